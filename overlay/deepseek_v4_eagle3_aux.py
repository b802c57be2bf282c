"""EAGLE-3 for DeepSeek-V4 in vLLM 0.21-0.22: the SupportsEagle3 interface and aux states.

Overlay part 1 of 2; ``install()`` also installs part 2 (``eagle3_draft_kv_cache``: the
draft's own KV-cache config and the KV-cache layout). Loaded by a ``.pth`` line, so
``install()`` only registers import hooks; the patches below are applied when vLLM imports
the model module, before any model is built:

* ``eagle3-interface``: ``DeepseekV4ForCausalLM`` gets ``supports_eagle3``,
  ``has_own_lm_head``, ``has_own_embed_tokens``, ``set_aux_hidden_state_layers`` and
  ``get_eagle3_default_aux_hidden_state_layers`` (vLLM's default ``(2, N//2, N-3)``).
* ``aux-forward``: ``DeepseekV4Model.forward`` is replaced at class level by ``forward``
  below (same parameters; the class is ``@support_torch_compile``, which compiles the class's
  forward when the model is built, so torch.compile and CUDA graphs see this one). It
  returns ``(hidden_states, [aux...])`` when aux layers are set, with vLLM >= 0.33's
  semantics: layer id L is the full hyper-connection residual stream after L decoder layers
  (``mhc_post`` applied where the fused CUDA path defers it), averaged over the hc_mult
  streams -> ``[T, H]``.

vLLM 0.22 keeps the model in ``vllm/models/deepseek_v4/nvidia/model.py`` (CUDA and XPU; ROCm
uses ``amd/model.py``, not patched); 0.21 in ``vllm/model_executor/models/deepseek_v4.py``.
Where the class already supports EAGLE-3 (vLLM >= 0.33) nothing is patched.
"""

from __future__ import annotations

import os
from itertools import islice

import eagle3_draft_kv_cache as base

PATCHES = base.PATCHES
MODEL_MODULES = {
    "0.22": "vllm.models.deepseek_v4.nvidia.model",
    "0.21": "vllm.model_executor.models.deepseek_v4",
}
PLATFORM_PACKAGE = "vllm.models.deepseek_v4"  # vLLM >= 0.22: imports the platform's model
MARK = "_dsv4_eagle3_overlay"

# Bound from the patched vLLM model module when the patch is applied (see _bind).
get_pp_group = IntermediateTensors = hc_head = None


def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
    """vLLM 0.21/0.22 ``DeepseekV4Model.forward`` plus EAGLE-3 aux hidden states."""
    if get_pp_group().is_first_rank:
        if inputs_embeds is not None:
            hidden_states = inputs_embeds
        else:
            hidden_states = self.embed_input_ids(input_ids)
        hidden_states = hidden_states.unsqueeze(-2).repeat(1, self.hc_mult, 1)
    else:
        assert intermediate_tensors is not None
        hidden_states = intermediate_tensors["hidden_states"]

    if self.use_mega_moe:
        input_ids = input_ids.long()

    aux_layers = self.aux_hidden_state_layers
    aux_hidden_states = []
    layer = residual = post_mix = res_mix = stream = None
    for idx, layer in enumerate(
        islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer
    ):
        hidden_states, residual, post_mix, res_mix = layer(
            hidden_states, positions, input_ids, post_mix, res_mix, residual
        )
        if idx + 1 in aux_layers:
            # [T, hc, H] stream after idx + 1 layers; the fused CUDA path (residual set)
            # leaves its post-mix to the next layer, the native path has applied it.
            stream = (
                hidden_states
                if residual is None
                else layer.hc_post(hidden_states, residual, post_mix, res_mix)
            )
            aux_hidden_states.append(stream.mean(dim=1))
    if residual is not None:
        if self.end_layer in aux_layers:
            hidden_states = stream
        else:
            hidden_states = layer.hc_post(hidden_states, residual, post_mix, res_mix)

    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states})

    num_tokens = hidden_states.shape[0]
    self._mtp_hidden_buffer[:num_tokens].copy_(hidden_states.flatten(1))
    head = self.hc_head_op if hc_head is None else hc_head  # 0.22 CustomOp, 0.21 function
    hidden_states = head(
        hidden_states,
        self.hc_head_fn,
        self.hc_head_scale,
        self.hc_head_base,
        self.rms_norm_eps,
        self.hc_eps,
    )
    hidden_states = self.norm(hidden_states)
    if aux_hidden_states:
        return hidden_states, aux_hidden_states
    return hidden_states


# --------------------------------------------------------------------------- id convention
CONVENTION_ENV = "EAGLE3_AUX_LAYER_CONVENTION"
CONVENTION_KEY = "eagle_aux_layer_convention"  # optional field of the draft's config.json
CONVENTIONS = ("output", "input")


