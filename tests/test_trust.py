"""Runs you can trust (issue 14), on the CPU without loading an engine: the sweep's worker
is replaced by tests/trust_worker.py, which keeps the worker's contract.

Resume by fingerprint, timing rounds, the run-folder lock, damaged files, early checks,
server failures and timeouts, Ctrl-C and a killed parent."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import yaml

from speclab import (
    analysis,
    cli,
    fingerprint,
    launch,
    preflight,
    profiles,
    runlock,
    server,
    store,
    sweep,
)
from speclab.profiles import REPO, Point

TESTS = Path(__file__).parent
SRC = REPO / "src"
CLI = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from speclab import cli, launch
launch.WORKER = "trust_worker"
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture()
def prof_path(tmp_path) -> Path:
    for name in ("target", "draft"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    p = tmp_path / "trust.yaml"
    p.write_text(yaml.safe_dump({
        "name": "trust", "backend": "cpu", "target": str(tmp_path / "target"),
        "draft": str(tmp_path / "draft"),
        "prompts": {"file": str(REPO / "data/prompts/tiny-code.jsonl"), "limit": 2},
        "max_tokens": 16, "grid": {"num_speculative_tokens": [0, 2]}, "timed_passes": 1,
        "engine": {"enforce_eager": True}, "timeout_s": 60}))
    return p


@pytest.fixture()
def fake(monkeypatch, tmp_path) -> Path:
    """Sweeps in this process and their children use the stand-in worker; returns its log."""
    monkeypatch.setattr(launch, "WORKER", "trust_worker")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(TESTS), str(SRC), os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "worker.log"
    monkeypatch.setenv("TRUST_LOG", str(log))
    return log


def starts(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


@contextmanager
def warnings_logged():
    """The `speclab` logger's warnings during the block, as messages."""
    msgs: list[str] = []
    h = logging.Handler(logging.WARNING)
    h.emit = lambda record: msgs.append(record.getMessage())
    logging.getLogger("speclab").addHandler(h)
    try:
        yield msgs
    finally:
        logging.getLogger("speclab").removeHandler(h)


