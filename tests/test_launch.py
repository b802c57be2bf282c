"""Jobs forked from a zygote (`launch.Zygote`, the CPU backend's workers) against jobs started
with `python -m`: the same contract (own process group, the job's environment, its log, its
exit status, the timeout, no orphan), with the imports done once per environment."""

import json
import logging
import os
import time
from pathlib import Path

import pytest

from speclab import launch

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"


@pytest.fixture(autouse=True)
def job_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(SRC)]))
    monkeypatch.delenv(launch.FORK_ENV, raising=False)


def run(tmp_path: Path, name: str, env: dict, *, fork=True, timeout=60.0, module="zygote_job",
        **spec) -> tuple[str | None, dict | None, str]:
    """(run_module's error, what the job wrote, its log)."""
    out = tmp_path / f"{name}.json"
    err = launch.run_module(module, {"output": str(out), **spec}, tmp_path / f"{name}.spec.json",
                            tmp_path / f"{name}.log", env, timeout, fork=fork)
    seen = json.loads(out.read_text()) if out.exists() else None
    return err, seen, (tmp_path / f"{name}.log").read_text()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_forked_jobs_import_once_per_environment_and_run_apart(tmp_path):
    err1, a, log1 = run(tmp_path, "a1", {"ZYGOTE_TEST": "a"})
    err2, b, _ = run(tmp_path, "a2", {"ZYGOTE_TEST": "a"})
    err3, c, _ = run(tmp_path, "b1", {"ZYGOTE_TEST": "b"})
    assert (err1, err2, err3) == (None, None, None)
    assert a["pid"] != b["pid"] and a["ppid"] == b["ppid"] != os.getpid()  # one zygote
    assert a["preloaded"] is not None and a["preloaded"] == b["preloaded"]  # imported once
    assert c["ppid"] not in (a["ppid"], os.getpid()) and c["env"] == "b" and a["env"] == "a"
    for seen in (a, b, c):
        assert seen["pgid"] == seen["pid"]  # a process group of its own
    assert "job says hello" in log1
    assert f"-m zygote_job {tmp_path / 'a1.spec.json'}" in a["cmdline"]  # what `ps` shows


def test_without_fork_the_job_is_a_child_of_its_own(tmp_path, monkeypatch):
    err, seen, _ = run(tmp_path, "exec", {"ZYGOTE_TEST": "x"}, fork=False)
    assert err is None and seen["ppid"] == os.getpid() and seen["preloaded"] is None
    monkeypatch.setenv(launch.FORK_ENV, "0")
    err, seen, _ = run(tmp_path, "off", {"ZYGOTE_TEST": "x"})
    assert err is None and seen["ppid"] == os.getpid()


@pytest.mark.parametrize("fork", [True, False])
def test_a_failing_job_reports_its_exit_status_and_traceback(tmp_path, fork):
    err, _, log = run(tmp_path, "raise", {}, fork=fork, act="raise")
    assert err == "exited with 1" and "RuntimeError: asked to fail" in log
    assert launch.root_cause(tmp_path / "raise.log") == "RuntimeError: asked to fail"
    err, _, _ = run(tmp_path, "exit", {}, fork=fork, act="exit")
    assert err == "exited with 3"


@pytest.mark.parametrize("fork", [True, False])
def test_a_job_past_its_timeout_is_stopped(tmp_path, fork):
    t0 = time.monotonic()
    err, seen, _ = run(tmp_path, "sleep", {}, fork=fork, timeout=3, act="sleep")
    assert err == "timeout after 3 s" and time.monotonic() - t0 < 30
    deadline = time.monotonic() + 5
    while alive(seen["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(seen["pid"])


def test_a_zygote_that_cannot_import_leaves_the_job_to_python_m(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="speclab.launch"):
        err, _, log = run(tmp_path, "missing", {}, module="no_such_job_module")
    assert err == "exited with 1"
    assert "No module named no_such_job_module" in log  # python -m's own message
    assert any("no zygote for no_such_job_module" in r.getMessage() for r in caplog.records)


@pytest.mark.vllm
def test_a_forked_point_measures_what_python_m_measures(tmp_path, fixture_cache, monkeypatch):
    """The same tiny-cpu point (k = 3, 4 prompts x 16 tokens) in a forked worker and in one
    started with `python -m`: the same tokens per request and the same counters."""
    from speclab import profiles, store

    monkeypatch.setenv("SPECLAB_CACHE", str(fixture_cache.parent))
    prof = profiles.load("tiny-cpu", {"prompts": {"limit": 4}, "max_tokens": 16})
    point = profiles.Point(k=3, kv_cache_dtype="auto", draft_kv_cache_dtype="auto")
    launch.prepare_models(prof, [point])
    seen = {}
    for fork in ("1", "0"):
        monkeypatch.setenv(launch.FORK_ENV, fork)
        meta = launch.run_point(prof, point, tmp_path / fork)
        assert meta["status"] == "ok", meta.get("error")
        recs = store.requests(tmp_path / fork)
        seen[fork] = (meta["counters"], meta["command"],
                      {r.prompt_id: list(r.output_token_ids) for r in recs.itertuples()})
    assert seen["1"][1].startswith("speclab.worker (forked)")
    assert not seen["0"][1].startswith("speclab.worker (forked)")
    assert seen["1"][0] == seen["0"][0] and seen["1"][0]["num_accepted_tokens"] > 0
    assert seen["1"][2] == seen["0"][2] and len(seen["1"][2]) == 4
