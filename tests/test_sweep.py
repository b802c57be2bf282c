"""Sweeps on a real vLLM CPU engine: resume after an interrupted run (nothing recomputed,
nothing lost), failures recorded while the sweep goes on, per-request counters that add up to
the engine's own."""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from speclab import store, sweep
from speclab.profiles import REPO, load

pytestmark = pytest.mark.vllm

SCRIPT = """
import sys
from speclab import profiles, sweep
from speclab.profiles import Point
prof = profiles.load(sys.argv[1])
pts = sweep.expand(prof) + [Point(k=0, engine={"max_model_len": 10 ** 9})]
sweep.run(prof, sys.argv[2], pts, retry_failed=sys.argv[3] == "retry")
"""


@pytest.fixture()
def rig_profile(tmp_path, fixture_cache) -> Path:
    p = tmp_path / "rig.yaml"
    p.write_text(yaml.safe_dump({
        "name": "rig-test", "backend": "cpu", "target": "fixture:rig-llama",
        "draft": "fixture:rig-llama-eagle3",
        "prompts": {"file": str(REPO / "data/prompts/tiny-code.jsonl"), "limit": 3},
        "max_tokens": 12, "grid": {"num_speculative_tokens": [0, 3]},  # one spec point: ~35 s
        "engine": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256,
                   "kv_cache_memory_bytes": 64 << 20},
        "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "timeout_s": 300, "timed_passes": 2}))
    return p


def _run(profile: Path, run_dir: Path, mode: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(profile), str(run_dir), mode],
                            env=env, start_new_session=True)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_interrupted_sweep_resumes_without_recomputing(rig_profile, tmp_path, fixture_cache):
    env = {**os.environ, "SPECLAB_CACHE": str(fixture_cache.parent)}
    run_dir = tmp_path / "run"
    proc = _run(rig_profile, run_dir, "retry", env)
    first = run_dir / "results" / "k0_kv-auto_tp1_raw.json"
    deadline = time.time() + 600
    while not first.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    assert first.exists(), "first point never finished"
    os.killpg(proc.pid, 15)  # interrupt mid-sweep (the second point's worker is running)
    proc.wait(timeout=60)
    done = {p.name: (_digest(p), p.stat().st_mtime_ns) for p in (run_dir / "points").glob("k*")}
    first_metas = {p.name: json.loads(p.read_text()) for p in (run_dir / "results").glob("k*.json")}
    assert "k0_kv-auto_tp1_raw.parquet" in done
    assert not list((run_dir / "points").glob(".*.parquet.*")), "partial file left behind"

    assert _run(rig_profile, run_dir, "retry", env).wait(timeout=900) == 0
    prof = load(rig_profile)
    for name, (digest, mtime) in done.items():  # nothing recomputed
        p = run_dir / "points" / name
        if p.suffix == ".parquet":
            assert (_digest(p), p.stat().st_mtime_ns) == (digest, mtime), name
    for name, meta in first_metas.items():  # the timing round only added its pass
        now = json.loads((run_dir / "results" / name).read_text())
        assert now["passes"][0] == meta["passes"][0] and now["started_at"] == meta["started_at"]
    metas = {m["point_id"]: m for m in
             map(json.loads, map(Path.read_text, (run_dir / "results").glob("[!.]*.json")))}
    ids = [p.id for p in sweep.expand(prof)]
    assert all(metas[i]["status"] == "ok" for i in ids)
    # two timed rounds each, the sampling settings and fingerprint recorded
    assert all([p["round"] for p in metas[i]["passes"]] == [1, 2] for i in ids)
    assert all(metas[i]["sampling"]["max_tokens"] == 12 for i in ids)
    assert len({metas[i]["fingerprint"]["digest"] for i in ids}) == len(ids)
    bad = [m for m in metas.values() if m["status"] == "error"]
    assert len(bad) == 1 and "max_model_len" in bad[0]["error"] + bad[0].get("log_tail", "")

    # per-request counters add up to the engine's; the rig accepts exactly position 0
    pts, recs = store.load_results(run_dir)
    for pid in ids[1:]:
        m = metas[pid]
        k = m["point"]["k"]
        c = m["counters"]
        assert c["accepted_per_pos"] == [c["num_drafts"]] + [0] * (k - 1)
        # vLLM's own per-request counters add up to the engine's; the engine steps, which
        # miss every request's last round (cut at max_tokens), account for the rest
        assert m["attribution_source"] == "native" and m["attribution"] == "exact", pid
        assert m["cross_check"]["attribution"] == "consistent", pid
        r = recs[recs.point_id == pid]
        assert int(r.drafts.sum()) == c["num_drafts"]
        assert m["counters_from_steps"]["num_drafts"] == c["num_drafts"] - len(r)
    plain = recs[recs.point_id == ids[0]].set_index("prompt_id").output_token_ids
    for pid in ids[1:]:
        spec = recs[recs.point_id == pid].set_index("prompt_id").output_token_ids
        assert all(list(plain[i]) == list(spec[i]) for i in plain.index)

    # failed points are retried only on request; finished ones never
    t0 = time.time()
    assert _run(rig_profile, run_dir, "no-retry", env).wait(timeout=300) == 0
    assert time.time() - t0 < 60, "a finished sweep re-ran points"
