"""Runs inside a subprocess with a real vLLM 0.21/0.22 Python tree first on PYTHONPATH (see
vllm022.py): installs the overlay, lets vLLM import the patched modules, exercises the
patches on vLLM's own classes and prints one JSON line for test_overlay_vllm.py.

Stand-ins, and why: ``gguf`` (imported by vLLM's config package, absent from the CPU test
environment) is an empty module; the engine config is a SimpleNamespace with the fields the
KV-cache planner reads (a real VllmConfig needs a model); ``get_pp_group`` is a stub because
no distributed group exists here.
"""

from __future__ import annotations

import copy
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import types
from types import SimpleNamespace as NS


class _EmptyModules:
    """Import ``gguf`` as an empty package when it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "gguf":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        module.__path__ = []


if importlib.util.find_spec("gguf") is None:
    sys.meta_path.append(_EmptyModules())

import deepseek_v4_eagle3_aux as aux  # the overlay, installed before vLLM is imported

aux.install()

import torch
import vllm.v1.core.kv_cache_utils as kvu
import vllm.v1.spec_decode.llm_base_proposer as lbp
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec
from vllm.version import __version__ as VLLM_VERSION

MODEL_MODULE = aux.MODEL_MODULES["0.21" if VLLM_VERSION.startswith("0.21.") else "0.22"]
PACKAGE = MODEL_MODULE if VLLM_VERSION.startswith("0.21.") else aux.PLATFORM_PACKAGE
importlib.import_module(PACKAGE)  # as vLLM's model registry does
model_mod = sys.modules[MODEL_MODULE]
DRAFT = "model.layers.4.self_attn.attn"


# --------------------------------------------------------------------------- interface
def interface() -> dict:
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    from vllm.model_executor.models.interfaces import supports_eagle3

    causal, model = model_mod.DeepseekV4ForCausalLM, model_mod.DeepseekV4Model
    orig = model._dsv4_overlay_original_forward
    fake = NS(model=NS(layers=[None] * 43, aux_hidden_state_layers=()))
    out = {
        "supports_eagle3_cls": supports_eagle3(causal),
        "members": {m: repr(getattr(causal, m, None)) for m in (
            "supports_eagle3", "has_own_lm_head", "has_own_embed_tokens")},
        "default_aux_43": list(causal.get_eagle3_default_aux_hidden_state_layers(fake)),
        "forward_is_overlay": model.forward is aux.forward,
        "signature_equal": inspect.signature(model.forward) == inspect.signature(orig),
        "params": [p.name for p in inspect.signature(model.forward).parameters.values()],
        "compile_wrapper_in_mro": TorchCompileWithNoGuardsWrapper in model.__mro__,
        "call_from_decorator": model.__call__.__module__,
        "class_aux_layers": list(model.aux_hidden_state_layers),
        "bound": {"get_pp_group": aux.get_pp_group is model_mod.get_pp_group,
                  "IntermediateTensors": aux.IntermediateTensors is model_mod.IntermediateTensors,
                  "hc_head": aux.hc_head is getattr(model_mod, "hc_head", None)},
    }
    saved = aux.get_pp_group
    try:
        aux.get_pp_group = lambda: NS(world_size=1)
        causal.set_aux_hidden_state_layers(fake, (40, 2, 21))
        out["set_aux"] = list(fake.model.aux_hidden_state_layers)
        errors = {}
        for bad in ((2, 2, 1), (0, 1, 2), (1, 44)):
            try:
                causal.set_aux_hidden_state_layers(fake, bad)
            except ValueError as e:
                errors[str(bad)] = str(e)
        aux.get_pp_group = lambda: NS(world_size=2)
        try:
            causal.set_aux_hidden_state_layers(fake, (1, 2, 3))
        except NotImplementedError as e:
            errors["pp2"] = str(e)
        out["set_aux_errors"] = errors
    finally:
        aux.get_pp_group = saved
    return out


# --------------------------------------------------------------------------- KV-cache layout
def v4_specs(ratios=(0, 4, 128, 4), window=128, block=256) -> dict:
    """The cache specs vLLM 0.22's DeepSeek-V4 layers return (attention.py, compressor.py,
    sparse_swa.py), in registration order, for the tiny checkpoint's compress_ratios."""
    specs = {}
    for i, r in enumerate(ratios):
        p = f"model.layers.{i}.attn"
        specs[f"{p}.swa_cache"] = SlidingWindowMLASpec(
            block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8,
            sliding_window=window, cache_dtype_str="fp8_ds_mla", alignment=576,
            model_version="deepseek_v4")
        if r > 1:
            specs[p] = MLAAttentionSpec(
                block_size=block, num_kv_heads=1, head_size=512, dtype=torch.uint8,
                compress_ratio=r, cache_dtype_str="fp8_ds_mla", alignment=576,
                model_version="deepseek_v4")
            coff = 1 + (r == 4)
            specs[f"{p}.compressor.state_cache"] = SlidingWindowMLASpec(
                block_size=4 if r == 4 else 8, num_kv_heads=1, head_size=2 * coff * 512,
                dtype=torch.float32, sliding_window=coff * r, alignment=576)
        if r == 4:
            specs[f"{p}.indexer.k_cache"] = MLAAttentionSpec(
                block_size=block, num_kv_heads=1, head_size=132, dtype=torch.uint8,
                compress_ratio=4, alignment=576)
            specs[f"{p}.indexer.compressor.state_cache"] = SlidingWindowMLASpec(
                block_size=4, num_kv_heads=1, head_size=512, dtype=torch.float32,
                sliding_window=8, alignment=576)
    return specs


