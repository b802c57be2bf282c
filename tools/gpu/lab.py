#!/usr/bin/env python3
"""Run the lab's GPU jobs on the device machine within one call's time, resuming across calls.

    eval "$(bash tools/gpu/unpack.sh .stage/gpu)"     # one bundle: vLLM 0.22 here
    python3 tools/gpu/lab.py --vllm 0.22 --out $OUT --deadline 540 [--only job,job]
        [--gpus 2] [--slots 3] [--no-warm-first]
    python3 tools/gpu/lab.py --list [--vllm 0.26]     # the jobs, as they would run (any machine)

The jobs are data: src/speclab/studies/*.yaml, planned by speclab.studies (templated on the
stamp and the interpreter); this file runs them. Jobs run as subprocesses, each with its own
log and timeout. Each job names the
vLLM release it needs (`vllm`, default 0.22); one invocation runs the jobs of the release the
environment has, which --vllm must name, and every run folder carries it (STAMP). A job
takes one or two GPUs; with --slots N up to N single-GPU jobs share one GPU, each with a
share of its memory (engine.gpu_share: capped gpu_memory_utilization and a fixed KV cache).
`exclusive` jobs (timing) have their GPUs to themselves; `after` jobs wait for the named
jobs to end (JIT caches warm); with --warm-first (the default when --slots > 1) the first job
runs alone. A job that finished in an earlier call on the same warm machine is skipped
(state in /tmp/speclab_lab), and so is the set-up (per release); the run folders earlier
calls wrote are restored first (the device drops untracked files between calls), so sweep
points resume. No job starts unless it can end before the deadline.
Everything the jobs wrote (data/runs/<run>/, logs) is packed into $OUT/results.tar.gz after
every job, so a call that is cut short still returns what was done, with $OUT/summary.json.
Stopping a job signals its process group and the process groups of every process it started
(workers and servers run in sessions of their own), never anything else on the machine."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))  # speclab from this checkout (the device has no install)
from speclab import memory, studies

STATE = Path(os.environ.get("LAB_STATE", "/tmp/speclab_lab"))  # one per concurrent lab.py
PY = sys.executable
SPECLAB = [PY, "-m", "speclab"]
RUNS = REPO / "data" / "runs"


def current_release() -> str | None:
    """major.minor of the vLLM this environment has ($SPECLAB_VLLM from unpack.sh, else the
    installed distribution), or None."""
    full = os.environ.get("SPECLAB_VLLM")
    if not full:
        try:
            full = version("vllm")
        except PackageNotFoundError:
            return None
    return ".".join(full.split(".")[:2])


def stamp_label() -> str:
    """The date, or LAB_STAMP (to keep a second session of the same day apart)."""
    return os.environ.get("LAB_STAMP") or time.strftime("%Y%m%d")


RELEASE = current_release()
RELTAG = RELEASE and studies.release_tag(RELEASE)  # e.g. vllm022
STAMP = studies.stamp(stamp_label(), RELEASE)  # run-folder suffix, e.g. 20261201-vllm022

# The jobs (src/speclab/studies/*.yaml, in priority order): name, GPUs, timeout (s), command,
# run folders it writes (under data/runs), env, whether failing is its result, the vLLM release
# it needs, jobs it must start after, whether it needs its GPUs to itself (timing)
GPU = studies.gpu_tag(memory.local_gpu_name() or "H200")  # <gpu>; --list on a CPU: h200
PLAN = studies.plan(STAMP, PY, gpu=GPU)
JOBS: list[dict] = [j.lab_dict() for j in PLAN.jobs]
FIXTURES = PLAN.fixtures  # what the set-up builds
DIAL = PLAN.setup_run  # the set-up's selftest.json and env.json go here
T = "tools/gpu"


def log(msg: str, fh=None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if fh:
        fh.write(line + "\n")
        fh.flush()


def pack(out: Path, summary: dict, lock: threading.Lock) -> None:
    """results.tar.gz with every run folder jobs wrote, plus summary.json (rewritten whole)."""
    with lock:
        tmp = out / ".results.tar.gz"
        with tarfile.open(tmp, "w:gz") as tar:
            for run in sorted({r for j in JOBS for r in j["runs"]}):
                if (RUNS / run).exists():
                    tar.add(RUNS / run, arcname=f"data/runs/{run}")
            if (STATE / "logs").exists():
                tar.add(STATE / "logs", arcname="gpu-logs")
        shutil.copyfile(tmp, STATE / "results.tar.gz")
        os.replace(tmp, out / "results.tar.gz")
        (out / "summary.json").write_text(json.dumps(summary, indent=1))


def restore(fh) -> None:
    """Put back the run folders an earlier call on this machine wrote: the device copies the
    working tree afresh for every call and drops untracked files, so without this a sweep
    would redo every point that is not committed yet."""
    saved = STATE / "results.tar.gz"
    if not saved.exists():
        return
    with tarfile.open(saved) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("data/runs/")]
        tar.extractall(REPO, members=members, filter="data")
    log(f"restored {len(members)} files of earlier calls' run folders", fh)


# job name -> pid -> (start time, process group) of every process the job started
FAMILIES: dict[str, dict[int, tuple[float, int]]] = {}


def family(pid: int) -> dict[int, tuple[float, int]]:
    """pid -> (start time, process group) of a process and all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            out[p.pid] = (p.create_time(), os.getpgid(p.pid))
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return out


