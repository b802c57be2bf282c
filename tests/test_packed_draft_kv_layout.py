"""The draft's KV pages in DeepSeek-V4's packed group-0 layout on vLLM 0.26.0, replayed on the
CPU with pure torch: is what the writer stores where the reader looks, for 8 and 32 KV heads?

Mirrors vLLM 0.26.0 (wheel vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64):

* planner `v1/core/kv_cache_utils.py:1259-1341` (`_bucket_layers_by_page_size`,
  `_get_kv_cache_config_packed`): one byte offset per (page size, slot), block_stride = the
  sum of all pages of one pool block; the overlay's `kv-groups` appends the draft layer to
  group 0, so it gets its own page size bucket (offset 47808 for the real-shape 4-layer target);
* worker view `v1/worker/gpu/attn_utils.py:214-222` (packing branch of
  `_reshape_attention_kv_cache`, called from `gpu_model_runner.py:7372`): raw int8 backing
  `.view(-1, block_stride)[:, offset:offset + page_bytes].view(bf16).view(permuted shape)`;
* FlashAttention shape/stride order `v1/attention/backends/flash_attn.py:131-165`: logical
  (blocks, H, N, 2D), NHD memory order (0, 2, 1, 3); K and V are
  `kv_cache.transpose(1, 2).split(D, -1)` (flash_attn.py:878 read, :1087 write);
* writer `reshape_and_cache_flash` (csrc cache_kernels.cu): dst = block * stride(0) +
  offset * stride(1) + head * stride(2) (head_stride 2D != D: the per-head branch), slot =
  block_id * 256 + pos % 256 (`block_table.py:407`, group 0 block 256, kernel block 256);
* reader: FA3 paged KV, k[block_table[pos // 256], pos % 256, q_head // group].

The check passes for both head counts: the packed arithmetic is consistent, so it does not
explain the H200 rejection (8 KV heads) by itself. The control (`contiguous` view, i.e. a
layout bug that ignores block_stride) must fail, so the check can see such a bug.
"""

from __future__ import annotations

import pytest
import torch

BLOCK = 256  # DeepSeek-V4 group-0 block size = FlashAttention kernel block size on 0.26
D = 128
# group-0 pages of the real-shape 4-layer target, fp8_ds_mla, 576-B aligned (bytes):
# C4 attention 37440, C4 indexer 8640, C128 attention 1728; the SWA and compressor-state
# groups share those buckets (slot 0 of 37440 and 8640), so they add no bytes.
TARGET_PAGES = (37440, 8640, 1728)


def plan(nkv: int) -> tuple[int, int, int]:
    """(draft byte offset, block_stride, draft page bytes) as `_get_kv_cache_config_packed`."""
    draft_page = 2 * BLOCK * nkv * D * 2  # FullAttentionSpec.real_page_size_bytes, bf16
    buckets = {ps: 1 for ps in TARGET_PAGES}
    buckets[draft_page] = buckets.get(draft_page, 0) + 1
    offset, draft_offset = 0, None
    for ps, slots in buckets.items():
        for _ in range(slots):
            if ps == draft_page:
                draft_offset = offset
            offset += ps
    return draft_offset, offset, draft_page


def packed_view(raw: torch.Tensor, nkv: int, broken: bool = False) -> torch.Tensor:
    """The draft layer's kv_cache as `_reshape_attention_kv_cache` builds it (0.26 packing)."""
    offset, stride, page = plan(nkv)
    shape = (-1, nkv, BLOCK, 2 * D)  # FlashAttentionBackend.get_kv_cache_shape (logical)
    order = (0, 2, 1, 3)  # NHD
    permuted = tuple(shape[i] for i in order)
    if broken:  # control: pages assumed contiguous (block_stride ignored)
        view = raw[offset:].view(torch.bfloat16)[: (raw.numel() - offset) // page * page // 2]
    else:
        view = raw.view(-1, stride)[:, offset:offset + page].view(torch.bfloat16)
    inv = [order.index(i) for i in range(4)]
    return view.view(permuted).permute(*inv)


def write(kv_cache, key, value, slots):
    """reshape_and_cache_flash: per-token, per-head copy through the cache's strides."""
    k_cache, v_cache = kv_cache.transpose(1, 2).split(D, dim=-1)  # (blocks, N, H, D)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        k_cache[slot // BLOCK, slot % BLOCK] = key[t]
        v_cache[slot // BLOCK, slot % BLOCK] = value[t]


def read(kv_cache, block_table, positions, nq):
    """FA3 paged gather: K/V each query head sees at each position (GQA: head // group)."""
    k_cache, v_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
    nkv = k_cache.shape[2]
    kv_of_q = torch.arange(nq) // (nq // nkv)
    blocks = block_table[positions // BLOCK]
    k = k_cache[blocks, positions % BLOCK][:, kv_of_q]
    v = v_cache[blocks, positions % BLOCK][:, kv_of_q]
    return k, v


def roundtrip(nkv: int, broken: bool = False) -> bool:
    nq, num_blocks = 32, 6
    offset, stride, _ = plan(nkv)
    raw = torch.zeros(num_blocks * stride, dtype=torch.int8)
    raw.view(-1, stride)[:, :offset] = 0x5A  # the target's pages of every block: a sentinel
    cache = packed_view(raw, nkv, broken)
    g = torch.Generator().manual_seed(nkv)
    ntok = 300  # crosses a block boundary
    block_table = torch.tensor([4, 1])  # request's pool blocks (group 0)
    pos = torch.arange(ntok)
    slots = block_table[pos // BLOCK] * BLOCK + pos % BLOCK
    key = torch.randn(ntok, nkv, D, generator=g).bfloat16()
    value = torch.randn(ntok, nkv, D, generator=g).bfloat16()
    write(cache, key, value, slots)
    k, v = read(cache, block_table, pos, nq)
    kv_of_q = torch.arange(nq) // (nq // nkv)
    ok = torch.equal(k, key[:, kv_of_q]) and torch.equal(v, value[:, kv_of_q])
    untouched = bool((raw.view(-1, stride)[:, :offset] == 0x5A).all())
    return ok and untouched


@pytest.mark.parametrize("nkv", [8, 32])
def test_packed_draft_pages_roundtrip(nkv):
    offset, stride, page = plan(nkv)
    assert offset == sum(TARGET_PAGES) == 47808 and offset % 16 == 0 and stride % 16 == 0
    assert page == {8: 1 << 20, 32: 4 << 20}[nkv]
    assert roundtrip(nkv)


@pytest.mark.parametrize("nkv", [8, 32])
def test_control_contiguous_view_is_caught(nkv):
    assert not roundtrip(nkv, broken=True)
