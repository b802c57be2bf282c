"""The layer-exact DeepSeek-V4 rig (speclab.fixtures.dsv4_layer_rig, speclab.layerrig):
construction (orthogonality, hyper-connection constants, the lookup's clamp), the streams'
per-layer and per-stream signatures on the transformers reference, every arm's behaviour on a
small config (hidden 1024, vocab 128), the vLLM-facing shape of the real fixture, the run
check, and the committed expectations for the real (hidden 4096) fixture."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from fake_requests import requests

from speclab import layerrig as LR
from speclab import store
from speclab.fixtures import dsv4_layer_rig as L
from speclab.fixtures import dsv4_reference as R
from speclab.fixtures import dsv4_shapes as SH
from speclab.fixtures import dsv4_target as T

torch.set_num_threads(2)
SMALL = {"hidden_size": 1024, "vocab_size": 128, "moe_intermediate_size": 128}
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small(module_tmp):
    root = module_tmp
    L.build_layer_rig_dsv4(root / "t", seed=0, config=SMALL)
    L.build_layer_rig_dsv4_eagle3(root / "d", root / "t", seed=0)
    L.build_layer_rig_dsv4_eagle3(root / "p", root / "t", seed=0, slot_shift=1)
    return root


@pytest.fixture(scope="module")
def small_ref(small):
    return R.DSV4Reference(small / "t")


def _structure(small):
    cfg = json.loads((small / "t" / "config.json").read_text())
    return cfg, L.families(cfg, 0), L.junk_maps(cfg["vocab_size"], cfg["num_hidden_layers"], 0)


# --------------------------------------------------------------------------- construction
def test_orthonormal_rows_are_exact_and_machine_independent():
    q = L.orthonormal_rows(256, 200, 0).double()
    assert torch.equal(q @ q.T, torch.eye(200, dtype=torch.float64))
    assert torch.equal(L.orthonormal_rows(256, 200, 0), L.orthonormal_rows(256, 200, 0))
    assert not torch.equal(L.orthonormal_rows(256, 200, 1), L.orthonormal_rows(256, 200, 0))
    x = torch.randn(3, 64)
    assert torch.allclose(L.fwht(L.fwht(x)), 64 * x, atol=1e-4)
    # dense (not Walsh rows): no row is a +-1/16 pattern
    assert (q.abs() - 1 / 16).abs().max() > 0.01
    with pytest.raises(ValueError, match="power-of-two"):
        L.orthonormal_rows(96, 10, 0)


def test_families_maps_and_draft_vocab(small):
    cfg, fam, maps = _structure(small)
    V = cfg["vocab_size"]
    allrows = torch.cat([fam["E"], *fam["F"].values(), fam["D"]]).double()
    assert allrows.shape == (5 * V, cfg["hidden_size"])
    assert torch.allclose(allrows @ allrows.T, torch.eye(5 * V, dtype=torch.float64), atol=1e-6)
    vocab = L.draft_vocab(V)
    assert len(vocab) == 3 * V // 4 and vocab[: V // 4].tolist() == list(range(0, V // 2, 2))
    assert maps.shape == (V, 3, 3)
    flat = maps.view(V, -1)
    x = torch.arange(V)[:, None]
    assert (flat != x).all()
    assert all(len(set(r.tolist())) == 9 for r in flat)
    assert torch.isin(flat + 2, vocab).all()


def test_real_config_loads_in_vllm022_and_keeps_the_lookup_saturated():
    cfg = L.rig_config()
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["moe_intermediate_size"],
            cfg["n_shared_experts"]) == (4096, 512, 512, 1)
    assert T.check_vllm022_loadable(cfg, SH.checkpoint_names(cfg)) == []
    assert L.lookup_drive(cfg, 5.0, 3.0) > 5 * cfg["swiglu_limit"]
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        L.rig_config({"n_shared_experts": 2, "moe_intermediate_size": 256})


def test_draft_has_the_published_eagle31_shape(small):
    c = json.loads((small / "d" / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c["fc_norm"] is True and c["norm_output"] is True
    assert c["target_hidden_size"] == c["hidden_size"] == 1024
    assert c["draft_vocab_size"] == 96 < c["vocab_size"] == 128
    assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    from safetensors.torch import load_file

    sd = load_file(str(small / "d" / "model.safetensors"))
    assert not any("embed" in k for k in sd)
    assert {f"fc_norm.{k}.weight" for k in range(3)} <= set(sd)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert sd["lm_head.weight"].shape == (96, 1024) and sd["fc.weight"].shape == (1024, 3072)
    tid = torch.arange(96) + sd["d2t"]
    assert torch.equal(tid, L.draft_vocab(128)) and torch.equal(torch.nonzero(sd["t2d"])[:, 0],
                                                                 tid)
    # the run tokens (ids >= V/2) sit where d2t is not zero: ignoring d2t would be visible
    assert (sd["d2t"][tid >= 64] == 32).all()
    plan = LR.arm_capture(c, 4, None)
    assert (plan["convention"], plan["capture_after_layers"]) == ("output", [2, 3, 4])
    meta = lambda d: json.loads((small / d / T.FIXTURE_META).read_text())["decoded_families"]
    assert meta("d") == [2, 3, 4] and meta("p") == [3, 4, 2]


def test_hyper_connections_are_constants(small_ref):
    g = torch.Generator().manual_seed(0)
    streams = torch.randn(1, 5, 4, 1024, generator=g)
    for i, layer in enumerate(small_ref.model.model.layers):
        for hc, posted in ((layer.attn_hc, None), (layer.ffn_hc, L.post_streams(i))):
            post, comb, collapsed = hc(streams)
            want = torch.ones(4) if posted is None else torch.zeros(4).index_fill(
                0, torch.tensor(posted), 2.0)
            assert torch.allclose(post[0, 0], want, atol=1e-9)
            assert torch.allclose(comb[0, 0], torch.eye(4), atol=1e-5)
            assert torch.allclose(collapsed, 0.5 * streams.sum(2), rtol=1e-5, atol=1e-5)
    assert L.post_streams(0) == (0, 1) and all(0 not in L.post_streams(i) for i in (1, 2, 3))


def test_lookup_units_clamp(small, small_ref):
    cfg, fam, maps = _structure(small)
    limit = cfg["swiglu_limit"]
    for i, layer in enumerate(small_ref.model.model.layers):
        mlp = layer.mlp.shared_experts
        x = torch.tensor([70, 99, 120])
        h = fam["E"][x] + 3.0 * fam["F"][2][maps[x, 0, 0]]  # a stream with junk in it
        inp = layer.post_attention_layernorm(h)
        gate, up = mlp.gate_proj(inp), mlp.up_proj(inp)
        own = gate[torch.arange(3), x]
        assert (own > 2 * limit).all() and (up[torch.arange(3), x] > 2 * limit).all()
        others = gate.clone()
        others[torch.arange(3), x] = 0
        assert others.abs().max() < 1.0  # FP8 rounding only
        out = mlp(inp)
        want = L.layer_writes(fam, maps, 3.0, i)[x]
        assert L.swiglu_unit(limit) == pytest.approx(limit / (1 + math.exp(-limit)) * limit)
        assert ((out - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.05


def test_streams_carry_per_layer_and_per_stream_signatures(small, small_ref):
    _, fam, maps = _structure(small)
    prompt = L.rig_prompts(128, n=1, lengths=(6,), max_tokens=8, k=3, seed=4)[0]
    gen = small_ref.greedy(prompt, 8)
    assert gen == list(range(prompt[-1] + 1, prompt[-1] + 9))  # counts
    seq = torch.tensor(prompt + gen)
    st = small_ref.forward(seq.tolist(), streams=True)["streams"]
    coef = {"T": lambda F: F[seq], "J": lambda F, c: 3 * F[maps[seq, c - 2, 0]],
            "J'": lambda F, c: 3 * F[maps[seq, c - 2, 1]],
            "J''": lambda F, c: 3 * F[maps[seq, c - 2, 2]]}
    proj = lambda s, v: (s * v).sum(-1) / v.pow(2).sum(-1)  # FP8 write noise ~0.01 (H 1024)
    for n in range(5):
        for stream in ("mean", 0):
            s = st[n].mean(1) if stream == "mean" else st[n][:, 0]
            assert torch.allclose(proj(s, fam["E"][seq]), torch.ones(len(seq)), atol=0.05)
        for c in range(2, 5):
            F, m = fam["F"][c], st[n].mean(1)
            t, j = proj(m, coef["T"](F)), proj(m, coef["J"](F, c))
            j1, j2 = proj(m, coef["J'"](F, c)), proj(m, coef["J''"](F, c))
            want = {"0": (0, 0, 0, 0), "T": (1, 0, 0, 0), "J-J'": (0, 1, -1, 0),
                    "J''": (0, 0, 0, 1)}[L.mean_content(c, n, 4)]
            for got, w in zip((t, j, j1, j2), want):
                assert torch.allclose(got, torch.full_like(got, float(w)), atol=0.05), (n, c)
            # stream 0 never holds the right token in a family
            assert proj(st[n][:, 0], coef["T"](F)).abs().max() < 0.05


def test_every_arm_on_the_small_rig(small):
    prompts = L.rig_prompts(128, n=2, lengths=(8, 5), max_tokens=16, k=3, seed=1)
    res = LR.expected_arms(small / "t", {"layer-rig-dsv4-eagle3": small / "d",
                                         "layer-rig-dsv4-eagle3-perm": small / "p"},
                           prompts, 16)
    assert res["target"]["counting"] and res["target"]["margin_min"] > 3
    arms = res["arms"]
    pos = arms["positive"]
    assert pos["capture_after_layers"] == [2, 3, 4]
    n = pos["counters"]["num_drafts"]
    assert n > 0 and pos["counters"]["accepted_per_pos"] == [n, 0, 0]
    assert pos["draft_right_share"] == 1.0 and pos["votes"]["argmax_right_share"] == 1.0
    assert pos["votes"]["margin_min_in_noise"] > 50
    right = min(pos["votes"]["right_vote_per_slot_min"])
    assert arms["neg-input"]["capture_after_layers"] == [1, 2, 3]
    assert arms["neg-perm"]["draft"].endswith("-perm")
    for arm in ("neg-input", "neg-stream0", "neg-perm"):
        r = arms[arm]
        assert r["counters"]["accepted_per_pos"] == [0, 0, 0], arm
        assert r["draft_right_share"] == 0.0 and r["votes"]["argmax_right_share"] == 0.0
        assert max(r["votes"]["right_vote_per_slot_max_abs"]) < 0.05 * right, arm
        assert r["votes"]["margin_max_in_noise"] < -50, arm


# --------------------------------------------------------------------------- run check
def test_check_run_compares_counters_and_outputs(tmp_path):
    expected = {"k": 3, "prompts": "data/prompts/layer-rig-dsv4-ids.jsonl",
                "prompt_ids": ["layer-rig-0-len8", "layer-rig-1-len16"],
                "arms": {"positive": {"counters": {
                    "num_drafts": 4, "accepted_per_pos": [4, 0, 0],
                    "per_prompt": [{"num_drafts": 3, "accepted_per_pos": [3, 0, 0],
                                    "last_round_accepted": 1},
                                   {"num_drafts": 2, "accepted_per_pos": [1, 0, 0],
                                    "last_round_accepted": 0}]}}}}
    from speclab import prompts

    last = {p.id: p.prompt_token_ids[-1] for p in prompts.load(REPO / expected["prompts"])}
    expected["prompts"] = str(REPO / expected["prompts"])

    def write(accepted, total=4, first_out_offset=1, drafts=(1, 2), source="stepped"):
        # stepped: per request the final round is missing; native: vLLM counts it
        ids = expected["prompt_ids"][::-1]
        records = requests([{
            "point_id": "k3_x", "k": 3, "prompt_id": i, "drafts": d,
            "accepted_per_pos": [a, 0, 0], "output_token_ids": list(range(
                last[i] + first_out_offset, last[i] + first_out_offset + 4))}
            for i, d, a in zip(ids, drafts, accepted[::-1])])
        store.write_point(tmp_path, store.PointResult(
            point_id="k3_x", status="ok", point={"k": 3}, env={}, attribution_source=source,
            counters={"num_drafts": 4, "accepted_per_pos": [total, 0, 0]}), records)

    write([2, 1])
    ok = LR.check_run(expected, "positive", tmp_path)
    assert ok["exact"] and ok["outputs_counting"] and ok["per_prompt_match"]
    write([2, 0])
    assert not LR.check_run(expected, "positive", tmp_path)["per_prompt_match"]
    write([3, 1], drafts=(2, 3), source="native")
    assert LR.check_run(expected, "positive", tmp_path)["per_prompt_match"]
    write([2, 1], source="native")
    assert not LR.check_run(expected, "positive", tmp_path)["per_prompt_match"]
    write([2, 1], total=3)
    bad = LR.check_run(expected, "positive", tmp_path)
    assert not bad["exact"] and bad["match"]["accepted_per_pos"] is False
    write([2, 1], first_out_offset=2)
    assert not LR.check_run(expected, "positive", tmp_path)["outputs_counting"]


# --------------------------------------------------------------------------- committed
def test_committed_expectations_for_the_real_fixture():
    exp = json.loads((REPO / LR.EXPECTED_FILE).read_text())
    assert (exp["k"], exp["max_tokens"], exp["prompts"]) == (3, 64, LR.PROMPT_FILE)
    assert exp["target"]["counting"] and exp["target"]["margin_min"] > 5
    assert set(exp["arms"]) == set(LR.ARMS)
    pos = exp["arms"]["positive"]
    n = pos["counters"]["num_drafts"]
    assert pos["counters"]["accepted_per_pos"] == [n, 0, 0] and n == 16 * 32
    assert pos["capture_after_layers"] == [2, 3, 4]
    assert pos["votes"]["argmax_right_share"] == 1.0
    for arm in ("neg-input", "neg-stream0", "neg-perm"):
        c = exp["arms"][arm]["counters"]
        assert c["accepted_per_pos"] == [0, 0, 0] and c["num_drafts"] == 16 * 63, arm
        assert exp["arms"][arm]["votes"]["argmax_right_share"] == 0.0
    assert len(exp["prompt_ids"]) == 16


def test_committed_expectations_reproduce_for_one_prompt(fixture_cache):
    """The real fixtures, built by this code, carry the committed weights, and give the
    committed per-prompt counters for the first prompt in the arms of the main draft (the
    whole set takes the reference ~16x longer; the -perm arm is covered on the small rig)."""
    from speclab import fixtures, prompts

    exp = json.loads((REPO / LR.EXPECTED_FILE).read_text())
    first = prompts.load(REPO / exp["prompts"])[0]
    assert first.id == exp["prompt_ids"][0]
    dirs = {n: fixtures.build(n, fixture_cache) for n in ("layer-rig-dsv4",
                                                          "layer-rig-dsv4-eagle3")}
    for name, d in dirs.items():
        sha = hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest()
        assert sha == exp["fixtures"][name]["safetensors_sha256"], name
    arms = {a: spec for a, spec in LR.ARMS.items() if spec["draft"] in dirs}
    assert set(arms) == {"positive", "neg-input", "neg-stream0"}
    res = LR.expected_arms(dirs.pop("layer-rig-dsv4"), dirs, [list(first.prompt_token_ids)],
                           exp["max_tokens"], exp["k"], arms=arms)
    for arm, r in res["arms"].items():
        assert r["counters"]["per_prompt"][0] == exp["arms"][arm]["counters"]["per_prompt"][0]
        assert r["capture_after_layers"] == exp["arms"][arm]["capture_after_layers"]


def test_aux_check_separates_the_rigs_layers(small_ref):
    """speclab.auxcheck on the small rig, with the reference's own streams (bf16-rounded) as
    the engine's capture: the configured layers win by a wide margin; the other convention's
    capture and stream 0 are flagged."""
    import numpy as np

    from speclab import auxcheck

    prompt = L.rig_prompts(128, n=1, lengths=(6,), max_tokens=8, k=3, seed=5)[0]
    seq = prompt + list(range(prompt[-1] + 1, prompt[-1] + 9))
    means, s0 = auxcheck.reference_streams(small_ref, seq)
    bf16 = lambda a: torch.as_tensor(a).bfloat16().float().numpy()

    def calls(source, capture):
        aux = np.concatenate([bf16(source[c]) for c in capture], -1)
        cuts = [0, len(prompt), len(prompt) + 3, len(seq)]  # prefill, then verify steps
        return [{"positions": np.arange(a, b), "token_ids": np.asarray(seq[a:b]),
                 "aux": aux[a:b]} for a, b in itertools.pairwise(cuts)]

    right = auxcheck.summarize(auxcheck.compare_request(calls(means, [2, 3, 4]), seq, means,
                                                        s0, [2, 3, 4]))
    assert auxcheck.verdict(right)
    allp = right[right["phase"] == "all"]
    assert allp["rel_err_max"].max() < 0.01
    assert allp["margin_fewer"].min() > 30 and allp["margin_stream0"].min() > 30
    for source, capture in ((means, [1, 2, 3]), (s0, [2, 3, 4])):
        wrong = auxcheck.compare_request(calls(source, capture), seq, means, s0, [2, 3, 4])
        assert not auxcheck.verdict(auxcheck.summarize(wrong))


def test_aux_check_analysis_and_saved_rows(small):
    """The device tool's analysis on CPU: served requests whose drafter calls carry the
    reference's own hc-means (bf16) plus a rejected draft row, against a fresh reference,
    plain and FP8-simulated; the saved rows are the usable ones."""
    import numpy as np

    from speclab import auxcheck

    ref = R.DSV4Reference(small / "t")
    prompt = L.rig_prompts(128, n=1, lengths=(5,), max_tokens=6, k=3, seed=6)[0]
    output = list(range(prompt[-1] + 1, prompt[-1] + 7))
    seq = prompt + output
    means, _ = auxcheck.reference_streams(ref, seq)
    aux = torch.as_tensor(np.concatenate([means[c] for c in (2, 3, 4)], -1)).bfloat16().float()
    calls = [{"positions": np.arange(5), "token_ids": np.asarray(seq[:5]), "aux": aux[:5]},
             {"positions": np.arange(5, 8), "token_ids": np.asarray([seq[5], seq[6], 3]),
              "aux": aux[5:8]},  # the third row is a rejected draft token
             {"positions": np.arange(7, 11), "token_ids": np.asarray(seq[7:11]),
              "aux": aux[7:11]}]
    served = [{"prompt": prompt, "output": output, "calls": calls}]
    res = auxcheck.analyse(served, ref, [2, 3, 4], "small")
    assert res["plain"]["verdict"] and res["fp8-sim"]["verdict"]
    rows = {r["phase"]: r for r in res["fp8-sim"]["summary"] if r["slot"] == 1}
    assert rows["prefill"]["positions"] == 5 and rows["decode"]["positions"] == 6
    assert "small: reference fp8-sim" in res["fp8-sim"]["table"]
    npz = auxcheck.rows_npz(served)
    assert npz["r0_position"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert npz["r0_call"].tolist() == [0] * 5 + [1, 1] + [2] * 4
    assert npz["r0_aux"].dtype == np.float16 and npz["r0_aux"].shape == (11, 3 * 1024)
