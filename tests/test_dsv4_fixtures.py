"""DeepSeek-V4 fixtures (tiny-dsv4, rig-dsv4(-eagle3), dial-dsv4(-eagle3), tiny-dsv4-eagle3)
and the transformers CPU reference: layout vs vLLM 0.22, FP8, determinism, RoPE choice,
aux-state math against vLLM's mHC torch reference, rig and dial expectations."""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm022 import vllm022_tree  # noqa: F401  (session fixture)

from speclab.fixtures import dsv4_reference as R
from speclab.fixtures import dsv4_rigs as RG
from speclab.fixtures import dsv4_shapes as SH
from speclab.fixtures import dsv4_target as T

torch.set_num_threads(2)
HIDDEN = SH.TINY_DSV4_CONFIG["hidden_size"]



def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stored(model_dir: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


@pytest.fixture(scope="module")
def built(module_tmp):
    root = module_tmp
    d = {k: root / k for k in ("tiny", "tiny_draft", "rig", "rig_draft", "dial0", "dial0_draft",
                               "dial1", "dial1_draft")}
    meta = {"tiny": T.build_tiny_dsv4(d["tiny"], seed=0),
            "tiny_draft": RG.build_tiny_dsv4_eagle3(d["tiny_draft"], d["tiny"], seed=0),
            "rig": RG.build_rig_dsv4(d["rig"], seed=0),
            "rig_draft": RG.build_rig_dsv4_eagle3(d["rig_draft"], d["rig"], seed=0),
            "dial0": RG.build_dial_dsv4(d["dial0"], seed=0, mismatch=0.0),
            "dial1": RG.build_dial_dsv4(d["dial1"], seed=0, mismatch=0.5)}
    meta["dial0_draft"] = RG.build_dial_dsv4_eagle3(d["dial0_draft"], d["dial0"], seed=0)
    meta["dial1_draft"] = RG.build_dial_dsv4_eagle3(d["dial1_draft"], d["dial1"], seed=0)
    return d, meta


@pytest.fixture(scope="module")
def tiny_ref(built):
    return R.DSV4Reference(built[0]["tiny"])


# --------------------------------------------------------------------------- config / layout
def test_config_satisfies_vllm022_constraints():
    cfg = SH.dsv4_config()
    assert T.check_vllm022_config(cfg) == []
    assert cfg["expert_dtype"] == "fp8"
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3",
                                          "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    # The no-op YaRN: factor 1 and a float32 cache that covers max_position_embeddings.
    rs = cfg["rope_scaling"]
    assert rs["rope_type"] == "yarn" and rs["factor"] == 1.0
    assert rs["original_max_position_embeddings"] * rs["factor"] == cfg["max_position_embeddings"]
    # What the checks catch:
    assert T.check_vllm022_config(SH.dsv4_config(rope_scaling=None))
    assert T.check_vllm022_config(SH.dsv4_config(compress_ratios=[0, 128, 128, 0]))
    assert T.check_vllm022_config(SH.dsv4_config(moe_intermediate_size=1024))


def test_mhc_small_batch_rule_matches_vllm022_kernel(vllm022_tree):  # noqa: F811
    """`check_vllm022_config`'s hidden-size rule is the column coverage of vLLM 0.22's
    small-batch mHC kernel: each of `split_k` slices of hidden/split_k columns is walked by 256
    threads for (hidden/split_k) // 256 iterations."""
    ops = (vllm022_tree / "vllm/_tilelang_ops.py").read_text()
    kernel = ops[ops.index("def mhc_fused_tilelang("):ops.index("def mhc_post_tilelang(")]
    assert "n_thr: int = 256," in kernel and "h_iters = h_per_split // n_thr" in kernel
    assert "h_idx = h_split_start + it * n_thr + tid" in kernel
    caller = (vllm022_tree / "vllm/model_executor/kernels/mhc/tilelang.py").read_text()
    assert "use_small_fma = num_tokens <= 16" in caller
    assert "n_splits = 8 if (num_tokens < 8 and hidden_size <= 4096) else 4" in caller

    def covered(hidden: int, split_k: int) -> set[int]:
        per = hidden // split_k
        return {k * per + it * 256 + t for k in range(split_k) for it in range(per // 256)
                for t in range(256)}

    def problems(hidden: int) -> list[str]:
        return [p for p in T.check_vllm022_config(SH.dsv4_config(hidden_size=hidden))
                if "mHC" in p]

    for hidden in (512, 1024, 1536, 3072, 4096, 6144):
        whole = all(covered(hidden, k) == set(range(hidden)) for k in (8, 4))
        assert bool(problems(hidden)) == (not whole), hidden
    assert not covered(512, 8)  # the old tiny config: no column at all on <= 16-token steps
    # 2048 passes the coverage rule but the fused-norm kernel returns NaN there (H200)
    assert covered(2048, 8) == set(range(2048)) and len(problems(2048)) == 1
    norm = ops[ops.index("def mhc_pre_big_fuse_with_norm_tilelang("):
               ops.index("def mhc_fused_tilelang(")]
    assert "hidden_block = math.gcd(1024, hidden_size)" in norm
    assert "T.Pipelined(hidden_size // hidden_block, num_stages=3)" in norm


def test_checkpoint_layout_matches_vllm022_params(built):
    d, meta = built
    cfg = json.loads((d["tiny"] / "config.json").read_text())
    stored = _stored(d["tiny"])
    names = {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in stored.items()}
    assert names == {k: (tuple(s), t) for k, (s, t) in SH.checkpoint_names(cfg).items()}
    assert len(names) == 340 == meta["tiny"]["n_tensors"]
    # Every mapped name is a vLLM 0.22 model parameter and every parameter is covered,
    # with stacked / expert shapes adding up (the device's 143 parameters).
    assert T.check_vllm022_loadable(cfg, names) == []
    mapped = {T.vllm022_mapped_name(n) for n in names}
    assert mapped == set(T.vllm022_model_params(cfg)) and len(mapped) == 143
    # A wrong name or shape is caught.
    bad = dict(names)
    bad["layers.0.attn.wq_x.weight"] = bad.pop("layers.0.attn.wq_a.weight")
    assert T.check_vllm022_loadable(cfg, bad)
    bad = dict(names)
    bad["layers.1.ffn.experts.3.w2.weight"] = ((512, 128), "float8_e4m3fn")
    assert T.check_vllm022_loadable(cfg, bad)
    # Original DeepSeek names, FP8 weights with power-of-two float32 block scales.
    for k, v in stored.items():
        if v.dtype == torch.float8_e4m3fn:
            s = stored[k[: -len(".weight")] + ".scale"]
            assert s.dtype == torch.float32
            assert s.shape == (v.shape[0] // 128, v.shape[1] // 128)
            assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    for k in ("embed.weight", "head.weight", "hc_head_fn", "layers.0.ffn.gate.tid2eid",
              "layers.1.ffn.gate.bias", "layers.1.attn.compressor.ape",
              "layers.1.attn.indexer.compressor.wkv.weight",
              "layers.2.attn.compressor.wgate.weight",
              "layers.3.ffn.shared_experts.w2.scale", "layers.0.attn.attn_sink"):
        assert k in stored
    assert stored["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert "layers.0.attn.compressor.ape" not in stored  # layer 0 is sliding-window only


def test_name_mapping_against_vllm022_source(built, vllm022_tree):  # noqa: F811
    """Run vLLM 0.22's own `_make_deepseek_v4_weights_mapper` and `load_weights` stacked
    mapping (extracted from its source) over the checkpoint names."""
    v22 = vllm022_tree / "vllm"
    src = (v22 / "models/deepseek_v4/nvidia/model.py").read_text()
    tree = ast.parse(src)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef)
              and n.name == "_make_deepseek_v4_weights_mapper")
    utils_src = (v22 / "model_executor/models/utils.py").read_text()
    wm = next(n for n in ast.parse(utils_src).body
              if isinstance(n, ast.ClassDef) and n.name == "WeightsMapper")
    ns: dict = {"re": re}
    code = ("from dataclasses import dataclass, field\nfrom typing import Any\n"
            "from collections.abc import Iterable, Mapping\nimport torch\n"
            "@dataclass\n" + ast.get_source_segment(utils_src, wm))
    exec(code, ns)  # noqa: S102
    exec(ast.get_source_segment(src, fn), ns)  # noqa: S102
    mapper = ns["_make_deepseek_v4_weights_mapper"]("fp8")
    load = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                and n.name == "load_weights" and "stacked_params_mapping" in
                ast.get_source_segment(src, n))
    stacked_node = next(n for n in ast.walk(load) if isinstance(n, ast.Assign)
                        and getattr(n.targets[0], "id", "") == "stacked_params_mapping")
    stacked = ast.literal_eval(stacked_node.value)
    cfg = SH.dsv4_config()
    for name in SH.checkpoint_names(cfg):
        key = mapper._map_name(name)
        if ".experts." not in key:
            for param, weight, _ in stacked:
                if weight in key:
                    key = key.replace(weight, param)
                    break
        else:  # FusedMoE.make_expert_params_mapping: experts.E.w{1,3}. -> experts.w13_
            key = re.sub(r"experts\.\d+\.w[13]\.", "experts.w13_", key)
            key = re.sub(r"experts\.\d+\.w2\.", "experts.w2_", key)
        assert key == T.vllm022_mapped_name(name), name


def test_fp8_block_roundtrip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * 0.03
    w[:128, :128] = 0.0  # an all-zero block
    w[128:, 256:] *= 1000.0  # a block with a much larger range
    q, s = T.fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3) and s.dtype == torch.float32
    assert s[0, 0] == 1.0
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # UE8M0-representable
    deq = T.fp8_block_dequantize(q, s)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normal values; nothing clips.
    blockmax = (w.abs().reshape(2, 128, 3, 128).amax((1, 3)))
    nz = blockmax > 0
    assert ((blockmax / s)[nz] <= 448).all() and ((blockmax / s)[nz] > 224).all()
    big = w.abs() > s.repeat_interleave(128, 0).repeat_interleave(128, 1) * 2 ** -6
    assert ((deq - w).abs() <= w.abs() * 2 ** -4 + 1e-12)[big].all()
    assert torch.equal(deq[:128, :128], torch.zeros(128, 128))
    # Dequantized values re-quantize to the same bytes (the stored values are exact).
    q2, s2 = T.fp8_block_quantize(deq)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    with pytest.raises(ValueError):
        T.fp8_block_quantize(torch.zeros(100, 128))


