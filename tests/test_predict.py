"""The cost model on synthetic gpubench results whose step costs follow a known law:
predictions recover measured speedups; a model that drops the drafter's time or prices the
verify step as one plain step misses them (the controls)."""

import functools
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from speclab import cudagraphs, hostwatch, layerfit, predict, predictreport, stepcosts

N = 128
RATES = (0.7, 0.5, 0.35, 0.25, 0.18)
COMMITTED = Path(__file__).resolve().parents[1] / "data/runs"  # the committed GPU runs


def t_plain(n, layers=4):
    return 0.3 * layers + 0.02 * n + 0.0004 * n * n  # ms


def t_draft(k, B):
    return 0.25 + 0.15 * k + 0.01 * B * k


def graph(B, k):
    """Rows of the verify step's CUDA graph (`cudagraphs.graph_rows`: B = 4 at k = 2, 12
    tokens, runs the 18-row graph)."""
    return cudagraphs.graph_rows(B, k + 1)


@functools.lru_cache
def request_rounds(B, k, n, rates, draws=400):
    """Monte Carlo rounds of `draws` batches of B requests of `n` tokens, each round
    accepting the first i drafts with probability p_i - p_{i+1} (independent of
    `predict.round_survival`): an array draws x B."""
    g = np.random.default_rng(B * 100 + k)
    p = np.r_[1.0, rates[:k], 0.0]
    emitted = g.choice(k + 1, size=(draws, B, n), p=p[:-1] - p[1:]) + 1
    return (np.cumsum(emitted, axis=2) < n - 1).sum(axis=2) + 1


def batch(B, k, L, n, rates=RATES):
    """The truth of an offline batch: B requests stepped together until the last one ends
    (`request_rounds`), a step of m requests costing the plain step of its graph's rows plus
    the drafter at B. Returns the mean verify rounds a request ran and the batch's mean
    decode ms."""
    R = request_rounds(B, k, n, tuple(rates))
    cost = np.r_[0.0, [t_plain(graph(m, k), L) + t_draft(k, B) for m in range(1, B + 1)]]
    running = (R[:, :, None] >= np.arange(1, R.max() + 1)).sum(axis=1)  # draws x steps
    return float(R.mean()), float(cost[running].sum(axis=1).mean())


def rows(layers=(4,), rounds=5, rates=RATES, seed=0, n=N):
    """Passes as gpubench writes them (prefill 10 ms, `n` tokens a request), 1% noise on
    decode times; the plain engine captures every size it runs (`Engine.capture_sizes`), a
    verify step costs the plain step of its graph's rows, and a speculative pass lasts until
    its last request ends (`batch`)."""
    g = np.random.default_rng(seed)
    out = []
    for L in layers:
        plain_B = sorted({graph(b, k) for b in (1, 4, 16) for k in range(6)})
        sizes = sorted({*cudagraphs.token_sizes(max(plain_B)), *plain_B})
        for r in range(rounds + 1):
            for B in plain_B:
                dec = (n - 1) * t_plain(B, L) / 1e3 * g.normal(1, 0.01)
                out.append({"engine": f"L{L}-k0", "op": "pass", "layers": L, "k": 0, "eager": False,
                                "round": r, "B": B, "t_prefill_s": 0.01, "t_full_s": 0.01 + dec,
                                "output_tokens": B * n, "capture_sizes": sizes,
                                "counters": {"num_drafts": 0}})
            for k in range(1, 6):
                for B in (1, 4, 16):
                    steps, ms = batch(B, k, L, n, tuple(rates))
                    dec = ms / 1e3 * g.normal(1, 0.01)
                    acc = [round(B * steps * p) for p in rates[:k]]
                    out.append({"engine": f"L{L}-k{k}", "op": "pass", "layers": L, "k": k,
                                    "eager": False, "round": r, "B": B, "t_prefill_s": 0.01,
                                    "t_full_s": 0.01 + dec, "output_tokens": B * n,
                                    "counters": {"num_drafts": B * steps, "accepted_per_pos": acc}})
        for k in range(1, 6):
            for B in (1, 4, 16):
                calls = [{"tokens": B * (k + 1), "reqs": B, "ms": t_draft(k, B)}] * 20 + \
                        [{"tokens": B * 256, "reqs": B, "ms": 9.0}]  # a prefill call: ignored
                out.append({"engine": f"L{L}-k{k}", "op": "split", "layers": L, "k": k,
                                "eager": False, "round": 0, "B": B, "calls": calls, "counters": {}})
    return pd.DataFrame(out)


def test_step_costs_and_speedup_ci():
    c = stepcosts.step_costs(rows())
    steps, ms = batch(4, 3, 4, N)
    r = c[(c.k == 3) & (c.B == 4)].iloc[0]
    assert r.step_ms == pytest.approx(ms / steps, rel=0.02)  # decode over mean rounds
    assert r.step_ms > 1.03 * (t_plain(16) + t_draft(3, 4))  # the batch's tail
    assert r.rounds == 5 and r.speedup_lo < r.speedup < r.speedup_hi
    assert r.speedup == pytest.approx((N - 1) * t_plain(4) / ms, rel=0.02)


def test_draft_times_use_verify_steps_only():
    d = stepcosts.draft_ms(rows())
    assert d[(d.k == 2) & (d.B == 16)].draft_ms.iloc[0] == pytest.approx(t_draft(2, 16))


def test_validate_recovers_measurement_and_controls_fail():
    res = rows()
    v = predict.validate(res)
    assert len(v) == 15 and v.error.abs().max() < 0.03
    # control 1: without the drafter's time the predictions miss
    no_draft = predict.predict(stepcosts.step_costs(res),
                               stepcosts.draft_ms(res).assign(draft_ms=0.0), (0.7, 0.5, 0.35))
    m = stepcosts.step_costs(res)
    k3 = no_draft[(no_draft.k == 3) & (no_draft.B == 1)].pred_speedup.iloc[0]
    meas = m[(m.k == 3) & (m.B == 1)].speedup.iloc[0]
    assert k3 / meas - 1 > 0.05
    # control 2: verify priced as one plain step of B rows (B = 16: 16 rows, not 64)
    meas16 = m[(m.k == 3) & (m.B == 16)].speedup.iloc[0]
    wrong = (1 + 0.7 + 0.5 + 0.35) * t_plain(16) / (t_plain(16) + t_draft(3, 16))
    assert wrong / meas16 - 1 > 0.05


def test_an_offline_batch_pays_for_its_tail():
    """B requests started together run until the last ends, its last rounds with fewer
    requests: the rounds a request runs follow from the acceptance profile alone (equal to
    the Monte Carlo truth's), the model with that tail predicts every point within 2%, the
    model without it (every step at B, `error_steady`, the control) misses each B >= 4 point
    by over 3%, and at B = 1 the two agree."""
    s = predict.round_survival([1.0], 1, 10)
    assert s.tolist() == [1.0] * 5 and predict.round_survival([0.0], 2, 10).sum() == 10
    for k in (1, 3, 5):
        assert predict.round_survival(RATES, k, N - 1).sum() == \
            pytest.approx(batch(16, k, 4, N)[0], rel=0.01)
    assert predict.batch_step(np.arange(1.0, 17), s) == pytest.approx(16)  # cost ∝ requests
    assert predict.batch_step(np.ones(16), s) == pytest.approx(1)  # every request ends at 5
    v = predict.validate(rows())
    assert v.error.abs().max() < 0.02
    wide = v[v.B >= 4]
    assert (wide.error_steady > 0.03).all() and (wide.pred_tail_ms > 0).all()
    one = v[v.B == 1]
    assert (one.pred_tail_ms == 0).all() and (one.error == one.error_steady).all()


def test_the_h200_tails_are_predicted_from_acceptance():
    """On the committed H200 runs the tail the model predicts from each point's acceptance
    matches the one the split passes measured (their GPU time over all decode steps, per
    round a request ran, less the step at B) within 0.15 ms at B = 16, where it is 0.7-1.0
    ms; a model without it is off by that much (the control)."""
    for name, ks in (("h200-realshape-20261204-vllm026-graphs", (1, 3)),
                     ("h200-realshape-20261205-vllm026-deeprest", (2,))):
        res = stepcosts.load(COMMITTED / name)
        v = predict.validate(res).set_index(["layers", "draft", "k", "B"])
        a = stepcosts.step_anatomy(res).set_index(["layers", "draft", "k", "B"])
        for k in ks:
            key = (32, "", k, 16)
            assert abs(v.loc[key, "pred_tail_ms"] - a.loc[key, "tail_ms"]) < 0.15
            assert k == 1 or a.loc[key, "tail_ms"] > 0.6
            assert a.loc[(32, "", k, 1), "tail_ms"] == 0


def test_verify_rows_are_the_cuda_graphs(monkeypatch):
    """A verify step of 4 requests at k = 2 runs the 18-row graph: the model prices it so
    (within 3%); priced at its 12 tokens (the control) it misses by over 5%."""
    res = rows()
    v = predict.validate(res).set_index(["k", "B"])
    assert v.loc[(2, 4), "rows"] == 18 and abs(v.loc[(2, 4), "error"]) < 0.03
    monkeypatch.setattr(cudagraphs, "graph_rows", lambda r, q=1, *_: r * q)
    unpadded = predict.validate(res).set_index(["k", "B"])
    assert unpadded.loc[(2, 4), "error"] > 0.05
    assert abs(unpadded.loc[(3, 4), "error"]) < 0.03  # 16 rows: a graph of its own


