"""DeepSeek-V4's mHC TileLang kernels compiled before any engine starts: vLLM 0.26's warm-up
skips them for this model, so each split-K variant compiles on first use (13-87 s on the
H200). The timing driver (`speclab.gpubench drive --warm N`) starts N of these processes.

    python -m speclab.mhcwarm CONFIG_JSON SIZES     (e.g. SIZES 64,128,192)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from speclab.benchworker import MAX_BATCHED
from speclab.fixtures import dsv4_shapes as SH

SMS = 132  # streaming multiprocessors of an H100 / H200


def mhc_splits(n: int, block_k_cap: int) -> int:
    """vLLM 0.26's split-K factor of an mHC pre kernel for `n` tokens (`kernels/mhc/
    tilelang_kernels.py`: `compute_num_split`, 64-token blocks); `block_k_cap` is its cap
    (K / 64 / 4: 64 for the hyper-connection GEMM over hc_mult x 4096, 16 for the first
    layer's broadcast one over 4096)."""
    return max(1, min(SMS // -(-n // 64), block_k_cap))


def mhc_warm_sizes(budget: int = MAX_BATCHED) -> list[int]:
    """One token count for each split-K variant either mHC pre kernel can take with at most
    `budget` tokens a step: each compiles on first use (vLLM 0.26's warm-up skips this
    model), 13-87 s each on the H200."""
    seen, out = set(), []
    for n in range(64, budget + 1, 64):
        key = (mhc_splits(n, 64), mhc_splits(n, 16))
        if key not in seen:
            seen.add(key)
            out.append(n)
    return out


def warm(config: dict, sizes: list[int]) -> int:
    """Compile DeepSeek-V4's mHC pre kernels (first-layer broadcast and later-layer) for
    `sizes` tokens with the model's constants, so the JIT caches hold them before any engine
    starts."""
    import torch
    from vllm.model_executor.kernels.mhc.tilelang import (
        mhc_pre_broadcast_tilelang,
        mhc_pre_tilelang,
    )

    hidden, hc, eps = config["hidden_size"], config["hc_mult"], config["rms_norm_eps"]
    consts = (eps, config["hc_eps"], config["hc_eps"], 2.0, config["hc_sinkhorn_iters"])
    mix = (2 + hc) * hc
    fn = torch.randn(mix, hc * hidden, device="cuda") * 1e-3
    scale, base = torch.ones(3, device="cuda"), torch.zeros(mix, device="cuda")
    norm = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    for n in sizes:
        t0 = time.time()
        x = torch.randn(n, hidden, dtype=torch.bfloat16, device="cuda")
        res = mhc_pre_broadcast_tilelang(x, fn, scale, base, *consts, norm_weight=norm,
                                         norm_eps=eps, fn_broadcast=fn.view(mix, hc, hidden)
                                         .sum(1))[0]
        mhc_pre_tilelang(res, fn, scale, base, *consts, norm_weight=norm, norm_eps=eps)
        torch.cuda.synchronize()
        print(f"warm {n} tokens: {time.time() - t0:.1f} s", flush=True)
    return 0


def start_warm(state: Path, procs: int = 8) -> list[subprocess.Popen]:
    """`procs` processes compiling the mHC variants (`mhc_warm_sizes`) side by side."""
    from speclab import launch

    cfg = json.dumps(SH.realshape_config(4))
    sizes = mhc_warm_sizes()
    (state / "logs").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(procs):
        part = ",".join(map(str, sizes[i::procs]))
        if part:
            with open(state / "logs" / f"warm{i}.log", "a") as fh:
                out.append(launch.start([sys.executable, "-m", "speclab.mhcwarm", cfg, part],
                                        fh, dict(os.environ)))
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.exit("usage: python -m speclab.mhcwarm CONFIG_JSON SIZES")
    return warm(json.loads(args[0]), [int(n) for n in args[1].split(",")])


if __name__ == "__main__":
    sys.exit(main())
