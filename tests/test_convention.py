"""The aux-layer convention as a run setting: profile field and grid dimension, early
validation, the resolution each point records, and the side-by-side comparison."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from fake_requests import requests

from speclab import (
    convention,
    convention_compare,
    engine,
    explorer,
    parity,
    preflight,
    profiles,
    report,
    store,
    sweep,
)
from speclab.profiles import REPO, ProfileError

EAGLE31 = {"architectures": ["LlamaForCausalLMEagle3"],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 21, 40]}}
DSV4 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "num_hidden_layers": 43}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 4}


def model_dir(tmp_path, name, cfg):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def sub(tmp_path, name):
    (tmp_path / name).mkdir()
    return tmp_path / name


def write(tmp_path, target_cfg=DSV4, draft_cfg=EAGLE31, **data):
    base = {"name": "t", "backend": "cpu",
            "target": str(model_dir(tmp_path, "target", target_cfg)),
            "draft": str(model_dir(tmp_path, "draft", draft_cfg)),
            "prompts": {"file": str(REPO / "data/prompts/tiny-code.jsonl")}}
    p = tmp_path / "t.yaml"
    p.write_text(yaml.safe_dump({**base, **data}))
    return p


def test_values_are_the_overlays():
    assert convention.CONVENTIONS == tuple(convention.aux_module().CONVENTIONS)
    assert convention.ENV == convention.aux_module().CONVENTION_ENV


@pytest.mark.parametrize("data, message", [
    ({"aux_layer_convention": "after"}, "aux_layer_convention"),
    ({"grid": {"aux_layer_convention": ["output", "sglang"]}}, "grid.aux_layer_convention"),
    ({"grid": {"aux_layer_convention": ["output", "output"]}}, "distinct"),
    ({"grid": {"aux_layer_convention": []}}, "distinct"),
    ({"aux_layer_convention": "input", "grid": {"aux_layer_convention": ["output"]}},
     "both at the top level and in grid"),
    ({"aux_layer_convention": "input", "env": {convention.ENV: "output"}}, "keep aux_layer"),
])
def test_bad_settings_fail_at_load(tmp_path, data, message):
    with pytest.raises(ProfileError, match=message) as e:
        profiles.load(write(tmp_path, **data))
    assert "Traceback" not in str(e.value)


def test_grid_dimension_gives_one_point_per_convention(tmp_path):
    prof = profiles.load(write(tmp_path, grid={"num_speculative_tokens": [0, 3],
                                               "aux_layer_convention": ["output", "input"]}))
    points = sweep.expand(prof)
    assert [p.id for p in points] == ["k0_kv-auto_tp1_raw",
                                      "k3_kv-auto_dkv-auto_aux-output_tp1_raw",
                                      "k3_kv-auto_dkv-auto_aux-input_tp1_raw"]
    envs = [engine.engine_args(prof, p, "t", "d")[1].get(convention.ENV) for p in points]
    assert envs == [None, "output", "input"]
    # the explorer keeps them apart
    assert [explorer.variant({"point": p.model_dump(mode="json")}) for p in points] == [
        "grid", "aux-output", "aux-input"]
    # each speculative point is compared with the one plain point
    assert {a.ref.id for a in parity.versus_plain(points)} == {"k0_kv-auto_tp1_raw"}


def test_absent_means_resolved_and_ids_unchanged(tmp_path):
    prof = profiles.load(write(tmp_path, grid={"num_speculative_tokens": [3]}))
    (p,) = sweep.expand(prof)
    assert p.id == "k3_kv-auto_dkv-auto_tp1_raw" and p.aux_layer_convention is None
    assert convention.ENV not in engine.engine_args(prof, p, "t", "d")[1]


def test_top_level_field_reaches_every_point_parity_arms_included(tmp_path):
    prof = profiles.load(write(tmp_path, aux_layer_convention="input",
                               grid={"num_speculative_tokens": [0, 2]}))
    assert [p.aux_layer_convention for p in sweep.expand(prof)] == [None, "input"]
    arms = parity.plan(prof, ["spec"], k_values=[2])
    spec = arms[0].cand
    assert spec.aux_layer_convention is None  # built from the plain point...
    assert engine.engine_args(prof, spec, "t", "d")[1][convention.ENV] == "input"  # ...still set


def test_resolution_of_the_published_shape():
    r = convention.resolution(EAGLE31, DSV4, env={})
    assert (r["convention"], r["capture_after_layers"]) == ("output", [2, 22, 41])
    assert r["applied"] and r["effective_capture_after_layers"] == [2, 22, 41]
    assert r["target"] == "DeepseekV4ForCausalLM"
    r = convention.resolution(EAGLE31, DSV4, env={convention.ENV: "input"})
    assert (r["source"], r["effective_capture_after_layers"]) == ("env", [1, 21, 40])
    # without the overlay vLLM reads the ids itself (input): what it captures is recorded
    r = convention.resolution(EAGLE31, DSV4, env={}, loaded=False)
    assert not r["applied"] and r["effective_capture_after_layers"] == [1, 21, 40]
    assert "not loaded" in r["effect"]


def test_llama_targets_are_not_mapped():
    r = convention.resolution({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, LLAMA,
                              env={convention.ENV: "output"})
    assert r["convention"] == "output" and not r["applied"]
    assert r["effective_capture_after_layers"] == [1, 2, 4]  # vLLM's input reading
    assert r["effect"].startswith("none:")


def test_out_of_range_capture_is_a_clear_error_before_any_model_loads(tmp_path):
    draft = {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}
    small = {**DSV4, "num_hidden_layers": 4}
    ok = profiles.load(write(tmp_path, small, draft, aux_layer_convention="input"))
    assert convention.env_problems(ok, env={}) == []
    bad = profiles.load(write(sub(tmp_path, "x"),
                              small, draft, grid={"aux_layer_convention": ["output", "input"]}))
    problems = preflight.check_env(bad)
    assert any(p.startswith("aux_layer_convention=output:") and "[5] not in 1..4" in p
               for p in problems), problems
    assert not any("aux_layer_convention=input" in p for p in problems)
    # the environment's own setting counts where the profile sets none
    plain = profiles.load(write(sub(tmp_path, "y"),
                                small, draft))
    assert convention.env_problems(plain, env={}) != []  # first id 1: output: [2, 3, 5]
    assert convention.env_problems(plain, env={convention.ENV: "input"}) == []
    # a Llama target reads the ids itself: nothing to check
    llama = profiles.load(write(sub(tmp_path, "z"),
                                LLAMA, draft, aux_layer_convention="output"))
    assert convention.env_problems(llama, env={}) == []


def test_worker_records_the_resolution_and_fails_before_loading(tmp_path):
    """A worker resolves with the point's environment before vLLM builds anything: an
    out-of-range capture is the point's error, with no engine started."""
    small = {**DSV4, "num_hidden_layers": 4}
    prof = profiles.load(write(tmp_path, small, {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]},
                               grid={"num_speculative_tokens": [3],
                                     "aux_layer_convention": ["output"]}))
    (point,) = sweep.expand(prof)
    run_dir = tmp_path / "run"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"profile": prof.model_dump(mode="json"),
                                "point": point.model_dump(mode="json"), "run_dir": str(run_dir)}))
    env = engine.engine_args(prof, point, "t", "d")[1]
    done = subprocess.run([sys.executable, "-m", "speclab.worker", str(spec)], text=True,
                          capture_output=True, check=False, env={**os.environ, **env},
                          timeout=300)
    meta = store.read_meta(run_dir, point.id)
    assert done.returncode == 1 and meta["status"] == "error"
    assert "[5] not in 1..4" in meta["error"] and "engine_init_s" not in meta["timings"]
    assert meta["engine_args"]["speculative_config"]["num_speculative_tokens"] == 3  # kept


