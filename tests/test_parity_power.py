"""Pre-registered classification, noise arm, rescoring, injected defects and detection power,
on constructed sequences (no engine)."""

import functools
import math

import pandas as pd
import pytest
import torch

from speclab import defects, multipass, notebook, parity
from speclab.fixtures import neartie
from speclab.profiles import Point, Profile


def _rec(point, pid, ids, margin=None, runner_up=None, k=0):
    return {"point_id": point, "prompt_id": pid, "category": "c", "output_token_ids": ids, "k": k,
            "margin": margin or [1.0] * len(ids), "runner_up": runner_up or [-1] * len(ids),
            "logprob_pass_divergence": None}


def _profile(**parity_block):
    return Profile(name="t", backend="cpu", target="/x", draft="/d", prompts={"file": "p.jsonl"},
                   grid={"num_speculative_tokens": [0, 3]},
                   parity={"arms": ["noise", "spec"], "k_values": [3], **parity_block})


def _run(arms, recs):
    ids = {p.id for a in arms for p in (a.ref, a.cand)}
    return pd.DataFrame({"point_id": sorted(ids), "status": "ok"})


def _noise_and_control(floor_margin, defect_margin):
    """A noise arm whose passes diverge once at `floor_margin`, and one verify-bias control
    whose output diverges from plain where the reference's margin is `defect_margin`."""
    prof = _profile(controls=[{"kind": "verify-bias", "sizes": [0.1], "seeds": [0]}])
    arms = parity.plan(prof, ["noise"], k_values=[3], spec_k=3)
    noise = [a for a in arms if a.role == "noise"]
    ctrl = next(a for a in arms if a.role == "control")
    plain_pts = {p.id: p for a in noise for p in (a.ref, a.cand)}
    recs = []
    for pid in plain_pts:
        flip = pid == noise[0].cand.id  # one pass takes the runner-up at position 2
        recs.append(_rec(pid, "a", [1, 2, 9 if flip else 3, 4], margin=[1, 1, floor_margin, 1]))
    recs.append(_rec(ctrl.cand.id, "a", [1, 7, 5, 5], k=3))
    recs = pd.DataFrame(recs)
    ref = recs[recs.point_id == ctrl.ref.id].index[0]
    recs.at[ref, "margin"] = [1, defect_margin, floor_margin, 1]
    return prof, arms, recs


@pytest.mark.parametrize("defect_margin, kind", [(0.07, "substantive"), (0.055, "within-noise"),
                                                 (0.03, "near-tie")])
def test_a_defect_just_above_the_measured_noise_floor_is_flagged(defect_margin, kind):
    prof, arms, recs = _noise_and_control(0.06, defect_margin)
    a = parity.analyze(arms, recs, _run(arms, recs), parity.settings(prof))
    assert a.floor["floor"] == pytest.approx(0.06) and a.floor["flips"] >= 1
    ctrl = a.summary[a.summary.role == "control"].iloc[0]
    assert a.cmp[a.cmp.arm == ctrl.arm].kind.iloc[0] == kind
    assert bool(ctrl.flagged_parity) == (kind == "substantive")
    # the noise arm itself is never flagged by its own floor
    assert not a.summary[a.summary.role == "noise"].flagged_parity.any()


def test_a_fixed_floor_is_a_named_reanalysis_beside_the_preregistered_one():
    prof, arms, recs = _noise_and_control(0.06, 0.07)
    pts = _run(arms, recs)
    first = parity.analyze(arms, recs, pts, parity.settings(prof))
    other = parity.analyze(arms, recs, pts, parity.settings(prof, "floor-0.1", noise_floor=0.1))
    assert first.settings.name == "pre-registered" and other.settings.name == "floor-0.1"
    assert other.floor["floor"] == 0.1 and other.floor["measured_max_flip"] == pytest.approx(0.06)
    assert first.summary.flagged_parity.sum() == 1 and other.summary.flagged_parity.sum() == 0
    assert "max-flip" in first.settings.describe() and "0.1 nats (fixed)" in \
        other.settings.describe()


