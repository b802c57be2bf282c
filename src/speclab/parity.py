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
and "unscored" when no plain pass of the run saw its context (no margin to judge it by) and
rescoring (`multipass.rescore`: the prefix re-run through the plain engine with logprobs) has
not filled it in.

The analysis is pre-registered (`Settings`, from the profile's `parity:` block): near-tie
threshold, noise-floor method (measured by the plain-repeat arm "noise": plain passes in
separate engines and in one engine, every pair compared), the acceptance tolerance against the
CPU reference's expected counters, and the share of runs that makes a defect size "detected".
Positive controls (`controls`: injected defects of known size, `speclab.defects`) measure
what the analysis can detect (`power`, `resolution`). Other settings are a named re-analysis.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from speclab.defects import Defect
from speclab.metrics import first_divergence
from speclab.multipass import GROUP_ENV, Group, prefix_sha, same_engine_repeats
from speclab.profiles import Layout, Point, Profile
from speclab.store import load_profile, load_results

KINDS = ("near-tie", "within-noise", "substantive", "unscored")
# expected counters along a run's own plain greedy path (tools/expected_neartie.py --along)
PLAIN_PATH_FILE = "expected_plain_path.json"
EXPECTED_FROM = ("reference", "plain-path")


@dataclass(frozen=True)
class Settings:
    """The pre-registered analysis: near-tie threshold (nats), noise-floor method ("max-flip"
    or a fixed value in nats), acceptance tolerance (absolute, acceptance rate), and the share
    of a defect size's runs that must be flagged for it to count as detected. Acceptance is
    compared with the profile's CPU reference (`expected_from="reference"`) or with the
    counters expected along the run's own plain greedy path (`"plain-path"`,
    `PLAIN_PATH_FILE` in the run folder)."""

    name: str = "pre-registered"
    near_tie: float = 0.05
    noise_floor: str | float = "max-flip"
    acceptance_tolerance: float = 0.01
    detect_share: float = 1.0
    expected_from: str = "reference"

    def __post_init__(self):
        if self.expected_from not in EXPECTED_FROM:
            raise ValueError(f"expected_from {self.expected_from!r}: one of {EXPECTED_FROM}")

    def describe(self) -> str:
        floor = (f"{self.noise_floor:g} nats (fixed)" if isinstance(self.noise_floor, float)
                 else "the largest margin at which two plain passes of the run diverged "
                      "(max-flip)")
        ref = ("the CPU reference" if self.expected_from == "reference" else
               f"the counters expected along this run's plain greedy path ({PLAIN_PATH_FILE})")
        return (f"{self.name}: near-tie below {self.near_tie:g} nats; noise floor {floor}; a "
                f"divergence above both is SUBSTANTIVE and flags its arm; an arm whose "
                f"acceptance rate is more than {self.acceptance_tolerance:g} from {ref} is "
                f"flagged too; a defect size is detected when >= "
                f"{self.detect_share:.0%} of its runs are flagged")


def settings(profile: Profile, name: str = "pre-registered", **overrides) -> Settings:
    """The profile's pre-registered settings, or a named re-analysis overriding some."""
    p = profile.parity
    base = Settings(name, p.near_tie, p.noise_floor, p.acceptance_tolerance, p.detect_share)
    if "noise_floor" in overrides and not isinstance(overrides["noise_floor"], str):
        overrides["noise_floor"] = float(overrides["noise_floor"])
    return replace(base, **overrides)


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
            plain: pd.DataFrame | None = None, noise_floor: float = 0.0,
            rescored: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per prompt: exact match, first divergence, prefix agreement, and at the divergence the
    reference's top-1/top-2 logprob margin and whether the candidate took the runner-up.

    The margin is the reference's own where its logprob pass saw the context, else the median
    over the other `plain` runs' passes that did (`margin_from`: how many), else the plain
    engine's margin after that prefix from `rescored` (`multipass.rescore`). margin_source
    says which. kind: "match", "near-tie" (margin < near_tie), "within-noise" (margin <=
    noise_floor), "substantive" or "unscored" (no margin; `prefix` holds the context to
    rescore)."""
    c = cand.set_index("prompt_id")
    rows = []
    for _, r in ref.iterrows():
        if r.prompt_id not in c.index:
            continue
        o = c.loc[r.prompt_id]
        ref_ids, cand_ids = list(r.output_token_ids), list(o.output_token_ids)
        j = first_divergence(ref_ids, cand_ids)
        margin, sources, runner_up, source = math.nan, 0, -1, "none"
        if j is not None:
            margin = _pass_margin(r, ref_ids[:j], j)
            sources = int(not math.isnan(margin))
            if sources:
                runner_up, source = list(r.runner_up)[j], "reference"
            elif plain is not None and len(plain):
                others = plain[(plain.prompt_id == r.prompt_id)
                               & ~plain.point_id.isin([r.get("point_id"), o.get("point_id")])]
                found = [(m, x) for m, x in ((_pass_margin(x, ref_ids[:j], j), x)
                                             for _, x in others.iterrows()) if not math.isnan(m)]
                if found:
                    margin, sources = float(np.median([m for m, _ in found])), len(found)
                    runner_up, source = list(found[0][1].runner_up)[j], "plain passes"
            if math.isnan(margin) and rescored is not None and len(rescored):
                hit = rescored[(rescored.prompt_id == r.prompt_id)
                               & (rescored.prefix_sha == prefix_sha(ref_ids[:j]))]
                if len(hit):
                    margin, sources = float(hit.margin.iloc[0]), 1
                    runner_up, source = int(hit.runner_up.iloc[0]), "rescored"
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
            "margin": margin, "margin_from": sources, "margin_source": source,
            "took_runner_up": took, "kind": kind,
            "prefix": ref_ids[:j] if kind == "unscored" else None,
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
    role: str = "arm"  # "noise" (plain-repeat arm), "control" (injected defect) or "arm"
    defect: Defect | None = None


def plan(profile: Profile, arms: Sequence[str], *, k_values: Sequence[int] = (1, 2, 3, 4),
         spec_k: int = 3) -> list[Arm]:
    """Experiment arms as (reference, candidate) point pairs.

    arms: any of "spec" (plain vs k in k_values), "repeat" (plain twice), "noise" (the
    plain-repeat arm: `profile.parity.noise_passes` plain passes in separate engines and as
    many in one engine, every pair within each set compared), "draft-kv" (spec_k
    with each draft KV dtype of the grid), "target-kv" (each other target KV dtype: plain vs
    plain, and spec vs plain under it), "tp2-ep" (TP=2 + expert parallel: plain vs TP=1 plain,
    and spec vs plain at TP=2), "batch1" (one request at a time: plain vs plain, spec vs
    plain), "batch-invariant" (VLLM_BATCH_INVARIANT=1: plain vs plain, spec vs plain under
    it), "cuda-graphs" (the profile's `enforce_eager` flipped, so CUDA graphs on where the
    profile is eager and off where it is not: plain vs plain, spec vs plain under it). The
    profile's `parity.controls` (injected defects) are appended to any plan."""
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
        elif a == "noise":
            n = profile.parity.noise_passes
            sep = [plain] + [plain.model_copy(update={"repeat": i}) for i in range(1, n)]
            same = same_engine_repeats("noise", plain, n).passes
            for label, pts, how in (("sep", sep, "separate engines"), ("same", same, "one engine")):
                out += [Arm(f"noise-{label}-{i}v{j}", pts[i], pts[j],
                            f"plain vs plain, {how}", role="noise")
                        for i in range(n) for j in range(i + 1, n)]
        elif a == "draft-kv":
            out += [Arm(f"draft-kv-{d}", plain, spec(plain, d=d), f"draft KV {d}")
                    for d in g.draft_kv_cache_dtype]
        elif a == "target-kv":
            for kv in g.kv_cache_dtype[1:]:
                p = plain.model_copy(update={"kv_cache_dtype": kv})
                out += [Arm(f"target-kv-{kv}-plain", plain, p, f"plain under target KV {kv}"),
                        Arm(f"target-kv-{kv}-spec", p, spec(p),
                            f"speculation under target KV {kv}")]
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
            out += [Arm("batch-invariant-plain", plain, p,
                        "plain with VLLM_BATCH_INVARIANT=1 vs plain"),
                    Arm("batch-invariant-spec", p, spec(p),
                        "speculation vs plain with VLLM_BATCH_INVARIANT=1")]
        elif a == "cuda-graphs":
            eager = not profile.engine.get("enforce_eager", False)
            p = plain.model_copy(update={"engine": {"enforce_eager": eager}})
            graphs = "off" if eager else "on"
            out += [Arm(f"cuda-graphs-{graphs}-plain", plain, p,
                        f"plain with CUDA graphs {graphs} vs the profile's plain"),
                    Arm(f"cuda-graphs-{graphs}-spec", p, spec(p),
                        f"speculation vs plain with CUDA graphs {graphs}")]
        else:
            raise ValueError(f"unknown parity arm {a!r}")
    return out + controls(profile, plain, spec_k, spec)


def controls(profile: Profile, plain: Point, spec_k: int, spec) -> list[Arm]:
    """Positive controls: the spec point with each injected defect, against plain. Biases of
    one kind and k share one engine (one pass each); an aux-layers defect gets its own."""
    out = []
    for c in profile.parity.controls:
        k = c.k or spec_k
        sp = spec(plain, k)
        if c.kind == "aux-layers":
            d = Defect(kind=c.kind, aux_ids=c.aux_ids)
            cand = sp.model_copy(update={"env": {**d.env(), GROUP_ENV: f"{d.label}-k{k}"}})
            out.append(Arm(f"{d.label}-k{k}", plain, cand,
                           f"k={k}, draft fed aux layers {c.aux_ids}", "control", d))
            continue
        for size in c.sizes:
            for seed in c.seeds:
                d = Defect(kind=c.kind, size=size, share=c.share, seed=seed)
                cand = sp.model_copy(update={"env": {**d.env(), GROUP_ENV: f"{c.kind}-k{k}"}})
                out.append(Arm(f"{d.label}-k{k}", plain, cand,
                               f"k={k}, {c.kind} {size:g} nats at {c.share:.0%} of positions",
                               "control", d))
    return out


def versus_plain(points: Sequence[Point]) -> list[Arm]:
    """Each speculative point against the plain point of the same configuration."""
    ids = {p.id for p in points}
    out = []
    for p in points:
        base = p.model_copy(update={"k": 0, "draft_kv_cache_dtype": None,
                                    "aux_layer_convention": None})
        if p.k > 0 and base.id in ids:
            out.append(Arm(p.id, base, p, f"k={p.k} vs plain"))
    return out


def points_of(arms: Sequence[Arm], *, grouped: bool | None = False) -> list[Point]:
    """The distinct points the arms need (shared references run once): those the sweep runs
    one engine each (grouped=False), those `groups_of` runs (True) or all (None)."""
    seen: dict[str, Point] = {}
    for arm in arms:
        for p in (arm.ref, arm.cand):
            if grouped is None or (GROUP_ENV in p.env) == grouped:
                seen.setdefault(p.id, p)
    return list(seen.values())


def groups_of(arms: Sequence[Arm]) -> list[Group]:
    """The engines that run several passes (`multipass.run_groups`): one per group name.
    Bias defects are set per pass; an aux-layers defect is part of its engine."""
    from speclab import defects

    groups: dict[str, list[Point]] = {}
    for p in points_of(arms, grouped=True):
        groups.setdefault(p.env[GROUP_ENV], []).append(p)
    out = []
    for name, passes in groups.items():
        d = defects.from_env(passes[0].env)
        keep = {defects.ENV} if d is not None and d.kind == "aux-layers" else set()
        env = {k: v for k, v in passes[0].env.items()
               if k not in (GROUP_ENV, defects.ENV) or k in keep}
        out.append(Group(name, passes[0].model_copy(update={"env": env, "repeat": 0}),
                         tuple(passes)))
    return out


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


def floor_from(noise_cmp: pd.DataFrame, flips: pd.DataFrame, st: Settings) -> dict:
    """The noise floor and its uncertainty from the plain-repeat arm's comparisons (every
    pair of plain passes) and the plain runs' self-flips (timed vs logprob pass).

    max-flip: the largest margin among those divergences (0: none). With n scored flips, a
    further flip exceeds the largest with probability 1/(n + 1) (exchangeability); the flip
    rate per prompt-pair carries a Wilson 95% CI."""
    div = noise_cmp[~noise_cmp.exact] if len(noise_cmp) else noise_cmp
    margins = list(div.margin) if len(div) else []
    margins += list(flips.margin) if len(flips) else []
    scored = [m for m in margins if not math.isnan(m)]
    pairs = len(noise_cmp)
    n_div = len(div)
    lo, hi = wilson(n_div, pairs)
    measured = max(scored) if scored else 0.0
    floor = st.noise_floor if isinstance(st.noise_floor, float) else measured
    return {"method": st.noise_floor if isinstance(st.noise_floor, str) else "fixed",
            "floor": float(floor), "measured_max_flip": float(measured),
            "flips": len(scored), "unscored_flips": len(margins) - len(scored),
            "prompt_pairs": pairs, "diverged_pairs": n_div,
            "flip_rate": n_div / pairs if pairs else math.nan, "flip_rate_lo": lo,
            "flip_rate_hi": hi, "self_flips": len(flips),
            "exceed_prob": 1 / (len(scored) + 1),
            "median_flip_margin": float(np.median(scored)) if scored else math.nan}


def load_expected(path: Path | str | None) -> dict | None:
    """Expected counters per k from the CPU reference (`tools/expected_neartie.py` output)."""
    if not path:
        return None
    return json.loads(Path(path).read_text())["counters"]


def expected_for(st: Settings, reference: dict | None, run_dir: Path | str) -> dict | None:
    """The expected counters analysis `st` compares acceptance with: the CPU reference, or
    the run's plain-path file (None when the run has none: acceptance is then not judged)."""
    if st.expected_from == "reference":
        return reference
    path = Path(run_dir) / PLAIN_PATH_FILE
    return load_expected(path if path.exists() else None)


def acceptance(points: pd.DataFrame, point_id: str, k: int, expected: dict | None) -> dict:
    """The candidate's acceptance from the engine's counters, next to the CPU reference's."""
    row = points[points.point_id == point_id]
    if not k or not len(row) or "counters.num_drafts" not in row:
        return {}
    r = row.iloc[0]
    drafts, acc = r["counters.num_drafts"], r["counters.num_accepted_tokens"]
    if pd.isna(drafts) or not drafts:
        return {}
    out = {"al": 1 + acc / drafts, "acceptance_rate": acc / (drafts * k),
           "accepted_share": acc / r.output_tokens if r.get("output_tokens") else math.nan}
    e = (expected or {}).get(str(k))
    if e:
        out["expected_al"] = e["mean_acceptance_length"]
        out["expected_rate"] = e["num_accepted_tokens"] / max(e["num_drafts"] * k, 1)
    return out


def evaluate(arms: Sequence[Arm], records: pd.DataFrame, points: pd.DataFrame, *,
             near_tie: float = 0.05) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-arm summary, per-prompt comparisons) under a near-tie threshold and the max-flip
    noise floor (`analyze` for the full analysis)."""
    a = analyze(arms, records, points, Settings(near_tie=near_tie))
    return a.summary, a.cmp


@dataclass
class Analysis:
    settings: Settings
    summary: pd.DataFrame
    cmp: pd.DataFrame
    floor: dict


def analyze(arms: Sequence[Arm], records: pd.DataFrame, points: pd.DataFrame,
            st: Settings, *, rescored: pd.DataFrame | None = None,
            expected: dict | None = None) -> Analysis:
    """Per-arm summary, per-prompt comparisons and the noise floor for the arms whose both
    points ran, under settings `st`.

    The noise floor comes from the "noise" arms and the plain runs' self-flips (`floor_from`).
    Margins missing from a reference come from the run's other plain passes, then from
    `rescored`. Each arm is flagged by parity (a SUBSTANTIVE divergence) and, with `expected`
    counters, by acceptance (rate off the reference by more than the tolerance)."""
    status = dict(zip(points.point_id, points.status)) if len(points) else {}
    plain = records[records.k == 0] if len(records) else records
    ran = [a for a in arms if status.get(a.ref.id) == "ok" and status.get(a.cand.id) == "ok"]

    def cmp_of(arm: Arm, floor: float) -> pd.DataFrame:
        c = compare(records[records.point_id == arm.ref.id],
                    records[records.point_id == arm.cand.id], near_tie=st.near_tie,
                    plain=plain, noise_floor=floor, rescored=rescored)
        c.insert(0, "arm", arm.name)
        return c

    noise = [cmp_of(a, 0.0) for a in ran if a.role == "noise"]
    noise_cmp = pd.concat(noise, ignore_index=True) if noise else pd.DataFrame(
        columns=["exact", "margin"])
    floor = floor_from(noise_cmp, self_flips(records) if len(records) else pd.DataFrame(
        columns=["margin"]), st)
    summ, rows = [], []
    for arm in arms:
        base = {"analysis": st.name, "arm": arm.name, "role": arm.role, "question": arm.question,
                **_defect_cols(arm, points)}
        if arm not in ran:
            missing = [f"{role} {pt.id} {status.get(pt.id) or 'has no result'}"
                       for role, pt in (("reference", arm.ref), ("candidate", arm.cand))
                       if status.get(pt.id) != "ok"]
            summ.append({**base, "status": "not run: " + "; ".join(missing)})
            continue
        cmp = cmp_of(arm, floor["floor"])
        rows.append(cmp)
        s = summarize(cmp)
        acc = acceptance(points, arm.cand.id, arm.cand.k, expected)
        acc_flag = bool("expected_rate" in acc and abs(acc["acceptance_rate"] - acc[
            "expected_rate"]) > st.acceptance_tolerance)
        summ.append({**base, "status": "ok", "ref": arm.ref.id, "cand": arm.cand.id,
                     "noise_floor": floor["floor"], **s, **acc,
                     "flagged_parity": s["substantive"] > 0, "flagged_acceptance": acc_flag,
                     "flagged": s["substantive"] > 0 or acc_flag})
    cmp_all = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()
    return Analysis(st, pd.DataFrame(summ), cmp_all, floor)


def _defect_cols(arm: Arm, points: pd.DataFrame) -> dict:
    if arm.defect is None:
        return {}
    d = arm.defect
    out = {"defect": d.kind, "size": d.size if d.kind != "aux-layers" else math.nan,
           "share": d.share, "seed": d.seed}
    row = points[points.point_id == arm.cand.id] if len(points) else points
    for col in ("rows_hit", "argmax_changed"):
        c = f"defect.{col}"
        if len(row) and c in row and not pd.isna(row[c].iloc[0]):
            out[f"defect_{col}"] = int(row[c].iloc[0])
    return out


def rescore_requests(cmp: pd.DataFrame) -> pd.DataFrame:
    """The unscored divergences' contexts, for `multipass.rescore`."""
    if not len(cmp) or "prefix" not in cmp:
        return pd.DataFrame(columns=["prompt_id", "position", "prefix"])
    u = cmp[cmp.kind == "unscored"]
    return pd.DataFrame({"prompt_id": u.prompt_id, "position": u.first_divergence.astype(int),
                         "prefix": u.prefix})


