"""The Ray executor on a real local Ray cluster (this machine: a head and worker-node processes,
with GPUs declared on these GPU-less nodes standing in for real ones): tiny-cpu points through
`speclab sweep --executor ray` give the local executor's counters and tokens exactly, run
side by side with their own CUDA_VISIBLE_DEVICES, survive an interrupted driver and a node
that dies mid-sweep (retry recorded); the cluster leaves no process behind. The device's check
of two such runs (tools/gpu/compare_counters.py) on run folders written here."""

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from speclab import executor_ray, executors, profiles, store, sweep
from speclab.profiles import Point

# the notebook suite's sampling (conftest.SMOKE): its k = 0 and eagle3 k = 3 points are the
# local executor's reference
OVER = {"prompts": {"limit": 8}, "max_tokens": 32,
        "grid": {"method": ["eagle3"], "num_speculative_tokens": [0, 3]},
        "ray": {"resource": "GPU"}, "timed_passes": 2}
RAY = str(Path(sys.executable).parent / "ray")


# --------------------------------------------------------------------- no cluster needed
def test_placement_and_side_by_side():
    prof = profiles.load("tiny-cpu", {"exclusive_node": True, "ray": {"resource": "GPU"}})
    p = Point(k=0)
    assert executor_ray.bundles(prof, p, 8, exclusive=False) == [{"GPU": 1.0}]
    assert executor_ray.bundles(prof, p, 8, exclusive=True) == [{"GPU": 1.0}, {"GPU": 7.0}]
    assert executor_ray.task_options(prof, p) == {"num_cpus": 0, "max_retries": 0,
                                                  "num_gpus": 1}
    cpu = profiles.load("tiny-cpu")
    assert executor_ray.bundles(cpu, p, 2, exclusive=False) == [{"CPU": 1.0}]
    # a Ray point's fingerprint names what it asks for, not the driver's hardware
    on_ray = prof.model_copy(update={"executor": "ray"})
    assert executors.placement(on_ray) == {"executor": "ray", "resource": "GPU"}
    assert executors.placement(prof) is None  # executor local
    spans = {"a": ("n1", 0, 10), "b": ("n1", 5, None), "c": ("n2", 0, 10), "d": ("n1", 10, 12)}
    assert executor_ray.side_by_side(spans, "a", 10) == ["b"]
    assert executor_ray.side_by_side(spans, "d", 12) == ["b"]


def test_failed_point_keeps_its_error(tmp_path):
    """What a node sends back for a failed point lands in the run folder, error and log
    included, with the node's scratch paths turned into the run folder's."""
    p = Point(k=0)
    scratch = "/tmp/speclab-point-x/run"
    meta = {"point_id": p.id, "status": "error", "point": p.model_dump(mode="json"),
            "error": "worker exited with 1", "root_cause": "ValueError: boom",
            "command": f"python -m speclab.worker {scratch}/logs/{p.id}.spec.json"}
    out = {"meta": meta, "scratch": scratch, "node_id": "n1",
           "files": {f"logs/{p.id}.log": b"ValueError: boom\n",
                     f"logs/{p.id}.spec.json": json.dumps({"run_dir": scratch}).encode(),
                     f"results/{p.id}.json": json.dumps(meta).encode()}}
    got = executor_ray._store(tmp_path, p, out, {"kind": "ray", "node": "n1"}, [])
    on_disk = store.read_meta(tmp_path, p.id)
    assert on_disk == got and on_disk["root_cause"] == "ValueError: boom"
    assert on_disk["command"].endswith(f"{tmp_path}/logs/{p.id}.spec.json")
    assert (tmp_path / "logs" / f"{p.id}.log").read_bytes() == b"ValueError: boom\n"
    assert json.loads((tmp_path / "logs" / f"{p.id}.spec.json").read_text())["run_dir"] == \
        str(tmp_path)
    assert not (tmp_path / "points" / f"{p.id}.parquet").exists()


