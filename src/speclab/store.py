"""The run store: the only code that reads or writes a run folder, and the schema of what it
holds.

Run folder layout (`run_dir`):
    points/<point-id>.parquet   its `RequestRecord`s, one row each (written first, atomically);
                                every file has one schema: `pd.read_parquet(run / "points")`
    results/<point-id>.json     a `PointResult` (written last: the completion mark)
    logs/<point-id>.log         the worker's stdout/stderr (timing rounds: .round<N>.log)
    logs/<point-id>.spec.json   the worker's input (`python -m speclab.worker` reruns it)
    superseded/<time>/          results set aside: measured with other settings, or damaged
    profile.json                the profile of the latest writer (an earlier, different one
                                is set aside under superseded/ first)
    .lock                       held by the one process writing into the folder (runlock)

A finished point is resumed only when its fingerprint (speclab.fingerprint) equals the one
this machine and profile give now (`needs_run`); otherwise it is set aside and measured again.
Every write goes through a temporary file in the same folder, removed when the write fails,
so a full disk leaves no half-written or hidden file behind."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, ValidationError

from speclab import fingerprint
from speclab.paths import run_folders
from speclab.profiles import Profile

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1
REQUEST_SCHEMA_VERSION = 1


class PointResult(BaseModel):
    """One point's metadata and status, `points/<point-id>.json`: every writer (worker,
    multipass, server, the sweep and the Ray executor for failures) constructs one; `read_meta`
    and `load_results` return only files that validate. Fields a writer does not set are not
    written. Version 1; a file without `schema_version` is version 1."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    point_id: str
    status: Literal["ok", "error"]
    point: dict                                  # the Point, as JSON
    profile: str | None = None                   # the profile's name
    mode: Literal["server"] | None = None        # absent: offline (speclab.worker)
    concurrency: int | None = None               # server mode: the level measured
    engine_group: str | None = None              # multipass: the engine's group ...
    pass_index: int | None = None                # ... and this pass's place in it
    defect: dict | None = None                   # multipass: the injected defect
    started_at: float | None = None
    finished_at: float | None = None
    wall_s: float | None = None
    command: str | None = None
    sampling: dict | None = None
    method: dict | None = None                   # methods.settings: the method and its settings
    models: dict | None = None                   # revisions.record: revisions asked and loaded
    fingerprint: dict | None = None              # {"digest", "parts"} (speclab.fingerprint)
    engine_args: dict | None = None
    env: dict | None = None
    vllm_version: str | None = None
    versions: dict | None = None                 # engine.versions(): software and hardware
    host: str | None = None
    aux_convention: dict | None = None
    counters: dict | None = None                 # metrics.SpecCounters.to_dict(), engine's
    counters_from_steps: dict | None = None      # the same, counted from steps or chunks
    counters_native: dict | None = None          # the same, vLLM's per-request counters
    server_counters_total: dict | None = None
    # where the requests' counters came from (absent: stepped offline, chunks in server mode)
    attribution_source: Literal["native", "stepped", "chunks"] | None = None
    attribution: str | None = None               # their sum against `counters`
    cross_check: dict | None = None              # native: what the steps or chunks say
    attribution_exact: bool | None = None        # runs before `attribution` existed
    n_requests: int | None = None                # rows of points/<point-id>.parquet
    output_tokens: int | None = None
    throughput_tok_s: float | None = None        # mean over `passes`
    passes: list[dict] | None = None             # one per timing round
    pass_errors: list[dict] | None = None
    timings: dict | None = None
    error: str | None = None
    traceback: str | None = None
    root_cause: str | None = None
    log_tail: str | None = None
    executor: dict | None = None                 # Ray: where and how it ran
    side_by_side: list[str] | None = None


