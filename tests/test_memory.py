"""Memory estimates per point (speclab.memory): checked against what vLLM 0.26 reported on
the H200 and against the GB10 case that nobody had compared with the memory."""

import json
import re
from pathlib import Path

import pytest

from speclab import cli, launch, memory, profiles, store, sweep
from speclab.fixtures import dsv4_layer_rig
from speclab.fixtures import dsv4_shapes as SH

V4 = memory.PUBLISHED["deepseek-ai/DeepSeek-V4-Flash"]
RUNS = Path(__file__).resolve().parents[1] / "data/runs"


def loaded_gib(cfg: dict, tp: int = 1, batched: int = 4096) -> float:
    """per_gpu's GiB; 4096 batched tokens as in every run below but the layer rig's."""
    return memory.per_gpu(memory.Files(config=cfg, source="test"), tp, batched)[0] / memory.GiB


def checkpoint(tmp_path, total_size: float | None, layers: int = 43):
    """A checkpoint folder with V4-Flash's config and (optionally) a safetensors index."""
    (tmp_path / "config.json").write_text(json.dumps({**V4, "num_hidden_layers": layers}))
    if total_size is not None:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total_size}, "weight_map": {}}))
    return str(tmp_path)


def profile(target: str, tp: int = 1, **engine) -> profiles.Profile:
    return profiles.Profile.model_validate({
        "name": "t", "backend": "cuda", "target": target, "prompts": {"file": "x.jsonl"},
        "grid": {"num_speculative_tokens": [0], "kv_cache_dtype": ["fp8"],
                 "layout": [{"tp": tp, "ep": tp > 1}]},
        "engine": {"enforce_eager": True, "max_model_len": 8192, "max_num_seqs": 16, **engine}})


# Measured on one H200, vLLM 0.26.0, 2026-12-02 (the real-shape probe), DeepSeek-V4-Flash's
# shapes: "Model loading took" 15.45 GiB at 4 layers and 42.12 GiB at 12 with MXFP4 experts,
# 26.7 GiB at 4 layers with FP8 experts.
@pytest.mark.parametrize("layers,experts,measured", [(4, "fp4", 15.45), (12, "fp4", 42.12),
                                                     (4, "fp8", 26.7)])
def test_real_shape_weights_within_5_percent_of_vllm(layers, experts, measured):
    est = loaded_gib(SH.realshape_config(layers, experts))
    assert est == pytest.approx(measured, rel=0.05)


def test_real_shape_with_the_eagle31_draft_within_5_percent_of_vllm():
    """h200-realshape-20261203-vllm026 (4 layers, MXFP4 experts, 4096 batched tokens): every
    engine's "Model loading took" is 15.45 GiB without the EAGLE3.1-shaped draft and 16.26
    GiB with it (timing/ and diag/ engines.jsonl, log_facts)."""
    took: dict[bool, set] = {False: set(), True: set()}
    for path in (RUNS / "h200-realshape-20261203-vllm026").glob("*/engines.jsonl"):
        for e in map(json.loads, path.read_text().splitlines()):
            for f in e.get("log_facts", []):
                if m := re.search(r"Model loading took ([\d.]+) GiB", f):
                    assert e["layers"] == 4 and e["expert_dtype"] == "fp4"
                    took[e["k"] > 0].add(float(m.group(1)))
    assert took == {False: {15.45}, True: {16.26}}
    cfg = SH.realshape_config(4)
    assert loaded_gib(cfg) == pytest.approx(15.45, rel=0.05)
    assert loaded_gib(cfg) + loaded_gib(SH.realshape_draft_config(cfg)) == pytest.approx(
        16.26, rel=0.05)


def test_real_shape_mtp_engine_shares_the_targets_head():
    """h100-realshape-20261205-vllm026-smokemtp (4 layers, MXFP4): the MTP engine loaded 18.80
    GiB, the plain one 15.45; the MTP layer without a head of its own is within 1% of it, with
    one (the control: vLLM replaces it by the target's) 5% above."""
    took = {}
    for e in map(json.loads, (RUNS / "h100-realshape-20261205-vllm026-smokemtp"
                              / "engines.jsonl").read_text().splitlines()):
        for f in e.get("log_facts", []):
            if m := re.search(r"Model loading took ([\d.]+) GiB", f):
                took[e.get("method", "eagle3") if e["k"] else "plain"] = float(m.group(1))
    assert took["plain"] == 15.45 and took["mtp"] == 18.80
    cfg = SH.realshape_config(4, mtp=True)
    est = loaded_gib(SH.realshape_config(4)) + sum(memory.mtp_weight_bytes(cfg)) / memory.GiB
    head = cfg["vocab_size"] * cfg["hidden_size"] * 2 / memory.GiB
    assert est == pytest.approx(took["mtp"], rel=0.01)
    assert (est + head) / took["mtp"] - 1 > 0.04