def power(summary: pd.DataFrame) -> pd.DataFrame:
    """Detection power per defect and size: runs, and how many the parity analysis flagged, the
    acceptance check flagged, either flagged; with what the defect did (positions hit, target
    argmaxes it changed, prompts diverged, SUBSTANTIVE divergences, largest divergence margin)."""
    cols = ["defect", "size", "runs", "flagged_parity", "flagged_acceptance", "flagged",
            "positions_hit", "argmax_changed", "diverged", "substantive", "max_margin"]
    c = summary[(summary.role == "control") & (summary.status == "ok")] if len(summary) else summary
    if not len(c):
        return pd.DataFrame(columns=cols)
    rows = []
    for (kind, size), g in c.groupby(["defect", c["size"].fillna(-1.0)], sort=True):
        margins = [m for ms in g.margins for m in ms if not math.isnan(m)]
        tot = {col: int(g[col].fillna(0).sum()) if col in g else 0
               for col in ("flagged_parity", "flagged_acceptance", "flagged", "defect_rows_hit",
                           "defect_argmax_changed", "substantive")}
        rows.append({"defect": kind, "size": None if size < 0 else float(size), "runs": len(g),
                     "flagged_parity": tot["flagged_parity"],
                     "flagged_acceptance": tot["flagged_acceptance"],
                     "flagged": tot["flagged"], "positions_hit": tot["defect_rows_hit"],
                     "argmax_changed": tot["defect_argmax_changed"],
                     "diverged": int((g.n - g.exact).sum()), "substantive": tot["substantive"],
                     "max_margin": max(margins) if margins else math.nan})
    return pd.DataFrame(rows, columns=cols)


