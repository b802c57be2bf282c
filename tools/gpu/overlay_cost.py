#!/usr/bin/env python3
"""What the overlay costs (device job).

1. Plain decoding (no draft) with the overlay active vs switched off
   (DSV4_EAGLE3_OVERLAY=off: vLLM's stock classes), alternating on/off/on/off engine runs of
   the tiny-dsv4-h200 profile's plain point with longer outputs; throughput from each run.
2. Aux capture per step: the extra work when aux layers are set is, per captured layer, one
   mHC post-mix (vLLM's own TileLang op) plus a mean over the hyper-connection streams.
   Timed with CUDA events at the tiny model's width and at V4-Flash's (4096), for several
   token counts.
Writes RUN_DIR/cost.json (and the sweep points under RUN_DIR/points)."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def engine_runs(run_dir: Path, rounds: int, max_tokens: int) -> list[dict]:
    """Alternate overlay on/off plain runs, each into its own run folder next to run_dir."""
    out = []
    for r in range(rounds):
        for mode in ("auto", "off"):
            run_id = f"{run_dir.name}-overlay-{mode}-r{r}"
            over = {"env": {"DSV4_EAGLE3_OVERLAY": mode}, "max_tokens": max_tokens}
            subprocess.run([sys.executable, "-m", "speclab", "sweep", "--profile",
                            "tiny-dsv4-h200", "--run-id", run_id, "--only", "k0_*",
                            "--override", json.dumps(over)], check=False)
            for meta in sorted((run_dir.parent / run_id / "points").glob("*.json")):
                m = json.loads(meta.read_text())
                if m.get("status") == "ok":
                    out.append({"run": run_id, "overlay": mode, "round": r,
                                "throughput_tok_s": m["throughput_tok_s"],
                                "generate_s": m["timings"]["generate_s"]})
    return out


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
    a = ap.parse_args()
    a.run_dir.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
    result["aux_capture"] = aux_capture_cost()
    runs = engine_runs(a.run_dir, a.rounds, a.max_tokens)
    result["plain_runs"] = runs
    on = [r["throughput_tok_s"] for r in runs if r["overlay"] == "auto"]
    off = [r["throughput_tok_s"] for r in runs if r["overlay"] == "off"]
    if on and off:
        result["plain_on_over_off"] = (sum(on) / len(on)) / (sum(off) / len(off))
    (a.run_dir / "cost.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "aux_capture"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
