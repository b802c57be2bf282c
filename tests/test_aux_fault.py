"""tools/gpu/aux_fault.py with a fake overlay module: the .pth it writes swaps the overlay's
`capture_aux` for stream 0 in a fresh interpreter, whether the overlay was imported before or
after the fault's .pth ran, and only when SPECLAB_AUX_FAULT asks for it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "gpu" / "aux_fault.py"
spec = importlib.util.spec_from_file_location("aux_fault", TOOL)
aux_fault = importlib.util.module_from_spec(spec)
spec.loader.exec_module(aux_fault)

FAKE = "def capture_aux(stream):\n    return stream.mean(axis=1)\n"
PROBE = ("import json, site, sys, numpy as np; site.addsitedir(sys.argv[1]);"
         "import deepseek_v4_eagle3_aux as m; s = np.arange(24.0).reshape(2, 4, 3);"
         "print(json.dumps({'out': m.capture_aux(s).tolist(),"
         " 'fault': getattr(m, '_speclab_aux_fault', None)}))")


def _site(tmp_path: Path, overlay_pth: bool, body: str = FAKE) -> Path:
    site = tmp_path / "site"
    (site / "fake_overlay").mkdir(parents=True)
    (site / "fake_overlay" / "deepseek_v4_eagle3_aux.py").write_text(body)
    # like the real overlay's .pth: a path line, then the import (sorted before the fault's)
    lines = "fake_overlay\n" + ("import deepseek_v4_eagle3_aux\n" if overlay_pth else "")
    (site / "speclab-dsv4-eagle3-overlay.pth").write_text(lines)
    aux_fault.write_pth(site)
    return site


def _run(site: Path, fault: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != aux_fault.FAULT_ENV}
    if fault is not None:
        env[aux_fault.FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-c", PROBE, str(site)], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("overlay_first", [True, False])
def test_stream0_fault_replaces_the_mean(tmp_path, overlay_first):
    site = _site(tmp_path, overlay_first)
    r = _run(site, "stream0")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"out": [[0.0, 1.0, 2.0], [12.0, 13.0, 14.0]], "fault": "stream0"}
    assert "capture_aux -> stream0" in r.stderr


def test_no_fault_without_the_variable(tmp_path):
    r = _run(_site(tmp_path, True), None)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"out": [[4.5, 5.5, 6.5], [16.5, 17.5, 18.5]], "fault": None}


@pytest.mark.parametrize("overlay_first", [True, False])
def test_overlay_without_the_hook_fails_loudly(tmp_path, overlay_first):
    r = _run(_site(tmp_path, overlay_first, body="X = 1\n"), "stream0")
    assert r.returncode == 3 and "has no capture_aux" in r.stderr


def test_unknown_fault_and_uninstall(tmp_path, monkeypatch):
    monkeypatch.setenv(aux_fault.FAULT_ENV, "stream7")
    with pytest.raises(ValueError, match="known faults"):
        aux_fault.fault()
    site = _site(tmp_path, True)
    aux_fault.remove_pth(site)
    assert not (site / aux_fault.PTH_NAME).exists() and not (site / aux_fault.DIR_NAME).exists()


def test_stream0_fault_on_the_real_overlay(tmp_path):
    """The overlay as `speclab overlay install` lays it out: its `capture_aux` is the hook."""
    from speclab import overlay

    site = tmp_path / "site"
    overlay.install(site)
    aux_fault.write_pth(site)
    probe = ("import json, site, sys, torch; site.addsitedir(sys.argv[1]);"
             "import deepseek_v4_eagle3_aux as m; s = torch.arange(24.0).view(2, 4, 3);"
             "print(json.dumps(m.capture_aux(s).tolist()))")
    env = {**os.environ, aux_fault.FAULT_ENV: "stream0"}
    r = subprocess.run([sys.executable, "-c", probe, str(site)], env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [[0.0, 1.0, 2.0],
                                                             [12.0, 13.0, 14.0]]