def resolution(pw: pd.DataFrame, detect_share: float, by: str = "flagged_parity") -> dict:
    """Per defect kind, the smallest size whose share of flagged runs (column `by`) reaches
    `detect_share` (None: no size detected)."""
    out = {}
    for kind, g in pw.groupby("defect"):
        hit = g[g[by] >= detect_share * g.runs]
        out[kind] = None if not len(hit) else (
            float(hit["size"].min()) if hit["size"].notna().any() else "detected")
    return out


def findings(summary: pd.DataFrame, near_tie: float, flips: pd.DataFrame | None = None,
             n_plain: int = 0, floor: dict | None = None) -> list[str]:
    """Plain-language findings, one line per arm (plus one on the plain runs' own flips when
    `flips` from `self_flips` over `n_plain` plain prompt-runs is given, and one on the noise
    arm's floor when `floor` from `evaluate` is), from the summary."""
    lines = []
    if flips is not None and n_plain:
        text = (f"Plain reruns: the untimed second pass of a plain run left its timed output in "
                f"{len(flips)}/{n_plain} prompt-runs")
        if len(flips):
            text += (f", at top-1/top-2 margins up to {flips.margin.max():.3g} (median "
                     f"{flips.margin.median():.3g}): the target's own run-to-run noise floor")
        lines.append(text + ".")
    if floor and floor.get("prompt_pairs"):
        lines.append(
            f"Noise arm: plain passes diverged in {floor['diverged_pairs']}/"
            f"{floor['prompt_pairs']} prompt-pairs (rate 95% CI {floor['flip_rate_lo']:.1%}-"
            f"{floor['flip_rate_hi']:.1%}), {floor['flips']} scored flips plus "
            f"{floor['self_flips']} self-flips counted; noise floor ({floor['method']}) = "
            f"{floor['floor']:.3g} nats (a further flip exceeds the largest with probability "
            f"<= {floor['exceed_prob']:.2f}).")
    for _, s in summary.iterrows():
        if s.status != "ok":
            lines.append(f"{s.arm}: {s.status}.")
            continue
        # counts turn float when the summary also holds arms that did not run (NaN)
        n, exact = int(s.n), int(s.exact)
        text = (f"{s.arm} ({s.question}): {exact}/{n} prompts identical "
                f"({s.match_rate:.0%}, 95% CI {s.match_lo:.0%}-{s.match_hi:.0%})")
        if not pd.isna(s.get("al", math.nan)):
            text += f"; AL {s.al:.2f}, acceptance {s.acceptance_rate:.3f}"
            if not pd.isna(s.get("expected_rate", math.nan)):
                text += f" (CPU reference {s.expected_rate:.3f})"
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
                floor_v = max(near_tie, s.get("noise_floor", 0) or 0)
                text += (f"; {int(s.substantive)} SUBSTANTIVE (margin > {floor_v:.3g}): not "
                         "explained by a near-tie or the target's own noise, investigate")
        if s.get("flagged_acceptance"):
            text += "; ACCEPTANCE off the CPU reference beyond tolerance"
        lines.append(text + ".")
    return lines


KIND_COLUMNS = ("near_tie", "within_noise", "substantive", "unscored")


def power_findings(pw: pd.DataFrame, res: dict, st: Settings,
                   summary: pd.DataFrame | None = None) -> list[str]:
    """Lines on the positive controls: each defect size's flagged runs per detector and what
    the defect did, then the resolution (smallest size detected) per detector; with
    `summary`, how many healthy arms (no defect) were flagged."""
    lines = []
    for _, r in pw.iterrows():
        size = "" if pd.isna(r["size"]) else f" {r['size']:g} nats"
        lines.append(
            f"Control {r.defect}{size}: flagged in {r.flagged_parity}/{r.runs} runs by parity, "
            f"{r.flagged_acceptance}/{r.runs} by acceptance ({r.flagged}/{r.runs} by either); "
            f"it hit {r.positions_hit} verified positions and changed the target's argmax at "
            f"{r.argmax_changed}, {r.diverged} prompt-runs diverged, {r.substantive} "
            f"SUBSTANTIVE" + ("" if pd.isna(r.max_margin) else
                               f", largest margin at a divergence {r.max_margin:.3g}") + ".")
    names = {"flagged_parity": "parity analysis", "flagged_acceptance": "acceptance check",
             "flagged": "either"}
    for by, per_kind in res.items():
        if not per_kind:
            continue
        parts = [f"{k}: " + ("not detected at any size tried" if v is None else
                             v if isinstance(v, str) else f"{v:g} nats")
                 for k, v in per_kind.items()]
        lines.append(f"Resolution of the {names.get(by, by)} (smallest defect flagged in >= "
                     f"{st.detect_share:.0%} of its runs): " + "; ".join(parts) + ".")
    if summary is not None and len(summary):
        ok = summary[(summary.status == "ok") & (summary.role != "control")]
        if len(ok):
            lines.append(f"Healthy arms flagged (false alarms): {int(ok.flagged.sum())}/{len(ok)}.")
    return lines


def recorded_analysis(run_dir: Path | str) -> dict:
    """The near-tie threshold and noise floor notebook 03 recorded for a run ({} before it
    ran; runs older than the noise arm: the largest self-flip), so that other views (the
    explorer) classify divergences exactly as the report does."""
    from speclab import notebook

    nb = Path(run_dir) / "notebooks" / "03_parity.ipynb"
    if not nb.exists():
        return {}
    rec = notebook.read_records(nb)
    floor = (rec.get("noise") or {}).get("floor")
    if floor is None:
        floor = max((f["margin"] for f in rec.get("self_flips") or []), default=0.0)
    return {"near_tie": rec.get("near_tie"), "noise_floor": floor}