def test_noise_floor_uncertainty_counts_flips_and_pairs():
    cmp = pd.DataFrame({"exact": [True, False, False, True], "margin": [math.nan, 0.02, 0.04,
                                                                        math.nan]})
    f = parity.floor_from(cmp, pd.DataFrame({"margin": [0.01]}), parity.Settings())
    assert (f["floor"], f["flips"], f["prompt_pairs"], f["diverged_pairs"]) == (0.04, 3, 4, 2)
    assert f["exceed_prob"] == pytest.approx(1 / 4)
    assert f["flip_rate_lo"] < 0.5 < f["flip_rate_hi"]
    none = parity.floor_from(cmp.iloc[:1], pd.DataFrame({"margin": []}), parity.Settings())
    assert none["floor"] == 0.0 and none["exceed_prob"] == 1.0


def test_unscored_divergences_are_rescored_from_the_plain_engine():
    ref = pd.DataFrame([{**_rec("ref", "a", [1, 2, 3, 4], margin=[1, 1, 1, 1]),
                         "logprob_pass_divergence": 0}])
    cand = pd.DataFrame([_rec("cand", "a", [1, 2, 8, 4], k=3)])
    cmp = parity.compare(ref, cand, near_tie=0.05)
    assert cmp.kind.iloc[0] == "unscored"
    todo = parity.rescore_requests(cmp)
    assert todo.to_dict("records") == [{"prompt_id": "a", "position": 2, "prefix": [1, 2]}]
    rescored = pd.DataFrame([{"prompt_id": "a", "position": 2,
                              "prefix_sha": multipass.prefix_sha([1, 2]), "margin": 0.5,
                              "top1": 3, "runner_up": 8}])
    row = parity.compare(ref, cand, near_tie=0.05, rescored=rescored).iloc[0]
    assert (row.kind, row.margin, row.margin_source, row.took_runner_up) == \
        ("substantive", 0.5, "rescored", True)
    other = rescored.assign(prefix_sha=multipass.prefix_sha([1, 9]))
    assert parity.compare(ref, cand, rescored=other).kind.iloc[0] == "unscored"


def test_power_and_resolution_from_flagged_runs():
    rows = []
    for size, flags in ((0.02, [0, 0, 0]), (0.1, [1, 0, 1]), (0.2, [1, 1, 1]), (0.5, [1, 1, 1])):
        for seed, f in enumerate(flags):
            rows.append({"arm": f"v{size}{seed}", "role": "control", "status": "ok",
                         "defect": "verify-bias", "size": size, "seed": seed, "n": 4,
                         "exact": 4 - f,
                         "substantive": f, "flagged_parity": bool(f), "flagged_acceptance": True,
                         "flagged": True, "margins": [0.3] if f else [],
                         "defect_rows_hit": 10, "defect_argmax_changed": 2})
    rows.append({"arm": "aux", "role": "control", "status": "ok", "defect": "aux-layers",
                 "size": math.nan, "n": 4, "exact": 4, "substantive": 0, "flagged_parity": False,
                 "flagged_acceptance": True, "flagged": True, "margins": []})
    pw = parity.power(pd.DataFrame(rows))
    v = pw[pw.defect == "verify-bias"].set_index("size")
    assert v.loc[0.1, ["runs", "flagged_parity", "diverged", "positions_hit"]].tolist() == \
        [3, 2, 2, 30]
    assert parity.resolution(pw, 1.0) == {"aux-layers": None, "verify-bias": 0.2}
    assert parity.resolution(pw, 2 / 3)["verify-bias"] == 0.1
    assert parity.resolution(pw, 1.0, "flagged_acceptance") == {"aux-layers": "detected",
                                                                "verify-bias": 0.02}
    lines = parity.power_findings(pw, {"flagged_parity": parity.resolution(pw, 1.0)},
                                  parity.Settings())
    assert any("verify-bias: 0.2 nats" in x and "aux-layers: not detected" in x for x in lines)


