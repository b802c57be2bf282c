"""Draft KV cache for an EAGLE-3 draft next to a DeepSeek-V4 target in vLLM 0.21-0.34.

Overlay part 2 of 2 (part 1, ``deepseek_v4_eagle3_aux``, imports this one). ``install()``
only registers import hooks: nothing from vLLM or torch is imported until vLLM imports the
module a patch targets, and the patch is applied right after that module has executed.

What to patch is decided per feature from vLLM's own source (``Source``: the live objects
in-process, or a wheel / source tree without importing it), never from the version string:

* ``draft-kv-dtype``: where ``SpeculativeConfig`` has no ``kv_cache_dtype`` (<= 0.25) the
  ``draft-cache-config`` patch gives an eagle/eagle3 draft next to a DeepSeek-V4 target its
  own ``CacheConfig`` copy with ``EAGLE3_DRAFT_KV_CACHE_DTYPE`` (default ``auto``); the target
  keeps ``fp8_ds_mla``. Where it has one (>= 0.26) that option is native; the overlay fills
  it from the variable (or ``auto``) only when the user left it unset.
* ``draft-window``: every release gives the draft the target's cache config, hence
  DeepSeek-V4's 128-token sliding window; the same patch gives the draft its own window.
* Where the draft's config is made: ``SpecDecodeBaseProposer._create_draft_vllm_config``
  (<= 0.33, wrapped by ``draft-cache-config``); from 0.34 (Model Runner V2 only)
  ``load_eagle_model`` builds the draft from ``SpeculativeConfig.apply_draft_overrides``, and
  ``draft-overrides`` wraps that: it fills ``speculative_config.kv_cache_dtype`` when unset
  (what vLLM's own ``Glm5NextModelConfig`` does, so the draft's attention metadata builders,
  ``BaseSpeculator.attn_vllm_config``, see the same dtype) and gives the draft its window.
* ``kv-grouping``: where the DeepSeek-V4 grouping keeps only MLA specs (<= 0.28) it drops the
  draft's ``FullAttentionSpec`` ("Some layers are not assigned to any group."). The draft
  layers join the full-MLA group 0 (``kv-groups``) and are counted once per pool block in
  the memory check (``kv-memory-check``); where the V4 planner lays pages out per layer tuple
  (<= 0.22) each draft layer also gets one dedicated tensor (``kv-tensors``,
  ``kv-pool-bytes``). From 0.29 the grouping is generic: nothing to do.

Environment: ``EAGLE3_DRAFT_KV_CACHE_DTYPE`` (draft KV dtype), ``DSV4_EAGLE3_OVERLAY`` =
``auto`` (default) | ``off`` (``force`` is accepted and means ``auto``).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

OVERLAY_VERSION = "2.2.0"
MODE_ENV = "DSV4_EAGLE3_OVERLAY"
DTYPE_ENV = "EAGLE3_DRAFT_KV_CACHE_DTYPE"
PROPOSER = "vllm.v1.spec_decode.llm_base_proposer"
EAGLE_LOADER = "vllm.v1.worker.gpu.spec_decode.eagle.utils"  # Model Runner V2's EAGLE loader
SPEC_CONFIG = "vllm.config.speculative"
KV_UTILS = "vllm.v1.core.kv_cache_utils"
KV_PLANNING = "vllm.v1.core.kv_cache_planning"  # vLLM >= 0.33 plans the KV cache here
KV_MODULES = (KV_PLANNING, KV_UTILS)
BREAKABLE = "vllm.compilation.breakable_cudagraph"  # vLLM >= 0.22: breakable CUDA graphs
VLLM_CONFIG = "vllm.config.vllm"

PATCHES: dict[str, dict[str, str]] = {}
"""What happened to each named patch in this process: target, status (applied | off |
failed), detail."""

PLAN: dict[str, dict] = {}
"""The per-feature plan decided in this process: scope (a platform or ``engine``) ->
feature -> {action, patches, detail}."""

FACTS: dict[str, dict] = {}
"""The facts each plan of this process was decided from: a platform, ``draft`` or ``kv``."""

_HOOKS: dict[str, list] = {}
_finder = None
_kvi = None  # vllm.v1.kv_cache_interface, bound when the KV module is patched
_native_draft_dtype = False  # SpeculativeConfig.kv_cache_dtype exists (bound with the patch)
_installing = False  # install() is registering its hooks (a hook that runs now: preloaded)


# --------------------------------------------------------------------------- infrastructure
def record(name: str, target: str, status: str, detail: str = "") -> None:
    """Note a patch outcome; failures also warn (never raise)."""
    PATCHES[name] = {"target": target, "status": status, "detail": detail}
    msg = f"DeepSeek-V4 EAGLE-3 overlay: {name} {status}" + (f": {detail}" if detail else "")
    if status == "failed":
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    else:
        _info(msg)


def adopt(scope: str, plan: dict, facts_key: str, facts: dict) -> dict[str, str]:
    """Make ``plan`` (decided from ``facts``, kept as ``FACTS[facts_key]``) this process's
    plan for ``scope``; say what is native or refused (a refusal warns) and note every
    planned patch as ``off`` when the overlay is disabled. Returns patch name -> target."""
    FACTS[facts_key] = facts
    PLAN.setdefault(scope, {}).update(plan)
    for feature, entry in plan.items():
        if entry["action"] == "refused" and mode() != "off":
            warnings.warn(f"DeepSeek-V4 EAGLE-3 overlay: {feature} refused on vLLM "
                          f"{vllm_version()} ({scope}): {entry['detail']}", RuntimeWarning,
                          stacklevel=3)
        elif entry["action"] in ("native", "not needed"):
            _info("DeepSeek-V4 EAGLE-3 overlay: %s %s (%s): %s", feature, entry["action"],
                  scope, entry["detail"])
    targets = plan_patches(plan)
    if mode() == "off":
        for name, target in targets.items():
            record(name, target, "off", f"{MODE_ENV}=off")
    return targets


def module_exists(name: str) -> bool:
    """Whether ``name`` can be imported (its parent packages are imported to find out)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _info(msg: str, *args) -> None:
    """Log through vLLM's logger tree (imported lazily: keeps interpreter start-up cheap)."""
    import logging

    logging.getLogger("vllm.dsv4_eagle3_overlay").info(msg, *args)


