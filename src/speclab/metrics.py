"""Speculative-decoding counters and what follows from them.

Definitions follow vLLM (see README "Metrics"): with D drafts (verify steps that carried a
draft), T drafted tokens, A accepted tokens and A_i drafts whose position i was accepted,
    acceptance rate = A / T,  mean acceptance length AL = 1 + A / D,
    per-position (unconditional, as vLLM prints) p_i = A_i / D,  sum_i p_i = AL - 1,
    conditional c_0 = p_0, c_i = A_i / A_{i-1}.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

PREFIX = "vllm:spec_decode_"
NAMES = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative (or delta) spec-decode counters of one engine or one request."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        a, b = _pad(self.accepted_per_pos, n), _pad(before.accepted_per_pos, n)
        return SpecCounters(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            tuple(x - y for x, y in zip(a, b)),
        )

    def __add__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a, b = _pad(self.accepted_per_pos, n), _pad(other.accepted_per_pos, n)
        return SpecCounters(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            tuple(x + y for x, y in zip(a, b)),
        )

    @property
    def acceptance_rate(self) -> float:
        return _div(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + _div(self.num_accepted_tokens, self.num_drafts)

    @property
    def per_position(self) -> list[float]:
        return [_div(a, self.num_drafts) for a in self.accepted_per_pos]

    @property
    def conditional(self) -> list[float]:
        return conditional_rates(self.accepted_per_pos, self.num_drafts)

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position": self.per_position,
            "conditional": self.conditional,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SpecCounters:
        return cls(
            int(d["num_drafts"]),
            int(d["num_draft_tokens"]),
            int(d["num_accepted_tokens"]),
            tuple(int(x) for x in d["accepted_per_pos"]),
        )


def _pad(xs: Sequence[int], n: int) -> list[int]:
    return list(xs) + [0] * (n - len(xs))


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def conditional_rates(accepted_per_pos: Sequence[float], num_drafts: float) -> list[float]:
    """c_0 = A_0 / D, c_i = A_i / A_{i-1} (NaN where the denominator is 0)."""
    denoms = [num_drafts, *accepted_per_pos[:-1]]
    return [_div(a, d) for a, d in zip(accepted_per_pos, denoms)]


# --------------------------------------------------------------------- sources
def from_snapshot(metrics: Iterable) -> SpecCounters:
    """Counters from `LLM.get_metrics()` (vllm.v1.metrics.reader objects), summed over
    engines and label sets. Needs `LLM(disable_log_stats=False)`."""
    totals = dict.fromkeys(NAMES, 0)
    per_pos: list[int] = []
    for m in metrics:
        short = m.name.removeprefix(PREFIX)
        if not m.name.startswith(PREFIX):
            continue
        if short == PER_POS:
            per_pos = [x + y for x, y in zip(_pad(per_pos, len(m.values)), m.values)]
        elif short in totals:
            totals[short] += int(m.value)
    return SpecCounters(*(totals[n] for n in NAMES), tuple(per_pos))


def from_prometheus(text: str) -> SpecCounters:
    """Counters from a server's `/metrics` text (Prometheus exposition format)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(NAMES, 0.0)
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(PREFIX) or s.name.endswith("_created"):
                continue
            short = s.name.removeprefix(PREFIX).removesuffix("_total")
            if short == PER_POS:
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            elif short in totals:
                totals[short] += s.value
    vec = tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos, default=-1) + 1))
    return SpecCounters(*(int(totals[n]) for n in NAMES), vec)


_LOG_FIELDS = {
    "mean_acceptance_length": r"Mean acceptance length:\s*([0-9.]+|nan)",
    "accepted": r"Accepted:\s*(\d+)\s*tokens",
    "drafted": r"Drafted:\s*(\d+)\s*tokens",
    "acceptance_pct": r"(?:Avg )?Draft acceptance rate:\s*([0-9.]+|nan)%",
    "per_position": r"Per-position acceptance rate:\s*((?:[0-9.]+|nan)(?:,\s*(?:[0-9.]+|nan))*)",
}


def _float(text: str, field: str) -> float | None:
    """A logged number; "nan" → None (JSON null); anything else unparsable → ValueError."""
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"malformed {field}: {text.strip()!r}") from None
    return None if math.isnan(x) else x


