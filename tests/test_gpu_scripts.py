"""The device-side shell tools that carry state between device calls: tools/gpu/jit.sh (JIT
caches in both tarball layouts), tools/gpu/labd.sh (lab.py detached from the call, with the
environment of every stage it is given; what `collect` brings back when the call's limit cuts
it, as for tools/gpu/realshape.sh), the Ray layer: tools/gpu/pack.sh --ray and
tools/gpu/unpack.sh's SPECLAB_RAY_SITE; on the CPU machine, tools/gpu/lean.sh (what
travels to the device); and what tools/gpu/gpu_env.py records of the machine."""

import io
import json
import os
import random
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
(state / "logs").mkdir(exist_ok=True)
(state / "logs" / "mtp-026.log").write_text(
    "=== job header\\nengine noise\\n[speclab] sweep p: 1/2 k0_x ok on vm in 5 s; ETA 5 s\\n")
"""


def labd_tree(tmp_path: Path, lab_py: str, **env: str) -> tuple[Path, Path, dict]:
    """A checkout with labd.sh, a fake lab.py and unpack.sh; its $OUT and the environment."""
    root = tree(tmp_path, "labd.sh", "jit.sh")
    (root / "tools/gpu/unpack.sh").write_text('echo "export BUNDLE=ok"\n')
    (root / "tools/gpu/lab.py").write_text(lab_py)
    out = tmp_path / "out"
    out.mkdir()
    return root, out, {**os.environ, "HOME": str(tmp_path), "LABD": str(tmp_path / "labd"),
                       "LAB_STATE": str(tmp_path / "state"), "OUT": str(out),
                       "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **env}


def test_labd_runs_lab_detached_until_the_job_is_done_and_collect_copies_it(tmp_path):
    root, out, env = labd_tree(tmp_path, FAKE_LAB)
    r = subprocess.run(["bash", "tools/gpu/labd.sh", "start", ".stage/gpu026", "0.26", "5",
                        "mtp-026", "--slots", "2"], cwd=root, env=env, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0 and "labd pid" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(["bash", "tools/gpu/labd.sh", "collect", "60"], cwd=root, env=env,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "labd ended" in r.stdout, r.stdout + r.stderr
    # each job's progress is printed: the sweep's lines, not the engine's
    assert "== mtp-026" in r.stdout and "1/2 k0_x ok on vm" in r.stdout
    assert "engine noise" not in r.stdout
    log = (out / "driver.log").read_text().splitlines()
    assert [line.split()[:3] for line in log] == [["call", "0", "BUNDLE=ok"],
                                                 ["call", "1", "BUNDLE=ok"]]
    assert "--only mtp-026 --slots 2" in log[1] and "--vllm 0.26" in log[1]
    assert json.loads((tmp_path / "state/done.json").read_text()) == ["mtp-026"]
    # lab.py ran from a copy of the tree, which later calls' fresh trees cannot remove
    assert (tmp_path / "labd/repo/tools/gpu/lab.py").exists()


SLOW_LAB = """import pathlib, sys, time
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1]); out.mkdir(parents=True, exist_ok=True)
(out / "driver.log").write_text("job started\\n")
print("lab running", flush=True)
time.sleep(40)
"""


def test_labd_collect_cut_by_the_calls_limit_still_leaves_the_latest_results(tmp_path):
    """The device call's limit kills `collect` mid-wait; what it copied on the way is in $OUT
    (2026-12-07: a call killed at 300 s came back empty although the jobs had ended)."""
    root, out, env = labd_tree(tmp_path, SLOW_LAB, COPY_EVERY="1")
    r = subprocess.run(["bash", "tools/gpu/labd.sh", "start", ".stage/gpu026", "0.26", "5",
                        "mtp-026"], cwd=root, env=env, capture_output=True, text=True,
                       check=False)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        cut = subprocess.run(["timeout", "4", "bash", "tools/gpu/labd.sh", "collect", "60"],
                             cwd=root, env=env, capture_output=True, text=True, check=False)
        assert cut.returncode == 124  # the limit, not collect, ended it
        assert (out / "driver.log").read_text() == "job started\n"
        assert (out / "labd.out").read_text() == "lab running\n"
        # collect's own end while lab.py runs on says so, in words and in its exit status
        short = subprocess.run(["bash", "tools/gpu/labd.sh", "collect", "1"], cwd=root,
                               env=env, capture_output=True, text=True, check=False)
        assert short.returncode == 5 and "labd still running" in short.stdout, short.stdout
    finally:
        subprocess.run(["pkill", "-f", str(tmp_path / "labd")], check=False)


def test_realshape_collect_cut_by_the_calls_limit_still_leaves_the_latest_results(tmp_path):
    """As labd.sh: the timing driver's results so far are in $OUT when the call's limit kills
    `collect` while the driver runs on."""
    root = tree(tmp_path, "realshape.sh")
    state, out = tmp_path / "state", tmp_path / "out"
    state.mkdir()
    out.mkdir()
    (state / "results.jsonl").write_text('{"point": "k0_b1", "round": 0}\n')
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                               "speclab.gpubench", "drive", str(tmp_path)])
    try:
        env = {**os.environ, "STATE": str(state), "OUT": str(out), "COPY_EVERY": "1"}
        cut = subprocess.run(["timeout", "3", "bash", "tools/gpu/realshape.sh", "collect", "60"],
                             cwd=root, env=env, capture_output=True, text=True, check=False)
        assert cut.returncode == 124, cut.stdout + cut.stderr
        assert (out / "results.jsonl").read_text() == (state / "results.jsonl").read_text()
    finally:
        driver.kill()


def test_labd_collect_on_a_fresh_machine_says_so_at_once(tmp_path):
    root = tree(tmp_path, "labd.sh")
    r = subprocess.run(["bash", "tools/gpu/labd.sh", "collect", "300"], cwd=root, text=True,
                       capture_output=True, timeout=30, check=False,
                       env={**os.environ, "LABD": str(tmp_path / "none"), "OUT": str(tmp_path)})
    assert r.returncode == 4 and "no detached lab.py" in r.stdout


def fake_wheel(path: Path, files: dict[str, bytes]) -> None:
    """A wheel pip installs: the files, plus its dist-info (METADATA, WHEEL, RECORD)."""
    import base64
    import hashlib
    import zipfile

    name, ver = path.name.split("-")[:2]
    info = f"{name}-{ver}.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\n"
             f"Version: {ver}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n"
             b"Tag: cp312-cp312-manylinux2014_x86_64\n"}
    digest = lambda b: base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=")
    record = "".join(f"{n},sha256={digest(b).decode()},{len(b)}\n" for n, b in files.items())
    with zipfile.ZipFile(path, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
        z.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")


RAYLET = random.Random(0).randbytes(1_600_000)  # incompressible: two parts of 1 MiB


def test_pack_ray_layer_prunes_and_unpack_exports_only_the_ray_site(tmp_path):
    """pack.sh --ray on the pinned wheels (fakes of the same names, in its wheel cache: no
    download): Ray's core stays, its libraries, jar and dashboard client go; the parts come
    back across two calls and unpack.sh prints SPECLAB_RAY_SITE alone (a bundle's PYTHONPATH
    is left as it was); the layer is deterministic (a second pack reuses it)."""
    root = tree(tmp_path, "pack.sh", "unpack.sh", "requirements-ray.txt")
    work = tmp_path / "work"
    (work / "whl").mkdir(parents=True)
    plat = "cp312-cp312-manylinux2014_x86_64.whl"
    fake_wheel(work / "whl" / f"ray-2.60.0-{plat}", {
        "ray/__init__.py": b"from ray.dashboard import agent\n",
        "ray/dashboard/__init__.py": b"", "ray/dashboard/agent.py": b"",
        "ray/dashboard/client/build/index.html": b"<html/>",
        "ray/rllib/__init__.py": b"", "ray/tune/__init__.py": b"", "ray/serve/__init__.py": b"",
        "ray/jars/ray_dist.jar": b"PK", "ray/core/src/ray/raylet/raylet": RAYLET,
        "ray/thirdparty_files/psutil/__init__.py": b""})
    fake_wheel(work / "whl" / f"msgpack-1.2.4-{plat}", {"msgpack/__init__.py": b""})
    env = {**os.environ, "WORK": str(work), "LAYER_CACHE": str(tmp_path / "layers"),
           "XZ_PRESET": "0", "PYTHON": sys.executable}
    pack = ["bash", "tools/gpu/pack.sh", "--ray", "--part-mib", "1"]
    r = subprocess.run(pack, cwd=root, env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    site = work / "tree/site"
    assert (site / "ray/dashboard/agent.py").exists() and (site / "msgpack").is_dir()
    assert (site / "ray/thirdparty_files/psutil").is_dir()
    for gone in ("ray/rllib", "ray/tune", "ray/serve", "ray/jars", "ray/dashboard/client",
                 "bin", "sitecustomize.py"):
        assert not (site / gone).exists(), gone
    stage = root / ".stage/ray"
    manifest = (stage / "MANIFEST").read_text().splitlines()
    assert "kind ray" in manifest and "nparts 2" in manifest
    assert {"wheel ray==2.60.0", "wheel msgpack==1.2.4"} <= set(manifest)
    assert [x.split()[1] for x in manifest if x.startswith("layer ")] == ["ray2.60.0"]
    sha = next(x for x in manifest if x.startswith("bundle_sha256"))

    # the device: one part a call, then the environment
    shutil.move(stage, tmp_path / "parts")
    uenv = {**os.environ, "SPECLAB_PARTS": str(tmp_path / "stash"),
            "SPECLAB_DEST_ROOT": str(tmp_path / "dest")}
    for k, want in ((1, 3), (2, 0)):
        shutil.rmtree(stage, ignore_errors=True)
        shutil.copytree(tmp_path / "parts" / f"p{k}", stage / f"p{k}")
        u = subprocess.run(["bash", "tools/gpu/unpack.sh", ".stage/ray"], cwd=root, env=uenv,
                           capture_output=True, text=True, check=False)
        assert u.returncode == want, u.stderr
    ray_site = tmp_path / "dest/speclab_site_ray/site"
    assert u.stdout == f"export SPECLAB_RAY_SITE={ray_site}\n" and "ray 2.60.0" in u.stderr
    assert (ray_site / "ray/core/src/ray/raylet/raylet").read_bytes() == RAYLET
    script = ('eval "$(bash tools/gpu/unpack.sh .stage/ray)" && echo "$PYTHONPATH" && '
              'PYTHONPATH=$PYTHONPATH:$SPECLAB_RAY_SITE python3 -c "import ray, msgpack; '
              'print(ray.__file__)"')
    probe = subprocess.run(
        ["bash", "-c", script], cwd=root, capture_output=True, text=True, check=False,
        env={**uenv, "PYTHONPATH": "/bundle/site",
             "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert probe.stdout.splitlines() == ["/bundle/site", f"{ray_site}/ray/__init__.py"], \
        probe.stderr

    r = subprocess.run(pack, cwd=root, env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "reusing" in r.stdout, r.stdout + r.stderr
    assert sha in (stage / "MANIFEST").read_text().splitlines()


LAB_ENV = """import json, os, sys, pathlib
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1]); out.mkdir(parents=True, exist_ok=True)
with open(out / "driver.log", "a") as f:
    f.write(f"BUNDLE={os.environ.get('BUNDLE')} RAY={os.environ.get('SPECLAB_RAY_SITE')}\\n")
