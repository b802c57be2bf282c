"""This machine's NVIDIA GPUs as `nvidia-smi` reports them: the one place the package asks
(the fingerprint's hardware, the memory check's GPU model, preflight's GPU count, gpubench's
memory in use, the host sampler's clocks and power)."""

from __future__ import annotations

import os
import shutil
import subprocess


def _query(fields: str, *, check: bool = False) -> list[list[str]]:
    """One row per GPU of `nvidia-smi --query-gpu=FIELDS` (CSV, no header, no units); [] where
    nvidia-smi is missing or fails, unless `check` (then it raises)."""
    if not shutil.which("nvidia-smi"):
        if check:
            raise FileNotFoundError("nvidia-smi is not on PATH: no NVIDIA GPU to ask")
        return []
    done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=60, check=check)
    if done.returncode:
        return []
    return [[c.strip() for c in line.split(",")] for line in done.stdout.splitlines()
            if line.strip()]


def names() -> list[str]:
    """Every GPU's model name ("NVIDIA H100 80GB HBM3"), whatever CUDA_VISIBLE_DEVICES says."""
    return [row[0] for row in _query("name")]


def visible_count() -> int:
    """The GPUs a process started here would see: nvidia-smi's count, capped by
    CUDA_VISIBLE_DEVICES (set and empty: none)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd == "":
        return 0
    n = len(names())
    return min(n, len(cvd.split(","))) if cvd else n


def memory_gib(index: int = 0) -> tuple[float, float]:
    """(total, used) GiB of GPU `index` (raises where nvidia-smi is missing or fails)."""
    row = _query("memory.total,memory.used", check=True)[index]
    return float(row[0]) / 1024, float(row[1]) / 1024


CLOCK_FIELDS = ("sm_mhz", "power_w", "temp_c")


def clocks(index: int = 0) -> dict | None:
    """GPU `index`'s SM clock (MHz), power draw (W) and temperature (°C) now, and the active
    clock-event reasons (a bit mask: power cap, thermal, …; `nvidia-smi --help-query-gpu`)
    where the driver names them; None where nvidia-smi is missing or fails."""
    base = "clocks.sm,power.draw,temperature.gpu"
    rows = _query(base + ",clocks_event_reasons.active") or _query(base)
    if len(rows) <= index:
        return None
    row = rows[index]
    try:
        out = {k: float(v) for k, v in zip(CLOCK_FIELDS, row)}
    except ValueError:  # "[N/A]" where a field is not supported
        return None
    if len(row) > 3 and row[3].startswith("0x"):  # not "[N/A]"
        out["reasons"] = row[3]
    return out
