#!/usr/bin/env python3
"""Run the lab's GPU jobs on the device machine within one call's time, resuming across calls.

    eval "$(bash tools/gpu/unpack.sh .stage/gpu)"     # one bundle: vLLM 0.22 here
    python3 tools/gpu/lab.py --vllm 0.22 --out $OUT --deadline 540 [--only job,job]
        [--gpus 2] [--slots 3] [--no-warm-first]

Jobs (JOBS below) run as subprocesses, each with its own log and timeout. Each job names the
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


RELEASE = current_release()
# run-folder suffix: the date (or LAB_STAMP, to keep a second session of the same day apart)
# and the vLLM release, e.g. 20261201-vllm022
RELTAG = RELEASE and "vllm{}{:02d}".format(*map(int, RELEASE.split(".")))
STAMP = "-".join(filter(None, (os.environ.get("LAB_STAMP") or time.strftime("%Y%m%d"), RELTAG)))

# name, GPUs, timeout (s), command, run folders it writes (under data/runs); the vLLM release
# it needs; jobs it must start after; whether it needs its GPUs to itself (timing)
JOBS: list[dict] = []


def job(name: str, gpus: int, timeout: int, cmd: list[str], runs: list[str], env=None,
        expect_fail: bool = False, vllm: str = "0.22", after: tuple[str, ...] = (),
        exclusive: bool = False):
    JOBS.append({"name": name, "gpus": gpus, "timeout": timeout, "cmd": cmd, "runs": runs,
                 "env": env or {}, "expect_fail": expect_fail, "vllm": vllm,
                 "after": tuple(after), "exclusive": exclusive})


def sweep(profile: str, run: str, *extra: str) -> list[str]:
    return [*SPECLAB, "sweep", "--profile", profile, "--run-id", run, *extra]


DIAL, RIG, NEAR = (f"h200-{n}-{STAMP}" for n in ("dsv4-dial", "dsv4-rig", "dsv4-neartie"))
T = "tools/gpu"
FIXTURES = ["tiny-dsv4", "tiny-dsv4-eagle3", "rig-dsv4", "rig-dsv4-eagle3", "dial-dsv4",
            "dial-dsv4-eagle3", "neartie-dsv4", "neartie-dsv4-eagle3"]
TP1 = "*_tp1_*"
# Priority order. First the kernel check behind the broken small-step decode of the hidden-512
# fixtures (seconds; data/runs/h200-20261130.md), then proof of the overlay (exact rig counters,
# plain decoding against the transformers reference, the acceptance sweep, draft KV fp8, server
# mode, compiled mode), the parity arms (one GPU, then TP=2 + EP), aux states, the cost
# benchmark, and the stock error last (recorded before; it does not depend on the fixture).
MHC = f"h200-mhc-check-{STAMP}"  # one folder per day for all sizes
job("mhc-check", 1, 300, [PY, f"{T}/mhc_check.py", "--hidden", "4096", "--out",
                          f"data/runs/{MHC}/mhc_check_4096.json"], [MHC])
job("rig", 1, 600, sweep("tiny-dsv4-rig", RIG), [RIG])
job("sanity", 1, 420, [PY, f"{T}/dsv4_sanity.py", "--run-dir", f"data/runs/{DIAL}/sanity-tiny",
                       "--target", "tiny-dsv4"], [DIAL])
job("dial-auto", 1, 900, sweep("tiny-dsv4-h200", DIAL, "--only", "k0_*,*dkv-auto*"), [DIAL])
job("dial-fp8", 1, 900, sweep("tiny-dsv4-h200", DIAL, "--only", "*dkv-fp8*"), [DIAL])
job("serve", 1, 600, sweep("tiny-dsv4-h200", DIAL, "--mode", "server", "--concurrency", "1,4",
                           "--only", "k3_*dkv-auto*"), [DIAL])
# torch.compile + CUDA graphs, every engine compiling from scratch
COMPILED = '{"engine": {"enforce_eager": false}, "env": {"VLLM_DISABLE_COMPILE_CACHE": "1"}}'
job("compiled", 1, 600, sweep("tiny-dsv4-h200", f"{DIAL}-compiled", "--only",
                              "k0_*,k3_*dkv-auto*", "--override", COMPILED), [f"{DIAL}-compiled"])
# the rig's draft reads aux state 1 (the dial draft ignores aux states): exact counters under
# torch.compile + CUDA graphs prove the captured aux states survive compilation
job("rig-compiled", 1, 600, sweep("tiny-dsv4-rig", f"{RIG}-compiled", "--override", COMPILED),
    [f"{RIG}-compiled"])
job("neartie-parity", 1, 1200, sweep("tiny-dsv4-neartie-h200", NEAR, "--with-parity",
                                     "--only", TP1), [NEAR])
job("tp2-ep", 2, 900, ["bash", "-c", "; ".join(
    " ".join(sweep(p, r, "--with-parity", "--only", "'*tp2-ep*'"))
    for p, r in (("tiny-dsv4-h200", DIAL), ("tiny-dsv4-neartie-h200", NEAR)))], [DIAL, NEAR])
# The overlay's cost in one eager engine (tools/gpu/overlay_cost.py): installed-but-unused vs
# vLLM's own forward, alternating per decode step, and the aux capture per verify step
COST = f"h200-dsv4-cost-{STAMP}"
job("cost", 1, 420, [PY, f"{T}/overlay_cost.py", "--run-dir", f"data/runs/{COST}"], [COST],
    exclusive=True)
job("sanity-neartie", 1, 420, [PY, f"{T}/dsv4_sanity.py", "--run-dir",
                               f"data/runs/{NEAR}/sanity", "--target", "neartie-dsv4"], [NEAR])
job("stock-error", 1, 300, sweep("tiny-dsv4-rig", f"{RIG}-stock", "--only", "k3_*", "--override",
                                 '{"env": {"DSV4_EAGLE3_OVERLAY": "off"}, "overlay": "off"}'),
    [f"{RIG}-stock"], expect_fail=True)
# vLLM 0.26 (bundle .stage/gpu026; issue 13): the same fixtures on the native DeepSeek-V4
# EAGLE-3 support, and the native aux capture's cost
job("rig-026", 1, 600, sweep("tiny-dsv4-rig", RIG), [RIG], vllm="0.26")
job("dial-026", 1, 900, sweep("tiny-dsv4-h200", DIAL, "--only", "k0_*,k3_*dkv-auto*"), [DIAL],
    vllm="0.26", after=("rig-026",))
job("dial-022", 1, 900, sweep("tiny-dsv4-h200", DIAL, "--only", "k0_*,k3_*dkv-auto*"), [DIAL])
# issue 18: the same points through the Ray executor (a Ray instance on this node; Ray from
# $SPECLAB_RAY_SITE, README "Ray on the device"), counters and tokens against dial-022's
job("ray-dial", 1, 900, ["bash", "-c", "export PYTHONPATH=$PYTHONPATH:"
                         "${SPECLAB_RAY_SITE:?no Ray layer} && " + " ".join(sweep(
                             "tiny-dsv4-h200", f"{DIAL}-ray", "--only", "'k0_*,k3_*dkv-auto*'",
                             "--executor", "ray")) +
                         f" && {PY} {T}/compare_counters.py data/runs/{DIAL} data/runs/{DIAL}-ray"],
    [f"{DIAL}-ray", DIAL], after=("dial-022",), exclusive=True)
# stock 0.26 (overlay off) with a Llama draft next to DeepSeek-V4: expected to fail at engine
# start ("Some layers are not assigned to any group.", overlay/README.md): recorded as data
job("stock-error-026", 1, 300, sweep("tiny-dsv4-layer-rig", f"{RIG}-stock", "--override",
                                     '{"env": {"DSV4_EAGLE3_OVERLAY": "off"}, "overlay": "off"}'),
    [f"{RIG}-stock"], expect_fail=True, vllm="0.26")
job("cost-026", 1, 420, [PY, f"{T}/overlay_cost.py", "--run-dir", f"data/runs/{COST}"], [COST],
    vllm="0.26", exclusive=True)


# Layer-exact rig (issue 12; speclab.fixtures.dsv4_layer_rig): one run folder per arm, each
# checked against the committed CPU expectations (`tools/layer_rig.py check ARM RUN` writes
# expected_check_<arm>.json; rc 1 unless counters are exact and outputs count). The positive
# arm eager and compiled; negatives (eager), each must read ~0 at position 1: the other
# convention, hc stream 0 instead of the mean (fault through the overlay's capture_aux: 0.22 +
# overlay only; tools/gpu/aux_fault.py), aux slots permuted (rotated draft). On vLLM 0.26 the
# same arms but neg-stream0 (jobs `<name>-026`; run folders carry the release via STAMP).
# Then the aux states against the transformers reference with neighbour controls
# (tools/gpu/aux_check.py, which replaced the old same-pass recomputation `aux-check` job) on
# tiny-dsv4 (random weights) and on the rig.
LR = f"h200-dsv4-layer-rig-{STAMP}"
LR_PROFILE = "tiny-dsv4-layer-rig"
FIXTURES += ["layer-rig-dsv4", "layer-rig-dsv4-eagle3", "layer-rig-dsv4-eagle3-perm"]
LR_ARMS = {  # job suffix: (expectation arm, sweep override or None, extra env)
    "": ("positive", None, {}),
    "-compiled": ("positive", COMPILED, {}),
    "-neg-input": ("neg-input", '{"env": {"EAGLE3_AUX_LAYER_CONVENTION": "input"}}', {}),
    "-neg-stream0": ("neg-stream0", '{"env": {"SPECLAB_AUX_FAULT": "stream0"}}', {}),
    "-neg-perm": ("neg-perm", '{"draft": "fixture:layer-rig-dsv4-eagle3-perm"}', {}),
}


def layer_rig_cmd(run: str, arm: str, override: str | None, *, tp2: bool = False) -> list[str]:
    extra = ["--override", override] if override else []
    if tp2:
        extra = ["--override", '{"grid": {"layout": [{"tp": 2, "ep": true}]}}']
    steps = [" ".join(sweep(LR_PROFILE, run, *(f"'{x}'" if x.startswith("{") else x
                                               for x in extra))),
             f"{PY} tools/layer_rig.py check {arm} data/runs/{run}"]
    if arm == "neg-stream0":  # the fault's .pth, only while this arm runs
        fault = f"{PY} {T}/aux_fault.py"
        steps = [f"{fault} install", f"trap '{fault} uninstall' EXIT", *steps]
    return ["bash", "-c", " && ".join(steps)]


for suffix, (arm, override, env) in LR_ARMS.items():
    run = LR + ("-positive" if suffix in ("", "-compiled") else "") + suffix
    job(f"layer-rig{suffix}", 1, 600 if "compiled" in suffix else 420,
        layer_rig_cmd(run, arm, override), [run], env=env)
    if arm != "neg-stream0":  # 0.26: the native forward has no capture_aux to fault
        job(f"layer-rig{suffix}-026", 1, 600 if "compiled" in suffix else 420,
            layer_rig_cmd(run, arm, override), [run], env=env, vllm="0.26")
job("layer-rig-tp2-ep", 2, 600, layer_rig_cmd(f"{LR}-positive-tp2-ep", "positive", None, tp2=True),
    [f"{LR}-positive-tp2-ep"])
AUX = [PY, f"{T}/aux_check.py", "--run-dir", f"data/runs/{LR}-aux"]
job("aux-check-tiny", 1, 480, [*AUX, "--tag", "tiny-dsv4", "--target", "tiny-dsv4", "--draft",
                                "tiny-dsv4-eagle3"], [f"{LR}-aux"])
job("aux-check-rig", 1, 480, [*AUX, "--tag", "layer-rig", "--target", "layer-rig-dsv4",
                              "--draft", "layer-rig-dsv4-eagle3", "--prompt-file",
                              "data/prompts/layer-rig-dsv4-ids.jsonl", "--prompts", "3"],
    [f"{LR}-aux"])
job("aux-check-rig-compiled", 1, 600, [*AUX, "--tag", "layer-rig-compiled", "--target",
                                       "layer-rig-dsv4", "--draft", "layer-rig-dsv4-eagle3",
                                       "--prompt-file", "data/prompts/layer-rig-dsv4-ids.jsonl",
                                       "--prompts", "3", "--compiled"], [f"{LR}-aux"])
for name in ("aux-check-tiny", "aux-check-rig"):  # the same on vLLM 0.26's native capture
    j = next(x for x in JOBS if x["name"] == name)
    job(f"{name}-026", 1, j["timeout"], j["cmd"], j["runs"], vllm="0.26")

# The aux-layer convention as a grid dimension (speclab.convention): the rig's draft once per
# convention in one run folder (two engines); notebook 02, rendered from the results
# (`speclab run --notebooks 02_acceptance -p execute=false`), must name `output` the winner.
CONV = f"h200-dsv4-convention-check-{STAMP}"
job("convention-check", 1, 840, sweep("tiny-dsv4-convention-check", CONV), [CONV])
job("convention-check-026", 1, 840, sweep("tiny-dsv4-convention-check", CONV), [CONV],
    vllm="0.26")

def _add_parity_jobs() -> None:
    """The parity study's jobs (tools/gpu/parity_jobs.py, loaded by path: lab.py is also
    imported as a file by the tests)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("parity_jobs",
                                                  Path(__file__).with_name("parity_jobs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.add_jobs(job, sweep, STAMP, PY)


_add_parity_jobs()


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


JIT_CACHES = ["~/.triton/cache", "~/.tilelang", "~/.deep_gemm", "~/.cache/tilelang",
              "~/.cache/vllm"]


def save_jit_cache(out: Path, fh) -> None:
    """The kernels JIT-compiled on this machine (TileLang, DeepGEMM, Triton), so a later
    session can carry them instead of compiling for minutes; dropped if over 15 MiB."""
    dirs = [os.path.expanduser(d) for d in JIT_CACHES if os.path.isdir(os.path.expanduser(d))]
    if not dirs:
        return
    dest = out / f"jit-cache-{RELTAG}.tar.gz"
    subprocess.run(["tar", "czf", str(dest), *dirs], check=False, capture_output=True)
    size = dest.stat().st_size if dest.exists() else 0
    sizes = subprocess.run(["du", "-sh", *dirs], capture_output=True, text=True).stdout
    log(f"jit caches: {sizes.strip()} -> {size / 2**20:.1f} MiB", fh)
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm", required=True, help="the release this environment has, e.g. "
                    "0.22 (jobs for other releases are skipped)")
    ap.add_argument("--out", type=Path, required=True)
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