def draft_spec():
    """The Llama EAGLE-3 draft layer's spec (4 heads, 2 KV heads, head_dim 128, bf16)."""
    return FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)


def engine_config(override=None, eagle=True):
    return NS(
        scheduler_config=NS(disable_hybrid_kv_cache_manager=False,
                            max_num_batched_tokens=4096),
        speculative_config=NS(use_eagle=lambda: True) if eagle else None,
        cache_config=NS(num_gpu_blocks_override=override, enable_prefix_caching=True,
                        hash_block_size=None, block_size=256),
        model_config=NS(original_max_model_len=4096, max_model_len=4096),
        parallel_config=NS(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        kv_transfer_config=None)


PATCHED = ("get_kv_cache_groups", "_get_kv_cache_config_deepseek_v4",
           "_max_memory_usage_bytes_from_groups", "_pool_bytes_per_block")


def stock(fn, *args):
    """Call ``fn`` with kv_cache_utils' original (unpatched) functions in place."""
    patched = {name: getattr(kvu, name) for name in PATCHED}
    try:
        for name, f in patched.items():
            setattr(kvu, name, f.__wrapped__)
        return fn(*args)
    finally:
        for name, f in patched.items():
            setattr(kvu, name, f)


def summary(cfg) -> dict:
    nb = cfg.num_blocks
    owners: dict[str, int] = {}
    for t in cfg.kv_cache_tensors:
        for name in t.shared_by:
            owners[name] = owners.get(name, 0) + 1
    return {
        "num_blocks": nb,
        "groups": [g.layer_names for g in cfg.kv_cache_groups],
        "eagle_groups": [i for i, g in enumerate(cfg.kv_cache_groups) if g.is_eagle_group],
        "tensors": [[t.size, t.shared_by] for t in cfg.kv_cache_tensors],
        "tensor_bytes": sum(t.size for t in cfg.kv_cache_tensors),
        "divisible": all(t.size % nb == 0 for t in cfg.kv_cache_tensors),
        "one_tensor_per_layer": owners,
    }


def kv_layout() -> dict:
    avail = 1 << 30
    v4 = v4_specs()
    full = {**v4, DRAFT: draft_spec()}
    out = {"draft_page": draft_spec().page_size_bytes}
    try:
        stock(kvu.get_kv_cache_configs, engine_config(), [dict(full)], [avail])
        out["stock_error"] = None
    except AssertionError as e:
        out["stock_error"] = str(e)
    out["plain_stock"] = summary(stock(kvu.get_kv_cache_configs, engine_config(eagle=False),
                                       [dict(v4)], [avail])[0])
    out["plain_patched"] = summary(kvu.get_kv_cache_configs(engine_config(eagle=False),
                                                             [dict(v4)], [avail])[0])
    out["with_draft"] = summary(kvu.get_kv_cache_configs(engine_config(), [dict(full)],
                                                          [avail])[0])
    out["override"] = summary(kvu.get_kv_cache_configs(engine_config(override=2000),
                                                        [dict(full)], [avail])[0])
    cfg = engine_config()
    groups = kvu.get_kv_cache_groups(cfg, dict(full))
    v4_groups = stock(kvu.get_kv_cache_groups, cfg, dict(v4))
    out["memory"] = {
        "patched": kvu._max_memory_usage_bytes_from_groups(cfg, groups),
        "v4_only": kvu._max_memory_usage_bytes_from_groups(cfg, v4_groups),
        "v4_pages": sum(g.kv_cache_spec.max_memory_usage_pages(cfg) for g in v4_groups),
        "pool_bytes": kvu._pool_bytes_per_block(groups),
        "pool_bytes_v4": kvu._pool_bytes_per_block(v4_groups),
    }
    # GPUModelRunner._init_minimal_kv_cache_for_profiling (CUDA-graph memory profiling)
    cfg = engine_config(override=8)
    out["minimal_profiling"] = summary(kvu.get_kv_cache_config_from_groups(
        cfg, kvu.get_kv_cache_groups(cfg, dict(full)), available_memory=0))
    llama = {f"model.layers.{i}.self_attn.attn": draft_spec() for i in range(3)}
    out["llama_unchanged"] = (
        summary(kvu.get_kv_cache_configs(engine_config(), [dict(llama)], [avail])[0])
        == summary(stock(kvu.get_kv_cache_configs, engine_config(), [dict(llama)], [avail])[0]))
    return out


# --------------------------------------------------------------------------- draft cache config
def draft_cache() -> dict:
    import eagle3_draft_kv_cache as base
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig

    cache = CacheConfig(cache_dtype="fp8", sliding_window=128, block_size=256)
    target = VllmConfig(cache_config=cache, device_config=DeviceConfig(device="cpu"))
    cache.cache_dtype = "fp8_ds_mla"  # what DeepseekV4MLAAttention.__init__ does

    def proposer(method="eagle3", model_type="deepseek_v4", text_config=None):
        return NS(method=method,
                  vllm_config=NS(model_config=NS(hf_config=NS(model_type=model_type)),
                                 cache_config=cache),
                  speculative_config=NS(draft_model_config=NS(
                      hf_text_config=text_config or LlamaConfig(),
                      get_sliding_window=lambda: 64)))

    def make(p):  # what the stock method returns: a replace()d copy sharing cache_config
        return base._draft_config(lambda _: copy.copy(target), p)

    out = {"wrapped": hasattr(lbp.SpecDecodeBaseProposer._create_draft_vllm_config,
                              "__wrapped__")}
    draft = make(proposer())
    out["dsv4"] = {"dtype": draft.cache_config.cache_dtype,
                   "sliding_window": draft.cache_config.sliding_window,
                   "block_size": draft.cache_config.block_size,
                   "own_object": draft.cache_config is not cache,
                   "target_dtype": cache.cache_dtype, "target_window": cache.sliding_window}
    interleaved = LlamaConfig(layer_types=["sliding_attention", "full_attention"] * 2,
                              num_hidden_layers=4)
    out["interleaved_window"] = make(proposer(text_config=interleaved)).cache_config.sliding_window
    out["mtp_shares"] = make(proposer(method="mtp")).cache_config is cache
    out["llama_target_shares"] = make(proposer(model_type="llama")).cache_config is cache
    os.environ[base.DTYPE_ENV] = "fp8"
    out["env_fp8"] = make(proposer()).cache_config.cache_dtype
    out["env_fp8_llama_target"] = make(proposer(model_type="llama")).cache_config.cache_dtype
    os.environ[base.DTYPE_ENV] = "bogus"
    try:
        make(proposer())
        out["bogus_error"] = None
    except ValueError as e:
        out["bogus_error"] = str(e)
    del os.environ[base.DTYPE_ENV]
    return out


if __name__ == "__main__":
    result = {"vllm_version": VLLM_VERSION, "interface": interface(), "kv": kv_layout(),
              "draft_cache": draft_cache(), "report": aux.report()}
    print(json.dumps(result, default=str))