def test_real_shape_per_layer_and_embeddings_as_measured():
    four, twelve = (loaded_gib(SH.realshape_config(n)) for n in (4, 12))
    per_layer = (twelve - four) / 8
    fp8 = (loaded_gib(SH.realshape_config(12, "fp8")) -
           loaded_gib(SH.realshape_config(4, "fp8"))) / 8
    empty = {**V4, "num_hidden_layers": 0}
    base = loaded_gib(empty) - memory.dsv4_load_bytes(empty, 4096) / memory.GiB
    assert per_layer == pytest.approx(3.33, rel=0.05) and fp8 == pytest.approx(6.2, rel=0.05)
    assert base == pytest.approx(1.97, rel=0.05)


def test_published_shapes_are_the_realshape_fixtures_at_43_layers():
    cfg = SH.realshape_config(43)
    assert memory.weight_bytes(V4) == pytest.approx(memory.weight_bytes(cfg), rel=1e-6)
    keys = ("hc_mult", "index_topk", "rope_theta", "compress_rope_theta")
    assert {k: V4[k] for k in keys} == {k: cfg[k] for k in keys}
    draft = memory.PUBLISHED["ManiacLabs/DeepSeek-V4-Flash-EAGLE3.1"]
    assert sum(memory.weight_bytes(draft)) == pytest.approx(
        sum(memory.weight_bytes(SH.realshape_draft_config(cfg))), rel=1e-3)


def test_tiny_dial_target_and_draft_within_5_percent_of_vllm():
    """dial-dsv4 (+ its draft) on the H200, vLLM 0.26.0 (data/runs/h200-dsv4-dial-20261202-
    vllm026/logs): "Model loading took" 0.41 GiB (k0) and 0.77 GiB (k3, target + draft)."""
    cfg = SH.dsv4_config()
    draft = SH.dsv4_eagle3_draft_config(cfg, intermediate_size=1024)
    assert loaded_gib(cfg) == pytest.approx(0.41, rel=0.05)
    assert loaded_gib(cfg) + loaded_gib(draft) == pytest.approx(0.77, rel=0.05)


@pytest.mark.parametrize("seqs,measured", [(8, 0.87), (4, 0.74)])
def test_layer_rig_target_and_draft_within_5_percent_of_vllm(seqs, measured):
    """layer-rig-dsv4 + its EAGLE3.1-shaped draft on the H200, vLLM 0.26.0, max_model_len 1024
    and no max_num_batched_tokens, so vLLM batches max_num_seqs x 1024 tokens: 8 sequences
    (the four h200-dsv4-layer-rig-20261201-vllm026-* runs, 8192 tokens) loaded 0.87 GiB, 4
    (h200-20261201-device/job-logs-v026/aux-check-rig-026.log, 4096) 0.74 GiB."""
    prof = profiles.load("tiny-dsv4-layer-rig")
    prof = prof.model_copy(update={"engine": {**prof.engine, "max_num_seqs": seqs}})
    cfg = dsv4_layer_rig.rig_config()
    files = {prof.target: memory.Files(config=cfg, source="test"),
             prof.draft: memory.Files(config=dsv4_layer_rig.draft_config(cfg), source="test")}
    est = memory.estimate(prof, profiles.expand(prof)[0], "H200", files)
    assert (est.weights + est.draft) / memory.GiB == pytest.approx(measured, rel=0.05)


def test_default_batched_tokens_are_vllms():
    """vLLM 0.26's LLM-class default: 16384 (>= 70 GiB GPUs) or 8192, at most seqs x len."""
    assert memory.batched_tokens({}, 8, 1024, big=True) == 8192
    assert memory.batched_tokens({}, 1024, 8192, big=True) == 16384
    assert memory.batched_tokens({}, 256, 8192, big=False) == 8192
    assert memory.batched_tokens({"max_num_batched_tokens": 4096}, 8, 1024, big=True) == 4096


