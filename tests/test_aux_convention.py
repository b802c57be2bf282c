"""The aux-layer id convention of an EAGLE-3 draft: resolution rule and capture layers."""

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))
aux = importlib.import_module("deepseek_v4_eagle3_aux")

# The published DeepSeek-V4-Flash EAGLE3.1 draft (config keys that matter here).
EAGLE31 = {"architectures": ["LlamaForCausalLMEagle3"],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 21, 40]}}


def test_published_config_captures_after_2_22_41():
    r = aux.resolve_aux_convention(EAGLE31, num_layers=43, env={})
    assert (r["convention"], r["source"]) == ("output", "rule")
    assert r["config_ids"] == [1, 21, 40]
    assert r["capture_after_layers"] == [2, 22, 41]


def test_first_id_2_is_input():
    r = aux.resolve_aux_convention({"eagle_aux_hidden_state_layer_ids": [2, 22, 41]}, 43, env={})
    assert r["convention"] == "input" and r["capture_after_layers"] == [2, 22, 41]


@pytest.mark.parametrize("value,expect", [("input", [1, 21, 40]), ("OUTPUT", [2, 22, 41])])
def test_env_overrides_both_ways(value, expect):
    r = aux.resolve_aux_convention(EAGLE31, 43, env={aux.CONVENTION_ENV: value})
    assert r["source"] == "env" and r["capture_after_layers"] == expect


def test_config_field_beats_rule_and_env_beats_config():
    cfg = {**EAGLE31, aux.CONVENTION_KEY: "input"}
    assert aux.resolve_aux_convention(cfg, 43, env={})["capture_after_layers"] == [1, 21, 40]
    nested = {"eagle_config": {**EAGLE31["eagle_config"], aux.CONVENTION_KEY: "input"}}
    assert aux.resolve_aux_convention(nested, 43, env={})["source"] == "config"
    r = aux.resolve_aux_convention(cfg, 43, env={aux.CONVENTION_ENV: "output"})
    assert r["capture_after_layers"] == [2, 22, 41]


def test_no_ids_means_vllm_default():
    r = aux.resolve_aux_convention({}, 43, env={})
    assert (r["convention"], r["capture_after_layers"]) == ("input", None)


def test_bad_values_fail_clearly():
    with pytest.raises(ValueError, match="not one of"):
        aux.resolve_aux_convention(EAGLE31, 43, env={aux.CONVENTION_ENV: "after"})
    with pytest.raises(ValueError, match=r"\[5\] not in 1..4"):
        aux.resolve_aux_convention({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, 4, env={})
