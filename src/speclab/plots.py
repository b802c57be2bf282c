"""Figures from tables (analysis/parity outputs). Every function returns a matplotlib Figure,
or None (and prints why) when there is nothing to draw; `save` writes PNG and SVG with the
run's caption (run id, date, vLLM, hardware: `provenance.caption`) as a footer. Error bars
are 95% CIs, each figure's footer says which and over how many requests/prompts; series
that coincide are drawn with offsets and distinct markers so none hides another."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd

from speclab import metrics, store

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")


def save(fig, out_dir: str | Path, name: str, caption: str | None = None,
         close: bool = False) -> None:
    """Write `name.png` and `name.svg` into out_dir with `caption` as the last footer line
    (nothing for a figure that was not drawn: None); `close` then closes the figure (scripts;
    a notebook keeps it open to show it). Returns nothing, so a notebook cell that ends with it
    shows no output."""
    if fig is None:
        return
    if caption:
        _footer(fig, caption)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.{ext}" for ext in ("png", "svg")]
    with matplotlib.rc_context({"svg.hashsalt": name}):  # the same figure, the same bytes
        for p in paths:
            buf = io.BytesIO()
            fig.savefig(buf, format=p.suffix[1:], dpi=130 if p.suffix == ".png" else None,
                        bbox_inches="tight", metadata={"Date": None} if p.suffix == ".svg"
                        else None)
            store.atomic_write(p, buf.getvalue())
    if close:
        plt.close(fig)


def _footer(fig, text: str) -> None:
    """Append a line to the figure's footer (small, grey, under the axes)."""
    prev = getattr(fig, "_speclab_footer", None)
    if prev is not None:
        prev.set_text(prev.get_text() + "\n" + text)
        return
    fig._speclab_footer = fig.text(0.01, -0.01, text, ha="left", va="top", fontsize=8,
                                   color="dimgrey", transform=fig.transFigure)


def _no_results(title: str, why: str = "no results (see the failed points above)") -> None:
    print(f"{title}: figure not drawn: {why}")


def _offsets(n: int, width: float = 0.12) -> list[float]:
    """x offsets that keep n series at the same x apart."""
    return [0.0] if n <= 1 else list(np.linspace(-width, width, n))


def short_labels(point_ids) -> dict[str, str]:
    """Point id → the id parts that tell it apart from the others (k always kept):
    k1_kv-fp8_dkv-auto_tp1_raw, k1_kv-fp8_dkv-fp8_tp1_raw → "k1 dkv-auto", "k1 dkv-fp8"."""
    ids = list(dict.fromkeys(point_ids))
    parts = {p: p.split("_") for p in ids}
    common = set.intersection(*(set(v) for v in parts.values())) if len(ids) > 1 else set()
    return {p: " ".join(x for i, x in enumerate(v) if i == 0 or x not in common)
            for p, v in parts.items()}


def _n_text(n) -> str:
    n = pd.Series(n).dropna().astype(int).unique()
    return "–" if not len(n) else str(n[0]) if len(n) == 1 else f"{n.min()}–{n.max()}"

def _series(df: pd.DataFrame, skip: tuple[str, ...] = ()) -> list[tuple[str, pd.DataFrame]]:
    keys = [c for c in ("method", "layout", "kv_cache_dtype", "draft_kv_cache_dtype",
                        "prompt_format", "concurrency")
            if c not in skip and c in df and df[c].nunique(dropna=False) > 1]
    if not keys:
        return [("", df)]
    return [(" ".join(f"{_SERIES_NAMES[c]}{v}" for c, v in
                      zip(keys, k if isinstance(k, tuple) else (k,))), g)
            for k, g in df.groupby(keys, dropna=False, sort=True)]


_SERIES_NAMES = {"method": "", "layout": "", "kv_cache_dtype": "KV ",
                 "draft_kv_cache_dtype": "draft KV ", "prompt_format": "", "concurrency": "c"}