def parse_log_line(line: str) -> dict | None:
    """One `SpecDecoding metrics:` log line → dict, by field name (both vLLM wordings:
    older lines start with `Draft acceptance rate: x%` and may lack the mean acceptance
    length and per-position fields); NaN values are None. Returns None for other lines and
    raises ValueError (naming the field) for a matching line with a malformed number or with
    none of the fields."""
    if "SpecDecoding metrics:" not in line:
        return None
    body = line.split("SpecDecoding metrics:", 1)[1]
    found = {k: re.search(p, body) for k, p in _LOG_FIELDS.items()}
    if not any(found.values()):
        raise ValueError("no counters or rates after 'SpecDecoding metrics:'")
    accepted = int(found["accepted"].group(1)) if found["accepted"] else None
    drafted = int(found["drafted"].group(1)) if found["drafted"] else None
    if found["acceptance_pct"]:
        pct = _float(found["acceptance_pct"].group(1), "draft acceptance rate")
        rate = None if pct is None else pct / 100.0
    else:
        rate = _div(accepted, drafted) if accepted is not None and drafted else None
    al = found["mean_acceptance_length"]
    pp = found["per_position"]
    return {
        "accepted": accepted,
        "drafted": drafted,
        "acceptance_rate": rate,
        "mean_acceptance_length": _float(al.group(1), "mean acceptance length") if al else None,
        "per_position": [_float(x, "per-position acceptance rate")
                         for x in pp.group(1).split(",")] if pp else [],
    }


_LOG_TIME = re.compile(r"(?:\d{4}-)?\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?")


def scan_log(text: str):
    """Each `SpecDecoding metrics:` line of a log as (line number, timestamp as logged or
    None, record or None, error or None): a malformed line yields its error and the scan
    goes on."""
    for n, line in enumerate(text.splitlines(), start=1):
        if "SpecDecoding metrics:" not in line:
            continue
        ts = _LOG_TIME.search(line.split("SpecDecoding metrics:", 1)[0])
        try:
            yield n, ts.group(0) if ts else None, parse_log_line(line), None
        except ValueError as e:
            yield n, ts.group(0) if ts else None, None, str(e)


def parse_log(text: str) -> list[dict]:
    """Every `SpecDecoding metrics:` line of a log, in order; ValueError (with the line
    number) at the first malformed one."""
    out = []
    for n, _, rec, err in scan_log(text):
        if err:
            raise ValueError(f"line {n}: {err}")
        out.append(rec)
    return out


# --------------------------------------------------------------------- per request
def request_counters(step_tokens: Sequence[int], k: int, *, finished: bool = False
                     ) -> SpecCounters:
    """Counters of one request from the tokens it gained at each engine step.

    The first step that emits tokens is the prefill (no draft); every later step that emits
    n tokens verified k drafts and accepted n-1 of them (chain drafting: positions 0..n-2).
    Steps that emit nothing (chunked prefill, scheduling gaps) are skipped. finished: the
    request ended (max_tokens or a stop token), which can cut its last round short: vLLM
    counts the whole round, the request keeps fewer tokens. That round is left out
    (`dropped_rounds` counts it; `attribution` checks the rest against the engine)."""
    emitted = [n for n in step_tokens if n > 0][1:]
    if finished:
        emitted = emitted[:-1]
    if k <= 0:
        return SpecCounters()
    per_pos = [0] * k
    for n in emitted:
        for i in range(min(n - 1, k)):
            per_pos[i] += 1
    return SpecCounters(len(emitted), k * len(emitted), sum(per_pos), tuple(per_pos))


def dropped_rounds(step_tokens: Sequence[int], finished: bool) -> int:
    """1 if `request_counters(..., finished=finished)` leaves out a final verify round."""
    return int(finished and sum(n > 0 for n in step_tokens) >= 2)


def attribution(engine: SpecCounters, requests: SpecCounters, n_dropped: int) -> str:
    """How per-request counters relate to the engine's: "exact" (equal), "consistent" (the
    difference is what the n_dropped left-out final rounds can account for: one draft each,
    at most one acceptance per position each) or "mismatch" (steps merged or lost: the
    per-request attribution cannot be trusted)."""
    if engine == requests:
        return "exact"
    k = max(len(engine.accepted_per_pos), len(requests.accepted_per_pos))
    diff = engine - requests
    ok = (diff.num_drafts == n_dropped and diff.num_draft_tokens == k * n_dropped
          and all(0 <= d <= n_dropped for d in diff.accepted_per_pos))
    return "consistent" if ok else "mismatch"


