"""Device-only start-up hook (loaded by a .pth that tools/gpu/gpu_env.py installs into the
bundle's site dir, so it runs in every Python process there, vLLM's engine core included).

- Preloads libnvrtc with RTLD_GLOBAL: TileLang (DeepSeek-V4's mHC kernels) aborts with
  "libnvrtc symbols not found globally" otherwise (seen on the H200).
- DSV4_COMPRESSOR=triton: maps vLLM 0.22's CuTe-DSL main KV compressor onto vLLM's own Triton
  kernel for the same op (the ROCm path), for when CuTe DSL cannot JIT on this driver. The
  default keeps the stock kernel; the choice is recorded in every run's env.json.
Cheap and failure-proof: no torch or vLLM import here."""

import glob
import os
import sys
import types

CUTEDSL_MOD = "vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl"


def _preload_nvrtc() -> None:
    import ctypes

    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for path in sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so.*")), key=len):
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue


def _triton_compressor() -> None:
    mod = types.ModuleType(CUTEDSL_MOD)

    def compress_norm_rope_store_cutedsl(*args, **kwargs):
        from vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache import (
            compress_norm_rope_store_triton,
        )

        return compress_norm_rope_store_triton(*args, **kwargs)

    mod.compress_norm_rope_store_cutedsl = compress_norm_rope_store_cutedsl
    sys.modules[CUTEDSL_MOD] = mod


try:
    if os.environ.get("SPECLAB_NVRTC_PRELOAD", "1") == "1":
        _preload_nvrtc()
    if os.environ.get("DSV4_COMPRESSOR") == "triton":
        _triton_compressor()
except Exception as e:  # never break interpreter start-up
    print(f"speclab_gpu_env: {e!r}", file=sys.stderr)
