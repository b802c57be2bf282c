"""tools/gpu/lab.py's bookkeeping across device calls (the GPU jobs themselves run on the device)."""
import importlib.util
import json
import os
import threading

import pytest

from speclab.profiles import REPO


@pytest.fixture
def lab(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("lab", REPO / "tools/gpu/lab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "REPO", tmp_path / "repo")
    monkeypatch.setattr(mod, "RUNS", tmp_path / "repo/data/runs")
    monkeypatch.setattr(mod, "STATE", tmp_path / "state")
    monkeypatch.setattr(mod, "JOBS", [{"runs": ["r1"]}])
    (tmp_path / "state").mkdir()
    return mod


def test_run_folders_come_back_in_the_next_call_on_the_same_machine(lab, tmp_path):
    point = lab.RUNS / "r1/points/k0.json"
    point.parent.mkdir(parents=True)
    point.write_text('{"status": "ok"}')
    out = tmp_path / "out"
    out.mkdir()
    lab.pack(out, {"jobs": {}}, threading.Lock())
    assert (out / "results.tar.gz").exists() and json.loads((out / "summary.json").read_text())
    # the device copies the working tree afresh: untracked run folders are gone
    point.unlink()
    lab.restore(None)
    assert json.loads(point.read_text()) == {"status": "ok"}


def test_restore_without_an_earlier_call_does_nothing(lab):
    lab.restore(None)
    assert not lab.RUNS.exists()


def test_setup_runs_once_per_machine(lab, monkeypatch):
    (lab.STATE / "setup.json").write_text('{"DSV4_COMPRESSOR": "triton"}')
    monkeypatch.delenv("DSV4_COMPRESSOR", raising=False)
    monkeypatch.setattr(lab.subprocess, "run", lambda *a, **k: pytest.fail("set-up ran again"))
    lab.setup(None)
    assert os.environ["DSV4_COMPRESSOR"] == "triton"
