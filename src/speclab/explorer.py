"""Explore finished sweeps without re-running anything: pick runs and a slice (k, method,
target and draft KV dtype, layout, prompt format, category, variant) and see per-position
acceptance, AL and throughput vs k, and greedy parity against plain decoding for that slice.

`explorer(...)` is the ipywidgets view for JupyterLab; `figure(...)` draws one slice as a
static matplotlib figure (what a headless papermill run shows). Both read result files only
(`store.load_results`)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import matplotlib.ticker
import pandas as pd

from speclab import analysis, metrics, parity, store
from speclab.profiles import Point

# Dimensions a slice fixes (besides k, which the per-position panel picks).
DIMS = ("method", "kv_cache_dtype", "draft_kv_cache_dtype", "layout", "prompt_format",
        "category", "variant")
ALL = "(all)"
GRID = "grid"


@dataclass(frozen=True)
class Slice:
    """One selection: runs, a value per dimension (ALL: category only), k for positions."""

    runs: tuple[str, ...]
    k: int | None = None
    values: dict = field(default_factory=dict)

    def title(self) -> str:
        vals = " · ".join(f"{d}={v}" for d, v in self.values.items() if v not in (None, ALL))
        return f"{', '.join(self.runs)} — k={self.k} · {vals}"


def variant(meta: dict) -> str:
    """What sets a point apart from a plain grid point: server mode and concurrency, request
    concurrency, aux-layer convention, environment or engine overrides, repeat index."""
    p = Point.model_validate(meta["point"])
    parts = [f"serve c{meta['concurrency']}"] if meta.get("mode") == "server" else []
    if p.concurrency is not None:
        parts.append(f"c{p.concurrency}")
    if p.aux_layer_convention:
        parts.append(f"aux-{p.aux_layer_convention}")
    parts += [f"{k}={v}" for k, v in sorted({**p.env, **p.engine}.items())]
    if p.repeat:
        parts.append(f"r{p.repeat}")
    return " ".join(parts) or GRID


def find_runs(root: str | Path) -> list[Path]:
    """Run folders under root that hold at least one finished point."""
    root = Path(root)
    return sorted(d for d in root.iterdir() if d.is_dir() and store.has_points(d)
                  ) if root.is_dir() else []


def load(run_dirs: Sequence[str | Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(points, records) of several runs, each row tagged with its run (folder name) and
    variant; plain-point rows get method and draft_kv_cache_dtype '-'."""
    pts, recs = [], []
    for d in map(Path, run_dirs):
        p, r = store.load_results(d)
        if p.empty:
            continue
        metas = {m["point_id"]: m for m in store.point_metas(d)}
        a = parity.recorded_analysis(d)  # notebook 03's classes for this run
        p = p.assign(run=d.name, variant=[variant(metas[i]) for i in p.point_id],
                     parity_near_tie=a.get("near_tie"), parity_noise_floor=a.get("noise_floor"))
        pts.append(p)
        if len(r):
            r = r.assign(run=d.name, variant=r.point_id.map(dict(zip(p.point_id, p.variant))))
            recs.append(r)
    points = pd.concat(pts, ignore_index=True) if pts else pd.DataFrame()
    records = pd.concat(recs, ignore_index=True) if recs else pd.DataFrame()
    if len(records):
        records = analysis.with_method(records)
        records["method"] = records.method.fillna("-")
        records["draft_kv_cache_dtype"] = records.draft_kv_cache_dtype.fillna("-")
        records["category"] = records.category.fillna("-")
    return points, records


def options(records: pd.DataFrame, runs: Sequence[str]) -> dict[str, list]:
    """Values each dimension takes in the given runs (category gets ALL first), and the
    speculative k values."""
    r = records[records.run.isin(runs)] if len(records) else records
    if r.empty:
        return {"k": [], **{d: [] for d in DIMS}}
    opts = {d: sorted(r[d].dropna().astype(str).unique()) for d in DIMS}
    opts["category"] = [ALL, *opts["category"]]
    for d in ("method", "draft_kv_cache_dtype"):  # plain rows ("-") belong to every value
        opts[d] = [v for v in opts[d] if v != "-"] or ["-"]
    if GRID in opts["variant"]:
        opts["variant"] = [GRID, *[v for v in opts["variant"] if v != GRID]]
    opts["k"] = sorted(int(k) for k in r.k.unique() if k > 0)
    return opts


