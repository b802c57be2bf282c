# Scratch scripts of the 2026-12-02 CPU diagnosis (docs/realshape-oracle-diagnosis.md); they write under /tmp/dd.
"""Counting-oracle EAGLE-3 draft for the rig-llama target, factors switchable."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from speclab.fixtures import eagle3_draft as ED

TARGET = Path("/root/.cache/speclab/fixtures/rig-llama-seed0-d14e034ce719")

def build(out, *, target=None, save_dtype="float32", head_dim=32, kv_group=1, width=None, fc_norm=False, norm_output=False,
          draft_vocab=None, intermediate=512, alpha=2.83, pairs=None, o_mode="first",
          seed=0):
    T_ = Path(target) if target else TARGET
    tcfg = json.loads((T_ / "config.json").read_text())
    ts = load_file(str(T_ / "model.safetensors"))
    E = ts["model.embed_tokens.weight"].float()
    H, V = tcfg["hidden_size"], tcfg["vocab_size"]
    NH = H // head_dim; NKV = NH // kv_group; HD = head_dim
    DV = draft_vocab or V
    c = ED.draft_config(tcfg, aux_layer_ids=[1, 2, 4], num_attention_heads=NH,
                        num_key_value_heads=NKV, intermediate_size=intermediate,
                        draft_vocab_size=DV)
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e10}
    c["rope_theta"] = 1e10
    c["norm_before_residual"] = True
    if fc_norm: c["fc_norm"] = True
    if norm_output: c["norm_output"] = True
    g = torch.Generator().manual_seed(50021 + seed)
    r = lambda *s: torch.randn(*s, generator=g) * s[-1] ** -0.5
    t = {"fc.weight": torch.zeros(H, 3 * H),
         "midlayer.input_layernorm.weight": torch.ones(H),
         "midlayer.hidden_norm.weight": torch.zeros(H),
         "midlayer.post_attention_layernorm.weight": torch.ones(H),
         "midlayer.mlp.gate_proj.weight": r(intermediate, H),
         "midlayer.mlp.up_proj.weight": r(intermediate, H),
         "midlayer.mlp.down_proj.weight": torch.zeros(H, intermediate),
         "norm.weight": ts["model.norm.weight"].float()}
    if fc_norm:
        t.update({f"fc_norm.{j}.weight": torch.ones(H) for j in range(3)})
    if width is None:  # dial-like: v = identity over all coords (needs kv heads * HD == H)
        width = NKV * HD
    assert width <= NKV * HD
    v = torch.zeros(NKV * HD, 2 * H); v[:width, :width] = torch.eye(width)
    o = torch.zeros(H, NH * HD)
    for kv in range(NKV):
        lo, hi = kv * HD, min((kv + 1) * HD, width)
        if hi <= lo: continue
        if o_mode == "first":
            o[lo:hi, kv * kv_group * HD: kv * kv_group * HD + (hi - lo)] = torch.eye(hi - lo)
        else:  # mean over the group's heads
            for h in range(kv * kv_group, (kv + 1) * kv_group):
                o[lo:hi, h * HD: h * HD + (hi - lo)] = torch.eye(hi - lo) / kv_group
    npair = pairs or HD // 4
    dims = list(range(HD // 2 - npair, HD // 2)) + list(range(HD - npair, HD))
    q = torch.zeros(NH * HD, 2 * H); k = torch.zeros(NKV * HD, 2 * H)
    for kv in range(NKV):
        P = alpha * torch.randn(len(dims), H, generator=g) / H ** 0.5
        k[[kv * HD + d for d in dims], :H] = P
        for h in range(kv * kv_group, (kv + 1) * kv_group):
            q[[h * HD + d for d in dims], :H] = P
    t.update({"midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
              "midlayer.self_attn.v_proj.weight": v, "midlayer.self_attn.o_proj.weight": o})
    e = E[:DV]
    trunc = torch.zeros_like(e); trunc[:, :width] = e[:, :width]
    head = torch.zeros_like(trunc)
    head[1:] = trunc[:-1] / trunc[:-1].norm(dim=-1, keepdim=True)
    t["lm_head.weight"] = head
    if DV != V:
        t["d2t"] = torch.zeros(DV, dtype=torch.long)
        t2d = torch.zeros(V, dtype=torch.bool); t2d[:DV] = True
        t["t2d"] = t2d
    out = Path(out); out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(c, indent=1))
    save_file({k_: (v_.to(getattr(torch, save_dtype)) if v_.is_floating_point() else v_).contiguous() for k_, v_ in t.items()}, str(out / "model.safetensors"))
    return out
