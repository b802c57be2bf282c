"""Per-request attribution without vLLM: its own per-request counters, the step counts that
cross-check them, and stepped generation against a scripted engine."""

from types import SimpleNamespace

import pytest

from speclab import engine, metrics
from speclab.profiles import Point, Profile


class ScriptedEngine:
    """`LLMEngine.add_request`/`step` with cumulative outputs: request i gains `script[i][s]`
    tokens at its step s, finishes after its last, and then reports `spec_decode[i]` as
    vLLM's per-request counters (None: the engine has none)."""

    def __init__(self, script, spec_decode=None):
        self.script, self.spec_decode = script, spec_decode or {}
        self.live: dict[str, list[int]] = {}

    def add_request(self, rid, prompt, params):
        self.live[rid] = []

    def step(self):
        outs = []
        for rid, gained in list(self.live.items()):
            i = int(rid.split("-")[1])
            gained.append(self.script[i][len(gained)])
            finished = len(gained) == len(self.script[i])
            sd = self.spec_decode.get(i) if finished else None
            outs.append(SimpleNamespace(request_id=rid, finished=finished, outputs=[
                SimpleNamespace(token_ids=[7] * sum(gained), logprobs=None,
                                finish_reason="length" if finished else None,
                                spec_decode_metrics=sd and SimpleNamespace(
                                    to_dict=lambda sd=sd: sd))]))
            if finished:
                del self.live[rid]
        return outs


def llm(script, spec_decode=None):
    return SimpleNamespace(llm_engine=ScriptedEngine(script, spec_decode))


def test_stepped_generation_records_tokens_per_step():
    traces = engine.generate_stepwise(llm({0: [1, 4, 2], 1: [1, 1]}), [[1], [2]],
                                      SimpleNamespace())
    assert [t["step_tokens"] for t in traces] == [[1, 4, 2], [1, 1]]


def test_stepped_generation_refuses_final_only_outputs():
    """`LLM.generate` sets FINAL_ONLY on the SamplingParams it is given; stepping with them
    would see one output per request (bench --overhead did, after its first round)."""
    final_only = SimpleNamespace(output_kind=SimpleNamespace(name="FINAL_ONLY"))
    with pytest.raises(ValueError, match="FINAL_ONLY"):
        engine.generate_stepwise(llm({0: [1, 4]}), [[1]], final_only)


def test_stepped_generation_keeps_vllms_own_counters():
    sd = {"acceptance_histogram": [0, 1, 0, 0], "num_spec_steps": 1}
    traces = engine.generate_stepwise(llm({0: [1, 2], 1: [1]}, {0: sd}), [[1], [2]],
                                      SimpleNamespace())
    assert [t["spec_decode"] for t in traces] == [sd, None]


# one request at k=3: prefill, then verify steps accepting 2, 0, 3 and (last, cut at
# max_tokens to 2 of its 4 tokens) 3 drafts; vLLM's detailed metrics for it
STEPS = [1, 3, 1, 4, 2]
NATIVE = {"mean_acceptance_length": 3.0, "draft_acceptance_rate": 8 / 12,
          "acceptance_histogram": [1, 0, 1, 2], "num_spec_steps": 4,
          "num_accepted_draft_tokens": 8, "num_draft_tokens": 12, "num_spec_tokens": 3,
          "per_step_accepted": [2, 0, 3, 3], "per_step_drafted": [3, 3, 3, 3]}


def test_native_counters_from_the_histogram():
    c = metrics.native_counters(NATIVE)
    assert c == metrics.SpecCounters(4, 12, 8, (3, 3, 2))
    assert c.mean_acceptance_length == NATIVE["mean_acceptance_length"]
    assert c.acceptance_rate == NATIVE["draft_acceptance_rate"]
    # the steps see the same rounds but the last one only up to max_tokens
    assert metrics.request_counters(STEPS, 3, finished=True) == metrics.SpecCounters(
        3, 9, 5, (2, 2, 1))


def test_steps_agree_with_vllms_verify_steps_and_not_with_merged_chunks():
    per_step = NATIVE["per_step_accepted"]
    assert metrics.steps_agree(STEPS, True, per_step)
    assert metrics.steps_agree([0, 1, 3, 0, 1, 4, 2], True, per_step)  # empty steps skipped
    # controls: two verify steps in one chunk, an accepted count off by one, a cut round
    # that emitted more than vLLM accepted, an unfinished request's short last step
    assert not metrics.steps_agree([1, 3, 5, 2], True, per_step)
    assert not metrics.steps_agree([1, 3, 2, 4, 2], True, per_step)
    assert not metrics.steps_agree([1, 3, 1, 4, 5], True, per_step)
    assert not metrics.steps_agree(STEPS, False, per_step)


