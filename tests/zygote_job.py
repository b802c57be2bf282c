"""A job for the launch tests (`launch.run_module`, forked from a zygote or started with
`python -m`): `preload` notes when it ran; `main` writes what the job saw (its pid, parent,
process group, environment, command line, when its module was preloaded) to spec["output"],
prints a line to its log, then fails, exits or sleeps when spec["act"] asks."""

import json
import os
import sys
import time
from pathlib import Path

from speclab import launch

PRELOADED: float | None = None


def preload() -> None:
    global PRELOADED
    PRELOADED = time.time()


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if not launch.guard_parent(spec):
        return 1
    print("job says hello", flush=True)
    Path(spec["output"]).write_text(json.dumps({
        "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
        "env": os.environ.get("ZYGOTE_TEST"), "preloaded": PRELOADED,
        "cmdline": Path("/proc/self/cmdline").read_bytes().decode().replace("\0", " ")}))
    act = spec.get("act")
    if act == "raise":
        raise RuntimeError("asked to fail")
    if act == "exit":
        sys.exit(3)
    if act == "sleep":
        time.sleep(120)
    return 0


if __name__ == "__main__":
    launch.child_main(main)
