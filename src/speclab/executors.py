"""Executors: where a sweep's points run. `local` runs them one after another in worker
processes on this machine; `ray` (speclab.executor_ray) places them on a Ray cluster. Both run
a point through `launch.run_point`, and both yield each point's metadata once the driver has
written its results to the run folder."""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Iterator
from pathlib import Path

from speclab import launch
from speclab.profiles import Profile
from speclab.progress import duration

log = logging.getLogger(__name__)

KINDS = ("local", "ray")


def placement(profile: Profile) -> dict | None:
    """What a point's fingerprint records as its hardware: None for this machine's (local);
    on Ray the resource a point asks for, since the node it lands on is known only after it
    ran (the node's own hardware is in the point's `executor` and `host` metadata)."""
    if profile.executor != "ray":
        return None
    from speclab.executor_ray import resource

    return {"executor": "ray", "resource": resource(profile)}


def execute(profile: Profile, run_dir: Path, points: list,
            fps: dict[str, dict] | None = None) -> Iterator[dict]:
    """Run `points` with the profile's executor; yield each point's metadata as it finishes,
    with one progress line per point (node, duration, ETA) on the log. fps: the
    driver's fingerprint per point id, recorded as each point's (computed where it runs when
    absent)."""
    fps = fps or {}
    if profile.executor == "ray":
        from speclab import executor_ray

        finished = executor_ray.run(profile, Path(run_dir), points, fps=fps)
    else:
        finished = local(profile, Path(run_dir), points, fps)
    progress = Progress(profile.name, len(points))
    for meta in finished:
        log.info(progress.line(meta))
        yield meta


def local(profile: Profile, run_dir: Path, points: list, fps: dict[str, dict]
          ) -> Iterator[dict]:
    for point in points:
        yield launch.run_point(profile, point, run_dir, fps.get(point.id))


class Progress:
    """One line per finished point (`sweep NAME: 2/9 <id> ok on <node> in 12 s;
    ETA 1 min 10 s`): count, status, node, duration and the ETA of the rest (wall time so far
    per finished point, so points run side by side count as such). `speclab run` forwards
    these lines from the notebooks to the terminal (`progress.LineForwarder`)."""

    def __init__(self, name: str, total: int):
        self.name, self.total, self.done, self.t0 = name, total, 0, time.time()

    def line(self, meta: dict) -> str:
        self.done += 1
        left = self.total - self.done
        eta = (time.time() - self.t0) / self.done * left
        ex = meta.get("executor", {})  # absent: run here by the local executor
        parts = [f"sweep {self.name}: {self.done}/{self.total} {meta['point_id']} "
                 f"{meta['status']}",
                 f"on {ex.get('node', platform.node())}"]
        if meta.get("wall_s") is not None:
            parts.append(f"in {duration(meta['wall_s'])}")
        if meta.get("side_by_side"):
            parts.append(f"beside {', '.join(meta['side_by_side'])}")
        if ex.get("retries"):
            parts.append(f"after {len(ex['retries'])} node failure(s)")
        return " ".join(parts) + (f"; ETA {duration(eta)}" if left else "; sweep done")