def test_deterministic_from_seed(built, tmp_path):
    d, meta = built
    again = T.build_tiny_dsv4(tmp_path / "again", seed=0)
    assert again["safetensors_sha256"] == meta["tiny"]["safetensors_sha256"]
    assert _sha(tmp_path / "again" / "config.json") == _sha(d["tiny"] / "config.json")
    cfg = SH.dsv4_config()
    a = T.init_dsv4_weights(cfg, 0, T.DSV4Init())
    b = T.init_dsv4_weights(cfg, 1, T.DSV4Init())
    assert not torch.equal(a["embed.weight"], b["embed.weight"])
    assert not torch.equal(a["layers.3.ffn.experts.7.w2"], b["layers.3.ffn.experts.7.w2"])
    assert not torch.equal(a["head.weight"], b["head.weight"])
    assert (d["tiny"] / T.FIXTURE_META).is_file()
    assert not (d["tiny"] / "speclab_fixture.json").exists()  # the registry's cache owns it


# --------------------------------------------------------------------------- RoPE choice
def _v22_deepseek_yarn_inv_freq(rotary_dim, base, factor, orig_max, beta_fast=32, beta_slow=1):
    """vLLM 0.22 DeepseekScalingRotaryEmbedding._compute_inv_freq
    (rotary_embedding/deepseek_scaling_rope.py:79-105, helpers from rotary_embedding/common.py)."""
    def corr_dim(num_rot):
        return (rotary_dim * math.log(orig_max / (num_rot * 2 * math.pi))) / (2 * math.log(base))
    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    mask = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask


