"""The CPU EAGLE-3 draft against a hand computation of vLLM's `llama_eagle3.py` math (0.22 and
0.26 alike): `fc_norm` (per-chunk RMSNorm before fc), `norm_output` (later steps take the
post-norm hidden state) and a reduced draft vocabulary mapped through `d2t`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from speclab.fixtures.eagle3_draft import Eagle3Draft, draft_chains, simulate_greedy_spec_decode

H, NH, HD, V, DV, N_AUX = 16, 2, 8, 12, 5, 3
D2T = torch.tensor([1, 1, 3, 4, 6])  # draft ids 0..4 -> target ids 1, 2, 5, 7, 10


def _config(**flags) -> dict:
    return {"hidden_size": H, "target_hidden_size": H, "rms_norm_eps": 1e-6,
            "num_attention_heads": NH, "num_key_value_heads": 1, "head_dim": HD,
            "intermediate_size": 24, "num_aux_hidden_states": N_AUX, "vocab_size": V,
            "draft_vocab_size": DV, "rope_parameters": {"rope_theta": 10000.0}, **flags}


def _draft(**flags) -> Eagle3Draft:
    torch.manual_seed(0)
    d = Eagle3Draft(_config(**flags), torch.randn(V, H), D2T)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return d.eval()


def _rms(x, w):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x, pos):  # neox rotation over the whole head dim, one position
    inv = 1.0 / 10000.0 ** (torch.arange(0, HD, 2).float() / HD)
    c, s = torch.cos(pos * inv), torch.sin(pos * inv)
    a, b = x[..., : HD // 2], x[..., HD // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def _hand(d: Eagle3Draft, aux: torch.Tensor, tok: int, fc_norm: bool, norm_output: bool):
    """Two draft steps for a one-token sequence, written out from vLLM's code."""
    sd = {k: v.detach() for k, v in d.state_dict().items()}
    p = "midlayer."
    if fc_norm:  # combine_hidden_states: chunk, RMSNorm each with its own weight, concat
        aux = torch.cat([_rms(c, sd[f"fc_norm.{i}.weight"])
                         for i, c in enumerate(aux.chunk(N_AUX))])
    hidden = sd["fc.weight"] @ aux
    keys, vals, out = [], [], []
    for step in range(2):
        x = torch.cat([_rms(d.embed[tok], sd[p + "input_layernorm.weight"]),
                       _rms(hidden, sd[p + "hidden_norm.weight"])])
        q = _rope((sd[p + "self_attn.q_proj.weight"] @ x).view(NH, HD), step)
        keys.append(_rope((sd[p + "self_attn.k_proj.weight"] @ x).view(1, HD), step))
        vals.append((sd[p + "self_attn.v_proj.weight"] @ x).view(1, HD))
        scores = torch.stack([(q * k).sum(-1) / math.sqrt(HD) for k in keys], -1)
        ctx = (scores.softmax(-1)[..., None] * torch.cat(vals)[None]).sum(1)
        r = sd[p + "self_attn.o_proj.weight"] @ ctx.flatten() + hidden
        m = _rms(r, sd[p + "post_attention_layernorm.weight"])
        mlp = sd[p + "mlp.down_proj.weight"] @ (F.silu(sd[p + "mlp.gate_proj.weight"] @ m)
                                                * (sd[p + "mlp.up_proj.weight"] @ m))
        prenorm = mlp + r
        post = _rms(prenorm, sd["norm.weight"])
        draft_logits = sd["lm_head.weight"] @ post
        # compute_logits: draft logits scattered into the target vocab, -inf elsewhere
        full = torch.full((V,), float("-inf"))
        full[torch.arange(DV) + D2T] = draft_logits
        out.append((draft_logits, int(full.argmax())))
        tok = out[-1][1]
        hidden = post if norm_output else prenorm
    return out


@pytest.mark.parametrize("fc_norm,norm_output", [(True, True), (True, False), (False, True),
                                                 (False, False)])
def test_draft_matches_hand_computation(fc_norm, norm_output):
    d = _draft(fc_norm=fc_norm, norm_output=norm_output)
    assert ("fc_norm.2.weight" in d.state_dict()) == fc_norm
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(N_AUX * H, generator=g) * 3
    want = _hand(d, aux, 4, fc_norm, norm_output)
    with torch.no_grad():
        got = d.unroll(aux[None, None], torch.tensor([[4]]), 2)
    for s in range(2):
        assert torch.allclose(got[s][0, 0], want[s][0], atol=1e-4)
        assert int(d.to_target_ids(got[s][0, 0].argmax())) == want[s][1]
    chains = draft_chains(d, torch.stack([aux, aux])[None], torch.tensor([[3, 4]]), 2)
    assert chains[0, 0].tolist() == [w[1] for w in want]


def test_flags_change_the_result():
    """fc_norm and norm_output are not no-ops on these weights (the tests above can fail)."""
    aux = torch.randn(N_AUX * H, generator=torch.Generator().manual_seed(1)) * 3
    a = _hand(_draft(fc_norm=True, norm_output=True), aux, 4, True, True)
    b = _hand(_draft(fc_norm=True, norm_output=True), aux, 4, False, True)
    c = _hand(_draft(fc_norm=True, norm_output=True), aux, 4, True, False)
    assert not torch.allclose(a[0][0], b[0][0]) and not torch.allclose(a[1][0], c[1][0])


def test_d2t_maps_and_t2d_marks_the_draft_vocab():
    d = _draft(fc_norm=True, norm_output=True)
    assert d.to_target_ids(torch.arange(DV)).tolist() == [1, 2, 5, 7, 10]
    assert torch.nonzero(d.t2d).flatten().tolist() == [1, 2, 5, 7, 10]
    assert d.state_dict()["d2t"].dtype == torch.int64


def test_spec_decode_counters_with_mapped_drafts():
    tokens = torch.tensor([9, 1, 2, 5, 7, 10, 3, 4])
    chains = torch.tensor([[0, 0]] * 7)
    chains[1] = torch.tensor([5, 7])   # after position 1: both right
    chains[4] = torch.tensor([3, 1])   # after position 4: first right, second wrong
    c = simulate_greedy_spec_decode(chains, tokens, prompt_len=2, k=2)
    assert c == {"num_drafts": 2, "num_draft_tokens": 4, "num_accepted_tokens": 3,
                 "accepted_per_pos": [2, 1]}