def test_idle_is_the_step_the_gpu_does_not_run():
    """`idle_ms`: a timed step of 10 ms whose split pass ran 7 ms of target forward and
    2.5 ms of sampling on the GPU leaves it idle 0.5 ms; a pass 3 ms longer (the control)
    shows 3 ms more. `tail_ms`: 5 steps of 4 requests, then 2 steps of one request at 3 ms
    (22 request rounds, 5.5 a request) is the pass's GPU time per request round less the
    step at B: (5 * 9.5 + 2 * 3) / 5.5 - 9.5."""
    def frame(extra_s, tail=()):
        split = {"engine": "L4-k2-graphs", "op": "split", "layers": 4, "k": 2, "eager": False,
                 "round": 0, "B": 4, "counters": {},
                 "calls": [{"op": "execute", "tokens": 12, "reqs": 4, "ms": 7.0},
                           {"op": "sample", "tokens": 12, "reqs": 4, "ms": 2.5}] * 5 + [*tail]}
        passes = [{"engine": "L4-k2-graphs", "op": "pass", "layers": 4, "k": 2, "eager": False,
                   "round": r, "B": 4, "t_prefill_s": 0.01,
                   "t_full_s": 0.01 + 50 * (0.010 + extra_s / 50), "output_tokens": 4 * 101,
                   "counters": {"num_drafts": 200, "accepted_per_pos": [100, 50]}}
                  for r in (1, 2, 3)]
        return pd.DataFrame([split, *passes])

    a = stepcosts.step_anatomy(frame(0)).iloc[0]
    assert a.idle_ms == pytest.approx(0.5) and a.tail_ms == 0
    assert stepcosts.step_anatomy(frame(0.150)).idle_ms.iloc[0] == pytest.approx(3.5)
    last = [{"op": "execute", "tokens": 3, "reqs": 1, "ms": 2.0},
            {"op": "sample", "tokens": 3, "reqs": 1, "ms": 1.0}] * 2
    a = stepcosts.step_anatomy(frame(0, last)).iloc[0]
    assert a.tail_ms == pytest.approx((5 * 9.5 + 2 * 3) / 5.5 - 9.5)
    assert a.idle_ms == pytest.approx(10 - (5 * 9.5 + 2 * 3) / 5.5)


def with_host_drafter(res, host_ms, waited):
    """`res` with the drafter's host time `host_ms` recorded in the split passes and the
    fraction `waited` of its excess over GPU time added to each speculative step."""
    res = res.copy()
    split = res.op == "split"
    res.loc[split, "calls"] = res.loc[split, "calls"].map(
        lambda cs: [{**c, "host_ms": host_ms} for c in cs])
    spec = (res.op == "pass") & (res.k > 0)
    for i in res.index[spec]:
        k, B = res.at[i, "k"], res.at[i, "B"]
        step = t_plain(B * (k + 1)) + t_draft(k, B)
        extra = waited * (host_ms - t_draft(k, B))
        res.at[i, "t_full_s"] = 0.01 + (res.at[i, "t_full_s"] - 0.01) * (step + extra) / step
    return res


def test_validate_brackets_a_drafter_whose_host_time_is_partly_waited_for():
    """The GPU-only prediction is the upper bound, the drafter's host time serial to the
    verify step the lower; a step that waits for half the host time lies between them, one
    that waits for more than all of it (the control) does not."""
    v = predict.validate(with_host_drafter(rows(), host_ms=4.0, waited=0.5))
    assert v.bracketed.all() and (v.error > 0.05).any()
    assert (v.pred_serial_speedup < v.speedup).all() and (v.draft_host_ms == 4.0).all()
    over = predict.validate(with_host_drafter(rows(), host_ms=4.0, waited=1.5))
    assert not over.bracketed.any()
    assert predict.validate(rows()).bracketed.isna().all()  # no host time recorded: no bound


def test_best_k_and_profile_continuation():
    assert predict.acceptance_profile([0.6, 0.3], 4) == pytest.approx([0.6, 0.3, 0.15, 0.075])
    assert predict.acceptance_length(predict.PUBLISHED_EAGLE31, 3) == pytest.approx(2.344)
    with pytest.raises(ValueError, match="non-increasing"):
        predict.acceptance_profile([0.3, 0.6], 2)
    res = rows()
    p = predict.predict(stepcosts.step_costs(res), stepcosts.draft_ms(res),
                        predict.PUBLISHED_EAGLE31)
    assert p.groupby("B").best.sum().eq(1).all()


def test_the_acceptance_length_that_breaks_even(monkeypatch):
    """`al_needed` is the AL at which k's step pays for itself at B, whatever the rates: the
    speedup is AL over it. At B = 4 the 12-token verify step of k = 2 replays the 18-row graph:
    priced unpadded (the control) it needs less, while k = 3's 16 rows need the same."""
    res = rows()
    costs, drafts = stepcosts.step_costs(res), stepcosts.draft_ms(res)
    a = predict.predict(costs, drafts, RATES).set_index(["B", "k"])
    b = predict.predict(costs, drafts, (0.9, 0.8, 0.7, 0.6, 0.5)).set_index(["B", "k"])
    assert np.allclose(a.pred_speedup, a.al / a.al_needed)
    assert np.allclose(a.al_needed, b.al_needed) and not np.allclose(a.al, b.al)
    monkeypatch.setattr(cudagraphs, "graph_rows", lambda r, q=1, *_: r * q)
    u = predict.predict(costs, drafts, RATES).set_index(["B", "k"])
    assert u.al_needed[4, 2] < a.al_needed[4, 2] - 0.05
    assert u.al_needed[4, 3] == pytest.approx(a.al_needed[4, 3])


def test_extrapolation_is_linear_in_layers():
    res = rows(layers=(4, 8), rounds=2)
    costs, drafts = stepcosts.step_costs(res), stepcosts.draft_ms(res)
    ex = layerfit.extrapolate(costs, drafts, predict.PUBLISHED_EAGLE31, layers=43)
    fit = ex["fit"].set_index("n")
    assert fit.loc[4].b_ms_per_layer == pytest.approx(0.3, rel=0.05)
    p = ex["prediction"]
    row = p[(p.k == 3) & (p.B == 4)].iloc[0]
    expect = 2.344 * t_plain(4, 43) / (t_plain(16, 43) + t_draft(3, 4))
    assert row.pred_speedup == pytest.approx(expect, rel=0.05)
    with pytest.raises(ValueError, match="two layer counts"):
        layerfit.extrapolate(stepcosts.step_costs(rows(rounds=2)), drafts, (0.6,))


def test_extrapolation_pairs_depths_by_graph_rows():
    """An engine without an n-row graph runs B = n on a larger one (here the 32-layer engine
    has no 3-, 5- or 6-row graph, as on the H200 runs of 2026-12-04/05): the layer fit pairs
    steps by the rows they ran, so every line at 43 layers is the truth's. The control pairs
    them by B (`rows` set to B): the line at n = 3 goes through T(3, 24) and T(4, 32) and
    misses T(3, 43) by over 10%."""
    def law(n, L):
        return 1.0 + 0.2 * n + (0.15 + 0.01 * n) * L

    fit_rows = {24: {b: b for b in (1, 2, 3, 4, 5, 6, 8)},
                32: {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 8: 8}}
    costs = pd.DataFrame(
        [{"layers": L, "eager": False, "draft": "", "k": 0, "B": B, "rows": n,
          "step_ms": law(n, L), "step_lo": law(n, L) - 0.05, "step_hi": law(n, L) + 0.05,
          "rounds": 5} for L, sizes in fit_rows.items() for B, n in sizes.items()]
        + [{"layers": 32, "eager": False, "draft": "", "k": 1, "B": B, "rows": 2 * B,
            "step_ms": 9.0, "step_lo": 8.9, "step_hi": 9.1, "rounds": 5} for B in (1, 4)])
    drafts = stepcosts.draft_ms(rows(layers=(8,), rounds=1))
    ex = layerfit.extrapolate(costs, drafts, predict.PUBLISHED_EAGLE31, layers=43)
    assert sorted(ex["fit"].n) == [1, 2, 4, 8]  # 3, 5 and 6 rows ran at 24 layers only
    plain = ex["plain"].set_index("rows").step_ms
    assert np.allclose(plain, [law(n, 43) for n in plain.index])
    by_B = layerfit.extrapolate(costs.assign(rows=costs.B), drafts, predict.PUBLISHED_EAGLE31,
                               layers=43)["plain"].set_index("B").step_ms
    assert by_B[3] / law(3, 43) - 1 > 0.10
    assert np.allclose(by_B[[1, 2, 4, 8]], [law(n, 43) for n in (1, 2, 4, 8)])


def test_a_depth_held_out_checks_the_extrapolation():
    """With three depths the deepest with speculative points (12) is left out: the line
    through 4 and 8 layers and the 8-layer drafter predict its plain steps and speedups
    within 3%. The control: plain passes at 12 layers 15% slower than the law (the per-layer
    cost not linear past 8) make both checks miss by over 10%."""
    res = rows(layers=(4, 8, 12), rounds=3)
    h = layerfit.held_out(res)
    assert set(h.layers) == {12} and set(h.from_layers) == {"[4, 8]"}
    assert set(h.kind) == {"plain", "spec"} and len(h[h.kind == "spec"]) == 15
    assert h.error.abs().max() < 0.03
    plain = h[h.kind == "plain"].set_index("rows")
    assert plain.predicted[16] == pytest.approx(t_plain(16, 12), rel=0.01)
    slow = res.copy()
    bent = (slow.layers == 12) & (slow.k == 0)
    slow.loc[bent, "t_full_s"] = 0.01 + (slow.loc[bent, "t_full_s"] - 0.01) * 1.15
    c = layerfit.held_out(slow)
    assert (c[c.kind == "plain"].error < -0.10).all() and (c[c.kind == "spec"].error < -0.10).all()
    assert layerfit.held_out(rows(layers=(4, 8), rounds=2)).empty  # two depths: none to spare
    section = "\n".join(predictreport._held_out_lines(res, 43))
    assert section.startswith("## A depth held out") and "Largest |error|" in section


