"""The draft's aux-layer id convention as a setting of a run (issue 12).

An EAGLE-3 draft lists the target layers it reads (``eagle_aux_hidden_state_layer_ids``) in
one of two conventions: ``output`` (id L = the output of decoder layer L, 0-indexed: the
stream after L + 1 layers; SGLang, SpecForge, the published DeepSeek-V4-Flash EAGLE3.1
draft) or ``input`` (id L = the stream entering layer L, after L layers; vLLM's own reading).
The overlay's ``resolve_aux_convention`` decides which one a draft means and, for DeepSeek-V4
targets, maps the ids before capture. Here: a profile sets the convention for every point
(``aux_layer_convention``) or sweeps it (``grid.aux_layer_convention``); each point passes it
as ``$EAGLE3_AUX_LAYER_CONVENTION``, records the resolution in its metadata
(``aux_convention``) and its log; ``by_convention``/``findings``/``plot`` put the acceptance
of the conventions side by side and name the winner.

Other targets (e.g. the CPU profile's Llama): vLLM reads the ids as ``input`` ids whatever
the setting (vLLM 0.32 ``EagleModelMixin._maybe_add_hidden_state``: id L captures after L
layers) and the overlay maps nothing, so the setting has no effect there; the metadata says
so (``applied: false``) and ``findings`` names no winner.
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
        try:
            from speclab import fixtures
        except ImportError:  # the fixtures package needs torch: without it, none is read
            return None
        name = ref.split(":", 1)[1]
        if name in fixtures.FIXTURES:
            path = fixtures.fixture_dir(name) / "config.json"
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


# --------------------------------------------------------------------------- results
def per_point(points):
    """One row per ok speculative point with its resolved convention (``aux_convention`` of
    its metadata): point_id, convention, requested, source, applied, capture columns."""
    import pandas as pd

    cols = ["point_id", "convention", "requested", "source", "applied",
            "capture_after_layers", "effective_capture_after_layers"]
    if points is None or points.empty or "aux_convention.convention" not in points:
        return pd.DataFrame(columns=cols)
    ok = points[(points.status == "ok") & points["aux_convention.convention"].notna()]
    req = ok.get("point.aux_layer_convention", pd.Series(None, index=ok.index))
    return pd.DataFrame({
        "point_id": ok.point_id, "convention": ok["aux_convention.convention"],
        "requested": req, "source": ok["aux_convention.source"],
        "applied": ok["aux_convention.applied"].astype(bool),
        "capture_after_layers": ok["aux_convention.capture_after_layers"],
        "effective_capture_after_layers": ok["aux_convention.effective_capture_after_layers"],
    }).reset_index(drop=True)


MATCH = ["k", "kv_cache_dtype", "draft_kv_cache_dtype", "layout", "prompt_format", "repeat"]
"""Columns two points must share to be compared across conventions."""


def by_convention(points, records, n_boot: int = 1000):
    """Per-position acceptance per convention, one row per (point, position): the
    unconditional (u_*) and conditional (c_*) rates with 95% bootstrap CIs over prompts
    (``analysis.acceptance``), the point's resolved convention, whether it was applied, and
    its capture layers. Empty without points that resolved a convention."""
    import pandas as pd

    from speclab import analysis

    conv = per_point(points)
    if conv.empty or records.empty:
        return pd.DataFrame(columns=["point_id", *MATCH, "convention", "position"])
    acc = analysis.acceptance(records[records.point_id.isin(conv.point_id)], points=points,
                              n_boot=n_boot)
    long = analysis.per_position_long(acc)
    if long.empty:
        return pd.DataFrame(columns=["point_id", *MATCH, "convention", "position"])
    return long.merge(conv, on="point_id").sort_values(
        [c for c in MATCH if c in long] + ["convention", "position"], ignore_index=True)


def _higher(a, b) -> bool:
    """a's CI lies wholly above b's."""
    return bool(a.u_lo > b.u_hi)


def findings(table) -> dict:
    """Which convention the draft was trained with, from ``by_convention``: per group of
    points that differ only in convention, the one whose position-1 acceptance is higher
    with non-overlapping 95% CIs. ``winner``: that convention when every group agrees, else
    None; ``text``: one paragraph; ``groups``: per group the position-1 rates."""
    if table.empty or table.convention.nunique() < 2:
        return {"winner": None, "groups": [], "text": (
            "one aux-layer convention only: nothing to compare (sweep grid.aux_layer_"
            "convention: [output, input] to compare)")}
    first = table[table.position == 0]
    keys = [c for c in MATCH if c in first]
    groups, votes = [], set()
    for key, g in first.groupby(keys, sort=False, dropna=False):
        if g.convention.nunique() < 2:
            continue
        rows = {r.convention: r for r in g.itertuples()}
        best = [c for c, r in rows.items()
                if all(_higher(r, o) for c2, o in rows.items() if c2 != c)]
        win = best[0] if best else None
        votes.add(win)
        groups.append({**dict(zip(keys, key)), "winner": win, "applied": bool(g.applied.all()),
                       **{f"{c}_pos1": [r.unconditional, r.u_lo, r.u_hi]
                          for c, r in rows.items()}})
    if not groups:
        return {"winner": None, "groups": [], "text": "no two points differ only in the "
                "aux-layer convention: nothing to compare"}
    if not all(g["applied"] for g in groups):
        target = sorted(set(table.loc[~table.applied, "point_id"]))
        return {"winner": None, "groups": groups, "text": (
            "no winner: the aux-layer convention was not applied to this target (points "
            f"{', '.join(target)}: vLLM read the draft's ids as input-to-layer ids for every "
            "convention, see aux_convention.effect in the point metadata), so the points "
            "ran the same capture and any difference between them is run-to-run noise")}
    winner = votes.pop() if len(votes) == 1 else None
    detail = "; ".join(
        f"k={g['k']}: " + ", ".join(f"{c} {v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"
                                     for c, v in ((c, g[f'{c}_pos1']) for c in CONVENTIONS
                                                  if f'{c}_pos1' in g))
        for g in groups)
    text = (f"the draft was trained with the `{winner}` convention: its position-1 acceptance "
            f"is higher with non-overlapping 95% CIs in every comparison ({detail})"
            if winner else
            f"no clear winner: position-1 acceptance CIs overlap or disagree ({detail})")
    return {"winner": winner, "groups": groups, "text": text}


def plot(table, title: str = ""):
    """Per-position unconditional acceptance per convention, side by side with 95% CIs; one
    panel per group of points that differ only in convention."""
    import matplotlib.pyplot as plt

    if table.empty:
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.text(0.5, 0.5, "no aux-layer convention results", ha="center", va="center")
        ax.set_axis_off()
        return fig
    keys = [c for c in MATCH if c in table and table[c].nunique(dropna=False) > 1] or ["k"]
    groups = list(table.groupby(keys, sort=False, dropna=False))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), sharey=True,
                             squeeze=False)
    convs = sorted(table.convention.unique(), key=lambda c: CONVENTIONS.index(c))
    width = 0.8 / len(convs)
    for ax, (key, g) in zip(axes[0], groups):
        for i, conv in enumerate(convs):
            s = g[g.convention == conv].sort_values("position")
            x = s.position + 1 + (i - (len(convs) - 1) / 2) * width
            applied = "" if s.applied.all() else " (not applied)"
            ax.bar(x, s.unconditional, width, yerr=[s.unconditional - s.u_lo,
                                                    s.u_hi - s.unconditional],
                   capsize=3, label=f"{conv}{applied}")
        name = ", ".join(f"{c}={v}" for c, v in zip(keys, key if isinstance(key, tuple)
                                                      else (key,)))
        ax.set(xlabel="draft position", title=name, ylim=(0, 1.05),
               xticks=sorted(g.position.unique() + 1))
        ax.legend(fontsize=8, title="aux-layer convention", title_fontsize=8)
    axes[0][0].set_ylabel("acceptance A_i / D")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


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
