"""The dial target with an MTP module (`dial-dsv4-mtp`, speclab.fixtures.dsv4_mtp) and its
expectations (speclab.mtprig): the `mtp.0.*` tensors vLLM 0.22 / 0.26's DeepSeek-V4 MTP loader
asks for (names mapped by vLLM's own code pieces, shapes, dtypes), the MTP's draft map from
the one-layer transformers reference, counters on constructed cases with controls, the
profile and the committed expectation file."""

from __future__ import annotations

import ast
import hashlib
import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
from vllm022 import vllm_py_tree

from speclab import methods, mtprig, profiles
from speclab.fixtures import dsv4_mtp as M
from speclab.fixtures import dsv4_rigs as RG
from speclab.fixtures import dsv4_shapes as SH
from speclab.fixtures import dsv4_target as T
from speclab.fixtures import realshape

torch.set_num_threads(2)
ROOT = Path(__file__).resolve().parents[1]
# DeepSeek-V4-Flash's own mtp.0 tensors other than the routed experts (its safetensors index;
# compress ratio 1: no compressor or indexer)
V4_FLASH_MTP = {
    "attn.attn_sink", "attn.kv_norm.weight", "attn.q_norm.weight", "attn.wkv.scale",
    "attn.wkv.weight", "attn.wo_a.scale", "attn.wo_a.weight", "attn.wo_b.scale",
    "attn.wo_b.weight", "attn.wq_a.scale", "attn.wq_a.weight", "attn.wq_b.scale",
    "attn.wq_b.weight", "attn_norm.weight", "e_proj.scale", "e_proj.weight", "enorm.weight",
    "ffn.gate.bias", "ffn.gate.weight", "ffn.shared_experts.w1.scale",
    "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.scale",
    "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.scale",
    "ffn.shared_experts.w3.weight", "ffn_norm.weight", "h_proj.scale", "h_proj.weight",
    "hc_attn_base", "hc_attn_fn", "hc_attn_scale", "hc_ffn_base", "hc_ffn_fn", "hc_ffn_scale",
    "hc_head_base", "hc_head_fn", "hc_head_scale", "hnorm.weight", "norm.weight"}