def test_plan_has_noise_pairs_and_control_groups():
    prof = _profile(controls=[{"kind": "accept-bias", "sizes": [0.05, 0.1], "seeds": [0, 1]},
                              {"kind": "aux-layers", "aux_ids": [2, 3, 4]}])
    arms = parity.plan(prof, ["noise", "spec"], k_values=[3], spec_k=3)
    noise = [a for a in arms if a.role == "noise"]
    assert len(noise) == 6 and {a.question for a in noise} == {
        "plain vs plain, separate engines", "plain vs plain, one engine"}
    sep = {p.id for p in parity.points_of(noise)}
    assert len(sep) == 3 and all(multipass.GROUP_ENV not in p.env for p in parity.points_of(noise))
    groups = {g.name: g for g in parity.groups_of(arms)}
    assert set(groups) == {"noise", "accept-bias-k3", "aux-layers-2-3-4-k3"}
    assert len(groups["noise"].passes) == 3 and groups["noise"].engine_point == Point(k=0)
    acc = groups["accept-bias-k3"]
    assert len(acc.passes) == 4 and acc.engine_point.env == {} and acc.engine_point.k == 3
    assert {defects.from_env(p.env).size for p in acc.passes} == {0.05, 0.1}
    aux = groups["aux-layers-2-3-4-k3"].engine_point
    assert defects.from_env(aux.env).aux_ids == [2, 3, 4]  # installed before the model loads


def test_verify_bias_flips_exactly_the_chosen_positions_with_margin_below_its_size():
    torch.manual_seed(0)
    n = 4000
    logits = torch.randn(n, 50)
    top2 = logits.topk(2, dim=-1)
    margin = top2.values[:, 0] - top2.values[:, 1]
    d = defects.Defect(kind="verify-bias", size=0.1, share=0.25, seed=3)
    hit_mask = defects.chosen(top2.indices[:, 0], top2.indices[:, 1], 3, 0.25)
    assert 0.2 < hit_mask.double().mean() < 0.3  # the known share
    biased = logits.clone()
    hit, flips = defects.bias_logits(biased, torch.zeros(n, dtype=torch.long), d)
    changed = biased.argmax(-1) != top2.indices[:, 0]
    assert hit == int(hit_mask.sum()) and flips == int(changed.sum())
    assert torch.equal(changed, hit_mask & (margin < 0.1))
    # same positions every time: the choice is a function of the token ids and the seed
    again = logits.clone()
    assert defects.bias_logits(again, torch.zeros(n, dtype=torch.long), d) == (hit, flips)


def test_accept_bias_only_helps_a_draft_token_within_its_size():
    logits = torch.tensor([[2.0, 1.95, 0.0], [2.0, 1.0, 0.0], [2.0, 1.95, 0.0]])
    draft = torch.tensor([1, 1, 0])
    d = defects.Defect(kind="accept-bias", size=0.1, share=1.0)
    hit, flips = defects.bias_logits(logits, draft, d)
    assert (hit, flips) == (2, 1)  # row 2's draft token already is the argmax: untouched
    assert logits.argmax(-1).tolist() == [1, 0, 0]


def test_defects_round_trip_through_the_point_environment():
    d = defects.Defect(kind="verify-bias", size=0.2, share=0.5, seed=1)
    assert defects.from_env(d.env()) == d and defects.from_env({}) is None
    with pytest.raises(ValueError):
        defects.from_env({defects.ENV: '{"kind": "nope"}'})
    with pytest.raises(ValueError, match="aux_ids"):
        _profile(controls=[{"kind": "aux-layers"}])


def test_neartie_scale_must_be_exact_and_margin_stats():
    with pytest.raises(ValueError, match="power of 2"):
        neartie.build_neartie_llama("/nowhere", "/nowhere", seed=0, head_scale=0.1)
    s = neartie.margin_stats([0.0, 0.01, 0.05, 0.2, math.inf])
    assert s["n"] == 4 and s["share_le_0.05"] == 0.75


def test_other_views_read_the_floor_notebook_03_recorded(tmp_path):
    import nbformat

    assert parity.recorded_analysis(tmp_path) == {}
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("record(...)")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        notebook.MIME: {"near_tie": 0.05, "noise": {"floor": 0.07}, "self_flips": []}})]
    nb.cells.append(cell)
    (tmp_path / "notebooks").mkdir()
    nbformat.write(nb, str(tmp_path / "notebooks" / "03_parity.ipynb"))
    assert parity.recorded_analysis(tmp_path) == {"near_tie": 0.05, "noise_floor": 0.07}
    cell.outputs[0]["data"][notebook.MIME] = {"near_tie": 0.05, "self_flips": [{"margin": 0.02}]}
    nbformat.write(nb, str(tmp_path / "notebooks" / "03_parity.ipynb"))
    assert parity.recorded_analysis(tmp_path)["noise_floor"] == 0.02  # runs before the noise arm


