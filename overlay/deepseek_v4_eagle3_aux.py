"""EAGLE-3 for DeepSeek-V4 in vLLM 0.21-0.34: the SupportsEagle3 interface, aux states and
the aux-layer id convention.

Overlay part 1 of 2; ``install()`` also installs part 2 (``eagle3_draft_kv_cache``: the
draft's own KV-cache config and the KV-cache layout). Loaded by a ``.pth`` line, so
``install()`` only registers import hooks. When vLLM imports a DeepSeek-V4 model module (one
per platform: ``nvidia``, ``amd``, ``xpu``, ``cpu``; 0.21: one for all), the overlay reads the
module's own classes and decides per feature (``model_plan``):

* ``interface`` + ``aux-forward``: native where ``DeepseekV4ForCausalLM`` declares
  ``SupportsEagle3`` and ``DeepseekV4Model.forward`` captures ``idx + 1 in
  aux_hidden_state_layers`` (CUDA from 0.25, ROCm/XPU from 0.26, CPU from 0.30). Otherwise
  patched when the stock forward calls exactly what one of the overlay's forwards was
  written against: ``forward`` (0.21/0.22: ``layer.hc_post``, ``hc_head``/``hc_head_op``) or
  ``forward_tilelang`` (0.23/0.24 ``nvidia/model.py``: ``mhc_post_tilelang``,
  ``hc_head_fused_kernel_tilelang``; 0.25's native capture backported). Anything else is
  refused with the release to use instead.
* ``id-convention``: wherever the overlay is installed, ``set_aux_hidden_state_layers``
  maps the draft config's ids (what vLLM's model runner passes) to capture-after-layers with
  ``resolve_aux_convention`` and logs the resolution as one JSON line. Model Runner V2
  (``eagle3_utils.get_eagle3_aux_layers_from_config``; the only runner from 0.34) reads the
  ids at the config's top level only and passes vLLM's default layers for a draft that
  keeps them in ``eagle_config``: the overlay then captures the draft's own ids.

Aux states follow vLLM's semantics: capture after L layers = the full hyper-connection
residual stream after L decoder layers, reduced over the hc streams by ``capture_aux``.
"""

from __future__ import annotations

import os
from itertools import islice

import eagle3_draft_kv_cache as base

PATCHES = base.PATCHES
MODEL_MODULES = {
    "all": "vllm.model_executor.models.deepseek_v4",  # 0.21: one module for every platform
    "nvidia": "vllm.models.deepseek_v4.nvidia.model",  # 0.22: CUDA and XPU; 0.23+: CUDA
    "amd": "vllm.models.deepseek_v4.amd.model",
    "xpu": "vllm.models.deepseek_v4.xpu.model",
    "cpu": "vllm.models.deepseek_v4.cpu.model",
}
PLATFORM_PACKAGE = "vllm.models.deepseek_v4"  # vLLM >= 0.22: imports the platform's model
GPU_MODEL_RUNNER = "vllm.v1.worker.gpu_model_runner"  # the v1 runner (gone in 0.34)
MRV2_AUX = "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils"  # Model Runner V2's aux setup
MARK = "_dsv4_eagle3_overlay"
INVARIANT_MODULES = (  # vLLM's batch-invariant ops (VLLM_BATCH_INVARIANT=1)
    "vllm.model_executor.layers.batch_invariant",  # 0.21-0.28
    "vllm.model_executor.determinism.batch_invariant",  # 0.29+
)
NATIVE_SINCE = {"nvidia": "0.25.0", "amd": "0.26.0", "xpu": "0.26.0", "cpu": "0.30.0"}
"""First release whose platform model supports EAGLE-3 natively (checked against the matrix)."""
ADVICE = {
    "all": "use vLLM 0.21.x with this overlay",
    "nvidia": f"use vLLM 0.21-0.24 with this overlay, or >= {NATIVE_SINCE['nvidia']} (native)",
    "amd": f"use vLLM >= {NATIVE_SINCE['amd']}, whose amd/model.py supports EAGLE-3 natively",
    "xpu": ("use vLLM 0.22.x (nvidia/model.py serves XPU there and this overlay patches it) "
            f"or >= {NATIVE_SINCE['xpu']} (native)"),
    "cpu": f"use vLLM >= {NATIVE_SINCE['cpu']} (native)",
}

