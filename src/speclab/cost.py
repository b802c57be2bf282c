"""What the DeepSeek-V4 EAGLE-3 overlay costs, from per-step timings of one eager engine.

tools/gpu/overlay_cost.py runs the experiments on the GPU; this module holds what can be
checked without one: which variant a decode step runs, and the statistics.

Design (tools/gpu/README.md "Cost"). Engine restarts cost 40-60 s each and differ from each
other by a few percent (the 2026-11-30 engine-per-run design gave 0.959, unexplained), so
every comparison runs inside ONE in-process eager engine: the model's class-level `forward`
is replaced by a timing wrapper that calls one of two variants per decode step, alternating
step by step (A B A B ...; the next round starts with the other one), CUDA-synchronised
before and after each call. A round is one `generate` call; its statistic is the ratio (or
difference) of the two variants' median step times; the rounds give the mean and a 95 %
t-interval. Experiments:

* `unused`: the overlay's forward with no aux layers (installed, plain decoding) vs vLLM's
  own `DeepseekV4Model.forward`, which the overlay keeps as
  `_dsv4_overlay_original_forward` (vLLM 0.22 + overlay only). The overlay's other patches
  act at engine start (KV-cache layout, draft config), so the forward is the only part that
  runs per step. Under CUDA graphs even that difference vanishes: with no aux layers the
  traced graph holds the same kernels (the membership tests are Python, evaluated once while
  tracing).
* `aux-T<n>`: the forward with 3 aux layers captured vs none, at n tokens per step (n = 4 x
  sequences: the tokens of a k=3 verify step). The overlay's forward on 0.22, vLLM's own on
  0.26; the aux states are computed and dropped, so generation is unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pandas as pd

PAIRS = {"unused": ("overlay", "stock"), "aux": ("aux", "noaux")}
_UNSET = object()
STEP_COLUMNS = ("experiment", "round", "call", "variant", "tokens", "t_start", "forward_s")


def variant_for(pair: tuple[str, str], round_: int, call: int) -> str:
    """The variant that forward call `call` (0-based, within its round) runs: alternating,
    and each round starts with the variant the previous one started without."""
    return pair[(call + round_) % 2]


def with_aux(forward: Callable, layers: tuple[int, ...]) -> Callable:
    """`forward` run with `layers` captured (the model's aux_hidden_state_layers, set for the
    call and restored after it); returns the hidden states only, so that plain decoding goes
    on unchanged while the aux states are computed."""
    def run(model, *args, **kwargs):
        before = model.__dict__.get("aux_hidden_state_layers", _UNSET)
        model.aux_hidden_state_layers = tuple(layers)
        try:
            out = forward(model, *args, **kwargs)
        finally:
            if before is _UNSET:
                del model.aux_hidden_state_layers  # back to the class default, ()
            else:
                model.aux_hidden_state_layers = before
        return out[0] if isinstance(out, tuple) else out
    return run


class StepTimer:
    """Replaces `cls.forward` (class level, where vLLM's eager call path looks it up) with a
    wrapper that runs the variant `variant_for` picks for each call and records its time,
    with `sync` (torch.cuda.synchronize on a GPU) before and after the call.

        timer = StepTimer(DeepseekV4Model, {"overlay": f1, "stock": f0}, sync)
        with timer.installed():
            timer.start("unused", round_=0, seqs=8); llm.generate(...)
        pd.DataFrame(timer.records)
    """

    def __init__(self, cls: type, variants: dict[str, Callable], sync: Callable[[], Any]):
        self.cls, self.variants, self.sync = cls, variants, sync
        self.records: list[dict] = []
        self.experiment: str | None = None

    def start(self, experiment: str, round_: int, seqs: int) -> None:
        pair = PAIRS[experiment.split("-")[0]]
        missing = set(pair) - set(self.variants)
        if missing:
            raise ValueError(f"experiment {experiment}: no variant {sorted(missing)}")
        self.experiment, self.round, self.seqs, self.pair, self.call = (
            experiment, round_, seqs, pair, 0)

    def _forward(self, model, *args, **kwargs):
        if self.experiment is None:
            raise RuntimeError("StepTimer: start() an experiment before generating")
        # forward(input_ids, positions, intermediate_tensors, inputs_embeds=None)
        named = dict(zip(("input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
                         args), **kwargs)
        ids = named.get("input_ids")
        if ids is None:
            ids = named["inputs_embeds"]
        variant = variant_for(self.pair, self.round, self.call)
        self.sync()
        t0 = time.perf_counter()
        out = self.variants[variant](model, *args, **kwargs)
        self.sync()
        self.records.append({"experiment": self.experiment, "round": self.round,
                             "call": self.call, "variant": variant, "tokens": int(ids.shape[0]),
                             "seqs": self.seqs, "t_start": t0,
                             "forward_s": time.perf_counter() - t0})
        self.call += 1
        return out

    @contextmanager
    def installed(self) -> Iterator[StepTimer]:
        original = self.cls.__dict__["forward"]
        timer = self

        def forward(model, *args, **kwargs):
            return timer._forward(model, *args, **kwargs)

        self.cls.forward = forward
        try:
            yield self
        finally:
            self.cls.forward = original


def decode_steps(steps: pd.DataFrame) -> pd.DataFrame:
    """Decode steps only (one token per sequence: `tokens` == the experiment's sequences),
    each with `step_s`: time to the next forward call of its round (model, sampler and
    scheduler), NaN for a round's last call."""
    missing = set(STEP_COLUMNS + ("seqs",)) - set(steps.columns)
    if missing:
        raise ValueError(f"step records lack columns {sorted(missing)}")
    s = steps.sort_values(["experiment", "round", "call"]).copy()
    s["step_s"] = s.groupby(["experiment", "round"]).t_start.shift(-1) - s.t_start
    return s[s.tokens == s.seqs].reset_index(drop=True)


def rounds(steps: pd.DataFrame) -> pd.DataFrame:
    """Per experiment and round: each variant's median forward and step time, the ratio
    A/B of the forward medians and the difference A-B (ms)."""
    dec = decode_steps(steps)
    rows = []
    for (exp, rnd), g in dec.groupby(["experiment", "round"]):
        a, b = PAIRS[exp.split("-")[0]]
        med = g.groupby("variant")[["forward_s", "step_s"]].median()
        if not {a, b} <= set(med.index):
            raise ValueError(f"{exp} round {rnd}: needs decode steps of both {a} and {b}")
        rows.append({"experiment": exp, "round": rnd, "steps": len(g),
                     "forward_ms_a": med.forward_s[a] * 1e3, "forward_ms_b": med.forward_s[b] * 1e3,
                     "step_ms_b": med.step_s[b] * 1e3,
                     "ratio": med.forward_s[a] / med.forward_s[b],
                     "diff_ms": (med.forward_s[a] - med.forward_s[b]) * 1e3})
    return pd.DataFrame(rows)


def mean_ci(values, level: float = 0.95) -> dict:
    """Mean with a Student-t confidence interval (needs 2+ values)."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        raise ValueError(f"a confidence interval needs 2+ rounds, got {len(v)}")
    half = stats.t.ppf(0.5 + level / 2, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return {"mean": float(v.mean()), "lo": float(v.mean() - half), "hi": float(v.mean() + half),
            "n": len(v), "level": level}


def summarize(steps: pd.DataFrame) -> dict:
    """Per experiment: rounds, the forward ratio A/B with its 95 % CI and, for the aux
    experiments, the extra milliseconds and their share of the forward and of the whole
    plain decode step at that token count."""
    table = rounds(steps)
    out = {}
    for exp, g in table.groupby("experiment"):
        a, b = PAIRS[exp.split("-")[0]]
        res = {"variants": [a, b], "rounds": len(g), "steps": int(g.steps.sum()),
               "tokens": int(steps[steps.experiment == exp].seqs.iloc[0]),
               "forward_ms_a": float(g.forward_ms_a.median()),
               "forward_ms_b": float(g.forward_ms_b.median()),
               "step_ms_b": float(g.step_ms_b.median()),
               "ratio": mean_ci(g.ratio), "diff_ms": mean_ci(g.diff_ms)}
        if exp.startswith("aux"):
            res["share_of_forward"] = res["diff_ms"]["mean"] / res["forward_ms_b"]
            res["share_of_step"] = res["diff_ms"]["mean"] / res["step_ms_b"]
        out[exp] = res
    return out


def _pct(x: float) -> str:
    return f"{(x - 1) * 100:+.2f} %"


def markdown(result: dict) -> str:
    """Short summary of a cost.json (see tools/gpu/overlay_cost.py)."""
    v = result.get("versions", {})
    lines = [f"# Overlay cost: vLLM {v.get('vllm')} on {v.get('gpu', '?')}", "",
             f"- date: {result.get('date')}", f"- command: `{result.get('command')}`",
             "- versions: " + ", ".join(f"{k} {v[k]}" for k in ("vllm", "torch", "transformers",
                                                                  "cuda") if v.get(k)),
             f"- overlay: {result.get('overlay', 'not installed')}",
             "- method: one in-process eager engine; the variants alternate per decode step, "
             "CUDA-synchronised; per round the ratio of median forward times; mean and 95 % "
             "t-interval over rounds (speclab.cost)", ""]
    exps = result.get("experiments", {})
    if "unused" in exps:
        r = exps["unused"]
        c = r["ratio"]
        lines += ["## Installed but unused (plain decoding)", "",
                  f"Forward with the overlay / vLLM's own forward at {r['tokens']} tokens per "
                  f"step: **{c['mean']:.4f}** (95 % CI {c['lo']:.4f} to {c['hi']:.4f}, "
                  f"{c['n']} rounds, {r['steps']} steps), i.e. {_pct(c['mean'])}; medians "
                  f"{r['forward_ms_a']:.3f} vs {r['forward_ms_b']:.3f} ms per forward. Under "
                  "CUDA graphs the difference is zero by construction (same traced kernels).",
                  ""]
    aux = sorted((e for e in exps if e.startswith("aux")), key=lambda e: exps[e]["tokens"])
    if aux:
        lines += ["## Aux capture (3 layers), eager", "",
                  "| tokens/step (k=3: 4 x seqs) | extra ms (95 % CI) | forward ms | share of "
                  "forward | plain step ms | share of step |", "| ---: | --- | ---: | ---: | "
                  "---: | ---: |"]
        for e in aux:
            r = exps[e]
            d = r["diff_ms"]
            lines.append(f"| {r['tokens']} | {d['mean']:.3f} ({d['lo']:.3f} to {d['hi']:.3f}) | "
                         f"{r['forward_ms_b']:.3f} | {r['share_of_forward'] * 100:.1f} % | "
                         f"{r['step_ms_b']:.3f} | {r['share_of_step'] * 100:.1f} % |")
        lines += ["", "A k=3 verify step also runs the draft 3 times, so its share of a whole "
                  "speculative step is smaller than the share of a plain step shown here. "
                  "Eager timing includes kernel launches; under CUDA graphs only the kernels "
                  "remain, so these are upper bounds there.", ""]
    return "\n".join(lines)


def compare_markdown(results: list[dict]) -> str:
    """The aux capture figures of several cost.json (e.g. vLLM 0.22 + overlay and 0.26
    native) side by side."""
    lines = ["| vLLM | forward | tokens/step | extra ms (95 % CI) | share of forward | share of "
             "plain step |", "| --- | --- | ---: | --- | ---: | ---: |"]
    for res in results:
        who = "overlay" if res.get("overlay") else "native"
        for e, r in sorted(res.get("experiments", {}).items(), key=lambda kv: kv[1]["tokens"]):
            if e.startswith("aux"):
                d = r["diff_ms"]
                lines.append(f"| {res['versions'].get('vllm')} | {who} | {r['tokens']} | "
                             f"{d['mean']:.3f} ({d['lo']:.3f} to {d['hi']:.3f}) | "
                             f"{r['share_of_forward'] * 100:.1f} % | "
                             f"{r['share_of_step'] * 100:.1f} % |")
    return "\n".join(lines) + "\n"