def test_detection_power_figure_draws_each_defect():
    from speclab import plots

    pw = pd.DataFrame({"defect": ["verify-bias"] * 2 + ["aux-layers"], "size": [0.05, 0.1, None],
                       "runs": [3, 3, 1], "flagged_parity": [0, 3, 0],
                       "flagged_acceptance": [3, 3, 0]})
    fig = plots.detection_power(pw, 0.05, 0.0)
    ax = fig.axes[0]
    assert len(ax.lines) == 3 and list(ax.lines[0].get_ydata()) == [0.0, 1.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.05", "0.1"]
    assert plots.detection_power(pw[pw.defect == "aux-layers"], 0.05, 0.0) is None


@pytest.fixture(scope="module")
def dial_bigram(module_tmp):
    """The near-tie DeepSeek-V4 bigram (`neartie-dial-dsv4`, seed 0) in a temporary folder."""
    (d := module_tmp / "neartie-dial-dsv4").mkdir()
    neartie.build_neartie_dial_dsv4(d, seed=0)
    return d


def test_counters_along_a_plain_path_follow_that_path(dial_bigram):
    """Along the readout's own greedy path the counters are the reference's; a path that took
    the runner-up once (a GPU's bf16 near-tie flip) gets other counters, and its tokens after
    the flip follow the readout from the token it took."""
    ids = [[5, 9, 17], [40, 41]]
    ref = neartie.dial_reference(dial_bigram, ids, 24, (1, 3))
    same = neartie.dial_counters_along(dial_bigram, ids, [p["output_token_ids"]
                                                          for p in ref["prompts"]], 24, (1, 3))
    assert same["counters"] == ref["counters"] and same["prompts"] == ref["prompts"]
    p0 = ref["prompts"][0]
    j = next(i for i, (tok, ru) in enumerate(zip(p0["output_token_ids"], p0["runner_up"]))
             if ru == tok + 1 and i > 2)  # the readout counted up by 2 here: flip to + 1
    flipped = p0["output_token_ids"][:j] + [p0["runner_up"][j]]
    along = neartie.dial_counters_along(dial_bigram, ids, [flipped, None], 24, (1, 3))
    out = along["prompts"][0]["output_token_ids"]
    assert out[:j + 1] == flipped and out != p0["output_token_ids"]
    assert along["counters"][3]["per_prompt"][0] != ref["counters"][3]["per_prompt"][0]
    assert along["counters"][3]["per_prompt"][1] == ref["counters"][3]["per_prompt"][1]
    with pytest.raises(ValueError, match="1 outputs for 2 prompts"):
        neartie.dial_counters_along(dial_bigram, ids, [flipped], 24)


def test_the_plain_path_expectation_is_a_reanalysis_read_from_the_run(tmp_path):
    """`expected_from="plain-path"` reads the run's file; the pre-registered analysis keeps
    the CPU reference; acceptance off by more than the tolerance flags only where it is."""
    import json

    prof = _profile(expected="unused.json")
    arms = [a for a in parity.plan(prof, ["spec"], k_values=[3], spec_k=3) if a.role == "arm"]
    arm = arms[0]
    recs = pd.DataFrame([_rec(arm.ref.id, "p", [1, 2, 3]), _rec(arm.cand.id, "p", [1, 2, 3], k=3)])
    pts = pd.DataFrame({"point_id": [arm.ref.id, arm.cand.id], "status": "ok", "output_tokens": 3,
                        "counters.num_drafts": [0, 10], "counters.num_accepted_tokens": [0, 21]})
    cpu = {"3": {"num_drafts": 10, "num_accepted_tokens": 18, "mean_acceptance_length": 2.8}}
    (tmp_path / parity.PLAIN_PATH_FILE).write_text(json.dumps({"counters": {
        "3": {"num_drafts": 10, "num_accepted_tokens": 21, "mean_acceptance_length": 3.1}}}))
    pre = parity.settings(prof)
    path = parity.settings(prof, "plain-path expectation", expected_from="plain-path")
    assert parity.expected_for(pre, cpu, tmp_path) is cpu
    a_pre = parity.analyze(arms, recs, pts, pre, expected=parity.expected_for(pre, cpu, tmp_path))
    a_path = parity.analyze(arms, recs, pts, path,
                            expected=parity.expected_for(path, cpu, tmp_path))
    assert bool(a_pre.summary.flagged_acceptance.iloc[0])       # 0.70 vs 0.60
    assert not bool(a_path.summary.flagged_acceptance.iloc[0])  # 0.70 vs 0.70
    assert "plain greedy path" in path.describe() and "CPU reference" in pre.describe()
    assert parity.expected_for(path, cpu, tmp_path / "elsewhere") is None
    with pytest.raises(ValueError, match="expected_from 'gpu'"):
        parity.settings(prof, "x", expected_from="gpu")


H200_PARITY = "h200-dsv4-neartie-accept-20261204-vllm026"
H100_PARITY_022 = "h100-dsv4-neartie-accept-20261207-vllm022"
H100_INVARIANT_026 = "h100-dsv4-neartie-accept-20261207-vllm026"


@functools.cache
def _requests(run_id):
    from speclab import store

    return store.requests(store.run_dirs(run_id)[0])


def _outputs(run_id, point):
    """A committed point's output tokens by prompt and its (drafts, accepted) totals."""
    df = _requests(run_id).query("point_id == @point").sort_values("prompt_id")
    return [list(t) for t in df.output_token_ids], df[["drafts", "accepted"]].sum().tolist()


def _parity_jobs():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools/gpu/parity_jobs.py"
    spec = importlib.util.spec_from_file_location("parity_jobs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_device_rescore_job_rescores_only_what_no_plain_pass_saw(monkeypatch, capsys):
    """The committed H200 run: every divergence (the controls') was seen by a plain pass, so
    nothing goes to the engine; a divergence left unscored is sent to multipass.rescore."""
    jobs = _parity_jobs()
    sent = []
    monkeypatch.setattr(multipass, "rescore", lambda prof, run_dir, todo: sent.append(todo))
    assert jobs.rescore("tiny-dsv4-neartie-accept-h200", H200_PARITY) == 0
    assert sent == [] and "no divergence to rescore" in capsys.readouterr().out
    todo = pd.DataFrame({"prompt_id": ["len16-0"], "position": [3], "prefix": [[1, 2, 3]]})
    monkeypatch.setattr(parity, "rescore_requests", lambda cmp: todo)
    assert jobs.rescore("tiny-dsv4-neartie-accept-h200", H200_PARITY) == 0
    assert len(sent) == 1 and sent[0] is todo


def _check_committed(run_id, n_healthy):
    """The pre-registered and the plain-path analyses of a committed parity run, with what
    every healthy GPU run must show: its `n_healthy` arms give plain greedy's 16 outputs under
    both, none is flagged along the plain path, and parity resolves both controls at 0.1
    nats. Returns both analyses and the plain-path summary by arm."""
    from speclab import profiles, store

    prof = profiles.load("tiny-dsv4-neartie-accept-h200")
    run = store.run_dirs(run_id)[0]
    plan = parity.plan(prof, prof.parity.arms, k_values=prof.parity.k_values,
                       spec_k=prof.parity.spec_k)
    pts, recs = store.results_for(run, parity.points_of(plan, grouped=None))
    ref = parity.load_expected(profiles.REPO / prof.parity.expected)
    pre, path = parity.settings(prof), parity.settings(prof, "p", expected_from="plain-path")
    a_pre = parity.analyze(plan, recs, pts, pre, expected=ref)
    a_path = parity.analyze(plan, recs, pts, path, expected=parity.expected_for(path, ref, run))
    for a in (a_pre, a_path):
        healthy = a.summary[(a.summary.role != "control") & (a.summary.status == "ok")]
        assert len(healthy) == n_healthy and (healthy.exact == 16).all()
    arms = a_path.summary.set_index("arm")
    assert not arms.loc[arms.status == "ok"].query("role != 'control'").flagged.any()
    pw = parity.power(a_path.summary)
    assert parity.resolution(pw, 1.0, "flagged_parity") == {"accept-bias": 0.1,
                                                            "verify-bias": 0.1}
    return a_pre, a_path, arms


def test_the_h200_parity_run_reads_as_committed():
    """data/runs/h200-...-vllm026 (vLLM 0.26, H200): plain repeats, speculation and all the
    arms but draft KV fp8 (added to the profile after the run) and TP 2 + EP (target KV
    fp8_e4m3, batch 1, CUDA graphs, batch invariance, each plain and k = 3)
    identical and unflagged along the plain path, acceptance off the CPU reference (the plain
    path took the runner-up at near-ties) but on the counters expected along its own plain
    path; both controls flagged by parity from 0.1 nats in every draw. k = 3 under batch
    invariance (2026-12-07, overlay 2.2.0; it failed in vLLM under 2.1.0, the error kept in
    `superseded/`) emitted the H100/0.26 run's tokens with the base k = 3 point's counters."""
    a_pre, a_path, arms = _check_committed(H200_PARITY, 17)  # draft-kv-auto is spec-k3
    assert (arms.loc[["batch-invariant-spec", "cuda-graphs-on-spec"], "status"] == "ok").all()
    assert arms.loc["draft-kv-fp8", "status"].startswith("not run")  # added 2026-12-07
    from speclab import store

    point = "k3_kv-fp8_dkv-auto_tp1_raw_x03f412a9"
    run = store.run_dirs(H200_PARITY)[0]
    res = store.read_meta(run, point)
    assert res["point"]["env"] == {"VLLM_BATCH_INVARIANT": "1"}
    assert "overlay: invariant-mean applied" in store.point_log(run, point)
    assert res["counters"] == store.read_meta(run, "k3_kv-fp8_dkv-auto_tp1_raw")["counters"]
    assert _outputs(H200_PARITY, point) == _outputs(H100_INVARIANT_026, point)
    failed = run / "superseded/20261207-200542" / f"{point}.json"
    assert "Incompatible dtypes" in failed.read_text()
    spec = lambda a: a.summary[a.summary.arm.str.startswith("spec-")]
    assert spec(a_pre).flagged_acceptance.all() and not spec(a_path).flagged_acceptance.any()


def test_the_h100_vllm022_parity_run_reads_as_committed_and_as_the_h200_one():
    """data/runs/h100-...-vllm022 (vLLM 0.22 + overlay 2.2.0, H100, 2026-12-07 in three device
    sessions): all 18 healthy arms, speculation with CUDA graphs, under
    `VLLM_BATCH_INVARIANT=1` and with the draft's KV cache in fp8 (the overlay's draft KV
    dtype, third session) included, are identical and unflagged along the plain path, and
    parity resolves both controls at 0.1 nats, as on the H200 with 0.26. Beyond the analysis:
    every point both runs measured emitted the H200 run's tokens and counters exactly, and
    k = 3 under batch invariance (failed in vLLM 0.26 on the H200) emitted plain k = 3's; the
    comparison is not blind (control: the 0.5-nat verify-bias point differs from plain on
    every prompt)."""
    _, _, arms = _check_committed(H100_PARITY_022, 18)
    assert (arms.loc[["batch-invariant-spec", "cuda-graphs-on-spec", "draft-kv-fp8"],
                     "status"] == "ok").all()
    shared = ["k0_kv-fp8_tp1_raw", "k0_kv-fp8_tp1_raw_r1", "k0_kv-fp8_tp1_raw_r2",
              "k0_kv-fp8_tp1_raw_c1", "k0_kv-fp8_e4m3_tp1_raw", "k0_kv-fp8_tp1_raw_x00f57164",
              "k0_kv-fp8_tp1_raw_x03f412a9", "k1_kv-fp8_dkv-auto_tp1_raw",
              "k3_kv-fp8_dkv-auto_tp1_raw", "k3_kv-fp8_dkv-auto_tp1_raw_c1",
              "k3_kv-fp8_dkv-auto_tp1_raw_x00f57164", "k3_kv-fp8_e4m3_dkv-auto_tp1_raw"]
    for point in shared:
        assert _outputs(H100_PARITY_022, point) == _outputs(H200_PARITY, point), point
    assert (_outputs(H100_PARITY_022, "k3_kv-fp8_dkv-auto_tp1_raw_x03f412a9")
            == _outputs(H100_PARITY_022, "k3_kv-fp8_dkv-auto_tp1_raw"))
    plain, _ = _outputs(H100_PARITY_022, "k0_kv-fp8_tp1_raw")
    biased, _ = _outputs(H100_PARITY_022, "k3_kv-fp8_dkv-auto_tp1_raw_x2b8b0634")  # 0.5 nats
    assert all(a != b for a, b in zip(plain, biased))
    # the draft's KV cache in fp8 beside target KV fp8 and fp8_e4m3 (the latter in no arm):
    # plain greedy's tokens; the fp8 cache took effect (the overlay logs it, and one accepted
    # token moves between positions 2 and 3 against the draft's bf16 cache: the proposals
    # changed), the accepted total did not
    from speclab import store

    run = store.run_dirs(H100_PARITY_022)[0]
    for kv in ("fp8", "fp8_e4m3"):
        point = f"k3_kv-{kv}_dkv-fp8_tp1_raw"
        log = store.point_log(run, point)
        assert "draft KV cache dtype fp8 (EAGLE3_DRAFT_KV_CACHE_DTYPE)" in log
        assert _outputs(H100_PARITY_022, point)[0] == plain
        fp8 = store.read_meta(run, point)["counters"]
        bf16 = store.read_meta(run, f"k3_kv-{kv}_dkv-auto_tp1_raw")["counters"]
        assert fp8["num_accepted_tokens"] == bf16["num_accepted_tokens"] == 696
        assert fp8["accepted_per_pos"] != bf16["accepted_per_pos"]


def test_the_h100_vllm026_batch_invariant_point_emits_plain_greedy():
    """data/runs/h100-...-vllm026 (vLLM 0.26 + overlay 2.2.0, H100, 2026-12-07): k = 3 under
    `VLLM_BATCH_INVARIANT=1`, the arm that died in vLLM 0.26 on the H200 under overlay 2.1.0,
    ran with batch invariance on and the overlay's `invariant-mean`, and emitted plain
    greedy's tokens with the base k = 3 point's counters (the H200 run's); the comparison
    is not blind (control: the H200 run's 0.5-nat verify-bias point differs on every
    prompt)."""
    from speclab import store

    point = "k3_kv-fp8_dkv-auto_tp1_raw_x03f412a9"
    run, h200 = store.run_dirs(H100_INVARIANT_026)[0], store.run_dirs(H200_PARITY)[0]
    res = store.read_meta(run, point)
    assert res["status"] == "ok" and res["vllm_version"] == "0.26.0"
    assert res["point"]["env"] == {"VLLM_BATCH_INVARIANT": "1"}
    assert res["fingerprint"]["parts"]["hardware"]["gpus"] == ["NVIDIA H100 80GB HBM3"]
    log = store.point_log(run, point)
    assert "overlay: invariant-mean applied" in log and "batch_invariant.py:910" in log
    assert res["counters"] == store.read_meta(h200, "k3_kv-fp8_dkv-auto_tp1_raw")["counters"]
    assert res["counters"]["accepted_per_pos"] == [271, 232, 193]

    got, _ = _outputs(H100_INVARIANT_026, point)
    assert len(got) == 16
    for pt in ("k0_kv-fp8_tp1_raw", "k0_kv-fp8_tp1_raw_x03f412a9", "k3_kv-fp8_dkv-auto_tp1_raw"):
        assert got == _outputs(H200_PARITY, pt)[0], pt
    biased, _ = _outputs(H200_PARITY, "k3_kv-fp8_dkv-auto_tp1_raw_x2b8b0634")  # 0.5 nats
    assert all(a != b for a, b in zip(got, biased))
