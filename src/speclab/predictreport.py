"""`predict.md` and `predict.html` for a gpubench run folder: the measured speedups, the cost
model beside them (`speclab.predict`), the production-depth extrapolation and what a TP + EP
node would change to it (`speclab.nodecost`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from speclab import (
    analysis,
    cudagraphs,
    hostwatch,
    layerfit,
    nodecost,
    paths,
    predict,
    provenance,
    stepcosts,
)
from speclab.predict import MOE
from speclab.stepcosts import CONFIG

PADDING_BATCHES = (*range(1, 9), 10, 12, 16, 20, 24, 32, 48, 64)  # the padding table's rows

REFERENCE_RUNS = ("h200-realshape-20261204-vllm026-graphs",
                  "h200-realshape-20261205-vllm026-deeprest",
                  "h200-realshape-20261205-vllm026-next",
                  "h200-realshape-20261206-vllm026-fit24",
                  "h200-realshape-20261207-vllm026-deepfinal")
"""The H200 runs the README's "how much faster?" answer pools
(`data/runs/h200-realshape-vllm026-pooled`; 32 real-shape layers, vLLM 0.26.0, target and
drafter in CUDA graphs): EAGLE-3 at k = 1..5 with plain at 24 and 32 layers, DeepSeek-V4's
own MTP head at k = 1 and 3, plain at 24 layers at every graph size below 16 rows (the layer
fit), and k = 4 again beside plain at its verify graphs' rows."""


def reference_runs() -> list[Path] | None:
    """`REFERENCE_RUNS` in this checkout's data/runs (None in an installation without
    them)."""
    if paths.CHECKOUT is None:
        return None
    runs = [paths.CHECKOUT / "data" / "runs" / name for name in REFERENCE_RUNS]
    return runs if all(r.is_dir() for r in runs) else None


ACCEPTANCE_FORMS = ("per-position acceptance is comma-separated non-increasing values in "
                    "[0, 1], or a folder of `speclab run` / `sweep` (RUN or RUN:POINT_ID)")


