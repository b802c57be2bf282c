"""Sweeps: expand a profile's grid into points, run each in its own worker process, keep the
results in the run store (speclab.store) one point at a time, resume by skipping finished
points whose fingerprint still matches. Throughput
comes from `timed_passes` rounds over the points (k0, k1, ..., then k0, k1, ... again), each
round a fresh worker, so that drift in the machine's speed hits every point alike.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

from pydantic import BaseModel, ConfigDict, Field

from speclab import fingerprint, runlock, store
from speclab.convention import Convention
from speclab.profiles import Layout, Profile

WORKER = "speclab.worker"  # the module a point's process runs (`python -m WORKER SPEC`)


class Point(BaseModel):
    """One engine configuration to run (a grid point or a parity arm)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    k: int
    kv_cache_dtype: str = "auto"
    draft_kv_cache_dtype: str | None = None
    layout: Layout = Layout()
    prompt_format: str = "raw"
    aux_layer_convention: Convention | None = None
    repeat: int = 0
    concurrency: int | None = Field(None, ge=1)
    env: dict[str, str] = {}
    engine: dict = {}

    @property
    def id(self) -> str:
        parts = [f"k{self.k}", f"kv-{self.kv_cache_dtype}"]
        if self.k > 0:
            parts.append(f"dkv-{self.draft_kv_cache_dtype}")
        if self.aux_layer_convention:
            parts.append(f"aux-{self.aux_layer_convention}")
        parts += [self.layout.label, self.prompt_format]
        if self.concurrency is not None:
            parts.append(f"c{self.concurrency}")
        if self.env or self.engine:
            blob = json.dumps([self.env, self.engine], sort_keys=True).encode()
            parts.append("x" + hashlib.sha1(blob).hexdigest()[:8])
        if self.repeat:
            parts.append(f"r{self.repeat}")
        return "_".join(parts)

    @property
    def logprobs(self) -> int:
        """Plain (k=0) runs return top-2 logprobs: the parity analysis reads the target's
        top-1/top-2 margin from them."""
        return 2 if self.k == 0 else 0


def expand(profile: Profile) -> list[Point]:
    """The profile's grid as points (k=0 ignores the draft KV dtype and aux-layer
    convention), repeats included."""
    g = profile.grid
    conventions = g.aux_layer_convention or [profile.aux_layer_convention]
    seen: dict[str, Point] = {}
    for lay in g.layout:
        for fmt in g.prompt_format:
            for kv in g.kv_cache_dtype:
                for k in g.num_speculative_tokens:
                    for dkv, conv in itertools.product(
                            *((g.draft_kv_cache_dtype, conventions) if k > 0 else ([None],) * 2)):
                        for r in range(profile.repeats):
                            p = Point(k=k, kv_cache_dtype=kv, draft_kv_cache_dtype=dkv,
                                      aux_layer_convention=conv, layout=lay, prompt_format=fmt,
                                      repeat=r)
                            seen.setdefault(p.id, p)
    return list(seen.values())


# --------------------------------------------------------------------- running
def run(profile: Profile, run_dir: Path, points: Iterable[Point] | None = None, *,
        retry_failed: bool = True, progress: bool = True, log=print) -> list[dict]:
    """Run every unfinished point with the profile's executor (speclab.executors: each point
    in a fresh worker process, here or on a Ray cluster); return their metadata.

    Holds the run folder's lock (runlock) throughout. A finished point (status ok) is reused
    only when its fingerprint matches; a changed or damaged one is set aside under
    superseded/ and measured again, with one line saying why. Failed points are retried
    unless retry_failed is False. A point that fails or times out is recorded with its error
    and the sweep goes on. Then timing rounds 2..timed_passes run over the profile's grid
    points in order (other points, e.g. parity arms, are timed once); on Ray each point takes
    its rounds back to back on its own node, in the task that measured it.
    Points run through the profile's executor (`speclab.executors`: local, or Ray).
    Ctrl-C stops the workers in flight and keeps everything already written. Progress: one
    line per point (status, node, duration, ETA) and the fixture builds' steps (`speclab.progress`)."""
    from speclab import executors
    from speclab import progress as prog

    if progress:
        prog.log_to_stdout()
    run_dir = Path(run_dir)
    points = list(points if points is not None else expand(profile))
    with runlock.hold(run_dir, log):
        (run_dir / "points").mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(exist_ok=True)
        prepare_models(profile, points)
        stamp = store.stamp()
        store.save_profile(profile, run_dir, stamp)
        where = executors.placement(profile)
        fps = {p.id: fingerprint.of_point(profile, p, placement=where) for p in points}
        todo = {p.id for p in points
                if store.needs_run(run_dir, p.id, fps[p.id], stamp, log, retry_failed)}
        results = {p.id: store.read_meta(run_dir, p.id) for p in points if p.id not in todo}
        if progress and results:
            log(f"{prog.PREFIX} sweep {profile.name}: {len(results)} of {len(points)} points "
                "measured earlier with these settings, kept")
        run = list({p.id: p for p in points if p.id in todo}.values())
        for meta in executors.execute(profile, run_dir, run, log=log if progress else None,
                                      fps=fps):
            if meta["status"] != "ok":
                log(f"point {meta['point_id']} failed: {meta['error']}")
            results[meta["point_id"]] = meta
        grid = {p.id for p in expand(profile)}  # extra points (parity, formats): timed once
        # Ray: each point's rounds ran in its own task, on its node (executor_ray.run_on_node)
        rounds = profile.timed_passes if profile.executor == "local" else 1
        for rnd in range(2, rounds + 1):
            due = [p for p in points if p.id in grid and results[p.id]["status"] == "ok"
                   and len(results[p.id].get("passes", [])) < rnd]
            if progress and due:
                log(f"{prog.PREFIX} sweep {profile.name}: timing round {rnd} of "
                    f"{profile.timed_passes}, {len(due)} point(s)")
            for point in due:
                results[point.id] = timing_round(profile, point, run_dir, rnd, log)
    return [results[p.id] for p in points]