def mode() -> str:
    """``auto`` | ``off`` from ``DSV4_EAGLE3_OVERLAY`` (``force`` and unknown values: auto)."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower()
    return "off" if value == "off" else "auto"


def vllm_version() -> str:
    """Version of the vLLM being imported (``vllm.version``, already loaded by ``vllm``)."""
    import importlib

    return str(getattr(importlib.import_module("vllm.version"), "__version__", "unknown"))


def draft_kv_cache_dtype() -> str:
    """The draft KV dtype the overlay gives when the engine options leave it open."""
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


# --------------------------------------------------------------------------- reading vLLM's source
class Source:
    """vLLM's source, one AST node per ``module`` + ``qualname`` (``Class.method``).

    ``Source(path)`` reads a tree that holds ``vllm/`` or a wheel (zip) without importing
    anything; ``Source()`` reads the objects of the imported modules (``inspect.getsource``
    of the live class or function, unwrapping the overlay's own wrappers), so the in-process
    plan and the static plan are decided from the same facts."""

    def __init__(self, path=None):
        self.path = path
        self._trees: dict[str, object] = {}
        self._zip = None
        if path is not None and not os.path.isdir(path):
            import zipfile

            self._zip = zipfile.ZipFile(path)

    def text(self, module: str) -> str | None:
        """A module's source text (static) or None when the release has no such module."""
        rel = module.replace(".", "/") + ".py"
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode()
            except KeyError:
                return None
        full = os.path.join(self.path, rel)
        if not os.path.isfile(full):
            return None
        with open(full, encoding="utf-8") as f:
            return f.read()

    def has_module(self, module: str) -> bool:
        if self.path is None:
            return module in sys.modules
        return self.text(module) is not None

    def node(self, module: str, qualname: str):
        """The ``ClassDef``/``FunctionDef`` (or alias ``Assign``) named ``qualname``."""
        import ast

        if self.path is None:
            return self._live_node(module, qualname)
        if module not in self._trees:
            text = self.text(module)
            self._trees[module] = None if text is None else ast.parse(text)
        node = self._trees[module]
        for part in qualname.split("."):
            node = None if node is None else _child(node, part)
        return node

    @staticmethod
    def _live_node(module: str, qualname: str):
        import ast
        import inspect
        import textwrap

        obj = sys.modules.get(module)
        for part in qualname.split("."):
            obj = None if obj is None else (vars(obj).get(part) if isinstance(obj, type)
                                            else getattr(obj, part, None))
        if obj is None or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            return None
        return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(obj)))).body[0]