def test_rope_is_plain_in_both_vllm022_and_transformers(tiny_ref):
    cfg = tiny_ref.cfg
    rd = cfg["qk_rope_head_dim"]
    plain = lambda theta: 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd)
    rs = cfg["rope_scaling"]
    # vLLM 0.22: every layer goes through deepseek_yarn with rope_scaling; SWA layers use
    # rope_theta, compressed layers compress_rope_theta (nvidia/model.py:753-772).
    for theta in (cfg["rope_theta"], cfg["compress_rope_theta"]):
        v = _v22_deepseek_yarn_inv_freq(rd, theta, rs["factor"],
                                        rs["original_max_position_embeddings"])
        assert torch.allclose(v, plain(theta), rtol=1e-6, atol=0)
    # ... whereas the probe's factor 16 would have put YaRN on the SWA layer as well:
    v16 = _v22_deepseek_yarn_inv_freq(rd, cfg["rope_theta"], 16, 256)
    assert not torch.allclose(v16, plain(cfg["rope_theta"]), rtol=1e-3)
    # transformers: "main" (SWA) = plain rope_theta; "compress" = factor-1 YaRN with
    # attention_factor 1 = plain compress_rope_theta.
    rot = tiny_ref.model.model.rotary_emb
    assert rot.rope_type == {"main": "default", "compress": "yarn"}
    assert torch.allclose(rot.main_inv_freq, plain(cfg["rope_theta"]), rtol=1e-6, atol=0)
    assert torch.allclose(rot.compress_inv_freq, plain(cfg["compress_rope_theta"]), rtol=1e-6,
                          atol=0)
    assert rot.main_attention_scaling == 1.0 and rot.compress_attention_scaling == 1.0
    layers = tiny_ref.model.model.layers
    assert [lay.self_attn.rope_layer_type for lay in layers] == ["main", "compress", "compress",
                                                                 "compress"]