def native_counters(spec_decode: dict) -> SpecCounters:
    """One request's counters as vLLM reports them itself (vLLM >= 0.29 with
    `per_request_spec_decode_metrics`: `CompletionOutput.spec_decode_metrics.to_dict()`, a
    response's `metrics.speculative_decoding`). Its `acceptance_histogram[j]` counts the
    verify steps that accepted j drafts; under chain drafting position i was accepted in
    the steps that accepted more than i. Every verify round counts, a request's last one in
    full, as in the engine's counters."""
    hist = [int(x) for x in spec_decode["acceptance_histogram"]]
    return SpecCounters(int(spec_decode["num_spec_steps"]), int(spec_decode["num_draft_tokens"]),
                        int(spec_decode["num_accepted_draft_tokens"]),
                        tuple(sum(hist[i + 1:]) for i in range(len(hist) - 1)))


def steps_agree(step_tokens: Sequence[int], finished: bool,
                per_step_accepted: Sequence[int]) -> bool:
    """Whether tokens per step (the stepped engine's steps, or streamed chunks) show the
    verify steps vLLM recorded for the request (`per_step_accepted`, its "detailed" level):
    after the prefill, one emitting step per verify step with 1 + its accepted drafts; a
    finished request's last step may emit fewer (cut at max_tokens or a stop token)."""
    seen = [n - 1 for n in step_tokens if n > 0][1:]
    want = [int(x) for x in per_step_accepted]
    if len(seen) != len(want):
        return False
    if finished and want:
        return seen[:-1] == want[:-1] and seen[-1] <= want[-1]
    return seen == want


def steps_merged(step_tokens: Sequence[int], finished: bool,
                 per_step_accepted: Sequence[int]) -> bool:
    """Whether streamed chunks are vLLM's steps (`steps_agree`) with consecutive ones
    carried in one chunk, as a client that reads late gets them behind `vllm serve`: the
    first token (the prefill's), then 1 + accepted drafts per verify step, each chunk the sum
    of a run of them; a finished request's last step may emit fewer."""
    emitted = [1] + [1 + int(a) for a in per_step_accepted]
    chunks = [n for n in step_tokens if n > 0]
    i = 0
    for j, chunk in enumerate(chunks):
        total = 0
        while total < chunk and i < len(emitted):
            total, i = total + emitted[i], i + 1
        cut = finished and j == len(chunks) - 1 and i == len(emitted)
        if total != chunk and not (cut and chunk < total < chunk + emitted[-1]):
            return False
    return i == len(emitted)


def attribute(engine: SpecCounters, traces: Sequence[dict], k: int, path: str
              ) -> tuple[list[SpecCounters], dict]:
    """Per-request counters of one point and how they were had (`PointResult` fields).

    traces: one per request with `step_tokens`, `finish_reason` and `spec_decode` (vLLM's own
    counters or None); path: what the step counts come from ("stepped": engine steps,
    "chunks": streamed chunks). Where vLLM reported every request (`native_counters`) those
    are the counters, `attribution_source` is "native", and `cross_check` says how many
    requests' steps show vLLM's verify steps (`steps_agree`) and how the step counts alone
    compare with the engine, and how many of the others show them merged
    (`steps_merged`: chunks a late reader got); otherwise the step counts are the counters
    (`request_counters`)
    and `attribution_source` is `path`. `attribution` compares the counters' sum with the
    engine's (`attribution`); `counters_from_steps` is the step counts' sum either way."""
    finished = [tr.get("finish_reason") is not None for tr in traces]
    steps = [request_counters(tr["step_tokens"], k, finished=f) for tr, f in zip(traces, finished)]
    from_steps = sum(steps, SpecCounters())
    dropped = sum(dropped_rounds(tr["step_tokens"], f) for tr, f in zip(traces, finished))
    by_steps = attribution(engine, from_steps, dropped if k else 0)
    native = [tr.get("spec_decode") for tr in traces]
    if not (k and native and all(native)):
        return steps, {"attribution_source": path, "attribution": by_steps,
                       "counters_from_steps": from_steps.to_dict()}
    counters = [native_counters(sd) for sd in native]
    total = sum(counters, SpecCounters())
    agree = merged = 0
    for tr, f, sd in zip(traces, finished, native):
        per_step = sd.get("per_step_accepted") or []
        if steps_agree(tr["step_tokens"], f, per_step):
            agree += 1
        else:
            merged += steps_merged(tr["step_tokens"], f, per_step)
    return counters, {
        "attribution_source": "native", "attribution": attribution(engine, total, 0),
        "counters_native": total.to_dict(), "counters_from_steps": from_steps.to_dict(),
        "cross_check": {"path": path, "requests": len(traces), "steps_agree": agree,
                        "steps_merged": merged, "attribution": by_steps}}


