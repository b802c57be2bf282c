"""Process lifetimes: the only code that starts or stops processes (point workers, multipass
engines, `vllm serve`).

Every child starts in a session of its own (its process group: vLLM's engine processes
join it) and is tied to its parent twice: the kernel sends it SIGTERM when the parent dies
(Linux `PR_SET_PDEATHSIG`, set before exec), and a Python child calls `guard_parent` first,
which turns that SIGTERM (or a parent found gone by its watchdog) into the end of its whole
group. `stop` is the one kill ladder. `run_point` and `timing_round` run one point in a
worker (`python -m speclab.worker SPEC`) and record its failure when it wrote no result."""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator, NoReturn

from speclab import fingerprint, methods, store
from speclab.profiles import Point, Profile, resolve_model

log = logging.getLogger(__name__)
WORKER = "speclab.worker"  # the module a point's process runs (`python -m WORKER SPEC`)
PR_SET_PDEATHSIG = 1
_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


# --------------------------------------------------------------------- in the parent
def _term_with_parent() -> None:
    """In the child before exec: SIGTERM it when its parent dies (Linux)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start(cmd: list[str], log: IO, env: dict[str, str], *, stdin=None,
          pass_fds: tuple[int, ...] = (), text: bool = False) -> subprocess.Popen:
    """A child process in its own group, output to `log`, tied to this process (PDEATHSIG);
    the caller ends it with `stop`. stdin / pass_fds / text as for `subprocess.Popen` (a
    worker that takes commands on a pipe and answers on an inherited descriptor)."""
    return subprocess.Popen(cmd, stdin=stdin, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, preexec_fn=_term_with_parent,
                            pass_fds=pass_fds, text=text)


@contextmanager
def child(cmd: list[str], log: IO[bytes], env: dict[str, str], *, interrupt_s: float = 0
          ) -> Iterator[subprocess.Popen]:
    """A child process in its own group, output to `log`, tied to this process; its whole
    group is stopped (`stop`) when the block ends, whatever ends it."""
    proc = start(cmd, log, env)
    try:
        yield proc
    finally:
        stop(proc, interrupt_s)


def stop(proc: subprocess.Popen, interrupt_s: float = 0) -> None:
    """The kill ladder for a child's process group: SIGINT first when interrupt_s (a server
    shuts down cleanly on it; waiting that long), then SIGTERM (15 s), then SIGKILL, then
    SIGKILL again for members that outlived the leader (an orphaned engine core)."""
    ladder = ([(signal.SIGINT, interrupt_s)] if interrupt_s else []) + [
        (signal.SIGTERM, 15), (signal.SIGKILL, 10)]
    for sig, wait in ladder:
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_module(module: str, spec: dict, spec_path: Path, log_path: Path,
               env: dict[str, str], timeout: float) -> str | None:
    """`python -m module SPEC` on `spec` (with this process as its parent_pid, written to
    spec_path: kept, it reruns the job by hand), output to log_path; None, or why it did not
    finish ("exited with N", "timeout after N s")."""
    store.atomic_write(spec_path, json.dumps({**spec, "parent_pid": os.getpid()}))
    env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_f, \
            child([sys.executable, "-m", module, str(spec_path)], log_f, env) as proc:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timeout after {timeout:.0f} s"
    return None if rc == 0 else f"exited with {rc}"


def prepare_models(profile: Profile, points: list[Point]) -> None:
    """Build the profile's fixtures here, once, before any worker starts (a build can take
    minutes and must not count against a point's timeout or repeat in every worker)."""
    refs = [profile.target] + ([profile.draft] if any(
        methods.uses_draft(methods.of(p)) for p in points) else [])
    for ref in refs:
        if ref and ref.startswith("fixture:"):
            resolve_model(ref)


def run_point(profile: Profile, point: Point, run_dir: Path, fp: dict | None = None) -> dict:
    """Run one point in a worker process (`python -m speclab.worker`) with its environment;
    its metadata carries fp (the point's fingerprint, computed here when not given)."""
    run_dir = Path(run_dir)
    fp = fp or fingerprint.of_point(profile, point)
    spec = {"profile": profile.model_dump(mode="json"), "point": point.model_dump(mode="json"),
            "run_dir": str(run_dir), "fingerprint": fp}
    log_path = run_dir / "logs" / f"{point.id}.log"
    t0 = time.time()
    error = _worker(profile, point, spec, run_dir / "logs" / f"{point.id}.spec.json", log_path)
    meta, problem = store.inspect_point(run_dir, point.id)
    fresh = meta is not None and meta.get("started_at", 0) >= t0 - 1
    if fresh and (error is None or meta["status"] == "error"):
        if meta["status"] == "error" and "root_cause" not in meta:
            meta["root_cause"] = root_cause(log_path)  # e.g. from vLLM's engine-core process
            store.write_point(run_dir, store.PointResult.model_validate(meta))
        return meta
    return store.write_point(run_dir, store.PointResult(
        point_id=point.id, status="error", point=point.model_dump(mode="json"),
        error=error or problem or "worker wrote no result",
        root_cause=root_cause(log_path), log_tail=tail(log_path),
        wall_s=time.time() - t0, fingerprint=fp, sampling=fp["parts"]["sampling"]))


