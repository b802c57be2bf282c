"""Draft KV cache for an EAGLE-3 draft next to a DeepSeek-V4 target in vLLM 0.21-0.22.

Overlay part 2 of 2 (part 1, ``deepseek_v4_eagle3_aux``, imports this one). ``install()``
only registers import hooks: nothing from vLLM or torch is imported until vLLM imports the
module a patch targets, and the patch is applied right after that module has executed.

Patches (each recorded in ``PATCHES``; see README.md next to this file):

* ``draft-cache-config``: ``SpecDecodeBaseProposer._create_draft_vllm_config`` gives an
  eagle/eagle3 draft its own ``CacheConfig`` copy when the target is DeepSeek-V4 (or
  ``EAGLE3_DRAFT_KV_CACHE_DTYPE`` is set): ``cache_dtype`` from that variable (default
  ``auto``) and the draft's own sliding window. Stock 0.22 shares the target's config, which
  the V4 attention rewrites to ``fp8_ds_mla`` with the target's 128-token window.
* ``kv-groups``, ``kv-tensors``, ``kv-memory-check``, ``kv-pool-bytes``: the DeepSeek-V4 KV
  layout of ``vllm/v1/core/kv_cache_utils.py`` drops the draft's ``FullAttentionSpec``
  ("Some layers are not assigned to any group."). The draft layers join the full-MLA group 0
  (same 256-token blocks and block table) and get one dedicated tensor each
  (``page_size * num_blocks``), counted once per pool block in the memory checks.

Environment: ``EAGLE3_DRAFT_KV_CACHE_DTYPE`` (draft KV dtype, default ``auto``),
``DSV4_EAGLE3_OVERLAY`` = ``auto`` (patch vLLM 0.21.x/0.22.x only) | ``force`` (also patch
other versions where the targets exist) | ``off``.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

OVERLAY_VERSION = "1.0.0"
KNOWN_VLLM = ("0.21.", "0.22.")
MODE_ENV = "DSV4_EAGLE3_OVERLAY"
DTYPE_ENV = "EAGLE3_DRAFT_KV_CACHE_DTYPE"
PROPOSER = "vllm.v1.spec_decode.llm_base_proposer"
KV_UTILS = "vllm.v1.core.kv_cache_utils"

PATCHES: dict[str, dict[str, str]] = {}
"""What happened to each named patch in this process: target, status, detail. Status is
applied | native | refused | off | skipped | failed."""

PLAN = {
    "draft-cache-config": f"{PROPOSER}.SpecDecodeBaseProposer._create_draft_vllm_config",
    "kv-groups": f"{KV_UTILS}.get_kv_cache_groups",
    "kv-tensors": f"{KV_UTILS}._get_kv_cache_config_deepseek_v4",
    "kv-memory-check": f"{KV_UTILS}._max_memory_usage_bytes_from_groups",
    "kv-pool-bytes": f"{KV_UTILS}._pool_bytes_per_block",
}
"""Patch name -> replaced object, for vLLM 0.21/0.22."""

_HOOKS: dict[str, list] = {}
_finder = None
_kvi = None  # vllm.v1.kv_cache_interface, bound when kv_cache_utils is patched


# --------------------------------------------------------------------------- infrastructure
def record(name: str, target: str, status: str, detail: str = "") -> None:
    """Note a patch outcome; failures and refusals also warn (never raise)."""
    PATCHES[name] = {"target": target, "status": status, "detail": detail}
    msg = f"DeepSeek-V4 EAGLE-3 overlay: {name} {status}" + (f": {detail}" if detail else "")
    if status in ("failed", "refused"):
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    else:
        _info(msg)


def _info(msg: str, *args) -> None:
    """Log through vLLM's logger tree (imported lazily: keeps interpreter start-up cheap)."""
    import logging

    logging.getLogger("vllm.dsv4_eagle3_overlay").info(msg, *args)