def test_dsv4_kv_per_request_near_vllms_admission_count():
    """dial-dsv4, max_model_len 4096, 4096 batched tokens (cost-026.log): 40.78 GiB of KV held
    350.39 requests at full length, 119.2 MiB each; ours leaves out vLLM's padding of every
    group to one page size (within 10%)."""
    got = memory.kv_request_bytes(SH.dsv4_config(), "fp8", 4096, in_flight=4096)
    assert got / memory.MiB == pytest.approx(40.78 * 1024 / 350.39, rel=0.10)


def test_gb10_nvfp4_checkpoint_does_not_fit(tmp_path):
    """nvidia/DeepSeek-V4-Flash-NVFP4's index reports total_size 168.3 GB; a GB10 has 121 GB."""
    prof = profile(checkpoint(tmp_path, 168.3e9), gpu_memory_utilization=0.9)
    est, = memory.estimates(prof, profiles.expand(prof), "GB10")
    assert est.weights > 150 * memory.GiB and est.verdict == "does not fit"
    assert "does not fit by " in est.line() and "0.9 x GB10" in est.line()
    # the same index half the size would fit
    small = profile(checkpoint(tmp_path, 50e9), gpu_memory_utilization=0.9)
    assert memory.estimates(small, profiles.expand(small), "GB10")[0].verdict == "fits"


def test_v4_flash_on_8_h200_fits_at_16_sequences(tmp_path):
    prof = profile(checkpoint(tmp_path, None), tp=8, gpu_memory_utilization=0.6)
    est, = memory.estimates(prof, profiles.expand(prof), "H200")
    assert est.verdict == "fits", est.line()
    assert est.line().startswith("weights 20.0 ") and "KV at 8192 x 16 = " in est.line()
    assert est.line().endswith("of 83.9 GiB (0.6 x H200 139.8 GiB): fits")
    # one GPU cannot hold the 43 layers (145 GiB)
    one = profile(checkpoint(tmp_path, None), tp=1, gpu_memory_utilization=0.9)
    assert memory.estimates(one, profiles.expand(one), "H200")[0].verdict == "does not fit"


def test_every_shipped_profile_gets_an_estimate_per_point():
    for name in profiles.available():
        prof = profiles.load(name)
        points = profiles.expand(prof)
        ests = memory.estimates(prof, points, memory.gpu_for(prof))
        assert [e.point for e in ests] == [p.id for p in points]
        for e in ests:
            assert e.verdict != "does not fit", (name, e.line())
            if not prof.target.startswith("fixture:"):  # published shapes: numbers throughout
                assert e.verdict in ("fits", "short") and e.budget, (name, e.line())


def test_strict_check_fails_on_a_point_that_cannot_fit(tmp_path, capsys):
    path = tmp_path / "gb10.yaml"
    path.write_text(profile(checkpoint(tmp_path, 168.3e9)).model_dump_json())
    assert cli.main(["profile", "check", str(path), "--gpu", "GB10", "--strict"]) == 1
    out = capsys.readouterr().out
    assert "  memory k0_kv-fp8_tp1_raw: weights 157.6 GiB/GPU + draft 0.0 + KV at 8192 x 16" in out
    assert "not runnable here: k0_kv-fp8_tp1_raw: does not fit in memory" in out


def test_sweep_refuses_a_point_that_cannot_fit_before_starting_a_worker(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    prof = profile(checkpoint(tmp_path / "ckpt", 168.3e9), gpu_memory_utilization=0.9)
    monkeypatch.setattr(memory, "local_gpu", lambda: "GB10")
    monkeypatch.setattr(launch, "run_point", lambda *a, **k: pytest.fail("worker started"))
    meta, = sweep.run(prof, tmp_path / "run")
    assert meta["status"] == "error" and meta["error"].startswith("does not fit in memory: ")
    assert store.read_meta(tmp_path / "run", meta["point_id"])["error"] == meta["error"]


def test_a_short_kv_cache_is_said_but_not_refused():
    """v4flash-8xh200 at vLLM's default 1024 sequences: KV for fewer at full length; vLLM
    starts and runs fewer at once, so the sweep runs the point."""
    prof = profiles.load("v4flash-8xh200")
    point = profiles.expand(prof)[0]
    est, = memory.estimates(prof, [point], "H200")
    assert est.verdict == "short" and est.kv_seqs == 1024
    room = int(est.line().split("room for ")[1].split(" of 1024")[0])
    assert 0 < room < 1024 and est.budget >= est.need - (1024 - room) * est.kv_request
    assert memory.refusals(prof, [point], "H200") == {}