def config_aux_ids(draft_config: dict) -> list[int] | None:
    """``eagle_aux_hidden_state_layer_ids`` of a draft config, top level first, then
    ``eagle_config`` (where vLLM's ``gpu_model_runner`` looks for them)."""
    ids = draft_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def resolve_aux_convention(draft_config: dict | None, num_layers: int | None = None,
                           env=None) -> dict:
    """Which target layers a draft's aux-layer ids mean, without vLLM or torch.

    ``output``: id L is the output of decoder layer L (0-indexed), captured after L + 1
    layers (SGLang, SpecForge). ``input``: id L is the stream entering layer L, captured
    after L layers (vLLM). Resolution, first match wins: ``$EAGLE3_AUX_LAYER_CONVENTION``;
    the draft config's ``eagle_aux_layer_convention`` (top level or ``eagle_config``);
    SGLang's rule (sgl-project/sglang#25454): a first id of 1 means ``output`` (no draft uses
    the embeddings), any other first id ``input``. Without ids in the config vLLM uses its
    own default layers, which are ``input`` ids. Raises ValueError for an unknown
    convention or a capture outside 1..num_layers."""
    env = os.environ if env is None else env
    cfg = draft_config or {}
    ids = config_aux_ids(cfg)
    from_config = cfg.get(CONVENTION_KEY) or (cfg.get("eagle_config") or {}).get(CONVENTION_KEY)
    if env.get(CONVENTION_ENV):
        convention, source = env[CONVENTION_ENV].strip().lower(), "env"
        why = f"{CONVENTION_ENV}={env[CONVENTION_ENV]}"
    elif from_config:
        convention, source = str(from_config).strip().lower(), "config"
        why = f"the draft config sets {CONVENTION_KEY}={from_config!r}"
    elif ids is None:
        convention, source = "input", "vllm-default"
        why = "the draft config lists no aux ids: vLLM's default layers are input-to-layer ids"
    elif ids[0] == 1:
        convention, source = "output", "rule"
        why = ("first id is 1: output-of-layer ids (nobody feeds the embeddings as an aux "
               "state; SGLang's rule)")
    else:
        convention, source = "input", "rule"
        why = f"first id is {ids[0]}, not 1: input-to-layer ids (SGLang's rule)"
    if convention not in CONVENTIONS:
        raise ValueError(f"aux-layer convention {convention!r} ({why}) is not one of "
                         f"{CONVENTIONS}")
    capture = None if ids is None else [i + 1 if convention == "output" else i for i in ids]
    if capture is not None and num_layers is not None:
        bad = [c for c in capture if not 1 <= c <= num_layers]
        if bad:
            raise ValueError(
                f"aux-layer ids {ids} read as {convention!r} ids ({why}) capture after "
                f"{capture} layers; {bad} not in 1..{num_layers} for a {num_layers}-layer "
                f"target. Set {CONVENTION_ENV} or the draft config's {CONVENTION_KEY}.")
    return {"convention": convention, "source": source, "config_ids": ids,
            "capture_after_layers": capture, "num_layers": num_layers, "why": why}


def set_aux_hidden_state_layers(self, layers) -> None:
    """Capture the hc-mean residual stream after each of ``layers`` decoder layers (1..N)."""
    n = len(self.model.layers)
    ids = tuple(int(i) for i in layers)
    if len(set(ids)) != len(ids) or not all(1 <= i <= n for i in ids):
        raise ValueError(
            f"DeepSeek-V4 EAGLE-3 aux layer ids must be distinct and in 1..{n} (id L is the "
            f"residual stream after L layers); got {tuple(layers)}. Set "
            "eagle_aux_hidden_state_layer_ids in the draft's config.json.")
    if get_pp_group().world_size > 1:
        raise NotImplementedError(
            "DeepSeek-V4 EAGLE-3 overlay: aux hidden states across pipeline-parallel ranks "
            "are not supported (vLLM >= 0.33 has them natively)")
    self.model.aux_hidden_state_layers = tuple(sorted(ids))


def _params(fn) -> list[tuple]:
    import inspect

    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _bind(module) -> None:
    """Point ``forward``'s free names at the model module's own objects."""
    globals().update(
        get_pp_group=module.get_pp_group,
        IntermediateTensors=module.IntermediateTensors,
        hc_head=getattr(module, "hc_head", None),
    )