def acceptance_length_histogram(step_token_lists: Iterable[Sequence[int]], k: int) -> np.ndarray:
    """Counts of verify steps by tokens emitted (1..k+1), bonus token included."""
    hist = np.zeros(k + 2, dtype=np.int64)
    for steps in step_token_lists:
        for n in [n for n in steps if n > 0][1:]:
            hist[min(n, k + 1)] += 1
    return hist[1:]


def _resampled(drafts, accepted_per_pos, n_boot: int, seed: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Drafts [n_boot] and accepted tokens per position [n_boot, k] summed over `n_boot`
    resamples (with replacement) of the requests (rows)."""
    drafts = np.asarray(drafts, dtype=float)
    app = np.asarray(accepted_per_pos, dtype=float).reshape(len(drafts), -1)
    idx = np.random.default_rng(seed).integers(0, len(drafts), size=(n_boot, len(drafts)))
    return drafts[idx].sum(axis=1), app[idx].sum(axis=1)


def bootstrap_rates(drafts, accepted_per_pos, *, n_boot: int = 1000, seed: int = 0
                    ) -> np.ndarray:
    """Per-position unconditional rates of `n_boot` resamples of the requests (rows), [n_boot,
    k]: the joint uncertainty `bootstrap_ci` gives per position (NaN where a resample holds
    no draft)."""
    d, a = _resampled(drafts, accepted_per_pos, n_boot, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        return a / d[:, None]


def bootstrap_ci(
    drafts: np.ndarray,
    accepted_per_pos: np.ndarray,
    *,
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Percentile bootstrap over requests (rows) for AL, per-position and conditional rates.

    drafts: [R] drafts per request; accepted_per_pos: [R, k]. Returns arrays of shape
    [2] (AL) or [2, k] (per position): lower and upper bounds."""
    d, a = _resampled(drafts, accepted_per_pos, n_boot, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        al = 1.0 + a.sum(axis=1) / d
        pp = a / d[:, None]
        prev = np.concatenate([d[:, None], a[:, :-1]], axis=1)
        cond = a / prev
    q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
    with warnings.catch_warnings():  # a position never reached has no rate: NaN bounds
        warnings.simplefilter("ignore", RuntimeWarning)
        return {
            "mean_acceptance_length": np.nanpercentile(al, q),
            "per_position": np.nanpercentile(pp, q, axis=0),
            "conditional": np.nanpercentile(cond, q, axis=0),
        }


def decode_steps(step_tokens: Sequence[int]) -> tuple[int, int]:
    """(tokens, steps) a request gained after its prefill step: every decode step counts,
    with or without a draft (ngram drafts only where its lookup matches)."""
    emitted = [n for n in step_tokens if n > 0][1:]
    return sum(emitted), len(emitted)


def ratio_bootstrap_ci(num, den, *, n_boot: int = 1000, level: float = 0.95, seed: int = 0
                       ) -> tuple[float, float]:
    """Percentile bootstrap over requests of sum(num) / sum(den)."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if not den.sum():
        return np.nan, np.nan
    idx = np.random.default_rng(seed).integers(0, len(num), size=(n_boot, len(num)))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = num[idx].sum(axis=1) / den[idx].sum(axis=1)
    lo, hi = np.nanpercentile(r, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(lo), float(hi)


# --------------------------------------------------------------------- speedup bounds
def expected_tokens_per_step(alpha: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens per verify step with i.i.d. acceptance a."""
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def ideal_speedup(mean_acceptance_length: float, k: int, draft_cost: float) -> float:
    """Best wall-clock speedup AL / (1 + k c) when one draft forward costs c target forwards
    (ignores the verify pass's extra cost over a plain decode step)."""
    return mean_acceptance_length / (1.0 + k * draft_cost)


def first_divergence(ref: Sequence[int], cand: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter end);
    None when the sequences are identical."""
    n = min(len(ref), len(cand))
    diff = np.flatnonzero(np.asarray(ref[:n]) != np.asarray(cand[:n]))
    if diff.size:
        return int(diff[0])
    return None if len(ref) == len(cand) else n