# Bound from the patched vLLM model module when the patch is applied (see _bind).
get_pp_group = IntermediateTensors = hc_head = None
mhc_post_tilelang = hc_head_fused_kernel_tilelang = None


def capture_aux(stream):
    """The aux state handed to the draft: ``[T, hc, H]`` stream -> mean over hc -> ``[T, H]``.

    Every patched forward reduces through this one function, looked up at call time, so a
    fault-injection harness can swap it (e.g. one stream instead of the mean)."""
    return stream.mean(dim=1)


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
            aux_hidden_states.append(capture_aux(stream))
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


def forward_tilelang(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
    """vLLM 0.23/0.24 ``DeepseekV4Model.forward`` (``nvidia/model.py``) plus EAGLE-3 aux
    hidden states, as vLLM 0.25 captures them natively. Every layer returns the pre-post-mix
    output; ``mhc_post_tilelang`` rebuilds the stream."""
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
            stream = mhc_post_tilelang(hidden_states, residual, post_mix, res_mix)
            aux_hidden_states.append(capture_aux(stream))
    if layer is not None:
        if self.end_layer in aux_layers:  # the last layer's stream is already rebuilt
            hidden_states = stream
        else:
            hidden_states = mhc_post_tilelang(hidden_states, residual, post_mix, res_mix)

    if not get_pp_group().is_last_rank:
        return IntermediateTensors({"hidden_states": hidden_states})

    num_tokens = hidden_states.shape[0]
    self._mtp_hidden_buffer[:num_tokens].copy_(hidden_states.flatten(1))
    hidden_states = hc_head_fused_kernel_tilelang(
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


_STOCK_CALLS = frozenset({
    "IntermediateTensors", "get_pp_group", "hidden_states.flatten", "hidden_states.unsqueeze",
    "hidden_states.unsqueeze(-2).repeat", "input_ids.to", "islice", "layer",
    "self._mtp_hidden_buffer[:num_tokens].copy_", "self.embed_input_ids", "self.norm"})
FORWARD_PARAMS = ["self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds"]
FORWARDS = {
    "forward": {
        "fn": forward, "binds": ("get_pp_group", "IntermediateTensors", "hc_head"),
        "layer_hc_post": True,
        "stock_calls": {  # what vLLM's own forward calls, for each release it was written from
            "0.21 deepseek_v4.py": _STOCK_CALLS | {"layer.hc_post", "hc_head"},
            "0.22 nvidia/model.py": _STOCK_CALLS | {"layer.hc_post", "self.hc_head_op",
                                                    "current_platform.is_cuda"}}},
    "forward_tilelang": {
        "fn": forward_tilelang,
        "binds": ("get_pp_group", "IntermediateTensors", "mhc_post_tilelang",
                  "hc_head_fused_kernel_tilelang"),
        "layer_hc_post": False,
        "stock_calls": {"0.23/0.24 nvidia/model.py": _STOCK_CALLS | {
            "mhc_post_tilelang", "hc_head_fused_kernel_tilelang"}}},
}
"""The overlay's forwards and the stock forwards each was written against."""
NATIVE_CAPTURE = "idx + 1 in self.aux_hidden_state_layers"


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


def draft_config_dict(hf_config) -> dict:
    """The keys ``resolve_aux_convention`` reads, from vLLM's draft ``hf_config`` (read as
    ``gpu_model_runner._get_eagle3_aux_layers_from_config`` reads them)."""
    out = {}
    for key in ("eagle_aux_hidden_state_layer_ids", "eagle_config", CONVENTION_KEY):
        value = getattr(hf_config, key, None)
        if value is not None and key == "eagle_config" and not isinstance(value, dict):
            value = value.to_dict() if hasattr(value, "to_dict") else dict(vars(value))
        if value is not None:
            out[key] = value
    return out


def _draft_hf_config():
    """The draft's hf_config from the engine config vLLM has set while loading the model."""
    from vllm import config

    current = getattr(config, "get_current_vllm_config_or_none", lambda: None)()
    draft = getattr(getattr(current, "speculative_config", None), "draft_model_config", None)
    return getattr(draft, "hf_config", None)


def capture_layers(layers, num_layers: int | None, default=()) -> tuple[int, ...]:
    """Capture-after-layers for the ids vLLM passes to ``set_aux_hidden_state_layers``.

    vLLM's model runner passes the draft config's ids unchanged; they are mapped with
    ``resolve_aux_convention`` and the resolution is logged as one JSON line. Where the
    runner passed the model's ``default`` layers because it reads no ids in ``eagle_config``
    (Model Runner V2) and the draft keeps its ids there, the draft's ids are captured. Other
    ids that are not the config's (vLLM's default layers, a caller of its own) are kept."""
    import json

    ids = tuple(int(i) for i in layers)
    hf = _draft_hf_config()
    cfg = None if hf is None else draft_config_dict(hf)
    resolved = resolve_aux_convention(cfg, num_layers)
    base._info("DeepSeek-V4 EAGLE-3 overlay: aux layers %s", json.dumps(resolved))
    skipped = (resolved["config_ids"] is not None and ids == tuple(default)
               and "eagle_aux_hidden_state_layer_ids" not in cfg)
    if skipped:
        base._info("DeepSeek-V4 EAGLE-3 overlay: vLLM passed its default aux layers %s (its "
                   "runner reads no eagle_config ids); the draft config's %s are captured",
                   ids, resolved["config_ids"])
    elif resolved["config_ids"] is None or tuple(resolved["config_ids"]) != ids:
        base._info("DeepSeek-V4 EAGLE-3 overlay: aux layer ids %s are not the draft config's "
                   "(%s): captured after %s layers as passed", ids, resolved["config_ids"], ids)
        return ids
    return tuple(resolved["capture_after_layers"])


def set_aux_hidden_state_layers(self, layers) -> None:
    """Capture the hc-mean residual stream after the layers the draft's ids mean (1..N)."""
    n = len(self.model.layers)
    ids = capture_layers(layers, n, self.get_eagle3_default_aux_hidden_state_layers())
    if len(set(ids)) != len(ids) or not all(1 <= i <= n for i in ids):
        raise ValueError(
            f"DeepSeek-V4 EAGLE-3 aux layers must be distinct and in 1..{n} (capture after "
            f"L layers); got {ids} from {tuple(layers)}. Set "
            "eagle_aux_hidden_state_layer_ids in the draft's config.json.")
    if get_pp_group().world_size > 1:
        raise NotImplementedError(
            "DeepSeek-V4 EAGLE-3 overlay: aux hidden states across pipeline-parallel ranks "
            "are not supported (vLLM >= 0.30 has them natively)")
    self.model.aux_hidden_state_layers = tuple(sorted(ids))


def _set_aux_mapped(orig, self, layers):
    """A native ``set_aux_hidden_state_layers`` fed the capture-after-layers."""
    layers_of_model = getattr(getattr(self, "model", None), "layers", None)
    return orig(self, capture_layers(layers, None if layers_of_model is None
                                     else len(layers_of_model),
                                     self.get_eagle3_default_aux_hidden_state_layers()))


# --------------------------------------------------------------------------- batch invariance
def invariant_facts(src: base.Source) -> dict:
    """Whether vLLM's batch-invariant ``aten::mean.dim`` (``mean_batch_invariant``, registered
    under ``VLLM_BATCH_INVARIANT=1``) returns its input's dtype when no dtype is asked, as
    ``torch.mean`` does: 0.21-0.31 compute in float32 and return it; 0.32 casts back
    (``return result if dtype is not None else result.to(input.dtype)``)."""
    import ast

    module = next((m for m in INVARIANT_MODULES if src.has_module(m)), None)
    fn = None if module is None else src.node(module, "mean_batch_invariant")
    return {"module": module, "mean": fn is not None,
            "keeps_dtype": fn is not None and any(
                isinstance(n, ast.Return) and "input.dtype" in ast.unparse(n)
                for n in ast.walk(fn))}


def invariant_plan(facts: dict) -> dict:
    """``invariant-mean``: not needed | native | patched."""
    if not facts["mean"]:
        return {"invariant-mean": base.plan_entry("not needed", {}, (
            "no batch-invariant mean"))}
    if facts["keeps_dtype"]:
        return {"invariant-mean": base.plan_entry("native", {}, (
            "mean_batch_invariant returns the input's dtype"))}
    return {"invariant-mean": base.plan_entry("patched", {
        "invariant-mean": f"{facts['module']}.mean_batch_invariant"}, (
        "under VLLM_BATCH_INVARIANT=1 vLLM's mean returns float32 for bfloat16 input, so the "
        "aux states (the mean over the hc streams) reach the draft's fc as float32 and its "
        "batch-invariant matmul asserts 'Incompatible dtypes' (vLLM 0.26.0 on an H200). The "
        "mean is cast back to the input's dtype when no dtype is asked, as vLLM >= 0.32 does"))}


def _mean_keeping_dtype(orig, input, dim, keepdim=False, dtype=None):  # vLLM's names
    result = orig(input, dim, keepdim, dtype)
    return result if dtype is not None else result.to(input.dtype)


def patch_invariant(module) -> None:
    """Import hook for vLLM's batch-invariant ops: the mean keeps its input's dtype. vLLM
    registers ``mean_batch_invariant`` (looked up by name) when it turns batch invariance
    on at worker start, after this import."""
    facts = invariant_facts(base.Source())
    targets = base.adopt("engine", invariant_plan(facts), "invariant", facts)
    if base.mode() == "off" or not targets:
        return
    module.mean_batch_invariant = base._wrap(module.mean_batch_invariant, _mean_keeping_dtype)
    if getattr(module, "_batch_invariant_MODE", False):
        base.record("invariant-mean", targets["invariant-mean"], "failed",
                    "batch invariance was on before the overlay was installed; load the "
                    "overlay from its .pth line")
    else:
        base.record("invariant-mean", targets["invariant-mean"], "applied")


# --------------------------------------------------------------------------- the plan
def _bases(node) -> list[str]:
    import ast

    return [] if node is None else [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]


def model_facts(src: base.Source, module: str) -> dict:
    """What the plan needs to know about one DeepSeek-V4 model module."""
    import ast

    fwd = src.node(module, "DeepseekV4Model.forward")
    model = src.node(module, "DeepseekV4Model")
    return {
        "module": module,
        "supports_eagle3": "SupportsEagle3" in _bases(src.node(module, "DeepseekV4ForCausalLM")),
        "eagle_model_mixin": "EagleModelMixin" in _bases(model),
        "torch_compile": model is not None and any(
            ast.unparse(d).startswith("support_torch_compile") for d in model.decorator_list),
        "forward_params": base.params(fwd),
        "forward_calls": base.calls(fwd),
        "aux_capture": [] if fwd is None else sorted({
            ast.unparse(n) for n in ast.walk(fwd)
            if isinstance(n, ast.Compare) and base.mentions(n, "aux_hidden_state_layers")}),
        "layer_hc_post": src.node(module, "DeepseekV4DecoderLayer.hc_post") is not None,
    }


def fitting_forward(facts: dict) -> str | None:
    """The overlay forward written against exactly this stock forward, if any."""
    for name, spec in FORWARDS.items():
        if (facts["forward_params"] == FORWARD_PARAMS
                and (facts["layer_hc_post"] or not spec["layer_hc_post"])
                and set(facts["forward_calls"]) in spec["stock_calls"].values()):
            return name
    return None


def model_plan(facts: dict, platform: str) -> dict:
    """``interface``, ``aux-forward``, ``id-convention`` for one platform model module."""
    m = facts["module"]
    entry = base.plan_entry
    mapping = {"id-convention": f"{m}.DeepseekV4ForCausalLM.set_aux_hidden_state_layers"}
    map_detail = ("maps the draft config's ids to capture-after-layers "
                  "(resolve_aux_convention) before ")
    if facts["supports_eagle3"]:
        if facts["eagle_model_mixin"] and NATIVE_CAPTURE in facts["aux_capture"]:
            return {
                "interface": entry("native", {}, "DeepseekV4ForCausalLM declares SupportsEagle3"),
                "aux-forward": entry("native", {}, (
                    f"DeepseekV4Model.forward captures `{NATIVE_CAPTURE}` (vLLM's "
                    "input-to-layer ids)")),
                "id-convention": entry("patched", mapping, map_detail + "vLLM's own setter"),
            }
        detail = (f"DeepseekV4ForCausalLM declares SupportsEagle3 but DeepseekV4Model.forward "
                  f"does not capture `{NATIVE_CAPTURE}`; {ADVICE[platform]}")
        return dict.fromkeys(("interface", "aux-forward", "id-convention"),
                             entry("refused", {}, detail))
    name = fitting_forward(facts)
    if name is None:
        detail = ("DeepseekV4Model.forward calls what no overlay forward was written against "
                  f"({', '.join(c for s in FORWARDS.values() for c in s['stock_calls'])}); "
                  + ADVICE[platform])
        return dict.fromkeys(("interface", "aux-forward", "id-convention"),
                             entry("refused", {}, detail))
    written = " or ".join(FORWARDS[name]["stock_calls"])
    return {
        "interface": entry("patched", {"eagle3-interface": f"{m}.DeepseekV4ForCausalLM"},
                           "supports_eagle3, set_aux_hidden_state_layers, default aux layers"),
        "aux-forward": entry("patched", {"aux-forward": f"{m}.DeepseekV4Model.forward"}, (
            f"{name}, written against {written} (same calls)"
            + (", compiled by @support_torch_compile" if facts["torch_compile"] else ""))),
        "id-convention": entry("patched", mapping, map_detail + "capture"),
    }


def runner_facts(src: base.Source) -> dict:
    """How vLLM's model runner hands the draft config's aux ids to the target: the v1
    runner where vLLM has it (<= 0.33), else Model Runner V2's ``eagle3_utils``."""
    import ast

    runner = src.node(GPU_MODEL_RUNNER, "GPUModelRunner")
    if runner is not None:
        name, setter = GPU_MODEL_RUNNER, "self.model.set_aux_hidden_state_layers"
        getter = src.node(GPU_MODEL_RUNNER, "GPUModelRunner._get_eagle3_aux_layers_from_config")
    else:
        name, setter = MRV2_AUX, "eagle3_model.set_aux_hidden_state_layers"
        getter = src.node(MRV2_AUX, "get_eagle3_aux_layers_from_config")
        runner = src.node(MRV2_AUX, "set_eagle3_aux_hidden_state_layers")
    return {
        "runner": name.removeprefix("vllm."),
        "passes_config_ids": getter is not None
        and base.mentions(getter, "eagle_aux_hidden_state_layer_ids")
        and setter in base.calls(runner),
        # eagle_config.get("eagle_aux_hidden_state_layer_ids"): MRV2 reads only "layer_ids"
        "reads_eagle_config_ids": getter is not None and any(
            isinstance(n, ast.Call) and ast.unparse(n.func).endswith(".get") and n.args
            and getattr(n.args[0], "value", None) == "eagle_aux_hidden_state_layer_ids"
            for n in ast.walk(getter)),
    }


def source_version(src: base.Source) -> str | None:
    import re

    for module in ("vllm._version", "vllm.version"):
        found = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]",
                          src.text(module) or "")
        if found:
            return found.group(1)
    return None


