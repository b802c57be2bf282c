"""The run store: one schema for point files (every committed one validates) and one for
requests (every committed run reads with one parquet call), writes that leave nothing
half-written, profile.json set aside before it is replaced, older run folders migrated."""

import errno
import json
from pathlib import Path

import pandas as pd
import pytest
from fake_requests import request

from speclab import multipass, profiles, store
from speclab.profiles import REPO

COMMITTED = sorted((REPO / "data" / "runs").glob("*/results/[!.]*.json"))
RUNS = sorted({p.parents[1] for p in COMMITTED})


def _result(pid="k0_kv-auto_tp1_raw", **kw):
    return store.PointResult(**{"point_id": pid, "status": "ok", "point": {"k": 0},
                                "n_requests": 1, **kw})


def _request(pid="k0_kv-auto_tp1_raw", **kw):
    return request(pid, **{"prompt_len": 3, "output_token_ids": [5, 6], "n_output": 2,
                           "step_tokens": [1, 1], "step_times": [0.1, 0.2], **kw})


def test_every_committed_point_file_is_a_point_result():
    assert len(COMMITTED) > 100
    for path in COMMITTED:
        store.PointResult.model_validate_json(path.read_text())
        meta, problem = store.inspect_point(path.parents[1], path.stem, records=False)
        assert problem is None and meta["point_id"] == path.stem, path


def test_every_committed_run_reads_with_one_parquet_call():
    assert len(RUNS) > 20
    for run in RUNS:
        ok = [m for m in store.point_metas(run) if m["status"] == "ok"]
        if not ok:  # failed points only: no requests, no points/ in a clone
            continue
        every = pd.read_parquet(run / "points")
        assert list(every.columns) == store.REQUEST_ARROW.names, run
        assert len(every) == sum(m["n_requests"] for m in ok), run
        assert len(store.requests(run)) == len(every), run


def test_requests_are_typed_and_read_back(tmp_path):
    store.write_point(tmp_path, _result(n_requests=2),
                      [_request(), _request(prompt_id="p1", margin=[0.5, float("inf")])])
    store.write_point(tmp_path, _result("k1_kv-auto_tp1_raw", n_requests=1),
                      [_request("k1_kv-auto_tp1_raw", k=1, itl_s=[0.1])])
    every = pd.read_parquet(tmp_path / "points")
    assert sorted(every.prompt_id) == ["p0", "p0", "p1"]
    one = store.requests(tmp_path, "k0_kv-auto_tp1_raw")
    assert list(one.prompt_id) == ["p0", "p1"] and list(one.margin[1]) == [0.5, float("inf")]
    with pytest.raises(ValueError):
        _request(n_outputs=2)  # a typo
    with pytest.raises(ValueError):
        _request(step_tokens=["one"])


def test_a_run_folder_of_the_older_layout_is_named_then_migrated(tmp_path):
    (tmp_path / "points").mkdir()
    (tmp_path / "points" / "k0_kv-auto_tp1_raw.json").write_text(_result().model_dump_json())
    row = _request().model_dump(exclude={"schema_version", "itl_s", "margin", "runner_up"})
    pd.DataFrame([{**row, "draft_kv_cache_dtype": None}]).to_parquet(
        tmp_path / "points" / "k0_kv-auto_tp1_raw.parquet")
    with pytest.raises(store.LayoutError, match="migrate_runs"):
        store.load_results(tmp_path)
    assert store.migrate(tmp_path) == 2 and store.migrate(tmp_path) == 0
    pts, recs = store.load_results(tmp_path)
    assert list(pts.status) == ["ok"] and recs.to_dict("records")[0]["output_token_ids"].tolist() \
        == [5, 6]
    assert list(pd.read_parquet(tmp_path / "points").columns) == store.REQUEST_ARROW.names


def test_a_point_file_outside_the_schema_is_damaged_and_named(tmp_path):
    store.write_point(tmp_path, _result(), [_request()])
    path = store.point_paths(tmp_path, "k0_kv-auto_tp1_raw")[1]
    written = json.loads(path.read_text())
    assert written["schema_version"] == store.SCHEMA_VERSION and "error" not in written
    path.write_text(json.dumps({**written, "status": "done"}))
    meta, problem = store.inspect_point(tmp_path, "k0_kv-auto_tp1_raw")
    assert meta is None and str(path) in problem and "status" in problem
    with pytest.warns(UserWarning, match="left out"):
        assert store.load_results(tmp_path)[0].empty
    with pytest.raises(ValueError):
        store.PointResult(point_id="x", status="ok", point={}, n_request=3)  # a typo


@pytest.mark.parametrize("fail", ["records", "metadata"])
def test_a_full_disk_leaves_the_old_result_and_no_temp_file(tmp_path, monkeypatch, fail):
    store.write_point(tmp_path, _result(wall_s=1.0), [_request()])
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*/*")}

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.pq, "write_table", full) if fail == "records" else \
        monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(OSError, match="No space"):
        store.write_point(tmp_path, _result(wall_s=2.0), [_request(prompt_id="p1")])
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*/*")} == before


def test_multipass_sets_a_changed_profile_aside(tmp_path):
    old = profiles.load("tiny-cpu")
    store.save_profile(old, tmp_path, "t0")
    new = profiles.load("tiny-cpu", {"max_tokens": old.max_tokens + 1})
    multipass.run_groups(new, tmp_path, [])
    assert store.load_profile(tmp_path).max_tokens == new.max_tokens
    (kept,) = (tmp_path / "superseded").glob("*/profile.json")
    assert json.loads(kept.read_text())["max_tokens"] == old.max_tokens


def test_results_set_aside_within_one_second_are_all_kept(tmp_path):
    """Two sweeps in the same second (forked workers take well under one) set aside under
    the same time stamp: neither overwrites the other."""
    for wall in (1.0, 2.0):
        store.write_point(tmp_path, _result(wall_s=wall), [_request()])
        store.set_aside(tmp_path, "k0_kv-auto_tp1_raw", "t0")
    kept = sorted((tmp_path / "superseded").glob("*/k0_kv-auto_tp1_raw.json"))
    assert [p.parent.name for p in kept] == ["t0", "t0-2"]
    assert {json.loads(p.read_text())["wall_s"] for p in kept} == {1.0, 2.0}
    old = profiles.load("tiny-cpu")
    for n in (1, 2, 3):
        store.save_profile(profiles.load("tiny-cpu", {"max_tokens": old.max_tokens + n}),
                           tmp_path, "t0")
    assert len(list((tmp_path / "superseded").glob("*/profile.json"))) == 2
