"""speclab.cost: the alternation schedule and the statistics of tools/gpu/overlay_cost.py,
on synthetic step timings with a known effect."""
import numpy as np
import pandas as pd
import pytest

from speclab import cost


def synthetic(effects: dict[str, float], rounds=6, calls=41, seqs=8, base=0.020, noise=0.0004,
              drift=0.00002, seed=0, prefill=True):
    """Step records as overlay_cost.py writes them: per round a prefill call (tokens =
    24 x seqs) then decode calls; variant A's forward takes `effect` x B's, plus noise and a
    slow drift across the run (which alternation must cancel)."""
    rng = np.random.default_rng(seed)
    rows, t = [], 0.0
    for exp, effect in effects.items():
        pair = cost.PAIRS[exp.split("-")[0]]
        for r in range(rounds):
            for c in range(calls):
                v = cost.variant_for(pair, r, c)
                tokens = 24 * seqs if (prefill and c == 0) else seqs
                fwd = (base + drift * len(rows)) * (effect if v == pair[0] else 1.0)
                fwd += rng.normal(0, noise)
                rows.append({"experiment": exp, "round": r, "call": c, "variant": v,
                             "tokens": tokens, "seqs": seqs, "t_start": t, "forward_s": fwd})
                t += fwd + 0.005  # sampler and scheduler
    return pd.DataFrame(rows)


def test_alternation_is_balanced_and_flips_each_round():
    pair = cost.PAIRS["unused"]
    r0 = [cost.variant_for(pair, 0, c) for c in range(6)]
    r1 = [cost.variant_for(pair, 1, c) for c in range(6)]
    assert r0 == ["overlay", "stock"] * 3 and r1 == ["stock", "overlay"] * 3


def test_known_ratio_is_recovered_within_its_interval():
    res = cost.summarize(synthetic({"unused": 1.01}))["unused"]
    c = res["ratio"]
    assert c["lo"] < 1.01 < c["hi"] and c["hi"] - c["lo"] < 0.025 and c["n"] == 6
    assert res["tokens"] == 8 and res["rounds"] == 6 and res["steps"] == 6 * 40
    # no effect: the interval holds 1
    c0 = cost.summarize(synthetic({"unused": 1.0}, seed=3))["unused"]["ratio"]
    assert c0["lo"] < 1.0 < c0["hi"]


def test_drift_is_cancelled_by_alternation_not_by_luck():
    """A run-long slowdown: step-wise alternation does not see it; the same steps labelled
    in blocks (rounds 0-2 all A, rounds 3-5 all B, paired up) do."""
    steps = synthetic({"unused": 1.0}, noise=0.0, drift=0.00005)
    assert abs(cost.summarize(steps)["unused"]["ratio"]["mean"] - 1.0) < 0.002
    blocks = steps.copy()
    blocks["variant"] = np.where(blocks["round"] < 3, "overlay", "stock")
    blocks["round"] = blocks["round"] % 3
    assert cost.summarize(blocks)["unused"]["ratio"]["mean"] < 0.9


def test_prefill_is_left_out_and_step_time_is_measured_to_the_next_call():
    steps = synthetic({"unused": 1.0}, rounds=2, calls=5)
    dec = cost.decode_steps(steps)
    assert len(dec) == 2 * 4 and (dec.tokens == 8).all()
    first = dec.iloc[0]
    assert first.step_s == pytest.approx(first.forward_s + 0.005)
    assert dec.groupby("round").step_s.apply(lambda s: s.isna().sum()).tolist() == [1, 1]


def test_aux_extra_milliseconds_and_shares():
    steps = pd.concat([synthetic({"aux-T4": 1.05}, seqs=4, seed=1),
                       synthetic({"aux-T32": 1.10}, seqs=32, seed=2)])
    res = cost.summarize(steps)
    r = res["aux-T32"]
    assert r["variants"] == ["aux", "noaux"] and r["tokens"] == 32
    assert r["diff_ms"]["lo"] < r["forward_ms_b"] * 0.10 < r["diff_ms"]["hi"]
    assert r["share_of_forward"] == pytest.approx(0.10, abs=0.01)
    assert r["share_of_step"] < r["share_of_forward"]  # the step also samples and schedules
    md = cost.markdown({"versions": {"vllm": "0.26.0", "gpu": "NVIDIA H200"}, "date": "d",
                        "command": "c", "experiments": res})
    assert "| 32 |" in md and "| 4 |" in md and "Installed but unused" not in md
    table = cost.compare_markdown([{"versions": {"vllm": "0.22.0"}, "overlay": "0.3",
                                    "experiments": res},
                                   {"versions": {"vllm": "0.26.0"}, "experiments": res}])
    assert "| 0.22.0 | overlay | 4 |" in table and "| 0.26.0 | native | 32 |" in table


def test_unused_markdown_states_ratio_and_interval():
    res = cost.summarize(synthetic({"unused": 1.0}))
    md = cost.markdown({"versions": {"vllm": "0.22.0"}, "overlay": "0.3", "experiments": res})
    c = res["unused"]["ratio"]
    assert f"**{c['mean']:.4f}**" in md and f"{c['lo']:.4f} to {c['hi']:.4f}" in md


@pytest.mark.parametrize("bad, message", [
    ({"rounds": 1}, "needs 2\\+ rounds"),
])
def test_one_round_gives_no_interval(bad, message):
    with pytest.raises(ValueError, match=message):
        cost.summarize(synthetic({"unused": 1.0}, **bad))


def test_records_without_the_needed_columns_are_refused():
    with pytest.raises(ValueError, match="lack columns"):
        cost.decode_steps(synthetic({"unused": 1.0}).drop(columns=["seqs"]))


