"""The run store: one schema for point files (every committed one validates), writes that
leave nothing half-written, profile.json set aside before it is replaced."""

import errno
import json
from pathlib import Path

import pandas as pd
import pytest

from speclab import multipass, profiles, store
from speclab.profiles import REPO

COMMITTED = sorted((REPO / "data" / "runs").glob("*/points/[!.]*.json"))


def _result(pid="k0_kv-auto_tp1_raw", **kw):
    return store.PointResult(point_id=pid, status="ok", point={"k": 0}, n_requests=1, **kw)


def test_every_committed_point_file_is_a_point_result():
    assert len(COMMITTED) > 100
    for path in COMMITTED:
        store.PointResult.model_validate_json(path.read_text())
        meta, problem = store.inspect_point(path.parents[1], path.stem, records=False)
        assert problem is None and meta["point_id"] == path.stem, path


def test_a_point_file_outside_the_schema_is_damaged_and_named(tmp_path):
    store.write_point(tmp_path, _result(), pd.DataFrame({"x": [1]}))
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
    store.write_point(tmp_path, _result(wall_s=1.0), pd.DataFrame({"x": [1]}))
    before = {p.name: p.read_bytes() for p in (tmp_path / "points").iterdir()}

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", full) if fail == "records" else \
        monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(OSError, match="No space"):
        store.write_point(tmp_path, _result(wall_s=2.0), pd.DataFrame({"x": [2]}))
    assert {p.name: p.read_bytes() for p in (tmp_path / "points").iterdir()} == before


def test_multipass_sets_a_changed_profile_aside(tmp_path):
    old = profiles.load("tiny-cpu")
    store.save_profile(old, tmp_path, "t0")
    new = profiles.load("tiny-cpu", {"max_tokens": old.max_tokens + 1})
    multipass.run_groups(new, tmp_path, [])
    assert store.load_profile(tmp_path).max_tokens == new.max_tokens
    (kept,) = (tmp_path / "superseded").glob("*/profile.json")
    assert json.loads(kept.read_text())["max_tokens"] == old.max_tokens