def release_facts(src: base.Source) -> dict:
    """Every fact the plan depends on, read statically from a vLLM tree or wheel."""
    return {
        "vllm": source_version(src),
        "models": {p: model_facts(src, m) for p, m in MODEL_MODULES.items()
                   if src.has_module(m)},
        "draft": base.draft_facts(src),
        "kv": base.kv_facts(src),
        "breakable": base.breakable_facts(src),
        "invariant": invariant_facts(src),
        "runner": runner_facts(src),
    }


def release_plan(facts: dict) -> dict:
    """The per-feature plan for a release: per platform model module, then engine-wide."""
    return {"platforms": {p: model_plan(f, p) for p, f in facts["models"].items()},
            "engine": {**base.draft_plan(facts["draft"]), **base.kv_plan(facts["kv"]),
                       **base.breakable_plan(facts["breakable"]),
                       **invariant_plan(facts["invariant"])}}


# --------------------------------------------------------------------------- applying it
def _bind(module, names) -> None:
    """Point a forward's free names at the model module's own objects."""
    globals().update({name: getattr(module, name, None) for name in names})


def patch_model(module) -> None:
    """Import hook for a DeepSeek-V4 model module: apply the plan decided from its classes."""
    from vllm.model_executor.models.interfaces import SupportsEagle3

    platform = next(p for p, m in MODEL_MODULES.items() if m == module.__name__)
    causal, model = module.DeepseekV4ForCausalLM, module.DeepseekV4Model
    if getattr(causal, MARK, None):
        return
    facts = model_facts(base.Source(), module.__name__)
    plan = model_plan(facts, platform)
    patches = base.adopt(platform, plan, platform, facts)
    if base.mode() == "off":
        return
    if plan["interface"]["action"] == "patched":
        spec = FORWARDS[fitting_forward(facts)]
        _bind(module, spec["binds"])
        causal.supports_eagle3 = True
        causal.has_own_lm_head = False
        causal.has_own_embed_tokens = False
        causal.set_aux_hidden_state_layers = set_aux_hidden_state_layers
        causal.get_eagle3_default_aux_hidden_state_layers = (
            SupportsEagle3.get_eagle3_default_aux_hidden_state_layers)
        base.record("eagle3-interface", patches["eagle3-interface"], "applied")
        # Keep the forward's own __module__/__qualname__: AOT-compiled artifacts pickle it by
        # reference (deepseek_v4_eagle3_aux.forward) and load it with its module's globals.
        spec["fn"].__annotations__ = dict(model.forward.__annotations__)
        model._dsv4_overlay_original_forward = model.forward
        model.forward = spec["fn"]
        model.aux_hidden_state_layers = ()
        base.record("aux-forward", patches["aux-forward"], "applied")
    elif plan["id-convention"]["action"] == "patched":
        causal.set_aux_hidden_state_layers = base._wrap(causal.set_aux_hidden_state_layers,
                                                        _set_aux_mapped)
    if plan["id-convention"]["action"] == "patched":
        base.record("id-convention", patches["id-convention"], "applied")
        setattr(causal, MARK, base.OVERLAY_VERSION)


