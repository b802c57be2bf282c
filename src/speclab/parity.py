"""Greedy-output parity: does speculative (or otherwise perturbed) decoding emit the same tokens
as a reference plain run, and where it does not, is the divergence a near-tie of the target's
own logits (numerics) or a substantive difference (a bug until explained)?

An experiment arm is a pair of points (reference, candidate) run on the same prompts; the
reference is a plain greedy run with top-2 logprobs, so its top-1/top-2 margin at the first
divergence position is known (the prefixes agree up to there, so the target saw the same
context in both runs).

The margins come from a second, untimed plain pass. Where that pass left the timed output
(`logprob_pass_divergence`) the target flipped its own argmax between two runs of the same
engine: those "self-flips" measure the target's run-to-run noise, and the largest margin at
which one happened is the run's noise floor. A divergence is a "near-tie" below the
`near_tie` threshold, "within-noise" at or below the noise floor, "substantive" above both,
and "unscored" when no plain pass of the run saw its context (no margin to judge it by).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from speclab.profiles import Layout, Profile
from speclab.sweep import Point, load_profile, load_results


def first_divergence(ref: Sequence[int], cand: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end);
    None when the sequences are identical."""
    n = min(len(ref), len(cand))
    diff = np.flatnonzero(np.asarray(ref[:n]) != np.asarray(cand[:n]))
    if diff.size:
        return int(diff[0])
    return None if len(ref) == len(cand) else n


def _pass_margin(row, prefix: list[int], j: int) -> float:
    """The margin at position j of a plain run's logprob pass, if that pass saw `prefix`
    (the timed output starts with it and the pass had not left the output before j)."""
    margins = row.get("margin")
    margins = [] if margins is None else list(margins)
    lp_div = row.get("logprob_pass_divergence")
    if j >= len(margins) or list(row.output_token_ids[:j]) != prefix:
        return math.nan
    if lp_div is not None and not pd.isna(lp_div) and j > lp_div:
        return math.nan
    return float(margins[j])


def self_flips(records: pd.DataFrame) -> pd.DataFrame:
    """Where plain (k=0) runs' logprob passes left their own timed output: one row per flip with
    the pass's top-1/top-2 margin there (a lower bound on the target's run-to-run logit noise)."""
    plain = records[records.k == 0] if "k" in records else records
    rows = []
    for r in plain.itertuples(index=False):
        # server-mode records have no logprob pass (no margin column)
        d, margins = getattr(r, "logprob_pass_divergence", None), getattr(r, "margin", None)
        if d is None or pd.isna(d) or margins is None or int(d) >= len(margins):
            continue
        rows.append({"point_id": getattr(r, "point_id", None), "prompt_id": r.prompt_id,
                     "position": int(d), "margin": float(margins[int(d)])})
    return pd.DataFrame(rows, columns=["point_id", "prompt_id", "position", "margin"])


def compare(ref: pd.DataFrame, cand: pd.DataFrame, *, near_tie: float = 0.05,
            plain: pd.DataFrame | None = None, noise_floor: float = 0.0) -> pd.DataFrame:
    """Per prompt: exact match, first divergence, prefix agreement, and at the divergence the
    reference's top-1/top-2 logprob margin and whether the candidate took the runner-up.

    The margin is the reference's own where its logprob pass saw the context, else the median
    over the other `plain` runs' passes that did (`margin_from`: how many). kind: "match",
    "near-tie" (margin < near_tie), "within-noise" (margin <= noise_floor), "substantive" or
    "unscored" (no pass saw the context)."""
    c = cand.set_index("prompt_id")
    rows = []
    for _, r in ref.iterrows():
        if r.prompt_id not in c.index:
            continue
        o = c.loc[r.prompt_id]
        ref_ids, cand_ids = list(r.output_token_ids), list(o.output_token_ids)
        j = first_divergence(ref_ids, cand_ids)
        margin, sources, runner_up = math.nan, 0, -1
        if j is not None:
            margin = _pass_margin(r, ref_ids[:j], j)
            sources = int(not math.isnan(margin))
            if sources:
                runner_up = list(r.runner_up)[j]
            elif plain is not None and len(plain):
                others = plain[(plain.prompt_id == r.prompt_id)
                               & ~plain.point_id.isin([r.get("point_id"), o.get("point_id")])]
                found = [m for m in (_pass_margin(x, ref_ids[:j], j) for _, x in others.iterrows())
                         if not math.isnan(m)]
                if found:
                    margin, sources = float(np.median(found)), len(found)
        took = j is not None and j < len(cand_ids) and cand_ids[j] == runner_up
        if j is None:
            kind = "match"
        elif math.isnan(margin):
            kind = "unscored"
        elif margin < near_tie:
            kind = "near-tie"
        elif margin <= noise_floor:
            kind = "within-noise"
        else:
            kind = "substantive"
        rows.append({
            "prompt_id": r.prompt_id, "category": r.category, "n_tokens": len(ref_ids),
            "exact": j is None, "first_divergence": j,
            "prefix_agreement": 1.0 if j is None else j / max(len(ref_ids), 1),
            "margin": margin, "margin_from": sources, "took_runner_up": took, "kind": kind,
        })
    return pd.DataFrame(rows)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a proportion k/n."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, mid - half), min(1.0, mid + half))