def default_slice(records: pd.DataFrame, runs: Sequence[str]) -> Slice:
    """The configuration with the most speculative k values in the given runs (the profile's
    grid rather than a one-k side arm), all categories, its largest k."""
    r = records[records.run.isin(runs) & (records.k > 0)] if len(records) else records
    if r.empty:
        return Slice(tuple(runs), None, {d: None for d in DIMS})
    keys = [d for d in DIMS if d != "category"]
    r = r.assign(**{d: r[d].astype(str) for d in keys})
    by = r.groupby(keys).agg(ks=("k", "nunique"), n=("k", "size"), kmax=("k", "max"))
    best = by.sort_values(["ks", "n"], ascending=False).iloc[0]
    return Slice(tuple(runs), int(best.kmax), {**dict(zip(keys, best.name)), "category": ALL})


@dataclass
class Tables:
    acc: pd.DataFrame        # acceptance per (run, k) point of the slice, CIs included
    pos: pd.DataFrame        # per-position rates of the slice at its k
    speed: pd.DataFrame      # throughput per (run, k) incl. k=0, whole point (all categories)
    parity: pd.DataFrame     # per (run, k): greedy match with the plain point of the slice


def tables(points: pd.DataFrame, records: pd.DataFrame, sl: Slice, *,
           near_tie: float = 0.05, n_boot: int = 400) -> Tables:
    """The slice's tables. Plain (k=0) records match any method and draft KV dtype, records
    of a method without a draft any draft KV dtype."""
    v = sl.values
    r = records[records.run.isin(sl.runs)] if len(records) else records
    if len(r):
        for d in ("kv_cache_dtype", "layout", "prompt_format", "variant"):
            if v.get(d) is not None:
                r = r[r[d].astype(str) == str(v[d])]
        if v.get("category") not in (None, ALL):
            r = r[r.category == v["category"]]
        for d in ("method", "draft_kv_cache_dtype"):
            want = v.get(d)
            # "-": a plain row, or a method without a draft (no draft KV dtype)
            r = r[(r[d] == "-") | (r[d] == want)] if want not in (None, "-") else r
    empty = pd.DataFrame()
    if r.empty:
        return Tables(empty, empty, empty, empty)
    acc = pd.concat([analysis.acceptance(g, n_boot=n_boot, points=points[points.run == run])
                     .assign(run=run) for run, g in r.groupby("run", sort=False)],
                    ignore_index=True)
    pos = analysis.per_position_long(acc[acc.k == sl.k]) if len(acc) else empty
    ids = set(r.point_id)
    p = points[points.run.isin(sl.runs) & points.point_id.isin(ids)]
    speed = pd.concat([analysis.speed(g).assign(run=run) for run, g in p.groupby("run")],
                      ignore_index=True) if len(p) else empty
    rows = []
    for run, g in r.groupby("run", sort=False):
        plain = g[g.k == 0]
        # the classes notebook 03 used for this run (its near-tie threshold and noise floor);
        # without its record, near_tie and the plain passes' own self-flips
        pr = points[points.run == run] if len(points) else points
        nt, floor = (pr[c].dropna().iloc[0] if c in pr and pr[c].notna().any() else None
                     for c in ("parity_near_tie", "parity_noise_floor"))
        nt = near_tie if nt is None else float(nt)
        floor = parity.noise_floor(plain) if floor is None else float(floor)
        for k, cand in g[g.k > 0].groupby("k"):
            if plain.empty:
                continue
            s = parity.summarize(parity.compare(plain, cand, near_tie=nt, plain=plain,
                                                noise_floor=floor))
            rows.append({"run": run, "k": int(k), "near_tie_threshold": nt, "noise_floor": floor,
                         **s})
    return Tables(acc, pos, speed, pd.DataFrame(rows))


