#!/usr/bin/env python3
"""Device job: are the aux hidden states vLLM hands the EAGLE-3 draft the right ones?

One in-process engine (tiny DeepSeek-V4 target + EAGLE-3 draft, overlay active, eager) serves
a few prompts one at a time. Forward hooks record every target decoder layer's outputs
(x, residual streams, post-mix, comb-mix) during the prompt's prefill, and a wrapper records
what the drafter receives (`combine_hidden_states` input: the aux states concatenated).
The independent computation: for each aux layer id L, vLLM's torch reference mHC post-mix of
layer L-1's outputs in float32 (the full residual stream after L layers), averaged over the
hyper-connection streams; it must equal the drafter's input slice within bf16 tolerance.
The same states from the transformers reference (CPU, float32, same weights) are compared
too (cosine and relative error: FP8 activations in vLLM make this looser than bf16).
Writes RUN_DIR/aux_check.json."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def runner_of(llm):
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--target", default="tiny-dsv4")
    ap.add_argument("--draft", default="tiny-dsv4-eagle3")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    a = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    from speclab import fixtures
    from speclab.fixtures import dsv4_rigs
    from speclab.fixtures.dsv4_reference import DSV4Reference

    target, draft = fixtures.build(a.target), fixtures.build(a.draft)
    dcfg = json.loads((Path(draft) / "config.json").read_text())
    aux_ids = list(dcfg["eagle_aux_hidden_state_layer_ids"])
    tcfg = json.loads((Path(target) / "config.json").read_text())
    hidden = tcfg["hidden_size"]
    prompts = dsv4_rigs.rig_prompt_token_ids(tcfg["vocab_size"], n=a.prompts, length=24, seed=1)
    llm = LLM(model=str(target), kv_cache_dtype="fp8", enforce_eager=True,
              skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=4,
              gpu_memory_utilization=0.4, seed=0,
              speculative_config={"method": "eagle3", "model": str(draft),
                                  "num_speculative_tokens": a.k})
    runner = runner_of(llm)
    layers = runner.model.model.layers
    seen: dict = {"layers": {}, "draft_in": None}

    def hook(i):
        def fn(_mod, _inp, out):
            if i not in seen["layers"]:
                seen["layers"][i] = [None if t is None else t.detach().float().cpu() for t in out]
        return fn

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    dmodel = runner.drafter.model
    orig = dmodel.combine_hidden_states

    def combine(h):
        if seen["draft_in"] is None:
            seen["draft_in"] = h.detach().float().cpu()
        return orig(h)

    dmodel.combine_hidden_states = combine
    ref = DSV4Reference(target, dtype=torch.float32, threads=8)
    results = []
    for n, ids in enumerate(prompts):
        seen["layers"].clear()
        seen["draft_in"] = None
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)[0]
        t = len(ids)
        got = seen["draft_in"][:t]
        ref_streams = ref.forward(list(ids), streams=True)["streams"]
        ref_aux = DSV4Reference.aux_from_streams(ref_streams, aux_ids)  # [T, n_aux, H]
        for j, lid in enumerate(aux_ids):
            x, res, post, comb = seen["layers"][lid - 1][:4]
            x, res = x[:t], None if res is None else res[:t]
            stream = x if res is None else mhc_post_torch(x, res, post[:t], comb[:t]).float()
            indep = stream.mean(dim=1)
            handed = got[:, j * hidden:(j + 1) * hidden]
            scale = indep.abs().max().item()
            err = (handed - indep).abs().max().item()
            r = ref_aux[:, j].float()
            cos = torch.nn.functional.cosine_similarity(handed, r, dim=-1)
            results.append({
                "prompt": n, "layer_id": lid, "tokens": t, "max_abs_err_vs_independent": err,
                "scale": scale, "within_bf16": err <= 2 ** -7 * max(scale, 1e-6) * 2,
                "hf_cosine_min": cos.min().item(), "hf_cosine_mean": cos.mean().item(),
                "hf_rel_err": ((handed - r).norm() / r.norm()).item(),
                "output": list(out.outputs[0].token_ids)})
    for h in handles:
        h.remove()
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv),
               "target": str(target), "draft": str(draft), "aux_layer_ids": aux_ids,
               "all_within_bf16": all(r["within_bf16"] for r in results), "checks": results}
    a.run_dir.mkdir(parents=True, exist_ok=True)
    (a.run_dir / "aux_check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("aux_layer_ids", "all_within_bf16")}),
          [(r["layer_id"], f"{r['max_abs_err_vs_independent']:.3g}/{r['scale']:.3g}",
            round(r["hf_cosine_min"], 4)) for r in results])
    return 0 if summary["all_within_bf16"] else 1


if __name__ == "__main__":
    sys.exit(main())