# --------------------------------------------------------------------------- reference
def test_reference_matches_transformers_own_conversion(built, tmp_path):
    """transformers' conversion_mapping (original names -> HF names, expert stacking) loads the
    dequantized checkpoint to exactly our state dict."""
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    cfg, tensors = R.load_checkpoint(built[0]["rig"])
    dense = R.dequantize_tensors(tensors)
    save_file({k: v.contiguous() for k, v in dense.items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(
        {k: v for k, v in cfg.items() if k != "quantization_config"}))
    hf = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    ours = R.build_reference_model(cfg, tensors).state_dict()
    assert set(hf) == set(ours)
    assert all(torch.equal(hf[k].float(), ours[k].float()) for k in hf)
    # The FP8 weights were dequantized exactly (value * power-of-two scale).
    q, s = tensors["layers.2.attn.wq_b.weight"], tensors["layers.2.attn.wq_b.scale"]
    w = ours["model.layers.2.self_attn.q_b_proj.weight"]
    assert torch.equal(w[:128, :128], q[:128, :128].float() * s[0, 0])


def test_tiny_dsv4_logits_have_margins(tiny_ref):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 2048, (40,), generator=g).tolist()
    logits = tiny_ref.forward(ids)["logits"]
    assert torch.isfinite(logits).all()
    m = R.logit_margins(logits)
    # bf16 noise on these logits is ~0.03 and the FP8-activation estimate ~0.15 (report).
    assert m.min() > 1.0 and m.median() > 4.0
    # The layers matter for the logit values (not a pure bigram readout).
    mm = tiny_ref.model.model
    with torch.no_grad():
        e = mm.embed_tokens(torch.tensor(ids))
        bigram = tiny_ref.model.lm_head(mm.norm(mm.hc_head(
            e[:, None, :].expand(-1, 4, -1)[None])))[0]
    assert (logits - bigram).std() > 0.3


def test_cached_greedy_equals_recompute(tiny_ref):
    prompt = [5, 900, 17, 1200, 33, 64]
    a = tiny_ref.greedy(prompt, 5)
    b = tiny_ref.greedy(prompt, 5, recompute=True)
    assert a == b
    logits = tiny_ref.forward(prompt + a)["logits"]
    assert torch.argmax(logits[len(prompt) - 1:-1], -1).tolist() == a


def _mhc_pre_torch(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                   hc_post_mult_value, sinkhorn_repeat):
    """vLLM 0.22 `mhc_pre_torch` (model_executor/kernels/mhc/torch.py:6-91), float32."""
    hc_mult, hidden = residual.shape[-2:]
    x = residual.reshape(-1, hc_mult * hidden).float()
    mixes = torch.matmul(x, fn.t())
    mixes = mixes * torch.rsqrt(x.square().sum(-1, keepdim=True) / (hc_mult * hidden) + rms_eps)
    pre = torch.sigmoid(mixes[:, :hc_mult] * hc_scale[0] + hc_base[:hc_mult]) + hc_pre_eps
    post = torch.sigmoid(mixes[:, hc_mult:2 * hc_mult] * hc_scale[1]
                         + hc_base[hc_mult:2 * hc_mult]) * hc_post_mult_value
    comb = mixes[:, 2 * hc_mult:].view(-1, hc_mult, hc_mult) * hc_scale[2] + \
        hc_base[2 * hc_mult:].view(1, hc_mult, hc_mult)
    comb = torch.softmax(comb, dim=-1) + hc_sinkhorn_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
    for _ in range(sinkhorn_repeat - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_sinkhorn_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_sinkhorn_eps)
    layer_input = (pre.unsqueeze(-1) * residual.reshape(-1, hc_mult, hidden)).sum(1)
    return post.view(-1, hc_mult, 1), comb, layer_input


