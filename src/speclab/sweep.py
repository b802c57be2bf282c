"""Sweeps: expand a profile's grid into points, run each in its own worker process, keep the
results on disk one point at a time, resume by skipping finished points.

Run folder layout (`run_dir`):
    points/<point-id>.parquet   per-request records (written first, atomically)
    points/<point-id>.json      point metadata and status (written last: the completion mark)
    logs/<point-id>.log         the worker's stdout/stderr
    logs/<point-id>.spec.json   the worker's input (`python -m speclab.worker` reruns it)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

import pandas as pd
from pydantic import BaseModel, ConfigDict

from speclab.profiles import Layout, Profile


class Point(BaseModel):
    """One engine configuration to run (a grid point or a parity arm)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    k: int
    kv_cache_dtype: str = "auto"
    draft_kv_cache_dtype: str | None = None
    layout: Layout = Layout()
    prompt_format: str = "raw"
    repeat: int = 0
    concurrency: int | None = None
    env: dict[str, str] = {}
    engine: dict = {}

    @property
    def id(self) -> str:
        parts = [f"k{self.k}", f"kv-{self.kv_cache_dtype}"]
        if self.k > 0:
            parts.append(f"dkv-{self.draft_kv_cache_dtype}")
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
    """The profile's grid as points (k=0 ignores the draft KV dtype), repeats included."""
    g = profile.grid
    seen: dict[str, Point] = {}
    for lay in g.layout:
        for fmt in g.prompt_format:
            for kv in g.kv_cache_dtype:
                for k in g.num_speculative_tokens:
                    for dkv in (g.draft_kv_cache_dtype if k > 0 else [None]):
                        for r in range(profile.repeats):
                            p = Point(k=k, kv_cache_dtype=kv, draft_kv_cache_dtype=dkv,
                                      layout=lay, prompt_format=fmt, repeat=r)
                            seen.setdefault(p.id, p)
    return list(seen.values())


# --------------------------------------------------------------------- results on disk
def run_dirs(run_id: str, runs_root: Path | None = None, figures_root: Path | None = None
             ) -> tuple[Path, Path]:
    """(data/runs/<run_id>, figures/<run_id>) under the repository, or under given roots."""
    from speclab.profiles import REPO

    return ((runs_root or REPO / "data" / "runs") / run_id,
            (figures_root or REPO / "figures") / run_id)



def point_paths(run_dir: Path, point_id: str) -> tuple[Path, Path]:
    d = Path(run_dir) / "points"
    return d / f"{point_id}.parquet", d / f"{point_id}.json"


def read_meta(run_dir: Path, point_id: str) -> dict | None:
    _, meta = point_paths(run_dir, point_id)
    return json.loads(meta.read_text()) if meta.exists() else None


def atomic_write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def write_point(run_dir: Path, point_id: str, records: pd.DataFrame | None, meta: dict) -> None:
    """Records first, metadata last: a point is finished iff its JSON exists."""
    rec_path, meta_path = point_paths(run_dir, point_id)
    rec_path.parent.mkdir(parents=True, exist_ok=True)
    if records is not None:
        fd, tmp = tempfile.mkstemp(dir=rec_path.parent, prefix=f".{rec_path.name}.")
        os.close(fd)
        records.to_parquet(tmp, index=False)
        os.replace(tmp, rec_path)
    atomic_write(meta_path, json.dumps(meta, indent=1, default=str))


def load_profile(run_dir: Path) -> Profile:
    """The profile a run was made with (saved by `run`)."""
    return Profile.model_validate_json((Path(run_dir) / "profile.json").read_text())


def profile_for(run_dir: Path, profile: str, overrides: dict | None, execute: bool) -> Profile:
    """The profile a notebook works with: the named one (with overrides) when it executes,
    the run's own saved profile when it only re-renders committed results."""
    from speclab import profiles

    if not execute and (Path(run_dir) / "profile.json").exists():
        return load_profile(run_dir)
    return profiles.load(profile, overrides)