def signal_family(seen: dict[int, tuple[float, int]], sig: int) -> int:
    """Send sig to the processes in seen that still run (same pid and start time) and to their
    process groups (which also holds what they started since they were seen). Returns how
    many of them still ran."""
    import psutil

    alive, groups = 0, set()
    for pid, (started, pgid) in list(seen.items()):
        try:
            p = psutil.Process(pid)
            if p.create_time() != started or p.status() == psutil.STATUS_ZOMBIE:
                continue
            os.kill(pid, sig)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
        alive += 1
        groups.add(pgid)
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
    return alive


def stop(seen: dict[int, tuple[float, int]], grace: float = 25,
         proc: subprocess.Popen | None = None) -> None:
    """SIGTERM a job's processes (speclab stops its workers and servers on the way out), then
    SIGKILL whatever is left after `grace` seconds; proc (the job itself) is reaped."""
    if signal_family(seen, signal.SIGTERM):
        end = time.time() + grace
        while time.time() < end and signal_family(seen, 0):
            time.sleep(0.5)
        signal_family(seen, signal.SIGKILL)
    if proc is not None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def job_env(j: dict, devices: str, slots: int, kv_gib: float) -> dict[str, str]:
    """The job's environment: its GPUs, speclab from this checkout, and (when it shares a GPU
    with other jobs) its share of the GPU's memory (speclab.engine.gpu_share)."""
    # DeepGEMM's warm-up compiles ~1800 kernels (15+ min) for shapes a tiny run never meets;
    # the sweep profiles skip it too, this covers the scripts that build an LLM themselves
    env = {"VLLM_DEEP_GEMM_WARMUP": "skip", **os.environ, **j["env"],
           "CUDA_VISIBLE_DEVICES": devices,
           "PYTHONPATH": f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    if slots > 1 and not j["exclusive"] and j["gpus"] == 1:
        env["SPECLAB_GPU_MEMORY_UTILIZATION"] = f"{0.9 / slots:.2f}"
        env["SPECLAB_KV_CACHE_MEMORY_BYTES"] = str(int(kv_gib * 2**30))
    return env


def run_job(j: dict, devices: str, env: dict, fh, summary: dict, out: Path,
            lock: threading.Lock, deadline: float) -> None:
    logf = STATE / "logs" / f"{j['name']}.log"
    timeout = max(10, min(j["timeout"], deadline - time.time()))
    log(f"start {j['name']} on GPU {devices} (timeout {timeout:.0f} s)", fh)
    t0 = time.time()
    seen: dict[int, tuple[float, int]] = {}
    with open(logf, "ab") as f:
        f.write(f"\n=== {time.ctime()} {' '.join(j['cmd'])}\n".encode())
        f.flush()
        proc = subprocess.Popen(j["cmd"], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        FAMILIES[j["name"]] = seen
        rc = None
        while rc is None:  # note every process the job starts, to stop exactly those
            seen.update(family(proc.pid))
            try:
                rc = proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                if time.time() - t0 > timeout:
                    rc = "timeout"
    stop(seen, proc=proc)  # on a timeout the job; otherwise what it left (an orphaned engine)
    wall = round(time.time() - t0, 1)
    tail = logf.read_text(errors="replace").splitlines()[-15:]
    with lock:
        summary["jobs"][j["name"]] = {"rc": rc, "wall_s": wall, "gpus": devices,
                                      "started": round(t0 - summary["t0"], 1), "tail": tail,
                                      "shared_gpu": env.get("SPECLAB_GPU_MEMORY_UTILIZATION")}
        if rc == 0 or (j["expect_fail"] and rc != "timeout"):
            done = set(json.loads((STATE / "done.json").read_text())) if (
                STATE / "done.json").exists() else set()
            (STATE / "done.json").write_text(json.dumps(sorted(done | {j["name"]})))
    log(f"end {j['name']}: rc={rc} in {wall} s", fh)
    pack(out, summary, lock)


def setup(fh) -> None:
    """Once per machine and release: the overlay's .pth into the bundle's site dir (processed
    by every Python process through the bundle's sitecustomize; it patches only what the
    release lacks), an RTLD_GLOBAL preload of libnvrtc that TileLang needs, the fixtures, and
    an environment report."""
    marker = STATE / f"setup-{RELEASE}.json"
    if marker.exists():
        os.environ.update(json.loads(marker.read_text()))
        log(f"setup: done for vLLM {RELEASE} by an earlier call on this machine", fh)
        return
    site = os.environ["SPECLAB_SITE"]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    (RUNS / DIAL).mkdir(parents=True, exist_ok=True)
    steps = [
        [*SPECLAB, "overlay", "install", "--site", site],
        [PY, f"{T}/gpu_env.py", "install", "--site", site],
        [PY, f"{T}/selftest.py", "--no-serve", "--json", f"data/runs/{DIAL}/selftest.json"],
        [*SPECLAB, "fixtures", "build", *FIXTURES],
    ]
    for cmd in steps:
        t0 = time.time()
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        log(f"setup {' '.join(cmd[1:5])}: rc={r.returncode} ({time.time() - t0:.0f} s)\n"
            + (r.stdout + r.stderr)[-2000:], fh)
        st = RUNS / DIAL / "selftest.json"
        if "selftest.py" in cmd[1] and st.exists() and not json.loads(st.read_text()).get(
                "jit", {}).get("ok", True):
            os.environ["DSV4_COMPRESSOR"] = "triton"
            log("CuTe DSL JIT failed: using vLLM's Triton compressor (recorded in env.json)", fh)
    env["DSV4_COMPRESSOR"] = os.environ.get("DSV4_COMPRESSOR", "")
    subprocess.run([PY, f"{T}/gpu_env.py", "report", "--out", f"data/runs/{DIAL}/env.json"],
                   cwd=REPO, env=env)
    marker.write_text(json.dumps({"DSV4_COMPRESSOR": env["DSV4_COMPRESSOR"]}))


def save_jit_cache(out: Path, fh) -> None:
    """The kernels JIT-compiled on this machine (TileLang, DeepGEMM, Triton), so a later
    session can carry them instead of compiling for minutes (`jit.sh save`, the layout
    `jit.sh load` reads); dropped if over 15 MiB."""
    dest = out / f"jit-cache-{RELTAG}.tar.gz"
    r = subprocess.run(["bash", f"{T}/jit.sh", "save", str(dest)], cwd=REPO,
                       capture_output=True, text=True, check=False)
    if not dest.exists():
        return
    size = dest.stat().st_size
    log(f"jit caches: {r.stdout.strip()} -> {size / 2**20:.1f} MiB", fh)
    if size > 15 * 2**20:
        dest.unlink()


def pick(todo: list[dict], free: dict[str, int], slots: int, ended: set[str],
         running: set[str], alone: bool) -> tuple[dict, list[str]] | None:
    """The next job to start and its GPUs, or None. Jobs go in list order; a job waiting for
    GPUs holds back every job after it (no overtaking), a job waiting for its `after` jobs
    does not. free: GPU -> free slots (`slots` each). alone: start nothing while a job runs
    (--warm-first until the first job ends)."""
    if alone and running:
        return None
    for j in todo:
        waiting = [a for a in j["after"] if a not in ended and (
            a in running or any(t["name"] == a for t in todo))]
        if waiting:
            continue
        if j["gpus"] > 1 or j["exclusive"]:
            idle = sorted(g for g, n in free.items() if n == slots)
            return (j, idle[: j["gpus"]]) if len(idle) >= j["gpus"] else None
        best = max(sorted(free), key=lambda g: free[g])
        if free[best] == 0:
            return None
        return j, [best]
    return None


def list_jobs(release: str | None) -> int:
    """Print the plan: every job, or those of `release` with that release's stamp."""
    plan = PLAN if release in (None, RELEASE) else studies.plan(
        studies.stamp(stamp_label(), release), PY, gpu=GPU)
    jobs = [j for j in plan.jobs if release is None or j.vllm == release]
    print(f"stamp {plan.stamp}; set-up builds fixtures {', '.join(plan.fixtures)}")
    for j in jobs:
        print(studies.describe(j))
    print(f"{len(jobs)} jobs" + (f" for vLLM {release}" if release else ""))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", help="the release this environment has, e.g. 0.22 (jobs for "
                    "other releases are skipped); needed unless --list")
    ap.add_argument("--out", type=Path, help="where results.tar.gz, summary.json and "
                    "driver.log go; needed unless --list")
    ap.add_argument("--list", action="store_true", help="print the jobs in priority order "
                    "(only --vllm's, with its stamp, when given) and exit; runs nothing")
    ap.add_argument("--deadline", type=float, default=540, help="seconds from now")
    ap.add_argument("--only", help="comma-separated job names, run in this order "
                    "(default: all of this release not yet done, in priority order)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    ap.add_argument("--slots", type=int, default=1,
                    help="single-GPU jobs at once per GPU (default 1)")
    ap.add_argument("--warm-first", action=argparse.BooleanOptionalAction, default=None,
                    help="run the first job alone, so that it fills the JIT caches (default: "
                    "on when --slots > 1)")
    ap.add_argument("--kv-gib", type=float, default=4,
                    help="KV cache per job when jobs share a GPU (default 4 GiB)")
    ap.add_argument("--min-left", type=float, default=60,
                    help="do not start a job with less time than this left")
    a = ap.parse_args()
    if a.list:
        return list_jobs(a.vllm)
    missing = [f"--{n}" for n in ("vllm", "out") if getattr(a, n) is None]
    if missing:
        ap.error(f"the following arguments are required: {', '.join(missing)} (or --list)")
    if a.vllm != RELEASE:
        ap.error(f"--vllm {a.vllm}, but this environment has vLLM {RELEASE} "
                 "(eval the unpack.sh line of the bundle you mean)")
    if a.slots < 1:
        ap.error("--slots wants 1 or more")
    known = {j["name"]: j for j in JOBS}
    names = a.only.split(",") if a.only else [j["name"] for j in JOBS if j["vllm"] == RELEASE]
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown jobs {unknown}; known: {sorted(known)}")
    other = [n for n in names if known[n]["vllm"] != RELEASE]
    if other:
        ap.error(f"jobs {other} need another vLLM release than {RELEASE}")
    deadline = time.time() + a.deadline
    (STATE / "logs").mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.gpus is None:
        import torch

        a.gpus = torch.cuda.device_count()
    done = set(json.loads((STATE / "done.json").read_text())) if (STATE / "done.json").exists() \
        else set()
    todo = [known[n] for n in names if n not in done and known[n]["gpus"] <= a.gpus]
    warm_first = a.slots > 1 if a.warm_first is None else a.warm_first
    summary = {"started": time.ctime(), "t0": time.time(), "vllm": RELEASE, "gpus": a.gpus,
               "slots": a.slots, "skipped_done": sorted(done & set(names)), "jobs": {}}
    lock = threading.Lock()
    fh = open(a.out / "driver.log", "a")
    log(f"vLLM {RELEASE}, {a.gpus} GPU(s) x {a.slots} slot(s); jobs to run: "
        f"{[j['name'] for j in todo]}", fh)
    restore(fh)
    setup(fh)
    free = {str(g): a.slots for g in range(a.gpus)}
    ended: set[str] = set()
    running: set[str] = set()
    threads: list[threading.Thread] = []
    while todo:
        if deadline - time.time() < a.min_left:
            log(f"deadline: not started {[j['name'] for j in todo]}", fh)
            break
        with lock:
            choice = pick(todo, free, a.slots, ended, running, warm_first and not ended)
            if choice is not None:
                j, devs = choice
                todo.remove(j)
                running.add(j["name"])
                for g in devs:
                    free[g] -= a.slots if (j["gpus"] > 1 or j["exclusive"]) else 1
        if choice is None:
            time.sleep(1)
            continue
        env = job_env(j, ",".join(devs), a.slots, a.kv_gib)

        def target(j=j, devs=devs, env=env):
            try:
                run_job(j, ",".join(devs), env, fh, summary, a.out, lock, deadline)
            finally:
                with lock:
                    for g in devs:
                        free[g] += a.slots if (j["gpus"] > 1 or j["exclusive"]) else 1
                    running.discard(j["name"])
                    ended.add(j["name"])

        t = threading.Thread(target=target)
        t.start()
        threads.append(t)
        time.sleep(1)
    for t in threads:
        t.join(timeout=max(1, deadline + 30 - time.time()))
    # safety net: no engine or server a job started may outlive this call and hold GPU memory
    # (only the processes lab.py's jobs started: nothing else on the machine is touched)
    for seen in list(FAMILIES.values()):
        stop(seen, grace=5)
    save_jit_cache(a.out, fh)
    jobs = summary["jobs"]
    for n, r in jobs.items():  # timing of a job that shared its GPU is not a measurement
        r["overlapped_with"] = sorted(
            m for m, q in jobs.items() if m != n and set(q["gpus"].split(",")) & set(
                r["gpus"].split(",")) and q["started"] < r["started"] + r["wall_s"]
            and r["started"] < q["started"] + q["wall_s"])
    summary["not_started"] = [j["name"] for j in todo]
    summary["finished"] = time.ctime()
    pack(a.out, summary, lock)
    log("driver done", fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
