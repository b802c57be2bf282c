"""The Ray executor: every point is one Ray task in a placement group (STRICT_PACK: its TP x DP
GPUs, or CPUs, on one node) that runs `launch.run_point` in a scratch folder on that node and
returns the folder's files; the driver writes them through the run store. Nothing assumes a
shared filesystem.

Placement groups are asked for all points at once, so Ray runs as many side by side as the
cluster holds; a point's task sees the GPUs Ray gave it as CUDA_VISIBLE_DEVICES. A point that
shared its node with others while it ran lists them in `side_by_side`. A point whose node or
worker dies is placed again (profile.ray.retries times, each failure recorded in
`executor.retries`); a point that fails on its own keeps its error like under the local
executor. Interrupting the driver cancels the tasks in flight (their workers are stopped) and
keeps every point already written.

Ray starts its workers at niceness 15 (`worker_niceness`, Ray's ray_config_def.h) and a
point's worker and vLLM's engine core inherit it; a host-bound decode loop then gives its core
away to any other process. The point's task moves back to its node's niceness (the raylet's)
where the OS lets it, an instance the executor starts has `RAY_worker_niceness=0`, and each
point records the niceness it ran at (`executor.nice`)."""

from __future__ import annotations

import io
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from speclab import launch, profiles, store
from speclab.profiles import Profile, ProfileError, prompt_file

log = logging.getLogger(__name__)


def resource(profile: Profile) -> str:
    """What one TP x DP rank of a point asks Ray for."""
    return profile.ray.resource or ("GPU" if profile.backend == "cuda" else "CPU")


def bundles(profile: Profile, point, node_size: float, exclusive: bool) -> list[dict]:
    """The point's placement group: its ranks in one bundle; an exclusive point also holds
    the rest of a node of `node_size` in a second bundle, so nothing else lands there."""
    res, n = resource(profile), point.layout.gpus
    out = [{res: float(n)}]
    if exclusive and node_size > n:
        out.append({res: float(node_size - n)})
    return out


def task_options(profile: Profile, point) -> dict:
    res, n = resource(profile), point.layout.gpus
    opts = {"num_cpus": n if res == "CPU" else 0, "max_retries": 0}  # retries: ours, recorded
    if res == "GPU":
        opts["num_gpus"] = n
    elif res != "CPU":
        opts["resources"] = {res: n}
    return opts


def side_by_side(spans: dict[str, tuple], point_id: str, end: float) -> list[str]:
    """Points that held resources on the same node while `point_id` did (spans: point id ->
    (node id, start, end or None while running))."""
    node, start, _ = spans[point_id]
    return sorted(q for q, (n, a, b) in spans.items()
                  if q != point_id and n == node and a < end and (b is None or b > start))