def figure(t: Tables, sl: Slice, draft_cost: float | None = None) -> plt.Figure:
    """Four panels for one slice: per-position acceptance at k (unconditional solid,
    conditional dashed), AL vs k, throughput vs k (k=0: no speculation), greedy match rate
    with plain decoding vs k (Wilson 95% CIs). One colour per run."""
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    ax_pos, ax_al, ax_tp, ax_par = axes
    colors = dict(zip(sl.runs, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    for run in sl.runs:
        c = colors[run]
        pos = t.pos[t.pos.run == run] if len(t.pos) else t.pos
        if len(pos):
            x = pos.position + 1
            ax_pos.errorbar(x, pos.unconditional, yerr=[pos.unconditional - pos.u_lo,
                            pos.u_hi - pos.unconditional], c=c, marker="o", capsize=3,
                            label=f"{run} unconditional")
            ax_pos.plot(x, pos.conditional, c=c, ls="--", marker="s", label=f"{run} conditional")
        acc = t.acc[t.acc.run == run].sort_values("k") if len(t.acc) else t.acc
        if len(acc):
            ax_al.errorbar(acc.k, acc.mean_acceptance_length,
                           yerr=[acc.mean_acceptance_length - acc.al_lo,
                                 acc.al_hi - acc.mean_acceptance_length],
                           c=c, marker="o", capsize=3, label=run)
        sp = t.speed[t.speed.run == run].sort_values("k") if len(t.speed) else t.speed
        if len(sp):
            ax_tp.plot(sp.k, sp.throughput_tok_s, c=c, marker="o", label=run)
            if draft_cost is not None and sp.baseline_tok_s.notna().any():
                b = sp[sp.k > 0]
                ax_tp.plot(b.k, [bt * metrics.ideal_speedup(al, k, draft_cost) for bt, al, k in
                                 zip(b.baseline_tok_s, b.mean_acceptance_length, b.k)],
                           c=c, ls=":", marker="x", label=f"{run} ideal (c={draft_cost:g})")
        par = t.parity[t.parity.run == run].sort_values("k") if len(t.parity) else t.parity
        if len(par):
            ax_par.errorbar(par.k, par.match_rate, yerr=[par.match_rate - par.match_lo,
                            par.match_hi - par.match_rate], c=c, marker="o", capsize=3,
                            label=run)
    kmax = int(t.acc.k.max()) if len(t.acc) else 1
    ax_al.plot(range(kmax + 1), [k + 1 for k in range(kmax + 1)], ls=":", c="grey",
               label="ceiling k+1")
    ax_pos.set(title=f"Per-position acceptance, k={sl.k}", xlabel="draft position",
               ylabel="acceptance", ylim=(0, 1.05), xlim=(0.5, (sl.k or 1) + 0.5))
    ax_al.set(title="Mean acceptance length", xlabel="k", ylabel="AL (bonus incl.)")
    ax_tp.set(title="Throughput (whole point)", xlabel="k (0: no speculation)",
              ylabel="output tokens / s")
    ax_par.set(title="Greedy match with plain", xlabel="k", ylabel="prompts identical",
               ylim=(-0.05, 1.05))
    for ax in axes:
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if ax.has_data():
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data for this slice", ha="center", va="center",
                    transform=ax.transAxes)
    fig.suptitle(sl.title(), fontsize=10)
    fig.tight_layout()
    return fig


def summary(t: Tables, sl: Slice) -> str:
    """One line per run: AL and speedup at the slice's k, parity with plain."""
    lines = []
    for run in sl.runs:
        acc = t.acc[(t.acc.run == run) & (t.acc.k == sl.k)] if len(t.acc) else t.acc
        sp = t.speed[(t.speed.run == run) & (t.speed.k == sl.k)] if len(t.speed) else t.speed
        par = t.parity[(t.parity.run == run) & (t.parity.k == sl.k)] if len(t.parity) else t.parity
        if acc.empty:
            lines.append(f"{run}: no speculative results at k={sl.k} for this slice")
            continue
        a = acc.iloc[0]
        text = (f"{run}: AL {a.mean_acceptance_length:.3f} "
                f"[{a.al_lo:.3f}, {a.al_hi:.3f}] over {a.n_requests} requests")
        if len(sp) and pd.notna(sp.speedup.iloc[0]):
            s = sp.speedup.iloc[0]
            text += f"; speedup {s:.2f}x over k=0 (whole point" + (
                "; above AL, the bound for a free draft: not a speed result)"
                if s > 1.05 * a.mean_acceptance_length else ")")
        if len(par):
            q = par.iloc[0]
            text += f"; {q.exact}/{q.n} outputs identical to plain"
            if q.exact < q.n:
                text += (f" ({q.near_tie} near-tie < {q.near_tie_threshold:g}, {q.within_noise} "
                         f"within the noise floor {q.noise_floor:.3g}, {q.substantive} "
                         f"SUBSTANTIVE, {q.unscored} unscored)")
        lines.append(text)
    return "\n".join(lines)


def png(fig: plt.Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def explorer(run_dirs: Sequence[str | Path], *, selected: Sequence[str] | None = None,
             draft_cost: float | None = None):
    """The interactive view: a run picker, one dropdown per dimension, the slice's summary
    and its figure (a PNG image widget), redrawn on every change."""
    import html

    import ipywidgets as w

    dirs = [Path(d) for d in run_dirs]
    points, records = load(dirs)
    names = [d.name for d in dirs if len(records) and (records.run == d.name).any()]
    if not names:
        return w.HTML("<b>no results</b> in " + html.escape(", ".join(map(str, dirs))))
    runs = w.SelectMultiple(options=names, value=tuple(selected or names[:1]),
                            description="runs", rows=min(len(names), 5))
    k = w.Dropdown(description="k")
    dims = {d: w.Dropdown(description=d.replace("_cache_dtype", "").replace("_", " "))
            for d in DIMS}
    title = w.HTML()
    text = w.HTML()
    image = w.Image(format="png")
    busy = {"on": False}

    def refresh_options(*_):
        """New runs picked: offer their values, keep each still-offered selection, else
        take the default slice's."""
        busy["on"] = True
        opts = options(records, runs.value)
        default = default_slice(records, runs.value)
        for d, dd in [("k", k), *dims.items()]:
            old = dd.value
            dd.options = opts[d]
            fallback = default.k if d == "k" else default.values[d]
            dd.value = old if old in opts[d] else (
                fallback if fallback in opts[d] else (opts[d][0] if opts[d] else None))
        busy["on"] = False
        redraw()

    def redraw(*_):
        if busy["on"]:
            return
        sl = Slice(tuple(runs.value), k.value, {d: dd.value for d, dd in dims.items()})
        t = tables(points, records, sl)
        # the title last: it tells a watcher (and the browser test) the redraw is complete
        image.value = png(figure(t, sl, draft_cost))
        text.value = "<pre class='speclab-summary'>" + html.escape(summary(t, sl)) + "</pre>"
        title.value = f"<b class='speclab-slice'>{html.escape(sl.title())}</b>"

    runs.observe(refresh_options, "value")
    for dd in [k, *dims.values()]:
        dd.observe(redraw, "value")
    refresh_options()
    controls = w.HBox([runs, w.VBox([k, *list(dims.values())[:3]]),
                       w.VBox(list(dims.values())[3:])])
    return w.VBox([controls, title, text, image])


def static(run_dirs: Sequence[str | Path], draft_cost: float | None = None
           ) -> tuple[plt.Figure, str]:
    """The default slice of the first run with results, as a figure and its summary (what a
    headless run shows in place of the widgets)."""
    points, records = load(run_dirs)
    runs = list(dict.fromkeys(records.run))[:1] if len(records) else []
    sl = default_slice(records, runs) if runs else Slice(())
    t = tables(points, records, sl, n_boot=1000)  # the report's CIs (speclab.summary.N_BOOT)
    return figure(t, sl, draft_cost), summary(t, sl)

