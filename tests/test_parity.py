import math

import numpy as np
import pandas as pd
import pytest
from fake_requests import requests

from speclab import parity, store
from speclab.profiles import Layout, Point, Profile


def _rec(pid, ids, margin=None, runner_up=None, cat="c"):
    return {"prompt_id": pid, "category": cat, "output_token_ids": ids,
            "margin": margin or [1.0] * len(ids), "runner_up": runner_up or [-1] * len(ids)}


def test_compare_classifies_near_ties_and_substantive_divergences():
    ref = pd.DataFrame([
        _rec("a", [1, 2, 3, 4]),
        _rec("b", [1, 2, 3, 4], margin=[2.0, 0.01, 2.0, 2.0], runner_up=[0, 7, 0, 0]),
        _rec("c", [1, 2, 3, 4], margin=[2.0, 2.0, 3.0, 2.0], runner_up=[0, 0, 8, 0]),
    ])
    cand = pd.DataFrame([_rec("a", [1, 2, 3, 4]), _rec("b", [1, 7, 5, 5]), _rec("c", [1, 2, 9, 9])])
    cmp = parity.compare(ref, cand, near_tie=0.05).set_index("prompt_id")
    assert cmp.loc["a", "kind"] == "match" and cmp.loc["a", "exact"]
    assert cmp.loc["b", "kind"] == "near-tie" and cmp.loc["b", "first_divergence"] == 1
    assert cmp.loc["b", "took_runner_up"] and cmp.loc["b", "margin"] == 0.01
    assert cmp.loc["c", "kind"] == "substantive" and not cmp.loc["c", "took_runner_up"]
    assert cmp.loc["c", "prefix_agreement"] == 0.5
    s = parity.summarize(cmp.reset_index())
    assert (s["n"], s["exact"], s["near_tie"], s["substantive"]) == (3, 1, 1, 1)
    assert s["match_lo"] < 1 / 3 < s["match_hi"]
    lines = parity.findings(
        pd.DataFrame([{"arm": "x", "question": "q", "status": "ok", **s}]), 0.05)
    assert "1 SUBSTANTIVE" in lines[0] and "1/3 prompts identical" in lines[0]


def test_margins_count_only_where_the_logprob_pass_shared_the_prefix():
    # the reference's margins come from a second pass that left its output after position 1
    lp = {"margin": [2.0, 0.01, 0.01, 0.01], "runner_up": [0, 7, 7, 7],
          "logprob_pass_divergence": 1}
    ref = pd.DataFrame([{**_rec("a", [1, 2, 3, 4]), **lp}, {**_rec("b", [1, 2, 3, 4]), **lp}])
    cand = pd.DataFrame([_rec("a", [1, 7, 3, 4]), _rec("b", [1, 2, 7, 4])])
    cmp = parity.compare(ref, cand, near_tie=0.05).set_index("prompt_id")
    assert cmp.loc["a", "kind"] == "near-tie"  # position 1: same prefix in both passes
    assert cmp.loc["b", "kind"] == "unscored" and np.isnan(cmp.loc["b", "margin"])


def test_missing_margins_come_from_other_plain_passes_that_saw_the_context():
    # the reference's pass left at 0; plain run "p2" shares the prefix and its pass stayed on
    ref = pd.DataFrame([{**_rec("a", [1, 2, 3, 4], margin=[0.0, 9, 9, 9]), "point_id": "ref",
                         "logprob_pass_divergence": 0}])
    cand = pd.DataFrame([{**_rec("a", [1, 2, 8, 4]), "point_id": "cand"}])
    p2 = {**_rec("a", [1, 2, 3, 5], margin=[1, 1, 0.02, 1]), "point_id": "p2",
          "logprob_pass_divergence": None}
    p3 = {**_rec("a", [1, 2, 3, 5], margin=[1, 1, 0.04, 1]), "point_id": "p3",
          "logprob_pass_divergence": 2}
    off = {**_rec("a", [1, 9, 3, 5], margin=[1, 1, 5.0, 1]), "point_id": "p4",
           "logprob_pass_divergence": None}  # another context: not used
    plain = pd.concat([ref, pd.DataFrame([p2, p3, off])], ignore_index=True)
    row = parity.compare(ref, cand, near_tie=0.05, plain=plain).iloc[0]
    assert row.margin == pytest.approx(0.03) and row.margin_from == 2 and row.kind == "near-tie"
    assert not row.took_runner_up  # the runner-up is only known from the reference's own pass