def test_pass_length_comes_from_the_pass():
    """Passes of 512 tokens (`gpubench drive --tokens 512`) price the same steps and AL, and
    a batch's tail is a smaller share of a longer pass."""
    c = stepcosts.step_costs(rows(n=512))
    plain = c[(c.k == 0) & (c.B == 4)].iloc[0]
    assert plain.step_ms == pytest.approx(t_plain(4), rel=0.02)
    r = c[(c.k == 3) & (c.B == 4)].iloc[0]
    assert r.step_ms == pytest.approx(np.divide(*batch(4, 3, 4, 512)[::-1]), rel=0.02)
    assert r.tokens == 511 and r.al == pytest.approx(1 + 0.7 + 0.5 + 0.35, rel=0.01)
    short = stepcosts.step_costs(rows(n=128)).query("k == 3 and B == 4").step_ms.iloc[0]
    assert t_plain(16) + t_draft(3, 4) < r.step_ms < short


def test_step_anatomy_and_drafter_host_time_from_timed_calls():
    """Split passes with every part timed: medians per part at the decode steps only, the
    drafter's host time beside its GPU time; records without an op count as the drafter's."""
    def call(op, tokens, ms, host):
        return {"op": op, "tokens": tokens, "reqs": 4, "ms": ms, "host_ms": host}

    steps = [c for i in range(9) for c in (call("execute", 16, 2.0 + i % 2, 4.0),
                                           call("sample", 16, 3.0, 6.0),
                                           call("propose", 16, 2.5, 5.0 + i % 3))]
    prefill = [call("execute", 1024, 50.0, 9.0), call("propose", 1024, 9.0, 9.0)]
    split = pd.DataFrame([
        {"engine": "L4-k3-graphs-drafteager", "op": "split", "layers": 4, "k": 3,
         "eager": False, "round": 0, "B": 4, "calls": prefill + steps, "counters": {}},
        {"engine": "L4-k0-graphs", "op": "split", "layers": 4, "k": 0, "eager": False,
         "round": 0, "B": 4, "calls": [call("execute", 4, 1.0, 3.0)] * 3, "counters": {}}])
    a = stepcosts.step_anatomy(split).set_index("k")
    assert a.loc[3, ["execute_ms", "execute_host_ms", "sample_host_ms", "propose_ms"]].tolist() \
        == [2.0, 4.0, 6.0, 2.5]
    assert a.loc[3, "propose_host_ms"] == 6.0 and a.loc[3, "draft"] == "drafteager"
    assert a.loc[0, "execute_host_ms"] == 3.0 and np.isnan(a.loc[0, "propose_ms"])
    assert a.idle_ms.isna().all()  # no timed pass: no step to compare with
    d = stepcosts.draft_ms(split).iloc[0]
    assert (d.draft_ms, d.draft_host_ms, d.draft_calls) == (2.5, 6.0, 9)
    resumed = pd.concat([split, split.iloc[1:]], ignore_index=True)  # carried state, twice
    assert len(stepcosts.step_anatomy(resumed)) == 2
    old = split.iloc[:1].assign(calls=[[{"tokens": 16, "reqs": 4, "ms": 1.5}] * 3])
    assert stepcosts.draft_ms(old).draft_ms.tolist() == [1.5] and stepcosts.step_anatomy(old).empty


def test_no_extrapolation_from_a_step_that_does_not_grow_with_depth():
    """The control: plain steps equal at 4 and 8 layers (host-bound) give no line to extend."""
    res = rows(layers=(4, 8), rounds=3)
    plain = res.k == 0
    flat = res[plain & (res.layers == 4)].set_index(["round", "B"]).t_full_s
    deep = plain & (res.layers == 8)
    res.loc[deep, "t_full_s"] = [flat[(r, B)] for r, B in zip(res[deep]["round"], res[deep].B)]
    costs, drafts = stepcosts.step_costs(res), stepcosts.draft_ms(res)
    with pytest.raises(ValueError, match="does not grow"):
        layerfit.extrapolate(costs, drafts, predict.PUBLISHED_EAGLE31, layers=43)
    ex = layerfit.extrapolate(stepcosts.step_costs(rows(layers=(4, 8), rounds=3)), drafts,
                             predict.PUBLISHED_EAGLE31, layers=43)
    assert ex["fit"].resolved.all()


def test_report_writes_tables_figure_and_html(tmp_path):
    run = tmp_path / "run"
    (run / "call1").mkdir(parents=True)
    res = rows(layers=(4, 8), rounds=3)
    (run / "call1" / "results.jsonl").write_text(res.to_json(orient="records", lines=True))
    md = predictreport.report(run).read_text()
    assert "Predicted vs measured" in md and "43 layers" in md and "largest |error|" in md
    assert "A depth held out" not in md  # two depths: the fit needs both
    assert "## The host during the timed passes" not in md  # no host.jsonl: no section
    # this law's per-layer step is 0.3 ms whatever the batch: no experts' part to carry to a node
    assert "## On a TP 8 + EP node\n\nNot computed: the per-layer step does not grow" in md
    assert (run / "figures" / "speedup_vs_k.png").exists() and (run / "predict.html").exists()


def test_report_sets_a_stalled_round_beside_the_host_that_stalled_it(tmp_path):
    """Passes back to back in time, the host sampled every second beside them (as `gpubench`
    writes `host.jsonl`); in round 2 of k = 3 at B = 1 a neighbour took three cores and the
    step ran 20% long: that row shows both, the other rounds of the engine neither."""
    import json

    res = rows(layers=(4, 8), rounds=3)
    stalled = (res.engine == "L4-k3") & (res["round"] == 2) & (res.B == 1)
    res.loc[stalled, "t_full_s"] = 0.01 + 1.2 * (res.loc[stalled, "t_full_s"] - 0.01)
    res["t_full_start"] = 1000.0 + (res.t_full_s + 0.5).cumsum().shift(fill_value=0)
    a = res.loc[stalled, "t_full_start"].iloc[0]
    b = a + res.loc[stalled, "t_full_s"].iloc[0]
    end = (res.t_full_start + res.t_full_s).max()
    host = [{"t": t, "dt": 1.0, "busy": 1.0 + 3.0 * (a < t and t - 1 < b), "iowait": 0.0,
             "steal": 0.0, "load1": 1.0,
             "top": [[9, "VLLM::EngineCore", 1.0, 0]]
             + ([[77, "neighbour", 3.0, 4]] if a < t and t - 1 < b else []),
             "gpu": {"sm_mhz": 1980.0, "power_w": 500.0, "temp_c": 50.0,
                     "reasons": "0x0000000000000000"}}
            for t in np.arange(1001.0, end + 2)]
    (tmp_path / "results.jsonl").write_text(res.to_json(orient="records", lines=True))
    (tmp_path / "host.jsonl").write_text("".join(json.dumps(h) + "\n" for h in host))
    md = predictreport.report(tmp_path).read_text()
    section = md.split("## The host during the timed passes")[1].split("\n## ")[0]
    k3 = [line.split(" | ") for line in section.splitlines() if line.startswith("L4-k3 | 1 | 3 |")]
    assert [int(r[3]) for r in k3] == [1, 2, 3]
    by_round = {int(r[3]): r for r in k3}
    assert float(by_round[2][5]) > 1.1 and "neighbour" in by_round[2][-1]
    assert [float(r[10]) for r in k3] == [1980.0] * 3  # the GPU's clock, sampled beside
    assert all(float(by_round[r][5]) < 1.05 and "neighbour" not in by_round[r][-1]
               for r in (1, 3))


def test_report_refuses_a_run_without_timed_rounds(tmp_path):
    (tmp_path / "results.jsonl").write_text(rows(rounds=0).to_json(orient="records", lines=True))
    with pytest.raises(ValueError, match="no timed pass"):
        predictreport.report(tmp_path)


def test_report_of_a_run_that_only_served(tmp_path):
    """A run of `vllm serve` engines alone (`serve-h100`, the committed third-H100 repeat)
    reports its served speedups and weights, no cost model; its warm-up rounds alone (the
    control) are still refused."""
    import json
    src = COMMITTED / "h100-realshape-20261206-vllm026-serverepeat"
    md = predictreport.report(src, out_dir=tmp_path / "report").read_text()
    assert "Only engines behind `vllm serve` ran" in md and "## Behind `vllm serve`" in md
    assert "## Predicted vs measured" not in md and "## Weights: estimate vs vLLM" in md
    row = next(line for line in md.splitlines() if line.startswith("18 | 16 | 3 |"))
    assert row.split(" | ")[-1] == "4"  # round 1's 1.56 s prefill (a stall) is not kept
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "results.jsonl").write_text("".join(
        line for line in (src / "results.jsonl").read_text().splitlines(keepends=True)
        if json.loads(line)["round"] == 0))
    with pytest.raises(ValueError, match="no timed pass"):
        predictreport.report(warm)


def test_memory_check_against_the_h200_loading_lines():
    """The committed real-shape run: 15.45 GiB (plain) and 16.26 GiB (with the draft) loaded;
    the estimate from the config alone is within 1%."""
    run = COMMITTED / "h200-realshape-20261202-vllm026"
    mem = stepcosts.memory_check(run)
    assert set(mem.vllm_gib.round(2)) == {15.45, 16.26}
    assert mem.error.abs().max() < 0.01