state = pathlib.Path(os.environ["LAB_STATE"]); state.mkdir(exist_ok=True)
(state / "done.json").write_text(json.dumps(sys.argv[sys.argv.index("--only") + 1].split(",")))
(state / "logs").mkdir(exist_ok=True)
(state / "logs" / "b-026.log").write_text("engine noise\\nk3_x: counters equal, tokens equal\\n"
                                         "1/1 shared points identical; throughput within\\n")
"""
STAGE_ENV = """case $(basename "$1") in
  gpu026) echo "export BUNDLE=ok" ;;
  ray) echo "export SPECLAB_RAY_SITE=/tmp/ray-site" ;;
  *) echo "have 0 of 4 parts" >&2; exit 3 ;;
esac
"""


def test_labd_takes_the_environment_of_every_stage_and_refuses_a_missing_one(tmp_path):
    root = tree(tmp_path, "labd.sh", "jit.sh")
    (root / "tools/gpu/unpack.sh").write_text(STAGE_ENV)
    (root / "tools/gpu/lab.py").write_text(LAB_ENV)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "HOME": str(tmp_path), "LABD": str(tmp_path / "labd"),
           "LAB_STATE": str(tmp_path / "state"), "OUT": str(out),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    start = lambda stages: subprocess.run(
        ["bash", "tools/gpu/labd.sh", "start", stages, "0.26", "5", "a-026,b-026"], cwd=root,
        env=env, capture_output=True, text=True, check=False)
    r = start(".stage/gpu026,.stage/missing")
    assert r.returncode == 3 and ".stage/missing incomplete" in r.stdout
    assert not (tmp_path / "labd").exists()  # nothing started
    r = start(".stage/gpu026,.stage/ray")
    assert r.returncode == 0 and "labd pid" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(["bash", "tools/gpu/labd.sh", "collect", "60"], cwd=root, env=env,
                       capture_output=True, text=True, check=False)
    assert "labd ended" in r.stdout, r.stdout + r.stderr
    assert (out / "driver.log").read_text().splitlines() == ["BUNDLE=ok RAY=/tmp/ray-site"]
    assert r.stdout.splitlines()[-2:] == ["k3_x: counters equal, tokens equal",
                                          "1/1 shared points identical; throughput within"]


def test_lean_sends_only_what_the_device_reads_and_blocks_commits_until_off(tmp_path):
    """lean.sh on: run folders and figures leave the index (still on disk) and are ignored, so
    what would travel (tracked + untracked-not-ignored) shrinks to the rest, a named run folder
    stays; a commit is refused until `off`, which restores index, ignore list and hook."""
    root = tree(tmp_path, "lean.sh")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    subprocess.run([*git[:5], "init", "-q", str(root)], check=True)
    for rel, size in (("src/a.py", 1 << 20), ("data/runs/old/big.html", 3 << 20),
                      ("data/runs/keep/r.json", 1 << 20), ("figures/old/f.svg", 2 << 20)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * size)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    exclude = (root / ".git/info/exclude").read_text()

    def lean(*args):
        r = subprocess.run(["bash", "tools/gpu/lean.sh", *args], cwd=root, capture_output=True,
                           text=True, check=False)
        return r.returncode, r.stdout.strip(), r.stderr

    def travels():
        out = subprocess.run([*git, "ls-files", "-co", "--exclude-standard"], check=True,
                             capture_output=True, text=True).stdout.split()
        return sorted(p for p in out if not p.startswith("tools/"))

    assert lean("size")[1].startswith("7.0 MiB")
    assert lean("on", "keep")[:2] == (0, "2.0 MiB travel")
    assert travels() == ["data/runs/keep/r.json", "src/a.py"]
    assert (root / "data/runs/old/big.html").exists() and (root / "figures/old/f.svg").exists()
    r = subprocess.run([*git, "commit", "-qam", "x", "--allow-empty"], capture_output=True,
                       text=True, check=False)
    assert r.returncode != 0 and "lean.sh is on" in r.stderr
    assert lean("off")[:2] == (0, "7.0 MiB travel")
    assert (root / ".git/info/exclude").read_text() == exclude
    assert not (root / ".git/hooks/pre-commit").exists()
    assert subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True,
                          check=True).stdout.strip() == ""
    assert subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "y"],
                          check=False).returncode == 0
    # an unknown run folder is refused, and nothing stays half lean
    assert lean("on", "nope")[0] == 2 and lean("size")[1].startswith("7.0 MiB")
    assert not (root / ".git/hooks/pre-commit").exists()


def test_lean_jit_leaves_other_releases_caches_home(tmp_path):
    """LEAN_JIT=vllm022: the 0.26 JIT cache leaves the index and is ignored while the 0.22 one
    travels; without it (the control) both travel; `off` tracks both again; a tag no cache
    carries is refused and leaves the tree as it was."""
    root = tree(tmp_path, "lean.sh")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    subprocess.run([*git[:5], "init", "-q", str(root)], check=True)
    jit = ("data/jit/jit-cache-vllm022-h100.tar.gz", "data/jit/jit-cache-vllm026-h200.tar.gz")
    for rel in (*jit, "data/runs/old/r.json", "figures/old/f.svg"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * (1 << 20))
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)

    def on(**env):
        r = subprocess.run(["bash", "tools/gpu/lean.sh", "on"], cwd=root, capture_output=True,
                           text=True, check=False, env={**os.environ, **env})
        assert r.returncode == 0, r.stdout + r.stderr
        out = subprocess.run([*git, "ls-files", "-co", "--exclude-standard"], check=True,
                             capture_output=True, text=True).stdout.split()
        subprocess.run(["bash", "tools/gpu/lean.sh", "off"], cwd=root, check=True,
                       capture_output=True)
        return sorted(p for p in out if p.startswith("data/"))

    assert on() == list(jit)
    assert on(LEAN_JIT="vllm022") == [jit[0]]
    assert on(LEAN_JIT="vllm026") == [jit[1]]
    # a tag with no cache (a typo would send none and the machine would compile cold)
    r = subprocess.run(["bash", "tools/gpu/lean.sh", "on"], cwd=root, capture_output=True,
                       text=True, check=False, env={**os.environ, "LEAN_JIT": "vllm0226"})
    assert r.returncode == 2 and "no data/jit/*-vllm0226-*" in r.stderr
    assert not (root / ".git/hooks/pre-commit").exists()  # left off
    assert subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True,
                          check=True).stdout.strip() == ""


def test_lean_works_on_a_clone_without_git_info(tmp_path):
    """A fresh checkout may have no .git/info (no exclude file yet): `on` creates it and
    `off` leaves no mark in it (before 2026-12-06 `on` stopped at sed and stayed off)."""
    root = tree(tmp_path, "lean.sh")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    subprocess.run([*git[:5], "init", "-q", str(root)], check=True)
    for rel in ("data/runs/old/big.html", "figures/old/f.svg"):
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_bytes(b"x" * (3 << 20))
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    shutil.rmtree(root / ".git/info")
    lean = lambda arg: subprocess.run(["bash", "tools/gpu/lean.sh", arg], cwd=root,  # noqa: E731
                                      capture_output=True, text=True, check=False)
    r = lean("on")
    assert r.returncode == 0 and r.stdout.startswith("0.0 MiB"), r.stdout + r.stderr
    assert "/data/runs/" in (root / ".git/info/exclude").read_text()
    r = lean("off")
    assert r.returncode == 0 and r.stdout.startswith("6.0 MiB"), r.stdout + r.stderr
    assert "lean.sh" not in (root / ".git/info/exclude").read_text()


def test_gpu_env_names_the_machine_a_run_had(tmp_path, monkeypatch):
    """env.json's `machine`: this boot's id, the CPU model and count, and the GPUs' UUIDs as
    nvidia-smi gives them; a fake nvidia-smi on PATH (the control) changes the UUIDs only."""
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    try:
        import gpu_env
    finally:
        sys.path.pop(0)
    m = gpu_env.machine()
    assert m["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert m["cpus"] == os.cpu_count() and m["cpu"] and m["hostname"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho GPU-0f1e; echo GPU-2d3c\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    faked = gpu_env.machine()
    assert faked["gpu_uuid"] == ["GPU-0f1e", "GPU-2d3c"] and faked["gpu_uuid"] != m["gpu_uuid"]
    assert {k: v for k, v in faked.items() if k != "gpu_uuid"} == \
        {k: v for k, v in m.items() if k != "gpu_uuid"}
