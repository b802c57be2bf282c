#!/usr/bin/env python3
"""Does Ray work here as the Ray executor uses it? (tools/gpu/README.md "Ray on the device")

    PYTHONPATH=$PYTHONPATH:$SPECLAB_RAY_SITE python3 tools/gpu/ray_check.py \\
        [--profile realshape-ray-h200] [--gpus N] [--modules vllm]

Starts a Ray instance on this machine as speclab.executor_ray.run does (no dashboard, no log
forwarding; --gpus N declares N GPUs, for a machine without them), places one point of the
profile in a STRICT_PACK placement group with the resources the executor asks for
(executor_ray.bundles, task_options), and runs a task there that reports its node, GPU ids
and CUDA_VISIBLE_DEVICES and imports speclab and --modules, in the task and in a process it
starts (as launch.run_point starts the point's worker), and the niceness they run at (Ray's
workers start at 15; the point's must run at the driver's). One line per check; exit 1 if
any fails. Seconds, no GPU work."""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def probe(modules: list[str]) -> dict:
    """The task: where it runs, and which modules import in it and in a child process."""
    import importlib

    import ray

    from speclab import executor_ray

    started_at = os.getpriority(os.PRIO_PROCESS, 0)
    nice = executor_ray.node_niceness()
    missing = []
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError as e:
            missing.append(f"{m}: {e}")
    code = ("import os; print(os.getpriority(os.PRIO_PROCESS, 0), flush=True); "
            f"import {', '.join(modules)}")
    child = subprocess.run([sys.executable, "-c", code],
                           capture_output=True, text=True, check=False)
    return {"node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "missing": missing, "child_rc": child.returncode, "child_err": child.stderr[-500:],
            "nice": (started_at, nice,
                     int(child.stdout.split()[0]) if child.stdout.strip() else None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="realshape-ray-h200")
    ap.add_argument("--gpus", type=int, help="GPUs to declare to Ray (default: detected)")
    ap.add_argument("--modules", default="", help="comma-separated, beyond speclab")
    a = ap.parse_args(argv)
    import ray
    from ray.util.placement_group import (
        placement_group,
        placement_group_table,
        remove_placement_group,
    )
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from speclab import executor_ray, profiles

    prof = profiles.load(a.profile)
    point = profiles.expand(prof)[-1]
    modules = ["speclab", *filter(None, a.modules.split(","))]
    print(f"ray {ray.__version__} from {Path(ray.__file__).parent}")
    t0 = time.time()
    executor_ray.connect(None, **({} if a.gpus is None else {"num_gpus": a.gpus}))
    bad = 0
    try:
        res = executor_ray.resource(prof)
        node_size = max(n["Resources"].get(res, 0) for n in ray.nodes() if n["Alive"])
        print(f"init: {time.time() - t0:.1f} s, {node_size:g} {res} on the node")
        if node_size < point.layout.gpus:  # the sweep refuses such a cluster too
            print(f"FAIL a point needs {point.layout.gpus} {res}")
            return 1
        pg = placement_group(executor_ray.bundles(prof, point, node_size, False),
                             strategy="STRICT_PACK")
        ray.get(pg.ready(), timeout=60)
        node = placement_group_table(pg)["bundles_to_node_id"][0]
        out = ray.get(ray.remote(probe).options(
            **executor_ray.task_options(prof, point),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote(modules),
            timeout=120)
        remove_placement_group(pg)
        checks = {"placed on the group's node": out["node_id"] == node,
                  f"{res} ids {out['gpu_ids']}, CUDA_VISIBLE_DEVICES "
                  f"{out['cuda_visible_devices']}": res != "GPU" or (
                      out["gpu_ids"] and out["cuda_visible_devices"] == ",".join(
                          out["gpu_ids"])),
                  f"{', '.join(modules)} in the task": not out["missing"],
                  f"{', '.join(modules)} in its child": out["child_rc"] == 0,
                  "niceness {} at the task's start, {} after node_niceness, {} in its child "
                  "(the driver's: {})".format(*out["nice"], os.getpriority(os.PRIO_PROCESS, 0)):
                      out["nice"][1:] == (os.getpriority(os.PRIO_PROCESS, 0),) * 2}
        for what, ok in checks.items():
            print(f"{'ok  ' if ok else 'FAIL'} {what}")
            bad += not ok
        for m in out["missing"]:
            print(f"     {m}")
        if out["child_rc"]:
            print(f"     {out['child_err']}")
    finally:
        ray.shutdown()
    print(f"{'ray ok' if not bad else f'{bad} failed'} in {time.time() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