def al_and_speed_vs_k(acc: pd.DataFrame, speed: pd.DataFrame, draft_cost: float,
                      title: str = "") -> plt.Figure:
    """Left: mean acceptance length vs k with 95% CIs and the k+1 ceiling. Right: throughput
    vs k against the no-speculation baseline (k=0, dashed) and the ideal bound
    baseline * AL / (1 + k*c) for a draft forward costing c target forwards (dotted)."""
    sp = speed.dropna(subset=["throughput_tok_s"]) if len(speed) else speed
    has_acc = len(acc) > 0 and acc.mean_acceptance_length.notna().any()
    if not has_acc:  # plain-only run: nothing varies with k (throughputs are in the table)
        return _no_results(title, "no speculative point with results (plain-only run)")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    series = _series(acc.sort_values("k"))
    for i, ((label, g), dx) in enumerate(zip(series, _offsets(len(series)))):
        g = g.groupby("k", as_index=False).mean(numeric_only=True)
        ax1.errorbar(g.k + dx, g.mean_acceptance_length,
                     yerr=[g.mean_acceptance_length - g.al_lo,
                           g.al_hi - g.mean_acceptance_length],
                     marker=MARKERS[i % len(MARKERS)], ls=LINESTYLES[i % len(LINESTYLES)],
                     capsize=3, label=label or "AL")
    kmax = int(acc.k.max())
    ax1.plot(range(kmax + 1), [k + 1 for k in range(kmax + 1)], ls=":", c="grey",
             label="ceiling k+1")
    ax1.set(xlabel="num_speculative_tokens k", ylabel="mean acceptance length (tokens)",
            title="Acceptance length (bonus token incl.)")
    ax1.legend(fontsize=8)
    _footer(fig, "AL error bars: 95% percentile bootstrap CI over requests (N = "
            f"{_n_text(acc.get('n_requests'))} per point); throughput: mean over the timing "
            "rounds, error bars 95% t-interval (none with one round)")
    plain = sp[sp.k == 0] if len(sp) else sp
    spec = sp[sp.k > 0] if len(sp) else sp
    series = _series(spec.sort_values("k")) if len(spec) else []
    for i, ((label, g), dx) in enumerate(zip(series, _offsets(len(series)))):
        g = g.groupby("k", as_index=False).mean(numeric_only=True)
        b = float(g.baseline_tok_s.dropna().mean()) if g.baseline_tok_s.notna().any() else np.nan
        line = ax2.plot([0 + dx, *(g.k + dx)], [b, *g.throughput_tok_s],
                        marker=MARKERS[i % len(MARKERS)], ls=LINESTYLES[i % len(LINESTYLES)],
                        label=f"measured {label}".strip())[0]
        if "tput_lo" in g and g.tput_lo.notna().any():
            ax2.errorbar(g.k + dx, g.throughput_tok_s, fmt="none", capsize=3,
                         ecolor=line.get_color(), yerr=[g.throughput_tok_s - g.tput_lo,
                                                        g.tput_hi - g.throughput_tok_s])
        bound = [b * metrics.ideal_speedup(al, k, draft_cost)
                 for al, k in zip(g.mean_acceptance_length, g.k)]
        ax2.plot(g.k, bound, ls=":", marker="x", c=line.get_color(),
                 label=f"ideal AL/(1+k·{draft_cost:g}) {label}".strip())
    for label, g in _series(plain):
        ax2.axhline(float(g.throughput_tok_s.mean()), ls="--", c="grey", lw=1,
                    label=f"no-spec baseline {label}".strip())
    ax2.set(xlabel="num_speculative_tokens k", ylabel="output tokens / s", title="Throughput")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def methods_comparison(table: pd.DataFrame, title: str = "") -> plt.Figure:
    """The run's methods side by side (`analysis.methods_table`), one line per method (and
    concurrency level): AL (over steps that carried a draft) and tokens per decode step (every
    step; dotted, open markers: lower where the drafter skips steps) vs k, unconditional
    per-position acceptance at each method's largest k, speedup over the shared plain point
    vs k; 95% CIs throughout."""
    t = table.dropna(subset=["mean_acceptance_length"]) if len(table) else table
    if t.empty:
        return _no_results(title, "no speculative point with results")
    fig, (ax_al, ax_pos, ax_sp) = plt.subplots(1, 3, figsize=(15, 4))
    groups = list(t.groupby(["method", "concurrency"], dropna=False, sort=True))
    many_c = t.concurrency.nunique(dropna=False) > 1
    for i, (((method, conc), g), dx) in enumerate(zip(groups, _offsets(len(groups)))):
        g = g.groupby("k", as_index=False).first()  # one configuration per k
        label = f"{method} c{conc}" if many_c and pd.notna(conc) else str(method)
        style = dict(marker=MARKERS[i % len(MARKERS)], ls=LINESTYLES[i % len(LINESTYLES)],
                     capsize=3, label=label)
        line = ax_al.errorbar(g.k + dx, g.mean_acceptance_length,
                              yerr=[g.mean_acceptance_length - g.al_lo,
                                    g.al_hi - g.mean_acceptance_length], **style)
        if "tokens_per_step" in g and g.tokens_per_step.notna().any():
            ax_al.errorbar(g.k + dx, g.tokens_per_step, yerr=[g.tokens_per_step - g.tps_lo,
                                                              g.tps_hi - g.tokens_per_step],
                           **{**style, "ls": ":", "mfc": "none", "color": line[0].get_color(),
                              "label": f"{label}: tokens per decode step"})
        top = g.loc[g.k.idxmax()]
        pos = np.arange(1, int(top.k) + 1)
        pp, lo, hi = (np.asarray(top[c], dtype=float) for c in ("per_position", "pp_lo", "pp_hi"))
        ax_pos.errorbar(pos + dx, pp, yerr=[pp - lo, hi - pp], **{**style,
                        "label": f"{label} k={int(top.k)}"})
        sp = g.dropna(subset=["speedup"])
        if len(sp):
            err = np.vstack([sp.speedup - sp.speedup_lo, sp.speedup_hi - sp.speedup])
            ax_sp.errorbar(sp.k + dx, sp.speedup, yerr=np.nan_to_num(err), **style)
    kmax = int(t.k.max())
    ax_al.plot(range(kmax + 1), [k + 1 for k in range(kmax + 1)], ls=":", c="grey",
               label="ceiling k+1")
    ax_al.set(xlabel="num_speculative_tokens k", ylabel="tokens per verify step",
              title="AL (drafted steps) and tokens per decode step (all)")
    ax_pos.set(xlabel="draft position", ylabel="unconditional acceptance A_i / D",
               ylim=(0, 1.05), title="Per-position acceptance")
    ax_sp.axhline(1, color="grey", lw=0.8, ls="--")
    ax_sp.set(xlabel="num_speculative_tokens k", ylabel="speedup over plain (k=0)",
              title="Speedup per method")
    for ax in (ax_al, ax_pos, ax_sp):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    _footer(fig, "AL and per-position: 95% percentile bootstrap CI over requests (N = "
            f"{_n_text(t.get('n_requests'))} per point); speedup: geometric mean over timing "
            f"rounds ({_n_text(t.get('n_rounds'))}) against the plain point, 95% t-interval")
    return fig


