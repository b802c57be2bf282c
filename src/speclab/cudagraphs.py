"""Which CUDA graph a decode step replays: the rows a step of B requests with q query tokens
each (q = k + 1 for a verify step, 1 for plain decoding) really runs.

vLLM captures FULL decode graphs at a fixed set of sizes and pads a batch up to the smallest
one that holds it. The token sizes (0.26.0 and 0.34.0 `vllm/config/vllm.py`
`_set_cudagraph_sizes`): 1, 2, 4, then every 8 below 256, then every 16, up to the largest
capture size (default min(2 q max_num_seqs, 512)). How speculation's decode graphs follow,
by release (`vllm`):

* "0.26" (0.26.0 `vllm/config/compilation.py` `adjust_cudagraph_sizes_for_spec_decode`, the
  V1 model runner DeepSeek-V4 runs there): each size rounded up to a multiple of q. At k = 2
  the graphs hold 3, 6, 9, 18, 24, 33, ... tokens: 4 requests (12 tokens) and 5 (15) replay
  the 18-row graph.
* "0.34" on Hopper (0.34.0, Model Runner V2; `decode_cudagraph_capture_request_sizes`):
  request counts, cdiv(s, q) of each token size, and with default sizes also the counts
  1, 2, 4, 8, 16, 24, ... themselves (`uniform_decode_sizes`): 4 requests at k = 2 run 12
  rows, 5 run 18. With sizes set explicitly (as `speclab.gpubench` does) only the former:
  the 0.26 graphs.
* "0.34" on SM100 (B200; `decode_cudagraph_capture_grid`, the default there): a request grid,
  every count up to 6, then steps growing with n.

A batch above the largest graph replays none: it runs as it is.
"""

from __future__ import annotations

import math

GPUS = ("hopper", "blackwell")
RELEASES = ("0.26", "0.34")
MAX_NUM_SEQS = 256  # vLLM's default


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


def decode_graphs(q: int = 1, sizes=None, gpu: str = "hopper", vllm: str = "0.26",
                  max_num_seqs: int = MAX_NUM_SEQS) -> list[int]:
    """Rows of the FULL decode graphs an engine captures for query length `q` (module doc),
    from its capture sizes in tokens `sizes` as its config resolved them before the spec
    rounding (None: vLLM's defaults for `max_num_seqs`). ValueError for a GPU not in
    `GPUS`, a release not in `RELEASES` or a q that is not positive."""
    if gpu not in GPUS:
        raise ValueError(f"gpu must be one of {GPUS}, not {gpu!r}")
    if vllm not in RELEASES:
        raise ValueError(f"vllm must be one of {RELEASES} (the releases read), not {vllm!r}")
    if q < 1:
        raise ValueError(f"q must be positive, not {q}")
    largest = min(2 * q * max_num_seqs, 512)
    if sizes:
        sizes = sorted(sizes)
    elif vllm == "0.34" and gpu == "blackwell":
        return [r * q for r in request_grid(max_num_seqs)]
    elif vllm == "0.34" and q > 1:  # the token grid and q times the request counts
        counts = [*token_sizes(min(max_num_seqs, 512)), max_num_seqs]
        sizes = sorted({*token_sizes(largest), *(n * q for n in counts if n * q <= largest)})
    else:
        sizes = token_sizes(largest)
    return sorted({r for s in sizes if (r := math.ceil(s / q) * q) <= sizes[-1]})


def graph_rows(requests: int, q: int = 1, sizes=None, gpu: str = "hopper",
               vllm: str = "0.26") -> int:
    """Rows the decode step of `requests` requests with `q` query tokens each runs: the
    smallest of `decode_graphs` that holds them, or requests x q above the largest."""
    if requests < 1:
        raise ValueError(f"requests must be positive, not {requests}")
    n = requests * q
    return min((g for g in decode_graphs(q, sizes, gpu, vllm) if g >= n), default=n)


def step_rows(B: int, k: int, eager: bool, sizes=None, gpu: str = "hopper",
              vllm: str = "0.26") -> int:
    """Rows a decode step of B requests at k (plain: 0) runs: B (k + 1) eager, else
    G_{k+1}(B) from the engine's capture sizes `sizes` (None: vLLM's default;
    `graph_rows` on `gpu` with release `vllm`, 0.26 where every run here ran)."""
    if eager:
        return int(B) * (k + 1)
    return graph_rows(int(B), k + 1, sizes if isinstance(sizes, list) else None, gpu, vllm)


def padding(batches, ks, gpu: str = "hopper", vllm: str = "0.26") -> list[dict]:
    """Per batch size and k: the verify step's tokens B (k + 1), the rows of its graph at
    vLLM's default sizes (`graph_rows`) and the share of those rows that are padding."""
    return [{"gpu": gpu, "vllm": vllm, "B": B, "k": k, "tokens": B * (k + 1),
             "rows": (r := graph_rows(B, k + 1, gpu=gpu, vllm=vllm)),
             "padding": 1 - B * (k + 1) / r}
            for B in batches for k in ks]