def _mhc_post_torch(x, residual, post, comb):
    """vLLM 0.22 `mhc_post_torch` (kernels/mhc/torch.py:94-106): out_j = post_j x + sum_i
    comb_ij residual_i."""
    return torch.einsum("...ij,...ih->...jh", comb, residual) + post * x.unsqueeze(-2)


def test_aux_states_follow_vllm_mhc_semantics(tiny_ref):
    """Rebuild every layer's output stream the way vLLM does (mhc_pre -> block -> deferred
    mhc_post, v0.22 `_forward_cuda` + the aux `mhc_post` of v0.33 / the overlay) from the
    blocks' outputs, and compare with the reference's streams and aux states."""
    cfg = tiny_ref.cfg
    ids = [7, 300, 1999, 45, 46, 1024, 3, 88, 512, 640, 11, 12]
    grabbed: dict = {}
    hooks = []
    for i, lay in enumerate(tiny_ref.model.model.layers):
        hooks.append(lay.self_attn.register_forward_hook(
            lambda m, a, o, i=i: grabbed.__setitem__(("attn", i), o[0][0])))
        hooks.append(lay.mlp.register_forward_hook(
            lambda m, a, o, i=i: grabbed.__setitem__(("ffn", i), o[0])))
        hooks.append(lay.input_layernorm.register_forward_hook(
            lambda m, a, o, i=i: grabbed.__setitem__(("attn_in", i), a[0][0])))
    try:
        f = tiny_ref.forward(ids, streams=True)
    finally:
        for h in hooks:
            h.remove()
    streams = f["streams"]
    kw = {"rms_eps": cfg["rms_norm_eps"], "hc_pre_eps": cfg["hc_eps"],
              "hc_sinkhorn_eps": cfg["hc_eps"], "hc_post_mult_value": 2.0,
              "sinkhorn_repeat": cfg["hc_sinkhorn_iters"]}
    res = streams[0]
    for i, lay in enumerate(tiny_ref.model.model.layers):
        post, comb, x_in = _mhc_pre_torch(res, lay.attn_hc.fn, lay.attn_hc.scale,
                                          lay.attn_hc.base, **kw)
        assert torch.allclose(x_in, grabbed[("attn_in", i)], atol=1e-4, rtol=1e-4)
        mid = _mhc_post_torch(grabbed[("attn", i)], res, post, comb)
        post, comb, _ = _mhc_pre_torch(mid, lay.ffn_hc.fn, lay.ffn_hc.scale, lay.ffn_hc.base,
                                       **kw)
        res = _mhc_post_torch(grabbed[("ffn", i)], mid, post, comb)
        assert torch.allclose(res, streams[i + 1], atol=1e-4, rtol=1e-4)
    # The last stream is what hc_head reduces: it reproduces the logits.
    mm = tiny_ref.model.model
    with torch.no_grad():
        logits = tiny_ref.model.lm_head(mm.norm(mm.hc_head(streams[4][None])))[0]
    assert torch.allclose(logits, f["logits"], atol=1e-4)
    aux = R.DSV4Reference.aux_from_streams(streams, [1, 2, 3])
    assert aux.shape == (len(ids), 3, HIDDEN)
    assert torch.equal(aux[:, 1], streams[2].mean(dim=1))
    # Different layers give different states (layer 0 = embedding is never an aux id for V4).
    assert not torch.allclose(aux[:, 0], aux[:, 2])
    with pytest.raises(ValueError):
        R.reference_run(None, [ids], 1, [0, 1], ref=tiny_ref)
    with pytest.raises(ValueError):
        R.reference_run(None, [ids], 1, [5], ref=tiny_ref)


