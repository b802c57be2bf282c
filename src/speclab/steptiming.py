"""Host and GPU time of each engine step's parts, measured inside vLLM's engine core.

A vLLM general plugin (entry point group `vllm.general_plugins`, loaded in every vLLM process
by `vllm.plugins.load_general_plugins`: the engine core and its workers, 0.26
`v1/engine/core.py`, `v1/worker/worker_base.py`). With `$SPECLAB_STEP_TIMING` naming a folder
it wraps three `GPUModelRunner` methods (0.22 and 0.26 `v1/worker/gpu_model_runner.py`):
`execute_model` (the target's forward: plain or verify), `sample_tokens` (sampling,
rejection and, inside it, the drafter) and `propose_draft_token_ids` (the one call that runs
the drafter of any method). Each call is timed twice: on the host (`host_ms`, wall time of
the call) and on the GPU (`ms`, two CUDA events around it on the current stream). Events are
recorded only while `<folder>/active` exists, so timed passes run the stock path but for one
`stat`; when the flag is gone the pending events are synchronised and appended to
`<folder>/<pid>.jsonl` as {"op": "execute" | "sample" | "propose", "tokens": scheduled
tokens, "reqs": requests, "ms", "host_ms", "t_ms"} (`sample` takes the counts of the step's
`execute`; `t_ms`, the call's start on the GPU after the first call's of the same flush, so
the gap between one call's end and the next one's start is time the stream ran none of these
calls). Loaded through the project's general plugin (`speclab.vllm_plugins`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from itertools import pairwise
from pathlib import Path

ENV = "SPECLAB_STEP_TIMING"
FLAG = "active"
METHODS = {"execute_model": "execute", "sample_tokens": "sample",
           "propose_draft_token_ids": "propose"}
"""The GPUModelRunner methods timed, and the `op` their records carry."""


class _Recorder:
    def __init__(self, folder: Path):
        self.folder = folder
        self.pending: list[tuple] = []
        self.step = (0, 0)  # (tokens, requests) of the last scheduler output seen

    def active(self) -> bool:
        return (self.folder / FLAG).exists()

    def flush(self) -> None:
        if not self.pending:
            return
        rows, ref = [], self.pending[0][4]
        for op, tokens, reqs, host_ms, start, end in self.pending:
            end.synchronize()
            rows.append({"op": op, "tokens": tokens, "reqs": reqs,
                         "ms": start.elapsed_time(end), "host_ms": host_ms,
                         "t_ms": ref.elapsed_time(start)})
        self.pending.clear()
        with open(self.folder / f"{os.getpid()}.jsonl", "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)


def wrap(fn, recorder: _Recorder, op: str = "propose"):
    """`fn` (an unbound GPUModelRunner method whose first argument is the scheduler output,
    or the grammar output for `sample`) timed on the host and with CUDA events while
    active."""
    import torch

    def timed(self, first, *args, **kwargs):
        if not recorder.active():
            recorder.flush()
            return fn(self, first, *args, **kwargs)
        if op != "sample":
            recorder.step = (int(first.total_num_scheduled_tokens),
                             len(first.num_scheduled_tokens))
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        t0 = time.perf_counter()
        start.record()
        out = fn(self, first, *args, **kwargs)
        end.record()
        recorder.pending.append((op, *recorder.step, 1e3 * (time.perf_counter() - t0),
                                 start, end))
        return out

    timed.__name__ = fn.__name__
    timed._speclab_steptiming = True
    return timed


def install() -> None:
    """The plugin's entry point: patch the model runner when `$SPECLAB_STEP_TIMING` is set."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    Path(folder).mkdir(parents=True, exist_ok=True)
    recorder = _Recorder(Path(folder))
    for name, op in METHODS.items():
        current = getattr(GPUModelRunner, name, None)
        if current is not None and not getattr(current, "_speclab_steptiming", False):
            setattr(GPUModelRunner, name, wrap(current, recorder, op))


def read(folder: Path) -> list[dict]:
    """Every recorded call in `folder` (all engine processes); records written before
    `execute`/`sample` were timed have no `op` and are the drafter's."""
    rows = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def gaps(calls: list[dict], B: int, k: int) -> dict[str, float]:
    """Median GPU time per decode step at `B` requests (B (k + 1) tokens) that the stream ran
    neither the target's forward nor sampling, before each (`gap_execute_ms`: after the
    previous step's sampling; `gap_sample_ms`: after this step's forward), from the recorded
    calls' GPU start times (`t_ms`, since 2026-12-06; NaN for records without them)."""
    timed = [c for c in calls if c.get("op") in ("execute", "sample") and "t_ms" in c]
    out = {"execute": [], "sample": []}
    for prev, c in pairwise(timed):
        if c["reqs"] == B and c["tokens"] == B * (k + 1) and prev["op"] != c["op"]:
            out[c["op"]].append(c["t_ms"] - prev["t_ms"] - prev["ms"])
    return {f"gap_{op}_ms": statistics.median(v) if v else float("nan") for op, v in out.items()}
