"""Official vLLM releases' Python sources for the overlay tests, and a runner that uses them.

The official CUDA wheels cannot be installed next to the CPU vLLM of the test environment,
but their pure-Python trees import on a CPU machine (no GPU kernel is touched at import):
``vllm_py_tree(version)`` unzips only a release's ``*.py`` under
``$SPECLAB_CACHE/vllm-py/<version>`` (default ``~/.cache/speclab``), from a wheel already in
``$SPECLAB_CACHE/wheels`` or else one downloaded for it and deleted after. ``run_probe`` runs
``overlay_probe.py`` in a subprocess with that tree first on ``PYTHONPATH`` and the
environment's torch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from speclab.vllm_matrix import Unavailable, cache_dir, cached_wheel, download

HERE = Path(__file__).resolve().parent
OVERLAY = HERE.parent / "overlay"


def vllm_py_tree(version: str) -> Path:
    """Directory holding vLLM ``version``'s ``vllm/**/*.py`` (built once, then cached). A wheel
    not already cached is downloaded into a scratch folder and deleted once unzipped: ten
    releases' wheels are ~2.7 GB, their Python trees ~0.4 GB."""
    root = cache_dir() / "vllm-py" / version
    if (root / "vllm" / "version.py").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{version}-"))
    try:
        whl = cached_wheel(version) or download(version, tmp / "wheel")
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(tmp / "tree", [n for n in zf.namelist()
                                         if n.startswith("vllm/") and n.endswith(".py")])
        (tmp / "tree").rename(root)
    except OSError:  # another process finished first
        if not (root / "vllm" / "version.py").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def run_probe(tree: Path | None, *args: str, env: dict | None = None,
              timeout: int = 900) -> dict:
    """Run ``overlay_probe.py`` against ``tree`` (None: the environment's own vLLM); its JSON
    result (raises on failure)."""
    path = [str(OVERLAY)] if tree is None else [str(tree), str(OVERLAY)]
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(path),
                "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, str(HERE / "overlay_probe.py"), *args], check=False,
                          capture_output=True, text=True, env=full_env, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise AssertionError(f"probe failed (rc={done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(lines[-1]) | {"stderr": done.stderr}


@pytest.fixture(scope="session")
def vllm022_tree() -> Path:
    """vLLM 0.22.0's Python tree (skips only when neither cached nor downloadable)."""
    try:
        return vllm_py_tree("0.22.0")
    except Unavailable as e:
        pytest.skip(str(e))
