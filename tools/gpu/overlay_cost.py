#!/usr/bin/env python3
"""What the overlay costs (device job).

1. Plain decoding (no draft) with the overlay active vs switched off
   (DSV4_EAGLE3_OVERLAY=off: vLLM's stock classes), alternating on/off/on/off engine runs of
   the tiny-dsv4-h200 profile's plain point with longer outputs; throughput from each run.
2. Aux capture per step: the extra work when aux layers are set is, per captured layer, one
   mHC post-mix (vLLM's own TileLang op) plus a mean over the hyper-connection streams.
   Timed with CUDA events at the tiny model's width and at V4-Flash's (4096), for several
   token counts.
Writes RUN_DIR/cost.json after each step (the runs go to RUN_DIR-overlay-<mode>-r<n>/), so a
call cut short keeps what it measured; --summarize rebuilds it from those folders (no GPU)."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def engine_runs(run_dir: Path, rounds: int, max_tokens: int, after_each) -> None:
    """Alternate overlay on/off plain runs, each into its own run folder next to run_dir
    (finished ones are kept: sweep resumes), calling after_each() after every run."""
    for r in range(rounds):
        for mode in ("auto", "off"):
            run_id = f"{run_dir.name}-overlay-{mode}-r{r}"
            over = {"env": {"DSV4_EAGLE3_OVERLAY": mode}, "max_tokens": max_tokens}
            subprocess.run([sys.executable, "-m", "speclab", "sweep", "--profile",
                            "tiny-dsv4-h200", "--run-id", run_id, "--only", "k0_*",
                            "--override", json.dumps(over)], check=False)
            after_each()


def plain_runs(run_dir: Path) -> list[dict]:
    """Every finished plain run in the `<run_dir>-overlay-*` folders: overlay mode (from the
    run's profile), throughput and the median decode step."""
    import numpy as np
    import pandas as pd

    out = []
    for run in sorted(run_dir.parent.glob(f"{run_dir.name}-overlay-*")):
        mode = json.loads((run / "profile.json").read_text())["env"].get(
            "DSV4_EAGLE3_OVERLAY", "auto")
        for meta in sorted((run / "points").glob("*.json")):
            m = json.loads(meta.read_text())
            if m.get("status") != "ok":
                continue
            steps = pd.read_parquet(meta.with_suffix(".parquet")).step_times
            dt = np.concatenate([np.diff(np.asarray(t)) for t in steps])
            out.append({"run": run.name, "overlay": mode, "started_at": m["started_at"],
                        "throughput_tok_s": m["throughput_tok_s"],
                        "generate_s": m["timings"]["generate_s"],
                        "median_step_ms": float(np.median(dt) * 1e3),
                        "p90_step_ms": float(np.percentile(dt, 90) * 1e3)})
    return out


def summarize(run_dir: Path, result: dict) -> dict:
    """result with plain_runs and on/off ratios (means over runs) from the run folders."""
    runs = plain_runs(run_dir)
    result = {**result, "plain_runs": runs}
    on = [r for r in runs if r["overlay"] == "auto"]
    off = [r for r in runs if r["overlay"] == "off"]
    for key in ("throughput_tok_s", "median_step_ms"):
        if on and off:
            mean_on = sum(r[key] for r in on) / len(on)
            mean_off = sum(r[key] for r in off) / len(off)
            result[f"{key}_on_over_off"] = mean_on / mean_off
    result["n_on"], result["n_off"] = len(on), len(off)
    return result


def aux_capture_cost(widths=(512, 4096), tokens=(1, 8, 64, 512, 4096), iters=200) -> list[dict]:
    import torch

    import vllm.model_executor.kernels.mhc  # noqa: F401  (registers the ops)

    post = torch.ops.vllm.mhc_post_tilelang
    rows = []
    for h in widths:
        for t in tokens:
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(t, 4, h, device="cuda", dtype=torch.bfloat16)
            pm = torch.rand(t, 4, 1, device="cuda", dtype=torch.float32)
            cm = torch.rand(t, 4, 4, device="cuda", dtype=torch.float32)
            for _ in range(10):
                post(x, res, pm, cm).mean(dim=1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(iters):
                post(x, res, pm, cm).mean(dim=1)
            end.record()
            torch.cuda.synchronize()
            rows.append({"hidden": h, "tokens": t,
                         "us_per_layer": start.elapsed_time(end) * 1000 / iters})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--summarize", action="store_true",
                    help="only rebuild cost.json from the run folders already there (no GPU)")
    a = ap.parse_args()
    a.run_dir.mkdir(parents=True, exist_ok=True)
    path = a.run_dir / "cost.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result.update({"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)})

    def write() -> None:
        nonlocal result
        result = summarize(a.run_dir, result)
        path.write_text(json.dumps(result, indent=1))

    if not a.summarize:
        if "aux_capture" not in result:  # kept from an earlier, interrupted call
            result["aux_capture"] = aux_capture_cost()
            write()
        engine_runs(a.run_dir, a.rounds, a.max_tokens, write)
    write()
    print(json.dumps({k: v for k, v in result.items() if k not in ("aux_capture", "plain_runs")},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