def mode() -> str:
    """``auto`` | ``force`` | ``off`` from ``DSV4_EAGLE3_OVERLAY`` (unknown values: auto)."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower()
    return value if value in ("auto", "force", "off") else "auto"


def vllm_version() -> str:
    """Version of the vLLM being imported (``vllm.version``, already loaded by ``vllm``)."""
    import importlib

    return str(getattr(importlib.import_module("vllm.version"), "__version__", "unknown"))


def gate() -> str:
    """``patch`` (known version), ``force``, ``refuse`` (unknown version) or ``off``."""
    if mode() == "off":
        return "off"
    if vllm_version().startswith(KNOWN_VLLM):
        return "patch"
    return "force" if mode() == "force" else "refuse"


def draft_kv_cache_dtype() -> str:
    """The draft KV dtype the overlay gives an EAGLE draft next to a DeepSeek-V4 target."""
    return os.environ.get(DTYPE_ENV, "").strip() or "auto"


class _Loader:
    """Runs the real loader, then the hooks registered for the module."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for hook in _HOOKS.get(module.__name__, ()):
            _run(hook, module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _Finder:
    """Wraps the loader of hooked modules; every other import passes through untouched."""

    def __init__(self):
        self.busy: set[str] = set()  # guards against finders that call find_spec themselves

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _HOOKS or fullname in self.busy:
            return None
        self.busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader)
                    return spec
            return None
        finally:
            self.busy.discard(fullname)


def _run(hook, module) -> None:
    try:
        hook(module)
    except Exception as e:  # noqa: BLE001 (a broken patch must never break vLLM's import)
        record(hook.__name__, module.__name__, "failed", f"{type(e).__name__}: {e}")


def when_imported(module_name: str, hook) -> None:
    """Call ``hook(module)`` right after ``module_name`` executes (now if already imported)."""
    global _finder
    if _finder is None:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)
    hooks = _HOOKS.setdefault(module_name, [])
    if hook in hooks:
        return
    hooks.append(hook)
    module = sys.modules.get(module_name)
    if module is not None:
        _run(hook, module)


def _wrap(orig, impl):
    """``orig``'s stand-in calling ``impl(orig, *args)``; ``__wrapped__`` keeps ``orig``."""

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        return impl(orig, *args, **kwargs)

    return wrapper


def _replace(obj, patches: dict[str, tuple[str, object]], target_prefix: str) -> None:
    """Set ``obj.<attr> = _wrap(old, impl)`` for every named patch, all or none."""
    missing = [attr for attr, _ in patches.values() if not hasattr(obj, attr)]
    if missing:
        for name in patches:
            record(name, f"{target_prefix}.{patches[name][0]}", "failed",
                   f"not found in vLLM {vllm_version()}: {', '.join(missing)}")
        return
    for name, (attr, impl) in patches.items():
        setattr(obj, attr, _wrap(getattr(obj, attr), impl))
        record(name, f"{target_prefix}.{attr}", "applied")


def _gated(names) -> bool:
    """Whether to patch now; for versions the gate turns away, notes why (quietly)."""
    decision = gate()
    if decision in ("patch", "force"):
        return True
    detail = (f"{MODE_ENV}=off" if decision == "off" else
              f"vLLM {vllm_version()} is not 0.21.x/0.22.x ({MODE_ENV}=force to patch anyway)")
    for name in names:
        PATCHES[name] = {"target": PLAN[name], "status": "off" if decision == "off" else
                         "skipped", "detail": detail}
    return False


# --------------------------------------------------------------------------- draft cache config
def _own_draft_dtype(proposer) -> str | None:
    """KV dtype for the draft's own CacheConfig, or None to keep vLLM's behaviour."""
    if proposer.method not in ("eagle", "eagle3"):
        return None  # MTP drafts are DeepSeek-V4 layers: they must share the target's layout
    hf = getattr(getattr(proposer.vllm_config, "model_config", None), "hf_config", None)
    if not os.environ.get(DTYPE_ENV, "").strip() and getattr(hf, "model_type", "") != "deepseek_v4":
        return None
    from typing import get_args

    from vllm.config.cache import CacheDType

    dtype = draft_kv_cache_dtype()
    if dtype not in get_args(CacheDType):
        raise ValueError(f"{DTYPE_ENV}={dtype!r} is not a vLLM KV-cache dtype; "
                         f"choose one of {', '.join(get_args(CacheDType))}")
    return dtype


