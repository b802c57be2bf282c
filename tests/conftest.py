import functools
import os
import re
import uuid
from pathlib import Path

import pytest
import yaml

from speclab import server
from speclab.profiles import REPO, Point, load

# Marks the processes this test process starts (inherited through their environment), so a
# check for leftover servers sees its own, orphans included, and not another worker's.
SESSION_MARK = os.environ["SPECLAB_TEST_PROCESS"] = uuid.uuid4().hex
# Session fixtures whose runs several test files read: under pytest-xdist those files share
# one worker, so each run is made once.
SHARED_RUNS = re.compile(r"\b(smoke_suite|served_k3|served_profile)\b")


@functools.cache
def shared_run_files() -> frozenset[str]:
    """The test files that use a SHARED_RUNS fixture (by name, in their source)."""
    return frozenset(p.name for p in Path(__file__).parent.glob("test_*.py")
                     if SHARED_RUNS.search(p.read_text()))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (`make test`): each test file on one worker (its module fixtures made
    once), and the files in shared_run_files on one worker together. pytest 9.2 ignores the
    node-id suffix behind `--dist loadgroup` (xdist 3.8 sets `item._nodeid`), hence this."""
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "shared-runs" if Path(file).name in shared_run_files() else file

    return Scheduling(config, log) if config.getvalue("dist") == "loadfile" else None


def pytest_collection_modifyitems(config, items):
    """In an xdist worker: the files in shared_run_files first (with
    `--no-loadscope-reorder`, the longest unit of work starts first)."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.path.name not in shared_run_files())


@pytest.fixture(scope="session")
def fixture_cache(tmp_path_factory) -> Path:
    """Fixture cache shared by the whole session: $SPECLAB_CACHE/fixtures, else the fixtures
    folder of a temporary cache root, one for all xdist workers (tests point SPECLAB_CACHE at
    fixture_cache.parent, so that their engines find the same builds)."""
    root = os.environ.get("SPECLAB_CACHE")
    if root:
        return Path(root) / "fixtures"
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder above the workers' (builds are locked)
    (cache := base / "speclab-cache" / "fixtures").mkdir(parents=True, exist_ok=True)
    return cache


# ------------------------------------------------------------------ one served k = 3 engine
SERVED_K3 = Point(k=3, draft_kv_cache_dtype="auto")
SERVED_LEVELS = [1, 4]


@pytest.fixture(scope="session")
def served_profile(tmp_path_factory, fixture_cache) -> Path:
    """The tiny trained pair behind `vllm serve` (grid k 0 and 3, 8 prompts x 32 tokens): the
    profile file of the server-mode tests (test_server.py, test_native_attribution.py)."""
    os.environ["SPECLAB_CACHE"] = str(fixture_cache.parent)
    p = tmp_path_factory.mktemp("serve-profile") / "serve.yaml"
    p.write_text(yaml.safe_dump({
        "name": "serve-test", "backend": "cpu", "target": "fixture:tiny-llama",
        "draft": "fixture:tiny-llama-eagle3",
        "prompts": {"file": str(REPO / "data/prompts/tiny-code.jsonl"), "limit": 8},
        "max_tokens": 32, "grid": {"num_speculative_tokens": [0, 3]},
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 512,
                   "kv_cache_memory_bytes": 128 << 20},
        "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "timeout_s": 400}))
    return p


@pytest.fixture(scope="session")
def served_k3(served_profile, tmp_path_factory) -> Path:
    """A run folder holding one `vllm serve` of SERVED_K3 measured at each of SERVED_LEVELS,
    made once per session (a server start costs ~40 s on 2 cores). The tests of served
    counters, logs and per-request records read it; only the server-mode notebook writes to
    it (it resumes these levels and adds k = 0's)."""
    run = tmp_path_factory.mktemp("served") / "serve"
    server.run_point(load(served_profile), SERVED_K3, run, SERVED_LEVELS)
    return run


# ------------------------------------------------------------------ the notebook suite, once
SMOKE = {"prompts": {"limit": 8}, "max_tokens": 32,
         "grid": {"num_speculative_tokens": [0, 1, 3]},
         "parity": {"arms": ["spec", "repeat"], "k_values": [1, 3], "spec_k": 3},
         "compare_formats": ["raw", "chat"],
         "timed_passes": 1}  # timing rounds: tests/test_trust.py, tests/test_sweep.py


@pytest.fixture(scope="session")
def smoke_suite(tmp_path_factory, fixture_cache) -> tuple[Path, Path]:
    """The notebook suite executed once per session by papermill on tiny-cpu with SMOKE
    (run "smoke"): (root holding runs/ and figures/, report path). test_notebooks.py asserts
    on its notebooks' records; test_native_attribution.py reads its eagle3 k = 3 point."""
    from speclab import report

    os.environ["SPECLAB_CACHE"] = str(fixture_cache.parent)
    root = tmp_path_factory.mktemp("suite")
    html = report.run_suite("tiny-cpu", run_id="smoke", parameters={"overrides": SMOKE},
                            runs_root=root / "runs", figures_root=root / "figures")
    return root, html