class RequestRecord(BaseModel):
    """One request of a point, a row of `points/<point-id>.parquet`: every writer (worker,
    multipass, server, the Ray executor) constructs them and `requests`/`load_results` read
    them. Every parquet file has the columns of `REQUEST_ARROW` in this order. Version 1."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = REQUEST_SCHEMA_VERSION
    point_id: str
    k: int
    kv_cache_dtype: str
    draft_kv_cache_dtype: str | None = None
    layout: str                                  # Layout.label: tp1, tp2dp2, ...
    prompt_format: str
    repeat: int
    concurrency: int                             # requests in flight
    prompt_id: str
    category: str
    prompt_len: int | None = None                # prompt tokens (server: from usage)
    output_token_ids: list[int]
    n_output: int
    finish_reason: str | None = None
    step_tokens: list[int]                       # tokens emitted per engine step (or chunk)
    step_times: list[float]                      # seconds from the start, per step
    latency_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] | None = None             # server mode: gaps between chunks
    drafts: int                                  # metrics.attribute (point's source)
    draft_tokens: int
    accepted: int
    accepted_per_pos: list[int]
    logprob_pass_divergence: int | None = None   # where the logprob pass left this output
    margin: list[float | None] | None = None     # top-1 minus top-2 logprob per position
    runner_up: list[int] | None = None           # the top-2 token per position (-1: none)


_ARROW = {int: pa.int64(), float: pa.float64(), str: pa.string(),
          list[int]: pa.list_(pa.int64()), list[float]: pa.list_(pa.float64()),
          list[float | None]: pa.list_(pa.float64())}


def _arrow_type(annotation) -> pa.DataType:
    args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
    return _ARROW[args[0] if annotation not in _ARROW and args else annotation]


REQUEST_ARROW = pa.schema([(n, _arrow_type(f.annotation))
                           for n, f in RequestRecord.model_fields.items()])


def request_table(requests: Iterable[RequestRecord]) -> pa.Table:
    """Requests as an arrow table of `REQUEST_ARROW`."""
    return pa.Table.from_pylist([r.model_dump() for r in requests], schema=REQUEST_ARROW)


def read_request_file(source) -> list[RequestRecord]:
    """The requests of one parquet file (a path or a file object), validated; a file of an
    older layout (columns missing, null-typed) reads the same."""
    return [RequestRecord.model_validate(row) for row in pq.read_table(source).to_pylist()]


# --------------------------------------------------------------------- where
def default_run_id(profile_name: str) -> str:
    """The run folder `speclab run`/`sweep` measure into by default: `<profile>-local`,
    ignored by git, so a fresh clone never resumes the committed reference runs."""
    return f"{profile_name}-local"


def fresh_run_id(run_id: str) -> str:
    """A new run folder name for `--fresh`: the run id plus the UTC time."""
    return f"{run_id}-{stamp()}"


def stamp() -> str:
    """The UTC time as a superseded/ folder name."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def run_dirs(run_id: str, runs_root: Path | None = None, figures_root: Path | None = None
             ) -> tuple[Path, Path]:
    """(data/runs/<run_id>, figures/<run_id>) under `paths.output_root()` or given roots."""
    return run_folders(run_id, runs_root, figures_root)


def point_paths(run_dir: Path, point_id: str) -> tuple[Path, Path]:
    """(its requests, its PointResult) of a point."""
    run_dir = Path(run_dir)
    return run_dir / "points" / f"{point_id}.parquet", run_dir / "results" / f"{point_id}.json"


# --------------------------------------------------------------------- reading
def point_log(run_dir: Path, point_id: str) -> str:
    """The text of a point's worker log (`logs/<point-id>.log`, server mode
    `<point-id>_serve.log`); empty when it has none (points measured in a multipass group)."""
    for name in (f"{point_id}.log", f"{point_id}_serve.log"):
        if (path := Path(run_dir) / "logs" / name).exists():
            return path.read_text(errors="replace")
    return ""


def read_meta(run_dir: Path, point_id: str) -> dict | None:
    """A point's metadata; None when it has none or its file is damaged (with a warning
    naming the file)."""
    meta, problem = inspect_point(run_dir, point_id, records=False)
    if problem:
        warnings.warn(problem, stacklevel=2)
    return meta


def _read_point_json(path: Path) -> tuple[dict | None, str | None]:
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{path}: unreadable point file ({type(e).__name__}: {e})"
    missing = [k for k in ("point_id", "status") if not isinstance(meta, dict) or k not in meta]
    if missing:
        return None, f"{path}: damaged point file (no {', '.join(missing)})"
    try:
        PointResult.model_validate(meta)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"]))
        return None, f"{path}: damaged point file ({where}: {first['msg']})"
    return meta, None


def _records_problem(path: Path, meta: dict) -> str | None:
    try:
        rows = pq.read_metadata(path).num_rows
    except Exception as e:  # noqa: BLE001 - missing, truncated, not parquet: all damaged
        return f"{path}: unreadable records ({type(e).__name__}: {e})"
    if meta.get("n_requests") is not None and rows != meta["n_requests"]:
        return f"{path}: {rows} records, its point file says {meta['n_requests']}"
    return None


def inspect_point(run_dir: Path, point_id: str, records: bool = True
                  ) -> tuple[dict | None, str | None]:
    """(metadata or None, problem or None) of a point on disk. A problem names the damaged
    file: an unreadable JSON or one that is no `PointResult`, or (status ok, records=True) a
    missing or unreadable parquet."""
    rec, path = point_paths(run_dir, point_id)
    if not path.exists():
        return None, None
    meta, problem = _read_point_json(path)
    if problem is None and records and meta["status"] == "ok":
        problem = _records_problem(rec, meta)
    return (None if problem else meta), problem


class LayoutError(RuntimeError):
    """A run folder written before `results/` existed (point files inside `points/`)."""


