"""What the host did while the GPU was timed: a sampler of the machine's CPU time (busy, iowait,
steal) and its busiest processes, and that record set beside each timed pass.

A speculative step at batch 1 issues more host work than a plain one (drafter launches,
rejection sampling); on some machines it stalled in some rounds and not in others. The
sampler answers what the host was doing then: `Watch(path)` appends one JSON line a second
(`interval`) to `host.jsonl`, the machine's CPU time in cores over the interval by kind, the
1-minute load, the processes that used at least `min_cores` of a core, busiest first, and
GPU 0's SM clock, power and temperature at the sample's end (`gpus.clocks`, where there is
a GPU: is a slow round a throttled GPU?).
`per_pass(host_rows, pass_rows)` averages those over each pass's greedy window
(`t_full_start` .. + `t_full_s`, set by `speclab.benchworker`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

from speclab import gpus, store

KINDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
TOP = 8


def parse_stat(text: str) -> dict[str, int]:
    """The machine's cumulative CPU ticks by kind, from /proc/stat's first line."""
    fields = text.split("\n", 1)[0].split()
    if fields[0] != "cpu":
        raise ValueError(f"not /proc/stat: {fields[:1]}")
    return dict(zip(KINDS, map(int, fields[1:1 + len(KINDS)])))


def parse_pid_stat(text: str) -> tuple[str, int, int]:
    """(command, utime + stime ticks, CPU last run on) from /proc/PID/stat; the command may
    hold spaces and parentheses, so the fields are read after its last ')'."""
    comm = text[text.index("(") + 1:text.rindex(")")]
    rest = text[text.rindex(")") + 2:].split()
    return comm, int(rest[11]) + int(rest[12]), int(rest[36])


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:  # a process that ended between listing and reading
        return None


def snapshot() -> tuple[float, dict[str, int], dict[int, tuple[str, int, int]]]:
    """(time, the machine's ticks by kind, {pid: `parse_pid_stat`}): about 0.02 ms of one
    core a process (1.3 ms for 72 on the 2-core machine), so a second's sample of a GPU
    machine's few hundred processes costs about 1% of one of its cores."""
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (text := _read(f"/proc/{name}/stat")):
            procs[int(name)] = parse_pid_stat(text)
    return time.time(), parse_stat(_read("/proc/stat") or ""), procs


def delta(before, after, tick_hz: float, min_cores: float = 0.05) -> dict:
    """One sample: what the machine and its processes used between two snapshots, in cores
    (`Watch` adds the load and the GPU's reading)."""
    t0, cpu0, p0 = before
    t1, cpu1, p1 = after
    dt = t1 - t0
    per = {k: (cpu1[k] - cpu0[k]) / tick_hz / dt for k in KINDS}
    top = []
    for pid, (comm, ticks, cpu) in p1.items():
        if pid in p0 and p0[pid][0] == comm:
            cores = (ticks - p0[pid][1]) / tick_hz / dt
            if cores >= min_cores:
                top.append([pid, comm, round(cores, 3), cpu])
    top.sort(key=lambda t: -t[2])
    busy = sum(v for k, v in per.items() if k not in ("idle", "iowait", "steal"))
    return {"t": round(t1, 3), "dt": round(dt, 3), "busy": round(busy, 3),
            "iowait": round(per["iowait"], 3), "steal": round(per["steal"], 3),
            "top": top[:TOP]}


class Watch:
    """A daemon thread appending a `delta` sample to `path` every `interval` s until `stop()`."""

    def __init__(self, path: Path, interval: float = 1.0):
        self.path, self.interval = Path(path), interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostwatch", daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        before = snapshot()
        while not self._stop.wait(self.interval):
            after = snapshot()
            sample = delta(before, after, hz)
            sample["load1"] = float((_read("/proc/loadavg") or "0").split()[0])
            if (gpu := gpus.clocks()) is not None:
                sample["gpu"] = gpu
            store.append_jsonl(self.path, sample)
            before = after


PASS_KEYS = ("engine", "op", "round", "B", "k", "t_full_s")


def per_pass(host_rows: list[dict], pass_rows: list[dict], keys=PASS_KEYS) -> list[dict]:
    """Each pass with a greedy window (its `keys`), beside the samples whose interval lies in
    it (weighted by overlap): the machine's busy, iowait and steal cores, the three busiest
    commands and, where sampled, the GPU's mean SM clock, power and temperature and every
    clock-event reason that was active (`clock_events`)."""
    out = []
    for r in pass_rows:
        if "t_full_start" not in r:
            continue
        a, b = r["t_full_start"], r["t_full_start"] + r["t_full_s"]
        weight, gpu_w, acc, by_comm = 0.0, 0.0, defaultdict(float), defaultdict(float)
        reasons: set[str] = set()
        for h in host_rows:
            w = max(0.0, min(b, h["t"]) - max(a, h["t"] - h["dt"]))
            if w <= 0:
                continue
            weight += w
            for k in ("busy", "iowait", "steal", "load1"):
                acc[k] += w * h[k]
            if "gpu" in h:
                gpu_w += w
                for k in gpus.CLOCK_FIELDS:
                    acc[k] += w * h["gpu"][k]
                if int(h["gpu"].get("reasons", "0"), 16):
                    reasons.add(h["gpu"]["reasons"])
            for _pid, comm, cores, _cpu in h["top"]:
                by_comm[comm] += w * cores
        if not weight:
            continue
        top = sorted(by_comm.items(), key=lambda kv: -kv[1])[:3]
        out.append({**{k: r.get(k) for k in keys},
                    "covered_s": round(weight, 2),
                    **{k: round(v / (gpu_w if k in gpus.CLOCK_FIELDS else weight), 3)
                       for k, v in acc.items()},
                    "top": ", ".join(f"{c} {v / weight:.2f}" for c, v in top),
                    **({"clock_events": ", ".join(sorted(reasons))} if gpu_w else {})})
    return out
