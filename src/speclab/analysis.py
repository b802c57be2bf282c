"""Tables from a run's results: acceptance and speed per point, per position, per category, and
the per-position profile one point measured (what the cost model prices a draft at)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from speclab import metrics

KEYS = ["kv_cache_dtype", "layout", "prompt_format"]


def with_method(records: pd.DataFrame) -> pd.DataFrame:
    """Records with a `method` column: None for plain (k = 0) rows, eagle3 for speculative
    rows recorded before methods existed."""
    m = records["method"] if "method" in records else pd.Series(None, index=records.index,
                                                                   dtype=object)
    return records.assign(method=m.astype(object).fillna("eagle3").where(records.k > 0, None))


def _counts(group: pd.DataFrame, k: int) -> tuple[np.ndarray, np.ndarray]:
    app = np.array([list(x)[:k] + [0] * (k - len(x)) for x in group.accepted_per_pos], dtype=float)
    return group.drafts.to_numpy(dtype=float), app.reshape(len(group), k)


def _untrusted(points: pd.DataFrame | None) -> dict[str, metrics.SpecCounters]:
    """Engine counters of the ok points whose per-request attribution is "mismatch" (server
    mode when stream chunks merged verify steps): their per-request counters are not usable."""
    if points is None or points.empty or "attribution" not in points:
        return {}
    bad = points[(points.status == "ok") & (points.attribution == "mismatch")]
    return {r.point_id: metrics.SpecCounters.from_dict(
        {n: r[f"counters.{n}"] for n in ("num_drafts", "num_draft_tokens",
                                          "num_accepted_tokens", "accepted_per_pos")})
        for _, r in bad.iterrows()}


def acceptance(records: pd.DataFrame, by: list[str] | None = None, *,
               points: pd.DataFrame | None = None, n_boot: int = 1000,
               seed: int = 0) -> pd.DataFrame:
    """Acceptance per point (or per `by` groups within points) from per-request counters,
    with percentile-bootstrap 95% CIs over requests. Plain (k=0) rows are skipped.

    With `points`, a point whose per-request counters disagree with the engine's
    (attribution "mismatch") is reported from the engine's counters without CIs
    (`source` "engine") and left out of `by` groups; every other row has `source` "requests"."""
    if records.empty:
        return pd.DataFrame(columns=["point_id", "k", *KEYS, "mean_acceptance_length"])
    engine = _untrusted(points)
    spec = with_method(records[records.k > 0])
    rows = []
    for key, g in spec.groupby(["point_id", *(by or [])], sort=False):
        k = int(g.k.iloc[0])
        pid = g.point_id.iloc[0]
        if pid in engine:
            if by:
                continue
            c = engine[pid]
            nan = [float("nan")] * k
            ci = {"mean_acceptance_length": (np.nan, np.nan), "per_position": (nan, nan),
                  "conditional": (nan, nan)}
        else:
            drafts, app = _counts(g, k)
            # ngram drafts may be shorter than k: its rows count their draft tokens
            tokens = g.draft_tokens.sum() if "draft_tokens" in g else k * drafts.sum()
            c = metrics.SpecCounters(int(drafts.sum()), int(tokens), int(app.sum()),
                                     tuple(int(x) for x in app.sum(axis=0)))
            ci = metrics.bootstrap_ci(drafts, app, n_boot=n_boot, seed=seed)
        row = dict(zip(["point_id", *(by or [])], key if isinstance(key, tuple) else (key,)))
        row.update({c_: g[c_].iloc[0] for c_ in ["k", "method", "draft_kv_cache_dtype", "repeat",
                                                  *KEYS, "concurrency"] if c_ in g})
        row.update(
            n_requests=len(g), num_drafts=c.num_drafts, acceptance_rate=c.acceptance_rate,
            mean_acceptance_length=c.mean_acceptance_length,
            al_lo=ci["mean_acceptance_length"][0], al_hi=ci["mean_acceptance_length"][1],
            per_position=c.per_position, pp_lo=list(ci["per_position"][0]),
            pp_hi=list(ci["per_position"][1]), conditional=c.conditional,
            cond_lo=list(ci["conditional"][0]), cond_hi=list(ci["conditional"][1]),
            source="engine" if pid in engine else "requests",
            **_per_step(g, n_boot, seed),
        )
        rows.append(row)
    return pd.DataFrame(rows)


def _per_step(g: pd.DataFrame, n_boot: int, seed: int) -> dict:
    """Tokens per decode step (bonus included, steps without a draft counted: what speed
    follows) with a bootstrap CI over requests, and the share of decode steps that carried a
    draft (below 1 where the drafter skips steps: ngram without a lookup match)."""
    if "step_tokens" not in g:
        return {}
    tokens, steps = zip(*(metrics.decode_steps(s) for s in g.step_tokens))
    lo, hi = metrics.ratio_bootstrap_ci(tokens, steps, n_boot=n_boot, seed=seed)
    total = sum(steps)
    # counters from the step trace leave out a finished request's last round: so do its steps
    vllm = g.counters_from == "vllm" if "counters_from" in g else pd.Series(False, g.index)
    counted = total - sum(metrics.dropped_rounds(s, pd.notna(f)) for s, f, v in zip(
        g.step_tokens, g.finish_reason if "finish_reason" in g else [None] * len(g), vllm)
        if not v)
    return {"tokens_per_step": sum(tokens) / total if total else np.nan, "tps_lo": lo,
            "tps_hi": hi, "drafted_share": g.drafts.sum() / counted if counted else np.nan}


def mean_ci(x) -> tuple[float, float, float]:
    """(mean, lo, hi): Student-t 95% interval of the mean (NaN bounds below 2 values)."""
    from scipy import stats

    x = np.asarray(x, dtype=float)
    m = float(x.mean()) if x.size else np.nan
    if x.size < 2:
        return m, np.nan, np.nan
    h = stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    return m, m - h, m + h


def ratio_ci(num, den) -> tuple[float, float, float]:
    """(geometric mean, lo, hi) of paired ratios num[i]/den[i] (one pair per timing round):
    a t-interval on the log ratios, transformed back."""
    r = np.log(np.asarray(num, dtype=float) / np.asarray(den, dtype=float))
    m, lo, hi = mean_ci(r)
    return float(np.exp(m)), float(np.exp(lo)), float(np.exp(hi))


def unpaired_ratio_ci(num, den) -> tuple[float, float, float]:
    """(ratio of geometric means, lo, hi) of two independent samples (e.g. one point's passes
    under two executors, run one after the other): scipy's Welch t-interval on the difference
    of the mean logs, transformed back (NaN bounds below 2 values in either)."""
    from scipy import stats

    a, b = np.log(np.asarray(num, dtype=float)), np.log(np.asarray(den, dtype=float))
    m = float(np.exp(a.mean() - b.mean())) if a.size and b.size else np.nan
    if a.size < 2 or b.size < 2:
        return m, np.nan, np.nan
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    return m, float(np.exp(ci.low)), float(np.exp(ci.high))


def _passes(row) -> dict[int, float]:
    """{round: tok/s} of a point's timed passes (a point from before rounds: its one pass)."""
    passes = row.get("passes")
    if isinstance(passes, list) and passes:
        return {int(p["round"]): float(p["tok_s"]) for p in passes}
    return {1: float(row["throughput_tok_s"])}


def speed(points: pd.DataFrame) -> pd.DataFrame:
    """Throughput per ok point and speedup over the plain (k=0) point of the same KV dtype,
    layout, prompt format and repeat, with 95% CIs from the timing rounds: throughput is the
    mean over rounds (t-interval), speedup the geometric mean of the per-round ratios to the
    plain point's pass of the same round (t-interval on log ratios); n_rounds pairs."""
    ok = points[points.status == "ok"].copy() if len(points) else points
    if ok.empty:
        return pd.DataFrame(columns=["point_id", "k", *KEYS, "throughput_tok_s",
                                     "baseline_tok_s", "speedup"])
    for col in KEYS + ["k", "repeat", "draft_kv_cache_dtype", "method"]:
        ok[col] = ok[f"point.{col}"] if f"point.{col}" in ok else None
    ok = with_method(ok)
    ok["layout"] = ok.apply(_layout_label, axis=1)
    ok["mean_acceptance_length"] = ok.get("counters.mean_acceptance_length", np.nan)
    # server mode: requests in flight; offline: the point's batch cap (a batch-1 arm); else NA
    def num(col: str) -> pd.Series:
        return pd.to_numeric(ok[col], errors="coerce") if col in ok else \
            pd.Series(np.nan, index=ok.index)

    conc = num("concurrency").fillna(num("point.concurrency"))
    ok["concurrency"] = conc.fillna(-1)  # -1 only to match baselines, NA in the table
    key = KEYS + ["repeat", "concurrency"]
    passes = {r.point_id: _passes(r) for _, r in ok.iterrows()}
    tput = [mean_ci(list(passes[pid].values())) for pid in ok.point_id]
    ok["throughput_tok_s"] = [t[0] for t in tput]
    ok["tput_lo"], ok["tput_hi"] = [t[1] for t in tput], [t[2] for t in tput]
    base = ok[ok.k == 0].drop_duplicates(key).set_index(key).point_id
    rows = []
    for _, r in ok.iterrows():
        b = base.get(tuple(r[key]))
        pairs = sorted(set(passes[r.point_id]) & set(passes[b])) if b is not None else []
        rows.append((ok.throughput_tok_s[ok.point_id == b].iloc[0] if b is not None else np.nan,
                     *(ratio_ci([passes[r.point_id][i] for i in pairs],
                                [passes[b][i] for i in pairs]) if pairs else (np.nan,) * 3),
                     len(pairs)))
    (ok["baseline_tok_s"], ok["speedup"], ok["speedup_lo"], ok["speedup_hi"],
     ok["n_rounds"]) = zip(*rows) if rows else ([],) * 5
    ok["concurrency"] = conc.astype("Int64")
    cols = ["point_id", "k", "method", "draft_kv_cache_dtype", "repeat", "concurrency", *KEYS,
            "throughput_tok_s", "tput_lo", "tput_hi", "baseline_tok_s", "speedup",
            "speedup_lo", "speedup_hi", "n_rounds", "mean_acceptance_length",
            "timings.engine_init_s",
            "timings.generate_s", "timings.harness_s", "wall_s",
            "side_by_side"]  # Ray executor: points that shared the node while this one ran
    return ok[[c for c in cols if c in ok]].sort_values(["layout", "kv_cache_dtype", "k"])