def _point_files(run_dir: Path) -> list[Path]:
    if any((Path(run_dir) / "points").glob("[!.]*.json")):
        raise LayoutError(f"{run_dir}: point files in points/ (the layout before results/); "
                          f"`python tools/migrate_runs.py {run_dir}` moves them")
    return sorted((Path(run_dir) / "results").glob("[!.]*.json"))


def has_points(run_dir: Path) -> bool:
    """Whether a run folder holds any point file."""
    return bool(_point_files(run_dir))


def point_metas(run_dir: Path) -> list[dict]:
    """Every readable point file of a run, by name; a damaged one is named in a warning and
    left out."""
    out = []
    for meta_path in _point_files(run_dir):
        meta, problem = _read_point_json(meta_path)
        if problem:
            warnings.warn(problem + "; left out", stacklevel=2)
            continue
        out.append(meta)
    return out


def load_profile(run_dir: Path) -> Profile:
    """The profile a run was made with (saved by `save_profile`)."""
    return Profile.model_validate_json((Path(run_dir) / "profile.json").read_text())


def results_for(run_dir: Path, points: Iterable[Any]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`load_results` restricted to the given points (or point ids)."""
    ids = {p if isinstance(p, str) else p.id for p in points}
    pts, recs = load_results(run_dir)
    if len(pts):
        pts = pts[pts.point_id.isin(ids)]
    if len(recs):
        recs = recs[recs.point_id.isin(ids)]
    return pts, recs


def requests(run_dir: Path, point_id: str | None = None) -> pd.DataFrame:
    """Every request of a run's ok points (or of one point), the columns of `RequestRecord`
    and the two `load_results` takes from the point. When every point finished,
    `pd.read_parquet(run_dir / "points")` reads the same rows."""
    recs = load_results(run_dir)[1]
    return recs if point_id is None or not len(recs) else \
        recs[recs.point_id == point_id].reset_index(drop=True)


def load_results(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(points, requests) of a run: one row per point (metadata flattened) and one per request,
    with two columns taken from the request's point: `method` (methods.of; None for plain)
    and `counters_from` ("vllm" where its `attribution_source` is native: vLLM's own
    per-request counters; else "steps": counted from the step trace or chunks).

    A damaged file is named in a warning and never passes as ok: an unreadable point JSON is
    left out, an ok point whose records cannot be read gets status "damaged"."""
    from speclab import methods
    from speclab.profiles import Point

    metas, recs = [], []
    for meta in point_metas(run_dir):
        rec = point_paths(run_dir, meta["point_id"])[0]
        if meta["status"] == "ok":
            try:
                recs.append(pq.read_table(rec, schema=REQUEST_ARROW).to_pandas().assign(
                    method=methods.of(Point.model_validate(meta["point"])),
                    counters_from="vllm" if meta.get("attribution_source") == "native"
                    else "steps"))
            except Exception as e:  # noqa: BLE001 - missing, truncated, not parquet
                problem = f"{rec}: unreadable records ({type(e).__name__}: {e})"
                warnings.warn(problem + "; point marked damaged", stacklevel=2)
                meta = {**meta, "status": "damaged", "error": problem}
        metas.append(meta)
    points = pd.json_normalize(metas) if metas else pd.DataFrame()
    records = pd.concat(recs, ignore_index=True) if recs else pd.DataFrame()
    return points, records


# --------------------------------------------------------------------- writing
def _write_via_temp(*files: tuple[Path, Callable[[str], None]]) -> None:
    """For each (path, write): write(tmp) into a temporary file beside path; once all are
    written, rename them over their paths in order. A failed write (a full disk) removes
    the temporary files and leaves every path as it was."""
    temps: list[str] = []
    try:
        for path, write in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            os.close(fd)
            temps.append(tmp)
            write(tmp)
        for (path, _), tmp in zip(files, temps):
            os.replace(tmp, path)
    finally:
        for tmp in temps:
            Path(tmp).unlink(missing_ok=True)


def _bytes_writer(data: bytes | str) -> Callable[[str], None]:
    raw = data.encode() if isinstance(data, str) else data
    return lambda tmp: Path(tmp).write_bytes(raw)


def atomic_write(path: Path, data: bytes | str) -> None:
    """Replace `path` with `data` at once (readers see the old file or the new one)."""
    _write_via_temp((Path(path), _bytes_writer(data)))


def write_parquet(path: Path, frame: pd.DataFrame) -> None:
    """`atomic_write` of a table as parquet."""
    _write_via_temp((Path(path), lambda tmp: frame.to_parquet(tmp, index=False)))


def write_point(run_dir: Path, result: PointResult,
                requests: Iterable[RequestRecord] | None = None) -> dict:
    """Requests first, metadata last (a point is finished iff its JSON exists); both are
    written in full before either replaces what was there. Returns the metadata written."""
    rec_path, meta_path = point_paths(run_dir, result.point_id)
    meta = {"schema_version": result.schema_version, **result.model_dump(exclude_unset=True)}
    files = [(meta_path, _bytes_writer(json.dumps(meta, indent=1, default=str)))]
    if requests is not None:
        table = request_table(requests)
        files.insert(0, (rec_path, lambda tmp: pq.write_table(table, tmp)))
    _write_via_temp(*files)
    return meta


def migrate(run_dir: Path) -> int:
    """Bring a run folder to this layout: point files from points/ to results/, every
    points/*.parquet rewritten as `RequestRecord`s (each row validated). Returns the files
    changed; a folder already in this layout is left as it is."""
    run_dir = Path(run_dir)
    n = 0
    for meta in sorted((run_dir / "points").glob("[!.]*.json")):
        (run_dir / "results").mkdir(exist_ok=True)
        os.replace(meta, run_dir / "results" / meta.name)
        n += 1
    for rec in sorted((run_dir / "points").glob("[!.]*.parquet")):
        if pq.read_schema(rec).remove_metadata() != REQUEST_ARROW:
            table = request_table(read_request_file(rec))
            _write_via_temp((rec, lambda tmp: pq.write_table(table, tmp)))
            n += 1
    return n


def set_aside(run_dir: Path, point_id: str, when: str) -> Path:
    """Move a point's files (requests, result, logs, specs) to superseded/<when>/; return
    it."""
    run_dir = Path(run_dir)
    rec, meta = point_paths(run_dir, point_id)
    files = [f for f in [rec, meta, *(run_dir / "logs").glob(f"{point_id}.*")] if f.exists()]
    dest = _aside(run_dir, when, [f.name for f in files])
    for f in files:
        dest.mkdir(parents=True, exist_ok=True)
        os.replace(f, dest / f.name)
    return dest


def _aside(run_dir: Path, when: str, names: list[str]) -> Path:
    """superseded/<when>/, or <when>-2/, -3/... where it holds one of names already (set
    aside earlier within the same second)."""
    dest, n = Path(run_dir) / "superseded" / when, 1
    while any((dest / name).exists() for name in names):
        n += 1
        dest = Path(run_dir) / "superseded" / f"{when}-{n}"
    return dest


def save_profile(profile: Profile, run_dir: Path, when: str) -> None:
    """Write profile.json; a different one already there is first set aside under
    superseded/<when>/ (when that fails, the old one stays where it was)."""
    path = Path(run_dir) / "profile.json"
    new = profile.model_dump_json(indent=1)
    if path.exists() and path.read_text() != new:
        dest = _aside(Path(run_dir), when, ["profile.json"])
        dest.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest / "profile.json")
    atomic_write(path, new)