def _child(node, name: str):
    import ast

    for child in node.body:
        if isinstance(child, (ast.ClassDef, ast.FunctionDef)) and child.name == name:
            return child
        if isinstance(child, ast.Assign) and any(
                getattr(t, "id", None) == name for t in child.targets):
            return child
    return None


def calls(node) -> list[str]:
    """What a function calls, as written (``layer.hc_post``, ``mhc_post_tilelang``...)."""
    import ast

    if node is None:
        return []
    return sorted({ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)})


def params(node) -> list[str] | None:
    """Positional parameter names of a function node (None if there is no function)."""
    import ast

    if not isinstance(node, ast.FunctionDef):
        return None
    return [a.arg for a in (*node.args.posonlyargs, *node.args.args)]


def mentions(node, name: str) -> bool:
    """Whether ``name`` occurs in the node as a name, attribute or string."""
    import ast

    return node is not None and any(
        getattr(n, "id", None) == name or getattr(n, "attr", None) == name
        or getattr(n, "value", None) == name for n in ast.walk(node))


# --------------------------------------------------------------------------- draft cache config
MAKERS = {  # what makes the draft's VllmConfig -> (patch name, module)
    "SpecDecodeBaseProposer._create_draft_vllm_config": ("draft-cache-config", PROPOSER),
    "SpeculativeConfig.apply_draft_overrides": ("draft-overrides", SPEC_CONFIG),
}


def draft_facts(src: Source) -> dict:
    """What the plan needs to know about the draft's cache config."""
    make = src.node(PROPOSER, "SpecDecodeBaseProposer._create_draft_vllm_config")
    maker = "SpecDecodeBaseProposer._create_draft_vllm_config" if make is not None else None
    if make is None and "speculative_config.apply_draft_overrides" in calls(
            src.node(EAGLE_LOADER, "load_eagle_model")):
        maker = "SpeculativeConfig.apply_draft_overrides"
        make = src.node(SPEC_CONFIG, maker)
    spec = src.node(SPEC_CONFIG, "SpeculativeConfig")
    return {
        "draft_config_maker": maker,
        "speculative_kv_cache_dtype": spec is not None and any(
            getattr(getattr(n, "target", None), "id", None) == "kv_cache_dtype"
            for n in spec.body),
        "draft_sets_sliding_window": mentions(make, "sliding_window"),
    }


def draft_plan(facts: dict) -> dict:
    """``draft-kv-dtype`` and ``draft-window``: native | patched | not needed | refused."""
    maker = facts["draft_config_maker"]
    if maker is None:
        detail = ("neither SpecDecodeBaseProposer._create_draft_vllm_config (<= 0.33) nor a "
                  f"{EAGLE_LOADER}.load_eagle_model that calls "
                  "speculative_config.apply_draft_overrides (0.34) makes the draft's config: "
                  "no patch point; use vLLM 0.21-0.34")
        return dict.fromkeys(("draft-kv-dtype", "draft-window"),
                             plan_entry("refused", {}, detail))
    name, module = MAKERS[maker]
    patch = {name: f"{module}.{maker}"}
    if facts["speculative_kv_cache_dtype"]:
        applied = (" (applied by apply_draft_overrides and BaseSpeculator.attn_vllm_config)"
                   if name == "draft-overrides" else "")
        dtype = plan_entry("native", patch, (
            f"speculative_config.kv_cache_dtype{applied}; left unset, the overlay sets it to "
            f"${DTYPE_ENV} or auto (the target's fp8_ds_mla fits no draft attention)"))
    else:
        dtype = plan_entry("patched", patch, (
            f"SpeculativeConfig has no kv_cache_dtype: the draft gets its own CacheConfig, "
            f"cache_dtype ${DTYPE_ENV} (default auto)"))
    if facts["draft_sets_sliding_window"]:
        window = plan_entry("not needed", {}, "the draft's cache config sets its own window")
    else:
        window = plan_entry("patched", patch, (
            "the draft would inherit the target's sliding window (128 for DeepSeek-V4); "
            "it gets the window vLLM gives it as a main model"
            + (" (apply_draft_overrides overrides no window)" if name == "draft-overrides"
               else "")))
    return {"draft-kv-dtype": dtype, "draft-window": window}


