"""The aux-layer conventions compared on a run's results: per-position acceptance of points
that differ only in convention (`by_convention`), which convention the draft was trained
with (`findings`) and its figure (`plot`). The convention itself, and how a point resolves
it, is `speclab.convention`'s."""

from __future__ import annotations

import pandas as pd

from speclab import analysis
from speclab.convention import CONVENTIONS


def per_point(points):
    """One row per ok speculative point with its resolved convention (``aux_convention`` of
    its metadata): point_id, convention, requested, source, applied, capture columns."""
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