def results_for(run_dir: Path, points: Iterable[Point | str]
                ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`load_results` restricted to the given points (or point ids)."""
    ids = {p if isinstance(p, str) else p.id for p in points}
    pts, recs = load_results(run_dir)
    if len(pts):
        pts = pts[pts.point_id.isin(ids)]
    if len(recs):
        recs = recs[recs.point_id.isin(ids)]
    return pts, recs


def load_results(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(points, records) of a run: one row per point (metadata flattened) and one per request."""
    metas, recs = [], []
    for meta_path in sorted((Path(run_dir) / "points").glob("[!.]*.json")):
        meta = json.loads(meta_path.read_text())
        metas.append(meta)
        rec = meta_path.with_suffix(".parquet")
        if meta.get("status") == "ok" and rec.exists():
            recs.append(pd.read_parquet(rec))
    points = pd.json_normalize(metas) if metas else pd.DataFrame()
    records = pd.concat(recs, ignore_index=True) if recs else pd.DataFrame()
    return points, records


# --------------------------------------------------------------------- running
def run(profile: Profile, run_dir: Path, points: Iterable[Point] | None = None, *,
        retry_failed: bool = True, progress: bool = True, log=print) -> list[dict]:
    """Run every unfinished point, each in a fresh worker process; return their metadata.

    Finished points (status ok) are skipped; failed ones are retried unless retry_failed is
    False. A point that fails or times out is recorded with its error and the sweep goes on.
    Ctrl-C stops the worker in flight and keeps everything already written."""
    from tqdm.auto import tqdm

    run_dir = Path(run_dir)
    (run_dir / "points").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    points = list(points if points is not None else expand(profile))
    atomic_write(run_dir / "profile.json", profile.model_dump_json(indent=1))
    todo = [p for p in points if (m := read_meta(run_dir, p.id)) is None
            or (m["status"] != "ok" and retry_failed)]
    if todo:
        prepare_models(profile, todo)
    results = []
    bar = tqdm(points, desc=f"sweep {profile.name}", unit="point", disable=not progress)
    for point in bar:
        bar.set_postfix_str(point.id)
        meta = read_meta(run_dir, point.id)
        if meta and (meta["status"] == "ok" or not retry_failed):
            results.append(meta)
            continue
        meta = run_point(profile, point, run_dir)
        if meta["status"] != "ok":
            log(f"point {point.id} failed: {meta['error']}")
        results.append(meta)
    return results


def prepare_models(profile: Profile, points: list[Point]) -> None:
    """Build the profile's fixtures here, once, before any worker starts (a build can take
    minutes and must not count against a point's timeout or repeat in every worker)."""
    from speclab.profiles import resolve_model

    refs = [profile.target] + ([profile.draft] if any(p.k > 0 for p in points) else [])
    for ref in refs:
        if ref and ref.startswith("fixture:"):
            resolve_model(ref)


def run_point(profile: Profile, point: Point, run_dir: Path) -> dict:
    """Run one point in a worker process (`python -m speclab.worker`) with its environment."""
    run_dir = Path(run_dir)
    spec = {"profile": profile.model_dump(mode="json"), "point": point.model_dump(mode="json"),
            "run_dir": str(run_dir)}
    spec_path = run_dir / "logs" / f"{point.id}.spec.json"  # kept: reruns the point by hand
    atomic_write(spec_path, json.dumps(spec))
    log_path = run_dir / "logs" / f"{point.id}.log"
    env = {**os.environ, **profile.env, **point.env, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "speclab.worker", str(spec_path)]
    t0 = time.time()
    with open(log_path, "wb") as log_f:
        proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=profile.timeout_s)
            error = None if rc == 0 else f"worker exited with {rc}"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            error = f"timeout after {profile.timeout_s} s"
        except BaseException:
            _kill_group(proc)
            raise
    meta = read_meta(run_dir, point.id)
    fresh = meta is not None and meta.get("started_at", 0) >= t0 - 1
    if fresh and (error is None or meta["status"] == "error"):
        if meta["status"] == "error" and "root_cause" not in meta:
            meta["root_cause"] = root_cause(log_path)  # e.g. from vLLM's engine-core process
            write_point(run_dir, point.id, None, meta)
        return meta
    meta = {
        "point_id": point.id, "status": "error", "point": point.model_dump(mode="json"),
        "error": error or "worker wrote no result", "root_cause": root_cause(log_path),
        "log_tail": _tail(log_path), "wall_s": time.time() - t0,
    }
    write_point(run_dir, point.id, None, meta)
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