def _draft_config(orig, proposer):
    """``_create_draft_vllm_config`` whose result carries the draft's own CacheConfig."""
    import copy

    draft = orig(proposer)
    dtype = _own_draft_dtype(proposer)
    if dtype is None:
        return draft
    from vllm.transformers_utils.config import is_interleaved

    model = proposer.speculative_config.draft_model_config
    cache = copy.copy(draft.cache_config)
    cache.cache_dtype = dtype
    # As EngineArgs does for a main model: a window only for all-sliding-window models.
    cache.sliding_window = None if is_interleaved(model.hf_text_config) else (
        model.get_sliding_window())
    if draft is proposer.vllm_config:
        draft = copy.copy(draft)
    object.__setattr__(draft, "cache_config", cache)
    _info("DeepSeek-V4 EAGLE-3 overlay: draft KV cache dtype %s, sliding window %s "
          "(target keeps %s)", dtype, cache.sliding_window,
          proposer.vllm_config.cache_config.cache_dtype)
    return draft


def patch_proposer(module) -> None:
    """Import hook for ``llm_base_proposer``."""
    if _gated(["draft-cache-config"]):
        _replace(module.SpecDecodeBaseProposer,
                 {"draft-cache-config": ("_create_draft_vllm_config", _draft_config)},
                 f"{module.__name__}.SpecDecodeBaseProposer")


# --------------------------------------------------------------------------- KV-cache layout
def _is_v4_spec(spec) -> bool:
    """A DeepSeek-V4 cache spec: SWA/compressor state or a compressed (C4/C128/indexer) MLA."""
    return isinstance(spec, _kvi.SlidingWindowMLASpec) or (
        isinstance(spec, _kvi.MLAAttentionSpec) and spec.compress_ratio > 1)


def _draft_layers(specs: dict) -> dict:
    """Layers a DeepSeek-V4 layout leaves out (the draft's), or {} for other layouts."""
    if not any(isinstance(s, _kvi.SlidingWindowMLASpec) for s in specs.values()):
        return {}
    return {name: spec for name, spec in specs.items() if not _is_v4_spec(spec)}


def _split(groups):
    """(groups with group 0 cut down to its DeepSeek-V4 layers, the draft specs cut out)."""
    if len(groups) < 2 or not all(
            isinstance(g.kv_cache_spec, _kvi.UniformTypeKVCacheSpecs) for g in groups):
        return groups, {}
    first = groups[0]
    extra = {n: s for n, s in first.kv_cache_spec.kv_cache_specs.items() if not _is_v4_spec(s)}
    if not extra:
        return groups, {}
    specs = {n: s for n, s in first.kv_cache_spec.kv_cache_specs.items() if n not in extra}
    cut = _kvi.KVCacheGroupSpec(
        [n for n in first.layer_names if n not in extra],
        _kvi.UniformTypeKVCacheSpecs(block_size=first.kv_cache_spec.block_size,
                                     kv_cache_specs=specs),
        is_eagle_group=first.is_eagle_group)
    return [cut, *groups[1:]], extra