def summarize(cmp: pd.DataFrame) -> dict:
    """Match rate with a Wilson 95% CI, divergence counts by kind, positions and margins."""
    n, exact = len(cmp), int(cmp.exact.sum()) if len(cmp) else 0
    div = cmp[~cmp.exact] if n else cmp
    lo, hi = wilson(exact, n)
    return {
        "n": n, "exact": exact, "match_rate": exact / n if n else math.nan,
        "match_lo": lo, "match_hi": hi,
        **{k.replace("-", "_"): int((div.kind == k).sum()) if n else 0
           for k in ("near-tie", "within-noise", "substantive", "unscored")},
        "took_runner_up": int(div.took_runner_up.sum()) if n else 0,
        "first_divergence": [int(x) for x in div.first_divergence] if n else [],
        "margins": [float(x) for x in div.margin] if n else [],
    }


# --------------------------------------------------------------------- experiment arms
@dataclass(frozen=True)
class Arm:
    name: str
    ref: Point
    cand: Point
    question: str


def plan(profile: Profile, arms: Sequence[str], *, k_values: Sequence[int] = (1, 2, 3, 4),
         spec_k: int = 3) -> list[Arm]:
    """Experiment arms as (reference, candidate) point pairs.

    arms: any of "spec" (plain vs k in k_values), "repeat" (plain twice), "draft-kv" (spec_k
    with each draft KV dtype of the grid), "target-kv" (each other target KV dtype: plain vs
    plain, and spec vs plain under it), "tp2-ep" (TP=2 + expert parallel: plain vs TP=1 plain,
    and spec vs plain at TP=2), "batch1" (one request at a time: plain vs plain, spec vs
    plain), "batch-invariant" (VLLM_BATCH_INVARIANT=1: spec vs plain)."""
    g = profile.grid
    dkv = g.draft_kv_cache_dtype[0]
    plain = Point(k=0, kv_cache_dtype=g.kv_cache_dtype[0], layout=g.layout[0],
                  prompt_format=g.prompt_format[0])

    def spec(p: Point, k: int = spec_k, d: str = dkv) -> Point:
        return p.model_copy(update={"k": k, "draft_kv_cache_dtype": d})

    out: list[Arm] = []
    for a in arms:
        if a == "spec":
            out += [Arm(f"spec-k{k}", plain, spec(plain, k), "speculation vs plain")
                    for k in k_values]
        elif a == "repeat":
            out.append(Arm("repeat", plain, plain.model_copy(update={"repeat": 1}),
                           "same plain configuration run twice"))
        elif a == "draft-kv":
            out += [Arm(f"draft-kv-{d}", plain, spec(plain, d=d), f"draft KV {d}")
                    for d in g.draft_kv_cache_dtype]
        elif a == "target-kv":
            for kv in g.kv_cache_dtype[1:]:
                p = plain.model_copy(update={"kv_cache_dtype": kv})
                out += [Arm(f"target-kv-{kv}-plain", plain, p, f"plain under target KV {kv}"),
                        Arm(f"target-kv-{kv}-spec", p, spec(p), f"speculation under target KV {kv}")]
        elif a == "tp2-ep":
            p = plain.model_copy(update={"layout": Layout(tp=2, ep=True)})
            out += [Arm("tp2-ep-plain", plain, p, "TP=2 + EP plain vs TP=1 plain"),
                    Arm("tp2-ep-spec", p, spec(p), "speculation under TP=2 + EP")]
        elif a == "batch1":
            p = plain.model_copy(update={"concurrency": 1})
            out += [Arm("batch1-plain", plain, p, "one request at a time vs all at once"),
                    Arm("batch1-spec", p, spec(p), "speculation, one request at a time")]
        elif a == "batch-invariant":
            p = plain.model_copy(update={"env": {"VLLM_BATCH_INVARIANT": "1"}})
            out += [Arm("batch-invariant-spec", p, spec(p),
                        "speculation vs plain with VLLM_BATCH_INVARIANT=1")]
        else:
            raise ValueError(f"unknown parity arm {a!r}")
    return out


def versus_plain(points: Sequence[Point]) -> list[Arm]:
    """Each speculative point against the plain point of the same configuration."""
    ids = {p.id for p in points}
    out = []
    for p in points:
        base = p.model_copy(update={"k": 0, "draft_kv_cache_dtype": None})
        if p.k > 0 and base.id in ids:
            out.append(Arm(p.id, base, p, f"k={p.k} vs plain"))
    return out


def points_of(arms: Sequence[Arm]) -> list[Point]:
    """The distinct points the arms need (shared references run once)."""
    seen: dict[str, Point] = {}
    for arm in arms:
        seen.setdefault(arm.ref.id, arm.ref)
        seen.setdefault(arm.cand.id, arm.cand)
    return list(seen.values())


SAME_RUN_FIELDS = ("target", "prompts", "max_tokens", "temperature", "ignore_eos",
                   "skip_tokenizer_init")


