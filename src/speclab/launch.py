"""Process lifetimes: the only code that starts or stops processes (point workers, multipass
engines, `vllm serve`).

Every child starts in a session of its own (its process group: vLLM's engine processes
join it) and is tied to its parent twice: the kernel sends it SIGTERM when the parent dies
(Linux `PR_SET_PDEATHSIG`, set before exec), and a Python child calls `guard_parent` first,
which turns that SIGTERM (or a parent found gone by its watchdog) into the end of its whole
group. `stop` is the one kill ladder. `run_point` and `timing_round` run one point in a
worker (`python -m speclab.worker SPEC`) and record its failure when it wrote no result.

On the CPU backend a job is forked from a `Zygote` instead: a process that imported the job's
module (and vLLM, through the module's `preload()`) once, under the job's environment. Each
job still runs in a fresh process of its own with a fresh engine; only the imports (~10 s a
process on two cores) are shared. `SPECLAB_FORK=0` starts every job with `python -m`."""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, ClassVar, NoReturn

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
               env: dict[str, str], timeout: float, *, fork: bool = False) -> str | None:
    """`python -m module SPEC` on `spec` (with this process as its parent_pid, written to
    spec_path: kept, it reruns the job by hand), output to log_path; None, or why it did not
    finish ("exited with N", "timeout after N s"). fork: fork the job from the `Zygote` of
    (module, environment) instead, unless $SPECLAB_FORK is "0" or the zygote cannot start."""
    store.atomic_write(spec_path, json.dumps({**spec, "parent_pid": os.getpid()}))
    env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    zygote = Zygote.of(module, env, timeout) if fork and env.get(FORK_ENV) != "0" else None
    with _job(zygote, module, spec_path, log_path, env) as proc:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timeout after {timeout:.0f} s"
    return None if rc == 0 else f"exited with {rc}"


@contextmanager
def _job(zygote: Zygote | None, module: str, spec_path: Path, log_path: Path,
         env: dict[str, str]) -> Iterator[subprocess.Popen | Forked]:
    if zygote is None:
        with open(log_path, "wb") as log_f, \
                child([sys.executable, "-m", module, str(spec_path)], log_f, env) as proc:
            yield proc
        return
    proc = zygote.fork(spec_path, log_path, env)
    try:
        yield proc
    finally:
        stop(proc)


# --------------------------------------------------------------------- forked jobs
FORK_ENV = "SPECLAB_FORK"  # "0": start every job with `python -m`, never from a zygote
# Set by pytest per test phase; a zygote's child gets the job's value, so it is not a reason
# to import everything again.
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})
_IDLE_ZYGOTES = 2  # kept per process beyond the one in use