def test_passes_with_jit_during_them_are_not_timings():
    res = rows(rounds=2)
    res["jit_compiled"] = [[] for _ in range(len(res))]
    hit = res.index[(res.k == 3) & (res.B == 4) & (res["round"] == 1)]
    for i in hit:
        res.at[i, "jit_compiled"] = ["mhc_pre_big_fuse_tilelang"]
    c = stepcosts.step_costs(res)
    assert c[(c.k == 3) & (c.B == 4)].rounds.iloc[0] == 1
    assert c[(c.k == 3) & (c.B == 1)].rounds.iloc[0] == 2


def test_stalled_and_impossible_passes_are_not_timings():
    res = rows(rounds=5)
    k3 = (res.engine == "L4-k3") & (res.B == 4) & (res.op == "pass")
    assert stepcosts.step_costs(res).query("k == 3 and B == 4").rounds.iloc[0] == 5  # control
    stalled = res.index[k3 & (res["round"] == 2)][0]
    res.at[stalled, "t_full_s"] += 50.0  # a TileLang compile the log did not name
    negative = res.index[k3 & (res["round"] == 4)][0]
    res.at[negative, "t_prefill_s"] = res.at[negative, "t_full_s"] + 1.0
    r = stepcosts.step_costs(res).query("k == 3 and B == 4").iloc[0]
    assert r.rounds == 3
    assert r.step_ms == pytest.approx(np.divide(*batch(4, 3, 4, N)[::-1]), rel=0.02)


def test_draft_settings_are_kept_apart():
    res = rows(rounds=3)
    other = res[res.k == 3].copy()  # the same k with another draft setting, twice as slow
    other["engine"] = "L4-k3-graphs-drafteager"
    other["t_full_s"] = 0.01 + 2 * (other.t_full_s - 0.01)
    other.loc[other.op == "split", "calls"] = other.loc[other.op == "split", "calls"].map(
        lambda cs: [{**c, "ms": 2 * c["ms"]} for c in cs])
    c = stepcosts.step_costs(pd.concat([res, other], ignore_index=True))
    k3 = c[(c.k == 3) & (c.B == 4)].set_index("draft")
    assert set(k3.index) == {"", "drafteager"}
    assert k3.step_ms["drafteager"] == pytest.approx(2 * k3.step_ms[""], rel=0.03)
    d = stepcosts.draft_ms(pd.concat([res, other], ignore_index=True))
    assert set(d.draft) == {"", "drafteager"}
    v = predict.validate(pd.concat([res, other], ignore_index=True))
    assert set(v.draft) == {"", "drafteager"}


def test_report_with_a_configuration_that_has_no_plain_engine(tmp_path):
    res = rows(rounds=2)
    eager = res[(res.k == 3) & (res.op == "pass")].assign(eager=True, engine="L4-k3-eager")
    pd.concat([res, eager]).to_json(tmp_path / "results.jsonl", orient="records", lines=True)
    md = predictreport.report(tmp_path).read_text()  # raised on the all-NaN group before
    best = md.split("## Best k (measured)")[1].split("##")[0]
    assert "| False |" in best and "| True |" not in best  # eager k = 3 has no speedup


def test_report_says_a_single_round_is_not_a_result(tmp_path):
    for rounds, caveat in ((1, True), (2, False)):
        out = tmp_path / str(rounds)
        out.mkdir()
        rows(rounds=rounds).to_json(out / "results.jsonl", orient="records", lines=True)
        md = predictreport.report(out).read_text()
        assert f"Timed rounds per point: {rounds} to {rounds}." in md
        assert ("not a result" in md) == caveat


def test_an_moe_step_is_read_between_batch_sizes_by_the_experts_it_reads():
    """A plain step that costs what its batch's routed experts cost (256 experts, top-6),
    measured at n = 1, 4, 16, 64 only: the verify step of B = 16, k = 1 (32 rows) is read
    within 1%; linear in n (the control) misses it by more than 5%."""
    law = lambda n: 5.4 + 0.16 * predict.experts_touched(n)  # ms
    curve = pd.Series({n: law(n) for n in (1, 4, 16, 64)})
    for n in (2, 6, 32, 48):
        assert predict.plain_at(curve, n) == pytest.approx(law(n), rel=0.01)
    assert predict.interpolate(curve, 32) / law(32) - 1 < -0.05
    assert np.isnan(predict.plain_at(curve, 96))  # outside the measured batch sizes
    assert (predict.experts_touched(1) == pytest.approx(6)
            and predict.experts_touched(10**4) == pytest.approx(256))


def test_the_drafter_is_read_between_measured_k_and_extended_past_them():
    """Between measured k: linear; past them: the line through the two nearest (exact for a
    drafter linear in k), or one measured k scaled by k / k0, flagged `drafter_scaled`."""
    d = pd.DataFrame({"k": [1, 3, 5], "draft_ms": [t_draft(k, 1) for k in (1, 3, 5)]})
    assert predict.drafter_at(d, 4, "draft_ms") == pytest.approx(t_draft(4, 1))
    assert predict.drafter_at(d, 6, "draft_ms") == pytest.approx(t_draft(6, 1))
    assert not predict.drafter_scaled(d, 4) and predict.drafter_scaled(d, 6)
    one = d[d.k == 3]
    assert predict.drafter_at(one, 4, "draft_ms") == pytest.approx(t_draft(3, 1) * 4 / 3)
    assert predict.drafter_at(one, 3, "draft_ms") == t_draft(3, 1)
    assert np.isnan(predict.drafter_at(d.iloc[:0], 1, "draft_ms"))
    assert not predict.drafter_scaled(d.iloc[:0], 1)


def test_the_committed_drafter_graphs_run_is_exact_and_predicted_within_five_percent():
    """The H200 run of 2026-12-04 (vLLM 0.26.0 + overlay 2.1.0, drafter in its CUDA graphs),
    re-read from its files: every pass exact, k = 3 at B = 1 faster than plain with its
    interval above 1.3, every predicted point within 5%; a pass with one counter off by one
    is not exact (the control)."""
    from speclab import gpubench, store

    run = COMMITTED / "h200-realshape-20261204-vllm026-graphs"
    passes = [r for r in store.read_jsonl(run / "results.jsonl") if r["op"] == "pass"]
    assert len(passes) == 88 and all(map(gpubench.pass_exact, passes))
    assert {r["engine"] for r in passes if r["k"]} >= {"L4-k3-graphs", "L32-k1-graphs",
                                                       "L32-k3-graphs", "L32-k5-graphs"}
    res = stepcosts.load(run)
    c = stepcosts.step_costs(res)
    k3 = c[(c.layers == 32) & (c.k == 3) & (c.B == 1)].iloc[0]
    assert k3.rounds == 5 and k3.speedup_lo > 1.3
    v = predict.validate(res).dropna(subset=["error"])
    assert len(v) == 5 and v.error.abs().max() < 0.05
    bad = {**passes[-1], "counters": {**passes[-1]["counters"]}}
    bad["counters"]["accepted_per_pos"] = [bad["counters"]["accepted_per_pos"][0] - 1,
                                           *bad["counters"]["accepted_per_pos"][1:]]
    assert passes[-1]["k"] and not gpubench.pass_exact(bad)


def test_each_method_is_predicted_at_its_own_acceptance():
    """An MTP engine (gpubench `...-mtp`) is a draft setting of its own, predicted at the MTP
    profile of a {method: rates} mapping while EAGLE-3's settings take theirs; one profile
    for all still works."""
    res = rows(layers=(4,), rounds=2)
    mtp = res[res.k > 0].assign(engine=lambda d: d.engine + "-graphs-mtp")
    both = pd.concat([res, mtp], ignore_index=True)
    costs, drafts = stepcosts.step_costs(both), stepcosts.draft_ms(both)
    assert set(drafts.draft) == {"", "mtp"}
    assert [predict.method_of(d) for d in ("", "drafteager", "mtp", "mtp-drafteager")] == \
        ["eagle3", "eagle3", "mtp", "mtp"]
    p = predict.predict(costs, drafts, {"eagle3": (0.6, 0.4, 0.3), "mtp": (0.8, 0.4)},
                        ks=[2], batches=[1])
    al = dict(zip(p.draft, p.al))
    assert al[""] == pytest.approx(2.0) and al["mtp"] == pytest.approx(2.2)
    one = predict.predict(costs, drafts, (0.6, 0.4, 0.3), ks=[2], batches=[1])
    assert len(one) == 2 and one.al.tolist() == pytest.approx([2.0, 2.0])


def write_run(folder, res, gpu="NVIDIA H200", vllm="0.26.0"):
    """A gpubench run folder: its passes and the `env.json` `gpu_env.py report` writes."""
    import json

    folder.mkdir(parents=True)
    res.to_json(folder / "results.jsonl", orient="records", lines=True)
    (folder / "env.json").write_text(json.dumps({
        "date": "2026-12-05 12:18:56 UTC", "nvidia_smi": [f"{gpu}, 143771 MiB, 580.159.04"],
        "versions": {"vllm": vllm, "torch": "2.11.0"}}))
    return folder