def test_reference_run_npz_roundtrip(tiny_ref, tmp_path):
    prompts = [[10, 20, 30, 40, 50], [1500, 7, 8]]
    res = R.reference_run(None, prompts, 3, [1, 3], topk=4, save_streams=True, ref=tiny_ref)
    path = R.save_reference_npz(res, tmp_path / "ref.npz")
    z = np.load(path)
    assert int(z["n_prompts"]) == 2 and z["aux_layers"].tolist() == [1, 3]
    for i, p in enumerate(prompts):
        n = len(p) + 3
        assert z[f"p{i}_tokens"].tolist()[: len(p)] == p
        assert z[f"p{i}_greedy"].shape == (3,) and bool(z[f"p{i}_greedy_consistent"])
        assert z[f"p{i}_logits"].shape == (n, 2048)
        assert z[f"p{i}_aux"].shape == (n, 2, HIDDEN)
        assert z[f"p{i}_aux"].dtype == np.float32
        assert z[f"p{i}_topk_ids"].shape == (n, 4)
        st = z[f"p{i}_streams"]
        assert st.shape == (5, n, 4, HIDDEN)
        assert np.allclose(st[3].mean(axis=1), z[f"p{i}_aux"][:, 1], atol=1e-6)
        lp = torch.log_softmax(torch.as_tensor(z[f"p{i}_logits"]), -1)
        assert np.allclose(z[f"p{i}_topk_logprobs"][:, 0], lp.max(-1).values.numpy(), atol=1e-5)
        assert z[f"p{i}_greedy"].tolist() == z[f"p{i}_topk_ids"][len(p) - 1:-1, 0].tolist()


def test_fp8_simulation_perturbs_but_keeps_argmax(built):
    cfg, tensors = R.load_checkpoint(built[0]["tiny"])
    model = R.build_reference_model(cfg, tensors)
    ids = torch.tensor([[9, 99, 999, 1999, 20, 21, 22, 400]])
    with torch.no_grad():
        clean = model(input_ids=ids, use_cache=False).logits[0]
        handles = R.enable_fp8_simulation(model, cfg)
        noisy = model(input_ids=ids, use_cache=False).logits[0]
    assert handles
    diff = (noisy - clean).abs()
    assert 1e-3 < diff.mean() < 1.0
    assert torch.equal(noisy.argmax(-1), clean.argmax(-1))
    x = torch.randn(3, 256)
    q = R.fp8_fake_quant(x, 128)
    assert torch.allclose(q, x, rtol=2 ** -4, atol=1e-3) and not torch.equal(q, x)
    assert torch.equal(R.fp8_fake_quant(x, 64, nope=128)[:, 128:], x[:, 128:])


