#!/usr/bin/env python3
"""Device job: is plain DeepSeek-V4 decoding in vLLM trustworthy on our tiny checkpoint?

One in-process plain engine (no draft), greedy, top-k logprobs for prompt and output tokens:
  - finite: every returned logprob is finite;
  - rerun: the same batch generated twice gives identical tokens and logprobs;
  - batch: the same prompts one at a time give the same tokens (batch-composition drift);
  - reference: transformers' DeepseekV4 (CPU, float32, same dequantized weights) run over
    prompt + vLLM's continuation: per position, vLLM's top-1 equals the reference argmax?
    |logprob difference| on vLLM's top-k tokens (prefill positions from prompt_logprobs,
    decode positions from logprobs), and the reference's top-1/top-2 margin where they differ.
Writes RUN_DIR/sanity.json."""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def as_lists(outs):
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[{int(t): float(v.logprob) for t, v in pos.items()} for pos in o.outputs[0].logprobs]
           for o in outs]
    plps = [[None if pos is None else {int(t): float(v.logprob) for t, v in pos.items()}
             for pos in o.prompt_logprobs] for o in outs]
    return toks, lps, plps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--target", default="tiny-dsv4")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--topk", type=int, default=8)
    a = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    from speclab import engine, fixtures
    from speclab.fixtures import dsv4_rigs
    from speclab.fixtures.dsv4_reference import DSV4Reference

    target = fixtures.build(a.target)
    cfg = json.loads((Path(target) / "config.json").read_text())
    lengths = [7, 40, 150, 300, 700, 1500][: a.prompts]
    prompts = [dsv4_rigs.rig_prompt_token_ids(cfg["vocab_size"], n=1, length=n, seed=10 + i)[0]
               for i, n in enumerate(lengths)]
    llm = LLM(**engine.gpu_share(dict(  # lab.py --slots: this job's share of the GPU
        model=str(target), kv_cache_dtype="fp8", enforce_eager=True, skip_tokenizer_init=True,
        max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.4, seed=0)))
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0, logprobs=a.topk,
                        prompt_logprobs=a.topk, ignore_eos=True, detokenize=False)
    batch = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.time()
    toks1, lps1, plps1 = as_lists(llm.generate(batch, sp, use_tqdm=False))
    toks2, lps2, _ = as_lists(llm.generate(batch, sp, use_tqdm=False))
    single = [as_lists(llm.generate([b], sp, use_tqdm=False))[0][0] for b in batch]
    gen_s = time.time() - t0
    finite = all(math.isfinite(v) for seq in lps1 for pos in seq for v in pos.values())
    ref = DSV4Reference(target, dtype=torch.float32, threads=8)
    per_prompt = []
    for p, out, lp, plp in zip(prompts, toks1, lps1, plps1):
        seq = p + out
        logp = torch.log_softmax(ref.forward(seq)["logits"], dim=-1)  # row t predicts t+1
        top2 = torch.topk(logp, 2, dim=-1)
        margin = (top2.values[:, 0] - top2.values[:, 1]).tolist()
        argmax = top2.indices[:, 0].tolist()
        rows = []  # (phase, position predicted, vLLM logprobs dict, vLLM top-1)
        for t in range(1, len(p)):
            if plp[t] is not None:
                rows.append(("prefill", t, plp[t], max(plp[t], key=plp[t].get)))
        for j, d in enumerate(lp):
            rows.append(("decode", len(p) + j, d, out[j]))
        stats = {}
        for phase in ("prefill", "decode"):
            sel = [r for r in rows if r[0] == phase]
            diffs = [abs(v - logp[pos - 1, tok].item()) for _, pos, d, _ in sel
                     for tok, v in d.items()]
            agree = [top == argmax[pos - 1] for _, pos, _, top in sel]
            flips = [margin[pos - 1] for (_, pos, _, top), ok in zip(sel, agree) if not ok]
            stats[phase] = {
                "positions": len(sel), "top1_agreement": sum(agree) / max(len(agree), 1),
                "max_abs_logprob_diff": max(diffs, default=0.0),
                "median_abs_logprob_diff": sorted(diffs)[len(diffs) // 2] if diffs else 0.0,
                "ref_margin_at_disagreements": flips}
        per_prompt.append({"prompt_len": len(p), "output": out,
                           "distinct_output_ids": len(set(out)),
                           "zero_token_fraction": out.count(0) / len(out), **stats,
                           "ref_margin_median": sorted(margin)[len(margin) // 2]})
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
        "target": str(target), "finite": finite,
        "rerun_identical_tokens": toks1 == toks2, "rerun_identical_logprobs": lps1 == lps2,
        "one_by_one_identical_tokens": single == toks1,
        "generate_s": gen_s, "prompts": per_prompt,
    }
    a.run_dir.mkdir(parents=True, exist_ok=True)
    (a.run_dir / "sanity.json").write_text(json.dumps(result, indent=1))
    short = {k: v for k, v in result.items() if k != "prompts"}
    short["decode_top1_agreement"] = [round(p["decode"]["top1_agreement"], 3) for p in per_prompt]
    short["prefill_top1_agreement"] = [round(p["prefill"]["top1_agreement"], 3) for p in per_prompt]
    short["decode_max_abs_logprob_diff"] = [round(p["decode"]["max_abs_logprob_diff"], 3)
                                            for p in per_prompt]
    print(json.dumps(short, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
