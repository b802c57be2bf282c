"""Injected defects of known size: the positive controls of the parity study.

A defect is installed into the running process before (`aux-layers`) or between (biases)
passes of an in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, TP 1: the sampler and the
model runner live in this process). Kinds:

- `verify-bias`: in the target's verify path, `size` nats are added to the runner-up logit of
  a verified position; the target's greedy token flips wherever its top-1/top-2 margin is
  below `size`.
- `accept-bias`: in the draft's acceptance path, `size` nats are added to the target's logit of
  the *draft* token before the accept test; a wrong draft token is accepted wherever the
  target prefers its own token by less than `size`.
- `aux-layers`: the target feeds the draft the aux hidden states of `aux_ids` instead of the
  draft config's layers (a wrong aux layer or id convention): greedy output cannot change,
  acceptance drops.

Biases hit a pseudo-random `share` of positions chosen by a hash of (the target's top-1 id,
the other id, `seed`): the same positions in every run, independent of batch composition.
Both biases act on `vllm.v1.sample.rejection_sampler.rejection_sample` (its `target_logits`
rows: every position verified against a draft; the bonus token is untouched), the function
`RejectionSampler.forward` calls in vLLM 0.22-0.32; `aux-layers` replaces
`GPUModelRunner._get_eagle3_aux_layers_from_config` (the CPU runner inherits it).
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ENV = "SPECLAB_DEFECT"
KINDS = ("verify-bias", "accept-bias", "aux-layers")


class Defect(BaseModel):
    """One injected defect (see the module doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["verify-bias", "accept-bias", "aux-layers"]
    size: float = Field(0.0, ge=0)
    share: float = Field(1.0, gt=0, le=1)
    seed: int = 0
    aux_ids: list[int] | None = None

    @property
    def label(self) -> str:
        if self.kind == "aux-layers":
            return f"aux-layers-{'-'.join(map(str, self.aux_ids or []))}"
        return f"{self.kind}-{self.size:g}-s{self.seed}"

    def env(self) -> dict[str, str]:
        """The point environment that carries this defect."""
        return {ENV: self.model_dump_json()}


def from_env(env=None) -> Defect | None:
    """The defect a point's environment carries, if any (a malformed one raises early)."""
    raw = (os.environ if env is None else env).get(ENV)
    return Defect.model_validate_json(raw) if raw else None


# --------------------------------------------------------------------- position choice
_P = 1_000_003


def chosen(top1, other, seed: int, share: float):
    """Bool mask of positions a bias hits: a hash of (top-1 id, other id, seed) below `share`.
    Works on torch tensors of token ids (same shape)."""
    h = (top1.long() * 2_654_435_761 + other.long() * 40_503 + (seed + 1) * 97_531) % _P
    return h.double() / _P < share


def bias_logits(logits, draft_ids, defect: Defect):
    """Apply a bias defect to verify rows `logits` [n, vocab] (float32, changed in place) whose
    draft tokens are `draft_ids` [n]; returns (rows hit, rows whose argmax changed)."""
    import torch

    top2 = logits.topk(2, dim=-1).indices
    top1 = top2[:, 0]
    if defect.kind == "verify-bias":
        other = top2[:, 1]
        hit = chosen(top1, other, defect.seed, defect.share)
    else:  # accept-bias: only a draft token the target does not already prefer
        other = draft_ids.long()
        hit = chosen(top1, other, defect.seed, defect.share) & (other != top1)
    rows = torch.nonzero(hit).flatten()
    if len(rows):
        logits[rows, other[rows]] += defect.size
    flips = int((logits[rows].argmax(-1) != top1[rows]).sum()) if len(rows) else 0
    return len(rows), flips


# --------------------------------------------------------------------- installation
class _State:
    def __init__(self) -> None:
        self.defect: Defect | None = None
        self.stats = {"verify_rows": 0, "rows_hit": 0, "argmax_changed": 0}


STATE = _State()


def set_defect(defect: Defect | None) -> None:
    """Make `defect` the active bias (None: none) and reset the counters."""
    STATE.defect = defect
    STATE.stats = {"verify_rows": 0, "rows_hit": 0, "argmax_changed": 0}


def install(defect: Defect | None = None) -> None:
    """Patch vLLM in this process (idempotent) and activate `defect`. Call before the engine
    is built: `aux-layers` is read when the model runner loads the draft."""
    from vllm.v1.sample import rejection_sampler as rs

    if not getattr(rs.rejection_sample, "_speclab_defect", False):
        original = rs.rejection_sample
        sig = inspect.signature(original)

        def rejection_sample(*args, **kwargs):
            d = STATE.defect
            if d is not None and d.kind in ("verify-bias", "accept-bias"):
                bound = sig.bind(*args, **kwargs)
                logits = bound.arguments["target_logits"]
                STATE.stats["verify_rows"] += int(logits.shape[0])
                hit, flips = bias_logits(logits, bound.arguments["draft_token_ids"], d)
                STATE.stats["rows_hit"] += hit
                STATE.stats["argmax_changed"] += flips
            return original(*args, **kwargs)

        rejection_sample._speclab_defect = True
        rs.rejection_sample = rejection_sample
    if defect is not None and defect.kind == "aux-layers":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        ids = tuple(int(i) for i in defect.aux_ids or ())
        if not ids:
            raise ValueError("aux-layers defect: give aux_ids")
        GPUModelRunner._get_eagle3_aux_layers_from_config = lambda self: ids
    set_defect(defect)


def describe(defect: Defect | None) -> dict | None:
    """The defect and what it did so far (for a point's metadata)."""
    if defect is None:
        return None
    return {**json.loads(defect.model_dump_json()), "label": defect.label, **STATE.stats}