def plain_from_runs(profile: Profile, run_dirs: Sequence[Path | str],
                    base: Path | str = ".") -> pd.DataFrame:
    """The plain (k=0) records of other runs of the same target, prompts and sampling, with
    their point ids prefixed by the run folder's name: more passes for the margin lookup
    and the noise floor. A bare name is looked up under `base` (the runs folder). A run that
    differs in any of SAME_RUN_FIELDS is refused."""
    frames = []
    for d in map(Path, run_dirs):
        d = d if d.is_dir() else Path(base) / d
        if not (d / "profile.json").exists():
            raise ValueError(f"plain_runs: {d} is not a run folder (no profile.json)")
        other = load_profile(d)
        diff = [f for f in SAME_RUN_FIELDS if getattr(other, f) != getattr(profile, f)]
        if diff:
            raise ValueError(f"plain_runs: {d.name} differs from {profile.name} in {diff}; "
                             "its plain runs would not share the reference's contexts")
        recs = load_results(d)[1]
        if len(recs):
            recs = recs[recs.k == 0].copy()
            recs["point_id"] = d.name + ":" + recs.point_id
            frames.append(recs)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def noise_floor(records: pd.DataFrame) -> float:
    """The largest margin at which a plain run of `records` flipped its own argmax (0: none)."""
    flips = self_flips(records)
    return float(flips.margin.max()) if len(flips) else 0.0


def evaluate(arms: Sequence[Arm], records: pd.DataFrame, points: pd.DataFrame, *,
             near_tie: float = 0.05) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-arm summary, per-prompt comparisons) for the arms whose both points ran. Margins
    missing from a reference are looked up in the run's other plain runs; the noise floor is
    the run's (`noise_floor`)."""
    status = dict(zip(points.point_id, points.status)) if len(points) else {}
    plain = records[records.k == 0] if len(records) else records
    floor = noise_floor(records)
    summ, rows = [], []
    for arm in arms:
        missing = [f"{role} {pt.id} {status.get(pt.id) or 'has no result'}"
                   for role, pt in (("reference", arm.ref), ("candidate", arm.cand))
                   if status.get(pt.id) != "ok"]
        if missing:
            summ.append({"arm": arm.name, "question": arm.question,
                         "status": "not run: " + "; ".join(missing)})
            continue
        cmp = compare(records[records.point_id == arm.ref.id],
                      records[records.point_id == arm.cand.id], near_tie=near_tie,
                      plain=plain, noise_floor=floor)
        cmp.insert(0, "arm", arm.name)
        rows.append(cmp)
        summ.append({"arm": arm.name, "question": arm.question, "status": "ok",
                     "ref": arm.ref.id, "cand": arm.cand.id, "noise_floor": floor,
                     **summarize(cmp)})
    return pd.DataFrame(summ), (pd.concat(rows, ignore_index=True) if rows else pd.DataFrame())


def findings(summary: pd.DataFrame, near_tie: float, flips: pd.DataFrame | None = None,
             n_plain: int = 0) -> list[str]:
    """Plain-language findings, one line per arm (plus one on the plain runs' own flips when
    `flips` from `self_flips` over `n_plain` plain prompt-runs is given), from the summary."""
    lines = []
    if flips is not None and n_plain:
        text = (f"Plain reruns: the untimed second pass of a plain run left its timed output in "
                f"{len(flips)}/{n_plain} prompt-runs")
        if len(flips):
            text += (f", at top-1/top-2 margins up to {flips.margin.max():.3g} (median "
                     f"{flips.margin.median():.3g}): the target's own run-to-run noise floor")
        lines.append(text + ".")
    for _, s in summary.iterrows():
        if s.status != "ok":
            lines.append(f"{s.arm}: {s.status}.")
            continue
        # counts turn float when the summary also holds arms that did not run (NaN)
        n, exact = int(s.n), int(s.exact)
        text = (f"{s.arm} ({s.question}): {exact}/{n} prompts identical "
                f"({s.match_rate:.0%}, 95% CI {s.match_lo:.0%}-{s.match_hi:.0%})")
        nd = n - exact
        if nd:
            pos = sorted(s.first_divergence)
            text += (f"; {nd} diverged (first divergence at tokens {pos[:8]}"
                     f"{'...' if len(pos) > 8 else ''}), {int(s.near_tie)} at near-ties "
                     f"(margin < {near_tie})")
            if s.get("within_noise"):
                text += (f", {int(s.within_noise)} within the plain runs' own noise (margin <= "
                         f"{s.noise_floor:.3g})")
            if s.get("unscored"):
                text += f", {int(s.unscored)} unscored (no plain pass saw that context)"
            text += f", {int(s.took_runner_up)} took the reference's runner-up"
            if s.substantive:
                floor = max(near_tie, s.get("noise_floor", 0) or 0)
                text += (f"; {int(s.substantive)} SUBSTANTIVE (margin > {floor:.3g}): not "
                         "explained by a near-tie or the target's own noise, investigate")
        lines.append(text + ".")
    return lines
