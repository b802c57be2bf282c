#!/usr/bin/env python3
"""The parity study's H200 jobs (issue 16; prepared, NOT RUN yet), and the one-engine groups
they need.

Profile `tiny-dsv4-neartie-accept-h200`: the near-tie bigram DeepSeek-V4 with the counting
oracle draft (acceptance and margins known in advance:
data/expected/neartie-dial-dsv4-h200.json), the plain-repeat noise arm (3 passes in separate
engines, 3 in one engine), speculation at k = 1 and 3, target KV fp8_e4m3 with speculation,
batch 1, VLLM_BATCH_INVARIANT=1, TP=2 + EP (2 GPUs, else "not run"), and the positive
controls (verify- and accept-path biases of 0.02-0.5 nats at a quarter of the positions,
three position draws each). The wrong-aux-convention control on DeepSeek-V4 is lab.py's
`layer-rig-neg-input` job (EAGLE3_AUX_LAYER_CONVENTION=input on the layer-exact rig, whose
draft reads its aux states; this pair's draft ignores them), judged by acceptance.

`tools/gpu/lab.py` adds these jobs (`add_jobs`); every job fits one device call and resumes
(finished points and passes are kept). The last one renders notebook 03 (rescoring any
divergence no plain pass saw) into data/runs/<run>/report.html.

    python tools/gpu/parity_jobs.py list                       # the jobs, as lab.py runs them
    python tools/gpu/parity_jobs.py groups PROFILE RUN [NAME ...]   # one-engine groups
"""

from __future__ import annotations

import sys

PROFILE = "tiny-dsv4-neartie-accept-h200"


def add_jobs(job, sweep, stamp: str, py: str = sys.executable) -> list[str]:
    """Register the parity jobs with lab.py's `job`; returns their names."""
    run = f"h200-dsv4-neartie-accept-{stamp}"
    groups = [py, "tools/gpu/parity_jobs.py", "groups", PROFILE, run]
    tp1 = "*_tp1_*"
    names = []

    def add(name, gpus, timeout, cmd, **kw):
        job(name, gpus, timeout, cmd, [run], **kw)
        names.append(name)

    add("parity-plain", 1, 540, sweep(PROFILE, run, "--with-parity", "--only", f"k0{tp1}"))
    add("parity-spec", 1, 540, sweep(PROFILE, run, "--with-parity", "--only", f"k[13]{tp1}"),
        after=("parity-plain",))
    add("parity-noise-same", 1, 300, [*groups, "noise"], after=("parity-plain",))
    for kind in ("verify-bias", "accept-bias"):
        add(f"parity-{kind}", 1, 540, [*groups, f"{kind}-k3"], after=("parity-spec",))
    add("parity-tp2-ep", 2, 540, sweep(PROFILE, run, "--with-parity", "--only", "*tp2-ep*"))
    add("parity-report", 1, 420, [py, "-m", "speclab", "run", "--profile", PROFILE, "--run-id",
                                  run, "--notebooks", "03_parity"],
        after=tuple(n for n in names if n != "parity-tp2-ep"))
    return names


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
        jobs = []
        add_jobs(lambda *a, **kw: jobs.append((a, kw)),
                 lambda p, r, *x: ["speclab", "sweep", "--profile", p, "--run-id", r, *x],
                 "STAMP", "python")
        for (name, gpus, timeout, cmd, runs), kw in jobs:
            print(f"{name:22s} {gpus} GPU  {timeout:4d} s  {' '.join(cmd)}"
                  + (f"  (after {', '.join(kw['after'])})" if kw.get("after") else ""))
        return 0
    if argv[:1] == ["groups"] and len(argv) >= 3:
        return run_groups(argv[1], argv[2], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
