"""Worker process for one sweep point: `python -m speclab.worker SPEC.json`.

Loads the engine, warms it up, generates stepwise, and writes the point's records and
metadata (store.write_point). Runs in its own process so GPU memory, crashes and hangs stay
contained; the parent (launch.run_point) sets the environment before Python starts. A spec
with mode "timing" only times one more pass (launch.timing_round). The worker ends its whole
process group when its parent dies (launch.guard_parent: no orphan keeps a GPU)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from speclab import (
    convention,
    engine,
    fingerprint,
    launch,
    methods,
    metrics,
    prompts,
    revisions,
    store,
)
from speclab.profiles import Point, Profile, prompt_file, resolve_model


def request_records(point: Point, plist, prompt_ids, traces, counters
                    ) -> list[store.RequestRecord]:
    """One record per request: outputs, per-step token counts and times, its counters (from
    `metrics.attribute`), and (plain runs) the top-1/top-2 logprob margin at each position
    (from an untimed pass)."""
    rows = []
    for p, ids, tr, c in zip(plist, prompt_ids, traces, counters):
        out = tr.get("output_token_ids", [])
        times = tr["step_times"]
        lps = tr.get("logprobs") or []
        rows.append(store.RequestRecord(**{
            "point_id": point.id, "k": point.k, "kv_cache_dtype": point.kv_cache_dtype,
            "draft_kv_cache_dtype": point.draft_kv_cache_dtype, "layout": point.layout.label,
            "prompt_format": point.prompt_format, "repeat": point.repeat,
            "concurrency": point.concurrency or len(plist),
            "prompt_id": p.id, "category": p.category, "prompt_len": len(ids),
            "output_token_ids": out, "n_output": len(out), "finish_reason": tr.get("finish_reason"),
            "step_tokens": tr["step_tokens"], "step_times": times,
            "latency_s": tr.get("latency_s"), "ttft_s": times[0] if times else None,
            "tpot_s": (times[-1] - times[0]) / (len(out) - 1) if len(out) > 1 else None,
            "drafts": c.num_drafts, "draft_tokens": c.num_draft_tokens,
            "accepted": c.num_accepted_tokens, "accepted_per_pos": list(c.accepted_per_pos),
            # margins come from a second pass; where it diverged from this output (None:
            # never), later margins belong to another sequence
            "logprob_pass_divergence": tr.get("logprob_pass_divergence"),
            "margin": [e[0][1] - e[1][1] if len(e) > 1 else np.inf for e in lps],
            "runner_up": [e[1][0] if len(e) > 1 else -1 for e in lps],
        }))
    return rows


def timed_pass(llm, prompt_ids, sp, concurrency) -> tuple[list[dict], dict]:
    """One timed stepped generation: (traces, pass record for the point's `passes`)."""
    g0 = time.perf_counter()
    traces = engine.generate_stepwise(llm, prompt_ids, sp, concurrency)
    gen_s = time.perf_counter() - g0
    n_out = sum(len(tr.get("output_token_ids", [])) for tr in traces)
    # the 1-minute load average: other work on the machine shows in it; the niceness the
    # engine ran at (Ray's workers start at 15: executor_ray)
    return traces, {"generate_s": gen_s, "output_tokens": n_out, "tok_s": n_out / gen_s,
                    "at": time.time(), "load_avg_1m": os.getloadavg()[0],
                    "nice": os.getpriority(os.PRIO_PROCESS, 0)}


def preload() -> None:
    """What a zygote imports before it forks workers (`launch.Zygote`)."""
    engine.preload()


def main(spec_path: str) -> int:
    started = time.time()
    spec = json.loads(Path(spec_path).read_text())
    if not launch.guard_parent(spec):
        return 1
    profile = Profile.model_validate(spec["profile"])
    point = Point.model_validate(spec["point"])
    run_dir = Path(spec["run_dir"])
    timing = spec.get("mode") == "timing"
    t: dict[str, float] = {}
    meta = {"point_id": point.id, "status": "error", "point": point.model_dump(mode="json"),
            "profile": profile.name, "started_at": started, "command": " ".join(sys.argv),
            "sampling": fingerprint.sampling(profile, point),
            "method": methods.settings(profile, point), "models": revisions.record(profile, point),
            "fingerprint": spec.get("fingerprint")}
    try:
        h0 = time.perf_counter()
        plist = prompts.load(prompt_file(profile), limit=profile.prompts.limit,
                             categories=profile.prompts.categories, seed=profile.prompts.seed)
        target = resolve_model(profile.target)
        draft = resolve_model(profile.draft) if methods.uses_draft(methods.of(point)) \
        else None
        t["harness_s"] = time.perf_counter() - h0
        i0 = time.perf_counter()
        import vllm
        from vllm import SamplingParams

        t["import_s"] = time.perf_counter() - i0
        native = engine.native_draft_kv_dtype() if point.k > 0 else True
        args, env = engine.engine_args(profile, point, target, draft, native,
                                       engine.native_request_metrics())
        os.environ.update(env)  # the draft KV dtype variable is only known here
        meta.update(engine_args=args, env=env, vllm_version=vllm.__version__)
        meta["aux_convention"] = convention.resolve(target, draft)  # fails before loading
        if meta["aux_convention"]:
            print(convention.log_line(meta["aux_convention"]), flush=True)
        e0 = time.perf_counter()
        with engine.open_llm(args, shutdown=not launch.forked()) as llm:
            t["engine_init_s"] = time.perf_counter() - e0
            h1 = time.perf_counter()
            tok = None if profile.skip_tokenizer_init else llm.get_tokenizer()
            prompt_ids = prompts.to_token_ids(plist, tok, point.prompt_format)
            sp_args = dict(temperature=profile.temperature, max_tokens=profile.max_tokens,
                           ignore_eos=profile.ignore_eos, seed=profile.seed,
                           detokenize=not profile.skip_tokenizer_init)
            sp = SamplingParams(**sp_args)
            t["harness_s"] += time.perf_counter() - h1
            if profile.warmup:
                # The measured batch's shapes and sampling path (a first pass that compiled
                # them cost the tiny-cpu plain point 3x its time), on reversed prompts so that
                # no measured request hits a cached prefix.
                w0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids[::-1]} for ids in prompt_ids],
                             SamplingParams(**{**sp_args, "max_tokens": profile.warmup_tokens}),
                             use_tqdm=False)
                t["warmup_s"] = time.perf_counter() - w0
            if timing:
                _, passed = timed_pass(llm, prompt_ids, sp, point.concurrency)
                passed["round"] = spec["round"]
                store.atomic_write(Path(spec["output"]), json.dumps(passed))
                return 0
            h2 = time.perf_counter()
            before = metrics.from_snapshot(llm.get_metrics())
            t["harness_s"] += time.perf_counter() - h2
            traces, passed = timed_pass(llm, prompt_ids, sp, point.concurrency)
            t["generate_s"] = passed["generate_s"]
            h3 = time.perf_counter()
            delta = metrics.from_snapshot(llm.get_metrics()) - before
            if point.logprobs:
                # margins for the parity analysis from a second, untimed pass: logprobs cost
                # (a third of the tiny-cpu plain point's time) stays out of the baseline
                l0 = time.perf_counter()
                with_lp = engine.generate_stepwise(
                    llm, prompt_ids, SamplingParams(**sp_args, logprobs=point.logprobs),
                    point.concurrency)
                t["logprob_pass_s"] = time.perf_counter() - l0
                for tr, lp in zip(traces, with_lp):
                    tr["logprobs"] = lp["logprobs"]
                    tr["logprob_pass_divergence"] = metrics.first_divergence(
                        tr["output_token_ids"], lp["output_token_ids"])
        counters, attributed = metrics.attribute(delta, traces, point.k, "stepped")
        records = request_records(point, plist, prompt_ids, traces, counters)
        n_out = sum(r.n_output for r in records)
        meta.update(
            status="ok", counters=delta.to_dict(), **attributed, n_requests=len(records),
            output_tokens=n_out, throughput_tok_s=n_out / t["generate_s"],
            passes=[{**passed, "round": 1}], versions=engine.versions(), host=socket.gethostname(),
        )
        t["harness_s"] += time.perf_counter() - h3
        meta.update(timings=t, finished_at=time.time(), wall_s=time.time() - started)
        store.write_point(run_dir, store.PointResult.model_validate(meta), records)
        return 0
    except Exception as e:  # recorded, the sweep goes on
        if timing:
            raise
        meta.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                    timings=t, wall_s=time.time() - started)
        store.write_point(run_dir, store.PointResult.model_validate(meta))
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    launch.child_main(main)