def report() -> dict:
    """Overlay state in this process (JSON-serialisable)."""
    import json
    import sys

    vllm = sys.modules.get("vllm.version")
    return {
        "overlay_version": base.OVERLAY_VERSION,
        "vllm_version": getattr(vllm, "__version__", None),
        "mode": base.mode(),
        "draft_kv_cache_dtype": base.draft_kv_cache_dtype(),
        "plan": json.loads(json.dumps(base.PLAN)),
        "facts": json.loads(json.dumps(base.FACTS)),
        "patches": {k: dict(v) for k, v in PATCHES.items()},
    }


def probe() -> dict:
    """Import the vLLM modules the overlay patches (no model is built); ``report()``."""
    import importlib

    errors = {}
    for name in (*base.KV_MODULES, base.PROPOSER, base.EAGLE_LOADER, *INVARIANT_MODULES,
                 PLATFORM_PACKAGE, MODEL_MODULES["all"]):
        try:
            if base.module_exists(name):
                importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (a platform may lack the model's dependencies)
            errors[name] = f"{type(e).__name__}: {e}"
    return {**report(), "import_errors": errors}


def install() -> None:
    """Register all import hooks (idempotent; imports neither torch nor vLLM)."""
    base.install()
    for module in INVARIANT_MODULES:
        base.when_imported(module, patch_invariant)
    for module in MODEL_MODULES.values():
        base.when_imported(module, patch_model)
