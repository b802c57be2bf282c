"""The cost model: measured step costs and an acceptance profile in, throughput and speedup
per k and batch size out, checked against measurement.

Step costs come from a `speclab.gpubench` run (results.jsonl): per pass, the decode time is
the full pass minus its prefill-only twin, a plain step is that over `max_tokens - 1` steps,
a speculative step that over the verify rounds per request (`num_drafts / B`). The model,
with nothing fitted to the speculative points it predicts:

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
measured in the same passes (`draft_ms`), and p_j the unconditional acceptance at position j
(a run's counters or a draft card's published rates).
For an offline batch (B requests started together, as every gpubench pass is) T_spec is the
batch's mean step: its last rounds run the requests still going, Binomial(B, s_j) of them at
round j with s_j the probability that a request runs a j-th round (`round_survival`, from the
acceptance profile alone), and a pass's tok/s sees E[sum_j T_spec(n_j)] / sum_j s_j
(`batch_step`); a served batch, whose finished requests are replaced, has no tail.
`validate` puts every measured speculative point beside its prediction and `error_budget` splits
the step it misses into the parts the model leaves out; `extrapolate` fits
T_plain(n, L) = a(n) + b(n) L over the measured layer counts and predicts at the production
depth, and `held_out` checks that chain at a measured depth left out of the fit.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd

from speclab import analysis, cudagraphs, provenance

# DeepSeek-V4-Flash EAGLE3.1 at k = 3 (SGLang, 8xH20; the draft card's own numbers are
# k = 3 too): unconditional per-position acceptance
PUBLISHED_EAGLE31 = (0.617, 0.433, 0.294)
# DeepSeek-V4-Flash's own MTP head in vLLM at k = 2 (vllm-project/vllm PR #41044: SM120, TP 2,
# FP8 KV, random 1k/1k prompts, concurrency 1): the only per-position figures published for it
PUBLISHED_MTP = (0.769, 0.381)
PRODUCTION_LAYERS = 43
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
    """The speculative method of a draft setting (`draft_setting`): `mtp` for the target's
    own MTP head (gpubench names its engines `...-mtp`), else `eagle3`."""
    return "mtp" if draft.split("-")[0] == "mtp" else "eagle3"


def rates_for(rates, draft: str):
    """The acceptance profile a draft setting is predicted at: `rates` itself, or for a
    mapping {method: rates} the one of its method (`method_of`)."""
    return rates[method_of(draft)] if isinstance(rates, dict) else rates


# --------------------------------------------------------------------------- measurements
def run_dirs(runs) -> list[Path]:
    """One run folder or several, as a list of paths."""
    return [Path(runs)] if isinstance(runs, (str, Path)) else [Path(r) for r in runs]


def check_poolable(runs) -> list[dict]:
    """What each run ran on (`provenance.gpu_env`, with its `run` name) when their step costs
    may be pooled: one GPU model and one vLLM release, each run's `env.json` saying so.
    Raises ValueError otherwise, or when two folders share a name (a pass is keyed by its
    run's name)."""
    dirs = run_dirs(runs)
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):
        raise ValueError(f"runs to pool need distinct folder names: {names}")
    prov = [{"run": d.name, **provenance.gpu_env(d)} for d in dirs]
    if len(dirs) > 1:
        missing = [p["run"] for p in prov if len(p) == 1]
        if missing:
            raise ValueError(f"pooling runs needs each run's env.json (GPU, vLLM): none in "
                             f"{missing}")
        for key in ("gpu", "vllm"):
            if len({p[key] for p in prov}) > 1:
                raise ValueError(f"runs pool only on one {key}: "
                                 + ", ".join(f"{p['run']} {p[key]}" for p in prov))
    return prov


def engines(runs) -> list[dict]:
    """Every engine record of one gpubench run or several (all calls: `engines.jsonl` in each
    folder or below it), in order, each with its run's folder name (`run`)."""
    from speclab.store import read_jsonl

    return [{**e, "run": d.name} for d in run_dirs(runs)
            for path in sorted(d.rglob("engines.jsonl")) for e in read_jsonl(path)]


def load(runs) -> pd.DataFrame:
    """Every pass of one gpubench run or several (all calls: `results.jsonl` in each folder
    or below it), with its run's folder name (`run`: passes pair, and are kept once, within
    their run) and its engine's CUDA-graph capture sizes as resolved (`engines`; column
    `capture_sizes`, None where not recorded). Several runs pool their step costs: they
    must share a GPU model and vLLM release (`check_poolable`)."""
    from speclab.store import read_jsonl

    check_poolable(runs)
    rows = [{**r, "run": d.name} for d in run_dirs(runs)
            for path in sorted(d.rglob("results.jsonl")) for r in read_jsonl(path)]
    if not rows:
        raise FileNotFoundError(f"no results.jsonl under {', '.join(map(str, run_dirs(runs)))}")
    sizes = {(e["run"], e["engine"]): e["resolved"].get("cudagraph_capture_sizes") or None
             for e in engines(runs) if "engine" in e and "resolved" in e}
    df = pd.DataFrame(rows)
    df["capture_sizes"] = [sizes.get(key) for key in zip(df.run, df.engine)]
    return df


