"""The cost model at a depth no engine here holds: the plain step fitted over the measured
layer counts and carried to DeepSeek-V4-Flash's 43 layers.

`fit_layers` fits T_plain(n, L) = a(n) + b(n) L per graph size n over the measured layer
counts, `extrapolate` predicts every (k, B) at the production depth with `speclab.predict`'s
model (the drafter of the deepest run: the draft does not grow with the target),
`extrapolation_spread` redraws the plain steps within their timing noise, and `held_out`
checks the chain at a measured depth left out of the fit.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from speclab import predict, stepcosts

PRODUCTION_LAYERS = 43


def _pooled_by(costs: pd.DataFrame, key, means: np.ndarray | None = None) -> pd.DataFrame:
    """`costs`' steps pooled per value of `key` (a column, or a list of them), sorted by it:
    for several measured points of one quantity (plain steps of batch sizes that replay one
    graph) the inverse-variance mean of their means, each standard error from its 95% t-interval,
    and the 95% t-interval of
    the same mean of the intervals' midpoints at their degrees of freedom summed (a single
    point keeps its own; a point without an interval makes its value's NaN). The interval
    stays the measured one's when the means are redrawn: `means` (a row per row of `costs`,
    a column per draw: `extrapolation_spread`) are pooled with the same weights, as columns
    0, 1, ... in place of step_ms."""
    from scipy import stats

    dof = (costs.rounds - 1).clip(lower=1).to_numpy(float)
    se = (costs.step_hi - costs.step_lo).to_numpy(float) / (2 * stats.t.ppf(0.975, dof))
    w = 1 / np.maximum(se, 1e-9) ** 2
    cols = ["step_ms"] if means is None else list(range(means.shape[1]))
    m = costs.step_ms.to_numpy(float)[:, None] if means is None else means
    parts = pd.DataFrame({"w": w, "wmid": w * (costs.step_lo + costs.step_hi).to_numpy(float) / 2,
                          "dof": dof, "nan": np.isnan(w)}, index=costs.index).join(
        pd.DataFrame(w[:, None] * m, index=costs.index, columns=cols))
    # per column: a draw's sums are the ones it would get pooled alone
    g = parts.join(costs[key]).groupby(key).sum().sort_index()
    g.loc[g.nan > 0, ["w", "wmid", *cols]] = np.nan
    mid, half = g.wmid / g.w, stats.t.ppf(0.975, g.dof) / np.sqrt(g.w)
    return g[cols].div(g.w, axis=0).assign(step_lo=mid - half, step_hi=mid + half)


def _plain_layers(costs: pd.DataFrame, eager: bool) -> list[int]:
    """The layer counts with plain steps at `eager`, sorted."""
    return sorted(int(x) for x in costs[(costs.k == 0) & (costs.eager == eager)].layers.unique())


def fit_layers(costs: pd.DataFrame, layers: int, eager: bool = False) -> tuple[
        pd.DataFrame, pd.DataFrame]:
    """The plain step at `layers` decoder layers from the measured layer counts: per graph
    size n (the rows a plain step ran, `stepcosts.step_costs`' `rows`: an engine without an
    n-row graph runs B = n on a larger one, so steps are paired across depths by rows, never
    by B), a line
    T_plain(n, L) = a + b L (least squares; needs two layer counts; where several batch
    sizes ran one graph at one depth, their steps pooled by `_pooled_by`). A size is
    extrapolated only where the deepest plain step's 95% interval lies above the shallowest
    one's: a step that does not grow resolvably with depth is host time, and a line through
    it says nothing about `layers` (ValueError when no size resolves, or fewer than two
    layer counts). Returns (rows of (n, a_ms, b_ms_per_layer, resolved), the plain steps at
    `layers` as `stepcosts.step_costs` rows with B = rows = n)."""
    plain = costs[(costs.k == 0) & (costs.eager == eager)]
    Ls = _plain_layers(costs, eager)
    if len(Ls) < 2:
        raise ValueError("extrapolation needs plain steps at two layer counts; have "
                         f"{Ls}")
    fit, synth = [], []
    for n, resolved, ((b, a),) in _lines(plain):
        fit.append({"n": n, "a_ms": a, "b_ms_per_layer": b, "resolved": resolved})
        if resolved:
            synth.append({"layers": layers, "eager": eager, "k": 0, "B": n,
                          "rows": n, "step_ms": a + b * layers})
    if not synth:
        raise ValueError(f"the plain step does not grow beyond its 95% interval from "
                         f"{Ls[0]} to {Ls[-1]} layers at any graph size (host-bound "
                         f"steps): a line through them says nothing about {layers} layers")
    return pd.DataFrame(fit), pd.DataFrame(synth)


def _lines(plain: pd.DataFrame, means: np.ndarray | None = None) -> list[tuple]:
    """`fit_layers`' lines: per graph size n (sorted) with steps at two or more layer counts
    in `plain`, (n, resolved, [(b, a) of the least-squares line a + b L through the pooled
    steps (`_pooled_by`), for step_ms or each column of `means`])."""
    out = []
    for n, by_L in _pooled_by(plain, ["rows", "layers"], means).groupby(level="rows"):
        by_L = by_L.droplevel("rows")
        if len(by_L) < 2:
            continue
        x, y = by_L.index.to_numpy(float), by_L.drop(columns=["step_lo", "step_hi"]).to_numpy()
        out.append((int(n), bool(by_L.step_lo.iloc[-1] > by_L.step_hi.iloc[0]),
                    [np.polyfit(x, y[:, j], 1) for j in range(y.shape[1])]))
    return out


def _carried(costs: pd.DataFrame, drafts: pd.DataFrame, layers: int,
             eager: bool) -> tuple[int, pd.DataFrame, list]:
    """What `extrapolate` carries to `layers` besides the plain steps: the depth of the
    deepest run with drafter times (else of the deepest plain steps), its drafter times as
    `layers`' (the draft does not grow with the target), and the speculative batch sizes."""
    deepest = max(drafts[drafts.eager == eager].layers, default=_plain_layers(costs, eager)[-1])
    d = drafts[(drafts.layers == deepest) & (drafts.eager == eager)].assign(layers=layers)
    return int(deepest), d, sorted(costs[costs.k > 0].B.unique())


