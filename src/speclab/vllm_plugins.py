"""The project's vLLM general plugins and the dist-info that makes vLLM load them.

vLLM loads every entry point of the group `vllm.general_plugins` in each of its processes
(`vllm.plugins.load_general_plugins`: the engine core and its workers, 0.22 and 0.26
`v1/engine/core.py`, `v1/worker/worker_base.py`). `PLUGINS` are the project's: step timing
(`speclab.steptiming`, active only with `$SPECLAB_STEP_TIMING`) and the `speclab_repeat` load
format for deep real-shape targets (`speclab.fixtures.repeat_loader`). `write_dist` puts
them in a site directory (speclab itself must be importable there).
"""

from __future__ import annotations

from pathlib import Path

DIST = "speclab_vllm_plugins-1.0.dist-info"
PLUGINS = {"speclab_steptiming": "speclab.steptiming:install",
           "speclab_repeat_loader": "speclab.fixtures.repeat_loader:register"}


def write_dist(site: Path) -> Path:
    """A dist-info folder in `site` declaring `PLUGINS` as vLLM general plugins."""
    dist = Path(site) / DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: speclab-vllm-plugins\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in PLUGINS.items()))
    return dist
