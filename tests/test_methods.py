"""Speculative methods as a grid axis (speclab.methods), their engine arguments, memory and
the vLLM releases that serve them; revisions (speclab.revisions)."""

import json
from pathlib import Path

import pytest
from profile_files import write

from speclab import engine, fingerprint, memory, methods, metrics, profiles, revisions, store
from speclab.profiles import ProfileError

REPO = Path(__file__).resolve().parents[1]


def test_methods_share_one_plain_point_and_only_eagle3_has_draft_settings(tmp_path):
    prof = profiles.load(write(tmp_path, grid={
        "method": ["eagle3", "mtp", "ngram"], "num_speculative_tokens": [0, 1, 2],
        "draft_kv_cache_dtype": ["auto", "fp8"], "k_by_method": {"mtp": [1]}}))
    ids = [p.id for p in profiles.expand(prof)]
    assert ids == ["k0_kv-auto_tp1_raw",
                   "k1_kv-auto_dkv-auto_tp1_raw", "k1_kv-auto_dkv-fp8_tp1_raw",
                   "k2_kv-auto_dkv-auto_tp1_raw", "k2_kv-auto_dkv-fp8_tp1_raw",
                   "k1_mtp_kv-auto_tp1_raw", "k1_ngram_kv-auto_tp1_raw", "k2_ngram_kv-auto_tp1_raw"]
    plain = profiles.expand(prof)[0]
    assert plain.method is None and methods.of(plain) is None


@pytest.mark.parametrize("data, message", [
    ({"method": "ngram"}, "draft: method(s) ngram load no draft model"),
    ({"draft": None, "grid": {"method": ["mtp"], "draft_kv_cache_dtype": ["fp8"]}},
     "grid.draft_kv_cache_dtype: method(s) mtp load no draft model"),
    ({"draft": None, "method": "mtp", "draft_revision": "main"}, "draft_revision: method(s) mtp"),
    ({"ngram": {"prompt_lookup_min": 3}}, "ngram: set, but the methods (eagle3)"),
    ({"method": "mtp", "grid": {"method": ["mtp", "ngram"]}}, "method is set both"),
    ({"grid": {"method": ["ngram", "ngram"]}}, "grid.method: method: give distinct values"),
    ({"grid": {"k_by_method": {"mtp": [1]}}}, "mtp is not among the methods (eagle3)"),
    ({"ngram": {"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "grid": {"method": ["ngram"]},
      "draft": None}, "prompt_lookup_min must be <= prompt_lookup_max"),
    ({"grid": {"method": ["beam"]}}, "grid.method.0"),
])
def test_method_settings_a_method_cannot_use_are_refused(tmp_path, data, message):
    with pytest.raises(ProfileError) as e:
        profiles.load(write(tmp_path, **data))
    assert message in str(e.value)


def test_draft_free_methods_need_no_draft(tmp_path):
    prof = profiles.load(write(tmp_path, draft=None, grid={"method": ["mtp", "ngram"]}))
    assert {methods.of(p) for p in profiles.expand(prof)} == {None, "mtp", "ngram"}


def test_engine_arguments_per_method(tmp_path):
    prof = profiles.load(write(tmp_path, target_revision="abc1234", draft_revision="v2",
                               ngram={"prompt_lookup_min": 1, "prompt_lookup_max": 3},
                               grid={"method": ["eagle3", "mtp", "ngram"],
                                     "num_speculative_tokens": [2]}))
    got = {methods.of(p): engine.engine_args(prof, p, "T", "D", native_draft_kv=True)
           for p in profiles.expand(prof)}
    assert got["eagle3"][0]["speculative_config"] == {
        "method": "eagle3", "num_speculative_tokens": 2, "model": "D", "revision": "v2",
        "kv_cache_dtype": "auto"}
    assert got["mtp"][0]["speculative_config"] == {
        "method": "mtp", "num_speculative_tokens": 2, "revision": "abc1234"}
    assert got["ngram"][0]["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}
    assert all(args["revision"] == "abc1234" for args, _ in got.values())
    assert engine.DRAFT_KV_ENV in got["eagle3"][1]
    assert engine.DRAFT_KV_ENV not in got["mtp"][1] and engine.DRAFT_KV_ENV not in got["ngram"][1]


def test_ngram_settings_are_in_the_fingerprint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    prof = profiles.load(write(tmp_path, draft=None, grid={"method": ["ngram"],
                                                           "num_speculative_tokens": [3]}))
    point = profiles.expand(prof)[0]
    other = prof.model_copy(update={"ngram": profiles.Ngram(prompt_lookup_max=4)})
    a, b = fingerprint.of_point(prof, point), fingerprint.of_point(other, point)
    assert a["digest"] != b["digest"]
    assert "prompt_lookup_max 5 -> 4" in fingerprint.diff(a, b)
    assert methods.settings(other, point) == {"name": "ngram", "prompt_lookup_min": 2,
                                              "prompt_lookup_max": 4}


@pytest.mark.vllm
def test_eagle3_points_measured_before_methods_keep_their_fingerprint():
    """The committed tiny-cpu run's eagle3 points keep their ids, models and engine
    arguments under the method axis; the one deliberate change is vLLM's own per-request
    counters (`engine.REQUEST_METRICS`, asked of every speculative point where the installed
    vLLM has them), so such points are measured again, and only for that reason."""
    run = REPO / "data" / "runs" / "tiny-cpu"
    prof = store.load_profile(run)
    key, value = engine.REQUEST_METRICS
    for point in profiles.expand(prof):
        old = store.read_meta(run, point.id)["fingerprint"]["parts"]
        new = fingerprint.of_point(prof, point)["parts"]
        args = dict(new["engine_args"])
        assert args.pop(key, None) == (value if point.k else None)
        assert key not in old["engine_args"]
        assert (args, new["models"]) == (old["engine_args"], old["models"])


def test_installed_vllm_serves_all_three_methods_on_deepseek_v4():
    assert [methods.vllm_serves(m, "deepseek_v4") for m in methods.METHODS] == [None] * 3


def test_a_vllm_without_deepseek_v4_mtp_is_named(tmp_path):
    root = tmp_path / "vllm"
    (root / "config").mkdir(parents=True)
    (root / "model_executor" / "models").mkdir(parents=True)
    (root / "config" / "speculative.py").write_text('M = Literal[\n    "mtp",\n    "ngram",\n]')
    (root / "model_executor" / "models" / "registry.py").write_text("{}")
    assert "no DeepSeek-V4 MTP model" in methods.vllm_serves("mtp", "deepseek_v4", root)
    assert methods.vllm_serves("mtp", "qwen3_next", root) is None  # control: another target
    assert "not a speculative method" in methods.vllm_serves("eagle3", "llama", root)


def test_mtp_needs_mtp_layers_in_the_target(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4",
                                                      "num_nextn_predict_layers": 0}))
    prof = profiles.load(write(tmp_path, draft=None, method="mtp"))
    assert any("no MTP layers" in p for p in methods.env_problems(prof))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4",
                                                      "num_nextn_predict_layers": 1}))
    assert methods.env_problems(prof) == []