def acceptance_from(value, method: str = "eagle3"
                    ) -> tuple[list[float], analysis.MeasuredProfile | None]:
    """(rates, where they came from) for `report`: `value` as per-position unconditional rates
    (a list, or comma-separated text; None), or a `speclab run` / `sweep` folder, "RUN" or
    "RUN:POINT_ID", whose `method` point measured them (`analysis.run_profile`). Raises
    ValueError saying which forms it takes."""
    if isinstance(value, (str, Path)):
        text = str(value)
        run, _, point = text.rpartition(":")
        if Path(text).is_dir():
            run, point = text, None
        if run and Path(run).is_dir():
            found = analysis.run_profile(Path(run), method, point)
            return predict.acceptance_profile(found.rates, found.k), found
        try:
            value = [float(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"{ACCEPTANCE_FORMS} (neither numbers nor a folder)") from None
    try:
        return predict.acceptance_profile(value, len(value)), None
    except ValueError as e:
        raise ValueError(f"{ACCEPTANCE_FORMS} ({e})") from None


def _md(df: pd.DataFrame, cols: list[str]) -> str:
    """A markdown table of `cols` (floats to 4 significant digits, NaN as n/a)."""
    cols = [c for c in cols if c in df]
    if df.empty:
        return "(none)"

    def cell(v) -> str:
        if isinstance(v, (float, np.floating)):
            return "n/a" if np.isnan(v) else f"{v:.4g}"
        return str(v)

    rows = [" | ".join(cell(v) for v in r) for r in df[cols].itertuples(index=False)]
    return "\n".join([" | ".join(cols), " | ".join("---" for _ in cols), *rows])


def report(runs, rates=predict.PUBLISHED_EAGLE31,
           layers: int = layerfit.PRODUCTION_LAYERS, out_dir: Path | None = None,
           gpus: int = 8, mtp_rates=predict.PUBLISHED_MTP, measured=()) -> Path:
    """`predict.md` and `predict.html` (+ `speedup_vs_k` figure) for a gpubench run folder,
    or several pooled (`stepcosts.load`: one GPU model and vLLM release; written to `out_dir`,
    which several runs need): measured speedup vs k per batch size with CIs, predicted beside
    measured with the largest error, the best k, the `layers`-layer prediction at acceptance
    `rates` (MTP engines at `mtp_rates`) with its fit, and (`gpus` > 1) what a TP `gpus` + EP
    node changes to it. `measured`: the `analysis.MeasuredProfile`s `rates` / `mtp_rates`
    came from (named under the prediction; their resamples join the spread's draws).
    Raises ValueError when the runs have no timed round, cannot pool, or `gpus` has no
    all-reduce curve."""
    from speclab import plots

    if gpus != 1 and gpus not in nodecost.AR_US:
        raise ValueError(f"--gpus {gpus}: the node bracket has all-reduce curves for "
                         f"{sorted(nodecost.AR_US)} GPUs (1: no node section)")
    dirs = stepcosts.run_dirs(runs)
    if len(dirs) > 1 and out_dir is None:
        raise ValueError("several runs pooled need an output folder of their own (--out)")
    run_dir = dirs[0]
    out_dir = Path(out_dir or run_dir)
    name = run_dir.name if len(dirs) == 1 else out_dir.name
    res = stepcosts.load(dirs)
    costs = stepcosts.step_costs(res)
    title = f"# Speed at DeepSeek-V4-Flash's real shapes: {name}"
    if costs.empty:
        served = _served_lines(res, pd.DataFrame())
        if not served:
            raise ValueError(f"{run_dir}: no timed pass (round >= 1) yet; round 0 is the "
                             "warm-up")
        return _write(out_dir, name, "\n".join(
            [title, "", *_pooled_section(dirs, res),
             ("Only engines behind `vllm serve` ran: no offline pass, so no step costs for "
              "the cost model and no prediction."), "", *served, *_host_lines(dirs, res),
             *_weights_lines(dirs)]))
    drafts = stepcosts.draft_ms(res)
    val = predict.validate(res)
    spec = costs[costs.k > 0]
    across = spec.paired_run.notna().any()  # a point paired with another run of its machine
    lines = [title, "", *_pooled_section(dirs, res),
             ("Decode throughput (tokens after the first, per second) and speedup over plain "
             "decoding at the same batch size, mean and 95% interval over timed rounds "
             "(speedup: geometric mean of per-round ratios, round r paired with plain's round r"
              + (" of its own run, or where `paired_run` names one, of the one other run on "
                 "the same machine, env.json's `machine`" if across else "") + ")."), "",
             (f"Timed rounds per point: {spec.rounds.min()} to {spec.rounds.max()}. "
              + ("**A point with one round has no interval and is not a result.**"
                 if spec.rounds.min() < 2 else "")) if len(spec) else "", "",
             _md(spec.sort_values([*CONFIG, "B", "k"]),
                 [*CONFIG, "B", "k", "al", "step_ms", "tok_s", "tok_s_lo", "tok_s_hi",
                  "speedup", "speedup_lo", "speedup_hi", "rounds",
                  *(["paired_run"] if across else [])]), ""]
    paired = spec.dropna(subset=["speedup"])  # a configuration with a plain engine beside it
    best = paired.loc[paired.groupby([*CONFIG, "B"]).speedup.idxmax()] if len(paired) else paired
    lines += ["## Best k (measured)", "", _md(best, [*CONFIG, "B", "k", "speedup",
                                                    "speedup_lo", "speedup_hi"]), ""]
    if len(val):
        worst = val.error.abs().max()
        lines += ["## Predicted vs measured", "",
                  ("Prediction from the plain step at the rows the verify step's CUDA graph "
                   "runs (`speclab.cudagraphs`: B(k+1) tokens padded to a captured size), the "
                   "drafter's measured time (`drafter_scaled`: carried from other k, "
                   "`predict.drafter_at`), what speculative sampling adds to plain's "
                   "(`sample_extra_ms`, from the split passes; 0 where they did not time it) "
                  "and the point's measured acceptance, for the pass as it ran: B requests of "
                  "its tokens started together, whose last rounds run the requests still "
                  "going (`pred_tail_ms`, what that adds a step, from the acceptance alone: "
                  f"`predict.round_survival`); largest |error| {worst:.1%} "
                  f"({val.error_steady.abs().max():.1%} without the tail, every step at B, "
                  f"`error_steady`; {val.error_linear.abs().max():.1%} with the plain step "
                  f"linear in n, `error_linear`; {val.error_no_sample.abs().max():.1%} "
                  "without the sampling term, `error_no_sample`)."), "",
                  _md(val, [*CONFIG, "B", "k", "step_ms", "pred_step_ms", "verify_ms",
                            "draft_ms", "sample_extra_ms", "pred_tail_ms", "drafter_scaled",
                            "speedup", "pred_speedup", "error", "error_steady",
                            "error_linear", "error_no_sample"]),
                  "", (f"T_plain(n) is linear in E(n) = {MOE[0]}(1 - (1 - {MOE[1]}/{MOE[0]})^n), "
                       "the routed experts n tokens read per MoE layer, between the measured "
                       "plain batch sizes (`predict.plain_at`)."), ""]
        if val.draft_host_ms.notna().any():
            lines += [("With the drafter's host time serial to the verify step (the bound for "
                       "a drafter whose launches the GPU waits for): `bracketed` says whether "
                       "the measured speedup lies between the two predictions."), "",
                      _md(val[val.draft_host_ms.notna()],
                          [*CONFIG, "B", "k", "draft_ms", "draft_host_ms", "speedup",
                           "pred_serial_speedup", "pred_speedup", "bracketed"]), ""]
    by_rows = predict.verify_by_rows(res)
    if len(by_rows):
        lines += ["## Verify steps by CUDA-graph rows", "",
                  ("The target's forward in the split passes (GPU ms, median) per scheduled "
                   "tokens, with the rows of the graph it replayed and the plain step at those "
                   "rows: a verify step costs what its graph's rows cost, not its tokens "
                   "(vLLM rounds the capture sizes up to multiples of k + 1); "
                   "`plain_tokens_ms`, the plain step at its tokens, is the model without "
                   "padding."), "",
                  _md(by_rows, [*CONFIG, "k", "tokens", "rows", "execute_ms",
                                "plain_rows_ms", "plain_tokens_ms", "calls"]), "",
                  "![verify steps by rows](figures/verify_rows.png)", ""]
        curves = {}
        for key in set(zip(by_rows.layers, by_rows.eager)):
            c = predict.rows_curve(costs, *key)
            n = range(int(c.index.min()), int(c.index.max()) + 1) if len(c) else []
            curves[key] = pd.Series([predict.plain_at(c, x) for x in n], index=list(n))
        plots.save(plots.verify_rows(by_rows, curves), out_dir / "figures", "verify_rows",
                   caption=f"{name}: verify forward vs the rows of its CUDA graph", close=True)
    if len(spec):
        batches = sorted({*(int(b) for b in spec.B.unique()), *PADDING_BATCHES})
        rules = {"v026": ("hopper", "0.26"), "v034": ("hopper", "0.34"),
                 "v034sm100": ("blackwell", "0.34")}
        pad = pd.DataFrame([{**r, "col": f"{name}_k{r['k']}"} for name, (gpu, vllm) in
                            rules.items() for r in cudagraphs.padding(batches, range(1, 6),
                                                                      gpu, vllm)])
        pad["padding"] = (100 * pad.padding).round().astype(int)
        table = pad.pivot_table(index="B", columns="col", values="padding").reset_index()
        cols = [f"{name}_k{k}" for name in rules for k in range(1, 6)]
        lines += ["## Padding of the verify step at vLLM's default graphs", "",
                  ("Percent of the verify step's rows that are padding, per batch size B and k, "
                   "at vLLM's default CUDA-graph sizes (`speclab.cudagraphs`): `v026` as "
                   "0.26.0 captures (any GPU; the runs here), `v034` as 0.34.0 does on "
                   "H100/H200, `v034sm100` on SM100. A padded row costs what a real one does; "
                   "plain decoding pads too (B = 5 runs 8 rows), inside its measured step."),
                  "",
                  _md(table, ["B", *cols]), ""]
    lines += _served_lines(res, val)
    anatomy = stepcosts.step_anatomy(res)
    if len(anatomy):
        cols = [*CONFIG, "k", "B", *(f"{op}_{t}" for op in ("execute", "sample", "propose")
                                     for t in ("ms", "host_ms")), "gpu_ms", "tail_ms",
                "step_ms", "idle_ms"]
        timeline = anatomy.filter(like="gap_").notna().any()
        cols += [c for c in timeline.index if timeline[c]]  # runs since 2026-12-06
        lines += ["## Step anatomy (split passes)", "",
                  ("Median per decode step, GPU time (CUDA events around the call) and host "
                   "time (wall time of the call) of the target's forward (`execute`), of "
                   "sampling (`sample`, which runs the drafter) and of the drafter "
                   "(`propose`), from `speclab.steptiming`. A host time above its GPU time is "
                   "a part the GPU waits for. `gpu_ms`: the GPU's execute and sample over "
                   "all the pass's decode steps, its last requests' alone included, per "
                   "round a request ran; `tail_ms`, what those last steps add to the step at "
                   "B (the cost model's `pred_tail_ms` predicts it); `idle_ms`, the timed "
                   "passes' step less `gpu_ms`, what a step spends with the GPU waiting (the "
                   "cost model leaves it out)" + ("; `gap_execute_ms` and `gap_sample_ms`, "
                   "the median time in the split pass's step that the GPU ran neither call "
                   "before the target's forward and before sampling (from the calls' GPU "
                   "start times): where that wait falls." if timeline.any() else ".")), "",
                  _md(anatomy.sort_values([*CONFIG, "B", "k"]), cols), ""]
    budget = predict.error_budget(val, anatomy)
    budget = budget.dropna(subset=["err_ms"]) if len(budget) else budget
    if len(budget):
        worst = budget.loc[budget.error.abs().idxmax()]
        part = max(predict.BUDGET[:-1], key=lambda c: worst[c])
        lines += ["## Where the model's error goes", "",
                  ("The measured step less the predicted one (`err_ms`; `error` is the "
                   "speedup's) as the sum of what the model prices otherwise or leaves out, "
                   "from the split passes (`predict.error_budget`): the verify forward above "
                   "the plain step at its rows (`verify_extra_ms`), sampling less the drafter "
                   "inside it and less the sampling term the model prices (`sampling_ms`: "
                   "plain's own sampling, which the plain step at the verify rows holds "
                   "too, where the runs timed it), the drafter's split-pass "
                   "time less the one priced (`drafter_ms`), the batch's tail measured less "
                   "predicted (`tail_extra_ms`), the GPU waiting for the host (`idle_ms`) and "
                   "the rest (`rest_ms`, mean against median steps). "
                   f"Of these points the largest error, {worst.error:+.1%} at B = "
                   f"{int(worst.B)}, k = {int(worst.k)}"
                   f"{f' ({worst.draft})' if worst.draft else ''}, is "
                   f"{worst.err_ms:.2f} ms a step, most of it `{part}` "
                   f"({worst[part]:.2f} ms)."), "",
                  _md(budget, [*CONFIG, "k", "B", "step_ms", "pred_step_ms", "error", "err_ms",
                               *predict.BUDGET]), ""]
    lines += _held_out_lines(res, layers)
    try:
        by_method = {"eagle3": list(rates), "mtp": list(mtp_rates)}
        ex = layerfit.extrapolate(costs, drafts, by_method, layers)
        has_mtp = any(predict.method_of(d) == "mtp" for d in drafts.draft)
        lines += [f"## {layers} layers at acceptance {_rates(rates)}"
                  + (f" (MTP: {_rates(mtp_rates)})" if has_mtp else ""), "",
                  *[line for m in measured for line in (m.describe(), "")],
                  (f"Plain step per batch size n fitted as a + b·L over layers "
                  f"{ex['layers_measured']}; drafter and sampling times from the "
                  f"{ex['drafts_from_layers']}-layer run. Requests replaced as they finish "
                  "(serving at concurrency B; "
                  "an offline batch also pays its tail, `pred_tail_ms` above). `al_needed`: "
                  "the acceptance length at which k breaks even at B, for any draft of that "
                  "drafter cost (a draft whose AL is below it slows decoding). "
                  "`pred_serial_speedup`: the same with the drafter's host time "
                  "(`draft_host_ms`, from the split passes) serial to the verify step, what a "
                  "host that cannot run ahead of the GPU leaves (`predict.predict`). One GPU, "
                  "TP 1"
                  + (f"; the next section says what a TP {gpus} + EP node changes." if gpus > 1
                     else ".")), "",
                  _md(ex["fit"], ["n", "a_ms", "b_ms_per_layer", "resolved"]), "",
                  _md(ex["prediction"], ["draft", "B", "k", "al", "verify_rows", "verify_ms",
                                         "draft_ms", "sample_extra_ms", "drafter_scaled",
                                         "pred_step_ms", "pred_tok_s", "pred_speedup",
                                         "draft_host_ms", "pred_serial_speedup",
                                         "al_needed", "best"]),
                  "", *_spread_lines(costs, drafts, by_method, layers, measured)]
        if gpus > 1:
            gpu = provenance.gpu_env(run_dir).get("gpu")  # pooled runs share one model
            lines += _node_section(ex, by_method, gpus, _expert_dtypes(dirs), gpu, out_dir)
    except ValueError as e:
        lines += [f"## {layers} layers", "", f"Not extrapolated: {e}.", ""]
    lines += [*_host_lines(dirs, res), *_weights_lines(dirs)]
    plots.save(plots.speedup_vs_k(spec, val), out_dir / "figures", "speedup_vs_k",
               caption=f"{name}: measured (95% CI) and predicted speedup", close=True)
    return _write(out_dir, name, "\n".join(lines), "figures/speedup_vs_k.png")


def _write(out_dir: Path, name: str, md: str, figure: str | None = None) -> Path:
    """`predict.md` and `predict.html` (with `figure` below the tables) into `out_dir`."""
    import html

    import mistune

    from speclab import store

    out_dir.mkdir(parents=True, exist_ok=True)
    store.atomic_write(out_dir / "predict.md", md)
    store.atomic_write(
        out_dir / "predict.html",
        "<!doctype html><meta charset='utf-8'><title>" + html.escape(name) +
        "</title><style>body{font-family:sans-serif;max-width:75em;margin:auto}table"
        "{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}</style>"
        + mistune.html(md) + (f"<img src='{figure}' alt='speedup vs k'>" if figure else ""))
    return out_dir / "predict.md"


def _served_lines(res: pd.DataFrame, val: pd.DataFrame) -> list[str]:
    """The passes behind `vllm serve` (`stepcosts.serve_costs`) as report lines (none where
    no serve engine ran), with the cost model's prediction beside each speculative point
    that also ran offline (`predict.served_vs_model` of `val`, what `predict.validate`
    returns; empty where nothing ran offline)."""
    served = stepcosts.serve_costs(res)
    if served.empty:
        return []
    lines = ["## Behind `vllm serve`", "",
             ("The same passes sent as B concurrent requests to `/v1/completions` (token "
              "ids, streaming), plain and speculative servers each on its own; speedup "
              "against the plain server at the same concurrency B."), "",
             _md(served.sort_values(["layers", "B", "k"]),
                 ["layers", "B", "k", "al", "step_ms", "tok_s", "tok_s_lo", "tok_s_hi",
                  "speedup", "speedup_lo", "speedup_hi", "rounds"]), ""]
    model = predict.served_vs_model(served, val).dropna(subset=["pred_speedup"])
    if len(model):
        lines += [("Against the cost model of the same run's offline passes (the offline "
                   "point's `pred_speedup` and its serial-drafter bound, as in § Predicted vs "
                   "measured; `pred_in_ci`: the prediction inside the served speedup's 95% "
                   f"interval): largest |error| {model.error.abs().max():.1%}."), "",
                  _md(model.sort_values(["layers", "B", "k"]),
                      ["layers", "B", "k", "speedup", "offline_speedup", "pred_speedup",
                       "pred_serial_speedup", "error", "bracketed", "pred_in_ci"]), ""]
    return lines


def _host_lines(dirs: list[Path], res: pd.DataFrame) -> list[str]:
    """The timed passes, offline and behind `vllm serve` (engines named `-serve`), at the
    batch sizes a speculative engine ran, each beside what the host did during its greedy
    window (`speclab.hostwatch`); none where the runs have no host samples."""
    host = stepcosts.host_samples(dirs)
    if not host or "t_full_start" not in res:
        return []
    timed = stepcosts.passes(res.assign(op=res.op.replace("serve", "pass")))
    timed = timed[timed.B.isin(timed[timed.k > 0].B) & timed.t_full_start.notna()].copy()
    timed["vs_median"] = timed.step_ms / timed.groupby(["run", "engine", "B"]).step_ms.transform(
        "median")
    per = pd.DataFrame(hostwatch.per_pass(host, timed.to_dict("records"),
                                          keys=("engine", "B", "k", "round", "step_ms",
                                                "vs_median")))
    if per.empty:
        return []
    return ["## The host during the timed passes", "",
            ("Each timed pass (offline, and behind `vllm serve` where an engine's name ends "
             "in `-serve`) at a batch size a speculative engine ran, its step time against "
             "its engine's median at that B (`vs_median`), beside what the machine's CPUs did "
             "in its greedy window (`speclab.hostwatch`, sampled every second, averaged over "
             "the samples it overlaps): cores busy, waiting on I/O and stolen by the "
             "hypervisor (`steal`), the 1-minute load and the three busiest commands (cores); "
             "where sampled, the GPU's mean SM clock, power and temperature and the clock-event "
             "reasons active (`nvidia-smi` bit masks: 0x1 idle, 0x4 power cap, 0x20/0x40 "
             "thermal). A stalled round beside a busy neighbour or stolen time is the host's; "
             "one beside a lower clock, the GPU's."), "",
            _md(per.sort_values(["B", "k", "engine", "round"]),
                ["engine", "B", "k", "round", "step_ms", "vs_median", "busy", "iowait",
                 "steal", "load1",
                 *(c for c in ("sm_mhz", "power_w", "temp_c", "clock_events") if c in per),
                 "top"]), ""]


def _weights_lines(dirs: list[Path]) -> list[str]:
    """`stepcosts.memory_check` as report lines (none where no engine logged its weights)."""
    mem = stepcosts.memory_check(dirs)
    if mem.empty:
        return []
    return ["## Weights: estimate vs vLLM", "",
            ("`speclab.memory` from the config alone against each engine's `Model loading "
             f"took`; largest |error| {mem.error.abs().max():.1%}."), "",
            _md(mem, [*(["run"] if len(dirs) > 1 else []), "engine",
                      "estimate_gib", "vllm_gib", "error"]), ""]


SPREAD_DRAWS = 200


def _held_out_lines(res: pd.DataFrame, layers: int) -> list[str]:
    """`layerfit.held_out` as report lines (none where no depth can be spared)."""
    h = layerfit.held_out(res)
    if h.empty:
        return []
    worst = h.loc[h.error.abs().idxmax()]
    return ["## A depth held out", "",
            (f"The {layers}-layer prediction extrapolates a line through the measured layer "
             "counts. Here the deepest layer count with speculative points is left out and "
             "predicted the same way (`layerfit.held_out`: the line through the other layer "
             "counts, the drafter times of the deepest of them; each speculative point at its "
             "own measured acceptance): `plain` rows are plain steps (ms) per graph size, "
             "`spec` rows speedups. Largest |error| "
             f"{abs(worst.error):.1%} ({worst.kind}, B = {int(worst.B)}"
             + (f", k = {int(worst.k)}" if worst.kind == "spec" else "") + ")."), "",
            _md(h, ["layers", "from_layers", "kind", "draft", "k", "B", "rows", "measured",
                    "lo", "hi", "predicted", "error"]), ""]


def _rates(rates) -> str:
    return "[" + ", ".join(f"{x:.3g}" for x in rates) + "]"


def _spread_lines(costs, drafts, rates, layers: int, measured=()) -> list[str]:
    """The extrapolation's spread from the plain steps' timing noise and, for a measured
    acceptance, its resamples (`layerfit.extrapolation_spread`) as report lines."""
    rate_draws = {m.method: m.draws for m in measured if len(m.draws)}
    per_k, per_method = layerfit.extrapolation_spread(costs, drafts, rates, layers,
                                                     draws=SPREAD_DRAWS, rate_draws=rate_draws)
    if rate_draws:
        moves = "timing noise and the measured acceptance move"
        what = ("drafter times held fixed; each draw also takes the acceptance of one resample "
                f"of the measuring run's requests for {', '.join(sorted(rate_draws))}, so this "
                "is timing and acceptance together")
    else:
        moves = "timing noise moves"
        what = "drafter times and acceptance held fixed, so the acceptance's own uncertainty " \
            "comes on top"
    return [(f"How far {moves} it ({SPREAD_DRAWS} draws of every plain step from "
             f"its interval, the fit and prediction redone; {what}): `pred_lo`, `pred_hi` "
             "bound 95% of the draws, `p_best` is the share in which k is its setting's best."),
            "", _md(per_k, ["draft", "B", "k", "pred_lo", "pred_hi", "p_best"]), "",
            ("Per batch size, each setting's best k on the same draws: `p_fastest` is the share "
             "of draws in which it beats every other setting (methods compared at their "
             "acceptance profiles above)."), "",
            _md(per_method, ["B", "draft", "best_speedup", "best_lo", "best_hi", "p_fastest"]),
            ""]


def _expert_dtypes(runs) -> set[str]:
    """The routed experts' dtypes the runs' engines loaded (`stepcosts.engines`)."""
    return {e.get("expert_dtype", "fp4") for e in stepcosts.engines(runs)}


def _pooled_section(dirs: list[Path], res: pd.DataFrame) -> list[str]:
    """For several runs: what each ran on (`stepcosts.check_poolable`) and the plain steps two
    or more of them measured, per run, with their spread (`stepcosts.plain_by_run`)."""
    if len(dirs) < 2:
        return []
    prov = pd.DataFrame(stepcosts.check_poolable(dirs))
    prov["passes"] = prov.run.map(res[res.op == "pass"].groupby("run").size()).fillna(0)
    same = stepcosts.plain_by_run(res)
    worst = (f"largest spread {same.spread.max():.1%}"
             + ("" if same.overlap.all() else
                f"; the intervals do not overlap at B = "
                f"{sorted(set(same[~same.overlap].B.astype(int)))}")) if len(same) else "none"
    return ["## Runs pooled", "",
            ("Step costs pooled from these runs (one GPU model and vLLM release, each run's "
             "`env.json`): a speculative point's speedup pairs with the plain passes of its "
             "own run, round by round (where its run has none, with those of the one other "
             "run on its machine, `machine`: boot id / GPU UUIDs, recorded since 2026-12-06); "
             "the plain curve and the drafter times take every run's passes."), "",
            _md(prov, ["run", "gpu", "driver", "vllm", "torch", "date", "passes",
                       *(["machine"] if prov.machine.notna().any() else [])]), "",
            (f"The plain steps two or more runs measured at one batch size on one graph "
             f"size (`rows`), per run ({worst}): pooling is pooling one quantity where they "
             "agree."), "",
            _md(same, ["layers", "eager", "B", "rows", "run", "step_ms", "step_lo", "step_hi",
                       "rounds", "spread", "overlap"]), ""]


def _node_section(ex: dict, rates, gpus: int, dtypes: set[str], gpu: str | None,
                  out_dir: Path) -> list[str]:
    """The TP `gpus` + EP bracket (`speclab.nodecost`) as report lines, its figure written
    into `out_dir`/figures; `gpu`, nvidia-smi's name of the runs' GPU (None: unknown)."""
    from speclab import plots
    try:
        fit = nodecost.expert_fit(ex["fit"])
        if len(dtypes) != 1:
            raise ValueError(f"the run's engines loaded routed experts as {sorted(dtypes)}: "
                             "one expert size is needed")
    except ValueError as e:
        return [f"## On a TP {gpus} + EP node", "", f"Not computed: {e}.", ""]
    (dtype,) = dtypes
    corners = nodecost.bracket(ex, rates, gpus, dtype=dtype)
    table = nodecost.summary(corners, ex["prediction"])
    best = corners[corners.best].groupby(["draft", "B"]).k.agg(lambda k: sorted(set(k)))
    best_k = ", ".join(f"{d or 'draft as is'} at B = {b}: k = {ks}"
                       for (d, b), ks in best.items())
    layers = int(ex["plain"].layers.iloc[0])
    tb_s = nodecost.expert_bytes(dtype) / (fit["beta_ms"] * 1e-3) / 1e12
    whose, hbm = nodecost.hbm_tb_s(gpu)
    bw = (f" One {dtype} expert is {nodecost.expert_bytes(dtype) / 2**20:.1f} MiB, so beta "
          f"reads experts at {tb_s:.2f} TB/s ({whose}: {hbm} TB/s)"
          + (": **more than the HBM delivers, so the fit is broken and the numbers below "
             "are not to be read**." if tb_s > hbm else "."))
    tp_ms = nodecost.divided_ms(fit["beta_ms"], layers, 1, dtype)
    plots.save(plots.node_bracket(table, gpus, layers), out_dir / "figures", "node_bracket",
               caption=f"TP {gpus} + EP bracket (speclab.nodecost)", close=True)
    return [
        f"## On a TP {gpus} + EP node: predicted from the one-GPU run, not measured", "",
        (f"vLLM 0.34.0 at TP {gpus}, DP 1, expert parallel: {MOE[0] // gpus} routed experts a "
         "rank, every token on every rank, two collectives a layer and the logits gather a "
         "step; the drafter at the same TP, three collectives a draft forward (an MTP forward "
         "is a MoE layer: its experts are read as the target's are) "
         "(`speclab.nodecost`). The one-GPU step splits into the routed experts' part, "
         f"{layers} x beta x E(n), and the rest; on the node the experts' part becomes "
         f"{layers} x beta x M(n), M(n) the expected most experts one rank reads (the step "
         "waits for the slowest rank; tokens spread evenly), TP divides part of the rest, and "
         "the collectives are added."), "",
        (f"beta (one expert read, per layer) = {fit['beta_ms'] * 1e3:.2f} us, alpha = "
         f"{fit['alpha_ms']:.3f} ms, fitted through the per-layer slopes at n = "
         f"{fit['batch_sizes']} (largest residual {fit['max_resid_ms'] * 1e3:.1f} us).{bw}"), "",
        ("Not measured, so bracketed. `tp`, the part of the rest TP divides: `latency` "
         "(none: the rest is launches and latencies), `weights` (the time to read the weights "
         "TP splits besides the routed experts at beta's rate: "
         f"{tp_ms[0]:.2f} ms a target step, the head included, and {tp_ms[1]:.2f} ms an "
         "EAGLE-3 draft forward), `all`. `allreduce`, one collective: `none` (the floor), "
         "`lo` and `hi`, "
         f"two published small-message all-reduce curves on {gpus} H100s over NVLink (SGLang PR "
         "#2904; lo: SGLang's kernel, hi: vLLM's custom all-reduce). Per (B, k): the lowest "
         "and highest speedup over the nine corners and the `weights` band with collectives "
         f"on the lo to hi curves, beside the one-GPU prediction; best k: {best_k}."), "",
        _md(table, ["draft", "B", "k", "one_gpu", "node_lo", "weights_lo", "weights_hi",
                    "node_hi", "best_in"]), "",
        f"![TP {gpus} + EP bracket](figures/node_bracket.png)", "",
        _md(corners, ["draft", "B", "k", "tp", "allreduce", "plain_ms", "verify_ms",
                      "draft_ms", "pred_tok_s", "pred_speedup", "best"]), "",
        ("Not covered: a trained router's imbalance (the fixture's router spreads tokens "
         "evenly), EPLB, DP attention and its all-to-all (DP > 1), mega-MoE kernels, and any "
         "GPU but the H200 (B200: other bandwidth and kernels)."), ""]