def test_runs_pool_with_each_speedup_paired_inside_its_run(tmp_path):
    """Two runs of one GPU and vLLM, the second on a machine 20% slower throughout: pooled,
    every point has both runs' rounds and each speedup pairs with its own run's plain passes,
    so it is the single runs' speedup; `plain_by_run` shows the 20% and says the intervals do
    not overlap. The control: the same passes without their run's name lose the first run's
    rounds (one engine name, round and B) and pair across machines."""
    a = rows(rounds=3, seed=0)
    b = rows(rounds=3, seed=1)
    b["t_full_s"] = 0.01 + 1.2 * (b.t_full_s - 0.01)
    runs = [write_run(tmp_path / "a", a), write_run(tmp_path / "b", b)]
    pooled = stepcosts.load(runs)
    assert set(pooled.run) == {"a", "b"}
    c = stepcosts.step_costs(pooled).set_index(["k", "B"])
    one = stepcosts.step_costs(stepcosts.load(runs[0])).set_index(["k", "B"])
    assert (c.rounds == 6).all() and (one.rounds == 3).all()
    assert c.speedup[3, 4] == pytest.approx(one.speedup[3, 4], rel=0.02)
    assert c.speedup_hi[3, 4] - c.speedup_lo[3, 4] < 0.1 * c.speedup[3, 4]
    same = stepcosts.plain_by_run(pooled)
    assert same.spread.min() == pytest.approx(0.2, abs=0.02) and not same.overlap.any()
    alike = stepcosts.plain_by_run(stepcosts.load([runs[0], write_run(tmp_path / "c",
                                                                  rows(rounds=3, seed=2))]))
    assert same.B.nunique() == alike.B.nunique() and alike.spread.max() < 0.02
    blind = stepcosts.step_costs(pooled.drop(columns="run")).set_index(["k", "B"])
    assert (blind.rounds == 3).all()


def test_plain_steps_of_two_runs_are_compared_only_on_one_graph_size(tmp_path):
    """Two runs of one machine, the second's plain engine capturing only vLLM's default sizes
    (its `engines.jsonl`): its B = 5 step ran the 8-row graph, as 2026-12-05's 32-layer plain
    engine did beside 2026-12-07's, which captured 5. `plain_by_run` compares the batch sizes
    both ran on one graph, agreeing, and leaves B = 5 out (the control: its 8-row step is 6%
    above the 5-row one, a spread that a comparison by B alone would report); the step costs
    keep the two apart, so the 8-row step the verify steps of B = 1 at k = 4 run is not the
    mean of both."""
    import json

    a, b = rows(rounds=3, seed=0), rows(rounds=3, seed=1)
    default = cudagraphs.token_sizes(96)
    plain = b.k == 0
    pad = {B: cudagraphs.graph_rows(B, 1, default) for B in b[plain].B}
    b.loc[plain, "t_full_s"] = [0.01 + (N - 1) * t_plain(pad[B]) / 1e3 for B in b[plain].B]
    runs = []
    for name, res, sizes in (("a", a, a.capture_sizes[a.k == 0].iloc[0]), ("b", b, default)):
        runs.append(write_run(tmp_path / name, res))
        (runs[-1] / "engines.jsonl").write_text(json.dumps(
            {"engine": "L4-k0", "resolved": {"cudagraph_capture_sizes": sizes}}) + "\n")
    pooled = stepcosts.load(runs)
    same = stepcosts.plain_by_run(pooled)
    assert pad[5] == 8 and t_plain(8) / t_plain(5) - 1 > 0.05
    assert 5 not in set(same.B) and {1, 2, 4, 8, 16} <= set(same.B)
    assert (same.rows == same.B).all() and same.spread.max() < 0.02 and same.overlap.all()
    # the step costs keep B = 5's two graphs apart, and the rows curve reads each at its rows
    c = stepcosts.step_costs(pooled)
    at5 = c[(c.k == 0) & (c.B == 5)].set_index("rows")
    assert sorted(at5.index) == [5, 8] and (at5.rounds == 3).all()
    for n in (5, 8):
        assert at5.step_ms[n] == pytest.approx(t_plain(n), rel=0.02)
        assert predict.rows_curve(c, 4, False)[n] == pytest.approx(t_plain(n), rel=0.02)


def test_a_run_without_plain_pairs_with_the_plain_run_of_its_machine(tmp_path):
    """A driver started again on one machine: the speculative engines in one run, the plain
    engine in another, both env.json naming the same `machine` (boot id and GPU UUIDs).
    Pooled, each speedup pairs with the other run's plain passes (`paired_run`) and equals the
    speedup of the two as one run; the report says so. The controls: the same two runs
    naming two machines, or none (env.json before 2026-12-06), give no speedup."""
    import json

    res = rows(rounds=3)
    one = stepcosts.step_costs(stepcosts.load(write_run(tmp_path / "one", res)))
    one = one.set_index(["k", "B"])

    def pair(tag, boots):
        runs = [write_run(tmp_path / tag / name, part) for name, part in
                (("plain", res[res.k == 0]), ("spec", res[res.k > 0]))]
        for run, boot in zip(runs, boots):
            env = json.loads((run / "env.json").read_text())
            if boot:
                env["machine"] = {"boot_id": boot, "gpu_uuid": ["GPU-8c1f"], "cpus": 16}
            (run / "env.json").write_text(json.dumps(env))
        return runs, stepcosts.step_costs(stepcosts.load(runs)).set_index(["k", "B"])

    runs, same = pair("same", ["b0", "b0"])
    spec = same[same.index.get_level_values("k") > 0]
    assert (spec.paired_run == "plain").all() and spec.paired_run.notna().all()
    assert spec.speedup.to_numpy() == pytest.approx(one.speedup[spec.index].to_numpy())
    md = predictreport.report(runs, out_dir=tmp_path / "same" / "pooled").read_text()
    assert "| paired_run" in md and "of the one other run on the same machine" in md
    assert "b0/GPU-8c1f" in md
    for tag, boots in (("two", ["b0", "b1"]), ("unnamed", [None, None])):
        _, c = pair(tag, boots)
        assert c[c.index.get_level_values("k") > 0].speedup.isna().all(), tag
    plain_only = predictreport.report(write_run(tmp_path / "alone", res)).read_text()
    assert "paired_run" not in plain_only


def test_runs_of_other_gpus_or_releases_do_not_pool(tmp_path):
    """Pooling needs one GPU model and one vLLM release, each run's env.json saying so,
    distinct folder names, and an output folder of its own; one run needs none of that."""
    res = rows(rounds=2)
    h200 = write_run(tmp_path / "h200", res)
    for name, kw, msg in (("h100", {"gpu": "NVIDIA H100 80GB HBM3"}, "one gpu"),
                          ("v034", {"vllm": "0.34.0"}, "one vllm")):
        with pytest.raises(ValueError, match=msg):
            stepcosts.load([h200, write_run(tmp_path / name, res, **kw)])
    bare = tmp_path / "bare"
    bare.mkdir()
    res.to_json(bare / "results.jsonl", orient="records", lines=True)
    with pytest.raises(ValueError, match="env.json"):
        stepcosts.load([h200, bare])
    with pytest.raises(ValueError, match="distinct folder names"):
        stepcosts.load([h200, write_run(tmp_path / "x" / "h200", res)])
    assert len(stepcosts.load(bare)) == len(res)  # one run: no provenance needed
    (bare / "env.json").write_text('{"versions": {"vllm": "0.26.0"}}')  # no nvidia-smi line
    with pytest.raises(ValueError, match="one gpu: h200 NVIDIA H200, bare None"):
        stepcosts.load([h200, bare])
    twin = write_run(tmp_path / "twin", res)
    with pytest.raises(ValueError, match="--out"):
        predictreport.report([h200, twin])
    md = predictreport.report([h200, twin], out_dir=tmp_path / "pooled").read_text()
    assert md.startswith("# Speed at DeepSeek-V4-Flash's real shapes: pooled")
    assert "## Runs pooled" in md and "largest spread 0.0%" in md


def test_the_committed_h200_runs_pool_and_the_mtp_head_is_predicted():
    """The three committed 32-layer H200 runs (2026-12-04 and 05, vLLM 0.26.0) pool: their
    plain steps agree within 5% at every batch size two of them measured; DeepSeek-V4's own
    MTP head (2026-12-05, every draft accepted) gives k = 3 over 2x at B = 1, and the cost
    model predicts its four points within 5%; at 43 layers both methods are predicted, each
    at its published acceptance."""
    runs = [COMMITTED / n
            for n in ("h200-realshape-20261204-vllm026-graphs",
                      "h200-realshape-20261205-vllm026-deeprest",
                      "h200-realshape-20261205-vllm026-next")]
    res = stepcosts.load(runs)
    assert stepcosts.plain_by_run(res).spread.max() < 0.05
    c = stepcosts.step_costs(res).set_index(["layers", "draft", "k", "B"])
    assert c.speedup_lo[32, "mtp", 3, 1] > 2 and c.al[32, "mtp", 3, 1] == pytest.approx(4, abs=0.01)
    v = predict.validate(res)
    mtp = v[v.draft == "mtp"]
    assert len(mtp) == 4 and mtp.error.abs().max() < 0.05
    ex = layerfit.extrapolate(stepcosts.step_costs(res), stepcosts.draft_ms(res),
                             {"eagle3": predict.PUBLISHED_EAGLE31, "mtp": predict.PUBLISHED_MTP})
    p = ex["prediction"].dropna(subset=["pred_speedup"])
    assert set(p.draft) == {"", "mtp"} and ex["layers_measured"] == [24, 32]


def test_the_committed_deepfinal_run_pools_on_graph_sizes():
    """2026-12-07's H200 run (plain at 32 layers, five rounds, its engine capturing 5, 20 and
    80 rows; EAGLE-3 k = 4 one timed round before the deadline): beside 2026-12-05's, whose
    plain engine ran B = 5 on the 8-row graph, the pooled step costs keep the two B = 5 steps
    apart (the 8-row one over 20% above) and the runs' plain steps on one graph agree within
    6%; k = 4 at B = 1 gains its round (four, was three)."""
    names = ["h200-realshape-20261205-vllm026-deeprest", "h200-realshape-20261205-vllm026-next"]
    pooled = stepcosts.load([COMMITTED / n for n in [*names,
                                                     "h200-realshape-20261207-vllm026-deepfinal"]])
    res = pooled[pooled.run.isin(names)]
    c = stepcosts.step_costs(pooled).query("layers == 32 and draft == ''")
    at5 = c[(c.k == 0) & (c.B == 5)].set_index("rows").step_ms
    assert sorted(at5.index) == [5, 8] and at5[8] / at5[5] > 1.2
    assert stepcosts.plain_by_run(pooled).query("layers == 32").spread.max() < 0.06
    before = stepcosts.step_costs(res).query("layers == 32 and draft == '' and k == 4 and B == 1")
    after = c.query("k == 4 and B == 1")
    assert before.rounds.item() + 1 == after.rounds.item() == 4