def test_memory_mtp_counts_the_mtp_layer_and_ngram_no_draft():
    prof = profiles.load("v4flash-methods")
    est = {methods.of(p): e for p, e in zip(profiles.expand(prof), memory.estimates(
        prof, profiles.expand(prof), "H200"))}
    assert est["ngram"].draft == 0.0 and est["eagle3"].draft > 0
    # one MXFP4 decoder layer (3.33 GiB measured) + e/h_proj; the head is the target's
    sharded, kept = memory.mtp_weight_bytes(memory.PUBLISHED["deepseek-ai/DeepSeek-V4-Flash"])
    assert (sharded + kept) / memory.GiB == pytest.approx(3.33 + 0.03, rel=0.03)
    assert est["mtp"].draft == pytest.approx(sharded / 8 + kept)
    assert est["mtp"].kv > est["ngram"].kv  # the MTP layer's own sliding-window cache


def test_per_request_counters_from_vllm_histogram():
    spec = {"acceptance_histogram": [3, 1, 0, 2], "num_spec_steps": 6, "num_draft_tokens": 17,
            "num_accepted_draft_tokens": 7}
    c = metrics.native_counters(spec)
    assert c == metrics.SpecCounters(6, 17, 7, (3, 2, 2))
    assert c.mean_acceptance_length == pytest.approx(1 + 7 / 6)


# --------------------------------------------------------------------- revisions
def hub_cache(root: Path, repo: str, commit: str, files: dict[str, str]) -> None:
    base = root / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    for name, text in files.items():
        (snap / name).write_text(text)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


TARGET_SHA = "60d8d707" + "0" * 32


@pytest.mark.parametrize("named, warned", [("60d8d707", False), ("deadbeef", True)])
def test_a_draft_trained_on_another_target_revision_is_warned(tmp_path, hub, capsys, named,
                                                              warned):
    hub_cache(hub, "org/target", TARGET_SHA, {"config.json": "{}"})
    hub_cache(hub, "org/draft", "1" * 40, {
        "config.json": "{}", "README.md": f"---\nbase_model: org/target\n"
                                          f"{revisions.KEY}: {named}\n---\n# card\n"})
    (tmp_path / "p.jsonl").write_text("")
    path = write(tmp_path, target="org/target", draft="org/draft")
    prof = profiles.load(path)
    assert revisions.trained_against("org/draft") == named
    assert revisions.loaded("org/target", None) == TARGET_SHA
    from speclab import cli

    cli.main(["profile", "check", str(path)])
    out = capsys.readouterr().out
    assert ("warning: Revision: the draft org/draft names target revision deadbeef" in out) \
        == warned
    assert (revisions.mismatch(prof) is not None) == warned
    point = profiles.expand(prof)[1]
    assert revisions.record(prof, point)["draft"]["trained_against"] == named