def plan_entry(action: str, patches: dict, detail: str) -> dict:
    """One feature's plan: native | patched | not needed | refused, the patches (name ->
    replaced object) and why."""
    return {"action": action, "patches": dict(patches), "detail": detail}


def _applies(method: str, target) -> bool:
    """An eagle/eagle3 draft next to a DeepSeek-V4 target (``target``: its VllmConfig), or
    the dtype variable is set."""
    if method not in ("eagle", "eagle3"):
        return False  # MTP drafts are DeepSeek-V4 layers: they must share the target's layout
    hf = getattr(getattr(target, "model_config", None), "hf_config", None)
    return bool(os.environ.get(DTYPE_ENV, "").strip()) or (
        getattr(hf, "model_type", "") == "deepseek_v4")


def _checked_dtype(dtype: str, source: str) -> str:
    from typing import get_args

    from vllm.config.cache import CacheDType

    if dtype not in get_args(CacheDType):
        raise ValueError(f"{source}={dtype!r} is not a vLLM KV-cache dtype; "
                         f"choose one of {', '.join(get_args(CacheDType))}")
    return dtype


def _overlay_dtype() -> tuple[str, str]:
    """(``$EAGLE3_DRAFT_KV_CACHE_DTYPE`` or ``auto``, checked; where it came from)."""
    env = os.environ.get(DTYPE_ENV, "").strip()
    return _checked_dtype(env or "auto", DTYPE_ENV), DTYPE_ENV if env else "overlay default"


def _native_dtype(native: str) -> tuple[str, str]:
    """The user's ``speculative_config.kv_cache_dtype``, which beats the variable."""
    env = os.environ.get(DTYPE_ENV, "").strip()
    if env:
        _info("DeepSeek-V4 EAGLE-3 overlay: %s=%s ignored: speculative_config."
              "kv_cache_dtype=%s is set", DTYPE_ENV, env, native)
    return native, "speculative_config.kv_cache_dtype"


def _own_cache(draft, target, spec, dtype: str, source: str):
    """``draft`` (the draft's VllmConfig) with its own CacheConfig: ``dtype`` and the
    sliding window vLLM gives the draft model as a main model; ``target`` is untouched."""
    import copy

    model = spec.draft_model_config
    cache = copy.copy(draft.cache_config)
    cache.cache_dtype = dtype
    # As EngineArgs does for a main model: a window only for all-sliding-window models.
    layer_types = getattr(model.hf_text_config, "layer_types", None)
    cache.sliding_window = model.get_sliding_window() if layer_types is None or all(
        t == "sliding_attention" for t in layer_types) else None
    if draft is target:
        draft = copy.copy(draft)
    object.__setattr__(draft, "cache_config", cache)
    _info("DeepSeek-V4 EAGLE-3 overlay: draft KV cache dtype %s (%s), sliding window %s "
          "(target keeps %s, window %s)", dtype, source, cache.sliding_window,
          target.cache_config.cache_dtype, target.cache_config.sliding_window)
    return draft


def _draft_config(orig, proposer):
    """``_create_draft_vllm_config`` whose result carries the draft's own CacheConfig: the
    dtype the engine options give (native ``speculative_config.kv_cache_dtype``), else
    ``$EAGLE3_DRAFT_KV_CACHE_DTYPE`` or ``auto``, and the draft's own sliding window."""
    draft = orig(proposer)
    if not _applies(proposer.method, proposer.vllm_config):
        return draft
    spec = proposer.speculative_config
    native = getattr(spec, "kv_cache_dtype", None) if _native_draft_dtype else None
    # native: vLLM has already applied it (>= 0.26); else what >= 0.26 does with the option
    dtype, source = _native_dtype(native) if native is not None else _overlay_dtype()
    return _own_cache(draft, proposer.vllm_config, spec, dtype, source)


