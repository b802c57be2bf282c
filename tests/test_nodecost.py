"""The TP + EP bracket: its parts against exact values, the one-GPU limit against the cost
model it extends, and the committed H200 run carried to a TP 8 + EP node."""

import itertools
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from speclab import layerfit, nodecost, predict, predictreport, stepcosts

RUN = Path(__file__).resolve().parents[1] / "data/runs/h200-realshape-20261204-vllm026-graphs"


def exact_max_rank_experts(gpus: int, experts: int = 256, top_k: int = 6) -> float:
    """E[max over ranks of the experts one token's top_k distinct picks put on a rank]: the
    multivariate hypergeometric over every split of top_k over the ranks."""
    per = experts // gpus
    total = 0.0
    for split in itertools.product(range(top_k + 1), repeat=gpus):
        if sum(split) == top_k:
            total += max(split) * math.prod(math.comb(per, c) for c in split)
    return total / math.comb(experts, top_k)


def test_slowest_rank_experts_against_exact_values():
    """One token on 4 ranks: the Monte Carlo within 2% of the exact expectation; on one rank
    (drawn, not the closed form) within 1% of `predict.experts_touched`; the slowest of 8 ranks
    reads more than the mean rank and no more than a rank holds."""
    assert nodecost.max_rank_experts(1, 4) == pytest.approx(exact_max_rank_experts(4), rel=0.02)
    for n in (1, 4, 16):
        drawn = nodecost._max_rank_experts(n, 1, 256, 6, 2000, 0)
        assert drawn == pytest.approx(float(predict.experts_touched(n)), rel=0.01)
        assert nodecost.max_rank_experts(n, 1) == float(predict.experts_touched(n))
    prev = 0.0
    for n in (1, 4, 16, 64):
        m = nodecost.max_rank_experts(n, 8)
        assert float(predict.experts_touched(n)) / 8 < m <= 32 and m > prev
        prev = m
    with pytest.raises(ValueError, match="do not divide"):
        nodecost.max_rank_experts(4, 3)


def test_allreduce_curves():
    """Each curve passes through its table's points (lo's sizes read as bf16 elements; a point
    below a smaller message's is levelled up to it), never falls as the message grows, and lo
    stays below hi; one GPU has no collective, a count without a curve is refused."""
    for gpus, corner in itertools.product((2, 4, 8), ("lo", "hi")):
        per = 2 if corner == "lo" else 1
        levelled = np.maximum.accumulate(nodecost.AR_US[gpus][corner])
        for size, us in zip(nodecost.AR_SIZES, levelled):
            assert nodecost.allreduce_us(per * size, corner, gpus) == pytest.approx(us)
    assert nodecost.allreduce_us(4096, "hi") == pytest.approx(10.1)  # 9.3 in the table
    sizes = [2 ** p for p in range(8, 24)]
    for gpus, corner in itertools.product((2, 4, 8), ("lo", "hi")):
        t = [nodecost.allreduce_us(b, corner, gpus) for b in sizes]
        assert all(b >= a for a, b in itertools.pairwise(t))
    assert all(nodecost.allreduce_us(b, "lo", g) < nodecost.allreduce_us(b, "hi", g)
               for b in sizes for g in (2, 4, 8))
    assert nodecost.allreduce_us(8192, "hi", 1) == 0.0
    with pytest.raises(ValueError, match="no published all-reduce curve for 16 GPUs"):
        nodecost.allreduce_us(8192, "hi", 16)


def test_expert_fit_recovers_the_per_expert_cost_and_refuses_what_it_cannot_split():
    n = np.array([1, 4, 16, 64])
    slopes = 0.13 + 0.0052 * predict.experts_touched(n)
    fit = pd.DataFrame({"n": n, "b_ms_per_layer": slopes, "resolved": [True, False, True, True]})
    got = nodecost.expert_fit(fit)
    assert got["beta_ms"] == pytest.approx(0.0052) and got["alpha_ms"] == pytest.approx(0.13)
    assert got["batch_sizes"] == [1, 16, 64]
    with pytest.raises(ValueError, match="two or more"):
        nodecost.expert_fit(fit.assign(resolved=[True, False, False, False]))
    flat = fit.assign(b_ms_per_layer=0.3)  # a step that does not grow with the experts read
    with pytest.raises(ValueError, match="does not grow"):
        nodecost.expert_fit(flat)


def _extrapolated() -> dict:
    res = stepcosts.load(RUN)
    return layerfit.extrapolate(stepcosts.step_costs(res), stepcosts.draft_ms(res),
                               predict.PUBLISHED_EAGLE31)