class Forked:
    """A job forked by a `Zygote`: what `stop` and `run_module` use of `subprocess.Popen`
    (its pid leads the job's own process group; exit status from the zygote)."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        return self.wait(0, raise_timeout=False)

    def wait(self, timeout: float | None = None, *, raise_timeout: bool = True) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_status(self.pid, timeout)
        if self.returncode is None and raise_timeout:
            raise subprocess.TimeoutExpired(f"forked job {self.pid}", timeout or 0)
        return self.returncode


class Zygote:
    """A process that imported a job module (and what its `preload()` imports) under one
    environment and forks a fresh process per job (`zygote_main`). Answers come as JSON lines
    on a pipe: {"ready"} or {"error"} once, {"pid"} per job, {"exit", "rc"} per job end."""

    _live: ClassVar[OrderedDict[tuple, Zygote]] = OrderedDict()

    @classmethod
    def of(cls, module: str, env: dict[str, str], timeout: float) -> Zygote | None:
        """The zygote of (module, env), started (and waited for up to timeout) on first use;
        None when it cannot start (the job then starts with `python -m`, whose log shows
        why)."""
        key = (module, tuple(sorted((k, v) for k, v in env.items() if k not in _VOLATILE_ENV)))
        z = cls._live.get(key)
        if z is not None and z.proc.poll() is None:
            cls._live.move_to_end(key)
            return z
        z = cls(module, env)
        why = z.wait_ready(timeout)
        if why:
            log.warning(f"no zygote for {module} ({why}): starting the job with python -m")
            z.close()
            return None
        cls._live[key] = z
        while len(cls._live) > 1 + _IDLE_ZYGOTES:
            cls._live.popitem(last=False)[1].close()
        return z

    def __init__(self, module: str, env: dict[str, str]):
        read_fd, write_fd = os.pipe()
        self.out = tempfile.TemporaryFile()  # the zygote's own output: imports' warnings
        try:
            code = f"from speclab import launch; launch.zygote_main({module!r}, {write_fd})"
            self.proc = start([sys.executable, "-c", code],
                              self.out, env, stdin=subprocess.PIPE, pass_fds=(write_fd,))
        finally:
            os.close(write_fd)
        self.answers, self.buf, self.exits = read_fd, b"", {}
        self.lock = threading.Lock()

    def _next(self, timeout: float | None) -> dict | None:
        """The next answer; None on timeout, {"eof": True} when the zygote is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.answers], [], [], left)[0]:
                return None
            chunk = os.read(self.answers, 65536)
            if not chunk:
                return {"eof": True}
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self, timeout: float) -> str | None:
        with self.lock:
            msg = self._next(timeout)
        if msg and "ready" in msg:
            return None
        if msg is None:
            return f"not ready within {timeout:.0f} s"
        self.out.seek(0)
        return msg.get("error") or f"exited: {self.out.read().decode(errors='replace')[-300:]}"

    def fork(self, spec_path: Path, log_path: Path, env: dict[str, str]) -> Forked:
        """Fork one job: `module.main(spec_path)` with env as its environment, output to
        log_path, in a process group of its own."""
        job = {"spec": str(spec_path), "log": str(log_path), "env": env}
        with self.lock:
            self.proc.stdin.write(json.dumps(job).encode() + b"\n")
            self.proc.stdin.flush()
            while (msg := self._next(None)) and "pid" not in msg:
                self._note(msg)
        if not msg or "pid" not in msg:
            raise RuntimeError("the zygote ended before forking the job")
        return Forked(self, msg["pid"])

    def _note(self, msg: dict) -> None:
        if "exit" in msg:
            self.exits[msg["exit"]] = msg["rc"]
        elif msg.get("eof"):
            self.exits[None] = -signal.SIGTERM  # every job still running ends with it

    def exit_status(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while pid not in self.exits and None not in self.exits:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                msg = self._next(left)
                if msg is None:
                    return None
                self._note(msg)
            return self.exits.pop(pid, self.exits.get(None))

    def close(self) -> None:
        """End the zygote (its stdin closes; a job it forked would end with it)."""
        if self.proc.stdin:
            self.proc.stdin.close()
        stop(self.proc)
        os.close(self.answers)
        self.out.close()


def zygote_main(module: str, answer_fd: int) -> NoReturn:
    """The zygote's loop (`Zygote`): import `module` and run its `preload()`, then fork one
    process per job line read from stdin, and report each job's pid and exit status; end
    when stdin closes (its parent is gone, or closed it). Single-threaded, so a fork never
    copies a lock another thread holds."""
    gc.disable()
    answers = os.fdopen(answer_fd, "w", buffering=1)

    def say(msg: dict) -> None:
        answers.write(json.dumps(msg) + "\n")

    try:
        mod = importlib.import_module(module)
        getattr(mod, "preload", lambda: None)()
    except BaseException as e:
        say({"error": f"{type(e).__name__}: {e}"})
        os._exit(1)
    gc.freeze()
    say({"ready": os.getpid()})
    stdin, buf, running = sys.stdin.fileno(), b"", set()
    while True:
        readable = select.select([stdin], [], [], 0.2)[0]
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            running.discard(pid)
            say({"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            os._exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            job = json.loads(line)
            pid = os.fork()
            if pid == 0:
                answers.close()
                _forked_job(mod, module, job)
            running.add(pid)
            say({"pid": pid})


_FORKED = False


def forked() -> bool:
    """Whether this process is a job forked by a zygote. Such a job ends with `os._exit`
    once its `main` returns and its output is flushed: no atexit handler or finalizer runs
    (vLLM's engine shutdown at exit cost a tiny CPU point ~2.5 s), and what it started in
    its process group ends with the group (`stop`). What it must keep, it writes first."""
    return _FORKED


def _forked_job(mod, module: str, job: dict) -> NoReturn:
    """In a job forked by the zygote: its own process group, output to the job's log, the
    job's environment, tied to the zygote (which ends when the job's parent does); then
    `mod.main(spec)` as `child_main` runs it, and `os._exit` (see `forked`)."""
    global _FORKED
    rc, _FORKED = 1, True
    try:
        os.setsid()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        from setproctitle import setproctitle  # `ps` names the job, as for `python -m`

        setproctitle(f"{sys.executable} -m {module} {job['spec']}")  # before environ changes
        sys.argv = [f"{module} (forked)", job["spec"]]
        os.environ.clear()
        os.environ.update(job["env"])
        die_with_parent(os.getppid())
        rc = mod.main(job["spec"])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc if isinstance(rc, int) else 1)


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
                       profile.timeout_s, fork=profile.backend == "cpu")
    return f"worker {error}" if error and error.startswith("exited") else error


def root_cause(log_path: Path) -> str | None:
    """The first exception line of a worker log ("ValueError: ..."): with vLLM's engine core
    in its own process, the worker's own exception only says "see root cause above"."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR [^\]]*\] )?((?:\w+\.)*\w*(?:Error|Exception)"
                  r": .+)$", text, re.MULTILINE)
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
