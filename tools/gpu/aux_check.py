#!/usr/bin/env python3
"""Device job: are the aux hidden states vLLM hands the EAGLE-3 draft the configured layer's?

One in-process engine (DeepSeek-V4 target + EAGLE-3 draft; eager, or `--compiled`) serves the
prompts one at a time, so every row the drafter gets maps to a position of one sequence. A
wrapper on the proposer's `propose` (vLLM 0.22 and 0.26: `llm_base_proposer.py`, which
receives `target_token_ids`, `target_positions` and `target_hidden_states`, the aux states
concatenated) records every call: prefill and each decode/verify step. The transformers
reference (CPU; float32, plain and with its FP8-activation simulation) then runs each served
sequence (prompt + vLLM's output) and `speclab.auxcheck` compares every usable row with the
hc-mean stream after every number of layers and with stream 0: the configured layer (the
overlay's resolution of the draft config's ids) must be the closest at every position, with
the neighbours' distance ratio as the margin. Works with the overlay on 0.22 and on releases
with native DeepSeek-V4 EAGLE-3 (0.26, where the overlay only maps ids).

Writes RUN_DIR/aux_check_<tag>.json (summary, versions, command), .md (tables) and .npz (the
usable recorded rows, float16, to compare releases offline; ~25 KB a row at hidden 4096, so
keep prompts few: device results come back in files of at most 16 MiB). Exit status 0 iff the
configured layer is the closest everywhere under the headline reference (FP8 simulation)."""

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path


def runner_of(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def record_proposals(drafter, calls: list) -> None:
    """Wrap `drafter.propose` to append {positions, token_ids, aux} per call to `calls`."""
    sig = inspect.signature(type(drafter).propose)
    orig = drafter.propose

    def propose(*args, **kwargs):
        a = sig.bind(drafter, *args, **kwargs).arguments
        pos = a["target_positions"]
        pos = pos[0] if pos.dim() == 2 else pos  # M-RoPE layout: first row
        calls.append({"positions": pos.detach().cpu().numpy().copy(),
                      "token_ids": a["target_token_ids"].detach().cpu().numpy().copy(),
                      "aux": a["target_hidden_states"].detach().float().cpu().numpy()})
        return orig(*args, **kwargs)

    drafter.propose = propose


def overlay_aux():
    """The overlay's aux module: loaded by the .pth, else the repository's copy."""
    if "deepseek_v4_eagle3_aux" not in sys.modules:
        from speclab.layerrig import overlay_module

        return overlay_module()
    return sys.modules["deepseek_v4_eagle3_aux"]


def prompts_for(a, vocab: int) -> list[list[int]]:
    if a.prompt_file:
        from speclab import prompts

        return [list(p.prompt_token_ids) for p in prompts.load(a.prompt_file)][: a.prompts]
    from speclab.fixtures.dsv4_rigs import rig_prompt_token_ids

    return rig_prompt_token_ids(vocab, n=a.prompts, length=a.prompt_len, seed=a.seed,
                                max_tokens=a.max_tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--tag", required=True, help="output name: aux_check_<tag>.*")
    ap.add_argument("--target", default="tiny-dsv4")
    ap.add_argument("--draft", default="tiny-dsv4-eagle3")
    ap.add_argument("--prompt-file", help="token-id prompt set (default: random prompts)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="torch.compile + CUDA graphs")
    ap.add_argument("--threads", type=int, default=8, help="CPU threads of the reference")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process

    import numpy as np
    import torch
    from vllm import LLM, SamplingParams

    from speclab import auxcheck, fixtures
    from speclab.engine import gpu_share, versions
    from speclab.fixtures.dsv4_reference import DSV4Reference

    t0 = time.time()
    target, draft = fixtures.build(a.target), fixtures.build(a.draft)
    dcfg = json.loads((Path(draft) / "config.json").read_text())
    tcfg = json.loads((Path(target) / "config.json").read_text())
    n_layers = tcfg["num_hidden_layers"]
    plan = overlay_aux().resolve_aux_convention(dcfg, n_layers)  # this process's env
    capture = plan["capture_after_layers"]
    prompts = prompts_for(a, tcfg["vocab_size"])
    llm = LLM(**gpu_share(dict(  # lab.py --slots: this job's share of the GPU
        model=str(target), kv_cache_dtype="fp8", enforce_eager=not a.compiled,
        skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=4,
        gpu_memory_utilization=0.4, seed=0,
        speculative_config={"method": "eagle3", "model": str(draft),
                            "num_speculative_tokens": a.k})))
    runner = runner_of(llm)
    engine_layers = list(getattr(runner.get_model().model, "aux_hidden_state_layers", ()))
    calls: list = []
    record_proposals(runner.drafter, calls)
    served = []
    for ids in prompts:
        calls.clear()
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(max_tokens=a.max_tokens, temperature=0.0,
                                          ignore_eos=True), use_tqdm=False)[0]
        served.append({"prompt": list(ids), "output": list(out.outputs[0].token_ids),
                       "calls": list(calls)})
    engine_s = time.time() - t0

    ref = DSV4Reference(target, dtype=torch.float32, threads=a.threads)
    results = auxcheck.analyse(served, ref, capture, a.tag)

    a.run_dir.mkdir(parents=True, exist_ok=True)
    base = a.run_dir / f"aux_check_{a.tag}"
    np.savez_compressed(base.with_suffix(".npz"), **auxcheck.rows_npz(served))
    overlay = sys.modules.get("deepseek_v4_eagle3_aux")
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
        "versions": versions(), "target": Path(target).name, "draft": Path(draft).name,
        "enforce_eager": not a.compiled, "k": a.k, "resolution": plan,
        "engine_aux_hidden_state_layers": engine_layers,
        "overlay": overlay.report() if overlay and hasattr(overlay, "report") else None,
        "prompts": prompts, "outputs": [s["output"] for s in served],
        "drafter_calls": [len(s["calls"]) for s in served],
        "engine_s": round(engine_s, 1), "wall_s": round(time.time() - t0, 1),
        "headline": "fp8-sim", "verdict": results["fp8-sim"]["verdict"],
        "references": {m: {k: r[k] for k in ("verdict", "summary")} for m, r in
                       results.items()}}
    base.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=str))
    base.with_suffix(".md").write_text("\n".join(r["table"] for r in results.values()))
    print(results["fp8-sim"]["table"])
    print(json.dumps({"tag": a.tag, "capture_after_layers": capture, "engine": engine_layers,
                      "verdict": summary["verdict"]}))
    return 0 if summary["verdict"] else 1


if __name__ == "__main__":
    sys.exit(main())
