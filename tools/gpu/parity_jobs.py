#!/usr/bin/env python3
"""The parity study's one-engine groups and rescoring on the device, and its jobs (issue 26;
first run on the H200 2026-12-04, vLLM 0.26).

The jobs are the `parity` study (src/speclab/studies/40-parity.yaml: what each arm and
control is, and why), which `tools/gpu/lab.py` runs with the other studies; every job fits
one device call and resumes (finished points and passes are kept). Three of them run here:
the profile's one-engine parity groups (the plain-repeat noise passes in one engine, the
positive controls), and `rescore`, which re-runs through the plain engine the prefix of every
divergence no plain pass saw (the report, notebook 03 with `execute false`, is rendered on
the CPU from the returned run folder: the device bundle has no Jupyter).

    python tools/gpu/parity_jobs.py list                       # the jobs, as lab.py runs them
    python tools/gpu/parity_jobs.py groups PROFILE RUN [NAME ...]   # one-engine groups
    python tools/gpu/parity_jobs.py rescore PROFILE RUN        # divergences to rescore
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # speclab of this checkout

STUDY = "parity"


def run_groups(profile: str, run: str, names: list[str]) -> int:
    """Run the named one-engine groups (all when none named) of the profile's parity plan."""
    from speclab import multipass, parity, preflight, profiles, store

    prof = profiles.load(profile)
    problems = preflight.check_env(prof)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    plan = parity.plan(prof, prof.parity.arms, k_values=prof.parity.k_values,
                       spec_k=prof.parity.spec_k)
    groups = [g for g in parity.groups_of(plan) if not names or g.name in names]
    unknown = set(names) - {g.name for g in groups}
    if unknown:
        print(f"unknown groups {sorted(unknown)}; the plan has "
              f"{[g.name for g in parity.groups_of(plan)]}", file=sys.stderr)
        return 2
    run_dir, _ = store.run_dirs(run)
    multipass.run_groups(prof, run_dir, groups)
    pts, _ = store.load_results(run_dir)
    want = {p.id for g in groups for p in g.passes}
    ok = set(pts.point_id[pts.status == "ok"]) if len(pts) else set()
    return 0 if want <= ok else 1


def rescore(profile: str, run: str) -> int:
    """Rescore, through the plain engine, the divergences of the run's arms that no plain pass
    saw (what notebook 03 does when it executes), into the run's rescore file."""
    import pandas as pd

    from speclab import multipass, parity, profiles, store

    prof = profiles.load(profile)
    plan = parity.plan(prof, prof.parity.arms, k_values=prof.parity.k_values,
                       spec_k=prof.parity.spec_k)
    run_dir, _ = store.run_dirs(run)
    pts, recs = store.results_for(run_dir, parity.points_of(plan, grouped=None))
    path = run_dir / multipass.RESCORE_FILE
    rescored = pd.read_parquet(path) if path.exists() else None
    todo = parity.rescore_requests(parity.analyze(plan, recs, pts, parity.settings(prof),
                                                  rescored=rescored).cmp)
    print(f"{len(todo)} divergence(s) no plain pass saw: rescoring" if len(todo)
          else "no divergence to rescore")
    if len(todo):
        multipass.rescore(prof, run_dir, todo)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["list"]:
        from speclab import studies

        for j in studies.plan("STAMP", "python").jobs:
            if j.study == STUDY:
                print(f"{j.name:22s} {j.gpus} GPU  {j.timeout:4d} s  {' '.join(j.cmd)}"
                      + (f"  (after {', '.join(j.after)})" if j.after else ""))
        return 0
    if argv[:1] == ["groups"] and len(argv) >= 3:
        return run_groups(argv[1], argv[2], argv[3:])
    if argv[:1] == ["rescore"] and len(argv) == 3:
        return rescore(argv[1], argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
