"""GPU time of the drafter per engine step, measured inside vLLM's engine core.

A vLLM general plugin (entry point group `vllm.general_plugins`, loaded in every vLLM process
by `vllm.plugins.load_general_plugins`: the engine core and its workers, 0.26
`v1/engine/core.py`, `v1/worker/worker_base.py`). With `$SPECLAB_STEP_TIMING` naming a folder
it wraps `GPUModelRunner.propose_draft_token_ids` (0.26 `v1/worker/gpu_model_runner.py`: the
one call that runs the drafter of any method after the target's verify forward) in two CUDA
events. Events are recorded only while `<folder>/active` exists, so timed passes run the
stock path but for one `stat`; when the flag is gone the pending events are synchronised and
appended to `<folder>/<pid>.jsonl` as {"tokens": scheduled tokens, "reqs": requests, "ms"}.
`write_plugin_dist` makes the entry point visible: a dist-info folder in a site directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "SPECLAB_STEP_TIMING"
FLAG = "active"
DIST = "speclab_steptiming-1.0.dist-info"


class _Recorder:
    def __init__(self, folder: Path):
        self.folder = folder
        self.pending: list[tuple[int, int, object, object]] = []

    def active(self) -> bool:
        return (self.folder / FLAG).exists()

    def flush(self) -> None:
        if not self.pending:
            return
        rows = []
        for tokens, reqs, start, end in self.pending:
            end.synchronize()
            rows.append({"tokens": tokens, "reqs": reqs, "ms": start.elapsed_time(end)})
        self.pending.clear()
        with open(self.folder / f"{os.getpid()}.jsonl", "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)


def wrap(propose, recorder: _Recorder):
    """`propose` (an unbound GPUModelRunner method) timed with CUDA events while active."""
    import torch

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if not recorder.active():
            recorder.flush()
            return propose(self, scheduler_output, *args, **kwargs)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        out = propose(self, scheduler_output, *args, **kwargs)
        end.record()
        recorder.pending.append((int(scheduler_output.total_num_scheduled_tokens),
                                 len(scheduler_output.num_scheduled_tokens), start, end))
        return out

    propose_draft_token_ids._speclab_steptiming = True
    return propose_draft_token_ids


def install() -> None:
    """The plugin's entry point: patch the model runner when `$SPECLAB_STEP_TIMING` is set."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    current = GPUModelRunner.propose_draft_token_ids
    if getattr(current, "_speclab_steptiming", False):
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    GPUModelRunner.propose_draft_token_ids = wrap(current, _Recorder(Path(folder)))


def write_plugin_dist(site: Path) -> Path:
    """Register `install` as a vLLM general plugin for every process that has `site` on its
    path (a dist-info with the entry point; speclab itself must be importable there)."""
    dist = Path(site) / DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: speclab-steptiming\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nspeclab_steptiming = speclab.steptiming:install\n")
    return dist


def read(folder: Path) -> list[dict]:
    """Every recorded drafter call in `folder` (all engine processes)."""
    rows = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows
