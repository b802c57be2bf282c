"""The overlay's ``DeepseekV4Model.forward`` bodies on CPU: aux-state capture against an
independent reference, against vLLM's own forwards (executed from the official wheels'
source) and under a full-graph torch.compile.

* ``forward`` (vLLM 0.21/0.22): both decoder-layer paths, both layouts (0.22 ``hc_head_op``,
  0.21 ``hc_head``); without aux layers it equals vLLM 0.22's own forward.
* ``forward_tilelang`` (vLLM 0.23/0.24 ``nvidia/model.py``): without aux layers it equals
  0.23's own forward, with aux layers vLLM 0.25's native capture, bit for bit.

The decoder layers are stand-ins with DeepSeek-V4's interface (``(x, residual, post_mix,
res_mix)``, post-mix deferred as in the fused CUDA path or applied as in the native one)
whose post-mix is vLLM's own torch reference ``mhc_post_torch``; the real layers and the
tilelang kernels need CUDA. ``capture_aux`` is swapped as a fault-injection harness would.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from itertools import islice
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from torch import nn
from vllm022 import Unavailable, vllm022_tree, vllm_py_tree  # noqa: F401  (session fixture)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))
import deepseek_v4_eagle3_aux as aux

T, HC, H, N, VOCAB = 7, 4, 32, 4, 50
BF16 = torch.bfloat16
RANK = NS(is_first_rank=True, is_last_rank=True)


def _tree(version: str) -> Path:
    try:
        return vllm_py_tree(version)
    except Unavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def mhc_post(vllm022_tree):  # noqa: F811
    """``mhc_post_torch`` from vLLM 0.22's ``model_executor/kernels/mhc/torch.py``."""
    path = vllm022_tree / "vllm/model_executor/kernels/mhc/torch.py"
    spec = importlib.util.spec_from_file_location("_vllm022_mhc_torch", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.mhc_post_torch


def vllm_forward(tree: Path, module: str, **names):
    """vLLM's own ``DeepseekV4Model.forward`` from ``tree``, compiled with ``names`` as its
    globals (annotations dropped: they name classes this test does not load)."""
    node = aux.base.Source(str(tree)).node(module, "DeepseekV4Model.forward")
    node.decorator_list, node.returns = [], None
    for arg in node.args.args:
        arg.annotation = None
    code = compile(ast.fix_missing_locations(ast.Module([node], [])), module, "exec")
    scope = {"torch": torch, "islice": islice, "get_pp_group": lambda: RANK,
             "IntermediateTensors": dict, **names}
    exec(code, scope)  # noqa: S102 (vLLM's source from the official wheel)
    return scope["forward"]


@pytest.fixture(autouse=True)
def bound(monkeypatch):
    """What ``patch_model`` binds from vLLM's model module (single rank here)."""
    monkeypatch.setattr(aux, "get_pp_group", lambda: RANK)
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
    """``DeepseekV4Model`` stand-in carrying one of the overlay's forwards."""

    def __init__(self, hc_post, native=False, layout="0.22", aux_layers=(), fn=aux.forward):
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
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(self, *args, **kwargs)

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
POS = torch.arange(T)


@pytest.fixture
def tilelang(monkeypatch, mhc_post):
    """``forward_tilelang``'s kernels bound to torch references."""
    monkeypatch.setattr(aux, "mhc_post_tilelang", mhc_post)
    monkeypatch.setattr(aux, "hc_head_fused_kernel_tilelang", HeadOp().forward)
    return {"mhc_post_tilelang": mhc_post, "hc_head_fused_kernel_tilelang": HeadOp().forward}


# --------------------------------------------------------------------------- 0.21/0.22 body
@pytest.mark.parametrize("native", [False, True], ids=["fused-cuda-path", "native-path"])
def test_aux_states_are_hc_means_of_the_stream_after_each_layer(mhc_post, native):
    model = Model(mhc_post, native=native, aux_layers=(1, 2, N))
    hidden, aux_states = model(IDS, POS, None)
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
    hidden = plain(IDS, POS, None)
    assert isinstance(hidden, torch.Tensor)  # no aux layers: a plain tensor, as stock
    buffer = plain._mtp_hidden_buffer[:T].clone()
    for layers in [(2,), (1, 3), (1, 2, N)]:
        captured = Model(mhc_post, aux_layers=layers)
        out, aux_states = captured(IDS, POS, None)
        assert len(aux_states) == len(layers)
        assert torch.equal(out, hidden)
        assert torch.equal(captured._mtp_hidden_buffer[:T], buffer)


def test_equals_vllm_022s_own_forward_without_aux_layers(mhc_post, vllm022_tree):  # noqa: F811
    stock = vllm_forward(vllm022_tree, aux.MODEL_MODULES["nvidia"],
                         current_platform=NS(is_cuda=lambda: True))
    ours = Model(mhc_post)
    theirs = Model(mhc_post, fn=stock)
    assert torch.equal(ours(IDS, POS, None), theirs(IDS, POS, None))
    assert torch.equal(ours._mtp_hidden_buffer, theirs._mtp_hidden_buffer)


def test_inputs_embeds_and_the_0_21_head_function(mhc_post, monkeypatch):
    ref = Model(mhc_post, aux_layers=(2,))
    want_hidden, want_aux = ref(IDS, POS, None)
    head = HeadOp()
    monkeypatch.setattr(aux, "hc_head", head.forward)  # 0.21: module-level hc_head(...)
    old = Model(mhc_post, layout="0.21", aux_layers=(2,))
    got_hidden, got_aux = old(None, POS, None, inputs_embeds=old.embed[IDS])
    assert torch.equal(got_hidden, want_hidden) and torch.equal(got_aux[0], want_aux[0])


def test_forward_compiles_as_one_graph(mhc_post):
    torch._dynamo.reset()
    model = Model(mhc_post, aux_layers=(1, N))
    eager_hidden, eager_aux = model(IDS, POS, None)
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend="eager")
    hidden, aux_states = compiled(IDS, POS, None)
    assert torch.equal(hidden, eager_hidden)
    assert all(torch.equal(a, b) for a, b in zip(aux_states, eager_aux))
    torch._dynamo.reset()