def _draft_overrides(orig, spec, vllm_config):
    """``SpeculativeConfig.apply_draft_overrides`` (vLLM 0.34: the config ``load_eagle_model``
    builds the draft with): ``kv_cache_dtype`` filled in when unset, as vLLM's own
    ``Glm5NextModelConfig`` does, so ``BaseSpeculator.attn_vllm_config`` agrees; then the
    draft's own sliding window."""
    if not _applies(spec.method, vllm_config):
        return orig(spec, vllm_config)
    if spec.kv_cache_dtype is None:
        spec.kv_cache_dtype, source = _overlay_dtype()
    else:
        _, source = _native_dtype(spec.kv_cache_dtype)
    return _own_cache(orig(spec, vllm_config), vllm_config, spec, spec.kv_cache_dtype, source)


DRAFT_IMPLS = {"draft-cache-config": _draft_config, "draft-overrides": _draft_overrides}


def _patch_draft() -> None:
    """Decide ``draft-kv-dtype``/``draft-window`` from the live classes; apply the plan."""
    global _native_draft_dtype
    import importlib

    importlib.import_module(SPEC_CONFIG)  # read below; vLLM has imported it already
    facts = draft_facts(Source())
    plan = draft_plan(facts)
    targets = adopt("engine", plan, "draft", facts)
    if mode() == "off" or not targets:
        return
    _native_draft_dtype = plan["draft-kv-dtype"]["action"] == "native"
    for name, target in targets.items():
        module, cls, attr = target.rsplit(".", 2)
        owner = getattr(sys.modules[module], cls)
        setattr(owner, attr, _wrap(getattr(owner, attr), DRAFT_IMPLS[name]))
        record(name, target, "applied")


def patch_proposer(module) -> None:
    """Import hook for ``llm_base_proposer`` (<= 0.33): the draft's own cache config."""
    _patch_draft()


def patch_eagle_loader(module) -> None:
    """Import hook for Model Runner V2's EAGLE loader: the draft's own cache config where
    ``llm_base_proposer`` is gone (0.34); before, that module's hook does it."""
    if not module_exists(PROPOSER):
        _patch_draft()


def plan_patches(plan: dict) -> dict[str, str]:
    """Patch name -> replaced object over a plan's features."""
    return {k: v for entry in plan.values() for k, v in entry["patches"].items()}


# --------------------------------------------------------------------------- KV-cache layout
_SLOT_LAYOUTS = ("_bucket_layers_by_page_size", "_get_packed_kv_cache_layout")
_TUPLE_LAYOUTS = ("full_mla_spec.get_page_sizes",)


def _layout(node) -> str:
    """How a KV planner places pages: one slot per layer, or per DeepSeek-V4 layer tuple."""
    called = calls(node)
    if any(c in called for c in _SLOT_LAYOUTS):
        return "per-layer-slots"
    if any(c in called for c in _TUPLE_LAYOUTS):
        return "layer-tuples"
    return "unknown"


def kv_facts(src: Source) -> dict:
    """What the plan needs to know about vLLM's KV-cache grouping and layout."""
    import ast

    module = next((m for m in KV_MODULES if src.node(m, "get_kv_cache_groups")), KV_UTILS)
    groups = src.node(module, "get_kv_cache_groups")
    grouping = src.node(module, "group_and_unify_kv_cache_specs")
    called = calls(groups)
    planner = next((c for c in calls(src.node(module, "get_kv_cache_config_from_groups"))
                    if c.startswith("_get_kv_cache_config_")), None)
    pool = src.node(module, "_pool_bytes_per_block")
    keeps = None
    if grouping is not None:
        keeps = sorted({ast.unparse(n.args[1]) for n in ast.walk(grouping)
                        if isinstance(n, ast.Call) and ast.unparse(n.func) == "isinstance"})
    if "group_and_unify_kv_cache_specs" in called:
        kind = "deepseek-v4-mla-only" if keeps == ["MLAAttentionSpec",
                                                   "SlidingWindowMLASpec"] else "unknown"
    elif "_get_packed_kv_cache_groups" in called:
        kind = "generic"
    else:
        kind = "unknown"
    return {
        "kv_module": module,
        "grouping": kind,
        "v4_grouping_keeps": keeps,
        "get_kv_cache_groups_params": params(groups),
        "planner": planner,
        "planner_params": params(src.node(module, planner)) if planner else None,
        "planner_layout": _layout(src.node(module, planner)) if planner else None,
        "pool_bytes_params": params(pool),
        "pool_bytes_layout": _layout(pool),
        "memory_params": params(src.node(module, "_max_memory_usage_bytes_from_groups")),
    }