def test_merged_chunks_are_vllms_steps_carried_together():
    per_step = NATIVE["per_step_accepted"]  # emits 1 (prefill), 3, 1, 4, then 4 cut to 2
    assert metrics.steps_merged([1, 3, 5, 2], True, per_step)  # two verify steps, one chunk
    assert metrics.steps_merged([4, 5, 2], True, per_step)  # the prefill's token with one
    assert metrics.steps_merged([1, 3, 1, 6], True, per_step)  # into the cut last round
    assert metrics.steps_merged([9, 0, 4], True, [2, 0, 3, 3])  # three, then the last uncut
    # controls: a chunk that splits a step, one token too few or too many, a cut round in
    # an unfinished request, a step no chunk carries
    assert not metrics.steps_merged([1, 2, 2, 4, 2], True, per_step)
    assert not metrics.steps_merged([1, 3, 4, 2], True, per_step)
    assert not metrics.steps_merged([1, 3, 5, 5], True, per_step)
    assert not metrics.steps_merged([1, 3, 5, 2], False, per_step)
    assert not metrics.steps_merged([1, 3, 5], True, per_step)


def trace(steps=STEPS, native=NATIVE, finish="length"):
    return {"step_tokens": steps, "finish_reason": finish, "spec_decode": native}


def test_attribute_takes_vllms_counters_and_cross_checks_the_steps():
    eng = metrics.SpecCounters(8, 24, 16, (6, 6, 4))  # two such requests
    counters, meta = metrics.attribute(eng, [trace(), trace()], 3, "chunks")
    assert counters == [metrics.native_counters(NATIVE)] * 2
    assert meta["attribution_source"] == "native" and meta["attribution"] == "exact"
    assert meta["cross_check"] == {"path": "chunks", "requests": 2, "steps_agree": 2,
                                   "steps_merged": 0, "attribution": "consistent"}
    assert meta["counters_from_steps"]["num_drafts"] == 6
    # a chunk that carried two verify steps: vLLM's counters stay exact, the cross-check
    # names the request and the chunk count alone does not add up
    merged = trace([1, 3, 5, 2])
    _, meta = metrics.attribute(eng, [trace(), merged], 3, "chunks")
    assert meta["attribution"] == "exact"
    assert meta["cross_check"]["steps_agree"] == 1
    assert meta["cross_check"]["steps_merged"] == 1
    assert meta["cross_check"]["attribution"] == "mismatch"
    # a chunk vLLM's steps do not explain: neither agreeing nor merged
    _, meta = metrics.attribute(eng, [trace(), trace([1, 3, 4, 2])], 3, "chunks")
    assert (meta["cross_check"]["steps_agree"], meta["cross_check"]["steps_merged"]) == (1, 0)


def test_attribute_falls_back_to_the_steps_where_vllm_has_no_counters():
    eng = metrics.SpecCounters(8, 24, 16, (6, 6, 4))
    counters, meta = metrics.attribute(eng, [trace(native=None)] * 2, 3, "stepped")
    assert counters == [metrics.request_counters(STEPS, 3, finished=True)] * 2
    assert meta == {"attribution_source": "stepped", "attribution": "consistent",
                    "counters_from_steps": (counters[0] + counters[1]).to_dict()}
    # one request without vLLM's counters: all of the point's come from the steps
    _, meta = metrics.attribute(eng, [trace(), trace(native=None)], 3, "stepped")
    assert meta["attribution_source"] == "stepped"
    # plain runs: nothing to attribute
    _, meta = metrics.attribute(metrics.SpecCounters(), [trace([1, 1, 1], None)], 0, "stepped")
    assert meta["attribution"] == "exact"


def test_engine_asks_for_request_metrics_only_with_a_draft():
    prof = Profile(name="t", backend="cpu", target="/t", draft="/d", prompts={"file": "p.jsonl"})
    spec, plain = Point(k=3, draft_kv_cache_dtype="auto"), Point(k=0)
    args = engine.engine_args(prof, spec, "t", "d", request_metrics=True)[0]
    assert args["per_request_spec_decode_metrics"] == "detailed"
    assert "per_request_spec_decode_metrics" not in engine.engine_args(
        prof, plain, "t", None, request_metrics=True)[0]
    assert "per_request_spec_decode_metrics" not in engine.engine_args(prof, spec, "t", "d")[0]
    own = prof.model_copy(update={"engine": {"per_request_spec_decode_metrics": "none"}})
    assert engine.engine_args(own, spec, "t", "d", request_metrics=True)[0][
        "per_request_spec_decode_metrics"] == "none"
