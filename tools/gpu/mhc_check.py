#!/usr/bin/env python3
"""Is vLLM 0.22's small-batch mHC path wrong at small hidden sizes? (GPU, seconds, no engine)

The first tiny DeepSeek-V4 config (hidden 512) decoded garbage whenever a step carried <= 16
tokens, where `mhc_fused_post_pre_tilelang` switches to its small-FMA path (`use_small_fma =
num_tokens <= 16`, kernels/mhc/tilelang.py). This runs that kernel and vLLM's own torch
reference (`mhc_post_torch` then `mhc_pre_torch`) on the same random inputs for several hidden
sizes and token counts on both sides of 16, and writes the largest errors as JSON:

    python3 tools/gpu/mhc_check.py --out data/runs/<run>/mhc_check.json

Result on the H200 (data/runs/h200-mhc-check-20261130): wrong below hidden 4096, see
`speclab.fixtures.dsv4_target.MHC_SMALL_BATCH_HIDDEN`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

HC = 4                                      # hc_mult of DeepSeek-V4
EPS = dict(rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6)
POST_MULT, SINKHORN = 2.0, 20


def inputs(tokens: int, hidden: int, gen: torch.Generator) -> dict:
    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    return {
        "x": randn(tokens, hidden).bfloat16(),
        "residual": randn(tokens, HC, hidden).bfloat16(),
        "post_layer_mix": torch.sigmoid(randn(tokens, HC, 1)) * POST_MULT,
        "comb_res_mix": torch.softmax(randn(tokens, HC, HC), dim=-1),
        "fn": randn(HC * 2 + HC * HC, HC * hidden, scale=hidden ** -0.5),
        "hc_scale": torch.rand(3, generator=gen, device="cuda") + 0.5,
        "hc_base": randn(HC * 2 + HC * HC, scale=0.1),
    }


def check(tokens: int, hidden: int, seed: int, norm: bool) -> dict:
    from vllm.model_executor.kernels.mhc.tilelang import mhc_fused_post_pre_tilelang
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch, mhc_pre_torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = inputs(tokens, hidden, gen)
    # the model fuses the next layer's RMSNorm into this kernel (norm_weight)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).bfloat16() if norm else None
    got = mhc_fused_post_pre_tilelang(
        a["x"], a["residual"], a["post_layer_mix"], a["comb_res_mix"], a["fn"], a["hc_scale"],
        a["hc_base"], **EPS, hc_post_mult_value=POST_MULT, sinkhorn_repeat=SINKHORN,
        norm_weight=w, norm_eps=1e-6)
    res = mhc_post_torch(a["x"], a["residual"], a["post_layer_mix"], a["comb_res_mix"])
    post, comb, layer_in = mhc_pre_torch(res, a["fn"], a["hc_scale"], a["hc_base"], **EPS,
                                         hc_post_mult_value=POST_MULT,
                                         sinkhorn_repeat=SINKHORN)
    if norm:
        f = layer_in.float()
        layer_in = f * torch.rsqrt(f.square().mean(-1, keepdim=True) + 1e-6) * w.float()
    out = {"tokens": tokens, "hidden": hidden, "norm": norm, "small_fma_path": tokens <= 16}
    for name, g, r in zip(("residual", "post_mix", "comb_mix", "layer_input"), got,
                          (res, post, comb, layer_in)):
        g, r = g.float().reshape(r.shape), r.float()
        err = (g - r).abs().max().item()
        out[name] = {"max_abs_err": err if math.isfinite(err) else str(err),
                     "scale": r.abs().max().item(), "nan": bool(torch.isnan(g).any())}
    # bf16 outputs: a few ulps of their scale; fp32 mixes (O(1), the kernels use TF32 or
    # split-k FMA): 1e-2 absolute. Broken paths are off by O(1) or NaN.
    out["ok"] = all(not out[n]["nan"] and isinstance(out[n]["max_abs_err"], float)
                    and out[n]["max_abs_err"] <= (0.02 * out[n]["scale"] + 1e-3
                                                  if n in ("residual", "layer_input") else 1e-2)
                    for n in ("residual", "post_mix", "comb_mix", "layer_input"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", default="512,1024,2048,4096")
    ap.add_argument("--tokens", default="1,2,4,7,8,12,16,17,24,64")
    a = ap.parse_args()
    import vllm

    rows = []
    head = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "vllm": vllm.__version__, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(),
            "command": f"tools/gpu/mhc_check.py --hidden {a.hidden} --tokens {a.tokens}"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for hidden in map(int, a.hidden.split(",")):
        for tokens in map(int, a.tokens.split(",")):
            for norm in (False, True):
                try:
                    rows.append(check(tokens, hidden, tokens * 7919 + hidden, norm))
                except Exception as e:  # a shape the kernel refuses is a finding too
                    rows.append({"tokens": tokens, "hidden": hidden, "norm": norm, "ok": False,
                                 "error": f"{type(e).__name__}: {e}"})
                print(json.dumps(rows[-1]), flush=True)
                # rewritten after every row: a call cut short keeps what was measured
                a.out.write_text(json.dumps({**head, "rows": rows}, indent=1))
    bad = [(r["hidden"], r["tokens"], r["norm"]) for r in rows if not r["ok"]]
    print(f"mhc check: {len(rows) - len(bad)}/{len(rows)} ok; failing (hidden, tokens, norm): "
          f"{bad}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
