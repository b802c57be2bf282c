#!/usr/bin/env python3
"""Device environment: `install --site DIR` puts tools/gpu/speclab_gpu_env.py and its .pth
into the bundle's site dir; `report --out FILE` writes what the machine and bundle are
(GPUs, driver, the host machine, versions, overlay status with a probe, compressor kernel in
use) as JSON."""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def install(site: Path) -> None:
    shutil.copy(HERE / "speclab_gpu_env.py", site / "speclab_gpu_env.py")
    (site / "speclab-gpu-env.pth").write_text("import speclab_gpu_env\n")


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {e}"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def machine() -> dict:
    """Which machine this is: two runs on the same GPU model differed by the host (2026-12-06,
    two H100s: the GPU waited 1.3-1.8 ms a step for one host at batch 1, ~0 for the other)."""
    cpu = next((line.split(":", 1)[1].strip() for line in
                (_read("/proc/cpuinfo") or "").splitlines() if line.startswith("model name")),
               platform.processor() or None)
    return {"hostname": platform.node(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "cpu": cpu, "cpus": os.cpu_count(),
            "gpu_uuid": _run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"])
            .splitlines()}


def report(out: Path) -> None:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from speclab import overlay

    vers = {}
    for dist in ("vllm", "torch", "transformers", "tilelang", "nvidia-cutlass-dsl",
                 "quack-kernels", "triton", "safetensors"):
        try:
            vers[dist] = version(dist)
        except PackageNotFoundError:
            vers[dist] = None
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader"]).splitlines(),
        "machine": machine(),
        "cuda": torch.version.cuda, "gpu_count": torch.cuda.device_count(),
        "python": sys.version.split()[0], "versions": vers,
        "compressor": ("triton (vLLM's compress_norm_rope_store_triton; CuTe DSL failed its "
                       "self-test)") if os.environ.get("DSV4_COMPRESSOR") == "triton"
        else "stock CuTe-DSL kernel",
        "bundle_sha256": _read(f"{Path(os.environ['SPECLAB_SITE']).parent}/.bundle_sha256")
        if "SPECLAB_SITE" in os.environ else None,
        "selftest": json.loads(_read(str(out.parent / "selftest.json")) or "null"),
        "overlay": overlay.status(probe=True),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=1, default=str))
    print(json.dumps({k: info[k] for k in ("nvidia_smi", "versions", "compressor")}, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["install", "report"])
    ap.add_argument("--site", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.action == "install":
        install(a.site)
    else:
        report(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
