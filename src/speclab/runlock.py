"""One writer per run folder: an exclusive `flock` on `<run>/.lock`, which the kernel drops
when its holder dies (no stale lock survives a crash or SIGKILL). The file names the holder
(pid, host, since, command) so that a second sweep can say who has the folder.

A process started by the holder (the notebook kernel of `speclab run`) inherits the lock
through $SPECLAB_RUN_LOCK and passes through."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "SPECLAB_RUN_LOCK"


class RunLocked(RuntimeError):
    """Another process writes into this run folder."""


def holder(run_dir: Path) -> dict | None:
    """Who holds (or last held) the run folder's lock, as written in the lock file."""
    try:
        return json.loads((Path(run_dir) / ".lock").read_text())
    except (OSError, ValueError):
        return None


def _inherited(run_dir: Path) -> bool:
    """True where this process or an ancestor holds the lock on run_dir."""
    token = os.environ.get(ENV, "")
    path, _, pid = token.rpartition(":")
    if path != str(Path(run_dir).resolve()) or not pid.isdigit():
        return False
    h = holder(run_dir)
    return bool(h) and h.get("pid") == int(pid) and (
        int(pid) == os.getpid() or int(pid) in _ancestors())


def _ancestors() -> set[int]:
    out, pid = set(), os.getppid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


@contextmanager
def hold(run_dir: Path) -> Iterator[None]:
    """Hold the run folder's lock for the block; raise RunLocked at once if another process
    holds it."""
    run_dir = Path(run_dir)
    if _inherited(run_dir):
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            h = holder(run_dir) or {}
            since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(h.get("since", 0)))
            raise RunLocked(
                f"run folder {run_dir} is in use by pid {h.get('pid', '?')} on "
                f"{h.get('host', '?')} since {since} ({h.get('command', '?')}); wait for it "
                "or use another --run-id") from None
        old = holder(run_dir)
        if old and old.get("pid"):
            log.warning(f"run folder {run_dir}: its previous writer (pid {old['pid']} on "
                f"{old.get('host')}) ended without releasing it; stale lock taken over")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
              "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        prev = os.environ.get(ENV)
        os.environ[ENV] = f"{run_dir.resolve()}:{os.getpid()}"
        try:
            yield
        finally:
            if prev is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = prev
            os.ftruncate(fd, 0)  # an empty file: released cleanly
    finally:
        os.close(fd)