def _layout_label(row) -> str:
    tp, dp, ep = row.get("point.layout.tp", 1), row.get("point.layout.dp", 1), row.get(
        "point.layout.ep", False)
    return f"tp{tp}" + (f"dp{dp}" if dp and dp > 1 else "") + ("-ep" if ep else "")


def per_position_long(acc: pd.DataFrame) -> pd.DataFrame:
    """One row per (point, position): unconditional and conditional rates with CIs."""
    rows = []
    for _, r in acc.iterrows():
        for i in range(int(r.k)):
            rows.append({**{c: r[c] for c in acc.columns if not isinstance(r[c], list)},
                         "position": i, "unconditional": r.per_position[i], "u_lo": r.pp_lo[i],
                         "u_hi": r.pp_hi[i], "conditional": r.conditional[i],
                         "c_lo": r.cond_lo[i], "c_hi": r.cond_hi[i]})
    return pd.DataFrame(rows)


def histogram(records: pd.DataFrame) -> pd.DataFrame:
    """Acceptance-length histogram (tokens per verify step, bonus included) per spec point."""
    rows = []
    if records.empty:
        return pd.DataFrame(columns=["point_id", "k", "length", "steps", "fraction"])
    for pid, g in records[records.k > 0].groupby("point_id", sort=False):
        k = int(g.k.iloc[0])
        counts = metrics.acceptance_length_histogram(g.step_tokens, k)
        for length, n in enumerate(counts, start=1):
            rows.append({"point_id": pid, "k": k, "length": length, "steps": int(n),
                         "fraction": n / counts.sum() if counts.sum() else np.nan})
    return pd.DataFrame(rows)