# --------------------------------------------------------------------------- drafts / rigs
def test_draft_configs(built):
    d, _ = built
    for k in ("tiny_draft", "rig_draft", "dial0_draft"):
        c = json.loads((d[k] / "config.json").read_text())
        assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == "llama"
        assert c["hidden_size"] == c["target_hidden_size"] == HIDDEN
        assert c["head_dim"] == 128 and c["num_attention_heads"] * 128 == c["hidden_size"]
        assert c["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
        assert c["num_aux_hidden_states"] == 3 and c["num_hidden_layers"] == 1
        assert not {"compress_ratios", "hc_mult"} & set(c)
        names = set(_stored(d[k]))
        assert "embed_tokens.weight" not in names and not any("embed" in n for n in names)
        assert names >= {"fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight"}
        assert all(v.dtype == torch.bfloat16 for v in _stored(d[k]).values())
    assert "lm_head.weight" not in _stored(d["tiny_draft"])  # shared with the target
    assert "lm_head.weight" in _stored(d["rig_draft"])
    assert json.loads((d["dial0_draft"] / "config.json").read_text())["norm_before_residual"]
    tcfg = SH.dsv4_config()
    for bad in ([0, 1, 2], [1, 2, 5], [1, 1, 2]):
        with pytest.raises(ValueError):
            SH.dsv4_eagle3_draft_config(tcfg, bad)


def test_rig_counts_and_streams_stay_embedding(built):
    d, meta = built
    assert meta["rig"]["bigram_accuracy"] == 1.0 and meta["rig"]["bigram_min_margin"] > 10
    ref = R.DSV4Reference(d["rig"])
    prompt = RG.rig_prompt_token_ids(2048, n=1, length=6, seed=5, max_tokens=6)[0]
    res = R.reference_run(None, [prompt], 6, [1, 2, 3], ref=ref)
    gen = res["p0_greedy"].tolist()
    assert gen == list(range(prompt[-1] + 1, prompt[-1] + 7))
    assert res["p0_margin"].min() > 15
    f = ref.forward(prompt + gen, streams=True)
    e = ref.model.model.embed_tokens.weight[torch.tensor(prompt + gen)]
    for L in (1, 2, 3, 4):
        s = f["streams"][L]
        assert torch.allclose(s, s[:, :1].expand_as(s), atol=1e-6)  # hc streams stay equal
        ratio = (s[:, 0] * e).sum(-1) / e.pow(2).sum(-1)
        assert torch.allclose(s[:, 0], ratio[:, None] * e, atol=1e-5)  # ∝ E[token]
        assert (ratio > 0.99).all() and (ratio < 1.01).all()
    aux = res["p0_aux"]
    assert np.allclose(aux[:, 0], e.numpy(), atol=1e-5)
    # The draft: first token right, the rest wrong -> [num_drafts, 0, ..., 0].
    draft = RG.load_draft_reference(d["rig_draft"], d["rig"])
    exp = RG.expected_counters(res, draft, ks=(1, 3))
    assert exp[1]["accepted_per_pos"] == [exp[1]["num_drafts"]] and exp[1]["num_drafts"] > 0
    assert exp[3]["accepted_per_pos"] == [exp[3]["num_drafts"], 0, 0]


def test_dial_oracle_and_mismatch_dial(built):
    """mismatch 0: the oracle draft is always right; mismatch 0.5: the reference's greedy
    output follows the planted bigram exactly (big margins) and the offline counters match
    the ones implied by which ids are in the mismatch set."""
    d, meta = built
    assert meta["dial0"]["bigram_accuracy"] == 1.0 == meta["dial1"]["bigram_accuracy"]
    assert meta["dial1"]["bigram_min_margin"] > 5
    prompt = RG.rig_prompt_token_ids(2048, n=1, length=10, seed=2, max_tokens=24)[0]
    out = {}
    for key in ("dial0", "dial1"):
        ref = R.DSV4Reference(d[key])
        res = R.reference_run(None, [prompt], 24, [1, 2, 3], full_logits=False, ref=ref)
        draft = RG.load_draft_reference(d[key + "_draft"], d[key])
        out[key] = (res, RG.expected_counters(res, draft, ks=(1, 3)))
    res0, exp0 = out["dial0"]
    assert RG.counting_fraction(res0) == 1.0
    assert exp0[3]["accepted_per_pos"][0] == exp0[3]["num_drafts"] > 0
    assert exp0[1]["per_pos_rate"] == [1.0]
    res1, exp1 = out["dial1"]
    succ, in_s = RG.dial_successors(2048, 0, 0.5)
    toks = res1["p0_tokens"].tolist()
    assert all(toks[j] == int(succ[toks[j - 1]]) for j in range(len(prompt), len(toks)))
    assert res1["p0_margin"][len(prompt) - 1:-1].min() > 5
    assert 0.0 < RG.counting_fraction(res1) < 1.0
    # k = 1: a draft is accepted iff the bonus token is outside the mismatch set.
    pos, acc, drafts = len(prompt) - 1, 0, 0
    while pos + 2 < len(toks):
        drafts += 1
        ok = not bool(in_s[toks[pos + 1]])
        acc += ok
        pos += 1 + ok
    assert exp1[1]["num_drafts"] == drafts and exp1[1]["accepted_per_pos"] == [acc]
    assert 0 < acc < drafts
    rates = exp1[3]["per_pos_rate"]
    assert rates[0] >= rates[1] >= rates[2]


def test_reference_cli(built, tmp_path, capsys):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[100, 101, 102]]))
    out = tmp_path / "rig.npz"
    assert R.main([str(built[0]["rig"]), str(prompts), str(out), "--max-new-tokens", "3",
                   "--aux", "2", "--no-full-logits"]) == 0
    z = np.load(out)
    assert z["p0_greedy"].tolist() == [103, 104, 105]
    assert "p0_logits" not in z.files and z["p0_aux"].shape == (6, 1, HIDDEN)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["n_prompts"] == 1