def per_position(pos: pd.DataFrame, title: str = "") -> plt.Figure:
    """Per-position acceptance with 95% CIs: unconditional (vLLM's, P(positions 0..i all
    accepted)) and conditional (P(i accepted | i-1 accepted), the EAGLE papers' n-alpha)."""
    if pos.empty:
        return _no_results(title)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    labels = short_labels(pos.point_id)
    for (col, lo, hi, name), ax in zip(
            [("unconditional", "u_lo", "u_hi", "unconditional A_i / D"),
             ("conditional", "c_lo", "c_hi", "conditional A_i / A_(i-1)")], axes):
        groups = list(pos.groupby("point_id", sort=False))
        for i, ((pid, g), dx) in enumerate(zip(groups, _offsets(len(groups)))):
            g = g.sort_values("position")
            ax.errorbar(g.position + 1 + dx, g[col], yerr=[g[col] - g[lo], g[hi] - g[col]],
                        marker=MARKERS[i % len(MARKERS)], ls=LINESTYLES[i % len(LINESTYLES)],
                        capsize=3, label=labels[pid])
        ax.set(xlabel="draft position", ylabel="acceptance rate", title=name, ylim=(0, 1.05))
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    _footer(fig, "error bars: 95% percentile bootstrap CI over requests (N = "
            f"{_n_text(pos.get('n_requests'))} per point)")
    return fig


