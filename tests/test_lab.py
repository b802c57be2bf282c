"""tools/gpu/lab.py's bookkeeping across device calls, its GPU slots, release tags and process
stopping, with fake jobs (the GPU jobs themselves run on the device)."""
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from speclab.profiles import REPO


def load_lab(monkeypatch, tmp_path, release="0.22.0"):
    monkeypatch.setenv("SPECLAB_VLLM", release)
    monkeypatch.setenv("LAB_STAMP", "20990101")
    spec = importlib.util.spec_from_file_location("lab", REPO / "tools/gpu/lab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "REPO", tmp_path / "repo")
    monkeypatch.setattr(mod, "RUNS", tmp_path / "repo/data/runs")
    monkeypatch.setattr(mod, "STATE", tmp_path / "state")
    monkeypatch.setattr(mod, "save_jit_cache", lambda out, fh: None)  # not this machine's
    (tmp_path / "state").mkdir(exist_ok=True)
    (tmp_path / "repo").mkdir(exist_ok=True)
    return mod


@pytest.fixture
def lab(tmp_path, monkeypatch):
    mod = load_lab(monkeypatch, tmp_path)
    monkeypatch.setattr(mod, "JOBS", [{"runs": ["r1"]}])
    return mod


def fake(name, gpus=1, *, vllm="0.22", after=(), exclusive=False, cmd=None, timeout=60):
    return {"name": name, "gpus": gpus, "timeout": timeout, "cmd": cmd or ["true"],
            "runs": [], "env": {}, "expect_fail": False, "vllm": vllm, "after": tuple(after),
            "exclusive": exclusive}


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


def test_setup_runs_once_per_machine_and_release(lab, monkeypatch):
    (lab.STATE / "setup-0.22.json").write_text('{"DSV4_COMPRESSOR": "triton"}')
    monkeypatch.delenv("DSV4_COMPRESSOR", raising=False)
    monkeypatch.setattr(lab.subprocess, "run", lambda *a, **k: pytest.fail("set-up ran again"))
    lab.setup(None)
    assert os.environ["DSV4_COMPRESSOR"] == "triton"


# --------------------------------------------------------------------------- release tags
def test_run_folders_and_jit_cache_carry_the_release(tmp_path, monkeypatch):
    for release, tag in (("0.22.0", "vllm022"), ("0.26.0", "vllm026")):
        mod = load_lab(monkeypatch, tmp_path, release)
        assert mod.RELEASE == release[:4] and mod.STAMP == f"20990101-{tag}"
        assert mod.DIAL == f"h200-dsv4-dial-20990101-{tag}" and tag in mod.PLAN.vars["COST"]


# jobs and fixtures of studies added after the capture (src/speclab/studies/50-mtp.yaml,
# 60-ray-realshape.yaml, 70-realshape-cost.yaml)
LATER_JOBS = ("mtp", "mtp-026", "realshape-local-k3-026", "ray-realshape-k3-026",
              "realshape-local-k0-026", "ray-realshape-k0-026", "cost-realshape",
              "cost-realshape-026")
LATER_FIXTURES = ("dial-dsv4-mtp", "dial-dsv4-mtp-eagle3")
CHANGED = ("parity-",)  # jobs changed since the capture (tests/test_studies.py holds them)


def test_lab_runs_the_studies_plan_as_lab_py_had_it(tmp_path, monkeypatch):
    """JOBS and FIXTURES come from src/speclab/studies (tests/test_studies.py holds the plan to
    the capture field by field); here lab.py's own view of them, as it runs them."""
    before = json.loads((REPO / "tests/data/lab_plan.json").read_text())
    for release in ("0.22.0", "0.26.0"):
        mod = load_lab(monkeypatch, tmp_path, release)
        want = before[f"{release} 20990101"]
        jobs = [j for j in mod.JOBS if j["name"] not in LATER_JOBS
                and not j["name"].startswith(CHANGED)]
        assert json.loads(json.dumps(jobs).replace(json.dumps(mod.PY)[1:-1], "{python}")
                          ) == [j for j in want["jobs"] if not j["name"].startswith(CHANGED)]
        assert [j["name"] for j in mod.JOBS[-len(LATER_JOBS):]] == list(LATER_JOBS)
        assert [f for f in mod.FIXTURES if f not in LATER_FIXTURES] == want["FIXTURES"]
        assert mod.STAMP == want["STAMP"]
        assert mod.RELTAG == want["RELTAG"] and mod.DIAL == want["DIAL"]


def test_list_prints_the_plan_of_a_release_and_runs_nothing(lab, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lab.py", "--list", "--vllm", "0.26"])
    monkeypatch.setattr(lab.subprocess, "Popen", lambda *a, **k: pytest.fail("a job ran"))
    assert lab.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("stamp 20990101-vllm026;") and out[-1] == "27 jobs for vLLM 0.26"
    assert out[1].split()[:3] == ["rig-026", "vLLM", "0.26"]
    assert "h200-dsv4-rig-20990101-vllm026" in out[1]
    monkeypatch.setattr(sys, "argv", ["lab.py", "--list"])
    lab.main()
    assert capsys.readouterr().out.splitlines()[-1] == "64 jobs"


def test_every_job_has_a_release_a_unique_name_and_known_after_jobs(tmp_path, monkeypatch):
    mod = load_lab(monkeypatch, tmp_path)
    names = [j["name"] for j in mod.JOBS]
    assert len(names) == len(set(names))
    assert {j["vllm"] for j in mod.JOBS} == {"0.22", "0.26"}
    assert all(a in names for j in mod.JOBS for a in j["after"])


def run_main(lab, monkeypatch, tmp_path, *args):
    monkeypatch.setattr(sys, "argv", ["lab.py", "--out", str(tmp_path / "out"), "--gpus", "1",
                                      *args])
    (lab.STATE / f"setup-{lab.RELEASE}.json").write_text("{}")
    lab.main()
    return json.loads((tmp_path / "out/summary.json").read_text())


def test_only_the_jobs_of_the_environments_release_run(lab, monkeypatch, tmp_path):
    monkeypatch.setattr(lab, "JOBS", [fake("a"), fake("b", vllm="0.26"), fake("c")])
    summary = run_main(lab, monkeypatch, tmp_path, "--vllm", "0.22")
    assert set(summary["jobs"]) == {"a", "c"} and summary["vllm"] == "0.22"


@pytest.mark.parametrize("args, message", [
    (["--vllm", "0.26"], "this environment has vLLM 0.22"),
    (["--vllm", "0.22", "--only", "b"], "need another vLLM release"),
    (["--vllm", "0.22", "--only", "zzz"], "unknown jobs"),
])
def test_a_release_mismatch_is_refused_before_anything_runs(lab, monkeypatch, tmp_path, capsys,
                                                            args, message):
    monkeypatch.setattr(lab, "JOBS", [fake("a"), fake("b", vllm="0.26")])
    with pytest.raises(SystemExit):
        run_main(lab, monkeypatch, tmp_path, *args)
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- slots
def test_pick_shares_a_gpu_up_to_its_slots(lab):
    todo = [fake("a"), fake("b"), fake("c")]
    free = {"0": 2}
    j, gpus = lab.pick(todo, free, 2, set(), set(), alone=False)
    assert (j["name"], gpus) == ("a", ["0"])
    free["0"] = 1
    assert lab.pick(todo[1:], free, 2, set(), {"a"}, alone=False)[0]["name"] == "b"
    free["0"] = 0
    assert lab.pick(todo[2:], free, 2, set(), {"a", "b"}, alone=False) is None


def test_pick_spreads_over_gpus_and_keeps_the_order(lab):
    free = {"0": 1, "1": 2}
    assert lab.pick([fake("a")], free, 2, set(), {"x"}, alone=False)[1] == ["1"]
    # a two-GPU job waits for two idle GPUs and holds back the jobs after it
    assert lab.pick([fake("big", gpus=2), fake("small")], free, 2, set(), {"x"},
                    alone=False) is None


def test_exclusive_job_waits_for_an_idle_gpu(lab):
    todo = [fake("cost", exclusive=True), fake("b")]
    assert lab.pick(todo, {"0": 1}, 2, set(), {"a"}, alone=False) is None
    assert lab.pick(todo, {"0": 2}, 2, {"a"}, set(), alone=False)[0]["name"] == "cost"


def test_after_waits_for_the_named_job_but_lets_others_pass(lab):
    todo = [fake("dial", after=("rig",)), fake("other")]
    free = {"0": 1}
    assert lab.pick(todo, free, 2, set(), {"rig"}, alone=False)[0]["name"] == "other"
    assert lab.pick(todo, free, 2, {"rig"}, set(), alone=False)[0]["name"] == "dial"
    # a dependency that is not in this call (done earlier, or not asked for) does not block
    assert lab.pick(todo, free, 2, set(), set(), alone=False)[0]["name"] == "dial"


def test_warm_first_starts_nothing_next_to_the_first_job(lab):
    assert lab.pick([fake("b")], {"0": 1}, 2, set(), {"a"}, alone=True) is None
    assert lab.pick([fake("b")], {"0": 2}, 2, set(), set(), alone=True)[0]["name"] == "b"


def test_shared_jobs_get_a_memory_share_and_exclusive_ones_do_not(lab):
    env = lab.job_env(fake("a"), "0", 3, 4)
    assert env["SPECLAB_GPU_MEMORY_UTILIZATION"] == "0.30"
    assert env["SPECLAB_KV_CACHE_MEMORY_BYTES"] == str(4 * 2**30)
    assert "SPECLAB_GPU_MEMORY_UTILIZATION" not in lab.job_env(fake("c", exclusive=True), "0",
                                                               3, 4)
    assert "SPECLAB_GPU_MEMORY_UTILIZATION" not in lab.job_env(fake("a"), "0", 1, 4)


def sleeper(path, seconds=2):
    """A fake job that records when it ran and its GPU-share environment."""
    code = ("import json, os, sys, time; t = time.time(); time.sleep(%s); json.dump({'t0': t, "
            "'t1': time.time(), 'util': os.environ.get('SPECLAB_GPU_MEMORY_UTILIZATION')}, "
            "open(sys.argv[1], 'w'))" % seconds)
    return [sys.executable, "-c", code, str(path)]


def test_main_runs_jobs_side_by_side_in_slots(lab, monkeypatch, tmp_path):
    rec = {n: tmp_path / f"{n}.json" for n in "abcd"}
    monkeypatch.setattr(lab, "JOBS", [
        fake("a", cmd=sleeper(rec["a"], 1)), fake("b", cmd=sleeper(rec["b"], 3)),
        fake("c", cmd=sleeper(rec["c"], 3)), fake("d", exclusive=True, cmd=sleeper(rec["d"], 1))])
    summary = run_main(lab, monkeypatch, tmp_path, "--vllm", "0.22", "--slots", "2")
    r = {n: json.loads(p.read_text()) for n, p in rec.items()}
    assert all(summary["jobs"][n]["rc"] == 0 for n in "abcd")
    assert r["a"]["t1"] <= min(r["b"]["t0"], r["c"]["t0"])  # warm-first: a ran alone
    assert r["b"]["t0"] < r["c"]["t1"] and r["c"]["t0"] < r["b"]["t1"]  # b and c overlapped
    assert r["d"]["t0"] >= max(r["b"]["t1"], r["c"]["t1"])  # exclusive: alone
    assert r["b"]["util"] == "0.45" and r["d"]["util"] is None
    assert summary["jobs"]["b"]["overlapped_with"] == ["c"]
    assert summary["jobs"]["d"]["overlapped_with"] == []


# --------------------------------------------------------------------------- stopping
SPAWNER = """
import subprocess, sys, time
# a worker in a session of its own (as speclab's sweep starts them), which starts a child
subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
                  "time.sleep(300)", "speclab.worker"], start_new_session=True)
time.sleep(300)
"""


def test_a_timed_out_job_is_stopped_with_everything_it_started_and_nothing_else(
        lab, monkeypatch, tmp_path):
    # an unrelated process whose command line matches the old `pkill -f` pattern
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                                  "speclab.worker", "vllm.entrypoints"])
    try:
        (lab.STATE / "logs").mkdir()
        (tmp_path / "out").mkdir()
        j = fake("spawner", cmd=[sys.executable, "-c", SPAWNER], timeout=4)
        summary = {"jobs": {}, "t0": time.time()}
        t0 = time.time()
        lab.run_job(j, "0", dict(os.environ), None, summary, tmp_path / "out",
                    threading.Lock(), time.time() + 60)
        seen = lab.FAMILIES["spawner"]
        assert summary["jobs"]["spawner"]["rc"] == "timeout" and time.time() - t0 < 40
        assert len(seen) == 3 and len({pgid for _, pgid in seen.values()}) == 2
        for pid in seen:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_what_a_finished_job_left_behind_is_stopped(lab, tmp_path):
    (lab.STATE / "logs").mkdir()
    (tmp_path / "out").mkdir()
    orphan = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(300)'], start_new_session=True); time.sleep(1.5)")
    summary = {"jobs": {}, "t0": time.time()}
    lab.run_job(fake("leaves", cmd=[sys.executable, "-c", orphan]), "0", dict(os.environ), None,
                summary, tmp_path / "out", threading.Lock(), time.time() + 60)
    assert summary["jobs"]["leaves"]["rc"] == 0
    left = [pid for pid in lab.FAMILIES["leaves"] if psutil.pid_exists(pid)
            and psutil.Process(pid).status() != "zombie"]
    assert left == []


def test_the_jit_cache_is_saved_in_the_layout_jit_sh_loads(tmp_path, monkeypatch):
    """lab.py saves through tools/gpu/jit.sh (members relative to $HOME), none when empty."""
    import tarfile

    monkeypatch.setenv("SPECLAB_VLLM", "0.26.0")
    spec = importlib.util.spec_from_file_location("lab_jit", REPO / "tools/gpu/lab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    home, out = tmp_path / "home", tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("HOME", str(home))
    with open(tmp_path / "log", "w") as fh:
        home.mkdir()
        mod.save_jit_cache(out, fh)
        assert not list(out.iterdir())  # nothing compiled: no tarball
        (home / ".tilelang/cache").mkdir(parents=True)
        (home / ".tilelang/cache/k.so").write_text("k")
        mod.save_jit_cache(out, fh)
    with tarfile.open(out / "jit-cache-vllm026.tar.gz") as t:
        assert ".tilelang/cache/k.so" in t.getnames()
    assert "-> 0.0 MiB" in (tmp_path / "log").read_text()
