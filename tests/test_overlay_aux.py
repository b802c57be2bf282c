"""The overlay's ``DeepseekV4Model.forward`` on CPU: aux-state capture against an independent
reference, both decoder-layer paths, both vLLM layouts (0.22 ``hc_head_op``, 0.21
``hc_head``), and a full-graph torch.compile.

The decoder layers are stand-ins with DeepSeek-V4's interface (``(x, residual, post_mix,
res_mix)``, post-mix deferred as in ``_forward_cuda`` or applied as in ``_forward_native``)
whose ``hc_post`` is vLLM 0.22's own torch reference ``mhc_post_torch``; the real layers
need CUDA kernels.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn
from vllm022 import vllm022_tree  # noqa: F401  (session fixture)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))
import deepseek_v4_eagle3_aux as aux

T, HC, H, N, VOCAB = 7, 4, 32, 4, 50
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def mhc_post(vllm022_tree):  # noqa: F811
    """``mhc_post_torch`` from vLLM 0.22's ``model_executor/kernels/mhc/torch.py``."""
    path = vllm022_tree / "vllm/model_executor/kernels/mhc/torch.py"
    spec = importlib.util.spec_from_file_location("_vllm022_mhc_torch", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.mhc_post_torch


@pytest.fixture(autouse=True)
def bound(monkeypatch):
    """What ``patch_model`` binds from vLLM's model module (single rank here)."""
    rank = NS(is_first_rank=True, is_last_rank=True)
    monkeypatch.setattr(aux, "get_pp_group", lambda: rank)
    monkeypatch.setattr(aux, "IntermediateTensors", dict)
    monkeypatch.setattr(aux, "hc_head", None)


class Layer(nn.Module):
    """DeepseekV4DecoderLayer stand-in with a deterministic mixer."""

    def __init__(self, seed: int, native: bool, hc_post):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(H, H, generator=g) / H**0.5, requires_grad=False)
        self.p = nn.Parameter(torch.randn(H, HC, generator=g), requires_grad=False)
        self.c = nn.Parameter(torch.randn(H, HC * HC, generator=g), requires_grad=False)
        self.native = native
        self.hc_post = hc_post

    def mix(self, stream):
        """(layer output [T, H] bf16, post_mix [T, hc, 1] fp32, comb_mix [T, hc, hc] fp32)."""
        summary = stream.float().mean(1)
        post = 2 * torch.sigmoid(summary @ self.p).unsqueeze(-1)
        comb = torch.softmax((summary @ self.c).view(-1, HC, HC), dim=-1)
        return torch.tanh(summary @ self.w).to(stream.dtype), post, comb

    def forward(self, x, positions, input_ids, post_mix, res_mix, residual):
        if self.native:  # x is the full stream; the post-mix is applied here
            out, post, comb = self.mix(x)
            return self.hc_post(out, x, post, comb), None, None, None
        stream = x if residual is None else self.hc_post(x, residual, post_mix, res_mix)
        out, post, comb = self.mix(stream)
        return out, stream, post, comb


class HeadOp(nn.Module):
    """``HCHeadOp`` stand-in: a learned weighting of the hc streams."""

    def forward(self, h, fn, scale, base, rms_eps, hc_eps):
        weights = torch.softmax(base * scale, dim=0)
        return (h.float() * weights.view(1, -1, 1)).sum(1).to(h.dtype)


class Model(nn.Module):
    """``DeepseekV4Model`` stand-in carrying the overlay's forward."""

    forward = aux.forward

    def __init__(self, hc_post, native=False, layout="0.22", aux_layers=()):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, H, generator=g).to(BF16), requires_grad=False)
        self.layers = nn.ModuleList(Layer(i + 1, native, hc_post) for i in range(N))
        self.hc_mult, self.use_mega_moe, self.start_layer, self.end_layer = HC, False, 0, N
        self.hc_head_fn = nn.Parameter(torch.zeros(HC, HC * H), requires_grad=False)
        self.hc_head_scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.hc_head_base = nn.Parameter(torch.randn(HC, generator=g), requires_grad=False)
        self.rms_norm_eps = self.hc_eps = 1e-6
        if layout == "0.22":
            self.hc_head_op = HeadOp()
        self.norm = nn.Identity()
        self._mtp_hidden_buffer = torch.zeros(16, HC * H, dtype=BF16)
        self.aux_hidden_state_layers = tuple(aux_layers)

    def embed_input_ids(self, input_ids):
        return self.embed[input_ids]