def with_sampling(res, extra_ms, plain_ms=0.04):
    """`res` with speculative sampling `extra_ms` a step above plain's `plain_ms`: every
    speculative pass that much longer a verify round, its split passes timing sampling (the
    drafter inside it, plus plain's and the extra), and plain split passes timing plain's."""
    res = res.copy()
    spec = (res.op == "pass") & (res.k > 0)
    for i in res.index[spec]:
        rounds = res.at[i, "counters"]["num_drafts"] / res.at[i, "B"]
        res.at[i, "t_full_s"] += rounds * extra_ms / 1e3
    split = (res.op == "split") & (res.k > 0)
    res.loc[split, "calls"] = res.loc[split, "calls"].map(lambda cs: [
        *cs, *({**c, "op": "sample", "ms": c["ms"] + plain_ms + extra_ms} for c in cs)])
    plain = [{"engine": "L4-k0", "op": "split", "layers": 4, "k": 0, "eager": False,
              "round": 0, "B": B, "counters": {},
              "calls": [{"op": "sample", "tokens": B, "reqs": B, "ms": plain_ms}] * 20}
             for B in (1, 4, 16)]
    return pd.concat([res, pd.DataFrame(plain)], ignore_index=True)


def test_speculative_sampling_is_priced_from_the_split_passes():
    """Sampling 0.3 ms a step above plain's: `draft_ms` measures it from the split passes
    (sampling less the drafter less plain's sampling), and the model that prices it predicts
    every point within 3%; without it (`error_no_sample`, the control) the small steps miss
    by more than 5%."""
    res = with_sampling(rows(), 0.3)
    d = stepcosts.draft_ms(res)
    assert np.allclose(d.sample_extra_ms, 0.3)
    v = predict.validate(res)
    assert len(v) == 15 and v.error.abs().max() < 0.03
    assert (v[v.B == 1].error_no_sample > 0.05).all()
    # the sampling term is read between measured k and held at the nearest outside them
    one = d[(d.k == 2) & (d.B == 1)].assign(sample_extra_ms=0.2)
    assert predict.sample_extra_at(one, 5) == pytest.approx(0.2)
    assert predict.sample_extra_at(one.assign(sample_extra_ms=np.nan), 2) == 0


def test_the_error_budget_names_what_the_model_leaves_out():
    """A verify forward 0.3 ms above the plain step at its rows and 0.1 ms of sampling beside
    the drafter, in the split pass of B = 4, k = 2: `error_budget` finds both, and its parts
    add up to the step the model misses; without them (the control) both read 0."""
    def budget(extra_execute, extra_sample):
        res = rows()
        i = res.index[(res.op == "split") & (res.k == 2) & (res.B == 4)][0]
        d = t_draft(2, 4)
        res.at[i, "calls"] = [
            {"op": "execute", "tokens": 12, "reqs": 4, "ms": t_plain(18) + extra_execute},
            {"op": "sample", "tokens": 12, "reqs": 4, "ms": d + extra_sample},
            {"op": "propose", "tokens": 12, "reqs": 4, "ms": d}] * 20
        return predict.error_budget(predict.validate(res),
                                    stepcosts.step_anatomy(res)).set_index(["k", "B"])

    b = budget(0.3, 0.1)
    assert list(b.index) == [(2, 4)]  # the only split pass that timed the target's forward
    b = b.iloc[0]
    assert b.verify_extra_ms == pytest.approx(0.3, abs=0.03)
    assert b.sampling_ms == pytest.approx(0.1) and b.drafter_ms == pytest.approx(0)
    assert b[list(predict.BUDGET)].sum() == pytest.approx(b.err_ms)
    control = budget(0, 0).iloc[0]
    assert abs(control.verify_extra_ms) < 0.03 and control.sampling_ms == pytest.approx(0)


def pooled_runs(md: str) -> list[str]:
    """The run column of a predict.md's "Runs pooled" table."""
    table = md[md.index("## Runs pooled"):].split("\n\n")[2].splitlines()[2:]
    return [row.split(" | ")[0] for row in table]


def test_the_reference_runs_are_the_pooled_answers_runs():
    """05_speed's default runs (`REFERENCE_RUNS`) are the runs the committed pooled report,
    the README's answer, lists under "Runs pooled" (2026-12-07's run joined that report but
    not the default until 2026-12-08: the main job's 43-layer numbers were four runs')."""
    from speclab import predictreport

    md = (COMMITTED / "h200-realshape-vllm026-pooled" / "predict.md").read_text()
    assert pooled_runs(md) == list(predictreport.REFERENCE_RUNS)
    assert [r.name for r in predictreport.reference_runs()] == list(predictreport.REFERENCE_RUNS)


def test_predict_without_a_run_pools_the_reference_runs(tmp_path, capsys):
    """`speclab predict --out DIR` with no run folder pools `REFERENCE_RUNS`; without --out
    it stops, naming --out, and writes nothing."""
    from speclab import cli, predictreport

    assert cli.main(["predict", "--gpus", "1"]) == 1
    assert "--out" in capsys.readouterr().err
    assert cli.main(["predict", "--out", str(tmp_path / "ref"), "--gpus", "1"]) == 0
    md = (tmp_path / "ref" / "predict.md").read_text()
    assert pooled_runs(md) == list(predictreport.REFERENCE_RUNS)


def test_the_h200_runs_largest_miss_is_host_time():
    """On the pooled H200 runs the point the model misses most among those with a full split
    pass (B = 4, k = 2: 8.4%) loses most of it to the GPU waiting for the host (`idle_ms`);
    what speculative sampling adds, 0.05-0.15 ms a step, is priced at every point, so the
    budget's sampling is plain's own (about 0.04 ms), and pricing it lowers every error."""
    from speclab import predictreport

    res = stepcosts.load(predictreport.reference_runs())
    v = predict.validate(res)
    b = predict.error_budget(v, stepcosts.step_anatomy(res)).dropna(subset=["err_ms"])
    worst = b.loc[b.error.idxmax()]
    assert (worst.B, worst.k) == (4, 2) and worst.idle_ms > 0.5 * worst.err_ms
    deep = v[v.layers == 32]
    assert deep.sample_extra_ms.between(0.05, 0.15).all() and len(deep) == 16
    assert (deep.error < deep.error_no_sample).all()
    assert b.sampling_ms.between(0.03, 0.05).all()
    assert np.allclose(b[list(predict.BUDGET)].sum(axis=1), b.err_ms)


def test_predict_cli_pools_runs_into_their_own_folder(tmp_path, capsys):
    """`speclab predict A B --out DIR` writes the pooled report to DIR; without --out it
    stops with the reason (exit 1), and a GPU mismatch is refused the same way."""
    from speclab import cli

    res = rows(rounds=2)
    a, b = write_run(tmp_path / "a", res), write_run(tmp_path / "b", res)
    assert cli.main(["predict", str(a), str(b)]) == 1
    assert "--out" in capsys.readouterr().err
    h100 = write_run(tmp_path / "h100", res, gpu="NVIDIA H100 80GB HBM3")
    assert cli.main(["predict", str(a), str(h100), "--out", str(tmp_path / "p")]) == 1
    assert "one gpu" in capsys.readouterr().err and not (tmp_path / "p").exists()
    assert cli.main(["predict", str(a), str(b), "--out", str(tmp_path / "p"), "--gpus", "1"]) == 0
    assert "## Runs pooled" in (tmp_path / "p" / "predict.md").read_text()
    assert not (a / "predict.md").exists()
    for bad in (["--layers", "0"], ["--gpus", "eight"]):  # refused as read, nothing written
        with pytest.raises(SystemExit):
            cli.main(["predict", str(a), "--out", str(tmp_path / "q"), *bad])
        assert "at least 1" in capsys.readouterr().err and not (tmp_path / "q").exists()


def test_the_extrapolation_spread_follows_the_plain_steps_intervals():
    """The 43-layer prediction redone over draws of the plain steps: the central prediction
    lies inside its 95% range, each setting's best k shares sum to 1, a faster drafter wins
    every draw at equal acceptance; widening the plain steps' intervals threefold (the control)
    widens the range more than twofold."""
    res = rows(layers=(4, 8), rounds=3)
    slow = res[res.k > 0].assign(engine=lambda d: d.engine + "-graphs-mtp")
    slow.loc[slow.op == "split", "calls"] = slow.loc[slow.op == "split", "calls"].map(
        lambda cs: [{**c, "ms": 3 * c["ms"]} for c in cs])
    both = pd.concat([res, slow], ignore_index=True)
    costs, drafts = stepcosts.step_costs(both), stepcosts.draft_ms(both)
    rates = {"eagle3": RATES, "mtp": RATES}
    per_k, per_method = layerfit.extrapolation_spread(costs, drafts, rates, draws=60)
    central = layerfit.extrapolate(costs, drafts, rates)["prediction"].merge(per_k)
    assert len(central) and ((central.pred_lo <= central.pred_speedup)
                             & (central.pred_speedup <= central.pred_hi)).all()
    assert per_k.groupby(["draft", "B"]).p_best.sum().tolist() == pytest.approx(
        [1.0] * per_k.groupby(["draft", "B"]).ngroups)
    fast = per_method.set_index(["B", "draft"]).p_fastest
    assert (fast.xs("", level="draft") == 1).all() and (fast.xs("mtp", level="draft") == 0).all()
    wide = costs.copy()
    plain = wide.k == 0
    half = (wide.step_hi - wide.step_lo) / 2
    wide.loc[plain, "step_lo"] -= 2 * half[plain]
    wide.loc[plain, "step_hi"] += 2 * half[plain]
    wide_k, _ = layerfit.extrapolation_spread(wide, drafts, rates, draws=60)
    both = per_k.merge(wide_k, on=["draft", "B", "k"], suffixes=("", "_wide"))
    assert len(both) >= len(per_k) // 2  # wider intervals leave fewer batch sizes resolved
    assert ((both.pred_hi_wide - both.pred_lo_wide) > 2 * (both.pred_hi - both.pred_lo)).all()


