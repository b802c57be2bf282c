"""Benchmarks that print numbers: `main` splits one sweep point's wall time into engine start,
generation and the harness's own work (worker spawn and imports, prompts, metrics, records,
plotting); `overhead` measures what stepping the engine for per-request attribution costs
against `LLM.generate` on the same point."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from speclab import analysis, engine, launch, plots, preflight, profiles, prompts, store


def main(profile_name: str, k: int, run_id: str) -> int:
    prof = profiles.load(profile_name)
    problems = preflight.check_env(prof)
    if problems:
        raise profiles.ProfileError("\n".join(problems))
    g = prof.grid
    point = profiles.Point(k=k, kv_cache_dtype=g.kv_cache_dtype[0],
                        draft_kv_cache_dtype=g.draft_kv_cache_dtype[0] if k else None,
                        layout=g.layout[0], prompt_format=g.prompt_format[0])
    run_dir = Path(tempfile.mkdtemp(prefix=f"speclab-{run_id}-"))
    try:
        t0 = time.perf_counter()
        meta = launch.run_point(prof, point, run_dir)
        if meta["status"] != "ok":
            print(f"point failed: {meta['error']}\n{meta.get('log_tail', '')}")
            return 1
        p0 = time.perf_counter()
        _, recs = store.load_results(run_dir)
        figs = []
        if k:
            acc = analysis.acceptance(recs)
            figs.append(plots.per_position(analysis.per_position_long(acc)))
            figs.append(plots.acceptance_histogram(analysis.histogram(recs)))
        for i, fig in enumerate(figs):
            plots.save(fig, run_dir / "figures", f"fig{i}", close=True)
        plot_s = time.perf_counter() - p0
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    t = meta["timings"]
    engine_s = t["import_s"] + t["engine_init_s"] + t.get("warmup_s", 0.0)
    gen_s = t["generate_s"]
    harness_s = wall - engine_s - gen_s
    print(f"BENCH point={point.id} profile={prof.name} wall_s={wall:.2f}")
    print(f"  engine start  {engine_s:7.2f} s  (import vllm {t['import_s']:.2f}, "
          f"LLM() {t['engine_init_s']:.2f}, warm-up {t.get('warmup_s', 0.0):.2f})")
    print(f"  generation    {gen_s:7.2f} s  ({meta['output_tokens']} tokens, "
          f"{meta['throughput_tok_s']:.1f} tok/s)")
    print(f"  harness       {harness_s:7.2f} s  = {harness_s / wall:.1%} of wall "
          f"(in-worker bookkeeping {t['harness_s']:.2f}, plotting {plot_s:.2f}, "
          f"process spawn + imports {harness_s - t['harness_s'] - plot_s:.2f})")
    return 0


def overhead(profile_name: str, k: int, rounds: int) -> int:
    """Stepped generation (`engine.generate_stepwise`, what the sweep times) against
    `LLM.generate` on one engine and the same prompts, in `rounds` rounds whose order
    alternates; prints each round and the ratios stepped/generate of wall time and of this
    process's CPU time (geometric means with 95% t-intervals). CPU time counts the engine's
    work only where it runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as in
    tiny-cpu) and moves less than wall time when other jobs share the cores. Both must give
    the same greedy tokens and, where vLLM reports each request's spec-decode counters
    (`engine.native_request_metrics`), the same counters."""
    import os

    prof = profiles.load(profile_name)
    point = next((p for p in profiles.expand(prof) if p.k == k), None)
    if point is None:
        raise ValueError(f"k={k} is not in profile {prof.name}'s grid")
    os.environ.update(prof.env)
    from vllm import SamplingParams

    plist = prompts.load(profiles.prompt_file(prof), limit=prof.prompts.limit,
                         categories=prof.prompts.categories, seed=prof.prompts.seed)
    target = profiles.resolve_model(prof.target)
    draft = profiles.resolve_model(prof.draft) if k else None
    args, env = engine.engine_args(prof, point, target, draft, engine.native_draft_kv_dtype(),
                                   engine.native_request_metrics())
    os.environ.update(env)
    # one SamplingParams per call: LLM.generate sets its own to FINAL_ONLY, which would leave
    # the stepped pass with one output per request
    sp_args = dict(temperature=prof.temperature, max_tokens=prof.max_tokens,
                   ignore_eos=prof.ignore_eos, seed=prof.seed,
                   detokenize=not prof.skip_tokenizer_init)
    with engine.open_llm(args) as llm:
        tok = None if prof.skip_tokenizer_init else llm.get_tokenizer()
        ids = prompts.to_token_ids(plist, tok, point.prompt_format)
        inputs = [{"prompt_token_ids": x} for x in ids]

        def stepped():
            out = engine.generate_stepwise(llm, ids, SamplingParams(**sp_args),
                                           point.concurrency)
            return [(tr["output_token_ids"], tr["spec_decode"]) for tr in out]

        def plain():
            out = llm.generate(inputs, SamplingParams(**sp_args), use_tqdm=False)
            return [(list(o.outputs[0].token_ids), engine.spec_decode_metrics(o.outputs[0]))
                    for o in out]

        stepped(), plain()  # warm-up: shapes and sampling paths
        times: dict[tuple[str, str], list[float]] = {
            (name, clock): [] for name in ("stepped", "generate") for clock in ("wall", "cpu")}
        print(f"BENCH stepping-overhead profile={prof.name} point={point.id} "
              f"requests={len(ids)} max_tokens={prof.max_tokens} rounds={rounds} "
              f"native_request_metrics={args.get(engine.REQUEST_METRICS[0], 'off')} "
              f"engine_in_process={os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING') == '0'} "
              f"load_avg_1m={os.getloadavg()[0]:.1f}")
        for r in range(rounds):
            order = (("stepped", stepped), ("generate", plain))[:: 1 if r % 2 == 0 else -1]
            outs = {}
            for name, fn in order:
                w0, c0 = time.perf_counter(), time.process_time()
                outs[name] = fn()
                times[name, "wall"].append(time.perf_counter() - w0)
                times[name, "cpu"].append(time.process_time() - c0)
            for what, i in (("outputs", 0), ("per-request counters", 1)):
                if [o[i] for o in outs["stepped"]] != [o[i] for o in outs["generate"]]:
                    print(f"  round {r + 1}: {what} differ (stepped vs generate)")
            print(f"  round {r + 1}: " + ", ".join(
                f"{name} {times[name, 'wall'][-1]:.3f} s (CPU {times[name, 'cpu'][-1]:.3f} s)"
                for name in ("stepped", "generate")) + f", load {os.getloadavg()[0]:.1f}")
    for clock, what in (("wall", "time"), ("cpu", "CPU time")):
        ratio, lo, hi = analysis.ratio_ci(times["stepped", clock], times["generate", clock])
        print(f"  stepped/generate {what} ratio {ratio:.4f} [95% CI {lo:.4f}, {hi:.4f}] over "
              f"{rounds} rounds ({(ratio - 1) * 100:+.2f}%)")
    return 0