def resume_reason(run_dir: Path, point_id: str, fp: dict, retry_failed: bool = True
                  ) -> tuple[str, str] | None:
    """Why a sweep would measure a point (again), as (kind, detail), or None where it keeps
    the point's result; reads only. Kinds: `new` (nothing on disk), `damaged` (the file at
    fault), `changed` (measured with another fingerprint: what differs, `fingerprint.diff`),
    `failed` (its error; only when retry_failed)."""
    meta, problem = inspect_point(run_dir, point_id)
    if problem:
        return "damaged", problem
    if meta is None:
        return "new", "not measured yet"
    if (meta.get("fingerprint") or {}).get("digest") != fp["digest"]:
        return "changed", fingerprint.diff(meta.get("fingerprint"), fp)
    if meta["status"] != "ok" and retry_failed:
        return "failed", (meta.get("error") or meta["status"]).splitlines()[0]
    return None


def needs_run(run_dir: Path, point_id: str, fp: dict, when: str,
              retry_failed: bool = True) -> bool:
    """Whether a point must be measured (again) (`resume_reason`); a damaged one or one
    measured with another fingerprint is first set aside under superseded/<when>/, with one
    line on the log."""
    why = resume_reason(run_dir, point_id, fp, retry_failed)
    if why is None:
        return False
    kind, detail = why
    if kind == "damaged":
        dest = set_aside(run_dir, point_id, when)
        log.warning(f"point {point_id}: {detail}; moved to {dest}, measuring again")
    elif kind == "changed":
        dest = set_aside(run_dir, point_id, when)
        log.warning(f"point {point_id}: not measured with these settings on this machine "
                    f"({detail}); previous result moved to {dest}, measuring again")
    return True


def read_jsonl(path: Path) -> list[dict]:
    """A JSON-lines log (gpubench's passes and engines), [] when it is not there."""
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def append_jsonl(path: Path, row: dict) -> None:
    """One line more in a JSON-lines log: a line at a time, so a driver cut short leaves
    every finished pass."""
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
