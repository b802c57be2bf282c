"""The draft's aux-layer id convention as a setting of a run (issue 12).

An EAGLE-3 draft lists the target layers it reads (``eagle_aux_hidden_state_layer_ids``) in
one of two conventions: ``output`` (id L = the output of decoder layer L, 0-indexed: the
stream after L + 1 layers; SGLang, SpecForge, the published DeepSeek-V4-Flash EAGLE3.1
draft) or ``input`` (id L = the stream entering layer L, after L layers; vLLM's own reading).
The overlay's ``resolve_aux_convention`` decides which one a draft means and, for DeepSeek-V4
targets, maps the ids before capture. Here: a profile sets the convention for every point
(``aux_layer_convention``) or sweeps it (``grid.aux_layer_convention``); each point passes it
as ``$EAGLE3_AUX_LAYER_CONVENTION``, records the resolution in its metadata
(``aux_convention``) and its log; ``speclab.convention_compare`` puts the acceptance of the
conventions side by side and names the winner.

Other targets (e.g. the CPU profile's Llama): vLLM reads the ids as ``input`` ids whatever
the setting (vLLM 0.32 ``EagleModelMixin._maybe_add_hidden_state``: id L captures after L
layers) and the overlay maps nothing, so the setting has no effect there; the metadata says
so (``applied: false``) and ``convention_compare.findings`` names no winner.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Literal

Convention = Literal["output", "input"]
CONVENTIONS = ("output", "input")
ENV = "EAGLE3_AUX_LAYER_CONVENTION"
MAPPED_MODEL_TYPES = ("deepseek_v4",)
"""Target model types whose aux ids the overlay maps (``DeepseekV4ForCausalLM``)."""
LOG_PREFIX = "speclab: aux layers "


def aux_module():
    """The overlay's ``deepseek_v4_eagle3_aux``: the copy this process loaded (the ``.pth``),
    else the shipped one (importing it installs nothing)."""
    from speclab import overlay

    return overlay.aux_module()


# --------------------------------------------------------------------------- settings
def profile_problem(profile) -> str | None:
    """A static inconsistency of the profile's convention settings, or None."""
    if profile.aux_layer_convention and profile.grid.aux_layer_convention:
        return ("aux_layer_convention is set both at the top level and in grid: keep one "
                "(grid sweeps it, the top level fixes it for every point)")
    if ENV in profile.env and (profile.aux_layer_convention or profile.grid.aux_layer_convention):
        return f"env.{ENV} and aux_layer_convention both set: keep aux_layer_convention"
    return None


def of_point(profile, point) -> str | None:
    """The convention a point runs with: its own, else the profile's (parity arms), else
    None (resolved per draft)."""
    return point.aux_layer_convention or profile.aux_layer_convention


def point_env(profile, point) -> dict[str, str]:
    """``{EAGLE3_AUX_LAYER_CONVENTION: value}`` for a point with a convention, else {}."""
    conv = of_point(profile, point)
    return {ENV: conv} if conv else {}


