"""Per-request attribution without vLLM: stepped generation against a scripted engine."""

from types import SimpleNamespace

import pytest

from speclab import engine


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
