"""One engine of a real-shape timing run (`speclab.gpubench`), in a process of its own: its
`LLM` arguments, the prompts of a pass, and the commands it answers (JSON lines on stdin:
`pass`, `split`, `serve`, `stop`) offline through `vllm.LLM` or behind `vllm serve`; what its
log says ran (`log_facts`) and compiled while a pass ran (`jit_since`).

    python -m speclab.benchworker SPEC FD     (started by the driver, never by hand)
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

from speclab.benchplans import Engine

PROMPT_LEN = 256
MAX_TOKENS = 128
MAX_BATCHED = 4096  # max_num_batched_tokens of every engine
MAX_MODEL_LEN = 2048


def prompt_lengths(B: int, length: int = PROMPT_LEN, budget: int = MAX_BATCHED) -> list[int]:
    """Prompt lengths of a batch of `B` whose prefill is one step of a power-of-two token
    count (at most B x `length` and `budget`), spread as evenly as possible. vLLM 0.26 warms
    DeepSeek-V4's mHC TileLang kernels up for power-of-two token counts and the CUDA-graph
    sizes only (`model_executor/warmup/deepseek_v4_mhc_warmup.py`); their split-K factor
    depends on the token count (`kernels/mhc/tilelang_kernels.py`: `compute_num_split`), so
    any other prefill size compiles new kernels, 40-134 s each (seen 2026-12-02)."""
    total = 1 << (min(B * length, budget).bit_length() - 1)
    if total < B:
        raise ValueError(f"batch {B} does not fit a {budget}-token prefill step")
    return [total // B + (i < total % B) for i in range(B)]


def batch_prompts(B: int, seed: int, k: int, tokens: int = MAX_TOKENS) -> list[list[int]]:
    """The pass's prompts (`prompt_lengths`): the tails of the oracle's random prompts, so each
    still ends on an id whose greedy continuation of `tokens` stays in the draft vocabulary."""
    from speclab.fixtures import realshape

    lengths = prompt_lengths(B)
    full = realshape.prompt_ids(B, max(lengths), seed=seed, max_tokens=tokens, k=k)
    return [p[len(p) - n:] for p, n in zip(full, lengths)]



LOG_FACTS = re.compile(
    r"(CompilationMode|compilation_config|cudagraph_mode|BREAKABLE_CUDAGRAPH|torch\.compile|"
    r"MoE backend|Mxfp4|MARLIN|Model loading took|KV cache memory|KV cache size|"
    r"Capturing CUDA graph|Graph capturing finished|enforce_eager|async scheduling|"
    r"EAGLE-3|overlay|steptiming|Loading plugin|attention backend)", re.IGNORECASE)


JIT_LINE = re.compile(r"(?:JIT compilation during inference: |TileLang begins to compile kernel `)"
                      r"([\w.]*\w)")


def log_facts(text: str, limit: int = 60) -> list[str]:
    """The lines of an engine log that say what ran (compile mode, graphs, MoE backend,
    memory), de-duplicated, without the logger's prefix."""
    seen, out = set(), []
    for line in text.splitlines():
        if LOG_FACTS.search(line):
            s = re.sub(r"^.*?\] ", "", line.strip())[:300]
            if s not in seen:
                seen.add(s)
                out.append(s)
    return out[:limit]


def engine_args(eng: Engine, target: str, draft: str | None, kv_bytes: int,
                gpu_fraction: float) -> dict:
    """`LLM(**args)` for one engine of the plan."""
    args = {"model": target, "skip_tokenizer_init": True, "kv_cache_dtype": "fp8",
                "enforce_eager": eng.eager, "max_model_len": MAX_MODEL_LEN,
                "max_num_seqs": eng.max_num_seqs,
                "max_num_batched_tokens": MAX_BATCHED, "enable_prefix_caching": False,
                "disable_log_stats": False, "seed": 0, "gpu_memory_utilization": gpu_fraction,
                "kv_cache_memory_bytes": kv_bytes}
    if eng.capture_sizes:
        args["compilation_config"] = {"cudagraph_capture_sizes": eng.capture_sizes}
    elif not eng.eager:
        # graphs for every verify step of the plan (B x (k + 1) tokens)
        args["compilation_config"] = {"max_cudagraph_capture_size":
                                      max(8, eng.max_num_seqs * (eng.k + 1))}
    if eng.mtp:  # the target's own mtp.0: no draft checkpoint
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": eng.k}
    elif eng.k:
        args["speculative_config"] = {"method": "eagle3", "model": draft,
                                      "num_speculative_tokens": eng.k}
    if eng.k and eng.draft_eager:
        args["speculative_config"]["enforce_eager"] = True
    if eng.fa_splits is not None:
        args["attention_config"] = {"flash_attn_max_num_splits_for_cuda_graph": eng.fa_splits}
    from speclab.fixtures import repeat_loader

    if repeat_loader.read_sources(target):  # a deep target that stores one layer per kind
        args["load_format"] = repeat_loader.LOAD_FORMAT
    return args


