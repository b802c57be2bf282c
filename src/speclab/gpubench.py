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
with any is not a clean timing); engines' resolved settings and log facts go to DIR/engines.jsonl;
the host's CPU time, sampled every second, to DIR/host.jsonl (`speclab.hostwatch`). A rerun skips
what is there, so a driver cut short resumes. Each worker is `speclab.benchworker`; `--warm N`
first compiles the mHC kernels in N `speclab.mhcwarm` processes. Analysis: `speclab.predict`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from speclab import gpus, hostwatch
from speclab.benchplans import PLANS, REPEAT_ABOVE, Engine
from speclab.benchworker import (
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPT_LEN,
    engine_args,
    log_facts,
    serve_log,
)
from speclab.mhcwarm import start_warm

ROUNDS = 5
EXTRA_ROUNDS = 3
GIB = 2 ** 30
OVERHEAD_GIB = 2.5  # per engine beyond weights and KV: CUDA context, activations, graphs
CAPACITY = 0.93  # share of the GPU a group may plan to use (prefill activations peak above)
START_GAP_S = 5  # between two engine starts of a group


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
        proc = launch.start([sys.executable, "-m", "speclab.benchworker",
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
        watch = hostwatch.Watch(state / "host.jsonl").start()
        try:
            return _drive(state, deadline, plan_name, rounds, paths, fh, warm_procs, tokens)
        finally:
            watch.stop()
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
                           "eager": w.eng.eager, "draft_kv_group": w.eng.draft_kv_group,
                           "round": r, "B": B, **ans,
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
    a = ap.parse_args(argv)
    longest = MAX_MODEL_LEN - PROMPT_LEN - 8  # room for k <= 5 draft tokens past the last
    if a.cmd == "drive" and not 2 <= a.tokens <= longest:
        ap.error(f"--tokens {a.tokens}: a pass needs 2 to {longest} tokens a request "
                 f"({PROMPT_LEN}-token prompts, max_model_len {MAX_MODEL_LEN})")
    if a.cmd == "drive" and (a.rounds < 1 or a.warm < 0):
        ap.error(f"--rounds {a.rounds} --warm {a.warm}: at least one timed round, and no "
                 "fewer than 0 warm-up processes")
    return drive(a.state, a.deadline, a.plan, a.rounds, warm_procs=a.warm, tokens=a.tokens)


if __name__ == "__main__":
    sys.exit(main())