def test_noise_floor_from_plain_self_flips_classifies_divergences():
    recs = pd.DataFrame([
        {**_rec("a", [1, 2, 3, 4], margin=[1, 0.2, 1, 1]), "point_id": "ref", "k": 0,
         "logprob_pass_divergence": None},
        {**_rec("b", [1, 2, 3, 4], margin=[1, 1, 0.3, 1]), "point_id": "ref", "k": 0,
         "logprob_pass_divergence": 2},  # a self-flip at margin 0.3
        {**_rec("a", [1, 7, 3, 4]), "point_id": "cand", "k": 3, "logprob_pass_divergence": None},
        {**_rec("b", [1, 2, 3, 4]), "point_id": "cand", "k": 3, "logprob_pass_divergence": None},
    ])
    # server-mode records carry no logprob pass: no flips, floor 0
    assert parity.noise_floor(recs.drop(columns=["margin", "logprob_pass_divergence"])) == 0.0
    flips = parity.self_flips(recs[recs.k == 0])
    assert flips[["prompt_id", "position", "margin"]].values.tolist() == [["b", 2, 0.3]]
    assert parity.noise_floor(recs) == 0.3
    arm = parity.Arm("spec-k3", Point(k=0), Point(k=3, draft_kv_cache_dtype="auto"), "q")
    recs["point_id"] = recs.point_id.map({"ref": arm.ref.id, "cand": arm.cand.id})
    pts = pd.DataFrame({"point_id": [arm.ref.id, arm.cand.id], "status": ["ok", "ok"]})
    summary, cmp = parity.evaluate([arm], recs, pts, near_tie=0.05)
    assert cmp.set_index("prompt_id").loc["a", "kind"] == "within-noise"
    s = summary.iloc[0]
    assert (s.within_noise, s.substantive, s.noise_floor) == (1, 0, 0.3)
    lines = parity.findings(summary, 0.05, flips=flips, n_plain=2)
    assert lines[0].startswith("Plain reruns: the untimed second pass of a plain run left its "
                               "timed output in 1/2 prompt-runs, at top-1/top-2 margins up to 0.3")
    assert "1 within the plain runs' own noise (margin <= 0.3)" in lines[1]
    # a margin above the floor is substantive
    summary, cmp = parity.evaluate([arm], recs.assign(margin=[[1, 0.5, 1, 1], [1, 1, 0.3, 1],
                                                              [1] * 4, [1] * 4]), pts)
    assert summary.iloc[0].substantive == 1 and "SUBSTANTIVE (margin > 0.3)" in \
        parity.findings(summary, 0.05)[0]


def test_wilson_interval():
    lo, hi = parity.wilson(8, 8)
    assert hi == 1.0 and 0.6 < lo < 0.7
    assert all(math.isnan(x) for x in parity.wilson(0, 0))


def _profile(**grid):
    return Profile(name="t", backend="cpu", target="/x", draft="/d", prompts={"file": "p.jsonl"},
                   grid={"kv_cache_dtype": ["fp8", "fp8_e5m2"],
                         "draft_kv_cache_dtype": ["auto", "fp8"], **grid})


def test_plan_builds_reference_candidate_pairs_and_shares_points():
    arms = parity.plan(_profile(), ["spec", "repeat", "draft-kv", "target-kv", "tp2-ep", "batch1",
                                    "batch-invariant"], k_values=(1, 3), spec_k=3)
    by = {a.name: a for a in arms}
    assert by["spec-k1"].ref == by["repeat"].ref == Point(k=0, kv_cache_dtype="fp8")
    assert by["spec-k3"].cand.k == 3 and by["spec-k3"].cand.draft_kv_cache_dtype == "auto"
    assert by["draft-kv-fp8"].cand.draft_kv_cache_dtype == "fp8"
    assert by["repeat"].cand.repeat == 1
    assert by["target-kv-fp8_e5m2-spec"].ref.kv_cache_dtype == "fp8_e5m2"
    assert by["tp2-ep-spec"].ref.layout == Layout(tp=2, ep=True)
    assert by["batch1-spec"].cand.concurrency == 1
    assert by["batch-invariant-spec"].cand.env == {"VLLM_BATCH_INVARIANT": "1"}
    pts = parity.points_of(arms)
    assert len({p.id for p in pts}) == len(pts)
    # spec-k3 and draft-kv-auto are the same point: run once
    assert by["spec-k3"].cand.id == by["draft-kv-auto"].cand.id
    with pytest.raises(ValueError, match="unknown parity arm"):
        parity.plan(_profile(), ["nope"])