def extrapolate(costs: pd.DataFrame, drafts: pd.DataFrame, rates, layers: int =
                PRODUCTION_LAYERS, eager: bool = False, ks=range(1, 6)) -> dict:
    """Predicted speedup per (k, B) at `layers` decoder layers: the plain steps there from
    `fit_layers`, the drafter times of the deepest measured run (the draft does not grow
    with the target). Returns {"fit": `fit_layers`' lines, "prediction": rows like
    `predict.predict`, "plain": the plain steps at `layers` (B = rows = n), "drafts": the drafter
    times used}."""
    fit, plain = fit_layers(costs, layers, eager)
    deepest, d, spec_B = _carried(costs, drafts, layers, eager)
    pred = predict.predict(plain, d, rates, ks=ks, batches=spec_B)
    return {"fit": fit, "prediction": pred, "layers_measured": _plain_layers(costs, eager),
            "drafts_from_layers": deepest, "plain": plain, "drafts": d}


def held_out(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """The depth extrapolation checked against a depth it did not see: per eager/graphs
    configuration, the deepest layer count with speculative points and plain steps is left
    out, `extrapolate`'s chain (`fit_layers` over the other layer counts, two or more; the
    drafter times of the deepest of them that has any, else the held depth's own: the draft
    does not grow with the target) predicts it, and the measurement there is the
    check. Rows: `kind` "plain" (per graph size: the measured step, pooled as the fit pools,
    against the line's) and "spec" (per point: the measured speedup against the prediction
    at the point's measured acceptance, as `predict.validate` does), with `measured`, its 95%
    interval (`lo`, `hi`), `predicted` and `error` = predicted / measured - 1, and the
    layer counts fitted (`from_layers`). Empty where no configuration has such a depth."""
    costs = stepcosts.step_costs(results, max_tokens)
    if costs.empty:
        return pd.DataFrame()
    drafts, timed, rows = stepcosts.draft_ms(results), stepcosts.passes(results, max_tokens), []
    for eager, c in costs.groupby("eager"):
        plain_L = set(c[c.k == 0].layers)
        held = max((L for L in set(c[c.k > 0].layers) & plain_L if len(plain_L - {L}) >= 2),
                   default=None)
        if held is None:
            continue
        seen = c[c.layers != held]
        try:
            _, synth = fit_layers(seen, held, eager)
        except ValueError:
            continue
        base = {"layers": int(held), "eager": eager,
                "from_layers": str(_plain_layers(seen, eager))}
        line = synth.set_index("rows").step_ms
        for n, m in _pooled_by(c[(c.layers == held) & (c.k == 0)], "rows").iterrows():
            if n in line.index:
                rows.append({**base, "kind": "plain", "draft": "", "k": 0, "B": int(n),
                             "rows": int(n), "measured": m.step_ms, "lo": m.step_lo,
                             "hi": m.step_hi, "predicted": line[n],
                             "error": line[n] / m.step_ms - 1})
        d = drafts[drafts.eager == eager]
        d = d[d.layers == max(d[d.layers != held].layers, default=held)].assign(layers=held)
        for _, r in c[(c.layers == held) & (c.k > 0)].iterrows():
            p = predict.point_prediction(synth, d, r, stepcosts.measured_rates(r, timed),
                                  tokens=int(np.rint(r.tokens)))
            if p.empty or np.isnan(p.pred_speedup.iloc[0]):
                continue
            rows.append({**base, "kind": "spec", "draft": r.draft, "k": int(r.k),
                         "B": int(r.B), "rows": int(p.verify_rows.iloc[0]),
                         "measured": r.speedup, "lo": r.speedup_lo, "hi": r.speedup_hi,
                         "predicted": p.pred_speedup.iloc[0],
                         "error": p.pred_speedup.iloc[0] / r.speedup - 1})
    return pd.DataFrame(rows)


def extrapolation_spread(costs: pd.DataFrame, drafts: pd.DataFrame, rates, layers: int =
                         PRODUCTION_LAYERS, eager: bool = False, ks=range(1, 6),
                         draws: int = 200, seed: int = 0, rate_draws: dict | None = None
                         ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """How far the `extrapolate` prediction moves with the plain steps' timing noise: `draws`
    times, every measured plain step is drawn from its t distribution (its rounds less one
    degrees of freedom, its standard error as scale) and the layer fit and prediction redone.
    The drafter times (medians of hundreds of calls) stay fixed, and so does the acceptance
    profile, unless `rate_draws` ({method: [n, k] per-position rates}, e.g. resamples of a
    run's requests, `analysis.MeasuredProfile.draws`; `rates` then a {method: rates} mapping)
    gives draw i that method's i-th row (n >= `draws`; a row with NaN keeps `rates`): then
    the spread is timing and acceptance together, else the timing's share. Returns per (draft,
    B, k) the 2.5 and 97.5 percentiles of the predicted speedup (`pred_lo`, `pred_hi`) and the
    share of draws in which that k is its setting's best at B (`p_best`); and per (B, draft)
    its best k's speedup (`best_speedup`, `best_lo`, `best_hi`) and the share of draws in
    which that setting is the fastest at B (`p_fastest`: methods compared on the same draw).
    What the draws do not change (the fit's weights and resolved sizes, the drafter times) is
    read once; each draw redoes the lines and the prediction."""
    from scipy import stats

    g = np.random.default_rng(seed)
    plain = costs[(costs.k == 0) & (costs.eager == eager)]
    dof = (plain.rounds - 1).clip(lower=1).to_numpy()
    se = ((plain.step_hi - plain.step_lo) / (2 * stats.t.ppf(0.975, dof))).fillna(0).to_numpy()
    drawn = np.column_stack([plain.step_ms + g.standard_t(dof) * se for _ in range(draws)])
    fit_layers(costs, layers, eager)  # raises where `extrapolate` would: no draw changes that
    _, d, spec_B = _carried(costs, drafts, layers, eager)
    points = predict.drafter_points(d, spec_B, ks, eager)
    lines = [(n, ab) for n, resolved, ab in _lines(plain, drawn) if resolved]
    sizes = np.array([n for n, _ in lines], float)  # `fit_layers`' steps: B = rows = n
    b, a = np.array([ab for _, ab in lines]).T  # per draw, per size
    rate_draws = rate_draws or {}
    if any(len(r) < draws for r in rate_draws.values()):
        raise ValueError(f"rate_draws need at least {draws} rows each")
    rows = []
    for i in range(draws):
        curve = sizes, a[i] + b[i] * layers  # one curve by B and by rows
        rates_i = {**rates, **{m: list(r[i]) for m, r in rate_draws.items()
                               if not np.isnan(r[i]).any()}} if rate_draws else rates
        rows += [{"draft": r["draft"], "B": r["B"], "k": r["k"],
                  "pred_speedup": r["pred_speedup"], "draw": i}
                 for r in predict.predicted_rows(points, curve, curve, rates_i, layers, eager)]
    every = pd.DataFrame(rows).dropna(subset=["pred_speedup"])
    keys = ["draft", "B", "k"]
    per_k = every.groupby(keys).pred_speedup.quantile([0.025, 0.975]).unstack()
    per_k.columns = ["pred_lo", "pred_hi"]
    best = every.loc[every.groupby(["draw", "draft", "B"]).pred_speedup.idxmax()]
    per_k["p_best"] = best.groupby(keys).size().reindex(per_k.index).fillna(0) / draws
    fastest = best.loc[best.groupby(["draw", "B"]).pred_speedup.idxmax()]
    per_method = best.groupby(["B", "draft"]).pred_speedup.agg(
        best_speedup="median", best_lo=lambda x: x.quantile(0.025),
        best_hi=lambda x: x.quantile(0.975))
    per_method["p_fastest"] = (fastest.groupby(["B", "draft"]).size()
                               .reindex(per_method.index).fillna(0) / draws)
    return per_k.reset_index(), per_method.reset_index()
