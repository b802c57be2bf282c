"""The device-side shell tools that carry state between device calls: tools/gpu/jit.sh (JIT
caches in both tarball layouts) and tools/gpu/labd.sh (lab.py detached from the call)."""

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tree(tmp_path: Path, *scripts: str) -> Path:
    """A minimal checkout holding the named tools/gpu scripts."""
    root = tmp_path / "repo"
    (root / "tools" / "gpu").mkdir(parents=True)
    (root / "data" / "jit").mkdir(parents=True)
    for s in scripts:
        shutil.copy(REPO / "tools" / "gpu" / s, root / "tools" / "gpu" / s)
    return root


def add(tar: tarfile.TarFile, name: str, text: str) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def test_jit_load_takes_home_relative_and_absolute_tarballs(tmp_path):
    root, home = tree(tmp_path, "jit.sh"), tmp_path / "home"
    home.mkdir()
    with tarfile.open(root / "data/jit/jit-cache-vllm026-h200.tar.gz", "w:gz") as t:
        add(t, f"{str(home).lstrip('/')}/.triton/cache/A/kernel.cubin", "abs")  # lab.py's layout
    with tarfile.open(root / "data/jit/jit-cache-vllm026-more.tar.gz", "w:gz") as t:
        add(t, ".tilelang/cache/k.so", "rel")  # jit.sh save's layout
    with tarfile.open(root / "data/jit/jit-cache-vllm022-h200.tar.gz", "w:gz") as t:
        add(t, ".deep_gemm/other-release", "x")
    r = subprocess.run(["bash", "tools/gpu/jit.sh", "load", "vllm026"], cwd=root, check=False,
                       text=True, capture_output=True, env={**os.environ, "HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert (home / ".triton/cache/A/kernel.cubin").read_text() == "abs"
    assert (home / ".tilelang/cache/k.so").read_text() == "rel"
    assert not (home / ".deep_gemm").exists()  # another release's cache stays out
    assert not (home / str(home).lstrip("/")).exists()  # not nested under $HOME


def test_jit_save_then_load_round_trips(tmp_path):
    root, home, other = tree(tmp_path, "jit.sh"), tmp_path / "h1", tmp_path / "h2"
    (home / ".cache/vllm").mkdir(parents=True)
    (home / ".cache/vllm/x").write_text("v")
    other.mkdir()
    dest = root / "data/jit/jit-cache-vllm026-h200.tar.gz"
    run = lambda h, *a: subprocess.run(["bash", "tools/gpu/jit.sh", *a], cwd=root, check=True,
                                       capture_output=True, env={**os.environ, "HOME": str(h)})
    run(home, "save", str(dest))
    run(other, "load", "vllm026")
    assert (other / ".cache/vllm/x").read_text() == "v"


FAKE_LAB = """import json, os, sys, pathlib
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1]); out.mkdir(parents=True, exist_ok=True)
state = pathlib.Path(os.environ["LAB_STATE"]); state.mkdir(exist_ok=True)
calls = state / "calls"; n = int(calls.read_text()) if calls.exists() else 0
calls.write_text(str(n + 1))
with open(out / "driver.log", "a") as f:
    f.write(f"call {n} BUNDLE={os.environ.get('BUNDLE')} {' '.join(sys.argv[1:])}\\n")
if n >= 1:  # the job's own timeout cut the first run; the second finishes it
    (state / "done.json").write_text(json.dumps(["mtp-026"]))
"""


def test_labd_runs_lab_detached_until_the_job_is_done_and_collect_copies_it(tmp_path):
    root = tree(tmp_path, "labd.sh", "jit.sh")
    (root / "tools/gpu/unpack.sh").write_text('echo "export BUNDLE=ok"\n')
    (root / "tools/gpu/lab.py").write_text(FAKE_LAB)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "HOME": str(tmp_path), "LABD": str(tmp_path / "labd"),
           "LAB_STATE": str(tmp_path / "state"), "OUT": str(out),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "tools/gpu/labd.sh", "start", ".stage/gpu026", "0.26", "5",
                        "mtp-026", "--slots", "2"], cwd=root, env=env, capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0 and "labd pid" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(["bash", "tools/gpu/labd.sh", "collect", "60"], cwd=root, env=env,
                       capture_output=True, text=True, check=False)
    assert "labd ended" in r.stdout, r.stdout + r.stderr
    log = (out / "driver.log").read_text().splitlines()
    assert [line.split()[:3] for line in log] == [["call", "0", "BUNDLE=ok"],
                                                 ["call", "1", "BUNDLE=ok"]]
    assert "--only mtp-026 --slots 2" in log[1] and "--vllm 0.26" in log[1]
    assert json.loads((tmp_path / "state/done.json").read_text()) == ["mtp-026"]
    # lab.py ran from a copy of the tree, which later calls' fresh trees cannot remove
    assert (tmp_path / "labd/repo/tools/gpu/lab.py").exists()


def test_labd_collect_on_a_fresh_machine_says_so_at_once(tmp_path):
    root = tree(tmp_path, "labd.sh")
    r = subprocess.run(["bash", "tools/gpu/labd.sh", "collect", "300"], cwd=root, text=True,
                       capture_output=True, timeout=30, check=False,
                       env={**os.environ, "LABD": str(tmp_path / "none"), "OUT": str(tmp_path)})
    assert r.returncode == 4 and "no detached lab.py" in r.stdout