# --------------------------------------------------------------------------- resolution
def local_config(ref: str | None) -> dict | None:
    """A model's config.json when it is on this machine without building or downloading
    anything (a folder, a built fixture, the Hugging Face cache); else None."""
    if not ref:
        return None
    path = None
    if ref.startswith("fixture:"):
        name = ref.split(":", 1)[1]
        try:
            from speclab import fixtures

            if name in fixtures.FIXTURES:
                path = fixtures.fixture_dir(name) / "config.json"
        except ImportError:  # the fixture registry needs torch: without it, none is read
            return None
    elif Path(ref).expanduser().exists():
        path = Path(ref).expanduser() / "config.json"
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(ref, "config.json")
            path = Path(found) if isinstance(found, str) else None
        except (ImportError, ValueError):
            path = None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def _text(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def maps_ids(target_cfg: dict) -> bool:
    """Whether the overlay maps this target's aux ids (a DeepSeek-V4 target)."""
    return _text(target_cfg).get("model_type") in MAPPED_MODEL_TYPES


def overlay_loaded() -> bool:
    """Whether the overlay's import hooks are installed in this process (by its ``.pth``)
    and not switched off."""
    aux = sys.modules.get("deepseek_v4_eagle3_aux")
    return aux is not None and aux.base.installed() and aux.base.mode() != "off"


def resolution(draft_cfg: dict, target_cfg: dict, env=None, loaded: bool = True) -> dict:
    """The overlay's resolution (``speclab overlay plan``: convention, source, config_ids,
    capture_after_layers, why) for this draft and target, plus ``target``, ``applied``
    (whether the overlay maps the ids here), ``effective_capture_after_layers`` (what vLLM
    captures: the mapped layers if applied, else the ids read as ``input``) and ``effect``.
    Raises ValueError (before any model loads) for an unknown convention or, where applied,
    a capture outside the target's layers."""
    aux = aux_module()
    env = os.environ if env is None else env
    mapped = maps_ids(target_cfg)
    text = _text(target_cfg)
    target = (target_cfg.get("architectures") or [text.get("model_type")])[0]
    out = aux.resolve_aux_convention(draft_cfg, text.get("num_hidden_layers") if mapped else None,
                                     env=env)
    applied = mapped and loaded
    if applied:
        effect = f"the overlay maps the ids for this {target} target"
    elif mapped:
        effect = ("the overlay is not loaded here: vLLM reads the ids as input-to-layer ids "
                  "(speclab overlay install)")
    else:
        effect = (f"none: the overlay maps ids for DeepSeek-V4 targets only; vLLM reads this "
                  f"{target} target's ids as input-to-layer ids whatever the setting")
    return {**out, "target": target, "applied": applied,
            "effective_capture_after_layers": out["capture_after_layers"] if applied
            else out["config_ids"], "effect": effect}


def resolve(target_dir: str, draft_dir: str | None, env=None) -> dict | None:
    """``resolution`` for the model folders a worker loads (None without a draft), with
    this process's environment and overlay state."""
    if draft_dir is None:
        return None
    from speclab import overlay

    return resolution(overlay.read_json_config(Path(draft_dir)),
                      overlay.read_json_config(Path(target_dir)), env, overlay_loaded())


def log_line(resolved: dict | None) -> str:
    """The line a point's log carries: the resolution as one JSON object."""
    return LOG_PREFIX + json.dumps(resolved)


def env_problems(profile, env=None) -> list[str]:
    """Every convention the profile's points run with, resolved against the draft and
    target configs when both are on this machine (nothing is built or downloaded): one line
    per convention that cannot apply. The environment's own ``$EAGLE3_AUX_LAYER_CONVENTION``
    counts where the profile sets none."""
    env = dict(os.environ if env is None else env)
    env.update(profile.env)
    draft, target = local_config(profile.draft), local_config(profile.target)
    if draft is None or target is None:
        return []
    values = profile.grid.aux_layer_convention or [profile.aux_layer_convention]
    problems = []
    for conv in values:
        try:
            resolution(draft, target, {**env, ENV: conv} if conv else env)
        except ValueError as e:
            problems.append(f"aux_layer_convention={conv or 'resolved'}: {e}")
    return problems


# --------------------------------------------------------------------------- provenance
def run_summary(metas: list[dict]) -> list[dict]:
    """The distinct resolutions recorded by a run's points (`store.point_metas`, metadata
    ``aux_convention``), each with the points that used it."""
    seen: dict[str, dict] = {}
    for meta in metas:
        res = meta.get("aux_convention")
        if res:
            key = json.dumps(res, sort_keys=True)
            seen.setdefault(key, {**res, "points": []})["points"].append(meta["point_id"])
    return list(seen.values())


def footer_rows(summary: list[dict] | None) -> list[tuple[str, str]]:
    """Report footer rows: one per resolution a run used."""
    return [(f"aux-layer convention ({len(s['points'])} points)",
             (f"{s['convention']}: ids {s['config_ids']} -> capture after "
              f"{s['effective_capture_after_layers']} layers ({s['why']}; effect: "
              f"{s['effect']})"))
            for s in summary or []]
