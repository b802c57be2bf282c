"""Step costs of the real-shape pair on a GPU: resident engines, rounds interleaved over k and
batch size, the drafter's share measured with CUDA events.

    python -m speclab.gpubench drive --state DIR --deadline EPOCH [--plan timing-eagle31]

A plan (`speclab.benchplans`) is a list of engines (target layers, k, eager or CUDA graphs,
batch sizes). The driver builds the fixtures, packs the engines into groups that fit the GPU
together (weights from the checkpoint index plus a per-engine allowance, refined from what the
previous group used), starts
each group's engines as workers (one subprocess each, holding one `vllm.LLM`), and then runs
`rounds` rounds: in round r every engine of the group, in turn, runs every batch size B as a
pair of passes on the same fresh prompts (B x `prompt_len` random draft-range ids): `max_tokens`
1 (prefill) and `max_tokens` (greedy, ignore_eos). Only one engine works at a time, so each has
the GPU to itself; the others wait idle. Round 0 is the untimed warm-up that compiles every
kernel shape the timed rounds use. A plain engine also runs `extra_batches` (the batch sizes a
verify step of B x (k + 1) tokens corresponds to: the cost model's input). After the rounds,
each speculative engine runs one `split` pass per batch size with `speclab.steptiming` active
(CUDA events around the drafter), so the draft's cost is measured, not assumed.

Every pass appends one JSON line to DIR/results.jsonl (counters, the expectation from
`realshape.expected_counters`, whether each output equals the target's known greedy tokens,
wall times, and the kernels vLLM's jit_monitor saw compiled during the pass: a timed pass
with any is not a clean timing); engines' resolved settings and log facts go to DIR/engines.jsonl. A rerun skips
what is there, so a driver cut short resumes. Analysis: `speclab.predict`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from speclab import gpus
from speclab.benchplans import PLANS, REPEAT_ABOVE, Engine

PROMPT_LEN = 256
MAX_TOKENS = 128
MAX_BATCHED = 4096  # max_num_batched_tokens of every engine
MAX_MODEL_LEN = 2048
ROUNDS = 5
EXTRA_ROUNDS = 3
GIB = 2 ** 30
OVERHEAD_GIB = 2.5  # per engine beyond weights and KV: CUDA context, activations, graphs
CAPACITY = 0.93  # share of the GPU a group may plan to use (prefill activations peak above)
START_GAP_S = 5  # between two engine starts of a group


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


def counters_exact(row: dict) -> bool:
    """The pass's acceptance counters are the oracle's expectation (plain: nothing expected)."""
    exp = row.get("expected")
    return exp is None or exp["accepted_per_pos"] == row["counters"].get("accepted_per_pos")


def pass_exact(row: dict) -> bool:
    """A pass whose every output is the target's greedy and whose counters are the oracle's."""
    return row["outputs_exact"] == row["B"] and counters_exact(row)


def gate_open(e: Engine, rows: list[dict], pending: set[str]) -> bool | None:
    """Whether `e` runs: True without a gate; for gate (name, want), None while engine `name`
    still has work (`pending`), else whether its passes' exactness equals `want` (an engine
    with no pass, e.g. one that failed to start, counts as not exact)."""
    if e.gate is None:
        return True
    name, want = e.gate
    if name in pending:
        return None
    passes = [r for r in rows if r["engine"] == name and r["op"] == "pass"]
    return (bool(passes) and all(map(pass_exact, passes))) == want


# --------------------------------------------------------------------------- worker
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
                "enforce_eager": eng.eager, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": eng.max_num_seqs,
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
        g0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        dt = time.perf_counter() - g0
        return dt, outs, (metrics.from_snapshot(llm.get_metrics()) - c0).to_dict()

    log_path = Path(spec.get("log_path", os.devnull))

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            break
        offset = log_path.stat().st_size if log_path.exists() else 0
        B, seed, n = cmd["B"], cmd["seed"], cmd.get("tokens", MAX_TOKENS)
        prompts = batch_prompts(B, seed, k, n)
        if cmd["op"] == "pass":
            t1, _, _ = gen(prompts, 1)
            tn, outs, c = gen(prompts, n)
            exact = sum(list(o.outputs[0].token_ids) == realshape.greedy(succ, p, n)
                        for o, p in zip(outs, prompts))
            msg = {"op": "pass", "t_prefill_s": t1, "t_full_s": tn, "counters": c,
                   "outputs_exact": exact, "jit_compiled": jit_since(log_path, offset),
                   "prompt_tokens": sum(map(len, prompts)),
                   "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
            if k:
                msg["expected"] = realshape.expected_counters(succ, prompts, k, n, draft_succ)
            say(msg)
        elif cmd["op"] == "split":
            before = len(steptiming.read(timing))
            (timing / steptiming.FLAG).touch()
            tn, _, c = gen(prompts, n)
            (timing / steptiming.FLAG).unlink()
            gen(prompts[:1], 2)  # the next drafter call writes the recorded events out
            calls = steptiming.read(timing)[before:]
            say({"op": "split", "t_full_s": tn, "counters": c, "calls": calls})
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
            c0, g0 = server.scrape(url), time.perf_counter()
            out = server.run_async(server.drive(url, reqs, concurrency=len(reqs)))
            dt = time.perf_counter() - g0
            return dt, out, (server.scrape(url) - c0).to_dict()

        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "stop":
                break
            if cmd["op"] != "serve":
                raise ValueError(f"a serve engine has no op {cmd['op']!r}")
            offset = log_path.stat().st_size
            B, n = cmd["B"], cmd.get("tokens", MAX_TOKENS)
            ids = batch_prompts(B, cmd["seed"], k, n)
            t1, _, _ = gen(ids, 1)
            tn, outs, c = gen(ids, n)
            msg = {"op": "serve", "t_prefill_s": t1, "t_full_s": tn, "counters": c,
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


# --------------------------------------------------------------------------- mHC warm-up
SMS = 132  # streaming multiprocessors of an H100 / H200


def mhc_splits(n: int, block_k_cap: int) -> int:
    """vLLM 0.26's split-K factor of an mHC pre kernel for `n` tokens (`kernels/mhc/
    tilelang_kernels.py`: `compute_num_split`, 64-token blocks); `block_k_cap` is its cap
    (K / 64 / 4: 64 for the hyper-connection GEMM over hc_mult x 4096, 16 for the first
    layer's broadcast one over 4096)."""
    return max(1, min(SMS // -(-n // 64), block_k_cap))


def mhc_warm_sizes(budget: int = MAX_BATCHED) -> list[int]:
    """One token count for each split-K variant either mHC pre kernel can take with at most
    `budget` tokens a step: each compiles on first use (vLLM 0.26's warm-up skips this
    model), 13-87 s each on the H200."""
    seen, out = set(), []
    for n in range(64, budget + 1, 64):
        key = (mhc_splits(n, 64), mhc_splits(n, 16))
        if key not in seen:
            seen.add(key)
            out.append(n)
    return out


def warm(config: dict, sizes: list[int]) -> int:
    """Compile DeepSeek-V4's mHC pre kernels (first-layer broadcast and later-layer) for
    `sizes` tokens with the model's constants, so the JIT caches hold them before any engine
    starts."""
    import torch
    from vllm.model_executor.kernels.mhc.tilelang import (
        mhc_pre_broadcast_tilelang,
        mhc_pre_tilelang,
    )

    hidden, hc, eps = config["hidden_size"], config["hc_mult"], config["rms_norm_eps"]
    consts = (eps, config["hc_eps"], config["hc_eps"], 2.0, config["hc_sinkhorn_iters"])
    mix = (2 + hc) * hc
    fn = torch.randn(mix, hc * hidden, device="cuda") * 1e-3
    scale, base = torch.ones(3, device="cuda"), torch.zeros(mix, device="cuda")
    norm = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
    for n in sizes:
        t0 = time.time()
        x = torch.randn(n, hidden, dtype=torch.bfloat16, device="cuda")
        res = mhc_pre_broadcast_tilelang(x, fn, scale, base, *consts, norm_weight=norm,
                                         norm_eps=eps, fn_broadcast=fn.view(mix, hc, hidden)
                                         .sum(1))[0]
        mhc_pre_tilelang(res, fn, scale, base, *consts, norm_weight=norm, norm_eps=eps)
        torch.cuda.synchronize()
        print(f"warm {n} tokens: {time.time() - t0:.1f} s", flush=True)
    return 0


def start_warm(state: Path, procs: int = 8) -> list[subprocess.Popen]:
    """`procs` processes compiling the mHC variants (`mhc_warm_sizes`) side by side."""
    from speclab import launch
    from speclab.fixtures import realshape

    cfg = json.dumps(realshape.realshape_config(4))
    sizes = mhc_warm_sizes()
    (state / "logs").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(procs):
        part = ",".join(map(str, sizes[i::procs]))
        if part:
            with open(state / "logs" / f"warm{i}.log", "a") as fh:
                out.append(launch.start([sys.executable, "-m", "speclab.gpubench", "warm", cfg,
                                         part], fh, dict(os.environ)))
    return out


# --------------------------------------------------------------------------- driver
LOG = logging.getLogger("speclab.gpubench")


def _log_to(fh) -> list[logging.Handler]:
    """The driver's progress lines on stdout and in its log file `fh`."""
    fmt = logging.Formatter("[gpubench %(asctime)s] %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler(sys.stdout), logging.StreamHandler(fh)]
    for h in handlers:
        h.setFormatter(fmt)
        LOG.addHandler(h)
    LOG.setLevel(logging.INFO)
    LOG.propagate = False
    return handlers


@dataclass
class Worker:
    eng: Engine
    proc: subprocess.Popen
    reader: object
    log_path: Path
    ready: dict = field(default_factory=dict)

    def ask(self, cmd: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def read(self, timeout: float) -> dict:
        import select

        end = time.time() + timeout
        while time.time() < end:
            r, _, _ = select.select([self.reader], [], [], 1.0)
            if r:
                line = self.reader.readline()
                if not line:
                    raise RuntimeError(f"{self.eng.name}: worker exited "
                                       f"(rc {self.proc.poll()}); see {self.log_path}")
                return json.loads(line)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.eng.name}: worker exited (rc {self.proc.returncode});"
                                   f" see {self.log_path}")
        raise TimeoutError(f"{self.eng.name}: no answer in {timeout:.0f} s")

    def stop(self) -> None:
        """Ask the worker to stop, then end its group (engine core included)."""
        from speclab import launch

        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        launch.stop(self.proc)


def start_worker(eng: Engine, args: dict, state: Path) -> Worker:
    r, w = os.pipe()
    log_path = state / "logs" / f"{eng.name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    timing = state / "steptiming" / eng.name
    timing.mkdir(parents=True, exist_ok=True)
    from speclab import launch

    spec = {"args": args, "k": eng.k, "timing_dir": str(timing), "log_path": str(log_path),
            "parent_pid": os.getpid(), "serve": eng.serve}
    env = {**os.environ, "SPECLAB_STEP_TIMING": str(timing), "PYTHONUNBUFFERED": "1"}
    if eng.cold_jit:  # every JIT cache lives under HOME (tools/gpu/jit.sh): start from none
        home = state / "coldhome" / eng.name
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        env["HOME"] = str(home)
    with open(log_path, "a") as fh:
        proc = launch.start([sys.executable, "-m", "speclab.gpubench", "worker",
                             json.dumps(spec), str(w)], fh, env, stdin=subprocess.PIPE,
                            pass_fds=(w,), text=True)
    os.close(w)
    return Worker(eng, proc, os.fdopen(r), log_path)


def pack_groups(plan: list[Engine], weights_gib: dict[int, float], capacity_gib: float,
                overhead_gib: float) -> list[list[Engine]]:
    """Consecutive engines of one layer count that fit `capacity_gib` together (at least
    one engine a group); an engine that starts without JIT caches compiles on every core, so
    it runs alone."""
    need = lambda e: weights_gib[e.layers] + e.kv_bytes / GIB + overhead_gib
    groups: list[list[Engine]] = []
    for e in plan:
        g = groups[-1] if groups else None
        if g and g[0].layers == e.layers and not (e.cold_jit or g[0].cold_jit) and \
                sum(map(need, g)) + need(e) <= capacity_gib:
            g.append(e)
        else:
            groups.append([e])
    return groups


def build_fixtures(plan: list[Engine], fh) -> dict[tuple[int, str, int, bool], tuple[str, str]]:
    """Build the plan's fixtures, each in a process of its own (the builder's GPU memory goes
    back before the engines start: in-process it kept 13.5 GiB, which an engine then lacked);
    an MTP engine's is the target with its MTP module and no draft ("")."""
    from speclab import fixtures

    paths = {}
    for layers, xd, kvg, mtp in sorted({e.fixture for e in plan}):
        t0 = time.time()
        p = {"realshape-dsv4": {"num_layers": layers, "expert_dtype": xd,
                                **({"repeat_layers": True} if layers > REPEAT_ABOVE else {}),
                                **({"mtp": True} if mtp else {})},
             **({} if mtp else {"realshape-dsv4-eagle3": {"kv_group": kvg}})}
        args = [f"--param={name}.{k}={v}" for name, kv in p.items() for k, v in kv.items()]
        subprocess.run([sys.executable, "-m", "speclab", "fixtures", "build",
                        "realshape-dsv4" if mtp else "realshape-dsv4-eagle3", *args],
                       check=True, stdout=fh, stderr=subprocess.STDOUT)
        target = fixtures.fixture_dir("realshape-dsv4", params={"realshape-dsv4":
                                                                p["realshape-dsv4"]})
        draft = "" if mtp else str(fixtures.fixture_dir("realshape-dsv4-eagle3", params=p))
        paths[(layers, xd, kvg, mtp)] = (str(target), draft)
        LOG.info(f"fixtures L{layers} {xd} " + (f"with its MTP: {target.name} " if mtp else
                 f"kv_group {kvg}: {target.name}, {Path(draft).name} ")
                 + f"({time.time() - t0:.0f} s)")
    return paths


def draft_gib(draft: str) -> float:
    """The draft checkpoint's size (0 where there is none or it is not built)."""
    if not draft:
        return 0.0
    return sum(p.stat().st_size for p in Path(draft).glob("*.safetensors")) / GIB


def index_gib(target: str) -> float:
    idx = json.loads((Path(target) / "model.safetensors.index.json").read_text())
    return idx["metadata"]["total_size"] / GIB


def drive(state: Path, deadline: float, plan_name: str, rounds: int,
          paths: dict | None = None, warm_procs: int = 0, tokens: int = MAX_TOKENS) -> int:
    """Run the plan's engines (module doc) until done or `deadline`, `tokens` greedy tokens a
    request in each pass; `paths`: {Engine.fixture: (target, draft)} instead of building the
    fixtures."""
    state.mkdir(parents=True, exist_ok=True)
    with open(state / "driver.log", "a") as fh:
        handlers = _log_to(fh)
        try:
            return _drive(state, deadline, plan_name, rounds, paths, fh, warm_procs, tokens)
        finally:
            for h in handlers:
                LOG.removeHandler(h)


def _drive(state: Path, deadline: float, plan_name: str, rounds: int, paths, fh,
           warm_procs: int, tokens: int) -> int:
    from speclab import store

    plan = PLANS[plan_name]()
    results = state / "results.jsonl"
    engines_file = state / "engines.jsonl"
    rows = store.read_jsonl(results)
    done = {(r["engine"], r["op"], r["round"], r["B"]) for r in rows}
    warming = start_warm(state, warm_procs) if warm_procs else []
    paths = paths or build_fixtures(plan, fh)
    if warming:
        t0 = time.time()
        for p in warming:
            try:
                p.wait(timeout=max(1, min(deadline - 300, t0 + 600) - time.time()))
            except subprocess.TimeoutExpired:
                pass
        from speclab import launch

        for p in warming:
            launch.stop(p)
        LOG.info(f"mHC warm-up: exit codes {[p.returncode for p in warming]} "
                 f"({time.time() - t0:.0f} s after the fixtures; logs/warm*.log)")
    weights: dict[int, float] = {}  # the largest checkpoint of each depth: what a group plans
    for e in plan:
        weights[e.layers] = max(weights.get(e.layers, 0.0), index_gib(paths[e.fixture][0])
                                + draft_gib(paths[e.fixture][1]))
    total, used = gpus.memory_gib()
    overhead = OVERHEAD_GIB
    LOG.info(f"GPU {total:.1f} GiB ({used:.1f} used); weights GiB {weights}")

    def todo(e: Engine) -> list[tuple]:
        op = "serve" if e.serve else "pass"
        items = [(op, r, B) for r in range(rounds + 1) for B in e.batches]
        items += [(op, r, B) for r in range(EXTRA_ROUNDS + 1) for B in e.extra_batches]
        if not e.serve:  # the step-timing plugin sees the offline engine core only
            items += [("split", 0, B) for B in e.batches]  # plain too: its step's anatomy
        return [i for i in items if (e.name, *i) not in done]

    failures: dict[str, int] = {}

    def runnable() -> list[Engine]:
        """Engines with work left whose gate is open; a closed gate is logged and dropped."""
        left = [e for e in plan if todo(e) and failures.get(e.name, 0) < 2]
        pending = {e.name for e in left}
        out = []
        for e in left:
            verdict = gate_open(e, rows, pending)
            if verdict is False:
                LOG.info(f"skipping {e.name}: {e.gate[0]} exact is not {e.gate[1]}")
                plan.remove(e)
            elif verdict:
                out.append(e)
        return out

    remaining = runnable()
    while remaining:
        group = ([remaining[0]] if failures.get(remaining[0].name) else
                 pack_groups(remaining, weights, CAPACITY * total, overhead)[0])
        if deadline - time.time() < 150:
            LOG.info(f"{deadline - time.time():.0f} s left: not starting "
                     f"{[e.name for e in group]}")
            break
        LOG.info(f"group {[e.name for e in group]}")
        workers = []
        try:
            for e in group:
                t, d = paths[e.fixture]
                frac = min(0.9, (weights[e.layers] + e.kv_bytes / GIB + overhead) / total)
                workers.append(start_worker(e, engine_args(e, t, d if e.k else None, e.kv_bytes,
                                                           frac), state))
                time.sleep(START_GAP_S)  # memory checks and weight loads a little apart
            for w in workers:
                w.ready = w.read(max(30, deadline - time.time()))
                facts = log_facts("".join(f.read_text(errors="replace") for f in
                                          (w.log_path, serve_log(w.log_path)) if f.exists()))
                row = {"engine": w.eng.name, **asdict(w.eng), **w.ready, "log_facts": facts,
                       "gpu_used_gib": gpus.memory_gib()[1]}
                store.append_jsonl(engines_file, row)
                LOG.info(f"{w.eng.name} ready in {w.ready['engine_init_s']} s: "
                         f"{w.ready['resolved']}")
            used_now = gpus.memory_gib()[1]
            overhead = max(1.0, (used_now - used - sum(weights[e.layers] for e in group)
                                 - sum(e.kv_bytes for e in group) / GIB) / len(group)) + 0.5
            LOG.info(f"GPU used {used_now:.1f} GiB with {len(group)} engines: overhead "
                     f"{overhead:.1f} GiB each")
            items = sorted({i for w in workers for i in todo(w.eng)},
                           key=lambda i: (i[0] == "split", i[1], i[2]))
            for op, r, B in items:
                for w in workers:
                    if (op, r, B) not in todo(w.eng):
                        continue
                    if deadline - time.time() < 30:
                        raise TimeoutError("deadline")
                    ans = w.ask({"op": op, "B": B, "seed": 1000 * r + B, "tokens": tokens},
                                max(10, deadline - time.time()))
                    row = {"engine": w.eng.name, "layers": w.eng.layers, "k": w.eng.k,
                           "eager": w.eng.eager, "draft_kv_group": w.eng.draft_kv_group, "round": r, "B": B, **ans,
                           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                    store.append_jsonl(results, row)
                    rows.append(row)
                    done.add((w.eng.name, op, r, B))
                    jit = ans.get("jit_compiled")
                    LOG.info(f"{w.eng.name} {op} r{r} B{B}: {ans.get('t_full_s', 0):.3f} s, "
                             f"exact {ans.get('outputs_exact', '-')}/{B}, counters "
                             f"{'= expected' if counters_exact(ans) else 'DIFFER from expected'}"
                             + (f", JIT during the pass: {jit}" if jit else ""))
        except (TimeoutError, RuntimeError) as err:
            LOG.info(f"stopped: {err}")
            if isinstance(err, TimeoutError):
                for w in workers:
                    w.stop()
                break
            for w in workers:  # an engine that died gets one more start, alone
                if w.proc.poll() is not None:
                    failures[w.eng.name] = failures.get(w.eng.name, 0) + 1
        for w in workers:
            w.stop()
        used = gpus.memory_gib()[1]
        remaining = runnable()
    LOG.info("driver done")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m speclab.gpubench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drive")
    d.add_argument("--state", required=True, type=Path)
    d.add_argument("--deadline", type=float, required=True, help="epoch seconds")
    d.add_argument("--plan", default="timing-eagle31", choices=sorted(PLANS))
    d.add_argument("--rounds", type=int, default=ROUNDS)
    d.add_argument("--warm", type=int, default=0, metavar="PROCS",
                   help="compile the mHC kernel variants first in PROCS processes")
    d.add_argument("--tokens", type=int, default=MAX_TOKENS,
                   help="greedy tokens a request in each pass (longer passes: less host noise)")
    m = sub.add_parser("warm")
    m.add_argument("config")
    m.add_argument("sizes")
    w = sub.add_parser("worker")
    w.add_argument("spec")
    w.add_argument("fd", type=int)
    a = ap.parse_args(argv)
    longest = MAX_MODEL_LEN - PROMPT_LEN - 8  # room for k <= 5 draft tokens past the last
    if a.cmd == "drive" and not 2 <= a.tokens <= longest:
        ap.error(f"--tokens {a.tokens}: a pass needs 2 to {longest} tokens a request "
                 f"({PROMPT_LEN}-token prompts, max_model_len {MAX_MODEL_LEN})")
    if a.cmd == "drive" and (a.rounds < 1 or a.warm < 0):
        ap.error(f"--rounds {a.rounds} --warm {a.warm}: at least one timed round, and no "
                 "fewer than 0 warm-up processes")
    if a.cmd == "worker":
        return worker(json.loads(a.spec), a.fd)
    if a.cmd == "warm":
        return warm(json.loads(a.config), [int(n) for n in a.sizes.split(",")])
    return drive(a.state, a.deadline, a.plan, a.rounds, warm_procs=a.warm, tokens=a.tokens)


if __name__ == "__main__":
    sys.exit(main())
