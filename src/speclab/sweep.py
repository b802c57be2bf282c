"""Sweeps: run a profile's points (`profiles.expand`), each in its own worker process
(speclab.launch, through speclab.executors), keep the results in the run store
(speclab.store) one point at a time, resume by skipping finished points whose fingerprint
still matches. Throughput comes from `timed_passes` rounds over the points (k0, k1, ..., then
k0, k1, ... again), each round a fresh worker, so that drift in the machine's speed hits
every point alike.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from speclab import executors, fingerprint, launch, memory, runlock, store
from speclab.profiles import Point, Profile, expand

log = logging.getLogger(__name__)


def _rounds(profile: Profile) -> int:
    """Timing rounds the sweep runs over the grid here: the profile's `timed_passes`; on Ray
    only the measuring one, since each point's rounds run in its own task, on its node
    (executor_ray.run_on_node)."""
    return profile.timed_passes if profile.executor == "local" else 1


def preview(profile: Profile, run_dir: Path, points: Iterable[Point] | None = None, *,
            retry_failed: bool = True) -> list[dict]:
    """What `run` would do with each point, without doing it: nothing is built, measured,
    moved or locked. Per point: `id`, `action` (`keep`, or a `store.resume_reason` kind:
    new, damaged, changed, failed), `detail` and `rounds` (timing rounds it would add:
    local executor, grid points)."""
    run_dir = Path(run_dir)
    points = list({p.id: p for p in (points if points is not None else expand(profile))}
                  .values())
    where = executors.placement(profile)
    grid = {p.id for p in expand(profile)}
    rounds = _rounds(profile)
    out = []
    for p in points:
        fp = fingerprint.of_point(profile, p, placement=where)
        why = store.resume_reason(run_dir, p.id, fp, retry_failed)
        kept = None if why else store.read_meta(run_dir, p.id)
        timed = p.id in grid and (kept is None or kept["status"] == "ok")
        done = len(kept.get("passes", [])) if kept else 1  # a measurement times round 1
        out.append({"id": p.id, "action": why[0] if why else "keep",
                    "detail": why[1] if why else "", "rounds": max(0, rounds - done) if timed
                    else 0})
    return out


def run(profile: Profile, run_dir: Path, points: Iterable[Point] | None = None, *,
        retry_failed: bool = True) -> list[dict]:
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
    Ctrl-C stops the workers in flight and keeps everything already written. Progress (the
    `speclab.sweep` logger): one line per point (status, node, duration, ETA)."""
    run_dir = Path(run_dir)
    points = list(points if points is not None else expand(profile))
    with runlock.hold(run_dir):
        (run_dir / "points").mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(exist_ok=True)
        launch.prepare_models(profile, points)
        stamp = store.stamp()
        store.save_profile(profile, run_dir, stamp)
        where = executors.placement(profile)
        fps = {p.id: fingerprint.of_point(profile, p, placement=where) for p in points}
        todo = {p.id for p in points
                if store.needs_run(run_dir, p.id, fps[p.id], stamp, retry_failed)}
        results = {p.id: store.read_meta(run_dir, p.id) for p in points if p.id not in todo}
        if results:
            log.info(f"sweep {profile.name}: {len(results)} of {len(points)} points "
                     "measured earlier with these settings, kept")
        run = list({p.id: p for p in points if p.id in todo}.values())
        refused = memory.refusals(profile, run, memory.gpu_for(profile))
        for point in run:
            if point.id in refused:
                log.warning(f"point {point.id} not started: {refused[point.id]}")
                fp = fps[point.id]
                results[point.id] = store.write_point(run_dir, store.PointResult(
                    point_id=point.id, status="error", point=point.model_dump(mode="json"),
                    error=refused[point.id], fingerprint=fp,
                    sampling=fp["parts"]["sampling"]))
        run = [p for p in run if p.id not in refused]
        for meta in executors.execute(profile, run_dir, run, fps=fps):
            if meta["status"] != "ok":
                log.warning(f"point {meta['point_id']} failed: {meta['error']}")
            results[meta["point_id"]] = meta
        grid = {p.id for p in expand(profile)}  # extra points (parity, formats): timed once
        for rnd in range(2, _rounds(profile) + 1):
            due = [p for p in points if p.id in grid and results[p.id]["status"] == "ok"
                   and len(results[p.id].get("passes", [])) < rnd]
            if due:
                log.info(f"sweep {profile.name}: timing round {rnd} of "
                         f"{profile.timed_passes}, {len(due)} point(s)")
            for point in due:
                results[point.id] = launch.timing_round(profile, point, run_dir, rnd)
    return [results[p.id] for p in points]