def timing_round(profile: Profile, point: Point, run_dir: Path, rnd: int) -> dict:
    """One more timed pass of a finished point in a fresh worker (spec mode "timing"),
    appended to the point's `passes`; its throughput becomes their mean. A failed round is
    logged and kept under `pass_errors`; the point's results stay."""
    run_dir = Path(run_dir)
    meta = store.read_meta(run_dir, point.id)
    stem = run_dir / "logs" / f"{point.id}.round{rnd}"  # beside round 1's files, not over them
    out = Path(f"{stem}.json")
    out.unlink(missing_ok=True)
    spec = {"profile": profile.model_dump(mode="json"), "point": point.model_dump(mode="json"),
            "run_dir": str(run_dir), "mode": "timing", "round": rnd, "output": str(out)}
    log_path = Path(f"{stem}.log")
    error = _worker(profile, point, spec, Path(f"{stem}.spec.json"), log_path)
    try:
        passed = json.loads(out.read_text()) if error is None else None
    except (OSError, json.JSONDecodeError) as e:
        passed, error = None, f"no timing result ({e})"
    if passed is None:
        cause = root_cause(log_path)
        log.warning(f"point {point.id}: timing round {rnd} failed: {error}"
                    + (f" ({cause})" if cause else ""))
        meta.setdefault("pass_errors", []).append({"round": rnd, "error": error,
                                                    "root_cause": cause})
    else:
        meta["passes"] = [*meta.get("passes", []), passed]
        meta["throughput_tok_s"] = sum(p["tok_s"] for p in meta["passes"]) / len(meta["passes"])
    return store.write_point(run_dir, store.PointResult.model_validate(meta))


def _worker(profile: Profile, point: Point, spec: dict, spec_path: Path, log_path: Path
            ) -> str | None:
    error = run_module(WORKER, spec, spec_path, log_path, {**profile.env, **point.env},
                       profile.timeout_s)
    return f"worker {error}" if error and error.startswith("exited") else error


def root_cause(log_path: Path) -> str | None:
    """The first exception line of a worker log ("ValueError: ..."): with vLLM's engine core
    in its own process, the worker's own exception only says "see root cause above"."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR [^\]]*\] )?((?:\w+\.)*\w*(?:Error|Exception)"
                  r": .+)$", text, re.M)
    return m.group(1).strip() if m else None


def tail(path: Path, n: int = 40) -> str:
    """The last n lines of a log ("" when it cannot be read)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


# --------------------------------------------------------------------- in the child
def die_with_parent(parent_pid: int) -> None:
    """End this process group (the child and vLLM's engine processes) when the parent dies:
    SIGTERM (sent by the kernel on the parent's death) ends the group, and a watchdog thread
    checks the parent's pid every half second (other systems, or a parent gone already).
    Only the leader of its own process group (as `child` starts it) takes the group down."""
    def end_group(*_):
        if os.getpgid(0) == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    signal.signal(signal.SIGTERM, end_group)
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        end_group()

    threading.Thread(target=watch, daemon=True, name="speclab-parent-watch").start()


def child_main(main: Callable[[str], int]) -> NoReturn:
    """Exit with `main(SPEC path from argv)`, run without cyclic garbage collection until its
    engine starts (`engine.open_llm` turns it back on, before any engine process can inherit
    it off) and without the final collection at exit: each full pass walks everything torch
    and vLLM imported so far."""
    gc.disable()
    rc = main(sys.argv[1])
    gc.freeze()
    sys.exit(rc)


def guard_parent(spec: dict) -> bool:
    """Tie this child to the process that started it (spec["parent_pid"]); False when that
    process is gone already. A spec rerun by hand runs untied."""
    parent = spec.get("parent_pid")
    if parent == os.getppid():
        die_with_parent(parent)
    elif parent and not _alive(parent):
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