def test_the_h100_served_points_match_offline_and_its_b1_miss_is_host_time():
    """The committed H100 run at 18 layers (`timing-h100-serve`): behind `vllm serve`, k = 3
    gives the offline acceptance and a speedup inside the offline interval at B = 1 and 16;
    the model misses by 4-6% at B = 16 and by 19-30% at B = 1, where most of the miss is the
    GPU waiting for the host (`idle_ms`), which the 32-layer H200 run (the control) lacks."""
    res = stepcosts.load(COMMITTED / "h100-realshape-20261206-vllm026-serve18")
    v = predict.validate(res).set_index(["k", "B"])
    served = stepcosts.serve_costs(res).query("k == 3").set_index("B")
    for B in (1, 16):
        assert served.loc[B, "al"] == pytest.approx(v.loc[(3, B), "al"], abs=1e-9)
        assert v.loc[(3, B), "speedup_lo"] < served.loc[B, "speedup"] < v.loc[(3, B), "speedup_hi"]
    assert v.xs(16, level="B").error.between(0.03, 0.07).all()
    b = predict.error_budget(predict.validate(res), stepcosts.step_anatomy(res))
    b1 = b[b.B == 1]
    assert len(b1) == 2 and (b1.error > 0.15).all() and (b1.idle_ms > 0.6 * b1.err_ms).all()
    h200 = stepcosts.step_anatomy(
        stepcosts.load(COMMITTED / "h200-realshape-20261204-vllm026-graphs"))
    assert (h200.query("layers == 32 and B == 1 and k > 0").idle_ms.abs() < 0.25).all()


def test_a_second_h100_shows_no_host_wait_at_b1_so_the_wait_was_the_machines():
    """The committed `timing-h100-host` run (another H100, same bundle and shapes): at B = 1
    the GPU waits under 0.25 ms a step, at 12 layers too (a shorter step did not make it wait
    longer), the split passes place no gap before either call, and the model's B = 1 error
    at 18 layers, k = 3, is within 5% and its speedup's interval excludes 1×; the first
    H100's run of the same point (the control) missed by more than 15%."""
    res = stepcosts.load(COMMITTED / "h100-realshape-20261206-vllm026-host")
    a = stepcosts.step_anatomy(res)
    b1 = a[a.B == 1]
    assert set(b1.layers) == {12, 18} and (b1.idle_ms.abs() < 0.25).all()
    assert (a.gap_execute_ms < 0.01).all() and (a.gap_sample_ms < 0.01).all()
    v = predict.validate(res).set_index(["layers", "k", "B"])
    first = predict.validate(stepcosts.load(COMMITTED / "h100-realshape-20261206-vllm026-serve18"))
    assert abs(v.loc[(18, 3, 1), "error"]) < 0.05
    assert first.set_index(["k", "B"]).loc[(3, 1), "error"] > 0.15
    assert v.loc[(18, 3, 1), "speedup_lo"] > 1


def test_the_fourth_h100_serves_at_the_model_while_its_offline_rounds_wait(tmp_path):
    """The committed `timing-h100-serve` run of a fourth H100 (offline and served on one
    machine): behind `vllm serve` k = 3 lands on the cost model of its own offline passes
    (|error| < 3% at B = 1 and 16, each prediction inside the served interval and paired with
    its own B), while the offline B = 1 point misses by more than 10%: its rounds spread from
    the served step to 30% above it. The first H100's served run (the control) misses by
    more than 15% at B = 1; a run that only served gets no model column and no such table."""
    res = stepcosts.load(COMMITTED / "h100-realshape-20261206-vllm026-serveoffline")
    val = predict.validate(res)
    m = predict.served_vs_model(stepcosts.serve_costs(res), val).set_index("B")
    v = val.set_index(["k", "B"])
    for B in (1, 16):
        assert m.loc[B, "pred_speedup"] == v.loc[(3, B), "pred_speedup"]
        assert abs(m.loc[B, "error"]) < 0.03 and m.loc[B, "pred_in_ci"]
    assert m.loc[1, "pred_speedup"] != m.loc[16, "pred_speedup"]
    assert v.loc[(3, 1), "error"] > 0.10
    steps = stepcosts.passes(res, 128).query("k == 3 and B == 1 and round >= 1").step_ms
    assert steps.max() > 1.25 * m.loc[1, "step_ms"] and steps.min() < 1.01 * m.loc[1, "step_ms"]
    first = stepcosts.load(COMMITTED / "h100-realshape-20261206-vllm026-serve18")
    f = predict.served_vs_model(stepcosts.serve_costs(first),
                                predict.validate(first)).set_index("B")
    assert f.loc[1, "error"] > 0.15 and not f.loc[1, "pred_in_ci"]
    src = COMMITTED / "h100-realshape-20261206-vllm026-serverepeat"
    only = stepcosts.serve_costs(stepcosts.load(src))
    assert predict.served_vs_model(only, pd.DataFrame()).pred_speedup.isna().all()
    md = predictreport.report(src, out_dir=tmp_path / "report").read_text()
    assert "Against the cost model" not in md


def test_the_serial_bound_prices_the_drafters_host_time():
    """`pred_serial_speedup` adds the drafter's host time beyond its GPU time to the step: a
    host time under the GPU time changes nothing, a doubled one lowers the bound, none gives
    NaN. On the committed H200 set at 43 layers it moves EAGLE-3's best k at B = 1 from 3
    (1.50x) to 2 (host 2.1 ms a step against 3.7 ms at k = 3)."""
    res = stepcosts.load(COMMITTED / "h100-realshape-20261206-vllm026-host")
    costs, drafts = stepcosts.step_costs(res), stepcosts.draft_ms(res)
    rates = predict.PUBLISHED_EAGLE31
    p = predict.predict(costs, drafts, rates)
    timed = p.dropna(subset=["draft_host_ms", "pred_speedup"])
    assert len(timed) and (timed.pred_serial_speedup < timed.pred_speedup).all()
    quick = predict.predict(costs, drafts.assign(draft_host_ms=drafts.draft_ms / 2), rates)
    assert np.allclose(quick.pred_serial_speedup, quick.pred_speedup, equal_nan=True)
    slow = predict.predict(costs, drafts.assign(draft_host_ms=2 * drafts.draft_host_ms), rates)
    key = timed.index
    assert (slow.loc[key, "pred_serial_speedup"] < timed.pred_serial_speedup).all()
    none = predict.predict(costs, drafts.assign(draft_host_ms=np.nan), rates)
    assert none.pred_serial_speedup.isna().all() and none.pred_speedup.notna().any()
    pooled = [COMMITTED / n for n in ("h200-realshape-20261204-vllm026-graphs",
                                 "h200-realshape-20261205-vllm026-deeprest",
                                 "h200-realshape-20261205-vllm026-next",
                                 "h200-realshape-20261206-vllm026-fit24")]
    h200 = stepcosts.load(pooled)
    ex = layerfit.extrapolate(stepcosts.step_costs(h200), stepcosts.draft_ms(h200), rates, 43)
    b1 = ex["prediction"].query("draft == '' and B == 1").set_index("k")
    assert b1.pred_speedup.idxmax() == 3 and b1.pred_serial_speedup.idxmax() == 2


def test_the_report_places_the_wait_where_the_runs_timed_the_calls_start(tmp_path):
    """A run whose split passes recorded the calls' GPU start times (`t_ms`) gets the step
    anatomy's `gap_` columns, with the wait before the target's forward; the committed run
    without them (the control) keeps its table as it was."""
    import json
    import shutil

    src = COMMITTED / "h100-realshape-20261206-vllm026-serve18"
    run = tmp_path / src.name
    run.mkdir()
    for name in ("results.jsonl", "engines.jsonl", "env.json"):
        shutil.copy(src / name, run / name)
    assert "gap_execute_ms" not in predictreport.report(run).read_text()
    rows = [json.loads(x) for x in (run / "results.jsonl").read_text().splitlines()]
    for r in rows:  # a timeline: each call starts 0.5 ms after the previous one ended
        t = 0.0
        for c in r.get("calls") or []:
            if c.get("op") in ("execute", "sample"):
                c["t_ms"], t = t, t + c["ms"] + 0.5
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = predictreport.report(run).read_text()
    assert "gap_execute_ms | gap_sample_ms" in md and "where that wait falls" in md
    a = stepcosts.step_anatomy(stepcosts.load(run))
    assert a.gap_execute_ms.round(6).eq(0.5).all() and a.gap_sample_ms.round(6).eq(0.5).all()