# --------------------------------------------------------------------- on the node
def run_on_node(profile_json: str, point_json: str, prompts: bytes, asked_cpus: bool,
                rounds: int = 1, fp: dict | None = None) -> dict:
    """Ray task body: run one point through `launch.run_point` in a scratch folder (with the
    driver's prompt file), then its timing rounds 2..rounds on the same node (the driver may
    have no GPU), and return that folder's files with where and how it ran. fp: the driver's
    fingerprint of the point (its prompt file, not the node's scratch copy)."""
    import ray

    t0 = time.time()
    if not asked_cpus:
        _drop_ray_thread_cap()
    nice = node_niceness()
    prof = Profile.model_validate_json(profile_json)
    point = profiles.Point.model_validate_json(point_json)
    with tempfile.TemporaryDirectory(prefix="speclab-point-") as tmp:
        pfile = Path(tmp) / Path(prof.prompts.file).name
        store.atomic_write(pfile, prompts)
        prof = prof.model_copy(update={"prompts": prof.prompts.model_copy(
            update={"file": str(pfile)})})
        scratch = Path(tmp) / "run"
        meta = launch.run_point(prof, point, scratch, fp)
        for rnd in range(2, rounds + 1):
            if meta["status"] == "ok":
                meta = launch.timing_round(prof, point, scratch, rnd)
        files = {str(p.relative_to(scratch)): p.read_bytes() for p in scratch.rglob("*")
                 if p.is_file() and not p.name.startswith(".")}
    ctx = ray.get_runtime_context()
    return {"meta": meta, "files": files, "scratch": str(scratch), "node_id": ctx.get_node_id(),
            "host": platform.node(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "task_s": time.time() - t0, "nice": nice}


def node_niceness() -> int:
    """Give this process the niceness of the process that started it (the raylet) where the
    OS allows it (lowering needs CAP_SYS_NICE) and return the niceness it now has, which the
    point's worker and its engine inherit (the module docstring says why)."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        parent = os.getpriority(os.PRIO_PROCESS, os.getppid())
        if parent < now:
            os.setpriority(os.PRIO_PROCESS, 0, parent)
    except OSError:
        pass
    return os.getpriority(os.PRIO_PROCESS, 0)


def _drop_ray_thread_cap() -> None:
    """Ray sets OMP_NUM_THREADS to a task's CPUs (1 when it asked none) unless the node's
    environment has it; a point that asked for GPUs gets the node's environment instead, like
    a worker of the local executor."""
    try:
        start_env = Path("/proc/self/environ").read_bytes().split(b"\0")
    except OSError:
        return
    if not any(v.startswith(b"OMP_NUM_THREADS=") for v in start_env):
        os.environ.pop("OMP_NUM_THREADS", None)


# --------------------------------------------------------------------- on the driver
def connect(address: str | None, **init) -> None:
    """ray.init as the executor does: join the cluster at `address`, or start an instance
    here (no dashboard) whose workers run at niceness 0, not Ray's 15; no log forwarding."""
    import ray

    if not address:
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=address, log_to_driver=False,
             **({} if address else {"include_dashboard": False}), **init)


def run(profile: Profile, run_dir: Path, points: list, fps: dict[str, dict]
        ) -> Iterator[dict]:
    """Run `points` on the Ray cluster; yield each point's metadata once it is written, with
    the driver's fingerprint (fps, by point id) as each point's."""
    if not points:
        return
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise ProfileError("executor ray needs Ray: pip install 'speclab[ray]'") from None

    own = not ray.is_initialized()
    if own:
        connect(profile.ray.address or os.environ.get("RAY_ADDRESS"))
    spans: dict[str, tuple] = {}  # point id -> (node id, placed, released)
    pgs: dict[str, object] = {}
    waiting: dict = {}  # placement group ready ref -> point id
    running: dict = {}  # task ref -> point id
    try:
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        res = resource(profile)
        node_size = max((n["Resources"].get(res, 0) for n in nodes.values()), default=0)
        need = max(p.layout.gpus for p in points)
        if need > node_size:
            raise ProfileError(f"a point needs {need} {res} on one node; the largest node of "
                               f"the Ray cluster has {node_size:g}")
        grid = {p.id for p in profiles.expand(profile)}
        by_id = {p.id: p for p in points}
        retries: dict[str, list] = {p.id: [] for p in points}
        prompts = prompt_file(profile).read_bytes()
        remote = ray.remote(run_on_node)

        def place(pid: str) -> None:
            pg = placement_group(bundles(profile, by_id[pid], node_size,
                                         profile.exclusive_node and pid in grid),
                                 strategy="STRICT_PACK")
            pgs[pid] = pg
            waiting[pg.ready()] = pid

        def release(pid: str) -> None:
            remove_placement_group(pgs.pop(pid))
            node, start, _ = spans[pid]
            spans[pid] = (node, start, time.time())

        for p in points:
            place(p.id)
        while waiting or running:
            [ref], _ = ray.wait([*waiting, *running], num_returns=1)
            if ref in waiting:
                pid = waiting.pop(ref)
                table = ray.util.placement_group_table(pgs[pid])
                spans[pid] = (table["bundles_to_node_id"][0], time.time(), None)
                p = by_id[pid]
                task = remote.options(**task_options(profile, p), scheduling_strategy=
                                      PlacementGroupSchedulingStrategy(pgs[pid], 0)).remote(
                    profile.model_dump_json(), p.model_dump_json(), prompts,
                    resource(profile) == "CPU", profile.timed_passes if pid in grid else 1,
                    fps.get(pid))
                running[task] = pid
                continue
            pid = running.pop(ref)
            node_id = spans[pid][0]
            try:
                out = ray.get(ref)
            except ray.exceptions.RayTaskError as e:  # speclab's code on the node raised
                out = {"error": f"{type(e.cause).__name__}: {e.cause}", "node_id": node_id}
            except ray.exceptions.RayError as e:  # the node or its worker died
                release(pid)
                nodes = {n["NodeID"]: n for n in ray.nodes()}
                retries[pid].append({"node": _label(nodes, node_id), "node_id": node_id,
                                     "error": f"{type(e).__name__}: {e}"[:2000],
                                     "at": time.time()})
                log.warning(f"point {pid}: node {_label(nodes, node_id)} failed "
                            f"({type(e).__name__}); " + ("placing it again" if len(
                                retries[pid]) <= profile.ray.retries else "giving up"))
                if len(retries[pid]) <= profile.ray.retries:
                    place(pid)
                    continue
                out = {"error": f"{len(retries[pid])} node failures, the last: "
                       f"{type(e).__name__}", "node_id": node_id}
            if pid in pgs:
                release(pid)
            nodes = {n["NodeID"]: n for n in ray.nodes()}
            yield _store(run_dir, by_id[pid], out, {
                "kind": "ray", "node": _label(nodes, out["node_id"]),
                "node_id": out["node_id"], "host": out.get("host"),
                "bundles": bundles(profile, by_id[pid], node_size,
                                   profile.exclusive_node and pid in grid),
                "gpu_ids": out.get("gpu_ids"),
                "cuda_visible_devices": out.get("cuda_visible_devices"),
                "task_s": out.get("task_s"), "nice": out.get("nice"),
                "attempts": len(retries[pid]) + 1,
                "retries": retries[pid]}, side_by_side(spans, pid, spans[pid][2]))
    finally:
        _stop(ray, running, waiting, pgs, remove_placement_group)
        if own:
            ray.shutdown()