def prepare_models(profile: Profile, points: list[Point]) -> None:
    """Build the profile's fixtures here, once, before any worker starts (a build can take
    minutes and must not count against a point's timeout or repeat in every worker)."""
    from speclab.profiles import resolve_model

    refs = [profile.target] + ([profile.draft] if any(p.k > 0 for p in points) else [])
    for ref in refs:
        if ref and ref.startswith("fixture:"):
            resolve_model(ref)


def _worker(profile: Profile, point: Point, spec: dict, spec_path: Path, log_path: Path
            ) -> str | None:
    """Run the worker process on spec; return None, or why it did not finish."""
    store.atomic_write(spec_path, json.dumps(spec))
    env = {**os.environ, **profile.env, **point.env, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", WORKER, str(spec_path)]
    with open(log_path, "wb") as log_f:
        proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=profile.timeout_s)
            return None if rc == 0 else f"worker exited with {rc}"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return f"timeout after {profile.timeout_s} s"
        except BaseException:
            _kill_group(proc)
            raise


def run_point(profile: Profile, point: Point, run_dir: Path, fp: dict | None = None) -> dict:
    """Run one point in a worker process (`python -m speclab.worker`) with its environment;
    its metadata carries fp (the point's fingerprint, computed here when not given)."""
    run_dir = Path(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    fp = fp or fingerprint.of_point(profile, point)
    spec = {"profile": profile.model_dump(mode="json"), "point": point.model_dump(mode="json"),
            "run_dir": str(run_dir), "fingerprint": fp, "parent_pid": os.getpid()}
    spec_path = run_dir / "logs" / f"{point.id}.spec.json"  # kept: reruns the point by hand
    log_path = run_dir / "logs" / f"{point.id}.log"
    t0 = time.time()
    error = _worker(profile, point, spec, spec_path, log_path)
    meta, problem = store.inspect_point(run_dir, point.id)
    fresh = meta is not None and meta.get("started_at", 0) >= t0 - 1
    if fresh and (error is None or meta["status"] == "error"):
        if meta["status"] == "error" and "root_cause" not in meta:
            meta["root_cause"] = root_cause(log_path)  # e.g. from vLLM's engine-core process
            store.write_point(run_dir, store.PointResult.model_validate(meta))
        return meta
    result = store.PointResult(
        point_id=point.id, status="error", point=point.model_dump(mode="json"),
        error=error or problem or "worker wrote no result",
        root_cause=root_cause(log_path), log_tail=_tail(log_path),
        wall_s=time.time() - t0, fingerprint=fp, sampling=fp["parts"]["sampling"])
    store.write_point(run_dir, result)
    return result.model_dump(exclude_unset=True)


def timing_round(profile: Profile, point: Point, run_dir: Path, rnd: int, log=print) -> dict:
    """One more timed pass of a finished point in a fresh worker (spec mode "timing"),
    appended to the point's `passes`; its throughput becomes their mean. A failed round is
    logged and kept under `pass_errors`; the point's results stay."""
    run_dir = Path(run_dir)
    meta = store.read_meta(run_dir, point.id)
    stem = run_dir / "logs" / f"{point.id}.round{rnd}"  # beside round 1's files, not over them
    out = Path(f"{stem}.json")
    out.unlink(missing_ok=True)
    spec = {"profile": profile.model_dump(mode="json"), "point": point.model_dump(mode="json"),
            "run_dir": str(run_dir), "parent_pid": os.getpid(), "mode": "timing",
            "round": rnd, "output": str(out)}
    log_path = Path(f"{stem}.log")
    error = _worker(profile, point, spec, Path(f"{stem}.spec.json"), log_path)
    try:
        passed = json.loads(out.read_text()) if error is None else None
    except (OSError, json.JSONDecodeError) as e:
        passed, error = None, f"no timing result ({e})"
    if passed is None:
        cause = root_cause(log_path)
        log(f"point {point.id}: timing round {rnd} failed: {error}" + (f" ({cause})" if cause
                                                                         else ""))
        meta.setdefault("pass_errors", []).append({"round": rnd, "error": error,
                                                    "root_cause": cause})
    else:
        meta["passes"] = [*meta.get("passes", []), passed]
        meta["throughput_tok_s"] = sum(p["tok_s"] for p in meta["passes"]) / len(meta["passes"])
    store.write_point(run_dir, store.PointResult.model_validate(meta))
    return meta


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def root_cause(log_path: Path) -> str | None:
    """The first exception line of a worker log ("ValueError: ..."): with vLLM's engine core
    in its own process, the worker's own exception only says "see root cause above"."""
    import re

    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR [^\]]*\] )?((?:\w+\.)*\w*(?:Error|Exception)"
                  r": .+)$", text, re.M)
    return m.group(1).strip() if m else None


def _tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])