def test_one_gpu_is_the_cost_model():
    """At G = 1 (no collectives, nothing to divide) every corner gives `layerfit.extrapolate`'s
    prediction exactly; the control: at G = 2 with nothing divided and free collectives, the
    busiest GPU reads fewer experts than one GPU does, and every verify step is cheaper."""
    ex = _extrapolated()
    b = nodecost.bracket(ex, predict.PUBLISHED_EAGLE31, gpus=1)
    one = ex["prediction"].merge(b, on=["draft", "B", "k"], suffixes=("", "_node"))
    assert len(one) == len(nodecost.TP_CORNERS) * len(nodecost.AR_CORNERS) * len(ex["prediction"])
    np.testing.assert_allclose(one.pred_speedup_node, one.pred_speedup, rtol=1e-12)
    b2 = nodecost.bracket(ex, predict.PUBLISHED_EAGLE31, gpus=2)
    two = ex["prediction"].merge(b2[(b2.tp == "latency") & (b2.allreduce == "none")],
                                 on=["draft", "B", "k"], suffixes=("", "_node")).dropna(
                                     subset=["verify_ms"])
    assert len(two) > 5 and (two.verify_ms_node < two.verify_ms).all()


def test_what_tp_divides_scales_with_what_is_read():
    """The weights TP splits take time in proportion to their bytes (`memory.weight_bytes`,
    checked against vLLM's loading lines elsewhere): one layer's worth a layer plus the
    head, the draft's forward k times, half the time at twice the rate."""
    beta = 0.0052
    t4, t8 = nodecost.divided_ms(beta, 4)[0], nodecost.divided_ms(beta, 8)[0]
    head = 129280 * 4096 * 2 / (nodecost.expert_bytes() / beta)
    assert t4 == pytest.approx(head + (t8 - t4)) and t8 > t4 > head
    d1, d3 = nodecost.divided_ms(beta, 8, 1)[1], nodecost.divided_ms(beta, 8, 3)[1]
    assert d3 == pytest.approx(3 * d1) and nodecost.divided_ms(beta, 8, 0)[1] == 0
    assert nodecost.divided_ms(2 * beta, 8, 3) == pytest.approx((2 * t8, 2 * d3))


def test_the_h200_run_on_a_tp8_ep_node(tmp_path):
    """The committed 32-layer run carried to 43 layers on TP 8 + EP: the report says it is not
    measured, beta reads experts below the H200's bandwidth, the `weights` band lies inside
    the nine corners; with --gpus 1 the section is absent."""
    md = predictreport.report(RUN, out_dir=tmp_path).read_text()
    section = md[md.index("## On a TP 8 + EP node"):]
    assert "not measured" in section.splitlines()[0] and "broken" not in section
    ex = _extrapolated()
    fit = nodecost.expert_fit(ex["fit"])
    tb_s = nodecost.expert_bytes("fp4") / (fit["beta_ms"] * 1e-3) / 1e12
    assert 0.5 < tb_s < nodecost.HBM_TB_S["H200"] and f"{tb_s:.2f} TB/s" in section
    assert "(the H200's HBM: 4.8 TB/s)" in section
    s = nodecost.summary(nodecost.bracket(ex, predict.PUBLISHED_EAGLE31, 8), ex["prediction"])
    k3 = s[(s.B == 1) & (s.k == 3)].iloc[0]
    assert k3.node_lo <= k3.weights_lo <= k3.weights_hi <= k3.node_hi and k3.corners == 9
    assert (tmp_path / "figures" / "node_bracket.png").exists()
    assert "figures/node_bracket.png" in (tmp_path / "predict.html").read_text()
    md1 = predictreport.report(RUN, out_dir=tmp_path / "one", gpus=1).read_text()
    assert "EP node" not in md1 and not (tmp_path / "one" / "figures" / "node_bracket.png").exists()


