"""The cost model: measured step costs and an acceptance profile in, throughput and speedup
per k and batch size out, checked against measurement.

Step costs come from a `speclab.gpubench` run (`speclab.stepcosts`). The model, with nothing
fitted to the speculative points it predicts:

    T_spec(k, B) = T_rows(G_{k+1}(B)) + T_draft(k, B) + T_sample(k, B)
    tok/s(k, B)  = B * AL(k) / T_spec(k, B)          AL(k) = 1 + sum_j p_j (j <= k)
    speedup      = AL(k) * T_plain(B) / T_spec(k, B)

T_rows(n) is the plain engine's step that ran n rows (the verify forward of B requests with
k + 1 tokens each runs its rows through the same kernels), linear between the measured ones
in E(n), the routed experts n tokens read per MoE layer (`plain_at`: an MoE step's cost
follows the experts it reads, which grow concavely in n). G_q(B) is the rows the step of B
requests with q tokens each runs: under CUDA graphs the captured graph it is padded to
(`speclab.cudagraphs`: at k = 2 on Hopper, 4 requests run the 18-row graph), eager B q; a
plain step at B ran G_1(B) rows of its own engine's graphs (`rows_curve`). T_draft is the
drafter's GPU time per step measured with CUDA events (`speclab.steptiming`), T_sample what
speculative sampling (rejection, bookkeeping) costs the GPU beyond a plain step's sampling,
measured in the same passes (`stepcosts.draft_ms`), and p_j the unconditional acceptance at
position j (a run's counters or a draft card's published rates).
For an offline batch (B requests started together, as every gpubench pass is) T_spec is the
batch's mean step: its last rounds run the requests still going, Binomial(B, s_j) of them at
round j with s_j the probability that a request runs a j-th round (`round_survival`, from the
acceptance profile alone), and a pass's tok/s sees E[sum_j T_spec(n_j)] / sum_j s_j
(`batch_step`); a served batch, whose finished requests are replaced, has no tail.
`validate` puts every measured speculative point beside its prediction and `error_budget` splits
the step it misses into the parts the model leaves out; `speclab.layerfit` carries the model
to the production depth.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd

from speclab import cudagraphs, stepcosts

# DeepSeek-V4-Flash EAGLE3.1 at k = 3 (SGLang, 8xH20; the draft card's own numbers are
# k = 3 too): unconditional per-position acceptance
PUBLISHED_EAGLE31 = (0.617, 0.433, 0.294)
# DeepSeek-V4-Flash's own MTP head in vLLM at k = 2 (vllm-project/vllm PR #41044: SM120, TP 2,
# FP8 KV, random 1k/1k prompts, concurrency 1): the only per-position figures published for it
PUBLISHED_MTP = (0.769, 0.381)
MOE = (256, 6)  # DeepSeek-V4-Flash's config.json: n_routed_experts, num_experts_per_tok


def acceptance_profile(rates, k: int) -> list[float]:
    """Per-position unconditional rates for k positions: the given ones, continued past the
    last by the last conditional rate (p_{j+1} = p_j * p_j / p_{j-1})."""
    p = [float(x) for x in rates]
    if not p or any(not 0 <= x <= 1 for x in p) or any(b > a for a, b in itertools.pairwise(p)):
        raise ValueError(f"acceptance rates must be non-increasing values in [0, 1]: {rates}")
    while len(p) < k:
        ratio = p[-1] / p[-2] if len(p) > 1 and p[-2] > 0 else p[-1]
        p.append(p[-1] * ratio)
    return p[:k]


def acceptance_length(rates, k: int) -> float:
    return 1.0 + sum(acceptance_profile(rates, k)) if k else 1.0


def round_survival(rates, k: int, tokens: int) -> np.ndarray:
    """s_j (j = 1, 2, ...): the probability that a request still generating `tokens` tokens
    after its first runs a j-th verify round, each round emitting A + 1 tokens with
    P(A >= i) = p_i (the unconditional per-position `rates`, continued by
    `acceptance_profile`) independently of the others; sum_j s_j is its expected rounds."""
    p = np.r_[1.0, acceptance_profile(rates, k), 0.0] if k else np.array([1.0, 0.0])
    emitted = np.r_[0.0, p[:-1] - p[1:]]  # P(a round emits t tokens), t = 0 .. k + 1
    running = np.zeros(tokens)
    running[0] = 1.0  # P(t tokens emitted so far and the request still running), t < tokens
    s = []
    while running.sum() > 1e-12:  # every round emits a token: at most `tokens` rounds
        s.append(running.sum())
        running = np.convolve(running, emitted)[:tokens]
    return np.array(s)


def batch_step(step_ms, survival: np.ndarray) -> float:
    """The mean time per round of a batch whose B requests start together and each stop
    after their own rounds (`round_survival`): a step runs the requests still going, m of B
    with probability Binomial(B, s_j) at round j, and costs `step_ms`[m - 1]; the batch's
    decode time over the rounds a request runs on average, the step a pass's tok/s sees."""
    t = np.r_[0.0, np.asarray(step_ms, float)]
    B = len(t) - 1
    m = np.arange(B + 1)
    comb = np.array([math.comb(B, int(i)) for i in m], float)
    s = survival[:, None]
    pmf = comb * s ** m * (1 - s) ** (B - m)
    return float((pmf @ t).sum() / survival.sum())


def method_of(draft: str) -> str:
    """The speculative method of a draft setting (`stepcosts.draft_setting`): `mtp` for the target's
    own MTP head (gpubench names its engines `...-mtp`), else `eagle3`."""
    return "mtp" if draft.split("-")[0] == "mtp" else "eagle3"


def rates_for(rates, draft: str):
    """The acceptance profile a draft setting is predicted at: `rates` itself, or for a
    mapping {method: rates} the one of its method (`method_of`)."""
    return rates[method_of(draft)] if isinstance(rates, dict) else rates


def plain_curve(costs: pd.DataFrame, layers: int, eager: bool) -> pd.Series:
    """Plain step ms by batch size n for one engine configuration, the mean where runs ran
    one batch size on different graphs, sorted."""
    c = costs[(costs.layers == layers) & (costs.eager == eager) & (costs.k == 0)]
    return c.step_ms.groupby(c.B.to_numpy()).mean().sort_index()


def rows_curve(costs: pd.DataFrame, layers: int, eager: bool) -> pd.Series:
    """Plain step ms by the rows the step ran (`stepcosts.step_costs`' `rows`), the mean
    where several batch sizes replay one graph, sorted."""
    c = costs[(costs.layers == layers) & (costs.eager == eager) & (costs.k == 0)]
    return c.step_ms.groupby(c.rows.to_numpy()).mean().sort_index()


def experts_touched(n, experts: int = MOE[0], top_k: int = MOE[1]):
    """Expected distinct routed experts a batch of n tokens reads in one MoE layer when each
    token picks `top_k` of `experts` evenly (a router that spreads tokens, as the real-shape
    fixture's does: `realshape.routing_stats`)."""
    return experts * (1 - (1 - top_k / experts) ** np.asarray(n, float))


def interpolate(curve: pd.Series, n: float) -> float:
    """T_plain(n) linear in n between the measured batch sizes, NaN outside them."""
    return plain_at(curve, n, None)


def plain_at(curve: pd.Series, n: float, moe=MOE) -> float:
    """T_plain(n): linear between the measured batch sizes in the experts n tokens read,
    E(n) = `experts_touched(n, *moe)` (linear in n with `moe` None: `interpolate`), NaN
    outside them."""
    return _plain_at(_xy(curve), n, moe)