def acceptance_histogram(hist: pd.DataFrame, title: str = "") -> plt.Figure:
    """Fraction of verify steps that emitted 1..k+1 tokens, per spec point."""
    if hist.empty:
        return _no_results(title)
    pids = list(dict.fromkeys(hist.point_id))
    labels = short_labels(pids)
    fig, ax = plt.subplots(figsize=(6 + 0.5 * len(pids), 4))
    width = 0.8 / max(len(pids), 1)
    for i, pid in enumerate(pids):
        g = hist[hist.point_id == pid]
        ax.bar(g.length + (i - (len(pids) - 1) / 2) * width, g.fraction, width,
               label=f"{labels[pid]} ({int(g.steps.sum())} steps)")
    ax.set(xlabel="tokens emitted per verify step (bonus incl.)", ylabel="fraction of steps",
           title=title or "Acceptance-length histogram")
    ax.set_xticks(range(1, int(hist.length.max()) + 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def by_category(acc: pd.DataFrame, title: str = "") -> plt.Figure:
    """Mean acceptance length per prompt category (and prompt format) with 95% CIs."""
    fig, ax = plt.subplots(figsize=(8, 4))
    cats = sorted(acc.category.unique())
    fmts = sorted(acc.prompt_format.unique())
    width = 0.8 / len(fmts)
    for i, fmt in enumerate(fmts):
        g = acc[acc.prompt_format == fmt].set_index("category").reindex(cats)
        x = np.arange(len(cats)) + (i - (len(fmts) - 1) / 2) * width
        ax.bar(x, g.mean_acceptance_length, width, label=fmt,
               yerr=[g.mean_acceptance_length - g.al_lo, g.al_hi - g.mean_acceptance_length],
               capsize=3)
    ax.set_xticks(np.arange(len(cats)), cats)
    ax.set(ylabel="mean acceptance length (tokens)",
           title=title or "Acceptance by prompt category")
    ax.legend(title="prompt format", fontsize=8)
    fig.tight_layout()
    _footer(fig, "error bars: 95% percentile bootstrap CI over the category's requests (N = "
            f"{_n_text(acc.get('n_requests'))})")
    return fig


_KIND_COLORS = {"near-tie": "tab:orange", "within-noise": "tab:olive",
                "substantive": "tab:red", "unscored": "tab:gray"}


def parity_overview(summary: pd.DataFrame, cmp: pd.DataFrame, near_tie: float,
                    title: str = "") -> plt.Figure:
    """Match rate per arm with 95% CIs; first-divergence positions; margin at divergence
    against the near-tie threshold."""
    ok = summary[summary.status == "ok"] if len(summary) else summary
    if ok.empty:
        return _no_results(title)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    y = np.arange(len(ok))
    ax1.errorbar(ok.match_rate, y, xerr=[ok.match_rate - ok.match_lo, ok.match_hi - ok.match_rate],
                 fmt="o", capsize=3)
    ax1.set_yticks(y, ok.arm)
    ax1.set(xlim=(-0.02, 1.02), xlabel="fraction of prompts identical", title="Greedy parity")
    _footer(fig, "error bars: Wilson 95% CI over prompts (N = "
            f"{_n_text(ok.get('n'))} per arm); margins in nats (natural-log probabilities)")
    div = cmp[~cmp.exact] if len(cmp) else cmp
    if len(div):
        m = div.margin.replace([np.inf], np.nan)
        # exact ties (margin 0) at the left edge; unscored divergences (no margin) further left
        low = min(near_tie, m[m > 0].min() if (m > 0).any() else near_tie) / 4
        for arm, g in div.groupby("arm", sort=False):
            ax2.scatter(g.first_divergence, [arm] * len(g), alpha=0.7)
        for kind, color in _KIND_COLORS.items():
            g = div[div.kind == kind]
            if len(g):
                x = g.margin.replace([np.inf], np.nan).clip(lower=low).fillna(low / 2)
                ax3.scatter(x, g.arm, alpha=0.7, c=color, label=kind,
                            marker="x" if kind == "unscored" else "o")
        ax3.axvline(near_tie, ls="--", c="grey", label=f"near-tie threshold {near_tie:g} nats")
        floor = ok.noise_floor.max() if "noise_floor" in ok else 0
        if floor > near_tie:
            ax3.axvline(floor, ls=":", c="black", label=f"plain self-flip max {floor:.3g}")
        ax3.set_xscale("log")
        ax3.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        for ax in (ax2, ax3):
            ax.text(0.5, 0.5, "no divergences", ha="center", va="center", transform=ax.transAxes)
    ax2.set(xlabel="first divergence (output token index)", title="Where outputs diverge")
    ax3.set(xlabel="reference top-1 − top-2 logprob at divergence (nats)",
            title="Margin at divergence (0: left edge; x: unscored)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def load_vs_concurrency(curve: pd.DataFrame, title: str = "") -> plt.Figure:
    """Server mode, one line per k (k=0: no speculation): output throughput, median TTFT,
    median TPOT (p90 dotted) and AL from /metrics against the number of concurrent requests."""
    if curve.empty:
        return _no_results(title)
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for label, g in _series(curve, skip=("concurrency", "draft_kv_cache_dtype")):
        for k, gk in g.groupby("k"):
            gk = gk.sort_values("concurrency")
            name = " ".join(x for x in (f"k={k}", label) if x)
            line = axes[0].plot(gk.concurrency, gk.throughput_tok_s, marker="o", label=name)[0]
            c = line.get_color()
            axes[1].plot(gk.concurrency, gk.ttft_p50_s * 1e3, marker="o", c=c, label=name)
            axes[2].plot(gk.concurrency, gk.tpot_p50_s * 1e3, marker="o", c=c, label=name)
            axes[2].plot(gk.concurrency, gk.tpot_p90_s * 1e3, ls=":", c=c)
            if k > 0:
                axes[3].plot(gk.concurrency, gk.mean_acceptance_length, marker="o", c=c,
                             label=name)
    for ax, (ylabel, name) in zip(axes, [("output tokens / s", "Throughput"),
                                         ("ms", "TTFT (median)"),
                                         ("ms", "TPOT (median; p90 dotted)"),
                                         ("AL (bonus incl.)", "Acceptance length")]):
        ax.set(xlabel="concurrent requests", ylabel=ylabel, title=name)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def detection_power(pw: pd.DataFrame, near_tie: float, floor: float,
                    title: str = "") -> plt.Figure | None:
    """Share of positive-control runs flagged against the injected defect's size, one colour
    per defect, solid: parity analysis, dashed: acceptance check; the near-tie threshold and
    the noise floor as vertical lines (parity cannot flag a flip below the larger)."""
    sized = pw[pw["size"].notna()] if len(pw) else pw
    if sized.empty:
        return _no_results(title or "Detection power", "no positive control with a defect size")
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, g in sized.groupby("defect"):
        g = g.sort_values("size")
        line, = ax.plot(g["size"], g.flagged_parity / g.runs, marker="o", label=f"{kind}: parity")
        ax.plot(g["size"], g.flagged_acceptance / g.runs, marker="s", ls="--", c=line.get_color(),
                label=f"{kind}: acceptance")
    ax.axvline(near_tie, ls=":", c="grey", label=f"near-tie threshold {near_tie:g}")
    if floor > near_tie:
        ax.axvline(floor, ls="-.", c="black", label=f"noise floor {floor:.3g}")
    ax.set_xscale("log")
    sizes = sorted(sized["size"].unique())
    ax.set_xticks(sizes, [f"{x:g}" for x in sizes])
    ax.minorticks_off()
    ax.set(xlabel="injected bias (nats)", ylabel="share of runs flagged", ylim=(-0.03, 1.03),
           title=title or "Detection power (positive controls)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def speedup_vs_k(measured: pd.DataFrame,
                 predicted: pd.DataFrame | None = None) -> plt.Figure | None:
    """Speedup over plain decoding vs k, one panel per (layers, mode, draft setting) that has
    a speedup (a plain engine beside it), one line per batch size: measured with 95%
    intervals, predicted (dashed) where given."""
    if "speedup" in measured:
        measured = measured.dropna(subset=["speedup"])
    if measured.empty:
        return _no_results("speedup vs k", "no speculative point with a plain engine beside it")
    measured = measured.assign(draft=measured.get("draft", ""))
    panels = list(measured.groupby(["layers", "eager", "draft"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, ((layers, eager, draft), g) in zip(axes[0], panels):
        for i, (B, gb) in enumerate(g.groupby("B")):
            gb = gb.sort_values("k")
            err = np.vstack([gb.speedup - gb.speedup_lo, gb.speedup_hi - gb.speedup])
            line = ax.errorbar(gb.k, gb.speedup, yerr=np.nan_to_num(err), marker="o",
                               capsize=3, label=f"B={B}")
            if predicted is not None and len(predicted):
                p = predicted[(predicted.layers == layers) & (predicted.eager == eager)
                              & (predicted.get("draft", "") == draft)
                              & (predicted.B == B)].sort_values("k")
                ax.plot(p.k, p.pred_speedup, ls="--", color=line[0].get_color())
        ax.axhline(1, color="grey", lw=0.8)
        ax.set(title=f"{layers} layers, {'eager' if eager else 'CUDA graphs'}"
               + (f", draft {draft}" if draft else ""), xlabel="k",
               ylabel="speedup over plain")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.legend(fontsize=8)
    return fig


def verify_rows(by_rows: pd.DataFrame, curves: dict) -> plt.Figure | None:
    """The target's verify forward (GPU ms) vs the tokens it scheduled, one panel per
    (layers, mode, draft setting), from `predict.verify_by_rows`: measured (filled, one
    marker per k), the plain step at its CUDA graph's rows (hollow) and the plain step at
    n rows, unpadded (`curves[(layers, eager)]`: plain ms by rows n; dashed)."""
    d = by_rows.dropna(subset=["plain_rows_ms"]) if len(by_rows) else by_rows
    if d.empty:
        return _no_results("verify steps by rows", "no split pass with a plain engine beside it")
    panels = list(d.groupby(["layers", "eager", "draft"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, ((layers, eager, draft), g) in zip(axes[0], panels):
        curve = curves[(layers, eager)]
        ax.plot(curve.index, curve.to_numpy(float), ls="--", color="grey", lw=1,
                label="plain step at n rows")
        for i, (k, gk) in enumerate(g.groupby("k")):
            color, marker = f"C{i}", MARKERS[i % len(MARKERS)]
            ax.plot(gk.tokens, gk.execute_ms, ls="", marker=marker, color=color,
                    label=f"k={k} verify forward")
            ax.plot(gk.tokens, gk.plain_rows_ms, ls="", marker=marker, mfc="none",
                    color=color, ms=9, label=f"k={k} plain at its graph's rows")
        ax.set(title=f"{layers} layers, {'eager' if eager else 'CUDA graphs'}"
               + (f", draft {draft}" if draft else ""), xlabel="tokens scheduled (B (k + 1))",
               ylabel="GPU ms a step")
        ax.legend(fontsize=7)
    _footer(fig, "medians of each split pass's steps at that token count; the plain line is "
                 "read between the plain engine's measured steps (`predict.plain_at`)")
    return fig


def node_bracket(summary: pd.DataFrame, gpus: int, layers: int) -> plt.Figure | None:
    """Predicted speedup vs k on a TP `gpus` + EP node, one panel per batch size: the one-GPU
    prediction (line), the whole bracket (light band) and its `weights` band (dark band),
    from `nodecost.summary`."""
    s = summary.dropna(subset=["node_lo"])
    if s.empty:
        return _no_results(f"TP {gpus} + EP", "no batch size with a prediction")
    panels = list(s.groupby(["draft", "B"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.4), squeeze=False)
    for ax, ((draft, B), g) in zip(axes[0], panels):
        g = g.sort_values("k")
        ax.fill_between(g.k, g.node_lo, g.node_hi, alpha=0.2, color="C1",
                        label=f"TP {gpus} + EP, every corner")
        ax.fill_between(g.k, g.weights_lo, g.weights_hi, alpha=0.6, color="C1",
                        label="TP splits its weight reads")
        ax.plot(g.k, g.one_gpu, marker="o", color="C0", label="one GPU")
        ax.axhline(1, color="grey", lw=0.8)
        ax.set(title=f"B = {B}" + (f", draft {draft}" if draft else ""), xlabel="k",
               ylabel="predicted speedup", xticks=g.k.tolist())
        ax.legend(fontsize=7)
    _footer(fig, f"{layers} layers, predicted from one H200's measured costs; the node was not "
                 "measured")
    return fig