def load_curve(points: pd.DataFrame, records: pd.DataFrame) -> pd.DataFrame:
    """Server-mode points: throughput, latency percentiles (TTFT, TPOT, inter-token) and AL
    per (k, concurrency) and configuration."""
    if "mode" not in points or records.empty:
        return pd.DataFrame(columns=["point_id", "k", "concurrency", "throughput_tok_s"])
    sv = points[(points["mode"] == "server") & (points.status == "ok")]
    if sv.empty:
        return pd.DataFrame(columns=["point_id", "k", "concurrency", "throughput_tok_s"])
    sp = speed(sv).set_index("point_id")
    rows = []
    for pid, g in records[records.point_id.isin(sv.point_id)].groupby("point_id", sort=False):
        itl = np.concatenate([np.asarray(x, dtype=float) for x in g.itl_s]) if "itl_s" in g \
            else np.array([])
        s = sp.loc[pid]
        rows.append({"point_id": pid, "k": int(s.k), "concurrency": int(s.concurrency),
                     **{c: s[c] for c in KEYS + ["draft_kv_cache_dtype"]},
                     "throughput_tok_s": s.throughput_tok_s, "speedup": s.speedup,
                     "mean_acceptance_length": s.mean_acceptance_length,
                     "ttft_p50_s": g.ttft_s.median(), "ttft_p90_s": g.ttft_s.quantile(0.9),
                     "tpot_p50_s": g.tpot_s.median(), "tpot_p90_s": g.tpot_s.quantile(0.9),
                     "itl_p50_s": float(np.median(itl)) if itl.size else np.nan,
                     "itl_p90_s": float(np.quantile(itl, 0.9)) if itl.size else np.nan})
    return pd.DataFrame(rows).sort_values(["k", "concurrency"], ignore_index=True)


def methods_table(acc: pd.DataFrame, spd: pd.DataFrame) -> pd.DataFrame:
    """One row per (concurrency, method, k) of the run's speculative points: AL (vLLM's:
    over the verify steps that carried a draft), tokens per decode step (every step: ngram
    drafts only where its lookup matches, `drafted_share` of the steps) and per-position
    (unconditional) acceptance with their bootstrap CIs, speedup over the shared plain point
    with its t-interval over timing rounds. Points differing in other settings
    (KV dtypes, layout, format, repeats) are separate rows: `point_id` says which."""
    cols = ["concurrency", "method", "k", "point_id", "n_requests", "mean_acceptance_length",
            "al_lo", "al_hi", "tokens_per_step", "tps_lo", "tps_hi", "drafted_share",
            "per_position", "pp_lo", "pp_hi", "speedup", "speedup_lo", "speedup_hi", "n_rounds"]
    if acc.empty:
        return pd.DataFrame(columns=cols)
    a = with_method(acc.drop(columns=["concurrency"], errors="ignore"))
    s = spd.drop(columns=[c for c in ("k", "method", "mean_acceptance_length") if c in spd]) \
        if len(spd) else pd.DataFrame(columns=["point_id"])
    out = a.merge(s, on="point_id", how="left", suffixes=("", "_speed"))
    if "concurrency" not in out:
        out["concurrency"] = pd.NA
    out["concurrency"] = out["concurrency"].astype("Int64")
    return out.reindex(columns=cols).sort_values(
        ["concurrency", "method", "k", "point_id"], ignore_index=True)


def best_per_concurrency(table: pd.DataFrame, by: str = "speedup") -> pd.DataFrame:
    """The method and k with the highest `by` (speedup; where the speeds are not results,
    tokens_per_step or mean_acceptance_length) at each concurrency level, with its CI."""
    lo, hi = {"speedup": ("speedup_lo", "speedup_hi"), "tokens_per_step": ("tps_lo", "tps_hi"),
              "mean_acceptance_length": ("al_lo", "al_hi")}[by]
    rows = []
    t = table.dropna(subset=[by]) if len(table) else table
    for conc, g in t.groupby("concurrency", dropna=False, sort=True):
        b = g.loc[g[by].idxmax()]
        rows.append({"concurrency": conc, "method": b.method, "k": int(b.k),
                     "point_id": b.point_id, by: b[by], "lo": b[lo], "hi": b[hi]})
    return pd.DataFrame(rows, columns=["concurrency", "method", "k", "point_id", by, "lo", "hi"])