def resolved(llm) -> dict:
    """What the engine resolved (not what was asked): compile mode, CUDA-graph mode and
    sizes, async scheduling, the speculative method."""
    cfg = llm.llm_engine.vllm_config
    cc = cfg.compilation_config
    out = {"compilation_mode": str(getattr(cc, "mode", None)),
           "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)),
           "cudagraph_capture_sizes": list(getattr(cc, "cudagraph_capture_sizes", None) or []),
           "enforce_eager": cfg.model_config.enforce_eager,
           "async_scheduling": getattr(cfg.scheduler_config, "async_scheduling", None),
           "kv_cache_dtype": cfg.cache_config.cache_dtype}
    sc = cfg.speculative_config
    if sc is not None:
        out["speculative"] = {"method": sc.method, "k": sc.num_speculative_tokens}
    return out


def worker(spec: dict, out_fd: int) -> int:
    """One engine: build it, say so, then answer commands (JSON lines on stdin). Tied to
    the driver: its group (vLLM's engine core included) ends when the driver dies."""
    from speclab import launch, metrics, steptiming
    from speclab.fixtures import realshape

    if not launch.guard_parent(spec):
        return 1

    out = os.fdopen(out_fd, "w", buffering=1)

    def say(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")

    if spec.get("serve"):
        return serve_worker(spec, say)
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(**spec["args"])
    try:
        settings = resolved(llm)
    except AttributeError as e:  # another release's config layout: say so, keep measuring
        settings = {"error": repr(e)}
    say({"op": "ready", "engine_init_s": round(time.perf_counter() - t0, 1),
         "vllm": vllm.__version__, "resolved": settings})
    succ = realshape.successors(spec["args"]["model"])
    k = spec["k"]
    draft_succ = _draft_successors(spec, succ)
    timing = Path(spec["timing_dir"])

    def gen(prompts, n):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        c0 = metrics.from_snapshot(llm.get_metrics())
        start = time.time()  # the window `speclab.hostwatch` reads the host in
        g0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        dt = time.perf_counter() - g0
        return dt, outs, (metrics.from_snapshot(llm.get_metrics()) - c0).to_dict(), start

    log_path = Path(spec.get("log_path", os.devnull))

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            break
        offset = log_path.stat().st_size if log_path.exists() else 0
        B, seed, n = cmd["B"], cmd["seed"], cmd.get("tokens", MAX_TOKENS)
        prompts = batch_prompts(B, seed, k, n)
        if cmd["op"] == "pass":
            t1, *_ = gen(prompts, 1)
            tn, outs, c, start = gen(prompts, n)
            exact = sum(list(o.outputs[0].token_ids) == realshape.greedy(succ, p, n)
                        for o, p in zip(outs, prompts))
            msg = {"op": "pass", "t_prefill_s": t1, "t_full_s": tn, "t_full_start": start,
                   "counters": c,
                   "outputs_exact": exact, "jit_compiled": jit_since(log_path, offset),
                   "prompt_tokens": sum(map(len, prompts)),
                   "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
            if k:
                msg["expected"] = realshape.expected_counters(succ, prompts, k, n, draft_succ)
            say(msg)
        elif cmd["op"] == "split":
            before = len(steptiming.read(timing))
            (timing / steptiming.FLAG).touch()
            tn, _, c, start = gen(prompts, n)
            (timing / steptiming.FLAG).unlink()
            gen(prompts[:1], 2)  # the next drafter call writes the recorded events out
            calls = steptiming.read(timing)[before:]
            say({"op": "split", "t_full_s": tn, "t_full_start": start, "counters": c,
                 "calls": calls})
        else:  # the driver would wait for an answer that never comes
            raise ValueError(f"an offline engine has no op {cmd['op']!r}")
    return 0


def _draft_successors(spec: dict, succ: list[int]) -> list[int] | None:
    """The drafter's next id after each id where it is not the EAGLE-3 counting oracle's
    (input + 1): the real-shape MTP reads out the target's own bigram (`realshape` `mtp`)."""
    sc = spec["args"].get("speculative_config") or {}
    return succ if sc.get("method") == "mtp" else None


def serve_log(log_path: Path) -> Path:
    """Where a serve engine's `vllm serve` writes (beside the worker's own log)."""
    return log_path.with_suffix(".serve.log")


def serve_worker(spec: dict, say) -> int:
    """`worker` behind `vllm serve` (the engine's `LLM` arguments as its flags,
    `speclab.server`): each `serve` command sends the pass's B prompts at once to
    /v1/completions as token ids, first with `max_tokens` 1 (prefill), then with `tokens`,
    and reads the spec-decode counters from /metrics around the full pass."""
    from statistics import median

    from speclab import prompts as P
    from speclab import server
    from speclab.fixtures import realshape

    log_path = serve_log(Path(spec["log_path"]))
    succ = realshape.successors(spec["args"]["model"])
    k = spec["k"]
    draft_succ = _draft_successors(spec, succ)
    t0 = time.perf_counter()
    with server.running_server(spec["args"], {}, log_path) as url:
        import httpx

        version = httpx.get(f"{url}/version", timeout=10).json().get("version")
        say({"op": "ready", "engine_init_s": round(time.perf_counter() - t0, 1),
             "vllm": version, "resolved": {"serve": url}})

        def gen(ids, n):
            reqs = [server.request_body(P.Prompt(id=str(i), category="realshape",
                                                 prompt_token_ids=tuple(p)), "raw", n, 0.0, True)
                    for i, p in enumerate(ids)]
            c0, start, g0 = server.scrape(url), time.time(), time.perf_counter()
            out = server.run_async(server.drive(url, reqs, concurrency=len(reqs)))
            dt = time.perf_counter() - g0
            return dt, out, (server.scrape(url) - c0).to_dict(), start

        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "stop":
                break
            if cmd["op"] != "serve":
                raise ValueError(f"a serve engine has no op {cmd['op']!r}")
            offset = log_path.stat().st_size
            B, n = cmd["B"], cmd.get("tokens", MAX_TOKENS)
            ids = batch_prompts(B, cmd["seed"], k, n)
            t1, *_ = gen(ids, 1)
            tn, outs, c, start = gen(ids, n)
            msg = {"op": "serve", "t_prefill_s": t1, "t_full_s": tn, "t_full_start": start,
                   "counters": c,
                   "outputs_exact": sum(o["output_token_ids"] == realshape.greedy(succ, p, n)
                                        for o, p in zip(outs, ids)),
                   "jit_compiled": jit_since(log_path, offset),
                   "prompt_tokens": sum(map(len, ids)),
                   "output_tokens": sum(o["n_output"] for o in outs),
                   "ttft_s": median(o["ttft_s"] for o in outs),
                   "tpot_s": median(o["tpot_s"] for o in outs if o["tpot_s"] is not None)}
            if k:
                msg["expected"] = realshape.expected_counters(succ, ids, k, n, draft_succ)
            say(msg)
    return 0


def jit_since(log_path: Path, offset: int) -> list[str]:
    """Kernels compiled while serving since `offset` of the engine's log: vLLM's jit_monitor
    warnings (once per kernel name) and TileLang's own compile lines (every variant: on 0.26
    the mHC kernels compile again for each new split count, 13-60 s, without a new
    warning)."""
    with open(log_path, "rb") as fh:
        fh.seek(offset)
        return sorted(set(JIT_LINE.findall(fh.read().decode(errors="replace"))))


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.exit("usage: python -m speclab.benchworker SPEC FD (the driver starts it)")
    return worker(json.loads(args[0]), int(args[1]))


if __name__ == "__main__":
    sys.exit(main())