def test_a_per_expert_cost_faster_than_the_hbm_is_flagged(tmp_path, monkeypatch):
    """The bandwidth check's control: a synthetic run whose per-layer step grows by 1 us an
    expert read (13 TB/s of MXFP4 experts) gets its node section flagged as a broken fit; at
    5 us an expert (the H200 run's order) it is not. The ceiling is the runs' GPU's: 3 us an
    expert (4.5 TB/s) is broken on an H100 (3.35 TB/s), not on an H200 (4.8)."""
    import json

    import test_predict

    def run(ns_per_expert: float, name: str, gpu: str | None = None) -> str:
        def law(n, layers=4):
            return layers * (0.1 + ns_per_expert * 1e-6 * predict.experts_touched(n)) + 0.02 * n
        monkeypatch.setattr(test_predict, "t_plain", law)
        (tmp_path / name / "call1").mkdir(parents=True)
        res = test_predict.rows(layers=(4, 8), rounds=3)
        (tmp_path / name / "call1" / "results.jsonl").write_text(
            res.to_json(orient="records", lines=True))
        (tmp_path / name / "call1" / "engines.jsonl").write_text(
            '{"engine": "L4-k0", "expert_dtype": "fp4"}\n')
        if gpu:
            (tmp_path / name / "env.json").write_text(json.dumps(
                {"nvidia_smi": [f"{gpu}, 81559 MiB, 580.159.04"], "versions": {"vllm": "0.26.0"}}))
        md = predictreport.report(tmp_path / name).read_text()
        return md[md.index("## On a TP 8 + EP node"):]

    fast = run(1000, "fast")
    assert "the fit is broken" in fast and "GPU unknown; the fastest HBM listed" in fast
    ok = run(5000, "plausible", gpu="NVIDIA H100 80GB HBM3")
    assert "not measured" in ok.splitlines()[0] and "broken" not in ok
    h100 = run(3000, "h100", gpu="NVIDIA H100 80GB HBM3")
    assert "(the H100's HBM: 3.35 TB/s): **more than the HBM delivers" in h100
    tb_s_at_3us = nodecost.expert_bytes("fp4") / 3e-6 / 1e12
    assert nodecost.hbm_tb_s("NVIDIA H100 80GB HBM3")[1] < tb_s_at_3us < \
        nodecost.hbm_tb_s("NVIDIA H200")[1]  # the same fit stands on an H200


def test_predict_refuses_a_node_without_an_allreduce_curve(tmp_path, capsys):
    """`speclab predict --gpus 16` stops with a clear error before reading the run."""
    from speclab import cli

    assert cli.main(["predict", str(tmp_path / "no-such-run"), "--gpus", "16"]) == 1
    assert "all-reduce curves for [2, 4, 8] GPUs" in capsys.readouterr().err


def test_an_mtp_drafter_is_carried_like_a_moe_layer():
    """An MTP drafter's k forwards read E(B) routed experts each: on one GPU its time is what
    was measured (every corner at G = 1, free collectives: `predict`'s prediction), on 8 GPUs
    with nothing divided and free collectives exactly its experts' part shrinks to the
    busiest rank's; an EAGLE-3 drafter (no experts) keeps its time there."""
    ex = _extrapolated()
    beta = nodecost.expert_fit(ex["fit"])["beta_ms"]
    d = ex["drafts"]
    mtp = d[d.draft == ""].assign(draft="mtp", draft_ms=lambda x: 2.5 * x.draft_ms)
    ex = {**ex, "drafts": pd.concat([d, mtp], ignore_index=True)}
    rates = {"eagle3": predict.PUBLISHED_EAGLE31, "mtp": predict.PUBLISHED_MTP}
    ex["prediction"] = predict.predict(ex["plain"], ex["drafts"], rates,
                                       batches=sorted(ex["prediction"].B.unique()))
    one = nodecost.bracket(ex, rates, gpus=1)
    got = ex["prediction"].merge(one[one.allreduce == "none"], on=["draft", "B", "k"],
                                 suffixes=("", "_node")).dropna(subset=["pred_speedup"])
    assert {"", "mtp"} <= set(got.draft)
    np.testing.assert_allclose(got.pred_speedup_node, got.pred_speedup, rtol=1e-12)
    eight = nodecost.bracket(ex, rates, gpus=8)
    row = eight[(eight.tp == "latency") & (eight.allreduce == "none") & (eight.B == 1)
                & (eight.k == 3)].set_index("draft")
    t_mtp = predict.drafter_at(mtp[mtp.B == 1], 3, "draft_ms")
    shrink = 3 * beta * (float(predict.experts_touched(1)) - nodecost.max_rank_experts(1, 8))
    assert row.draft_ms["mtp"] == pytest.approx(t_mtp - shrink)
    assert row.draft_ms[""] == pytest.approx(predict.drafter_at(d[(d.draft == "")
                                                                  & (d.B == 1)], 3, "draft_ms"))
    assert nodecost.divided_ms(beta, 43, 2, method="mtp")[1] > \
        nodecost.divided_ms(beta, 43, 2)[1] > 0  # the head is the bulk of an MTP forward


def test_predict_refuses_bad_acceptance_before_reading_the_run(tmp_path, capsys):
    from speclab import cli

    for args in (["--acceptance", "0.6,0.7"], ["--acceptance-mtp", "0.8,x"]):
        assert cli.main(["predict", str(tmp_path / "no-such-run"), *args]) == 1
        err = capsys.readouterr().err
        assert args[0] in err and "non-increasing" in err and "no-such-run" not in err