def _stored(model_dir: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _names(stored: dict) -> dict:
    return {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in stored.items()}


@pytest.fixture(scope="module")
def built(module_tmp):
    d = module_tmp / "dial-dsv4-mtp"
    meta = M.build_dial_dsv4_mtp(d, seed=0)
    return d, meta, json.loads((d / "config.json").read_text()), _stored(d)


# --------------------------------------------------------------------------- layout
def test_checkpoint_has_what_vllms_mtp_loader_asks_for(built):
    _, meta, cfg, stored = built
    names = _names(stored)
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["architectures"] == [
        "DeepseekV4ForCausalLM"]
    mtp = {k: v for k, v in names.items() if k.startswith("mtp.")}
    assert mtp == {k: (tuple(s), t) for k, (s, t) in M.mtp_checkpoint_names(cfg).items()}
    # DeepSeek-V4-Flash's mtp.0 layout, plus 8 routed experts x (w1, w2, w3) x (weight, scale)
    assert {k[len("mtp.0."):] for k in mtp if ".experts." not in k} == V4_FLASH_MTP
    assert sum(".experts." in k for k in mtp) == 8 * 3 * 2
    # the MTP loader: every mtp tensor maps to a parameter and every parameter is filled
    # (the embedding and shared_head.head come from the target); the target's loader skips
    # mtp.* and still finds all of its own
    assert M.check_vllm_mtp_loadable(cfg, names) == []
    assert T.check_vllm022_loadable(cfg, names) == []
    params, shared = M.vllm_mtp_params(cfg)
    mapped = {M.vllm_mtp_mapped_name(n, cfg) for n in mtp}
    assert mapped == set(params) - shared
    assert shared == {"model.embed_tokens.weight", "model.layers.4.shared_head.head.weight"}
    assert {M.vllm_mtp_mapped_name(n, cfg) for n in names if n not in mtp} == {None}
    # dtypes: block-FP8 e4m3 with power-of-two float32 scales [N/128, K/128]
    for k in ("mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.attn.wq_a", "mtp.0.ffn.experts.7.w2"):
        w, s = stored[k + ".weight"], stored[k + ".scale"]
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.shape == (w.shape[0] // 128, w.shape[1] // 128)
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert stored["mtp.0.attn.attn_sink"].dtype == torch.float32
    assert stored["mtp.0.hc_head_fn"].shape == (4, 4 * 4096)
    assert stored["mtp.0.enorm.weight"].dtype == torch.bfloat16
    # what makes the acceptance known: h_proj and the block's output projections are 0
    for k in ("mtp.0.h_proj", "mtp.0.attn.wo_b", "mtp.0.ffn.shared_experts.w2",
              "mtp.0.ffn.experts.0.w2"):
        assert stored[k + ".weight"].float().abs().max() == 0
    # the target's tensors are the dial target's
    tnames = {k for k in names if not k.startswith("mtp.")}
    assert tnames == set(SH.checkpoint_names(SH.dsv4_config()))
    assert meta["bigram_accuracy"] == 1.0 and meta["mtp_accuracy"] == 1.0
    assert meta["mtp_min_margin"] > 20


def test_loader_check_catches_a_wrong_checkpoint(built):
    _, _, cfg, stored = built
    names = _names(stored)
    bad = dict(names)
    bad["mtp.0.bogus.weight"] = ((4096,), "bfloat16")
    assert any("bogus" in p for p in M.check_vllm_mtp_loadable(cfg, bad))
    bad = {k: v for k, v in names.items() if not k.startswith("mtp.0.e_proj")}
    assert any("e_proj" in p for p in M.check_vllm_mtp_loadable(cfg, bad))
    bad = dict(names)
    bad["mtp.0.hc_head_fn"] = ((4, 4096), "float32")
    assert any("hc_head_fn" in p for p in M.check_vllm_mtp_loadable(cfg, bad))
    assert M.check_vllm_mtp_loadable({**cfg, "num_nextn_predict_layers": 0}, names)


@pytest.mark.parametrize("version", ["0.22.0", "0.26.0"])
def test_name_mapping_against_vllm_source(built, version):
    """vLLM's own pieces of `DeepSeekV4MTP.load_weights` (its remapping table, stacked
    mapping, `_find_mtp_layer_idx`, `_rewrite_spec_layer_name`, and deepseek_v2's
    `get_spec_layer_idx_from_weight_name`), run over the checkpoint's names; plus the facts
    the fixture relies on: the target's loader skips mtp.*, the proposer shares the target's
    embedding and lm_head with an MTP model, `deepseek_v4` maps to DeepSeekV4MTPModel."""
    try:
        root = vllm_py_tree(version) / "vllm"
    except Exception as e:  # noqa: BLE001 (no cached tree and no network)
        pytest.skip(str(e))
    _, _, cfg, stored = built
    src = (root / "models/deepseek_v4/nvidia/mtp.py").read_text()
    tree = ast.parse(src)
    fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assigns = {n.targets[0].id: n.value for n in ast.walk(fns["load_weights"])
               if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)}
    assigns.update({n.target.id: n.value for n in ast.walk(fns["load_weights"])
                    if isinstance(n, ast.AnnAssign)})
    remap = ast.literal_eval(assigns["WEIGHT_NAME_REMAPPING"])
    stacked = ast.literal_eval(assigns["stacked_params_mapping"])
    assert tuple(remap.items()) == M.NAME_REMAP
    assert tuple((p, w) for p, w, _ in stacked) == M.STACKED
    ns: dict = {"re": re}
    # deepseek_v2.py (0.22) or models/utils.py, which deepseek_v2 re-exports it from (0.26)
    for f in ("deepseek_v2.py", "utils.py"):
        v2 = (root / "model_executor/models" / f).read_text()
        spec_fn = next((n for n in ast.parse(v2).body if isinstance(n, ast.FunctionDef)
                        and n.name == "get_spec_layer_idx_from_weight_name"), None)
        if spec_fn is not None:
            break
    exec(re.sub(r"config: [^,]*,", "config,", ast.get_source_segment(v2, spec_fn),  # noqa: S102
                count=1), ns)
    for fn in ("_find_mtp_layer_idx", "_rewrite_spec_layer_name"):
        node = fns[fn]
        exec(textwrap.dedent(" " * node.col_offset + ast.get_source_segment(src, node)),  # noqa: S102
             ns)

    class Conf:
        num_hidden_layers = cfg["num_hidden_layers"]
        num_nextn_predict_layers = cfg["num_nextn_predict_layers"]

    class Model:
        _rewrite_spec_layer_name = ns["_rewrite_spec_layer_name"]

    model = Model()
    L = cfg["num_hidden_layers"]
    for name in _names(stored):
        i = ns["_find_mtp_layer_idx"](name)
        key = name.replace(f"mtp.{i}.", f"model.layers.{L + i}.")
        spec = ns["get_spec_layer_idx_from_weight_name"](Conf, key)
        if spec is None:
            assert M.vllm_mtp_mapped_name(name, cfg) is None, name
            continue
        for old, new in remap.items():
            if old in key:
                key = key.replace(old, new)
        key = model._rewrite_spec_layer_name(spec, key)
        if key.endswith(".scale"):  # fp8 experts and linears alike: .weight_scale_inv
            key = key.removesuffix(".scale") + ".weight_scale_inv"
        if ".experts." in key:  # FusedMoE's expert mapping: experts.E.w{1,3}. -> w13_
            key = re.sub(r"experts\.\d+\.w[13]\.", "experts.w13_", key)
            key = re.sub(r"experts\.\d+\.w2\.", "experts.w2_", key)
        else:
            for param, weight, _ in stacked:
                if weight in key:
                    key = key.replace(weight, param)
                    break
            key = key.replace(".shared_experts.w2", ".shared_experts.down_proj")
            key = re.sub(r"\.ffn\.gate\.bias$", ".ffn.gate.e_score_correction_bias", key)
        assert key == M.vllm_mtp_mapped_name(name, cfg), name
    model_src = (root / "models/deepseek_v4/nvidia/model.py").read_text()
    assert 'AutoWeightsLoader(self, skip_substrs=["mtp."])' in model_src
    proposer = (root / "v1/spec_decode/llm_base_proposer.py").read_text()
    assert "sh.head = target_language_model.lm_head" in proposer
    assert "# MTP model\n                share_embeddings = True" in proposer
    spec_src = (root / "config/speculative.py").read_text()
    assert re.search(r'if hf_config.model_type == "deepseek_v4":\s+hf_config.model_type = '
                     r'"deepseek_mtp"\s+n_predict = getattr\(hf_config, '
                     r'"num_nextn_predict_layers", None\)', spec_src)
    assert "layer_id < config.num_hidden_layers" in (
        root / "models/deepseek_v4" / ("attention.py" if version >= "0.26" else
                                       "nvidia/model.py")).read_text()


# --------------------------------------------------------------------------- the draft map
def test_e_proj_moves_exactly_the_chosen_ids():
    g = torch.Generator().manual_seed(3)
    u = torch.randn(48, 128, generator=g, dtype=torch.float64)
    wrong = torch.zeros(48, dtype=torch.bool)
    wrong[[1, 5, 7, 40]] = True
    pi = M.mtp_input_map(48, wrong, 2)
    assert pi[5] == 7 and pi[2] == 2 and pi[40] == 42
    m = M.e_proj_matrix(u, pi)
    assert torch.allclose(u @ m.T, u[pi], atol=1e-9)
    assert torch.equal(M.e_proj_matrix(u, torch.arange(48)), torch.eye(128, dtype=torch.float64))


def test_reference_gives_the_planned_draft_map_and_a_control_fails(built):
    d, meta, cfg, stored = built
    planned = M.planned_successors(cfg["vocab_size"], 0, meta["params"])
    ref = M.mtp_successors(d)
    assert ref["successors"] == planned
    assert ref["order_independent"] and ref["min_margin"] > 20
    succ = torch.tensor(realshape.successors(d))
    wrong = M.mtp_wrong_ids(cfg["vocab_size"], 0, meta["params"]["mtp_mismatch"])
    right = torch.tensor(planned) == succ
    assert torch.equal(right, ~wrong)  # wrong exactly on D
    assert 0.15 < wrong.double().mean() < 0.25
    # control: an MTP whose e_proj is the identity drafts succ(x), so the readout no longer
    # matches the planned map on D
    ident = dict(stored)
    q, s = T.fp8_block_quantize(torch.eye(cfg["hidden_size"]))
    ident["mtp.0.e_proj.weight"], ident["mtp.0.e_proj.scale"] = q, s
    acc = M.mtp_readout(cfg, ident, torch.tensor(planned))["accuracy"]
    assert abs(acc - (1 - wrong.double().mean().item())) < 1e-9


# --------------------------------------------------------------------------- expectations
def test_counters_on_a_constructed_bigram_with_controls():
    V = 256
    succ = [(x + 1) % V for x in range(V)]
    prompts = [[10, 11, 12], [50, 60]]
    perfect = mtprig.expected_counters(succ, succ, prompts, ks=(1, 3), max_tokens=24)
    for k in ("1", "3"):
        c = perfect[k]
        assert c["accepted_per_pos"] == [c["num_drafts"]] * int(k) and c["num_drafts"] > 0
    # wrong after every even id: at k = 1 a draft after an even token fails, after an odd
    # one succeeds; the bigram alternates parity, so rounds alternate too
    half = [(x + 1) % V if x % 2 else (x + 5) % V for x in range(V)]
    c1 = mtprig.expected_counters(succ, half, [[11]], ks=(1,), max_tokens=12)["1"]
    # prefill gives 12; the draft after 12 (even) fails and the round gives 13; from 13 on
    # every draft follows an odd token: 5 rounds of 2 tokens reach 12 tokens
    assert c1["num_drafts"] == 6 and c1["accepted_per_pos"] == [5]
    c3 = mtprig.expected_counters(succ, half, [[11]], ks=(3,), max_tokens=12)["3"]
    assert c3["accepted_per_pos"][1:] == [0, 0] and c3["accepted_per_pos"][0] > 0
    # control: a shuffled draft map accepts almost nothing
    g = torch.Generator().manual_seed(0)
    shuffled = torch.tensor(succ)[torch.randperm(V, generator=g)].tolist()
    c = mtprig.expected_counters(succ, shuffled, prompts, ks=(3,), max_tokens=24)["3"]
    assert sum(c["accepted_per_pos"]) <= 1


def test_committed_expectation_is_current(built):
    """data/expected/mtp-dial-dsv4-h200.json: made from these exact weights (sha256), its
    counters recomputed from the planned maps, MTP and EAGLE-3 dialled apart; a shuffled MTP
    map would read ~0."""
    d, meta, cfg, _ = built
    exp = json.loads((ROOT / mtprig.EXPECTED_FILE).read_text())
    sha = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
    assert exp["fixtures"]["target"]["safetensors_sha256"] == sha == meta["safetensors_sha256"]
    assert exp["mtp_reference"] == {"min_margin": exp["mtp_reference"]["min_margin"],
                                    "order_independent": True, "equals_planned": True}
    assert exp["mtp_fp8_readout"]["accuracy"] == 1.0 and exp["mtp_fp8_readout"]["min_margin"] > 20
    prof = profiles.load(exp["profile"])
    from speclab import prompts

    plist = prompts.load(profiles.prompt_file(prof))
    ids = prompts.to_token_ids(plist, None, "raw")
    succ = realshape.successors(d)
    planned = M.planned_successors(cfg["vocab_size"], 0, meta["params"])
    V = cfg["vocab_size"]
    want = {"eagle3": mtprig.expected_counters(succ, [(x + 1) % V for x in range(V)], ids,
                                               (1, 3), prof.max_tokens),
            "mtp": mtprig.expected_counters(succ, planned, ids, (1, 3), prof.max_tokens)}
    assert exp["counters"] == want
    assert exp["greedy"] == [realshape.greedy(succ, p, prof.max_tokens) for p in ids]
    mtp3, ea3 = want["mtp"]["3"]["per_pos_rate"], want["eagle3"]["3"]["per_pos_rate"]
    assert mtp3[2] > ea3[2] + 0.05 and 0.7 < want["mtp"]["1"]["per_pos_rate"][0] < 0.9
    g = torch.Generator().manual_seed(1)
    shuffled = torch.tensor(planned)[torch.randperm(V, generator=g)].tolist()
    ctl = mtprig.expected_counters(succ, shuffled, ids, (1,), prof.max_tokens)["1"]
    assert ctl["per_pos_rate"][0] < 0.02
    assert RG.DIAL_TARGET_DEFAULTS["mismatch"] == meta["params"]["mismatch"]


# --------------------------------------------------------------------------- profile
def test_profile_sweeps_both_methods_on_the_mtp_target():
    prof = profiles.load("tiny-dsv4-mtp-h200")
    assert methods.profile_methods(prof) == ["eagle3", "mtp"]
    assert prof.target == "fixture:dial-dsv4-mtp" and methods.static_problem(prof) is None
    ids = [p.id for p in profiles.expand(prof)]
    assert {"k0_kv-fp8_tp1_raw", "k1_mtp_kv-fp8_tp1_raw", "k3_mtp_kv-fp8_tp1_raw",
            "k1_kv-fp8_dkv-auto_tp1_raw", "k3_kv-fp8_dkv-auto_tp1_raw"} == set(ids)
    mtp = next(p for p in profiles.expand(prof) if p.id == "k3_mtp_kv-fp8_tp1_raw")
    assert methods.speculative_config(prof, mtp, None, False) == {
        "method": "mtp", "num_speculative_tokens": 3}


# --------------------------------------------------------------------------- run check
def test_check_run_compares_counters_and_outputs_per_method(tmp_path):
    from fake_requests import requests

    from speclab import store

    expected = {"prompt_ids": ["a", "b"], "greedy": [[5, 6, 7, 8], [20, 21, 22, 23]],
                "counters": {"eagle3": {"3": {"num_drafts": 3, "accepted_per_pos": [2, 1, 0]}},
                             "mtp": {"3": {"num_drafts": 2, "accepted_per_pos": [2, 2, 1]}}}}

    def write(pid, k, method, counters, outputs=expected["greedy"]):
        records = requests([{"point_id": pid, "k": k, "prompt_id": p, "drafts": 1,
                             "accepted_per_pos": [0] * k, "output_token_ids": o}
                            for p, o in zip(expected["prompt_ids"], outputs)])
        store.write_point(tmp_path, store.PointResult(
            point_id=pid, status="ok", point={"k": k}, env={}, counters=counters,
            method=method and {"name": method}), records)

    write("k0_x", 0, None, {})
    write("k3_x", 3, "eagle3", {"num_drafts": 3, "accepted_per_pos": [2, 1, 0]})
    assert not mtprig.check_run(expected, tmp_path)["complete"]  # no mtp point yet
    write("k3_mtp_x", 3, "mtp", {"num_drafts": 2, "accepted_per_pos": [2, 2, 1]})
    ok = mtprig.check_run(expected, tmp_path)
    assert ok["exact"] and ok["complete"] and len(ok["points"]) == 3
    # the MTP point read with EAGLE-3's counters, or an output that is not the greedy one
    write("k3_mtp_x", 3, "mtp", {"num_drafts": 3, "accepted_per_pos": [2, 1, 0]})
    bad = mtprig.check_run(expected, tmp_path)
    assert not bad["exact"]
    assert next(p for p in bad["points"] if p["method"] == "mtp")["match"] == {
        "num_drafts": False, "accepted_per_pos": False}
    write("k3_mtp_x", 3, "mtp", {"num_drafts": 2, "accepted_per_pos": [2, 2, 1]},
          outputs=[[5, 6, 7, 9], [20, 21, 22, 23]])
    assert not mtprig.check_run(expected, tmp_path)["exact"]


def test_the_committed_h200_run_is_exact_for_both_methods(tmp_path):
    """The H200 run (vLLM 0.26.0) against the committed expectation, re-read from its files;
    a copy with one MTP counter off by one fails."""
    import shutil

    root = Path(__file__).resolve().parents[1]
    expected = json.loads((root / "data/expected/mtp-dial-dsv4-h200.json").read_text())
    run = root / "data/runs/h200-dsv4-mtp-20261204-vllm026"
    got = mtprig.check_run(expected, run)
    assert got["exact"] and got["complete"]
    assert {(p["method"], p["k"]) for p in got["points"]} == {
        (None, 0), ("eagle3", 1), ("eagle3", 3), ("mtp", 1), ("mtp", 3)}
    bad = shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("logs"))
    res = bad / "results/k3_mtp_kv-fp8_tp1_raw.json"
    meta = json.loads(res.read_text())
    meta["counters"]["accepted_per_pos"][2] -= 1
    res.write_text(json.dumps(meta))
    assert not mtprig.check_run(expected, bad)["exact"]
