import os
import shutil
import uuid
from pathlib import Path

import pytest
import yaml

from speclab import server
from speclab.profiles import REPO, Point, load

# Marks the processes this test run starts (inherited through their environment), so a check
# for leftover servers sees its own, orphans included, and not another run's on the machine.
SESSION_MARK = os.environ["SPECLAB_TEST_PROCESS"] = uuid.uuid4().hex


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory, request) -> Path:
    """A folder for one test module's builds, removed when the module ends: its checkpoints
    (hundreds of MB each) must not pile up on a shared disk across the suite."""
    path = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def fixture_cache(tmp_path_factory) -> Path:
    """Fixture cache shared by the whole session: $SPECLAB_CACHE/fixtures, else the fixtures
    folder of a temporary cache root (tests point SPECLAB_CACHE at fixture_cache.parent, so
    that their engines find the same builds)."""
    root = os.environ.get("SPECLAB_CACHE")
    if root:
        return Path(root) / "fixtures"
    (cache := tmp_path_factory.mktemp("speclab-cache") / "fixtures").mkdir()
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
    # 05_speed prices the draft at the committed tiny-cpu run's measured acceptance
    params = {"overrides": SMOKE,
              "acceptance": str(REPO / "data" / "runs" / "tiny-cpu")}
    html = report.run_suite("tiny-cpu", run_id="smoke", parameters=params,
                            runs_root=root / "runs", figures_root=root / "figures")
    return root, html
