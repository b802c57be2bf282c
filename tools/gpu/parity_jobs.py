#!/usr/bin/env python3
"""The parity study's one-engine groups on the device, and its jobs (issue 16; prepared, NOT
RUN yet).

The jobs are the `parity` study (src/speclab/studies/40-parity.yaml: what each arm and
control is, and why), which `tools/gpu/lab.py` runs with the other studies; every job fits
one device call and resumes (finished points and passes are kept). Two of them run the
profile's one-engine parity groups (the plain-repeat noise passes in one engine, the
positive controls) through `groups` below.

    python tools/gpu/parity_jobs.py list                       # the jobs, as lab.py runs them
    python tools/gpu/parity_jobs.py groups PROFILE RUN [NAME ...]   # one-engine groups
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
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
