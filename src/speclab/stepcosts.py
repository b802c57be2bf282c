"""What the timed passes measured: a `speclab.gpubench` run's records (results.jsonl,
engines.jsonl) as step costs, drafter times and step anatomy, the input of the cost model
(`speclab.predict`).

Per pass, the decode time is the full pass minus its prefill-only twin, a plain step is that
over the tokens a request generates after its first, a speculative step that over the verify
rounds per request (`num_drafts / B`). Several runs pool their passes when they ran on one
GPU model and vLLM release (`check_poolable`). Split passes (`op` `split`) carry
`speclab.steptiming`'s per-call GPU and host times of the target's forward, sampling and the
drafter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from speclab import analysis, cudagraphs, provenance, steptiming
from speclab.fixtures import dsv4_shapes as SH


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


def _records(runs, name: str) -> list[tuple[Path, dict]]:
    """(run folder, record) for every line of every `name` JSON-lines log in each run's
    folder or below it (all device calls), in order."""
    from speclab.store import read_jsonl

    return [(d, r) for d in run_dirs(runs) for path in sorted(d.rglob(name))
            for r in read_jsonl(path)]


def engines(runs) -> list[dict]:
    """Every engine record of one gpubench run or several (`engines.jsonl`), in order, each
    with its run's folder name (`run`)."""
    return [{**e, "run": d.name} for d, e in _records(runs, "engines.jsonl")]


def host_samples(runs) -> list[dict]:
    """The host's CPU samples of one gpubench run or several (`host.jsonl`,
    `speclab.hostwatch`; [] for runs from before 2026-12-06's seventh session)."""
    return [h for _, h in _records(runs, "host.jsonl")]


def load(runs) -> pd.DataFrame:
    """Every pass of one gpubench run or several (all calls: `results.jsonl` in each folder
    or below it), with its run's folder name (`run`: passes pair, and are kept once, within
    their run), the machine it ran on (`machine`: env.json's, else the run's name) and its
    engine's CUDA-graph capture sizes as resolved (`engines`; column `capture_sizes`, None
    where not recorded). Several runs pool their step costs: they must share a GPU model and
    vLLM release (`check_poolable`)."""
    machine = {p["run"]: p.get("machine") for p in check_poolable(runs)}
    rows = [{**r, "run": d.name, "machine": machine[d.name] or d.name}
            for d, r in _records(runs, "results.jsonl")]
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
    df["rows"] = [cudagraphs.step_rows(b, k, e, z)
                  for b, k, e, z in zip(df.B, df.k, df.eager, sizes)]
    df["tokens"] = after
    df["steps"] = np.where(df.k > 0, drafts / df.B, after)
    df["step_ms"] = 1e3 * df.decode_s / df.steps
    df["tok_s"] = df.B * after / df.decode_s
    df["al"] = np.where(df.k > 0, after / df.steps, 1.0)
    return df