def _store(run_dir: Path, point, out: dict, executor: dict, beside: list[str]) -> dict:
    """Write what the node returned through the run store (paths of its scratch folder
    become the run folder's); a point without results gets an error record."""
    files = out.get("files", {})
    scratch = out.get("scratch")
    rec_name, meta_name = (str(p.relative_to(run_dir)) for p in store.point_paths(run_dir,
                                                                                    point.id))
    for name, data in files.items():
        if name in (rec_name, meta_name):
            continue
        if name.endswith(".json") and scratch:
            data = data.replace(scratch.encode(), str(run_dir).encode())
        store.atomic_write(run_dir / name, data)
    if "meta" in out:
        meta = json.loads(json.dumps(out["meta"]).replace(scratch, str(run_dir)))
    else:
        meta = {"point_id": point.id, "status": "error", "point": point.model_dump(mode="json"),
                "error": out["error"]}
    records = store.read_request_file(io.BytesIO(files[rec_name])) if (
        meta["status"] == "ok" and rec_name in files) else None
    return store.write_point(run_dir, store.PointResult.model_validate(
        {**meta, "executor": executor, "side_by_side": beside}), records)


def _label(nodes: dict, node_id: str) -> str:
    n = nodes.get(node_id, {})
    return f"{n.get('NodeManagerAddress', '?')} [{node_id[:8]}]"


def _stop(ray, running: dict, waiting: dict, pgs: dict, remove_placement_group) -> None:
    """Cancel tasks in flight (a KeyboardInterrupt in the task: run_point stops its worker)
    and give back every placement group."""
    for ref in running:
        ray.cancel(ref)
    if running:
        ray.wait(list(running), num_returns=len(running), timeout=60)
    for pg in pgs.values():
        remove_placement_group(pg)
    running.clear()
    waiting.clear()
    pgs.clear()
