"""The overlay on vLLM 0.22.0's and 0.21.0's real classes (their Python trees import on CPU;
see vllm022.py and overlay_probe.py): the interface, the forward replacement under
``@support_torch_compile``, the draft's own cache config and the DeepSeek-V4 KV layout with
a Llama EAGLE-3 draft layer, which stock vLLM rejects with the error seen on the H200."""

from __future__ import annotations

import pytest
from vllm022 import Unavailable, run_probe, vllm_py_tree

DRAFT = "model.layers.4.self_attn.attn"


@pytest.fixture(scope="module", params=["0.22.0", "0.21.0"])
def probe(request) -> dict:
    try:
        tree = vllm_py_tree(request.param)
    except Unavailable as e:
        pytest.skip(str(e))
    result = run_probe(tree)
    assert result["vllm_version"] == request.param
    return result


def test_every_patch_applies_without_warnings(probe):
    statuses = {name: p["status"] for name, p in probe["report"]["patches"].items()}
    assert statuses == dict.fromkeys(
        ["eagle3-interface", "aux-forward", "draft-cache-config", "kv-groups", "kv-tensors",
         "kv-memory-check", "kv-pool-bytes"], "applied")
    assert "DeepSeek-V4 EAGLE-3 overlay" not in probe["stderr"]


def test_supports_eagle3_interface(probe):
    it = probe["interface"]
    assert it["supports_eagle3_cls"] is True
    assert it["members"] == {"supports_eagle3": "True", "has_own_lm_head": "False",
                             "has_own_embed_tokens": "False"}
    assert it["default_aux_43"] == [2, 21, 40]  # vLLM's default for V4-Flash's 43 layers
    assert it["set_aux"] == [2, 21, 40]
    assert set(it["set_aux_errors"]) == {"(2, 2, 1)", "(0, 1, 2)", "(1, 44)", "pp2"}
    assert all("eagle_aux_hidden_state_layer_ids" in it["set_aux_errors"][k]
               for k in ("(2, 2, 1)", "(0, 1, 2)", "(1, 44)"))


def test_forward_replaced_where_torch_compile_looks(probe):
    it = probe["interface"]
    assert it["forward_is_overlay"] and it["signature_equal"]
    assert it["params"] == ["self", "input_ids", "positions", "intermediate_tensors",
                            "inputs_embeds"]
    assert it["compile_wrapper_in_mro"] and it["call_from_decorator"] == (
        "vllm.compilation.decorators")
    assert it["class_aux_layers"] == []
    assert all(it["bound"].values())


def test_stock_layout_drops_the_draft_layer(probe):
    assert probe["kv"]["stock_error"] == "Some layers are not assigned to any group."


def test_plain_deepseek_v4_layout_is_unchanged(probe):
    kv = probe["kv"]
    assert kv["plain_patched"] == kv["plain_stock"]
    assert kv["llama_unchanged"] is True


def test_draft_layer_joins_group_0_with_its_own_tensor(probe):
    kv, page = probe["kv"], probe["kv"]["draft_page"]
    plain, got = kv["plain_stock"], kv["with_draft"]
    assert got["groups"][0] == [*plain["groups"][0], DRAFT]
    assert got["groups"][1:] == plain["groups"][1:]
    assert got["eagle_groups"] == [0]
    assert set(got["one_tensor_per_layer"].values()) == {1}
    assert set(got["one_tensor_per_layer"]) == {n for g in got["groups"] for n in g}
    assert got["divisible"]
    v4_per_block = plain["tensor_bytes"] // plain["num_blocks"]
    assert got["num_blocks"] == (1 << 30) // (v4_per_block + page)
    assert got["tensors"][-1] == [page * got["num_blocks"], [DRAFT]]
    assert got["tensor_bytes"] <= 1 << 30
    mem = kv["memory"]
    assert mem["patched"] == mem["v4_only"] + mem["v4_pages"] * page
    assert mem["pool_bytes"] == mem["pool_bytes_v4"] + page == v4_per_block + page


def test_block_override_and_profiling_kv_cache(probe):
    page = probe["kv"]["draft_page"]
    for key, blocks in (("override", 2000), ("minimal_profiling", 8)):
        got = probe["kv"][key]
        assert got["num_blocks"] == blocks
        assert got["tensors"][-1] == [page * blocks, [DRAFT]]
        assert got["eagle_groups"] == [0]


def test_draft_gets_its_own_cache_config(probe):
    dc = probe["draft_cache"]
    assert dc["wrapped"]
    assert dc["dsv4"] == {"dtype": "auto", "sliding_window": 64, "block_size": 256,
                          "own_object": True, "target_dtype": "fp8_ds_mla",
                          "target_window": 128}
    assert dc["interleaved_window"] is None
    assert dc["mtp_shares"] and dc["llama_target_shares"]
    assert dc["env_fp8"] == dc["env_fp8_llama_target"] == "fp8"
    assert "EAGLE3_DRAFT_KV_CACHE_DTYPE='bogus'" in dc["bogus_error"]