KV_GROUPS_PARAMS = ["vllm_config", "kv_cache_spec"]
KV_MEMORY_PARAMS = ["vllm_config", "kv_cache_groups"]
KV_PLANNER_PARAMS = ["vllm_config", "kv_cache_groups", "available_memory"]
KV_POOL_PARAMS = ["kv_cache_groups"]


def kv_plan(facts: dict) -> dict:
    """``kv-grouping``: native (generic grouping) | patched | refused, with its patches."""
    m = facts["kv_module"]
    if facts["grouping"] == "generic":
        return {"kv-grouping": plan_entry("not needed", {}, (
            "get_kv_cache_groups packs any mix of specs (_get_packed_kv_cache_groups): the "
            "draft's full-attention layer is grouped like any other"))}
    advice = "use vLLM 0.21-0.28 with this overlay, or >= 0.29 (generic grouping)"
    if facts["grouping"] != "deepseek-v4-mla-only":
        return {"kv-grouping": plan_entry("refused", {}, (
            f"get_kv_cache_groups in {m} groups in a way the overlay does not know; {advice}"))}
    wrong = [f"{name}{got}" for name, got, want in (
        ("get_kv_cache_groups", facts["get_kv_cache_groups_params"], KV_GROUPS_PARAMS),
        ("_max_memory_usage_bytes_from_groups", facts["memory_params"], KV_MEMORY_PARAMS))
        if got != want]
    patches = {"kv-groups": f"{m}.get_kv_cache_groups",
               "kv-memory-check": f"{m}._max_memory_usage_bytes_from_groups"}
    if (facts["planner_layout"], facts["pool_bytes_layout"]) == ("layer-tuples",) * 2:
        patches |= {"kv-tensors": f"{m}.{facts['planner']}",
                    "kv-pool-bytes": f"{m}._pool_bytes_per_block"}
        wrong += [f"{name}{got}" for name, got, want in (
            (facts["planner"], facts["planner_params"], KV_PLANNER_PARAMS),
            ("_pool_bytes_per_block", facts["pool_bytes_params"], KV_POOL_PARAMS))
            if got != want]
        layout = (f"{facts['planner']} lays pages out per layer tuple: each draft layer gets a "
                  "tensor of its own")
    elif (facts["planner_layout"], facts["pool_bytes_layout"]) == ("per-layer-slots",) * 2:
        layout = (f"{facts['planner']} (the planner get_kv_cache_config_from_groups calls) "
                  "gives every layer of group 0 its own page slot: no tensor patch needed")
    else:
        wrong.append(f"page layout {facts['planner']}={facts['planner_layout']}, "
                     f"_pool_bytes_per_block={facts['pool_bytes_layout']}")
        layout = ""
    if wrong:
        return {"kv-grouping": plan_entry("refused", {}, (
            f"{m} differs from what the KV patches were written for ({'; '.join(wrong)}); "
            f"{advice}"))}
    return {"kv-grouping": plan_entry("patched", patches, (
        "group_and_unify_kv_cache_specs keeps only MLA specs for DeepSeek-V4: the draft's "
        f"full-attention layers join group 0; {layout}"))}


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


KV_IMPLS = {"kv-groups": _kv_groups, "kv-tensors": _kv_tensors,
            "kv-memory-check": _kv_memory, "kv-pool-bytes": _kv_pool_bytes}


def patch_kv_cache(module) -> None:
    """Import hook for the KV-cache planning modules: the draft's layers join the V4 layout."""
    global _kvi
    if module.__name__ == KV_UTILS and not hasattr(module, "get_kv_cache_groups") and (
            module_exists(KV_PLANNING)):
        return  # vLLM >= 0.33: the grouping lives in kv_cache_planning (hooked too)
    facts = kv_facts(Source())
    plan = kv_plan(facts)
    targets = adopt("engine", plan, "kv", facts)
    if mode() == "off" or not targets:
        return
    import vllm.v1.kv_cache_interface as kvi

    _kvi = kvi
    for name, target in targets.items():
        owner, attr = target.rsplit(".", 1)
        owner = sys.modules[owner]
        setattr(owner, attr, _wrap(getattr(owner, attr), KV_IMPLS[name]))
        record(name, target, "applied")