def test_versus_plain_pairs_each_spec_point_with_its_baseline():
    pts = [Point(k=0), Point(k=2, draft_kv_cache_dtype="auto"),
           Point(k=2, draft_kv_cache_dtype="auto", prompt_format="chat")]
    arms = parity.versus_plain(pts)
    assert [a.cand.id for a in arms] == [pts[1].id]
    assert arms[0].ref == pts[0]


def test_evaluate_reports_arms_whose_points_did_not_run():
    arms = parity.plan(_profile(), ["repeat"])
    pts = pd.DataFrame([{"point_id": arms[0].ref.id, "status": "ok"},
                        {"point_id": arms[0].cand.id, "status": "error"}])
    summary, cmp = parity.evaluate(arms, pd.DataFrame(), pts)
    assert summary.status.iloc[0] == f"not run: candidate {arms[0].cand.id} error" and cmp.empty
    summary, _ = parity.evaluate(arms, pd.DataFrame(), pts.iloc[:0])
    assert "reference" in summary.status.iloc[0] and "has no result" in summary.status.iloc[0]


def test_findings_print_counts_as_integers_next_to_arms_that_did_not_run():
    s = {"n": 16, "exact": 15, "match_rate": 15 / 16, "match_lo": 0.7, "match_hi": 0.99,
         "near_tie": 1, "substantive": 0, "took_runner_up": 1, "first_divergence": [9]}
    summary = pd.DataFrame([{"arm": "a", "question": "q", "status": "ok", **s},
                            {"arm": "b", "question": "q", "status": "not run: candidate x error"}])
    lines = parity.findings(summary, 0.05)
    assert lines[0].startswith("a (q): 15/16 prompts identical") and "1 at near-ties" in lines[0]
    assert lines[1] == "b: not run: candidate x error."


def _write_run(d, profile, point_id, recs):
    store.save_profile(profile, d, "t0")
    store.write_point(d, store.PointResult(point_id=point_id, status="ok", point={"k": 0}),
                      requests(recs))


def test_plain_from_runs_pools_other_runs_of_the_same_target_and_refuses_others(tmp_path):
    prof = _profile()
    plain = {**_rec("a", [1, 2, 3]), "point_id": "k0", "k": 0, "logprob_pass_divergence": 1}
    spec = {**_rec("a", [1, 2, 3]), "point_id": "k3", "k": 3, "logprob_pass_divergence": None}
    _write_run(tmp_path / "again", prof, "k0", [plain, spec])
    got = parity.plain_from_runs(prof, ["again"], base=tmp_path)
    assert got.point_id.tolist() == ["again:k0"] and parity.noise_floor(got) == 1.0
    _write_run(tmp_path / "other", prof.model_copy(update={"target": "/y"}), "k0", [plain])
    with pytest.raises(ValueError, match=r"other differs from t in \['target'\]"):
        parity.plain_from_runs(prof, [tmp_path / "other"])
    with pytest.raises(ValueError, match="not a run folder"):
        parity.plain_from_runs(prof, ["missing"], base=tmp_path)


@pytest.mark.parametrize("eager, label, flipped", [(True, "on", False), (False, "off", True)])
def test_cuda_graphs_arm_flips_the_profiles_eager_setting(eager, label, flipped):
    prof = _profile().model_copy(update={"engine": {"enforce_eager": eager}})
    by = {a.name: a for a in parity.plan(prof, ["cuda-graphs"], spec_k=3)}
    plain_arm, spec_arm = by[f"cuda-graphs-{label}-plain"], by[f"cuda-graphs-{label}-spec"]
    assert plain_arm.ref.engine == {} and plain_arm.cand.engine == {"enforce_eager": flipped}
    assert spec_arm.ref == plain_arm.cand and spec_arm.cand.k == 3
    assert spec_arm.cand.engine == {"enforce_eager": flipped}
    # its own engines: ids differ from the profile's plain and spec points
    assert len({plain_arm.ref.id, plain_arm.cand.id, spec_arm.cand.id}) == 3