def _run(run_dir: Path, counters: dict, tokens: list[int], tok_s: list[float],
         nice: list[int] | None = None) -> Path:
    """A run folder holding one ok k = 3 point: its counters, one request, timed passes (with
    the niceness each ran at, where given)."""
    p = Point(k=3, draft_kv_cache_dtype="auto")
    rec = store.RequestRecord(
        point_id=p.id, k=3, kv_cache_dtype="auto", layout="tp1", prompt_format="raw",
        repeat=0, concurrency=1, prompt_id="p0", category="c", output_token_ids=tokens,
        n_output=len(tokens), step_tokens=[len(tokens)], step_times=[0.1], drafts=1,
        draft_tokens=3, accepted=2, accepted_per_pos=[1, 1, 0])
    store.write_point(run_dir, store.PointResult(
        point_id=p.id, status="ok", point=p.model_dump(mode="json"), counters=counters,
        throughput_tok_s=sum(tok_s) / len(tok_s),
        passes=[{"round": i + 1, "tok_s": t, **({"nice": nice[i]} if nice else {})}
                for i, t in enumerate(tok_s)]), [rec])
    return run_dir


COMPARE = runpy.run_path(str(Path(__file__).parents[1] / "tools/gpu/compare_counters.py"))


def _compare(tmp_path, capsys, b_counters, b_tokens, b_tok_s, nice=(None, None)):
    c = {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 2,
         "accepted_per_pos": [1, 1, 0]}
    a = _run(tmp_path / "a", c, [5, 6, 7], [100.0, 104.0, 96.0], nice[0])
    b = _run(tmp_path / "b", b_counters or c, b_tokens, b_tok_s, nice[1])
    out = tmp_path / "compare.json"
    rc = COMPARE["main"]([str(a), str(b), "--out", str(out)])
    return rc, capsys.readouterr().out, json.loads(out.read_text())


def test_compare_counters_checks_counters_and_tokens_and_reports_throughput(tmp_path, capsys):
    """tools/gpu/compare_counters.py (the Ray job's check): rc 1 on a counter or token
    difference; throughput against each run's 95% interval (t over 3 rounds: 100 +- 9.9)
    reported, within or outside, without failing; the niceness the passes ran at beside it."""
    rc, out, rep = _compare(tmp_path / "same", capsys, None, [5, 6, 7], [101.0, 99.0, 103.0])
    assert rc == 0, out
    assert "counters equal, tokens equal; tok/s 100.0 [90.1, 109.9] vs 101.0 [96.0, 106.0] " \
        "(3 and 3 rounds): within; B/A 1.01 [0.93, 1.10]" in out
    assert (rep["identical"], rep["within"]) == (1, 1)
    assert rep["points"][0]["b"] == {"tok_s": 101.0, "lo": pytest.approx(96.03, abs=0.01),
                                     "hi": pytest.approx(105.97, abs=0.01), "rounds": 3,
                                     "nice": [], "passes": [101.0, 99.0, 103.0]}
    assert "niceness" not in out  # runs from before the passes recorded it
    rc, out, rep = _compare(tmp_path / "slow", capsys, None, [5, 6, 7], [70.0, 71.0, 72.0],
                            nice=([0, 0, 0], [15, 0, 15]))
    assert rc == 0 and ": OUTSIDE; B/A 0.71 [0.65, 0.78]; niceness 0 vs 0,15" in out
    assert rep["within"] == 0 and rep["points"][0]["b"]["nice"] == [0, 15]
    # passes spread +-20% (as the H100's of 2026-12-06): within, and the ratio's interval
    # says the comparison could not have told a 30% deficit from noise
    rc, out, rep = _compare(tmp_path / "noisy", capsys, None, [5, 6, 7], [120.0, 80.0, 101.0])
    q = rep["points"][0]["ratio"]
    assert rc == 0 and rep["within"] == 1 and q["lo"] < 0.7 and q["hi"] > 1.3
    rc, out, _ = _compare(tmp_path / "tokens", capsys, None, [5, 6, 8], [101.0, 99.0, 103.0])
    assert rc == 1 and "tokens differ" in out
    other = {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 1,
             "accepted_per_pos": [1, 0, 0]}
    rc, out, rep = _compare(tmp_path / "counters", capsys, other, [5, 6, 7],
                            [101.0, 99.0, 103.0])
    assert rc == 1 and "!=" in out and rep["identical"] == 0
    rc, out, _ = _compare(tmp_path / "one", capsys, None, [5, 6, 7], [101.0])
    assert rc == 0 and "101.0 (3 and 1 rounds): no interval; B/A 1.01\n" in out