class FakeModel:
    """A DeepseekV4Model stand-in: returns (hidden, aux) when aux layers are set."""
    aux_hidden_state_layers = ()
    calls: list = []

    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        FakeModel.calls.append(tuple(self.aux_hidden_state_layers))
        hidden = input_ids * 2
        if self.aux_hidden_state_layers:
            return hidden, [hidden + i for i in self.aux_hidden_state_layers]
        return hidden


def test_step_timer_alternates_variants_records_steps_and_restores_forward():
    import torch

    original = FakeModel.forward
    timer = cost.StepTimer(FakeModel, {"aux": cost.with_aux(original, (1, 2, 3)),
                                       "noaux": original}, sync=lambda: None)
    model, ids = FakeModel(), torch.arange(4)
    FakeModel.calls = []
    with timer.installed():
        assert FakeModel.forward is not original
        for r in range(2):
            timer.start("aux-T4", round_=r, seqs=4)
            outs = [model.forward(ids, None, None) for _ in range(3)]
            assert all(torch.equal(o, ids * 2) for o in outs)  # plain output either way
    assert FakeModel.forward is original and "aux_hidden_state_layers" not in model.__dict__
    assert FakeModel.calls == [(1, 2, 3), (), (1, 2, 3), (), (1, 2, 3), ()]
    df = pd.DataFrame(timer.records)
    assert df.variant.tolist() == ["aux", "noaux", "aux", "noaux", "aux", "noaux"]
    assert (df.tokens == 4).all() and df["call"].tolist() == [0, 1, 2] * 2
    assert (df.forward_s >= 0).all() and df.t_start.is_monotonic_increasing


def test_step_timer_needs_both_variants_and_a_started_experiment():
    timer = cost.StepTimer(FakeModel, {"overlay": FakeModel.forward}, sync=lambda: None)
    with pytest.raises(ValueError, match="no variant \\['stock'\\]"):
        timer.start("unused", round_=0, seqs=8)
    with timer.installed(), pytest.raises(RuntimeError, match="start\\(\\) an experiment"):
        FakeModel().forward(np.arange(3), None, None)
    assert (FakeModel.forward.__name__ == "forward"
            and "timer" not in FakeModel.forward.__code__.co_freevars)


def test_overlay_cost_script_summarizes_and_compares_without_a_gpu(tmp_path):
    import json
    import subprocess
    import sys

    from speclab.profiles import REPO

    script = REPO / "tools/gpu/overlay_cost.py"
    runs = {}
    for vllm, effects in (("0.22.0", {"unused": 1.0, "aux-T4": 1.05, "aux-T32": 1.08}),
                          ("0.26.0", {"aux-T4": 1.04, "aux-T32": 1.07})):
        d = tmp_path / vllm
        d.mkdir()
        steps = pd.concat([synthetic({e: f}, seqs=int(e[5:]) if e.startswith("aux") else 8,
                                     seed=i) for i, (e, f) in enumerate(effects.items())])
        steps.to_parquet(d / "steps.parquet")
        (d / "cost.json").write_text(json.dumps({
            "date": "2026-12-01", "command": "overlay_cost.py", "versions": {"vllm": vllm},
            "overlay": {"overlay_version": "x"} if vllm == "0.22.0" else None}))
        out = subprocess.run([sys.executable, str(script), "--summarize", "--run-dir", str(d)],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        runs[vllm] = d
    res = json.loads((runs["0.22.0"] / "cost.json").read_text())
    assert set(res["experiments"]) == {"unused", "aux-T4", "aux-T32"} and res["date"]
    assert "Installed but unused" in (runs["0.22.0"] / "cost.md").read_text()
    assert "Installed but unused" not in (runs["0.26.0"] / "cost.md").read_text()
    out = subprocess.run([sys.executable, str(script), "--compare", str(runs["0.22.0"]),
                          str(runs["0.26.0"]), "--out", str(tmp_path / "c.md")],
                         capture_output=True, text=True)
    table = (tmp_path / "c.md").read_text()
    assert out.returncode == 0 and table.count("| 0.22.0 | overlay |") == 2
    assert table.count("| 0.26.0 | native |") == 2


RUNS = ("h100-realshape-cost-20261206-vllm022", "h100-realshape-cost-20261206-vllm026")


@pytest.mark.parametrize("run", RUNS)
def test_committed_real_shape_runs_are_their_steps(run):
    """The committed real-shape cost runs (README "What has run on GPUs so far"): cost.json's
    figures are `cost.summarize` of the run's own steps.parquet; the control, the unused
    experiment's overlay steps made 2% slower, moves the ratio out of the stated interval."""
    import json

    from speclab.profiles import REPO

    d = REPO / "data/runs" / run
    steps = pd.read_parquet(d / "steps.parquet")
    stated = json.loads((d / "cost.json").read_text())["experiments"]
    again = cost.summarize(steps)
    assert set(again) == set(stated)
    for exp, r in stated.items():
        assert again[exp]["ratio"] == pytest.approx(r["ratio"])
        assert again[exp]["diff_ms"] == pytest.approx(r["diff_ms"])
    if "unused" not in stated:
        return
    assert stated["unused"]["ratio"]["lo"] < 1 < stated["unused"]["ratio"]["hi"]
    slow = steps.assign(forward_s=steps.forward_s.where(
        (steps.experiment != "unused") | (steps.variant != "overlay"), steps.forward_s * 1.02))
    moved = cost.summarize(slow)["unused"]["ratio"]
    assert moved["lo"] > stated["unused"]["ratio"]["hi"]