CONFIG = ["layers", "eager", "draft"]
"""What sets an engine's step cost apart besides k and B: target depth, eager or CUDA graphs,
and the draft's setting (`draft_setting`)."""
STALL = 3.0  # a pass over this many times its engine's median at that B stalled


def draft_setting(engine: str, k: int) -> str:
    """The draft's setting in a gpubench engine name (`L4-k3-graphs-drafteager` ->
    `drafteager`; the EAGLE3.1 shape as is -> ``); plain engines have none."""
    parts = engine.split("-", 3)
    return parts[3] if k and len(parts) == 4 else ""


def passes(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """Timed passes (round >= 1, op `pass`) with decode time, tokens a request after its
    first, steps (speculative: verify rounds a request ran on average), step time and tok/s. A
    pass is kept once (the last record of an engine, round and batch size); not kept: a pass
    during which a kernel was JIT-compiled, one whose decode time is not positive, and one
    whose prefill or full time is over `STALL` times its engine's median at that batch size
    (a compile the log did not name)."""
    df = _once(results[(results.op == "pass") & (results["round"] >= 1)]).copy()
    if "jit_compiled" in df:  # a kernel compiled while the pass ran: not a clean timing
        df = df[df.jit_compiled.map(lambda j: not (isinstance(j, list) and j)).astype(bool)]
    df["decode_s"] = df.t_full_s - df.t_prefill_s
    df = df[df.decode_s > 0]
    for col in ("t_prefill_s", "t_full_s"):
        df = df[df[col] <= STALL * df.groupby(["engine", "B"])[col].transform("median")]
    df["draft"] = [draft_setting(e, k) for e, k in zip(df.engine, df.k)]
    drafts = df.counters.map(lambda c: c.get("num_drafts", 0))
    # tokens a request after the first: from the pass's own output when recorded
    # (`gpubench drive --tokens`), else `max_tokens`
    after = (df.output_tokens / df.B if "output_tokens" in df else
             pd.Series(max_tokens, index=df.index)).fillna(max_tokens) - 1
    sizes = df.capture_sizes if "capture_sizes" in df else pd.Series(None, index=df.index)
    df["rows"] = [step_rows(b, k, e, z) for b, k, e, z in zip(df.B, df.k, df.eager, sizes)]
    df["tokens"] = after
    df["steps"] = np.where(df.k > 0, drafts / df.B, after)
    df["step_ms"] = 1e3 * df.decode_s / df.steps
    df["tok_s"] = df.B * after / df.decode_s
    df["al"] = np.where(df.k > 0, after / df.steps, 1.0)
    return df


def step_costs(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """Per (layers, eager, k, B): step time, tok/s (mean and 95% t-interval over rounds),
    measured AL, tokens a request and rounds; speedup over the plain engine of the same
    (layers, eager, B) as the geometric mean of per-round ratios (rounds run interleaved, so
    round r pairs)."""
    df = passes(results, max_tokens)
    keys = [*CONFIG, "k", "B"]
    rows = []
    for key, g in df.groupby(keys):
        step = analysis.mean_ci(g.step_ms)
        tput = analysis.mean_ci(g.tok_s)
        rows.append({**dict(zip(keys, key)), "rows": int(g.rows.iloc[0]),
                     "step_ms": step[0], "step_lo": step[1],
                     "step_hi": step[2], "tok_s": tput[0], "tok_s_lo": tput[1],
                     "tok_s_hi": tput[2], "al": g.al.mean(), "tokens": g.tokens.median(),
                     "rounds": len(g)})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    sp = []
    for _, r in out.iterrows():
        mine = df[(df.layers == r.layers) & (df.eager == r.eager) & (df.draft == r.draft)
                  & (df.k == r.k) & (df.B == r.B)]
        base = df[(df.layers == r.layers) & (df.eager == r.eager) & (df.k == 0) & (df.B == r.B)]
        paired = mine.merge(base, on=[*_run_key(df), "round"], suffixes=("", "_0"))
        sp.append(analysis.ratio_ci(paired.tok_s, paired.tok_s_0) if len(paired) else
                  (np.nan,) * 3)
    out["speedup"], out["speedup_lo"], out["speedup_hi"] = zip(*sp)
    return out


def plain_by_run(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """The plain step of each (layers, eager, B) that two or more pooled runs measured, per
    run (mean and 95% interval over its rounds), with `spread` (largest / smallest mean - 1)
    and `overlap` (every run's interval overlaps every other's): whether pooling them is
    pooling one quantity."""
    df = passes(results, max_tokens)
    df = df[df.k == 0]
    rows = []
    for (layers, eager, B), g in df.groupby(["layers", "eager", "B"]):
        if g.run.nunique() < 2:
            continue
        per = [(run, *analysis.mean_ci(h.step_ms), len(h)) for run, h in g.groupby("run")]
        means = [m for _, m, _, _, _ in per]
        rows += [{"layers": layers, "eager": eager, "B": B, "run": run, "step_ms": m,
                  "step_lo": lo, "step_hi": hi, "rounds": n,
                  "spread": max(means) / min(means) - 1,
                  "overlap": max(lo for _, _, lo, _, _ in per) <= min(hi for *_, hi, _ in per)}
                 for run, m, lo, hi, n in per]
    return pd.DataFrame(rows, columns=["layers", "eager", "B", "run", "step_ms", "step_lo",
                                       "step_hi", "rounds", "spread", "overlap"])


def _step_calls(r, op: str) -> list[dict]:
    """A split pass's recorded calls of `op` at its decode steps (B (k + 1) scheduled tokens:
    plain or verify steps; prefill steps excluded); records without an op are the drafter's."""
    return [c for c in r["calls"] if c.get("op", "propose") == op
            and c["tokens"] == r.B * (r.k + 1)]


def _decode_calls(r, ops) -> list[dict]:
    """A split pass's recorded calls of `ops` at all its decode steps, those its last
    requests ran with fewer than B included (k + 1 scheduled tokens a request)."""
    return [c for c in r["calls"] if c.get("op") in ops and c.get("reqs")
            and c["tokens"] == c["reqs"] * (r.k + 1)]


def _median(calls: list[dict], key: str) -> float:
    """Median of `key` over the calls that recorded it (NaN where none did)."""
    vals = [c[key] for c in calls if key in c]
    return float(np.median(vals)) if vals else np.nan


def _once(records: pd.DataFrame) -> pd.DataFrame:
    """Each pass once: the last record of a run's engine, round and batch size (a driver
    resumed on another machine carries the earlier records in its own results)."""
    return records.drop_duplicates([*_run_key(records), "engine", "round", "B"], keep="last")


def _run_key(df: pd.DataFrame) -> list[str]:
    """["run"] where the records name their run (`load`), else []."""
    return ["run"] if "run" in df else []


def _splits(results: pd.DataFrame) -> pd.DataFrame:
    return _once(results[results.op == "split"]) if "op" in results else results.iloc[:0]


def draft_ms(results: pd.DataFrame) -> pd.DataFrame:
    """Drafter GPU time per decode step (median over a split pass's drafter calls at its
    verify steps) per (layers, eager, draft, k, B), with its host time where recorded, and
    `sample_extra_ms`: the speculative step's sampling less the drafter inside it less the
    plain step's sampling (`plain_sample_ms`), what verifying adds to sampling; NaN where the
    split passes timed only the drafter."""
    splits = _splits(results)
    rows = []
    for _, r in splits.iterrows():
        calls = _step_calls(r, "propose")
        if r.k and calls:
            drafter = _median(calls, "ms")
            rows.append({"layers": r.layers, "eager": r.eager,
                         "draft": draft_setting(r.engine, r.k), "k": r.k, "B": r.B,
                         "draft_ms": drafter,
                         "draft_host_ms": _median(calls, "host_ms"), "draft_calls": len(calls),
                         "sample_extra_ms": _median(_step_calls(r, "sample"), "ms") - drafter
                         - plain_sample_ms(splits, r.layers, r.eager, r.B)})
    cols = [*CONFIG, "k", "B", "draft_ms", "draft_host_ms", "draft_calls", "sample_extra_ms"]
    out = pd.DataFrame(rows, columns=cols)  # several runs' split passes of one point: the mean
    return out.groupby([*CONFIG, "k", "B"], as_index=False).agg(
        draft_ms=("draft_ms", "mean"), draft_host_ms=("draft_host_ms", "mean"),
        draft_calls=("draft_calls", "sum"), sample_extra_ms=("sample_extra_ms", "mean"))[cols]


def plain_sample_ms(splits: pd.DataFrame, layers: int, eager: bool, B: int) -> float:
    """The plain engine's sampling GPU time per decode step at (layers, eager): the median of
    its split passes' `sample` calls at B requests, or at every B where none ran at B (it is
    flat in B: 0.038-0.041 ms from 1 to 16 on the H200); NaN without a plain split pass."""
    plain = splits[(splits.k == 0) & (splits.layers == layers) & (splits.eager == eager)]
    at_B = [c for _, r in plain[plain.B == B].iterrows() for c in _step_calls(r, "sample")]
    return _median(at_B or [c for _, r in plain.iterrows() for c in _step_calls(r, "sample")],
                   "ms")


def step_anatomy(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """Per split pass: median GPU and host ms per decode step of the target's forward
    (`execute`), of sampling (`sample`, which holds the drafter) and of the drafter
    (`propose`) at its B requests, from `speclab.steptiming`'s records (runs that recorded
    only the drafter have no rows here); `gpu_ms`: the GPU's execute and sample over all the
    pass's decode steps, those its last requests ran alone included, per round a request
    ran, and `tail_ms`, what that adds to the mean step at B (the batch's tail,
    `batch_step`); with the timed passes' step (`step_costs`), `idle_ms`: the step less
    `gpu_ms`, the time a step the GPU waits for the host."""
    rows = []
    for _, r in _splits(results).iterrows():
        row = {"layers": r.layers, "eager": r.eager, "draft": draft_setting(r.engine, r.k),
               "k": r.k, "B": r.B}
        for op in ("execute", "sample", "propose"):
            calls = _step_calls(r, op)
            row[f"{op}_ms"], row[f"{op}_host_ms"] = (_median(calls, "ms"),
                                                     _median(calls, "host_ms"))
        if not np.isnan(row["execute_ms"]):
            decode = _decode_calls(r, ("execute", "sample"))
            executes = [c for c in decode if c["op"] == "execute"]
            row["gpu_ms"] = sum(c["ms"] for c in decode) / (sum(c["reqs"] for c in executes)
                                                           / r.B)
            row["tail_ms"] = row["gpu_ms"] - (sum(c["ms"] for c in decode if c["reqs"] == r.B)
                                              / sum(c["reqs"] == r.B for c in executes))
            rows.append(row)
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    timed = (results.op == "pass") & (results["round"] >= 1)
    costs = step_costs(results, max_tokens) if timed.any() else pd.DataFrame()
    keys = [*CONFIG, "k", "B"]
    out = out.merge(costs[[*keys, "step_ms"]], on=keys, how="left") if len(costs) else \
        out.assign(step_ms=np.nan)
    out["idle_ms"] = out.step_ms - out.gpu_ms
    return out


def verify_by_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The target's verify forward (`execute` GPU ms, median) per scheduled token count of
    the split passes, each with the rows its CUDA graph ran (`step_rows`), the plain step at
    those rows and, the control, at its tokens (`rows_curve`, `plain_at`): a split pass's
    last steps run with fewer requests as they finish, so one pass covers every request
    count below its B."""
    costs = step_costs(results)
    rows = []
    for _, r in _splits(results).iterrows():
        if not r.k:
            continue
        sizes = r.get("capture_sizes")
        for c in _decode_calls(r, ("execute",)):
            rows.append({"layers": r.layers, "eager": r.eager,
                         "draft": draft_setting(r.engine, r.k), "k": r.k, "tokens": c["tokens"],
                         "rows": step_rows(c["reqs"], r.k, r.eager, sizes), "ms": c["ms"]})
    if not rows:
        return pd.DataFrame()
    out = (pd.DataFrame(rows).groupby([*CONFIG, "k", "tokens", "rows"]).ms
           .agg(execute_ms="median", calls="size").reset_index())
    curves = {key: rows_curve(costs, *key) for key in zip(out.layers, out.eager)}
    out["plain_rows_ms"] = [plain_at(curves[r.layers, r.eager], r.rows) for r in out.itertuples()]
    out["plain_tokens_ms"] = [plain_at(curves[r.layers, r.eager], r.tokens)
                              for r in out.itertuples()]
    return out


# --------------------------------------------------------------------------- the model
def serve_costs(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """`step_costs` of the passes behind `vllm serve` (gpubench `serve` engines: B requests
    at once over HTTP), each speculative engine against the plain serve engine of its depth;
    empty when none ran."""
    if "op" not in results or not (results.op == "serve").any():
        return pd.DataFrame()
    served = results[results.op == "serve"].assign(op="pass")
    return step_costs(served, max_tokens)


def plain_curve(costs: pd.DataFrame, layers: int, eager: bool) -> pd.Series:
    """Plain step ms by batch size n for one engine configuration, sorted."""
    c = costs[(costs.layers == layers) & (costs.eager == eager) & (costs.k == 0)]
    return c.set_index("B").step_ms.sort_index()


def step_rows(B: int, k: int, eager: bool, sizes=None, gpu: str = "hopper",
              vllm: str = "0.26") -> int:
    """Rows a decode step of B requests at k (plain: 0) runs: B (k + 1) eager, else
    G_{k+1}(B) from the engine's capture sizes `sizes` (None: vLLM's default;
    `cudagraphs.graph_rows` on `gpu` with release `vllm`, 0.26 where every run here ran)."""
    if eager:
        return int(B) * (k + 1)
    return cudagraphs.graph_rows(int(B), k + 1, sizes if isinstance(sizes, list) else None,
                                 gpu, vllm)


def rows_curve(costs: pd.DataFrame, layers: int, eager: bool) -> pd.Series:
    """Plain step ms by the rows the step ran (`step_costs`' `rows`), the mean where several
    batch sizes replay one graph, sorted."""
    c = costs[(costs.layers == layers) & (costs.eager == eager) & (costs.k == 0)]
    return c.step_ms.groupby(c.rows.to_numpy()).mean().sort_index()


def experts_touched(n, experts: int = MOE[0], top_k: int = MOE[1]):
    """Expected distinct routed experts a batch of n tokens reads in one MoE layer when each
    token picks `top_k` of `experts` evenly (a router that spreads tokens, as the real-shape
    fixture's does: `realshape.routing_stats`)."""
    return experts * (1 - (1 - top_k / experts) ** np.asarray(n, float))


def interpolate(curve: pd.Series, n: float) -> float:
    """T_plain(n) linear in n between the measured batch sizes, NaN outside them."""
    if curve.empty or not curve.index.min() <= n <= curve.index.max():
        return float("nan")
    return float(np.interp(n, curve.index.to_numpy(float), curve.to_numpy(float)))


def plain_at(curve: pd.Series, n: float, moe=MOE) -> float:
    """T_plain(n): linear between the measured batch sizes in the experts n tokens read,
    E(n) = `experts_touched(n, *moe)` (linear in n with `moe` None: `interpolate`), NaN
    outside them."""
    if moe is None or curve.empty or not curve.index.min() <= n <= curve.index.max():
        return interpolate(curve, n)
    return float(np.interp(experts_touched(n, *moe),
                           experts_touched(curve.index.to_numpy(float), *moe),
                           curve.to_numpy(float)))


def drafter_at(d: pd.DataFrame, k: int, col: str) -> float:
    """The drafter's time per step at k (`draft_ms` rows of one setting and batch size):
    measured, else linear in k between the measured k (k sequential draft forwards); outside
    them, the line through the two nearest, or with one measured k0 its time scaled by
    k / k0 (`drafter_scaled` says which k these are); NaN with none measured. On the H200
    (2026-12-04, k = 1, 3, 5 measured) the scaled k = 1 time gives k = 3's 10% high, k = 5's
    3% low; the line through k = 1 and 3 gives k = 5's within 1.4%."""
    ks, ts = _measured(d, col)
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
    ks, ts = _measured(d, "sample_extra_ms")
    return float(np.interp(k, ks, ts)) if len(ks) else 0.0


def _measured(d: pd.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray]:
    """The measured k (sorted) and their `col` values, rows without one left out."""
    ks, ts = d.k.to_numpy(float), d[col].to_numpy(float)
    keep = ~np.isnan(ts)
    order = np.argsort(ks[keep], kind="stable")
    return ks[keep][order], ts[keep][order]


def drafter_scaled(d: pd.DataFrame, k: int) -> bool:
    """Whether `drafter_at` reads k outside the measured k (extrapolated, not measured)."""
    ks, _ = _measured(d, "draft_ms")
    return bool(len(ks)) and not ks[0] <= k <= ks[-1]


def predict(costs: pd.DataFrame, drafts: pd.DataFrame, rates, ks=range(1, 6),
            batches=None, moe=MOE, gpu: str = "hopper", vllm: str = "0.26",
            tokens: int | None = None) -> pd.DataFrame:
    """Predicted step, tok/s and speedup per (layers, eager, draft, k, B) from the plain
    curve (`plain_at` with `moe`, by rows: `rows_curve`, `step_rows` on `gpu` and `vllm`) and the
    drafter times of each draft setting (module doc), for the acceptance profile `rates` (or
    {method: rates}, `rates_for`); best k per B is the row with `best` True. `al_needed`, the
    acceptance length at which k breaks even at B (T_spec / T_plain), holds for any rates. `tokens`: an
    offline batch of B requests generating that many tokens each after the first, whose
    last rounds run fewer requests (`batch_step`; `tail_ms` is what that adds a step);
    None: a batch whose finished requests are replaced at once (serving at concurrency B)."""
    rows = []
    for (layers, eager), _ in costs.groupby(["layers", "eager"]):
        curve = plain_curve(costs, layers, eager)
        by_rows = rows_curve(costs, layers, eager)
        d = drafts[(drafts.layers == layers) & (drafts.eager == eager)]
        for draft in sorted(d.draft.unique()) or [""]:
            dd = d[d.draft == draft]
            for B in batches or sorted(costs[(costs.layers == layers) & (costs.k > 0)].B.unique()):
                t0, db = plain_at(curve, B, moe), dd[dd.B == B]
                for k in ks:
                    n = step_rows(B, k, eager, gpu=gpu, vllm=vllm)
                    verify = plain_at(by_rows, n, moe)
                    draft_ms = drafter_at(db, k, "draft_ms")
                    sample = sample_extra_at(db, k)
                    rate = rates_for(rates, draft)
                    tail = 0.0
                    if tokens and B > 1:  # the drafter's and sampling's time at B every step
                        tail = batch_step([plain_at(by_rows, step_rows(m, k, eager, gpu=gpu,
                                                                       vllm=vllm), moe)
                                           + draft_ms + sample for m in range(1, int(B) + 1)],
                                          round_survival(rate, k, tokens)) - verify - draft_ms \
                            - sample
                    step = verify + draft_ms + sample + tail
                    al = acceptance_length(rate, k)
                    rows.append({"layers": layers, "eager": eager, "draft": draft, "k": k,
                                 "B": B, "al": al, "verify_rows": n, "verify_ms": verify,
                                 "draft_ms": draft_ms, "sample_extra_ms": sample,
                                 "tail_ms": tail,
                                 "pred_step_ms": step,
                                 "draft_host_ms": drafter_at(db, k, "draft_host_ms"),
                                 "drafter_scaled": drafter_scaled(db, k),
                                 "pred_tok_s": 1e3 * B * al / step,
                                 "pred_speedup": al * t0 / step,
                                 "al_needed": step / t0})
    out = pd.DataFrame(rows)
    if len(out):
        best = out.groupby([*CONFIG, "B"]).pred_speedup.transform("max")
        out["best"] = out.pred_speedup == best
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
    costs = step_costs(results, max_tokens)
    drafts = draft_ms(results)
    timed = passes(results, max_tokens)
    rows = []
    for _, r in costs[costs.k > 0].iterrows():
        rates, tokens = _measured_rates(r, timed), int(np.rint(r.tokens))

        def mine(r=r, rates=rates, drafts=drafts, **kw) -> pd.DataFrame:
            return _point_prediction(costs, drafts, r, rates, **kw)

        p = mine(tokens=tokens)
        if p.empty:
            continue
        q = p.iloc[0]
        serial = q.pred_speedup * q.pred_step_ms / (q.pred_step_ms - q.draft_ms
                                                    + max(q.draft_host_ms, q.draft_ms))
        rows.append({**r.to_dict(), "pred_step_ms": q.pred_step_ms, "draft_ms": q.draft_ms,
                     "sample_extra_ms": q.sample_extra_ms,
                     "verify_ms": q.verify_ms, "pred_tail_ms": q.tail_ms,
                     "drafter_scaled": q.drafter_scaled, "pred_speedup": q.pred_speedup,
                     "error": q.pred_speedup / r.speedup - 1, "draft_host_ms": q.draft_host_ms,
                     "error_steady": mine().pred_speedup.iloc[0] / r.speedup - 1,
                     "error_linear": mine(tokens=tokens, moe=None).pred_speedup.iloc[0]
                     / r.speedup - 1,
                     "error_no_sample": mine(tokens=tokens, drafts=drafts.assign(
                         sample_extra_ms=np.nan)).pred_speedup.iloc[0] / r.speedup - 1,
                     "pred_serial_speedup": serial,
                     "bracketed": bool(serial <= r.speedup <= q.pred_speedup)
                     if pd.notna(q.draft_host_ms) else None})
    return pd.DataFrame(rows)


BUDGET = ("verify_extra_ms", "sampling_ms", "drafter_ms", "tail_extra_ms", "idle_ms",
          "rest_ms")
"""The parts of `error_budget`, in the order they are summed."""


def error_budget(validated: pd.DataFrame, anatomy: pd.DataFrame) -> pd.DataFrame:
    """Where the model's error goes, per speculative point with a split pass that timed the
    target's forward: the measured step less the predicted one (`validated`, what `validate`
    returns), `err_ms`, as the sum of what the model prices otherwise or leaves out
    (`anatomy`, what `step_anatomy` returns; several runs' split passes of a point
    averaged): `verify_extra_ms`, the verify forward less the plain step at its rows (which
    holds plain's own sampling and idle time); `sampling_ms`, sampling less the drafter
    inside it less what the model prices for it (`sample_extra_ms`), so plain's own sampling
    where the runs timed it (all of it where they did not); `drafter_ms`, the drafter in the
    split pass less the one priced; `tail_extra_ms`, the batch's tail measured less predicted; `idle_ms`,
    the step the GPU waits for the host; `rest_ms`, what is left (mean against median steps)."""
    v, a = validated, anatomy
    if v.empty or a.empty:
        return pd.DataFrame()
    keys = [*CONFIG, "k", "B"]
    a = a[a.k > 0].groupby(keys, as_index=False).mean(numeric_only=True)
    m = v[[*keys, "step_ms", "pred_step_ms", "verify_ms", "draft_ms", "sample_extra_ms",
           "pred_tail_ms", "error"]].merge(a.drop(columns="step_ms"), on=keys)
    out = m[[*keys, "step_ms", "pred_step_ms", "error"]].assign(
        err_ms=m.step_ms - m.pred_step_ms, verify_extra_ms=m.execute_ms - m.verify_ms,
        sampling_ms=m.sample_ms - m.propose_ms - m.sample_extra_ms,
        drafter_ms=m.propose_ms - m.draft_ms,
        tail_extra_ms=m.tail_ms - m.pred_tail_ms, idle_ms=m.idle_ms)
    out["rest_ms"] = out.err_ms - out[list(BUDGET[:-1])].sum(axis=1)
    return out.sort_values([*CONFIG, "B", "k"], ignore_index=True)


def _point_prediction(costs: pd.DataFrame, drafts: pd.DataFrame, r, rates,
                      **kw) -> pd.DataFrame:
    """`predict`'s row for the measured point `r` (its layers, eager, draft, k and B) at
    acceptance `rates`; `kw` goes to `predict`."""
    p = predict(costs, drafts, rates, ks=[r.k], batches=[r.B], **kw)
    return p[(p.layers == r.layers) & (p.eager == r.eager) & (p.draft == r.draft)]


def _measured_rates(row, df: pd.DataFrame) -> list[float]:
    """The measured per-position acceptance of one engine configuration and batch size, over
    its timed passes `df` (`passes`)."""
    g = df[(df.layers == row.layers) & (df.eager == row.eager) & (df.draft == row.draft)
           & (df.k == row.k) & (df.B == row.B)]
    drafts = g.counters.map(lambda c: c["num_drafts"]).sum()
    acc = np.sum([c["accepted_per_pos"] for c in g.counters], axis=0)
    return [float(a / drafts) for a in acc]


def _pooled_step(g: pd.DataFrame) -> pd.Series:
    """One step time from several measured points of one quantity (plain steps of batch
    sizes that replay one graph): the inverse-variance mean of their means, each standard
    error from its 95% t-interval, and the 95% t-interval of the same mean of the intervals'
    midpoints at their degrees of freedom summed (a single point keeps its own). The interval
    stays the measured one's when the means are redrawn (`extrapolation_spread`)."""
    from scipy import stats

    dof = (g.rounds - 1).clip(lower=1).to_numpy(float)
    se = ((g.step_hi - g.step_lo) / (2 * stats.t.ppf(0.975, dof))).to_numpy(float)
    w = 1 / np.maximum(se, 1e-9) ** 2
    mid = float(np.sum(w * (g.step_lo + g.step_hi).to_numpy(float) / 2) / w.sum())
    half = float(stats.t.ppf(0.975, dof.sum()) / np.sqrt(w.sum()))
    return pd.Series({"step_ms": float(np.sum(w * g.step_ms.to_numpy(float)) / w.sum()),
                      "step_lo": mid - half, "step_hi": mid + half})


def _pooled_by(costs: pd.DataFrame, key: str) -> pd.DataFrame:
    """`costs`' steps pooled per value of `key` (`_pooled_step`), sorted by it."""
    return costs.groupby(key)[["step_ms", "step_lo", "step_hi", "rounds"]].apply(
        _pooled_step).sort_index()


def _plain_layers(costs: pd.DataFrame, eager: bool) -> list[int]:
    """The layer counts with plain steps at `eager`, sorted."""
    return sorted(int(x) for x in costs[(costs.k == 0) & (costs.eager == eager)].layers.unique())


def fit_layers(costs: pd.DataFrame, layers: int, eager: bool = False) -> tuple[
        pd.DataFrame, pd.DataFrame]:
    """The plain step at `layers` decoder layers from the measured layer counts: per graph
    size n (the rows a plain step ran, `step_costs`' `rows`: an engine without an n-row graph
    runs B = n on a larger one, so steps are paired across depths by rows, never by B), a line
    T_plain(n, L) = a + b L (least squares; needs two layer counts; where several batch
    sizes ran one graph at one depth, their steps pooled by `_pooled_step`). A size is
    extrapolated only where the deepest plain step's 95% interval lies above the shallowest
    one's: a step that does not grow resolvably with depth is host time, and a line through
    it says nothing about `layers` (ValueError when no size resolves, or fewer than two
    layer counts). Returns (rows of (n, a_ms, b_ms_per_layer, resolved), the plain steps at
    `layers` as `step_costs` rows with B = rows = n)."""
    plain = costs[(costs.k == 0) & (costs.eager == eager)]
    Ls = _plain_layers(costs, eager)
    if len(Ls) < 2:
        raise ValueError("extrapolation needs plain steps at two layer counts; have "
                         f"{Ls}")
    fit, synth = [], []
    for n, g in plain.groupby("rows"):
        by_L = _pooled_by(g, "layers")
        if len(by_L) < 2:
            continue
        b, a = np.polyfit(by_L.index.to_numpy(float), by_L.step_ms, 1)
        resolved = bool(by_L.step_lo.iloc[-1] > by_L.step_hi.iloc[0])
        fit.append({"n": int(n), "a_ms": a, "b_ms_per_layer": b, "resolved": resolved})
        if resolved:
            synth.append({"layers": layers, "eager": eager, "k": 0, "B": int(n),
                          "rows": int(n), "step_ms": a + b * layers})
    if not synth:
        raise ValueError(f"the plain step does not grow beyond its 95% interval from "
                         f"{Ls[0]} to {Ls[-1]} layers at any graph size (host-bound "
                         f"steps): a line through them says nothing about {layers} layers")
    return pd.DataFrame(fit), pd.DataFrame(synth)


def extrapolate(costs: pd.DataFrame, drafts: pd.DataFrame, rates, layers: int =
                PRODUCTION_LAYERS, eager: bool = False, ks=range(1, 6)) -> dict:
    """Predicted speedup per (k, B) at `layers` decoder layers: the plain steps there from
    `fit_layers`, the drafter times of the deepest measured run (the draft does not grow
    with the target). Returns {"fit": `fit_layers`' lines, "prediction": rows like
    `predict`, "plain": the plain steps at `layers` (B = rows = n), "drafts": the drafter
    times used}."""
    fit, plain = fit_layers(costs, layers, eager)
    Ls = _plain_layers(costs, eager)
    deepest = max(drafts[drafts.eager == eager].layers, default=Ls[-1])
    d = drafts[(drafts.layers == deepest) & (drafts.eager == eager)].assign(layers=layers)
    spec_B = sorted(costs[costs.k > 0].B.unique())
    pred = predict(plain, d, rates, ks=ks, batches=spec_B)
    return {"fit": fit, "prediction": pred, "layers_measured": Ls,
            "drafts_from_layers": int(deepest), "plain": plain, "drafts": d}


def held_out(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """The depth extrapolation checked against a depth it did not see: per eager/graphs
    configuration, the deepest layer count with speculative points and plain steps is left
    out, `extrapolate`'s chain (`fit_layers` over the other layer counts, two or more; the
    drafter times of the deepest of them that has any, else the held depth's own: the draft
    does not grow with the target) predicts it, and the measurement there is the
    check. Rows: `kind` "plain" (per graph size: the measured step, pooled as the fit pools,
    against the line's) and "spec" (per point: the measured speedup against the prediction
    at the point's measured acceptance, as `validate` does), with `measured`, its 95%
    interval (`lo`, `hi`), `predicted` and `error` = predicted / measured - 1, and the
    layer counts fitted (`from_layers`). Empty where no configuration has such a depth."""
    costs = step_costs(results, max_tokens)
    if costs.empty:
        return pd.DataFrame()
    drafts, timed, rows = draft_ms(results), passes(results, max_tokens), []
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
            p = _point_prediction(synth, d, r, _measured_rates(r, timed),
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
                         draws: int = 200, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """How far the `extrapolate` prediction moves with the plain steps' timing noise: `draws`
    times, every measured plain step is drawn from its t distribution (its rounds less one
    degrees of freedom, its standard error as scale) and the layer fit and prediction redone.
    The drafter times (medians of hundreds of calls) and the acceptance profile stay fixed, so
    this is the timing's share of the uncertainty, not the acceptance's. Returns per (draft,
    B, k) the 2.5 and 97.5 percentiles of the predicted speedup (`pred_lo`, `pred_hi`) and the
    share of draws in which that k is its setting's best at B (`p_best`); and per (B, draft)
    its best k's speedup (`best_speedup`, `best_lo`, `best_hi`) and the share of draws in
    which that setting is the fastest at B (`p_fastest`: methods compared on the same draw)."""
    from scipy import stats

    g = np.random.default_rng(seed)
    plain = costs[(costs.k == 0) & (costs.eager == eager)]
    dof = (plain.rounds - 1).clip(lower=1).to_numpy()
    se = ((plain.step_hi - plain.step_lo) / (2 * stats.t.ppf(0.975, dof))).fillna(0).to_numpy()
    runs = []
    for i in range(draws):
        drawn = costs.copy()
        drawn.loc[plain.index, "step_ms"] = plain.step_ms + g.standard_t(dof) * se
        runs.append(extrapolate(drawn, drafts, rates, layers, eager, ks)["prediction"]
                    .assign(draw=i))
    every = pd.concat(runs, ignore_index=True).dropna(subset=["pred_speedup"])
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


def memory_check(runs) -> pd.DataFrame:
    """Per engine of one gpubench run or several (`run`, `engine`): `speclab.memory`'s
    weight estimate (target, plus the draft, or the MTP module, for k > 0) at the engine's
    max_num_batched_tokens beside vLLM's "Model loading took ... GiB", and the error."""
    import re

    from speclab import memory
    from speclab.fixtures import realshape
    from speclab.gpubench import MAX_BATCHED

    rows = []
    for e in engines(runs):
        took = [float(m.group(1)) for f in e.get("log_facts", [])
                if (m := re.search(r"Model loading took ([\d.]+) GiB", f))]
        if not took:
            continue
        batched = [int(m.group(1)) for f in e.get("log_facts", [])
                   if (m := re.search(r"'max_num_batched_tokens': (\d+)", f))]
        cfg = realshape.realshape_config(e["layers"], e.get("expert_dtype", "fp4"))
        est = memory.per_gpu(memory.Files(config=cfg, source="config"), 1,
                             (batched or [MAX_BATCHED])[-1])[0]
        if e["k"] and e.get("method") == "mtp":  # the target's own mtp.0
            est += sum(memory.mtp_weight_bytes(realshape.realshape_config(
                e["layers"], e.get("expert_dtype", "fp4"), mtp=True)))
        elif e["k"]:
            est += sum(memory.weight_bytes(realshape.draft_config(cfg)))
        rows.append({"run": e["run"], "engine": e["engine"], "estimate_gib": est / 2 ** 30,
                     "vllm_gib": took[-1], "error": est / 2 ** 30 / took[-1] - 1})
    cols = ["run", "engine", "estimate_gib", "vllm_gib", "error"]
    return pd.DataFrame(rows, columns=cols).drop_duplicates(["run", "engine"], keep="last")