def _xy(curve: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """A curve's batch sizes and steps as float arrays, for `_plain_at`."""
    return curve.index.to_numpy(float), curve.to_numpy(float)


def _plain_at(xy: tuple[np.ndarray, np.ndarray], n: float, moe=MOE) -> float:
    """`plain_at` on a curve's arrays (`_xy`)."""
    x, y = xy
    if not len(x) or not x.min() <= n <= x.max():
        return float("nan")
    if moe is None:
        return float(np.interp(n, x, y))
    return float(np.interp(experts_touched(n, *moe), experts_touched(x, *moe), y))


def drafter_at(d: pd.DataFrame, k: int, col: str) -> float:
    """The drafter's time per step at k (`stepcosts.draft_ms` rows of one setting and batch size):
    measured, else linear in k between the measured k (k sequential draft forwards); outside
    them, the line through the two nearest, or with one measured k0 its time scaled by
    k / k0 (`drafter_scaled` says which k these are); NaN with none measured. On the H200
    (2026-12-04, k = 1, 3, 5 measured) the scaled k = 1 time gives k = 3's 10% high, k = 5's
    3% low; the line through k = 1 and 3 gives k = 5's within 1.4%."""
    return _drafter_at(_measured(d, col), k)


def _drafter_at(measured: tuple[np.ndarray, np.ndarray], k: int) -> float:
    """`drafter_at` on `_measured`'s k and times."""
    ks, ts = measured
    if not len(ks):
        return float("nan")
    if ks[0] <= k <= ks[-1]:
        return float(np.interp(k, ks, ts))
    if len(ks) == 1:
        return float(ts[0] * k / ks[0])
    i = [0, 1] if k < ks[0] else [-2, -1]
    return float(ts[i[0]] + (k - ks[i[0]]) * (ts[i[1]] - ts[i[0]]) / (ks[i[1]] - ks[i[0]]))


def sample_extra_at(d: pd.DataFrame, k: int) -> float:
    """What speculative sampling adds a step at k (`sample_extra_ms` rows of one setting and
    batch size): read between the measured k, the nearest measured k's outside them (it is
    nearly flat in k: 0.058-0.064 ms at B = 1 for k = 1, 2, 3, 5 on the H200); 0 where none
    was measured (the model then leaves it out, as before 2026-12-05)."""
    return _sample_extra_at(_measured(d, "sample_extra_ms"), k)


def _sample_extra_at(measured: tuple[np.ndarray, np.ndarray], k: int) -> float:
    """`sample_extra_at` on `_measured`'s k and times."""
    ks, ts = measured
    return float(np.interp(k, ks, ts)) if len(ks) else 0.0


def _measured(d: pd.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray]:
    """The measured k (sorted) and their `col` values, rows without one left out."""
    ks, ts = d.k.to_numpy(float), d[col].to_numpy(float)
    keep = ~np.isnan(ts)
    order = np.argsort(ks[keep], kind="stable")
    return ks[keep][order], ts[keep][order]


def drafter_scaled(d: pd.DataFrame, k: int) -> bool:
    """Whether `drafter_at` reads k outside the measured k (extrapolated, not measured)."""
    return _drafter_scaled(_measured(d, "draft_ms"), k)


def _drafter_scaled(measured: tuple[np.ndarray, np.ndarray], k: int) -> bool:
    """`drafter_scaled` on `_measured`'s k and times."""
    ks, _ = measured
    return bool(len(ks)) and not ks[0] <= k <= ks[-1]


def predict(costs: pd.DataFrame, drafts: pd.DataFrame, rates, ks=range(1, 6),
            batches=None, moe=MOE, gpu: str = "hopper", vllm: str = "0.26",
            tokens: int | None = None) -> pd.DataFrame:
    """Predicted step, tok/s and speedup per (layers, eager, draft, k, B) from the plain
    curve (`plain_at` with `moe`, by rows: `rows_curve`, `cudagraphs.step_rows` on `gpu` and
    `vllm`) and the drafter times of each draft setting (module doc), for the acceptance
    profile `rates` (or {method: rates}, `rates_for`); best k per B is the row with `best`
    True. `al_needed`, the acceptance length at which k breaks even at B (T_spec / T_plain),
    holds for any rates. `tokens`: an offline batch of B requests generating that many tokens
    each after the first, whose last rounds run fewer requests (`batch_step`; `tail_ms` is
    what that adds a step); None: a batch whose finished requests are replaced at once
    (serving at concurrency B). `pred_serial_speedup`: the same with the drafter's host
    time (`draft_host_ms`, where split passes timed it) serial to the verify step, the bound
    for a host that cannot run ahead of the GPU; NaN without a host time."""
    rows = []
    for (layers, eager), _ in costs.groupby(["layers", "eager"]):
        curve, by_rows, points = _configuration(costs, drafts, layers, eager, batches, ks, gpu,
                                                vllm, tail=bool(tokens))
        rows += predicted_rows(points, curve, by_rows, rates, layers, eager, moe, tokens)
    return _with_best(pd.DataFrame(rows))


def _with_best(out: pd.DataFrame) -> pd.DataFrame:
    """`predict`'s rows with `best`: the highest speedup per (configuration, B)."""
    if len(out):
        best = out.groupby([*stepcosts.CONFIG, "B"]).pred_speedup.transform("max")
        out["best"] = out.pred_speedup == best
    return out


def _configuration(costs: pd.DataFrame, drafts: pd.DataFrame, layers: int, eager: bool,
                   batches=None, ks=range(1, 6), gpu: str = "hopper", vllm: str = "0.26",
                   tail: bool = False) -> tuple:
    """What `predict` reads of one (layers, eager) configuration besides the rates: its plain
    curves by B and by rows (`_xy` of `plain_curve`, `rows_curve`) and its `drafter_points`
    at `batches` (None: the batch sizes its speculative engines ran)."""
    d = drafts[(drafts.layers == layers) & (drafts.eager == eager)]
    Bs = batches or sorted(costs[(costs.layers == layers) & (costs.k > 0)].B.unique())
    return (_xy(plain_curve(costs, layers, eager)), _xy(rows_curve(costs, layers, eager)),
            drafter_points(d, Bs, ks, eager, gpu, vllm, tail))


def drafter_points(d: pd.DataFrame, batches, ks, eager: bool, gpu: str = "hopper",
                   vllm: str = "0.26", tail: bool = False) -> list[dict]:
    """What `predict` reads per (draft setting, B, k), in its order, that the plain curve
    does not change, from one configuration's drafter times `d`: the verify step's rows
    (`verify_rows`), `draft_ms` and `draft_host_ms` (`drafter_at`), `sample_extra_ms` and
    `drafter_scaled`; with `tail`, `tail_rows`, the rows of the step at each m = 1 .. B
    requests (None at B = 1 or without `tail`)."""
    points = []
    for draft in sorted(d.draft.unique()) or [""]:
        dd = d[d.draft == draft]
        for B in batches:
            db = dd[dd.B == B]
            drafter, host = _measured(db, "draft_ms"), _measured(db, "draft_host_ms")
            sample = _measured(db, "sample_extra_ms")
            for k in ks:
                points.append({
                    "draft": draft, "B": B, "k": k,
                    "verify_rows": cudagraphs.step_rows(B, k, eager, gpu=gpu, vllm=vllm),
                    "draft_ms": _drafter_at(drafter, k),
                    "sample_extra_ms": _sample_extra_at(sample, k),
                    "draft_host_ms": _drafter_at(host, k),
                    "drafter_scaled": _drafter_scaled(drafter, k),
                    "tail_rows": [cudagraphs.step_rows(m, k, eager, gpu=gpu, vllm=vllm)
                                  for m in range(1, int(B) + 1)]
                    if tail and B > 1 else None})
    return points


def predicted_rows(points: list[dict], curve, by_rows, rates, layers: int, eager: bool,
                   moe=MOE, tokens: int | None = None) -> list[dict]:
    """`predict`'s rows (less `best`) of one configuration from its `drafter_points` and its
    plain curves by B and by rows as arrays (`_xy` of `plain_curve` and `rows_curve`);
    `tokens` as `predict`'s (the points need `tail_rows` then)."""
    rows = []
    for p in points:
        B, k, n, draft_ms = p["B"], p["k"], p["verify_rows"], p["draft_ms"]
        sample, host, rate = p["sample_extra_ms"], p["draft_host_ms"], rates_for(rates, p["draft"])
        t0, verify = _plain_at(curve, B, moe), _plain_at(by_rows, n, moe)
        tail = 0.0
        if tokens and B > 1:  # the drafter's and sampling's time at B every step
            by_m = [_plain_at(by_rows, m, moe) + draft_ms + sample for m in p["tail_rows"]]
            tail = (batch_step(by_m, round_survival(rate, k, tokens))
                    - verify - draft_ms - sample)
        step = verify + draft_ms + sample + tail
        al = acceptance_length(rate, k)
        rows.append({"layers": layers, "eager": eager, "draft": p["draft"], "k": k,
                     "B": B, "al": al, "verify_rows": n, "verify_ms": verify,
                     "draft_ms": draft_ms, "sample_extra_ms": sample,
                     "tail_ms": tail,
                     "pred_step_ms": step,
                     "draft_host_ms": host,
                     "drafter_scaled": p["drafter_scaled"],
                     "pred_tok_s": 1e3 * B * al / step,
                     "pred_speedup": al * t0 / step,
                     "pred_serial_speedup": al * t0 / (step - draft_ms + max(host, draft_ms))
                     if pd.notna(host) else float("nan"),
                     "al_needed": step / t0})
    return rows


def verify_by_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The target's verify forward (`execute` GPU ms, median) per scheduled token count of
    the split passes, each with the rows its CUDA graph ran (`cudagraphs.step_rows`), the
    plain step at those rows and, the control, at its tokens (`rows_curve`, `plain_at`): a
    split pass's last steps run with fewer requests as they finish, so one pass covers every
    request count below its B."""
    costs = stepcosts.step_costs(results)
    rows = []
    for _, r in stepcosts.split_passes(results).iterrows():
        if not r.k:
            continue
        sizes = r.get("capture_sizes")
        for c in stepcosts.decode_calls(r, ("execute",)):
            rows.append({"layers": r.layers, "eager": r.eager,
                         "draft": stepcosts.draft_setting(r.engine, r.k), "k": r.k,
                         "tokens": c["tokens"], "ms": c["ms"],
                         "rows": cudagraphs.step_rows(c["reqs"], r.k, r.eager, sizes)})
    if not rows:
        return pd.DataFrame()
    out = (pd.DataFrame(rows).groupby([*stepcosts.CONFIG, "k", "tokens", "rows"]).ms
           .agg(execute_ms="median", calls="size").reset_index())
    curves = {key: rows_curve(costs, *key) for key in zip(out.layers, out.eager)}
    out["plain_rows_ms"] = [plain_at(curves[r.layers, r.eager], r.rows) for r in out.itertuples()]
    out["plain_tokens_ms"] = [plain_at(curves[r.layers, r.eager], r.tokens)
                              for r in out.itertuples()]
    return out


def validate(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """Every measured speculative point beside its prediction from the plain curve, the
    drafter time and the point's own measured AL (so the check is of the step-cost model),
    for its pass: B requests of the pass's tokens each, the batch's tail included (`predict`
    `tokens`): columns step_ms / pred_step_ms, speedup (CI) / pred_speedup, error = pred /
    measured - 1. Where the drafter's host time was recorded, also the bound with that host
    time serial to the verify step (`pred_serial_speedup`: an eager drafter's launches the
    GPU waits for) and `bracketed`: the measured speedup lies between the two predictions.
    The models before their last terms, as controls: `error_steady` without the tail (every
    step at B), `error_linear` with T_plain linear in n (`interpolate`), not in the experts
    it reads, `error_no_sample` without T_sample."""
    costs = stepcosts.step_costs(results, max_tokens)
    drafts = stepcosts.draft_ms(results)
    timed = stepcosts.passes(results, max_tokens)
    rows = []
    for _, r in costs[costs.k > 0].iterrows():
        rates, tokens = stepcosts.measured_rates(r, timed), int(np.rint(r.tokens))
        curve, by_rows, points = _point(costs, drafts, r)  # read once for the four models
        if not points:
            continue

        def mine(points=points, curve=curve, by_rows=by_rows, r=r, rates=rates,
                 **kw) -> dict:
            return predicted_rows(points, curve, by_rows, rates, r.layers, r.eager, **kw)[0]

        q = mine(tokens=tokens)
        no_sample = [{**p, "sample_extra_ms": 0.0} for p in points]  # T_sample left out
        rows.append({**r.to_dict(), "pred_step_ms": q["pred_step_ms"],
                     "draft_ms": q["draft_ms"], "sample_extra_ms": q["sample_extra_ms"],
                     "verify_ms": q["verify_ms"], "pred_tail_ms": q["tail_ms"],
                     "drafter_scaled": q["drafter_scaled"], "pred_speedup": q["pred_speedup"],
                     "error": q["pred_speedup"] / r.speedup - 1,
                     "draft_host_ms": q["draft_host_ms"],
                     "error_steady": mine()["pred_speedup"] / r.speedup - 1,
                     "error_linear": mine(tokens=tokens, moe=None)["pred_speedup"]
                     / r.speedup - 1,
                     "error_no_sample": mine(no_sample, tokens=tokens)["pred_speedup"]
                     / r.speedup - 1,
                     "pred_serial_speedup": q["pred_serial_speedup"],
                     "bracketed": bool(q["pred_serial_speedup"] <= r.speedup
                                       <= q["pred_speedup"])
                     if pd.notna(q["draft_host_ms"]) else None})
    return pd.DataFrame(rows)


def served_vs_model(served: pd.DataFrame, validated: pd.DataFrame) -> pd.DataFrame:
    """The speculative points behind `vllm serve` (`served`, what `stepcosts.serve_costs`
    returns) beside the offline point of the same layers, k and B with the default drafter
    (`validated`, what `validate` returns): `offline_speedup`, the model's `pred_speedup` and
    its serial-drafter bound `pred_serial_speedup`, `error` = pred / served - 1, `bracketed`
    (the served speedup between the two) and `pred_in_ci` (the prediction inside the served
    speedup's 95% interval); the prediction columns are NaN where no offline point ran."""
    if served.empty:
        return served
    served = served[served.k > 0]
    keys = ["layers", "eager", "k", "B"]
    cols = ["offline_speedup", "pred_speedup", "pred_serial_speedup"]
    model = (validated[validated.draft == ""].rename(columns={"speedup": "offline_speedup"})
             [[*keys, *cols]] if len(validated) else pd.DataFrame(columns=[*keys, *cols]))
    out = served.merge(model, on=keys, how="left")
    out["error"] = out.pred_speedup / out.speedup - 1
    out["bracketed"] = [bool(s <= m <= p) if pd.notna(p) else None for s, m, p in
                        zip(out.pred_serial_speedup, out.speedup, out.pred_speedup)]
    out["pred_in_ci"] = [bool(lo <= p <= hi) if pd.notna(p) else None for lo, p, hi in
                         zip(out.speedup_lo, out.pred_speedup, out.speedup_hi)]
    return out


BUDGET = ("verify_extra_ms", "sampling_ms", "drafter_ms", "tail_extra_ms", "idle_ms",
          "rest_ms")
"""The parts of `error_budget`, in the order they are summed."""


def error_budget(validated: pd.DataFrame, anatomy: pd.DataFrame) -> pd.DataFrame:
    """Where the model's error goes, per speculative point with a split pass that timed the
    target's forward: the measured step less the predicted one (`validated`, what `validate`
    returns), `err_ms`, as the sum of what the model prices otherwise or leaves out
    (`anatomy`, what `stepcosts.step_anatomy` returns; several runs' split passes of a point
    averaged): `verify_extra_ms`, the verify forward less the plain step at its rows (which
    holds plain's own sampling and idle time); `sampling_ms`, sampling less the drafter
    inside it less what the model prices for it (`sample_extra_ms`), so plain's own sampling
    where the runs timed it (all of it where they did not); `drafter_ms`, the drafter in the
    split pass less the one priced; `tail_extra_ms`, the batch's tail measured less predicted;
    `idle_ms`, the step the GPU waits for the host; `rest_ms`, what is left (mean against
    median steps)."""
    v, a = validated, anatomy
    if v.empty or a.empty:
        return pd.DataFrame()
    keys = [*stepcosts.CONFIG, "k", "B"]
    a = a[a.k > 0].groupby(keys, as_index=False).mean(numeric_only=True)
    m = v[[*keys, "step_ms", "pred_step_ms", "verify_ms", "draft_ms", "sample_extra_ms",
           "pred_tail_ms", "error"]].merge(a.drop(columns="step_ms"), on=keys)
    out = m[[*keys, "step_ms", "pred_step_ms", "error"]].assign(
        err_ms=m.step_ms - m.pred_step_ms, verify_extra_ms=m.execute_ms - m.verify_ms,
        sampling_ms=m.sample_ms - m.propose_ms - m.sample_extra_ms,
        drafter_ms=m.propose_ms - m.draft_ms,
        tail_extra_ms=m.tail_ms - m.pred_tail_ms, idle_ms=m.idle_ms)
    out["rest_ms"] = out.err_ms - out[list(BUDGET[:-1])].sum(axis=1)
    return out.sort_values([*stepcosts.CONFIG, "B", "k"], ignore_index=True)


def point_prediction(costs: pd.DataFrame, drafts: pd.DataFrame, r, rates,
                      **kw) -> pd.DataFrame:
    """`predict`'s row for the measured point `r` (its layers, eager, draft, k and B) at
    acceptance `rates`; `kw` (`moe`, `tokens`) as `predict`'s."""
    curve, by_rows, points = _point(costs, drafts, r)
    return _with_best(pd.DataFrame(predicted_rows(points, curve, by_rows, rates, r.layers,
                                                  r.eager, **kw)))


def _point(costs: pd.DataFrame, drafts: pd.DataFrame, r) -> tuple:
    """The measured point `r`'s configuration's plain curves (`_configuration`) and the
    `drafter_points` of its draft setting at its k and B (none where `predict` has no row
    for it: its draft setting not among the drafter times', its configuration not in
    `costs`)."""
    curve, by_rows, points = _configuration(costs, drafts, r.layers, r.eager, [r.B], [r.k],
                                            tail=True)
    ran = ((costs.layers == r.layers) & (costs.eager == r.eager)).any()
    return curve, by_rows, [p for p in points if ran and p["draft"] == r.draft]