# --------------------------------------------------------------------- a real cluster
class LocalCluster:
    """A head and worker-node processes on this machine (ray.cluster_utils, as Ray's own
    multi-node tests use); a node is killed by the pids of its processes."""

    def __init__(self):
        from ray._common.utils import get_default_ray_temp_dir
        from ray.cluster_utils import Cluster

        self.temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # socket paths must be short
        # Ray 2.60 writes the head's address under its default temp dir even when given
        # another one, and fails where that dir does not exist yet (a fresh machine)
        os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
        self.cluster = Cluster(initialize_head=True, connect=False, head_node_args={
            "num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "temp_dir": self.temp})
        self.address = self.cluster.address
        self.seen: set[int] = set()  # every pid of the cluster ever seen
        self.tree(self.cluster.head_node)

    def start(self, gpus: int):
        node = self.cluster.add_node(num_cpus=1, num_gpus=gpus)
        self.tree(node)
        return node

    def tree(self, node) -> list[psutil.Process]:
        procs = []
        for infos in node.all_processes.values():
            for info in infos:
                try:
                    p = psutil.Process(info.process.pid)
                    procs += [p, *p.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
        self.seen |= {p.pid for p in procs}
        return procs

    def workers(self, node) -> list[psutil.Process]:
        out = []
        for p in self.tree(node):
            try:
                if "speclab.worker" in " ".join(p.cmdline()):
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def kill(self, node) -> None:
        """The node dies: every process of it at once (its points' workers included)."""
        for p in self.tree(node):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.cluster.remove_node(node, allow_graceful=False)

    def stop(self) -> None:
        for node in [*self.cluster.worker_nodes, self.cluster.head_node]:
            self.tree(node)
        self.cluster.shutdown()

    def left(self) -> list[int]:
        alive = []
        for pid in self.seen:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive


def _wait(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (v := cond()):
            return v
        assert proc is None or proc.poll() is None, f"driver exited ({proc.returncode}) " + what
        time.sleep(0.5)
    raise AssertionError(f"timed out: {what}")


@pytest.mark.timeout(300)
def test_ray_check_places_a_gpu_point_like_the_executor_and_reports_a_missing_module():
    """tools/gpu/ray_check.py (the device's check of the Ray layer) on a Ray instance with a
    GPU declared: the realshape-ray-h200 point gets its placement group's node, GPU 0 as
    CUDA_VISIBLE_DEVICES and speclab in the task and its child; a module the task cannot
    import fails the check. Its workers run at the driver's niceness, not Ray's 15 (the likely
    cause of 4 of 6 host-bound passes 12-31% slow on an H100): the instance it starts as the
    executor does sets their niceness to 0; where the instance keeps 15 (the control), the
    task lowers its own where the OS allows it (root) and the check fails where it does not."""
    def check(**env):
        r = subprocess.run([sys.executable, "tools/gpu/ray_check.py", "--gpus", "1",
                            "--modules", "json,no_such_module"], cwd=Path(__file__).parents[1],
                           capture_output=True, text=True, timeout=240, check=False,
                           env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **env})
        assert r.returncode == 1, r.stdout + r.stderr
        return r.stdout.splitlines()

    lines = check()
    assert "ok   placed on the group's node" in lines
    assert "ok   GPU ids ['0'], CUDA_VISIBLE_DEVICES 0" in lines
    assert "FAIL speclab, json, no_such_module in the task" in lines
    assert "FAIL speclab, json, no_such_module in its child" in lines
    assert any("no_such_module: No module named 'no_such_module'" in x for x in lines)
    me = os.getpriority(os.PRIO_PROCESS, 0)
    assert (f"ok   niceness {me} at the task's start, {me} after node_niceness, {me} in its "
            f"child (the driver's: {me})") in lines
    lines = check(RAY_worker_niceness="15")
    after, ok = (me, "ok  ") if os.geteuid() == 0 else (15, "FAIL")
    assert (f"{ok} niceness 15 at the task's start, {after} after node_niceness, {after} in "
            f"its child (the driver's: {me})") in lines


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_ray_sweep_on_a_local_cluster(tmp_path, fixture_cache, smoke_suite, monkeypatch):
    # the cluster's processes start with this environment (speclab importable on its nodes)
    monkeypatch.setenv("SPECLAB_CACHE", str(fixture_cache.parent))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(Path(sweep.__file__).parents[1]), os.environ.get("PYTHONPATH")])))
    env = dict(os.environ)
    prof = profiles.load("tiny-cpu", OVER)
    ids = [p.id for p in sweep.expand(prof)]
    ray_dir = tmp_path / "ray"
    # the local reference for counters and tokens: the session's notebook suite measured
    # these points with the local executor (conftest.smoke_suite; two engine starts saved)
    local_dir = smoke_suite[0] / "runs" / "smoke"

    cluster = LocalCluster()
    try:
        node2 = cluster.start(gpus=2)
        cmd = [sys.executable, "-m", "speclab", "sweep", "--profile", "tiny-cpu", "--run-id",
               str(ray_dir), "--override", json.dumps(OVER), "--executor", "ray",
               "--ray-address", cluster.address]

        # an interrupted driver: its workers stop, nothing half-written, the rerun resumes
        driver = subprocess.Popen(cmd, env=env, start_new_session=True)
        _wait(lambda: len(cluster.workers(node2)) == 2, 300, "two points side by side", driver)
        driver.send_signal(signal.SIGTERM)
        driver.wait(timeout=120)
        _wait(lambda: not cluster.workers(node2), 60, "workers stopped with the driver")
        assert not list((ray_dir / "results").glob("*.json"))

        log = tmp_path / "driver.log"
        with open(log, "w") as f:
            driver = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                      start_new_session=True)
            _wait(lambda: len(cluster.workers(node2)) == 2, 300, "points placed again", driver)
            cluster.kill(node2)  # the node dies mid-sweep; a new one joins
            cluster.start(gpus=2)
            assert driver.wait(timeout=900) == 0, log.read_text()[-3000:]
        out = log.read_text()
        assert sum(line.startswith("[") and " ok on " in line and " in " in line
                   for line in out.splitlines()) == 2, out
        assert "ETA" in out and "sweep done" in out
        assert "timing round" not in out  # rounds ran on the nodes, in the points' tasks

        metas = {i: store.read_meta(ray_dir, i) for i in ids}
        for i, m in metas.items():
            ex = m["executor"]
            assert m["status"] == "ok" and ex["kind"] == "ray" and ex["attempts"] == 2, m
            # Ray's workers start at niceness 15; the point's task moves back to the raylet's
            assert ex["nice"] == (os.getpriority(os.PRIO_PROCESS, 0) if os.geteuid() == 0
                                  else 15), ex
            assert {p["nice"] for p in m["passes"]} == {ex["nice"]}  # the engine's too
            assert ex["retries"][0]["node_id"] != ex["node_id"]  # rerun elsewhere
            assert m["side_by_side"] == [j for j in ids if j != i]
            assert [p["round"] for p in m["passes"]] == [1, 2], m["passes"]
            assert (ray_dir / "logs" / f"{i}.round2.log").exists()
        assert {m["executor"]["cuda_visible_devices"] for m in metas.values()} == {"0", "1"}

        # exactly the local executor's counters and tokens, same sampling and engine
        _, lrec = store.load_results(local_dir)
        _, rrec = store.load_results(ray_dir)
        for i in ids:
            ref = store.read_meta(local_dir, i)
            assert ref["status"] == "ok" and "executor" not in ref, i
            assert {p["nice"] for p in ref["passes"]} == {os.getpriority(os.PRIO_PROCESS, 0)}
            assert (metas[i]["sampling"], metas[i]["engine_args"]) == (
                ref["sampling"], ref["engine_args"]), i
            assert metas[i]["counters"] == ref["counters"], i
            a = lrec[lrec.point_id == i].set_index("prompt_id").output_token_ids
            b = rrec[rrec.point_id == i].set_index("prompt_id").output_token_ids
            assert {k: list(v) for k, v in a.items()} == {k: list(v) for k, v in b.items()}

        # finished: a rerun resumes with nothing to do
        before = {p: p.stat().st_mtime_ns for p in ray_dir.glob("[pr]*s/*")}
        assert subprocess.run(cmd, env=env, timeout=300, check=False).returncode == 0
        assert {p: p.stat().st_mtime_ns for p in ray_dir.glob("[pr]*s/*")} == before
    finally:
        cluster.stop()
    assert not cluster.left(), f"left behind: {cluster.left()}"