# --------------------------------------------------------------------------- 0.23/0.24 body
def tile_model(mhc_post, aux_layers=(), fn=aux.forward_tilelang) -> Model:
    """0.23+'s layers always defer the post-mix (the fused path)."""
    return Model(mhc_post, native=False, layout="0.23", aux_layers=aux_layers, fn=fn)


def test_tilelang_aux_states_against_the_reference(mhc_post, tilelang):
    model = tile_model(mhc_post, aux_layers=(1, 3, N))
    hidden, aux_states = model(IDS, POS, None)
    streams = reference_streams(model, IDS)
    for layer_id, got in zip((1, 3, N), aux_states):
        want = streams[layer_id - 1].double().mean(dim=1)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    final = HeadOp()(streams[-1], None, model.hc_head_scale, model.hc_head_base, 0, 0)
    torch.testing.assert_close(hidden.double(), final.double(), atol=2e-2, rtol=2e-2)


def test_tilelang_equals_vllm_023_stock_and_025_native(mhc_post, tilelang):
    """No aux layers: vLLM 0.23's own forward. Aux layers: vLLM 0.25's native capture
    (0.25 is 0.24's forward plus the capture), outputs and aux states bit for bit."""
    stock_023 = vllm_forward(_tree("0.23.0"), aux.MODEL_MODULES["nvidia"], **tilelang)
    native_025 = vllm_forward(_tree("0.25.0"), aux.MODEL_MODULES["nvidia"], **tilelang)
    plain, theirs = tile_model(mhc_post), tile_model(mhc_post, fn=stock_023)
    assert torch.equal(plain(IDS, POS, None), theirs(IDS, POS, None))
    assert torch.equal(plain._mtp_hidden_buffer, theirs._mtp_hidden_buffer)
    for layers in [(2,), (1, 3), (1, 2, N), (N,)]:
        ours = tile_model(mhc_post, aux_layers=layers)
        native = tile_model(mhc_post, aux_layers=layers, fn=native_025)
        (h1, a1), (h2, a2) = ours(IDS, POS, None), native(IDS, POS, None)
        assert torch.equal(h1, h2) and len(a1) == len(a2) == len(layers)
        assert all(torch.equal(x, y) for x, y in zip(a1, a2))
        assert torch.equal(ours._mtp_hidden_buffer, native._mtp_hidden_buffer)


# --------------------------------------------------------------------------- capture_aux
@pytest.mark.parametrize("fn", ["forward", "forward_tilelang"])
def test_every_capture_goes_through_capture_aux(mhc_post, tilelang, monkeypatch, fn):
    """A fault injector swapping ``capture_aux`` (one stream instead of the mean) changes the
    aux states of both forwards and nothing else."""
    model = Model(mhc_post, aux_layers=(1, 3), fn=getattr(aux, fn))
    hidden, means = model(IDS, POS, None)
    seen = []
    monkeypatch.setattr(aux, "capture_aux", lambda s: seen.append(s.shape) or s[:, 0])
    hidden2, firsts = model(IDS, POS, None)
    streams = reference_streams(model, IDS)
    assert seen == [(T, HC, H)] * 2 and torch.equal(hidden, hidden2)
    for layer_id, got, mean in zip((1, 3), firsts, means):
        torch.testing.assert_close(got.double(), streams[layer_id - 1][:, 0].double(),
                                   atol=2e-2, rtol=2e-2)
        assert not torch.allclose(got, mean)