@dataclass(frozen=True)
class MeasuredProfile:
    """The per-position acceptance one point of a `speclab run` / `sweep` measured: what the
    cost model (`speclab predict --acceptance RUN`) prices a draft at."""

    run: str
    target: str
    draft: str | None
    point_id: str
    method: str
    k: int
    n_requests: int
    num_drafts: int
    rates: tuple[float, ...]
    rates_lo: tuple[float, ...]
    rates_hi: tuple[float, ...]
    al: float
    al_lo: float
    al_hi: float
    # per-position rates of resamples of the point's requests ([draws, k]; none where only
    # the engine's counters are usable): what the prediction's spread draws from
    draws: np.ndarray = field(default_factory=lambda: np.empty((0, 0)), compare=False,
                              repr=False)

    def describe(self) -> str:
        """One markdown sentence: where the rates come from and how sure they are."""
        def fmt(xs) -> str:
            return ", ".join("n/a" if np.isnan(x) else f"{x:.3f}" for x in xs)

        ci = "" if np.isnan(self.al_lo) else f" [{self.al_lo:.2f}, {self.al_hi:.2f}]"
        return (f"{self.method}'s acceptance measured by run `{self.run}` (target "
                f"`{self.target}`, draft `{self.draft}`), point `{self.point_id}`: k = {self.k}, "
                f"{self.n_requests} requests, {self.num_drafts} drafts, AL {self.al:.2f}{ci}, "
                f"per position {fmt(self.rates)} (95% CIs from {fmt(self.rates_lo)} to "
                f"{fmt(self.rates_hi)}); positions past {self.k} continue by the last "
                "conditional rate.")


def measured_profile(acc: pd.DataFrame, method: str, point_id: str | None = None, *,
                     run: str = "", target: str = "", draft: str | None = None
                     ) -> MeasuredProfile:
    """The `method` point of an `acceptance` table to price a draft at: `point_id`, or the one
    point with the largest k. Raises ValueError naming the candidates when none fits or
    several share the largest k (then a point must be named)."""
    acc = with_method(acc)
    mine = acc[acc.method == method]
    if point_id is not None:
        row = acc[acc.point_id == point_id]
        if row.empty:
            raise ValueError(f"{run}: no speculative point {point_id!r} with results; its "
                             f"{method} points: {sorted(mine.point_id) or 'none'}")
        if row.method.iloc[0] != method:
            raise ValueError(f"{run}: point {point_id!r} ran method {row.method.iloc[0]}, "
                             f"not {method}")
    else:
        if mine.empty:
            raise ValueError(f"{run}: no {method} point with results (methods there: "
                             f"{sorted(set(acc.method.dropna())) or 'none'})")
        row = mine[mine.k == mine.k.max()]
        if len(row) > 1:
            raise ValueError(f"{run}: {len(row)} {method} points at k = {int(row.k.iloc[0])} "
                             f"({', '.join(sorted(row.point_id))}): name one as RUN:POINT_ID")
    r = row.iloc[0]
    if not r.num_drafts:
        raise ValueError(f"{run}: point {r.point_id!r} drafted nothing: no acceptance to read")
    return MeasuredProfile(
        run=run, target=target, draft=draft, point_id=r.point_id, method=method, k=int(r.k),
        n_requests=int(r.n_requests), num_drafts=int(r.num_drafts),
        rates=tuple(float(x) for x in r.per_position),
        rates_lo=tuple(float(x) for x in r.pp_lo), rates_hi=tuple(float(x) for x in r.pp_hi),
        al=float(r.mean_acceptance_length), al_lo=float(r.al_lo), al_hi=float(r.al_hi))


def run_profile(run_dir: Path, method: str, point_id: str | None = None, *,
                n_boot: int = 1000, seed: int = 0) -> MeasuredProfile:
    """`measured_profile` of a `speclab run` / `sweep` folder's ok points, with `n_boot`
    resamples of the point's requests (`MeasuredProfile.draws`)."""
    from speclab import store

    run_dir = Path(run_dir)
    try:
        found = store.has_points(run_dir)
    except store.LayoutError as e:
        raise ValueError(str(e)) from None
    if not found:
        raise ValueError(f"{run_dir}: no point results (results/*.json): not a folder of "
                         "`speclab run` or `sweep` (a gpubench folder's acceptance is its "
                         "oracle's, set by construction)")
    points, records = store.load_results(run_dir)  # records: the ok points' only
    acc = acceptance(records, points=points)
    prof = store.load_profile(run_dir)
    found = measured_profile(acc, method, point_id, run=run_dir.name, target=prof.target,
                             draft=prof.draft)
    if (acc.source[acc.point_id == found.point_id] == "engine").any():
        return found  # its per-request counters are not usable: nothing to resample
    drafts, app = _counts(records[records.point_id == found.point_id], found.k)
    return replace(found, draws=metrics.bootstrap_rates(drafts, app, n_boot=n_boot, seed=seed))
