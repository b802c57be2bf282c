"""The notebook protocol: a notebook's folders and profile from its parameters, `record(...)`
of its results (a custom MIME output, in the last cell) and `read_records` to read them back
from an executed notebook (tests, the report, the explorer)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import nbformat

from speclab import paths, profiles, store
from speclab.profiles import Profile

MIME = "application/vnd.speclab.record+json"


def folders(profile: str, run_dir: str | None, figures_dir: str | None) -> tuple[Path, Path]:
    """A notebook's run and figure folders: the given ones, else the profile's own (named
    after the profile), so a plain `papermill ... -p profile X` never writes into another
    profile's run."""
    if run_dir is None or figures_dir is None:
        d_run, d_fig = paths.run_folders(Path(run_dir).name if run_dir is not None
                                         else profiles.load(profile).name)
        run_dir = run_dir if run_dir is not None else d_run
        figures_dir = figures_dir if figures_dir is not None else d_fig
    return Path(run_dir).resolve(), Path(figures_dir).resolve()


def profile_for(run_dir: Path, profile: str, overrides: dict | None, execute: bool) -> Profile:
    """The profile a notebook works with: the named one (with overrides) when it executes,
    the run's own saved profile when it only re-renders committed results."""
    if not execute and (Path(run_dir) / "profile.json").exists():
        return store.load_profile(run_dir)
    return profiles.load(profile, overrides)


def record(**values) -> None:
    """Publish results from a notebook cell so tests and the report can read them back."""
    from IPython.display import display

    clean = _no_nan(json.loads(json.dumps(values, default=_jsonable)))
    display({MIME: clean, "text/plain": f"(recorded: {', '.join(clean)})"}, raw=True)


def _no_nan(x):
    """NaN/inf → None, so records are valid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def read_records(notebook: str | Path) -> dict:
    """Merge every `record(...)` output of an executed notebook into one dict."""
    nb = nbformat.read(str(notebook), as_version=4)
    out: dict = {}
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if MIME in o.get("data", {}):
                out.update(o["data"][MIME])
    return out
