#!/usr/bin/env python3
"""What the overlay costs, in one eager engine (device job; one call of ~2-4 minutes).

    python3 tools/gpu/overlay_cost.py --run-dir data/runs/h200-dsv4-cost-<stamp>
    python3 tools/gpu/overlay_cost.py --summarize RUN_DIR          # any machine
    python3 tools/gpu/overlay_cost.py --compare RUN_DIR RUN_DIR --out FILE.md

One in-process plain engine on the dial-dsv4 target (hidden 4096, block-FP8, fp8 KV cache,
enforce_eager). speclab.cost.StepTimer replaces DeepseekV4Model.forward with a timing wrapper
that alternates two variants per decode step (CUDA-synchronised), `--rounds` generate calls
per experiment (see speclab.cost for the design and its argument):
  unused    the overlay's forward, installed with no aux layers, vs vLLM's own forward
            (`_dsv4_overlay_original_forward`); vLLM 0.22 + overlay only
  aux-T4    3 aux layers captured vs none at 4 tokens per step (4 sequences: a k=3 verify
            step of 1 sequence); the overlay's forward on 0.22, vLLM's own on 0.26
  aux-T32   the same at 32 tokens per step (8 sequences at k=3)
Writes RUN_DIR/steps.parquet (every forward call), cost.json (versions, GPU, command, date,
settings, per-experiment ratio / extra ms with 95 % CI) and cost.md (short summary)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd

from speclab import cost


def summarize(run_dir: Path, meta: dict) -> dict:
    steps = pd.read_parquet(run_dir / "steps.parquet")
    result = {**meta, "rounds": cost.rounds(steps).to_dict("records"),
              "experiments": cost.summarize(steps)}
    (run_dir / "cost.json").write_text(json.dumps(result, indent=1, default=str))
    (run_dir / "cost.md").write_text(cost.markdown(result))
    return result


def model_class(llm):
    """DeepseekV4Model of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    found = {type(m) for m in runner.model.modules() if type(m).__name__ == "DeepseekV4Model"}
    if len(found) != 1:
        raise SystemExit(f"expected one DeepseekV4Model class in {type(runner.model)}, "
                         f"found {found}")
    return found.pop()


def measure(a: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model lives in this process
    import torch
    from vllm import LLM, SamplingParams

    from speclab import engine, fixtures
    from speclab.fixtures import dsv4_rigs

    target = fixtures.build(a.target)
    torch.cuda.empty_cache()  # a real-shape build runs on the GPU in this process
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    args = engine.gpu_share(dict(
        model=str(target), kv_cache_dtype="fp8", enforce_eager=True, skip_tokenizer_init=True,
        max_model_len=4096, max_num_seqs=32, max_num_batched_tokens=4096,
        gpu_memory_utilization=0.4, seed=0))
    t0 = time.time()
    llm = LLM(**args)
    startup = time.time() - t0
    cls = model_class(llm)
    current = cls.__dict__["forward"]
    stock = getattr(cls, "_dsv4_overlay_original_forward", None)
    variants = {"noaux": current, "aux": cost.with_aux(current, tuple(a.aux_layers))}
    experiments = [(f"aux-T{4 * s}", 4 * s) for s in (1, 8)]
    if stock is not None:  # the overlay patched this vLLM: its forward vs vLLM's own
        variants.update(overlay=current, stock=stock)
        experiments.insert(0, ("unused", 8))
    timer = cost.StepTimer(cls, variants, torch.cuda.synchronize)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True,
                        detokenize=False)
    with timer.installed():
        for exp, seqs in experiments:
            prompts = [{"prompt_token_ids": p} for p in dsv4_rigs.rig_prompt_token_ids(
                vocab, n=seqs, length=a.prompt_len, seed=seqs, max_tokens=a.max_tokens)]
            for r in (-2, -1, *range(a.rounds)):  # two untimed rounds: JIT for both variants
                timer.start(exp, round_=r, seqs=seqs)
                llm.generate(prompts, sp, use_tqdm=False)
            print(f"{exp}: {a.rounds} rounds done ({time.time() - t0:.0f} s)", flush=True)
    steps = pd.DataFrame(timer.records)
    steps = steps[steps["round"] >= 0]
    a.run_dir.mkdir(parents=True, exist_ok=True)
    steps.to_parquet(a.run_dir / "steps.parquet")
    overlay = sys.modules.get("deepseek_v4_eagle3_aux")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
            "versions": engine.versions(), "engine_args": args, "startup_s": round(startup, 1),
            "overlay": overlay.report() if overlay and stock is not None else None,
            "settings": {"rounds": a.rounds, "max_tokens": a.max_tokens,
                         "prompt_len": a.prompt_len, "aux_layers": a.aux_layers,
                         "target": a.target, "experiments": dict(experiments)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path)
    ap.add_argument("--target", default="dial-dsv4")
    ap.add_argument("--rounds", type=int, default=10, help="generate calls per experiment")
    ap.add_argument("--max-tokens", type=int, default=64, help="decode steps per round")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--aux-layers", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 2, 3], help="captured after these layers (3, as EAGLE-3)")
    ap.add_argument("--summarize", action="store_true",
                    help="only rebuild cost.json/cost.md from RUN_DIR/steps.parquet (no GPU)")
    ap.add_argument("--compare", type=Path, nargs="+", help="cost run folders to tabulate")
    ap.add_argument("--out", type=Path, help="--compare: markdown file")
    a = ap.parse_args()
    if a.compare:
        results = [json.loads((d / "cost.json").read_text()) for d in a.compare]
        text = cost.compare_markdown(results)
        if a.out:
            a.out.write_text(text)
        print(text)
        return 0
    if a.run_dir is None:
        ap.error("--run-dir is needed")
    if a.rounds < 5:
        ap.error("--rounds: at least 5 (a 95 % interval over fewer is too wide to settle it)")
    if a.summarize:
        meta = json.loads((a.run_dir / "cost.json").read_text())
        meta = {k: v for k, v in meta.items() if k not in ("rounds", "experiments")}
    else:
        meta = measure(a)
    result = summarize(a.run_dir, meta)
    print((a.run_dir / "cost.md").read_text())
    print(json.dumps({e: {k: r[k] for k in ("ratio", "diff_ms")}
                      for e, r in result["experiments"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
