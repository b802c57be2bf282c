"""`engine.open_llm`'s exits, with a stand-in for `vllm.LLM` (no engine is started)."""

import gc
import sys
import types
from types import SimpleNamespace

import pytest

from speclab import engine


class FakeLLM:
    shut_down = 0

    def __init__(self, **kwargs):
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self._stop))

    @classmethod
    def _stop(cls) -> None:
        cls.shut_down += 1


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(engine, "_defer_iri_grammar", lambda: None)
    monkeypatch.setattr(engine, "_LEFT_OPEN", [])
    monkeypatch.setattr(FakeLLM, "shut_down", 0)
    yield
    gc.unfreeze()  # open_llm froze the test process's heap


def test_what_the_body_raises_reaches_the_caller_whether_or_not_the_engine_is_left_open(
        fake_vllm):
    """An engine left open (a forked worker's) and one shut down alike let the body's error
    through (a `return` in open_llm's `finally` once swallowed it when left open); the one
    left open is kept to the end of the process, the other shut down."""
    for shutdown in (False, True):
        with pytest.raises(RuntimeError, match="raised in the body"):
            with engine.open_llm({}, shutdown=shutdown):
                raise RuntimeError("raised in the body")
    assert len(engine._LEFT_OPEN) == 1 and FakeLLM.shut_down == 1


def test_a_clean_body_leaves_open_or_shuts_down_as_asked(fake_vllm):
    with engine.open_llm({}, shutdown=False) as llm:
        assert isinstance(llm, FakeLLM)
    assert engine._LEFT_OPEN == [llm] and FakeLLM.shut_down == 0
    with engine.open_llm({}):
        pass
    assert FakeLLM.shut_down == 1