def _kv_groups(orig, vllm_config, kv_cache_spec):
    """``get_kv_cache_groups`` that puts the draft's layers into the full-MLA group 0."""
    extra = _draft_layers(kv_cache_spec)
    if not extra or vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        return orig(vllm_config, kv_cache_spec)
    groups = orig(vllm_config, {n: s for n, s in kv_cache_spec.items() if n not in extra})
    first = groups[0]  # the full-MLA group (C4/C128 attention and indexer caches)
    block_size = first.kv_cache_spec.block_size
    for name, spec in extra.items():
        if not (isinstance(first.kv_cache_spec, _kvi.UniformTypeKVCacheSpecs)
                and isinstance(spec, _kvi.FullAttentionSpec) and spec.sliding_window is None
                and spec.attention_chunk_size is None and spec.block_size == block_size):
            raise NotImplementedError(
                f"DeepSeek-V4 EAGLE-3 overlay: draft layer {name} has {spec}; only "
                f"full-attention draft layers with block_size {block_size} can join the "
                "DeepSeek-V4 KV layout")
    groups[0] = _kvi.KVCacheGroupSpec(
        [*first.layer_names, *extra],
        _kvi.UniformTypeKVCacheSpecs(block_size=block_size,
                                     kv_cache_specs={**first.kv_cache_spec.kv_cache_specs,
                                                     **extra}))
    spec_config = vllm_config.speculative_config
    if spec_config is not None and spec_config.use_eagle():
        for i, group in enumerate(groups):  # the EAGLE last-block drop goes to the draft's group
            group.is_eagle_group = i == 0
    return groups


def _kv_tensors(orig, vllm_config, kv_cache_groups, available_memory):
    """DeepSeek-V4 tensor layout plus one ``page_size * num_blocks`` tensor per draft layer."""
    groups, extra = _split(kv_cache_groups)
    if not extra:
        return orig(vllm_config, kv_cache_groups, available_memory)
    num_blocks, tensors = orig(vllm_config, groups, available_memory)
    if num_blocks > 0:  # each pool block now also holds one page of every draft layer
        v4_bytes = sum(t.size for t in tensors) // num_blocks
        extra_bytes = sum(s.page_size_bytes for s in extra.values())
        budget = available_memory // (v4_bytes + extra_bytes) * v4_bytes
        num_blocks, tensors = orig(vllm_config, groups, budget)
    tensors = tensors + [_kvi.KVCacheTensor(size=s.page_size_bytes * num_blocks, shared_by=[n])
                         for n, s in extra.items()]
    return num_blocks, tensors


def _kv_memory(orig, vllm_config, kv_cache_groups):
    """Max KV bytes for one request, counting the draft's page in every pool block."""
    groups, extra = _split(kv_cache_groups)
    if not extra:
        return orig(vllm_config, kv_cache_groups)
    pages = sum(g.kv_cache_spec.max_memory_usage_pages(vllm_config) for g in groups)
    return orig(vllm_config, groups) + pages * sum(s.page_size_bytes for s in extra.values())


def _kv_pool_bytes(orig, kv_cache_groups):
    """Bytes per pool block, draft pages included."""
    groups, extra = _split(kv_cache_groups)
    return orig(groups) + sum(s.page_size_bytes for s in extra.values())


def patch_kv_cache_utils(module) -> None:
    """Import hook for ``kv_cache_utils``."""
    global _kvi
    if not _gated(["kv-groups", "kv-tensors", "kv-memory-check", "kv-pool-bytes"]):
        return
    import vllm.v1.kv_cache_interface as kvi

    _kvi = kvi
    _replace(module, {
        "kv-groups": ("get_kv_cache_groups", _kv_groups),
        "kv-tensors": ("_get_kv_cache_config_deepseek_v4", _kv_tensors),
        "kv-memory-check": ("_max_memory_usage_bytes_from_groups", _kv_memory),
        "kv-pool-bytes": ("_pool_bytes_per_block", _kv_pool_bytes),
    }, module.__name__)


# --------------------------------------------------------------------------- entry point
def installed() -> bool:
    """Whether ``install()`` ran in this process."""
    return _finder is not None


def install() -> None:
    """Register the import hooks (idempotent; imports neither torch nor vLLM)."""
    when_imported(PROPOSER, patch_proposer)
    when_imported(KV_UTILS, patch_kv_cache_utils)
