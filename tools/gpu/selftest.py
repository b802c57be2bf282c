#!/usr/bin/env python3
"""Device-side check of the unpacked speclab GPU bundle (run after unpack.sh's eval).

  python3 tools/gpu/selftest.py [--no-serve] [--no-jit] [--json OUT]

Checks, each reported as ok/FAIL with the error, never stopping at the first:
  site      the bundle's sitecustomize ran: cutlass's .pth path is on sys.path,
            also in a multiprocessing *spawn* child (as vLLM's engine core)
  imports   cutlass, quack.compile_utils, tilelang, vllm and the modules of our
            code paths (api_server, cli, DeepSeek-V4 + its CuTe-DSL compressor,
            EAGLE-3, FlashMLA/FA3 extensions, the MoE ops), per vLLM release (RELEASES)
  serve     `vllm serve --help` (builds the whole CLI, imports every subcommand)
  jit       a CuTe-DSL kernel JIT-compiled and run on the GPU (the path the
            DeepSeek-V4 main KV compressor takes); checks c == a + b
Exit 0 when all selected checks pass.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback

IMPORTS = [
    "cutlass", "cutlass.cute", "quack.compile_utils", "tilelang",
    "vllm", "vllm.vllm_flash_attn", "vllm.entrypoints.llm",
    "vllm.v1.engine.core", "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.spec_decode.eagle", "vllm.model_executor.models.llama_eagle3",
    "vllm.models.deepseek_v4",
    "vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl",
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.v1.attention.backends.mla.flashmla_sparse",
]
SERVE_IMPORTS = [
    "vllm.entrypoints.cli.main", "vllm.entrypoints.openai.api_server",
    "mistral_common", "uvicorn", "prometheus_fastapi_instrumentator",
    "model_hosting_container_standards.sagemaker", "watchfiles",
]
# Per release (major.minor): its CUDA extensions, and the folder cutlass-dsl's .pth puts
# on sys.path.
RELEASES = {
    "0.22": {"extensions": ["vllm._C", "vllm._moe_C"], "cutlass_dir": "python_packages"},
    "0.26": {"extensions": ["vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"],
             "cutlass_dir": "dsl_packages"},
}


def release() -> dict:
    version = importlib.metadata.version("vllm")
    rel = RELEASES.get(".".join(version.split(".")[:2]))
    if rel is None:
        sys.exit(f"vLLM {version}: no bundle release in selftest.RELEASES {sorted(RELEASES)}")
    return {**rel, "version": version}


def cutlass_on_path(folder: str) -> bool:
    return any(p.endswith(os.path.join("nvidia_cutlass_dsl", folder)) for p in sys.path)


def _child(q, folder):
    q.put((cutlass_on_path(folder), os.environ.get("SPECLAB_SITE")))


def check_site(folder: str):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, folder))
    p.start()
    child = q.get(timeout=120)
    p.join()
    assert cutlass_on_path(folder), f"nvidia_cutlass_dsl/{folder} not on sys.path (sitecustomize?)"
    assert child[0], "spawn child: cutlass path missing"
    return f"SPECLAB_SITE={os.environ.get('SPECLAB_SITE')}; spawn child ok"


def check_serve():
    exe = os.path.join(os.environ.get("SPECLAB_SITE", ""), "bin", "vllm")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    r = subprocess.run(cmd + ["serve", "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return f"`vllm serve --help` printed {len(r.stdout.splitlines())} lines"


def check_jit():
    import cutlass
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    # CuTe DSL resolves the kernels' annotations in this module's globals
    globals().update(cutlass=cutlass, cute=cute)

    @cute.kernel
    def add_kernel(g_a: cute.Tensor, g_b: cute.Tensor, g_c: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        bdim, _, _ = cute.arch.block_dim()
        i = bidx * bdim + tidx
        g_c[i] = g_a[i] + g_b[i]

    @cute.jit
    def add(m_a: cute.Tensor, m_b: cute.Tensor, m_c: cute.Tensor):
        add_kernel(m_a, m_b, m_c).launch(grid=(8, 1, 1), block=(128, 1, 1))

    a = torch.randn(1024, device="cuda")
    b = torch.randn(1024, device="cuda")
    c = torch.zeros(1024, device="cuda")
    t = time.time()
    fn = cute.compile(add, from_dlpack(a), from_dlpack(b), from_dlpack(c))
    ct = time.time() - t
    fn(from_dlpack(a), from_dlpack(b), from_dlpack(c))
    torch.cuda.synchronize()
    assert torch.allclose(c, a + b), "wrong result"
    return f"cutlass {cutlass.__version__}: compiled in {ct:.1f}s, result ok"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--no-jit", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    results = {}

    def run(name, fn):
        t = time.time()
        try:
            msg, ok = fn(), True
        except BaseException as e:  # noqa: BLE001 - report everything
            msg, ok = "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:], False
        results[name] = {"ok": ok, "msg": msg, "s": round(time.time() - t, 1)}
        shown = msg if not ok or name in ("site", "serve", "jit") else ""
        print(f"{'ok  ' if ok else 'FAIL'} {name:70s} {time.time() - t:6.1f}s  {shown}", flush=True)

    rel = release()
    print(f"vLLM {rel['version']} bundle")
    run("site", lambda: check_site(rel["cutlass_dir"]))
    for m in IMPORTS + rel["extensions"] + ([] if a.no_serve else SERVE_IMPORTS):
        run(m, lambda m=m: (importlib.import_module(m), "")[1])
    if not a.no_serve:
        run("serve", check_serve)
    if not a.no_jit:
        run("jit", check_jit)
    bad = [k for k, v in results.items() if not v["ok"]]
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed")
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