# --------------------------------------------------------------------------- results
def fake_run(tmp_path, rates: dict[str, list[float]], applied=True, n=40, k=3, seed=0):
    """A run folder whose points accept position i of each draft with the given rates."""
    rng = np.random.default_rng(seed)
    run = tmp_path / "run"
    for conv, p in rates.items():
        pid = f"k{k}_kv-auto_dkv-auto_aux-{conv}_tp1_raw"
        res = convention.resolution(EAGLE31, DSV4, env={convention.ENV: conv}, loaded=applied)
        rows = []
        for r in range(n):
            acc = rng.random((20, k)) < np.array(p)
            app = np.cumprod(acc, axis=1).sum(axis=0)
            rows.append({"point_id": pid, "k": k, "kv_cache_dtype": "auto",
                         "draft_kv_cache_dtype": "auto", "layout": "tp1", "prompt_format": "raw",
                         "repeat": 0, "concurrency": n, "drafts": 20,
                         "accepted_per_pos": list(app), "prompt_id": f"p{r}"})
        store.write_point(run, store.PointResult(
            point_id=pid, status="ok", aux_convention=res,
            point={"k": k, "aux_layer_convention": conv}), requests(rows))
    return run


def test_side_by_side_names_the_winner(tmp_path):
    run = fake_run(tmp_path, {"output": [0.6, 0.6, 0.6], "input": [0.1, 0.5, 0.5]})
    table = convention_compare.by_convention(*store.load_results(run), n_boot=200)
    assert set(table.convention) == {"output", "input"} and len(table) == 6
    assert {"u_lo", "u_hi", "c_lo", "c_hi", "effective_capture_after_layers"} <= set(table)
    out = table[(table.convention == "output") & (table.position == 0)].iloc[0]
    assert out.effective_capture_after_layers == [2, 22, 41]
    found = convention_compare.findings(table)
    assert found["winner"] == "output" and "`output`" in found["text"]
    assert convention_compare.plot(table).axes


def test_overlapping_cis_are_no_clear_winner(tmp_path):
    run = fake_run(tmp_path, {"output": [0.5, 0.5, 0.5], "input": [0.5, 0.5, 0.5]})
    found = convention_compare.findings(
        convention_compare.by_convention(*store.load_results(run), n_boot=200))
    assert found["winner"] is None and found["text"].startswith("no clear winner")