def step_costs(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """Per (layers, eager, k, B, rows): step time, tok/s (mean and 95% t-interval over
    rounds), measured AL, tokens a request and rounds; speedup over the plain engine of the
    same (layers, eager, B) as the geometric mean of per-round ratios (rounds run interleaved,
    so round r pairs), within the point's run, or where its run has no such plain engine
    within the one other run of the same machine (`machine`, a driver started again on one
    machine; `paired_run` names it, else NaN). `rows`, the graph the step ran, keeps apart
    the runs whose engines captured different sizes (B = 5 on a 5-row graph and padded to 8)."""
    df = passes(results, max_tokens)
    keys = [*CONFIG, "k", "B", "rows"]
    rows = []
    for key, g in df.groupby(keys):
        step = analysis.mean_ci(g.step_ms)
        tput = analysis.mean_ci(g.tok_s)
        rows.append({**dict(zip(keys, key)), "step_ms": step[0], "step_lo": step[1],
                     "step_hi": step[2], "tok_s": tput[0], "tok_s_lo": tput[1],
                     "tok_s_hi": tput[2], "al": g.al.mean(), "tokens": g.tokens.median(),
                     "rounds": len(g)})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    sp = []
    for _, r in out.iterrows():
        mine = df[(df.layers == r.layers) & (df.eager == r.eager) & (df.draft == r.draft)
                  & (df.k == r.k) & (df.B == r.B) & (df.rows == r.rows)]
        base = df[(df.layers == r.layers) & (df.eager == r.eager) & (df.k == 0) & (df.B == r.B)]
        paired = mine.merge(base, on=[*_run_key(df), "round"], suffixes=("", "_0"))
        other = np.nan
        if paired.empty and "machine" in df:
            near = base[base.machine.isin(mine.machine) & ~base.run.isin(mine.run)]
            if near.run.nunique() == 1:
                paired = mine.merge(near, on=["machine", "round"], suffixes=("", "_0"))
                other = near.run.iloc[0]
        sp.append((*analysis.ratio_ci(paired.tok_s, paired.tok_s_0), other) if len(paired)
                  else (np.nan,) * 4)
    out["speedup"], out["speedup_lo"], out["speedup_hi"], out["paired_run"] = zip(*sp)
    return out


def plain_by_run(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """The plain step of each (layers, eager, B, rows) that two or more pooled runs measured,
    per run (mean and 95% interval over its rounds), with `spread` (largest / smallest mean -
    1) and `overlap` (every run's interval overlaps every other's): whether pooling them is
    pooling one quantity. `rows` is the graph the step ran (`cudagraphs.step_rows`): a B that
    one engine captured and another padded to a larger graph is two quantities, not compared."""
    df = passes(results, max_tokens)
    df = df[df.k == 0]
    rows = []
    for (layers, eager, B, graph), g in df.groupby(["layers", "eager", "B", "rows"]):
        if g.run.nunique() < 2:
            continue
        per = [(run, *analysis.mean_ci(h.step_ms), len(h)) for run, h in g.groupby("run")]
        means = [m for _, m, _, _, _ in per]
        rows += [{"layers": layers, "eager": eager, "B": B, "rows": graph, "run": run,
                  "step_ms": m, "step_lo": lo, "step_hi": hi, "rounds": n,
                  "spread": max(means) / min(means) - 1,
                  "overlap": max(lo for _, _, lo, _, _ in per) <= min(hi for *_, hi, _ in per)}
                 for run, m, lo, hi, n in per]
    return pd.DataFrame(rows, columns=["layers", "eager", "B", "rows", "run", "step_ms",
                                       "step_lo", "step_hi", "rounds", "spread", "overlap"])


def step_calls(r, op: str) -> list[dict]:
    """A split pass's recorded calls of `op` at its decode steps (B (k + 1) scheduled tokens:
    plain or verify steps; prefill steps excluded); records without an op are the drafter's."""
    return [c for c in r["calls"] if c.get("op", "propose") == op
            and c["tokens"] == r.B * (r.k + 1)]


def decode_calls(r, ops) -> list[dict]:
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


def split_passes(results: pd.DataFrame) -> pd.DataFrame:
    return _once(results[results.op == "split"]) if "op" in results else results.iloc[:0]


def draft_ms(results: pd.DataFrame) -> pd.DataFrame:
    """Drafter GPU time per decode step (median over a split pass's drafter calls at its
    verify steps) per (layers, eager, draft, k, B), with its host time where recorded, and
    `sample_extra_ms`: the speculative step's sampling less the drafter inside it less the
    plain step's sampling (`plain_sample_ms`), what verifying adds to sampling; NaN where the
    split passes timed only the drafter."""
    splits = split_passes(results)
    rows = []
    for _, r in splits.iterrows():
        calls = step_calls(r, "propose")
        if r.k and calls:
            drafter = _median(calls, "ms")
            rows.append({"layers": r.layers, "eager": r.eager,
                         "draft": draft_setting(r.engine, r.k), "k": r.k, "B": r.B,
                         "draft_ms": drafter,
                         "draft_host_ms": _median(calls, "host_ms"), "draft_calls": len(calls),
                         "sample_extra_ms": _median(step_calls(r, "sample"), "ms") - drafter
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
    at_B = [c for _, r in plain[plain.B == B].iterrows() for c in step_calls(r, "sample")]
    return _median(at_B or [c for _, r in plain.iterrows() for c in step_calls(r, "sample")],
                   "ms")


def step_anatomy(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """Per split pass: median GPU and host ms per decode step of the target's forward
    (`execute`), of sampling (`sample`, which holds the drafter) and of the drafter
    (`propose`) at its B requests, from `speclab.steptiming`'s records (runs that recorded
    only the drafter have no rows here); `gpu_ms`: the GPU's execute and sample over all the
    pass's decode steps, those its last requests ran alone included, per round a request
    ran, and `tail_ms`, what that adds to the mean step at B (the batch's tail,
    `predict.batch_step`); with the timed passes' step (`step_costs`), `idle_ms`: the step less
    `gpu_ms`, the time a step the GPU waits for the host; `gap_execute_ms` and
    `gap_sample_ms` (`steptiming.gaps`): where in the split pass's step the GPU waited."""
    rows = []
    for _, r in split_passes(results).iterrows():
        row = {"layers": r.layers, "eager": r.eager, "draft": draft_setting(r.engine, r.k),
               "k": r.k, "B": r.B}
        for op in ("execute", "sample", "propose"):
            calls = step_calls(r, op)
            row[f"{op}_ms"], row[f"{op}_host_ms"] = (_median(calls, "ms"),
                                                     _median(calls, "host_ms"))
        if not np.isnan(row["execute_ms"]):
            decode = decode_calls(r, ("execute", "sample"))
            executes = [c for c in decode if c["op"] == "execute"]
            row["gpu_ms"] = sum(c["ms"] for c in decode) / (sum(c["reqs"] for c in executes)
                                                           / r.B)
            row["tail_ms"] = row["gpu_ms"] - (sum(c["ms"] for c in decode if c["reqs"] == r.B)
                                              / sum(c["reqs"] == r.B for c in executes))
            rows.append({**row, **steptiming.gaps(r["calls"], r.B, r.k)})
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


def serve_costs(results: pd.DataFrame, max_tokens: int = 128) -> pd.DataFrame:
    """`step_costs` of the passes behind `vllm serve` (gpubench `serve` engines: B requests
    at once over HTTP), each speculative engine against the plain serve engine of its depth;
    empty when none ran."""
    if "op" not in results or not (results.op == "serve").any():
        return pd.DataFrame()
    served = results[results.op == "serve"].assign(op="pass")
    return step_costs(served, max_tokens)


def measured_rates(row, df: pd.DataFrame) -> list[float]:
    """The measured per-position acceptance of one engine configuration and batch size, over
    its timed passes `df` (`passes`)."""
    g = df[(df.layers == row.layers) & (df.eager == row.eager) & (df.draft == row.draft)
           & (df.k == row.k) & (df.B == row.B)]
    drafts = g.counters.map(lambda c: c["num_drafts"]).sum()
    acc = np.sum([c["accepted_per_pos"] for c in g.counters], axis=0)
    return [float(a / drafts) for a in acc]


def memory_check(runs) -> pd.DataFrame:
    """Per engine of one gpubench run or several (`run`, `engine`): `speclab.memory`'s
    weight estimate (target, plus the draft, or the MTP module, for k > 0) at the engine's
    max_num_batched_tokens beside vLLM's "Model loading took ... GiB", and the error."""
    import re

    from speclab import memory
    from speclab.benchworker import MAX_BATCHED

    rows = []
    for e in engines(runs):
        took = [float(m.group(1)) for f in e.get("log_facts", [])
                if (m := re.search(r"Model loading took ([\d.]+) GiB", f))]
        if not took:
            continue
        batched = [int(m.group(1)) for f in e.get("log_facts", [])
                   if (m := re.search(r"'max_num_batched_tokens': (\d+)", f))]
        cfg = SH.realshape_config(e["layers"], e.get("expert_dtype", "fp4"))
        est = memory.per_gpu(memory.Files(config=cfg, source="config"), 1,
                             (batched or [MAX_BATCHED])[-1])[0]
        if e["k"] and e.get("method") == "mtp":  # the target's own mtp.0
            est += sum(memory.mtp_weight_bytes(SH.realshape_config(
                e["layers"], e.get("expert_dtype", "fp4"), mtp=True)))
        elif e["k"]:
            est += sum(memory.weight_bytes(SH.realshape_draft_config(cfg)))
        rows.append({"run": e["run"], "engine": e["engine"], "estimate_gib": est / 2 ** 30,
                     "vllm_gib": took[-1], "error": est / 2 ** 30 / took[-1] - 1})
    cols = ["run", "engine", "estimate_gib", "vllm_gib", "error"]
    return pd.DataFrame(rows, columns=cols).drop_duplicates(["run", "engine"], keep="last")