def reference_streams(model: Model, ids) -> list[torch.Tensor]:
    """Residual stream after each layer, written out without mhc_post_torch (float64):
    out_j = post_j * x + sum_i comb_ij * stream_i, cast back to bf16 like vLLM."""
    stream = model.embed[ids].unsqueeze(1).repeat(1, HC, 1)
    streams = []
    for layer in model.layers:
        x, post, comb = layer.mix(stream)
        new = torch.zeros(stream.shape, dtype=torch.float64)
        for j in range(HC):
            new[:, j] = post[:, j].double() * x.double()
            for i in range(HC):
                new[:, j] += comb[:, i, j, None].double() * stream[:, i].double()
        stream = new.to(BF16)
        streams.append(stream)
    return streams


IDS = torch.tensor([3, 1, 4, 1, 5, 9, 2])


@pytest.mark.parametrize("native", [False, True], ids=["fused-cuda-path", "native-path"])
def test_aux_states_are_hc_means_of_the_stream_after_each_layer(mhc_post, native):
    model = Model(mhc_post, native=native, aux_layers=(1, 2, N))
    hidden, aux_states = model(IDS, torch.arange(T), None)
    streams = reference_streams(model, IDS)
    assert len(aux_states) == 3
    for layer_id, got in zip((1, 2, N), aux_states):
        assert got.shape == (T, H) and got.dtype == BF16
        want = streams[layer_id - 1].double().mean(dim=1)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    final = HeadOp()(streams[-1], None, model.hc_head_scale, model.hc_head_base, 0, 0)
    torch.testing.assert_close(hidden.double(), final.double(), atol=2e-2, rtol=2e-2)


def test_capture_leaves_the_target_untouched(mhc_post):
    plain = Model(mhc_post)
    hidden = plain(IDS, torch.arange(T), None)
    assert isinstance(hidden, torch.Tensor)  # no aux layers: a plain tensor, as stock
    buffer = plain._mtp_hidden_buffer[:T].clone()
    for layers in [(2,), (1, 3), (1, 2, N)]:
        captured = Model(mhc_post, aux_layers=layers)
        out, aux_states = captured(IDS, torch.arange(T), None)
        assert len(aux_states) == len(layers)
        assert torch.equal(out, hidden)
        assert torch.equal(captured._mtp_hidden_buffer[:T], buffer)


def test_inputs_embeds_and_the_0_21_head_function(mhc_post, monkeypatch):
    ref = Model(mhc_post, aux_layers=(2,))
    want_hidden, want_aux = ref(IDS, torch.arange(T), None)
    head = HeadOp()
    monkeypatch.setattr(aux, "hc_head", head.forward)  # 0.21: module-level hc_head(...)
    old = Model(mhc_post, layout="0.21", aux_layers=(2,))
    got_hidden, got_aux = old(None, torch.arange(T), None, inputs_embeds=old.embed[IDS])
    assert torch.equal(got_hidden, want_hidden) and torch.equal(got_aux[0], want_aux[0])


def test_forward_compiles_as_one_graph(mhc_post):
    torch._dynamo.reset()
    model = Model(mhc_post, aux_layers=(1, N))
    eager_hidden, eager_aux = model(IDS, torch.arange(T), None)
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="eager")
    hidden, aux_states = compiled(IDS, torch.arange(T), None)
    assert torch.equal(hidden, eager_hidden)
    assert all(torch.equal(a, b) for a, b in zip(aux_states, eager_aux))
    torch._dynamo.reset()