def test_revision_from_config_json_and_a_pinned_target(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({revisions.KEY: "abcdef12"}))
    (tmp_path / "README.md").write_text("# no front matter\n")
    assert revisions.trained_against(str(tmp_path)) == "abcdef12"
    prof = profiles.load(write(tmp_path, target="org/absent", target_revision="0123456789"))
    assert revisions.loaded("org/absent", "0123456789") == "0123456789"  # not cached: the pin
    assert "loads 0123456789" in revisions.mismatch(prof)
    assert revisions.same("abcdef12", "ABCDEF12" + "9" * 32)
    assert not revisions.same("main", "v1") and not revisions.same("abc", "abcdef")


# --------------------------------------------------------------------- the run's tables
def fake_run(run_dir: Path, trained_against: str) -> None:
    """A run folder with a plain point, eagle3 and ngram at k = 2 (4 requests each, two
    timing rounds): plain 100/110 tok/s, eagle3 2x, ngram 1.2x; eagle3 drafts at all 2
    decode steps (3 tokens each), ngram at 2 of 4 (6 tokens in 4 steps)."""
    from speclab.profiles import Point

    for point, tok_s, app, steps, drafts in (
            (Point(k=0, method=None), 100, [], [1, 1, 1, 1, 1, 1, 1], 0),
            (Point(k=2, draft_kv_cache_dtype="auto"), 200, [2, 2], [1, 3, 3], 2),
            (Point(k=2, method="ngram"), 120, [2, 2], [1, 1, 3, 1, 1], 2)):
        m = methods.of(point)
        recs = [store.RequestRecord(
            point_id=point.id, k=point.k, kv_cache_dtype="auto",
            draft_kv_cache_dtype=point.draft_kv_cache_dtype, layout="tp1", prompt_format="raw",
            repeat=0, concurrency=4, prompt_id=str(i), category="c", output_token_ids=[1, 2],
            n_output=2, step_tokens=steps, step_times=[0.1] * len(steps), drafts=drafts,
            draft_tokens=2 * drafts, accepted=sum(app),
            accepted_per_pos=app if i % 2 else [a // 2 for a in app]) for i in range(4)]
        models = {"target": {"ref": "org/t", "revision": None, "loaded": "b" * 40}}
        if m == "eagle3":
            models["draft"] = {"ref": "org/d", "revision": None, "loaded": "c" * 40,
                               "trained_against": trained_against}
        store.write_point(run_dir, store.PointResult(
            point_id=point.id, status="ok", point=point.model_dump(mode="json"), n_requests=4,
            output_tokens=8, throughput_tok_s=tok_s, models=models,
            method=None if m is None else {"name": m},
            attribution_source="native" if m == "ngram" else "stepped" if m else None,
            passes=[{"round": 1, "tok_s": tok_s}, {"round": 2, "tok_s": tok_s * 1.1}]), recs)


def test_methods_table_speedups_share_the_plain_point_and_best_is_named(tmp_path):
    fake_run(tmp_path, "b" * 8)
    pts, recs = store.load_results(tmp_path)
    from speclab import analysis

    t = analysis.methods_table(analysis.acceptance(recs, points=pts), analysis.speed(pts))
    assert list(zip(t.method, t.k)) == [("eagle3", 2), ("ngram", 2)]
    assert t.speedup.round(6).tolist() == [2.0, 1.2]
    assert all(len(pp) == 2 for pp in t.per_position)
    # the same AL over drafted steps; ngram gains fewer tokens per decode step
    assert t.mean_acceptance_length.tolist() == [2.5, 2.5]
    assert t.tokens_per_step.tolist() == [3.0, 1.5] and t.drafted_share.tolist() == [1.0, 0.5]
    assert analysis.best_per_concurrency(t, by="tokens_per_step").method.tolist() == ["eagle3"]
    best = analysis.best_per_concurrency(t)
    assert best[["method", "k"]].values.tolist() == [["eagle3", 2]]


@pytest.mark.parametrize("named, caveat", [("b" * 8, False), ("d" * 8, True)])
def test_a_revision_mismatch_is_the_reports_first_caveat(tmp_path, named, caveat):
    from speclab import summary

    fake_run(tmp_path, named)
    t = summary.table(tmp_path)
    assert t.set_index("point_id").method.fillna("-").to_dict() == {
        "k0_kv-auto_tp1_raw": "-", "k2_kv-auto_dkv-auto_tp1_raw": "eagle3",
        "k2_ngram_kv-auto_tp1_raw": "ngram"}
    assert t.tokens_per_step.round(6).fillna(0).tolist() == [0, 3.0, 1.5]
    assert "tok/step" in summary.display_table(t)
    first = (summary.caveats(t) or [""])[0]
    assert first.startswith("Revision: the draft was trained against target revision "
                            "dddddddd") == caveat


def test_explorer_slices_by_method_with_the_shared_plain_point(tmp_path):
    from speclab import explorer

    fake_run(tmp_path / "run", "b" * 8)
    points, records = explorer.load([tmp_path / "run"])
    assert explorer.options(records, ["run"])["method"] == ["eagle3", "ngram"]
    sl = explorer.Slice(("run",), 2, {"method": "ngram", "draft_kv_cache_dtype": "auto"})
    t = explorer.tables(points, records, sl, n_boot=50)
    assert t.acc.method.tolist() == ["ngram"]
    assert sorted(t.speed.k) == [0, 2]  # ngram with its plain baseline