def test_not_applied_never_names_a_winner(tmp_path):
    run = fake_run(tmp_path, {"output": [0.6, 0.6, 0.6], "input": [0.1, 0.1, 0.1]},
                   applied=False)
    found = convention_compare.findings(
        convention_compare.by_convention(*store.load_results(run), n_boot=200))
    assert found["winner"] is None and "not applied" in found["text"]


def test_one_convention_has_nothing_to_compare(tmp_path):
    run = fake_run(tmp_path, {"output": [0.6, 0.6, 0.6]})
    found = convention_compare.findings(
        convention_compare.by_convention(*store.load_results(run), n_boot=200))
    assert found["winner"] is None and "nothing to compare" in found["text"]


def test_footer_records_every_resolution(tmp_path):
    run = fake_run(tmp_path, {"output": [0.6] * 3, "input": [0.1] * 3})
    summary = convention.run_summary(store.point_metas(run))
    assert sorted(s["convention"] for s in summary) == ["input", "output"]
    prov = {"versions": {}, "date": "d", "command": "c", "git_commit": "g", "git_dirty": False,
            "cpu_count": 1, "wall_s": 1, "notebook_wall_s": {}, "input_sha256": {},
            "aux_convention": summary}
    html = report.footer_html(prov)
    assert "aux-layer convention (1 points)" in html
    assert "capture after [2, 22, 41] layers" in html and "capture after [1, 21, 40]" in html


@pytest.mark.vllm
def test_cpu_engine_records_the_convention_it_cannot_apply(tmp_path, fixture_cache):
    """The grid dimension end to end on vLLM's CPU engine with the Llama rig: each point
    records and logs its resolution; vLLM reads a Llama target's ids itself, so both
    conventions capture the same layers, count the same, and no winner is named."""
    p = tmp_path / "rig.yaml"
    p.write_text(yaml.safe_dump({
        "name": "rig-conv", "backend": "cpu", "target": "fixture:rig-llama",
        "draft": "fixture:rig-llama-eagle3",
        "prompts": {"file": str(REPO / "data/prompts/tiny-code.jsonl"), "limit": 3},
        "max_tokens": 12, "grid": {"num_speculative_tokens": [2],
                                   "aux_layer_convention": ["output", "input"]},
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                   "kv_cache_memory_bytes": 64 << 20},
        "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "timeout_s": 300,
        "timed_passes": 1}))  # counters, not speed: no timing rounds (tests/test_sweep.py)
    os.environ["SPECLAB_CACHE"] = str(fixture_cache.parent)
    prof = profiles.load(p)
    run = tmp_path / "run"
    metas = sweep.run(prof, run)
    assert [m["status"] for m in metas] == ["ok", "ok"], [m.get("error") for m in metas]
    for m in metas:
        res = m["aux_convention"]
        assert res["convention"] == m["point"]["aux_layer_convention"]
        assert res["source"] == "env" and res["applied"] is False
        assert res["effective_capture_after_layers"] == res["config_ids"]
        log = (run / "logs" / f"{m['point_id']}.log").read_text()
        assert convention.log_line(res) in log
    assert metas[0]["counters"] == metas[1]["counters"]
    found = convention_compare.findings(
        convention_compare.by_convention(*store.load_results(run), n_boot=100))
    assert found["winner"] is None and "not applied" in found["text"]


def test_the_layer_rigs_expectations_name_output_the_winner(tmp_path):
    """tiny-dsv4-convention-check: the rig's committed CPU-reference counters for the two
    conventions (arms positive and neg-input), per prompt, must make `output` the winner; the
    resolution of each grid point is the arm's capture."""
    expected = json.loads((REPO / "data/expected/layer-rig-dsv4-k3.json").read_text())
    prof = profiles.load("tiny-dsv4-convention-check")
    assert prof.grid.aux_layer_convention == ["output", "input"]
    draft = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    target = {"model_type": "deepseek_v4", "num_hidden_layers": 4}
    run = tmp_path / "run"
    for point, arm in zip(sweep.expand(prof), ("positive", "neg-input")):
        exp = expected["arms"][arm]
        res = convention.resolution(draft, target, env=convention.point_env(prof, point))
        assert res["convention"] == exp["convention"] == point.aux_layer_convention
        assert res["effective_capture_after_layers"] == exp["capture_after_layers"]
        rows = [{"point_id": point.id, "k": point.k, "kv_cache_dtype": "fp8",
                 "draft_kv_cache_dtype": "auto", "layout": "tp1", "prompt_format": "raw",
                 "repeat": 0, "prompt_id": pid, "drafts": c["num_drafts"],
                 "accepted_per_pos": c["accepted_per_pos"]}
                for pid, c in zip(expected["prompt_ids"], exp["counters"]["per_prompt"])]
        store.write_point(run, store.PointResult(
            point_id=point.id, status="ok", aux_convention=res,
            point=point.model_dump(mode="json")), requests(rows))
    table = convention_compare.by_convention(*store.load_results(run), n_boot=200)
    first = table[table.position == 0].set_index("convention").unconditional
    assert first["output"] == 1.0 and first["input"] == 0.0
    assert convention_compare.findings(table)["winner"] == "output"
