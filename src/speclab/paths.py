"""Where the lab's inputs and outputs live, in a checkout and in an installed package.

Inputs (profiles/, notebooks/, data/prompts, data/corpus) come from the checkout when the
package runs from one (`pip install -e .`, PYTHONPATH=src), else from the copies the wheel
ships under `speclab/_data/`. Outputs go under `output_root()`: $SPECLAB_OUT, else the
checkout, else the current working directory (never into site-packages):
`<root>/data/runs/<run-id>/` and `<root>/figures/<run-id>/`."""

from __future__ import annotations

import os
from pathlib import Path

_SRC_ROOT = Path(__file__).resolve().parents[2]
CHECKOUT: Path | None = _SRC_ROOT if (
    (_SRC_ROOT / "pyproject.toml").exists() and (_SRC_ROOT / "notebooks").is_dir()) else None
PACKAGE_DATA = Path(__file__).resolve().parent / "_data"
# profiles/, notebooks/ and data/{prompts,corpus} of this installation
RESOURCES: Path = CHECKOUT or PACKAGE_DATA


def output_root() -> Path:
    """$SPECLAB_OUT, else the checkout, else the working directory."""
    env = os.environ.get("SPECLAB_OUT")
    return Path(env).expanduser().resolve() if env else (CHECKOUT or Path.cwd())


def check_run_id(run_id: str) -> str:
    """A run id is one folder name, or an absolute path (the run folder itself): a relative
    path (`data/runs/x`) would nest a run inside the runs folder. ValueError saying so, else
    the id."""
    if not run_id or run_id in (".", "..") or (
            not Path(run_id).is_absolute() and Path(run_id).name != run_id):
        raise ValueError(f"run id {run_id!r} is not a folder name: give the name under "
                         f"data/runs (e.g. {Path(str(run_id)).name!r}), and --out DIR for "
                         "another output root")
    return run_id


def run_folders(run_id: str, runs_root: Path | None = None, figures_root: Path | None = None
                ) -> tuple[Path, Path]:
    """(<root>/data/runs/<run_id>, <root>/figures/<run_id>), or under the given roots."""
    check_run_id(run_id)
    root = output_root()
    return ((Path(runs_root) if runs_root else root / "data" / "runs") / run_id,
            (Path(figures_root) if figures_root else root / "figures") / run_id)