@contextmanager
def running(args: list[str], env: dict[str, str]):
    """`python ARGS` for the block; killed at its end if still running, so that a failed
    assertion leaves no sweep behind."""
    proc = subprocess.Popen([sys.executable, *args], env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def sweep_run(path, run_dir, overrides=None, **kw):
    with warnings_logged() as msgs:
        res = sweep.run(profiles.load(path, overrides), run_dir, **kw)
    return res, msgs


def processes_naming(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def wait_for(cond, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False


# --------------------------------------------------------------------- resume by fingerprint
def test_changed_settings_are_measured_again_and_the_old_result_kept(prof_path, tmp_path, fake):
    run_dir = tmp_path / "run"
    res, msgs = sweep_run(prof_path, run_dir)
    assert [m["status"] for m in res] == ["ok", "ok"] and len(starts(fake)) == 2 and not msgs
    meta = json.loads((run_dir / "results" / f"{res[0]['point_id']}.json").read_text())
    assert meta["sampling"]["max_tokens"] == 16 and meta["fingerprint"]["digest"]

    sweep_run(prof_path, run_dir)
    assert len(starts(fake)) == 2, "an unchanged point was measured again"

    for overrides, what in (({"max_tokens": 48}, "sampling.max_tokens 16 -> 48"),
                            ({"max_tokens": 48, "temperature": 0.5}, "sampling.temperature"),
                            ({"max_tokens": 48, "temperature": 0.5,
                              "prompts": {"limit": 3}}, "prompts.limit 2 -> 3"),
                            ({"max_tokens": 48, "temperature": 0.5, "prompts": {"limit": 3},
                              "engine": {"enforce_eager": False}},
                             "engine_args.enforce_eager true -> false")):
        n = len(starts(fake))
        res, msgs = sweep_run(prof_path, run_dir, overrides)
        assert len(starts(fake)) == n + 2, overrides
        assert len(msgs) == 2 and all(what in m and "measuring again" in m for m in msgs), msgs
    new = json.loads((run_dir / "results" / f"{res[0]['point_id']}.json").read_text())
    assert new["sampling"]["max_tokens"] == 48 and new["sampling"]["temperature"] == 0.5
    kept = sorted((run_dir / "superseded").glob(f"*/{res[0]['point_id']}.json"))
    assert len(kept) == 4, "every earlier result is kept aside"
    assert {json.loads(p.read_text())["sampling"]["max_tokens"] for p in kept} == {16, 48}
    assert list((run_dir / "superseded").glob("*/profile.json")), "the old profile is kept"


def test_a_dry_run_says_what_the_sweep_then_does_and_changes_nothing(prof_path, tmp_path,
                                                                      fake, capsys):
    """`sweep.preview` (`speclab sweep --dry-run`) against what `sweep.run` then does: the
    same points measured, for the same reasons, and until then no file moved or written."""
    from speclab import cli

    run_dir = tmp_path / "run"
    prof = profiles.load(prof_path, {"timed_passes": 2})
    k0, k2 = (p.id for p in sweep.expand(prof))
    assert [(r["action"], r["rounds"]) for r in sweep.preview(prof, run_dir)] == [
        ("new", 1), ("new", 1)] and not run_dir.exists()
    sweep.run(prof, run_dir)
    assert [(r["action"], r["rounds"]) for r in sweep.preview(prof, run_dir)] == [
        ("keep", 0), ("keep", 0)]
    # one point failed, the other's result damaged; then the settings change for both
    meta = json.loads((run_dir / "results" / f"{k0}.json").read_text())
    (run_dir / "results" / f"{k0}.json").write_text(json.dumps(
        {**meta, "status": "error", "error": "RuntimeError: engine died\ntraceback"}))
    (run_dir / "points" / f"{k2}.parquet").write_bytes(b"not parquet")
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns)
                    for p in run_dir.rglob("*") if p.is_file())
    rows = {r["id"]: r for r in sweep.preview(prof, run_dir)}
    assert (rows[k0]["action"], rows[k0]["detail"]) == ("failed", "RuntimeError: engine died")
    assert rows[k2]["action"] == "damaged" and f"{k2}.parquet" in rows[k2]["detail"]
    assert [r["action"] for r in sweep.preview(prof, run_dir, retry_failed=False)] == [
        "keep", "damaged"]
    changed = profiles.load(prof_path, {"timed_passes": 2, "max_tokens": 48})
    rows = sweep.preview(changed, run_dir)
    assert [r["action"] for r in rows] == ["changed", "damaged"]  # the failure set aside
    assert cli.main(["sweep", "--profile", str(prof_path), "--run-id", str(run_dir),
                     "--override", json.dumps({"timed_passes": 2}), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"  retry   {k0} (+1 timing round): RuntimeError: engine died" in out
    assert "2 of 2 points would be measured" in out
    assert sorted((p.relative_to(run_dir), p.stat().st_mtime_ns)
                  for p in run_dir.rglob("*") if p.is_file()) == before, "a dry run wrote"
    n = len(starts(fake))
    sweep.run(prof, run_dir)
    assert len(starts(fake)) == n + 4  # both measured again, each with its second round
    rows = sweep.preview(changed, run_dir)
    assert [(r["action"], r["detail"]) for r in rows] == [
        ("changed", "sampling.max_tokens 16 -> 48")] * 2
    with warnings_logged() as msgs:
        sweep.run(changed, run_dir)
    assert len(msgs) == 2 and all("sampling.max_tokens 16 -> 48" in m for m in msgs)


def test_a_point_measured_elsewhere_or_before_fingerprints_is_not_resumed(
        prof_path, tmp_path, fake, monkeypatch):
    run_dir = tmp_path / "run"
    res, _ = sweep_run(prof_path, run_dir)
    other = {**fingerprint.hardware(), "cpu": "another machine's CPU"}
    monkeypatch.setattr(fingerprint, "hardware", lambda: other)
    _, msgs = sweep_run(prof_path, run_dir)
    assert len(starts(fake)) == 4 and all("hardware.cpu" in m for m in msgs), msgs

    path = run_dir / "results" / f"{res[0]['point_id']}.json"
    meta = json.loads(path.read_text())
    del meta["fingerprint"]  # as committed before fingerprints existed
    path.write_text(json.dumps(meta))
    _, msgs = sweep_run(prof_path, run_dir)
    assert len(starts(fake)) == 5 and "no fingerprint recorded" in msgs[0]


def test_make_report_measures_into_its_own_ignored_folder(prof_path, monkeypatch):
    from contextlib import nullcontext

    from speclab import report

    seen = []
    monkeypatch.setattr(report, "run_suite", lambda profile, run_id, **kw: seen.append(run_id))
    monkeypatch.setattr(runlock, "hold", lambda *a, **k: nullcontext())
    assert cli.main(["run", "--profile", str(prof_path), "--notebooks", "01_sweep"]) == 0
    assert cli.main(["run", "--profile", str(prof_path), "--notebooks", "01_sweep",
                     "--fresh"]) == 0
    assert seen[0] == "trust-local"
    assert seen[1].startswith("trust-local-") and seen[1] != seen[0]
    for run_id in ("tiny-cpu-local", "tiny-cpu-local-20261201-101010"):
        for path in (f"data/runs/{run_id}/points/x", f"figures/{run_id}/x.png"):
            ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
            assert ignored.returncode == 0, f"{path}: the main job's output is not ignored"


def _fake_group(ran: list):
    """Stands in for the multipass child: writes every pass it finds missing, with the
    fingerprint the parent sent."""
    from fake_requests import request

    def run(spec, run_dir, name, env, timeout):
        ran.append(name)
        for i, p in enumerate(spec["passes"]):
            pid = Point.model_validate(p).id
            if store.read_meta(run_dir, pid) is None:
                store.write_point(run_dir, store.PointResult(
                    point_id=pid, status="ok", point=p, engine_group=spec["name"], pass_index=i,
                    n_requests=1, fingerprint=spec.get("fingerprints", {}).get(pid)),
                    [request(pid)])
    return run


def test_multipass_resume_measures_passes_with_changed_settings_again(prof_path, tmp_path,
                                                                      monkeypatch):
    from speclab import multipass

    run_dir, ran = tmp_path / "run", []
    monkeypatch.setattr(multipass, "_subprocess", _fake_group(ran))
    group = multipass.same_engine_repeats("noise", Point(k=0), 2)
    with warnings_logged() as msgs:
        multipass.run_groups(profiles.load(prof_path), run_dir, [group])
        multipass.run_groups(profiles.load(prof_path), run_dir, [group])
        assert ran == ["group-noise"] and not msgs, "an unchanged group ran again"
        multipass.run_groups(profiles.load(prof_path, {"max_tokens": 48}), run_dir, [group])
    assert ran == ["group-noise"] * 2, "changed settings reused the earlier passes"
    assert len(msgs) == 2 and all("sampling.max_tokens 16 -> 48" in m for m in msgs), msgs
    assert len(list((run_dir / "superseded").glob("*/k0_*.json"))) == 2


# --------------------------------------------------------------------- timing rounds
def test_timed_passes_run_in_rounds_over_the_points(prof_path, tmp_path, fake):
    run_dir = tmp_path / "run"
    res, _ = sweep_run(prof_path, run_dir, {"timed_passes": 3})
    k0, k2 = (m["point_id"] for m in res)
    assert starts(fake) == [f"{k0} full 1", f"{k2} full 1", f"{k0} timing 2", f"{k2} timing 2",
                            f"{k0} timing 3", f"{k2} timing 3"]
    assert [len(m["passes"]) for m in res] == [3, 3]
    logs = run_dir / "logs"  # each round has its own log and spec; round 1's are kept
    assert f"{k0} full 1" in (logs / f"{k0}.log").read_text()
    assert "timing" not in json.loads((logs / f"{k0}.spec.json").read_text()).get("mode", "")
    assert f"{k0} timing 3" in (logs / f"{k0}.round3.log").read_text()
    assert json.loads((logs / f"{k0}.round3.spec.json").read_text())["round"] == 3
    sweep_run(prof_path, run_dir, {"timed_passes": 4})  # resuming adds only the missing round
    assert starts(fake)[6:] == [f"{k0} timing 4", f"{k2} timing 4"]
    pts, _ = store.load_results(run_dir)
    spd = analysis.speed(pts).set_index("point_id")
    # the stand-in's k-point passes 100*(1+k) + round tok/s
    ratios = [(300 + r) / (100 + r) for r in (1, 2, 3, 4)]
    assert spd.loc[k2, "n_rounds"] == 4
    assert spd.loc[k2, "speedup"] == pytest.approx(np.exp(np.mean(np.log(ratios))))
    assert spd.loc[k2, "speedup_lo"] < spd.loc[k2, "speedup"] < spd.loc[k2, "speedup_hi"]
    assert spd.loc[k0, "throughput_tok_s"] == pytest.approx(102.5)


def test_ratio_ci_is_a_t_interval_on_log_ratios():
    from scipy import stats

    num, den = [2.0, 2.4, 2.1], [1.0, 1.1, 1.0]
    r = np.log(np.divide(num, den))
    h = stats.t.ppf(0.975, 2) * r.std(ddof=1) / np.sqrt(3)
    assert analysis.ratio_ci(num, den) == pytest.approx(
        (np.exp(r.mean()), np.exp(r.mean() - h), np.exp(r.mean() + h)))
    assert np.isnan(analysis.ratio_ci([2.0], [1.0])[1])


# --------------------------------------------------------------------- damaged files
def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


@pytest.mark.parametrize("damage", ["truncated-json", "empty-json", "empty-object", "list",
                                    "truncated-parquet", "missing-parquet"])
def test_a_damaged_point_is_named_set_aside_and_measured_again(prof_path, tmp_path, fake,
                                                              damage):
    run_dir = tmp_path / "run"
    res, _ = sweep_run(prof_path, run_dir)
    pid = res[0]["point_id"]
    rec, meta = store.point_paths(run_dir, pid)
    target = rec if "parquet" in damage else meta
    {"truncated-json": lambda: _truncate(meta), "empty-json": lambda: meta.write_text(""),
     "empty-object": lambda: meta.write_text("{}"), "list": lambda: meta.write_text("[1]"),
     "truncated-parquet": lambda: _truncate(rec), "missing-parquet": rec.unlink}[damage]()
    res, msgs = sweep_run(prof_path, run_dir)
    assert [m["status"] for m in res] == ["ok", "ok"]
    assert len(msgs) == 1 and str(target) in msgs[0] and "measuring again" in msgs[0], msgs
    assert starts(fake)[2:] == [f"{pid} full 1"]
    if damage != "missing-parquet":
        assert list((run_dir / "superseded").glob(f"*/{target.name}")), "damaged file kept"


def test_analysis_never_takes_an_unreadable_parquet_as_ok(prof_path, tmp_path, fake):
    run_dir = tmp_path / "run"
    res, _ = sweep_run(prof_path, run_dir)
    rec, _ = store.point_paths(run_dir, res[1]["point_id"])
    _truncate(rec)
    (run_dir / "results" / "broken.json").write_text("{")
    with pytest.warns(UserWarning) as caught:
        pts, recs = store.load_results(run_dir)
    text = " ".join(str(w.message) for w in caught)
    assert str(rec) in text and "broken.json" in text
    assert dict(zip(pts.point_id, pts.status)) == {res[0]["point_id"]: "ok",
                                                   res[1]["point_id"]: "damaged"}
    assert set(recs.point_id) == {res[0]["point_id"]}
    assert list(analysis.speed(pts).point_id) == [res[0]["point_id"]]


# --------------------------------------------------------------------- the lock, Ctrl-C
def test_second_sweep_refused_then_ctrl_c_stops_cleanly(prof_path, tmp_path, fake):
    run_dir = tmp_path / "run"
    env = {**os.environ, "TRUST_SLEEP": "60", "TRUST_CHILD": "1"}
    # Ctrl-C as at a terminal, also when this suite was started in the background (where
    # the shell has the children ignore SIGINT)
    first = subprocess.Popen([sys.executable, "-c", CLI, "sweep", "--profile", str(prof_path),
                              "--run-id", str(run_dir)], env=env, stderr=subprocess.PIPE,
                             text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert wait_for(lambda: starts(fake), 120), "first sweep's worker never started"
        t0 = time.time()
        with pytest.raises(runlock.RunLocked) as e:
            sweep_run(prof_path, run_dir)
        assert time.time() - t0 < 10, "the second sweep must fail fast"
        assert f"pid {first.pid} on {socket.gethostname()}" in str(e.value)
        assert len(starts(fake)) == 1

        first.send_signal(signal.SIGINT)  # Ctrl-C
        _, err = first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("speclab: interrupted; finished points are kept in ") and \
        f"--run-id {run_dir}" in last, err
    assert wait_for(lambda: not processes_naming(str(run_dir)), 10), "a worker outlived Ctrl-C"
    assert not list((run_dir / "results").glob("*.json")), "an interrupted point was recorded"
    res, _ = sweep_run(prof_path, run_dir)  # the lock is free again
    assert [m["status"] for m in res] == ["ok", "ok"]


def test_a_stale_lock_is_taken_over(prof_path, tmp_path, fake):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").write_text(json.dumps({"pid": 2 ** 22 + 7, "host": "gone",
                                               "since": time.time() - 3600}))
    res, msgs = sweep_run(prof_path, run_dir)
    assert [m["status"] for m in res] == ["ok", "ok"]
    assert any("stale lock taken over" in m and str(2 ** 22 + 7) in m for m in msgs)


def test_notebook_kernel_of_the_holder_passes_through_the_lock(tmp_path):
    run_dir = tmp_path / "run"
    code = ("import sys; from speclab import runlock\n"
            "with runlock.hold(sys.argv[1]): print('inside')")
    with runlock.hold(run_dir):
        child = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": str(SRC)})
        assert child.stdout.strip() == "inside", child.stderr
        stranger = subprocess.run(
            [sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True,
            env={k: v for k, v in {**os.environ, "PYTHONPATH": str(SRC)}.items()
                 if k != runlock.ENV})
        assert stranger.returncode != 0 and "in use by pid" in stranger.stderr


def test_multipass_groups_and_rescoring_take_the_run_lock(prof_path, tmp_path):
    run_dir = tmp_path / "run"
    code = ("import sys; import pandas as pd; from speclab import multipass, profiles\n"
            "prof = profiles.load(sys.argv[2])\n"
            "for job in (lambda: multipass.run_groups(prof, sys.argv[1], []),\n"
            "            lambda: multipass.rescore(prof, sys.argv[1], pd.DataFrame(\n"
            "                {'prompt_id': [], 'position': [], 'prefix': []}))):\n"
            "    try:\n"
            "        job()\n"
            "    except Exception as e:\n"
            "        print(type(e).__name__)\n")
    with runlock.hold(run_dir):
        out = subprocess.run(
            [sys.executable, "-c", code, str(run_dir), str(prof_path)], capture_output=True,
            text=True, env={k: v for k, v in {**os.environ, "PYTHONPATH": str(SRC)}.items()
                            if k != runlock.ENV})
    assert out.stdout.split() == ["RunLocked", "RunLocked"], out.stdout + out.stderr


# --------------------------------------------------------------------- parent killed
SWEEP = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from speclab import launch, profiles, sweep
launch.WORKER = sys.argv[3]
sweep.run(profiles.load(sys.argv[1]), sys.argv[2])
"""


@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked", "python-m"])
def test_a_killed_sweep_takes_its_worker_and_the_workers_children_along(prof_path, tmp_path,
                                                                       fake, fork):
    """The worker forked from a zygote (CPU backend) or started with `python -m`."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "TRUST_SLEEP": "60", "TRUST_CHILD": "1", launch.FORK_ENV: fork}
    with running(["-c", SWEEP, str(prof_path), str(run_dir), "trust_worker"], env) as parent:
        assert wait_for(lambda: starts(fake) and len(processes_naming(str(run_dir))) >= 3, 120)
        parent.kill()
        parent.wait()
        assert wait_for(lambda: not processes_naming(str(run_dir)), 5), \
            f"left running: {processes_naming(str(run_dir))}"
    assert not list((run_dir / "results").glob("*.json"))


GROUPS = """
import sys
from speclab import multipass, profiles
from speclab.profiles import Point
multipass.run_groups(profiles.load("tiny-cpu"), sys.argv[1],
                     [multipass.same_engine_repeats("noise", Point(k=0), 2)])
"""


@pytest.mark.vllm
@pytest.mark.parametrize("child", ["worker", "multipass"])
def test_a_real_engine_process_dies_with_its_parent(tmp_path, fixture_cache, child):
    """speclab.worker (a sweep point) or speclab.multipass (a parity group, as a notebook
    runs it) on tiny-cpu, its parent killed while it starts its engine (its log has vLLM's
    engine line; a forked tiny point takes ~2 s in all): nothing is left."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]),
           "SPECLAB_CACHE": str(fixture_cache.parent)}
    args, name = {"worker": ([SWEEP, "tiny-cpu", str(run_dir), "speclab.worker"],
                             f"{run_dir}/logs/"),
                  "multipass": ([GROUPS, str(run_dir)], f"{run_dir}/logs/group-noise.spec")}[child]

    def starting_engine() -> bool:
        return any("Initializing a V1 LLM engine" in f.read_text(errors="replace")
                   for f in (run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() \
            else False

    def logs() -> str:  # what the failure messages show
        return "\n".join(f"--- {f.name}\n{launch.tail(f, 15)}"
                         for f in sorted((run_dir / "logs").glob("*.log")))

    with running(["-c", *args], env) as parent:
        assert wait_for(starting_engine, 300), f"no {child} started its engine\n{logs()}"
        assert processes_naming(name), f"the {child} ended before its parent was killed\n{logs()}"
        parent.kill()
        parent.wait()
        assert wait_for(lambda: not processes_naming(name), 5), \
            f"the {child} outlived its parent\n{logs()}"


# --------------------------------------------------------------------- early checks
def _profile(tmp_path, prof_path, **changes) -> Path:
    data = yaml.safe_load(prof_path.read_text())
    data.update(changes)
    p = tmp_path / "changed.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_engine_key_typo_named_with_the_closest_valid_key(prof_path, tmp_path, capsys):
    p = _profile(tmp_path, prof_path, engine={"gpu_memory_utilisation": 0.5})
    problems = preflight.check_env(profiles.load(p))
    assert any("engine.gpu_memory_utilisation" in m and "did you mean gpu_memory_utilization"
               in m for m in problems), problems
    assert cli.main(["profile", "check", str(p), "--strict"]) == 1
    assert "did you mean gpu_memory_utilization" in capsys.readouterr().out
    assert not preflight.engine_key_problems(profiles.load(prof_path))
    assert {"enforce_eager", "max_model_len", "kv_cache_memory_bytes",
            "gpu_memory_utilization", "speculative_config"} <= preflight.engine_arg_names()


def test_tp_beyond_the_numa_nodes_of_the_cpu_backend(prof_path, tmp_path, monkeypatch):
    tp = preflight.numa_nodes() + 1
    p = _profile(tmp_path, prof_path, grid={"num_speculative_tokens": [0],
                                            "layout": [{"tp": tp}]})
    assert any(f"TP x DP = {tp}" in m and "NUMA" in m for m in preflight.check_env(
        profiles.load(p)))
    assert cli.main(["profile", "check", str(p), "--strict"]) == 1
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(["0"] * tp))
    assert not any("NUMA" in m for m in preflight.check_env(profiles.load(p)))


def test_a_profile_that_is_not_a_mapping_names_its_file(tmp_path, capsys):
    p = tmp_path / "listy.yaml"
    p.write_text("- name: x\n- backend: cpu\n")
    with pytest.raises(profiles.ProfileError, match="listy.yaml.*mapping"):
        profiles.load(p)
    assert cli.main(["profile", "check", str(p), "--strict"]) == 2
    assert "listy.yaml" in capsys.readouterr().err


def test_unknown_notebook_refused_before_the_run_folder_exists(prof_path, tmp_path, capsys):
    run_dir = tmp_path / "never"
    assert cli.main(["run", "--profile", str(prof_path), "--run-id", str(run_dir),
                     "--notebooks", "01_sweeep"]) == 2
    assert "unknown notebook '01_sweeep' (did you mean 01_sweep?)" in capsys.readouterr().err
    assert not run_dir.exists()


@pytest.mark.parametrize("bad, message", [
    (b'{"id": "b", "prompt": "caf\xff"}\n', "not UTF-8 (byte 0xff at column 27)"),
    (b'{"id": "b", "prompt": \n', "bad prompt record"),
])
def test_a_bad_prompt_line_is_named_before_the_run(prof_path, tmp_path, capsys, fake, bad,
                                                   message):
    pfile = tmp_path / "prompts.jsonl"
    pfile.write_bytes(b'{"id": "a", "prompt": "fine"}\n' + bad)
    path = _profile(tmp_path, prof_path, prompts={"file": str(pfile)})
    run_dir = tmp_path / "never"
    assert cli.main(["sweep", "--profile", str(path), "--run-id", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"prompts.file: {pfile}:2: {message}" in err, err
    assert not run_dir.exists() and not starts(fake)


def test_an_only_that_matches_nothing_is_refused(prof_path, tmp_path, capsys):
    run_dir = tmp_path / "never"
    assert cli.main(["sweep", "--profile", str(prof_path), "--run-id", str(run_dir),
                     "--only", "k9_*"]) == 2
    err = capsys.readouterr().err
    assert "--only k9_*: matches none of the 2 points (k0_kv-auto_tp1_raw, " in err, err
    assert not run_dir.exists()


def test_a_run_folder_that_cannot_be_written_is_one_line(prof_path, capsys):
    assert cli.main(["sweep", "--profile", str(prof_path),
                     "--run-id", "/sys/kernel/speclab-test/run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speclab: error: ") and "'/sys/kernel/speclab-test" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_the_resume_line_repeats_the_override(prof_path):
    a = cli.build_parser().parse_args(["sweep", "--profile", str(prof_path), "--run-id", "r",
                                       "--override", "{prompts: {limit: 4}}"])
    cli._run_id(a, profiles.load(prof_path, {"prompts": {"limit": 4}}))
    assert a.resume.endswith(f"`speclab sweep --profile {prof_path} --run-id r "
                             "--override '{prompts: {limit: 4}}'`"), a.resume


@pytest.mark.parametrize("levels", ["0", "-1", "1,0", "x"])
def test_concurrency_below_one_is_refused_before_anything_starts(prof_path, tmp_path, capsys,
                                                                 levels):
    run_dir = tmp_path / "never"
    assert cli.main(["sweep", "--profile", str(prof_path), "--run-id", str(run_dir),
                     "--mode", "server", f"--concurrency={levels}"]) == 2
    assert "--concurrency" in capsys.readouterr().err and not run_dir.exists()
    with pytest.raises(ValueError, match="concurrency"):
        server.run_point(profiles.load(prof_path), Point(k=0), run_dir, [0])
    with pytest.raises(ValueError):
        Point(k=0, concurrency=0)


# --------------------------------------------------------------------- server mode
@pytest.fixture()
def silent_server():
    """A TCP server that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    conns = []
    stop = threading.Event()

    def accept():
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(sock.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    t.join()
    for c in conns:
        c.close()
    sock.close()


def test_client_times_out_on_a_server_that_stops_answering(silent_server):
    import httpx

    t0 = time.time()
    with pytest.raises(httpx.ReadTimeout):
        server.run_async(server.drive(silent_server, [("/v1/completions", {})], 1, timeout=1))
    assert time.time() - t0 < 10


@pytest.mark.vllm
def test_server_that_fails_to_start_or_hangs_is_the_points_error(prof_path, tmp_path,
                                                                 monkeypatch, silent_server):
    from contextlib import contextmanager

    prof = profiles.load(prof_path, {"timeout_s": 10})
    monkeypatch.setattr(server, "serve_command", lambda args, port: [
        sys.executable, "-c", "print('boom: cannot load the model'); raise SystemExit(3)"])
    metas = server.run_point(prof, Point(k=0), tmp_path / "run", [1, 4])
    assert [m["status"] for m in metas] == ["error", "error"]
    assert all("exited with 3" in m["error"] and "boom" in m["log_tail"] for m in metas)

    @contextmanager
    def hanging(*_a, **_k):
        yield silent_server

    monkeypatch.setattr(server, "running_server", hanging)
    t0 = time.time()
    metas = server.run_point(prof, Point(k=2), tmp_path / "run", [1])
    assert time.time() - t0 < 60
    assert metas[0]["status"] == "error" and "Timeout" in metas[0]["error"]


def test_fingerprint_takes_vllm_settings_but_not_where_things_are(prof_path, monkeypatch):
    prof = profiles.load(prof_path)
    base = fingerprint.of_point(prof, Point(k=0))["digest"]
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/elsewhere")
    assert fingerprint.of_point(prof, Point(k=0))["digest"] == base
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TORCH_SDPA")
    changed = fingerprint.of_point(prof, Point(k=0))
    assert changed["digest"] != base
    assert "env.VLLM_ATTENTION_BACKEND" in fingerprint.diff(
        {"parts": {**changed["parts"], "env": {}}}, changed)