def patch_model(module) -> None:
    """Import hook for the DeepSeek-V4 model module (0.22 nvidia/model.py, 0.21 deepseek_v4.py)."""
    from vllm.model_executor.models.interfaces import SupportsEagle3, supports_eagle3

    causal, model = module.DeepseekV4ForCausalLM, module.DeepseekV4Model
    targets = {"eagle3-interface": f"{module.__name__}.DeepseekV4ForCausalLM",
               "aux-forward": f"{module.__name__}.DeepseekV4Model.forward"}
    if supports_eagle3(causal) and not getattr(causal, MARK, None):
        _note_native(targets)
        return
    decision = base.gate()
    if decision in ("off", "refuse"):
        detail = (f"{base.MODE_ENV}=off" if decision == "off" else
                  f"vLLM {base.vllm_version()} is neither 0.21.x/0.22.x nor natively EAGLE-3 "
                  f"capable; nothing patched ({base.MODE_ENV}=force to try)")
        for name, target in targets.items():
            base.record(name, target, "off" if decision == "off" else "refused", detail)
        return
    if _params(model.forward) != _params(forward):
        for name, target in targets.items():
            base.record(name, target, "failed",
                        f"DeepseekV4Model.forward{_params(model.forward)} differs from 0.22's")
        return

    _bind(module)
    causal.supports_eagle3 = True
    causal.has_own_lm_head = False
    causal.has_own_embed_tokens = False
    causal.set_aux_hidden_state_layers = set_aux_hidden_state_layers
    causal.get_eagle3_default_aux_hidden_state_layers = (
        SupportsEagle3.get_eagle3_default_aux_hidden_state_layers)
    setattr(causal, MARK, base.OVERLAY_VERSION)
    base.record("eagle3-interface", targets["eagle3-interface"], "applied")

    # Keep forward's own __module__/__qualname__: AOT-compiled artifacts pickle it by
    # reference (deepseek_v4_eagle3_aux.forward) and load with its module's globals.
    forward.__annotations__ = dict(model.forward.__annotations__)
    model._dsv4_overlay_original_forward = model.forward
    model.forward = forward
    model.aux_hidden_state_layers = ()
    base.record("aux-forward", targets["aux-forward"], "applied")


def check_platform_model(module) -> None:
    """Import hook for ``vllm.models.deepseek_v4``, which picks the platform's model class:
    says so when that class is native (e.g. the CPU model) or one the overlay does not cover
    (vLLM 0.22's ROCm ``amd/model.py``)."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    if "eagle3-interface" in PATCHES or base.mode() == "off":  # handled, or disabled
        return
    cls = module.DeepseekV4ForCausalLM
    targets = {"eagle3-interface": f"{cls.__module__}.DeepseekV4ForCausalLM",
               "aux-forward": f"{cls.__module__}.DeepseekV4Model.forward"}
    if supports_eagle3(cls):
        _note_native(targets)
    else:
        for name, target in targets.items():
            base.record(name, target, "refused",
                        "the overlay covers the NVIDIA/XPU model (nvidia/model.py) only")


def _note_native(targets: dict[str, str]) -> None:
    for name, target in targets.items():
        base.record(name, target, "native",
                    f"vLLM {base.vllm_version()} supports EAGLE-3 for DeepSeek-V4 natively")
    if os.environ.get(base.DTYPE_ENV):
        base.record("draft-cache-config", "speculative_config.kv_cache_dtype", "skipped",
                    f"{base.DTYPE_ENV} is ignored here: pass "
                    "speculative_config={'kv_cache_dtype': ...} instead")


def plan(version: str) -> dict[str, str]:
    """Patch name -> replaced object for a vLLM version (0.21/0.22 module layouts)."""
    module = MODEL_MODULES["0.21" if version.startswith("0.21.") else "0.22"]
    return {
        "eagle3-interface": f"{module}.DeepseekV4ForCausalLM",
        "aux-forward": f"{module}.DeepseekV4Model.forward",
        **base.PLAN,
    }


def report() -> dict:
    """Overlay state in this process (JSON-serialisable)."""
    import sys

    vllm = sys.modules.get("vllm.version")
    return {
        "overlay_version": base.OVERLAY_VERSION,
        "vllm_version": getattr(vllm, "__version__", None),
        "mode": base.mode(),
        "draft_kv_cache_dtype": base.draft_kv_cache_dtype(),
        "patches": {k: dict(v) for k, v in PATCHES.items()},
    }


def probe() -> dict:
    """Import the vLLM modules the overlay patches (no model is built); ``report()``."""
    import importlib

    model = (MODEL_MODULES["0.21"] if base.vllm_version().startswith("0.21.")
             else PLATFORM_PACKAGE)
    errors = {}
    for name in (base.KV_UTILS, base.PROPOSER, model):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (a platform may lack the model's dependencies)
            errors[name] = f"{type(e).__name__}: {e}"
    return {**report(), "import_errors": errors}


def install() -> None:
    """Register all import hooks (idempotent; imports neither torch nor vLLM)."""
    base.install()
    for module in MODEL_MODULES.values():
        base.when_imported(module, patch_model)
    base.when_imported(PLATFORM_PACKAGE, check_platform_model)