def test_the_fifth_h100_runs_offline_at_the_model_beside_a_quiet_host():
    """The committed `timing-h100-serve-k3` run (a fifth H100, the first with the host
    sampled): every offline k = 3 round at B = 1 within 2% of the median step and the model
    within 2% at B = 1 and 16; the host beside every timed pass used under two cores, the
    engine core the busiest, and had nothing stolen. The fourth machine's offline B = 1 rounds
    (the control) spread over 25%; it ran before the sampler and has no host samples."""
    run = COMMITTED / "h100-realshape-20261206-vllm026-hostk3"
    res = stepcosts.load(run)
    val = predict.validate(res).set_index(["k", "B"])
    assert abs(val.loc[(3, 1), "error"]) < 0.02 and abs(val.loc[(3, 16), "error"]) < 0.02
    steps = stepcosts.passes(res).query("k == 3 and B == 1").step_ms
    assert len(steps) == 5 and steps.max() < 1.02 * steps.median()
    timed = stepcosts.passes(res)
    per = hostwatch.per_pass(stepcosts.host_samples(run), timed.to_dict("records"))
    assert len(per) == len(timed)
    assert all(p["busy"] < 2 and p["steal"] < 0.05 and p["top"].startswith("VLLM::EngineCor")
               for p in per)
    fourth = stepcosts.passes(
        stepcosts.load(COMMITTED / "h100-realshape-20261206-vllm026-serveoffline"))
    control = fourth.query("k == 3 and B == 1").step_ms
    assert control.max() > 1.25 * control.min()
    assert not stepcosts.host_samples(COMMITTED / "h100-realshape-20261206-vllm026-serveoffline")


H100_RUNS = ("h100-realshape-20261206-vllm026-host", "h100-realshape-20261206-vllm026-hostk3",
             "h100-realshape-20261207-vllm026-serve")
STALLED = ("h100-realshape-20261206-vllm026-serve18",
           "h100-realshape-20261206-vllm026-serveoffline")


def test_h100_machines_differ_in_the_speculative_step_only():
    """Five H100 machines at 18 real-shape layers (README "The host"): the plain step agrees
    within 2% at B = 1 and 5% at B = 16 across all five, the k = 3 step at B = 1 within 3%
    across the three that did not stall, and the same spread over all five, the two whose
    host stalled the drafter included, is over 15% (the control: the measure flags them)."""
    res = stepcosts.load([COMMITTED / r for r in (*H100_RUNS, *STALLED)])
    plain = stepcosts.plain_by_run(res, 512).query("layers == 18").groupby("B")
    assert plain.run.nunique()[1] == 5 and plain.run.nunique()[16] == 5
    assert plain.spread.max()[1] < 0.02 and plain.spread.max()[16] < 0.05
    k3 = stepcosts.passes(res, 512).query("layers == 18 and k == 3 and B == 1")
    per_run = k3.groupby("run").step_ms.mean()
    calm = per_run[list(H100_RUNS)]
    assert calm.max() / calm.min() - 1 < 0.03
    assert per_run.max() / per_run.min() - 1 > 0.15
    assert set(per_run.nlargest(2).index) == set(STALLED)


def test_the_sixth_h100_runs_k1_to_3_inside_the_models_bracket():
    """The committed `timing-h100-serve` run on a sixth H100 (every offline point of k = 1, 2,
    3 at B = 1 and 16): every measured speedup lies between the serial-drafter bound and the
    model, the model within 6%, k = 2 the measured best at B = 1; pooled with the two other
    machines that did not stall, the model stays within 6% at 18 layers. The control: the
    first machine, whose host stalled the drafter, falls outside the bracket and the 6%."""
    val = predict.validate(stepcosts.load(COMMITTED / H100_RUNS[-1]))
    assert len(val) == 6 and val.bracketed.all()
    assert val.error.between(0, 0.06).all()
    first = predict.validate(stepcosts.load(COMMITTED / STALLED[0]))
    assert not first.bracketed.all() and not first.error.between(0, 0.06).all()
    b1 = val[val.B == 1].set_index("k").speedup
    assert b1.idxmax() == 2
    pooled = predict.validate(stepcosts.load([COMMITTED / r for r in H100_RUNS]))
    assert pooled.query("layers == 18").error.abs().max() < 0.06


def test_the_spread_takes_the_acceptance_draws_it_is_given():
    """`extrapolation_spread` with `rate_draws`: draws that all equal the central rates (the
    control) give the timing-only spread exactly; resamples of a point's requests widen the
    best k's range at B = 1, and a draw without drafts (NaN) keeps the central rates."""
    from speclab import analysis

    res = rows(layers=(4, 8), rounds=3)
    costs, drafts = stepcosts.step_costs(res), stepcosts.draft_ms(res)
    prof = analysis.run_profile(COMMITTED / "tiny-cpu", "eagle3", n_boot=60)
    rates = {"eagle3": list(prof.rates)}

    def best_range(draws=None):
        pm = layerfit.extrapolation_spread(costs, drafts, rates, draws=60,
                                           rate_draws=draws)[1].set_index("B")
        return pm.best_hi[1] - pm.best_lo[1], pm

    timing, pm0 = best_range()
    same, pm1 = best_range({"eagle3": np.tile(prof.rates, (60, 1))})
    pd.testing.assert_frame_equal(pm0, pm1)
    both, _ = best_range({"eagle3": prof.draws})
    assert both > 1.5 * timing
    nan = prof.draws.copy()
    nan[:] = np.nan
    assert best_range({"eagle3": nan})[0] == pytest.approx(timing)
    with pytest.raises(ValueError, match="at least 60 rows"):
        best_range({"eagle3": prof.draws[:10]})


def test_a_sweep_runs_point_gives_the_acceptance_to_predict_at():
    """`analysis.run_profile` reads the committed tiny-cpu run's EAGLE-3 point with the largest
    k (k = 4), its rates the accepted counts per position over its drafts, read here from its
    records; a named point gives its own. Ambiguity, another method, a plain or unknown point
    and a folder without point results are refused, each naming what there is."""
    from speclab import analysis, store

    run = COMMITTED / "tiny-cpu"
    prof = analysis.run_profile(run, "eagle3")
    recs = store.requests(run, prof.point_id)
    counts = np.array(recs.accepted_per_pos.tolist()).sum(axis=0)
    assert prof.k == 4 and prof.num_drafts == recs.drafts.sum() and prof.n_requests == len(recs)
    assert prof.rates == pytest.approx(tuple(counts / recs.drafts.sum()))
    assert all(lo < r < hi for lo, r, hi in zip(prof.rates_lo, prof.rates, prof.rates_hi))
    assert prof.draws.shape == (1000, 4)  # the resamples the intervals come from
    assert np.percentile(prof.draws, [2.5, 97.5], axis=0) == pytest.approx(
        np.array([prof.rates_lo, prof.rates_hi]))
    assert prof.target == "fixture:tiny-llama" and f"`{prof.point_id}`" in prof.describe()
    k1 = analysis.run_profile(run, "eagle3", "k1_kv-auto_dkv-auto_tp1_raw")
    assert k1.k == 1 and k1.rates[0] != pytest.approx(prof.rates[0])
    points, records = store.load_results(run)
    acc = analysis.acceptance(records, points=points)
    with pytest.raises(ValueError, match="3 eagle3 points at k = 3 .*k3_kv-auto_dkv-auto_tp1_chat"):
        analysis.measured_profile(acc[acc.k < 4], "eagle3")
    for method, point, said in (("mtp", None, r"no mtp point .*\['eagle3'\]"),
                                ("mtp", prof.point_id, "ran method eagle3, not mtp"),
                                ("eagle3", "k0_kv-auto_tp1_raw", "no speculative point"),
                                ("eagle3", "nope", "k4_kv-auto_dkv-auto_tp1_raw")):
        with pytest.raises(ValueError, match=said):
            analysis.run_profile(run, method, point)
    with pytest.raises(ValueError, match="not a folder of `speclab run`"):
        analysis.run_profile(COMMITTED / "h200-realshape-20261204-vllm026-graphs", "eagle3")


def test_predict_prices_the_draft_at_a_runs_measured_acceptance(tmp_path, capsys):
    """`speclab predict RUN --acceptance SWEEP_RUN` extrapolates at the acceptance the sweep
    run's point measured and says where it came from, with the best k at its intervals' ends;
    the published default (the control) predicts other speedups. A folder that is not a run,
    or an unknown point, stops before anything is written."""
    from speclab import analysis, cli

    run = write_run(tmp_path / "gpu", rows(layers=(4, 8), rounds=3))
    sweep = COMMITTED / "tiny-cpu"

    def predicted(out: str, *args) -> tuple[str, pd.Series]:
        """predict.md and its 43-layer predicted speedups by (B, k)."""
        assert cli.main(["predict", str(run), "--out", str(tmp_path / out), "--gpus", "1",
                         *args]) == 0
        md = (tmp_path / out / "predict.md").read_text()
        table = next(t for t in md[md.index("## 43 layers"):].split("\n\n")
                     if t.startswith("draft | B | k | al"))
        cells = [r.split(" | ") for r in table.splitlines()[2:]]
        return md, pd.Series({(c[1], c[2]): c[11] for c in cells})

    md, mine = predicted("measured", "--acceptance", str(sweep))
    prof = analysis.run_profile(sweep, "eagle3")
    assert f"## 43 layers at acceptance [{', '.join(f'{x:.3g}' for x in prof.rates)}]" in md
    assert prof.describe() in md and "one resample of the measuring run's requests" in md
    md0, published = predicted("published")
    assert "## 43 layers at acceptance [0.617, 0.433, 0.294]" in md0
    assert "measured by run" not in md0 and (mine != published).all()
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    for bad, said in ((tmp_path / "empty", "not a folder of `speclab run`"),
                      (f"{sweep}:nope", "k4_kv-auto_dkv-auto_tp1_raw")):
        assert cli.main(["predict", str(run), "--out", str(tmp_path / "q"), "--acceptance",
                         str(bad)]) == 1
        assert said in capsys.readouterr().err and not (tmp_path / "q").exists()
