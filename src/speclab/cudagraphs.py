"""Which CUDA graph a decode step replays: the rows a step of B requests with q query tokens
each (q = k + 1 for a verify step, 1 for plain decoding) really runs.

vLLM captures FULL decode graphs at a fixed set of sizes and pads a batch up to the smallest
one that holds it. The token sizes (vLLM 0.26.0 and 0.34.0 `vllm/config/vllm.py`
`_set_cudagraph_sizes`): 1, 2, 4, then every 8 below 256, then every 16, up to the largest
capture size. With speculation each is rounded up to a multiple of q (0.26.0
`vllm/config/compilation.py` `adjust_cudagraph_sizes_for_spec_decode`, the V1 model runner
DeepSeek-V4 runs; 0.34.0 on Hopper: `decode_cudagraph_capture_request_sizes` defaults to
`cdiv(s, q)` requests of those sizes, the same graphs). So at k = 2 the verify graphs hold
3, 6, 9, 18, 24, 33, ... tokens: 4 requests (12 tokens) and 5 (15) both replay the 18-token
graph. On SM100 (B200) 0.34.0 defaults instead to a request grid (every count up to 6, then
steps growing with n: `decode_cudagraph_capture_grid`), where B requests of q tokens mostly
run B q rows. A batch above the largest size replays no FULL graph: it runs as it is.
"""

from __future__ import annotations

import math

GPUS = ("hopper", "blackwell")


def token_sizes(largest: int) -> list[int]:
    """vLLM's default CUDA-graph token sizes up to `largest` (module doc)."""
    sizes = [s for s in (1, 2, 4) if s <= largest]
    sizes += list(range(8, min(largest + 1, 256), 8)) + list(range(256, largest + 1, 16))
    return sizes


def request_grid(largest: int) -> list[int]:
    """vLLM 0.34.0's request-count grid on SM100 up to `largest` (`_walk_grid` with step
    0.65 n^(2/3): every count up to 6, then 8, 10, ..., 16, 20, ...)."""
    grid, size = [], 1
    while size < largest:
        grid.append(size)
        stride = 1 << max(0, math.floor(math.log2(max(1.0, 0.65 * size ** (2 / 3)))))
        size = (size // stride + 1) * stride
    return [*grid, largest] if largest else []


def decode_graphs(q: int = 1, sizes=None, gpu: str = "hopper") -> list[int]:
    """Rows of the FULL decode graphs an engine captures for query length `q` (module doc)
    from its capture sizes in tokens, `sizes` (as its config resolved them before the spec
    rounding; None: vLLM's default up to 512, `token_sizes`). ValueError for a GPU not in
    `GPUS` or a q that is not positive."""
    if gpu not in GPUS:
        raise ValueError(f"gpu must be one of {GPUS}, not {gpu!r}")
    if q < 1:
        raise ValueError(f"q must be positive, not {q}")
    sizes = sorted(sizes) if sizes else token_sizes(512)
    if gpu == "blackwell":
        return [r * q for r in request_grid(sizes[-1] // q)]
    return sorted({r for s in sizes if (r := math.ceil(s / q) * q) <= sizes[-1]})


def graph_rows(requests: int, q: int = 1, sizes=None, gpu: str = "hopper") -> int:
    """Rows the decode step of `requests` requests with `q` query tokens each runs: the
    smallest of `decode_graphs` that holds them, or requests x q above the largest."""
    if requests < 1:
        raise ValueError(f"requests must be positive, not {requests}")
    n = requests * q
    return min((g for g in decode_graphs(q, sizes, gpu) if g >= n), default=n)


def padding(batches, ks, gpu: str = "hopper") -> list[dict]:
    """Per batch size and k: the verify step's tokens B (k + 1), the rows of its graph at
    vLLM's default sizes (`graph_rows`) and the share of those rows that are padding."""
    return [{"gpu": gpu, "B": B, "k": k, "tokens": B * (k + 1),
             "rows": (r := graph_rows(B, k + 1, gpu=gpu)), "padding": 1 - B * (k + 1) / r}
            for B in batches for k in ks]