# --------------------------------------------------------------------------- eager breaks
def breakable_facts(src: Source) -> dict:
    """Whether ``eager_break_during_capture`` decides when an op is decorated (at the import
    of its module) that breakable CUDA graphs are off and returns the op unwrapped
    (``if not is_breakable_cudagraph_enabled(): return fn``, 0.22-0.32; 0.33 always wraps),
    and whether ``VllmConfig`` turns them on itself (``os.environ[...] = "1"`` for
    DeepSeek-V4, 0.23-0.32), which happens after the model's modules were imported."""
    import ast

    fn = src.node(BREAKABLE, "eager_break_during_capture")
    config = src.node(VLLM_CONFIG, "VllmConfig")
    return {
        "eager_break": fn is not None,
        "decides_at_decoration": isinstance(fn, ast.FunctionDef) and any(
            isinstance(n, ast.If) and mentions(n.test, "is_breakable_cudagraph_enabled")
            and any(isinstance(b, ast.Return) for b in n.body) for n in fn.body),
        "auto_enables": config is not None and any(
            isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Subscript) and mentions(t.value, "environ")
                and mentions(t.slice, "VLLM_USE_BREAKABLE_CUDAGRAPH") for t in n.targets)
            for n in ast.walk(config)),
    }


def breakable_plan(facts: dict) -> dict:
    """``eager-breaks``: not needed | native | patched."""
    if not facts["eager_break"]:
        return {"eager-breaks": plan_entry("not needed", {}, "no breakable CUDA graphs")}
    if not facts["decides_at_decoration"]:
        return {"eager-breaks": plan_entry("native", {}, (
            "eager_break_during_capture always wraps and decides at call time"))}
    if not facts["auto_enables"]:
        return {"eager-breaks": plan_entry("not needed", {}, (
            "breakable CUDA graphs only from VLLM_USE_BREAKABLE_CUDAGRAPH set before start, "
            "which every op's decoration sees"))}
    return {"eager-breaks": plan_entry("patched", {
        "eager-breaks": f"{BREAKABLE}.eager_break_during_capture"}, (
        "eager_break_during_capture reads VLLM_USE_BREAKABLE_CUDAGRAPH when an op is "
        "decorated, but VllmConfig turns it on for DeepSeek-V4 only after ModelConfig has "
        "imported the model (quantization lookup) and with it the attention ops, unwrapped: "
        "a breakable graph (the drafter's PIECEWISE graphs) then records attention's "
        "profiling path (output 0) instead of running it. Every op is wrapped; the wrapper "
        "decides at call time, as vLLM >= 0.33 does"))}


def _decorate_with_breaks(orig, module, fn):
    """``orig(fn)`` with breakable graphs taken as on while decorating: the stock wrapper,
    which breaks only inside a ``BreakableCUDAGraphCapture`` (there is none unless vLLM runs
    breakable graphs) and otherwise just calls ``fn``."""
    saved = module.is_breakable_cudagraph_enabled
    module.is_breakable_cudagraph_enabled = lambda: True
    try:
        return orig(fn)
    finally:
        module.is_breakable_cudagraph_enabled = saved


def patch_breakable(module) -> None:
    """Import hook for ``breakable_cudagraph``: every op decorated from now on keeps its
    eager break."""
    facts = breakable_facts(Source())
    targets = adopt("engine", breakable_plan(facts), "breakable", facts)
    if mode() == "off" or not targets:
        return
    module.eager_break_during_capture = _wrap(module.eager_break_during_capture,
                                              lambda orig, fn: _decorate_with_breaks(
                                                  orig, module, fn))
    if _installing:  # imported before install(): the ops decorated then stay unwrapped
        record("eager-breaks", targets["eager-breaks"], "failed",
               f"{BREAKABLE} was imported before the overlay was installed; load the overlay "
               "from its .pth line")
    else:
        record("eager-breaks", targets["eager-breaks"], "applied")


# --------------------------------------------------------------------------- entry point
def installed() -> bool:
    """Whether ``install()`` ran in this process."""
    return _finder is not None


def install() -> None:
    """Register the import hooks (idempotent; imports neither torch nor vLLM)."""
    global _installing
    _installing = True
    try:
        when_imported(BREAKABLE, patch_breakable)
    finally:
        _installing = False
    when_imported(PROPOSER, patch_proposer)
    when_imported(EAGLE_LOADER, patch_eagle_loader)
    for module in KV_MODULES:
        when_imported(module, patch_kv_cache)
