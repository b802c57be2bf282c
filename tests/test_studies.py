"""The GPU study plan as data (speclab.studies, src/speclab/studies/*.yaml): it plans exactly
the jobs tools/gpu/lab.py defined in code before the move (tests/data/lab_plan.json, captured
from that code for both releases and two stamps), and a study that cannot be planned fails
with one line per problem."""

import itertools
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from speclab import fixtures, profiles, prompts, studies
from speclab.fixtures import dsv4_layer_rig as LR
from speclab.fixtures import dsv4_rigs as RG
from speclab.fixtures import dsv4_shapes as SH
from speclab.fixtures import realshape as R

ROOT = Path(__file__).resolve().parents[1]
BEFORE = json.loads((ROOT / "tests/data/lab_plan.json").read_text())
# studies added after the move (their jobs come after the captured ones), and studies whose
# jobs changed since (left out on both sides; test_parity_jobs_cover_the_profile holds them)
LATER = ("mtp", "ray-realshape", "realshape-cost")
CHANGED = ("parity",)
LATER_FIXTURES = ("dial-dsv4-mtp", "dial-dsv4-mtp-eagle3")
PY = "/opt/torch/.venv/bin/python3"  # the device's interpreter (the capture wrote {python})


def _py(x):
    if isinstance(x, str):
        return x.replace("{python}", PY)
    if isinstance(x, list):
        return [_py(v) for v in x]
    if isinstance(x, dict):
        return {k: _py(v) for k, v in x.items()}
    return x


def test_the_capture_covers_both_releases_and_two_stamps():
    assert sorted(BEFORE) == ["0.22.0 20261205b", "0.22.0 20990101", "0.26.0 20261205b",
                              "0.26.0 20990101"]
    assert all(len(v["jobs"]) == 43 for v in BEFORE.values())


@pytest.mark.parametrize("key", sorted(BEFORE))
def test_plan_equals_lab_py_before_the_move(key):
    """Every job, in order, field by field (command argv, env, dependencies, timeouts, GPUs,
    run folders, release, flags), plus the set-up's fixtures and run folder."""
    release, label = key.split()
    before = BEFORE[key]
    plan = studies.plan(studies.stamp(label, release), PY)
    assert plan.stamp == before["STAMP"] and before["RELTAG"] in plan.stamp
    got = [j.lab_dict() for j in plan.jobs if j.study not in LATER + CHANGED]
    kept = [j for j in _py(before["jobs"]) if not j["name"].startswith(CHANGED)]
    assert [j["name"] for j in got] == [j["name"] for j in kept]
    for g, want in zip(got, kept):
        assert isinstance(g["after"], tuple) and isinstance(g["cmd"], list)
        assert json.loads(json.dumps(g)) == want, g["name"]
    assert [f for f in plan.fixtures if f not in LATER_FIXTURES] == before["FIXTURES"]
    assert plan.setup_run == before["DIAL"] and plan.vars["COST"] == before["COST"]


def test_stamp_and_release_tag():
    assert studies.release_tag("0.22") == "vllm022" == studies.release_tag("0.22.0")
    assert studies.release_tag("1.3.2") == "vllm103"
    assert studies.stamp("20261201", "0.26") == "20261201-vllm026"
    assert studies.stamp("20261201", None) == "20261201"


def test_the_stamp_reaches_every_run_folder_and_path():
    plan = studies.plan("S7AMP", PY)
    for j in plan.jobs:
        assert all("S7AMP" in r for r in j.runs), j.name
        paths = [x for x in shlex.split(" ".join(j.cmd[2:] if j.cmd[0] == "bash" else j.cmd))
                 if x.startswith("data/runs/")]
        assert all("S7AMP" in p for p in paths), j.name
    assert "S7AMP" in plan.setup_run


def test_every_profile_and_script_a_job_names_exists():
    plan = studies.plan("x", "python")
    named, targets = set(), set()
    for j in plan.jobs:
        words = shlex.split(j.cmd[2]) if j.cmd[:2] == ["bash", "-c"] else j.cmd
        named |= {b for a, b in itertools.pairwise(words) if a == "--profile"}
        targets |= {b for a, b in itertools.pairwise(words) if a == "--target"}
        for w in words:
            if w.endswith(".py"):
                assert (ROOT / w).is_file(), (j.name, w)
    assert len(named) == 8
    for name in named:
        profiles.load(name)
    assert "realshape-dsv4" in targets and targets <= set(fixtures.FIXTURES)


def test_study_files_live_in_the_package():
    """Shipped in the wheel with the package (hatch's packages = src/speclab)."""
    assert studies.STUDY_DIR.parent == Path(studies.__file__).parent
    assert [s.name for s in studies.load_studies()] == ["dsv4-overlay", "layer-rig",
                                                        "convention", "parity", "mtp",
                                                        "ray-realshape", "realshape-cost"]


def _study(tmp_path, text: str):
    (tmp_path / "s.yaml").write_text(text)
    return studies.load_studies(tmp_path)


GOOD = """
name: s
order: 1
vars: {RUN: r-<stamp>}
jobs:
  - name: a
    timeout: 60
    runs: [<RUN>]
    steps:
      - [<python>, x.py, --out, data/runs/<RUN>, '{"k": 1}', 'a b']
  - name: b
    timeout: 60
    after: [a]
    runs: [<RUN>]
    join: then
    steps:
      - shell: export X=$Y
      - [<python>, x.py, install]
      - on_exit: [<python>, x.py, uninstall]
      - [<python>, y.py, '*glob*']
"""


def test_steps_become_one_command(tmp_path):
    plan = studies.plan("S", "/py", _study(tmp_path, GOOD))
    a, b = plan.jobs
    assert a.cmd == ["/py", "x.py", "--out", "data/runs/r-S", '{"k": 1}', "a b"]
    assert a.vllm == "0.22" and a.after == () and a.runs == ["r-S"]
    assert b.cmd == ["bash", "-c", ("export X=$Y; /py x.py install; trap '/py x.py uninstall' "
                                    "EXIT; /py y.py '*glob*'")]
    assert b.after == ("a",)


@pytest.mark.parametrize("change, message", [
    (("<RUN>]\n    steps", "<RUM>]\n    steps"), "s: a: unknown <RUM>"),
    (("after: [a]", "after: [z]"), "job b: after z, which no study has"),
    (("name: b", "name: a"), "job a: named twice"),
    (("timeout: 60\n    runs", "timeout: 5\n    runs"), "jobs.0.timeout"),
])
def test_a_study_that_cannot_be_planned_says_why(tmp_path, change, message):
    text = GOOD.replace(*change)
    with pytest.raises(studies.StudyError, match=message):
        studies.plan("S", "/py", _study(tmp_path, text))


def test_a_lone_shell_step_is_refused(tmp_path):
    text = GOOD.replace("      - [<python>, x.py, --out, data/runs/<RUN>, '{\"k\": 1}', 'a b']",
                        "      - shell: echo hi")
    with pytest.raises(studies.StudyError, match="a job of one step runs an argv list"):
        _study(tmp_path, text)


def test_unknown_keys_are_refused(tmp_path):
    with pytest.raises(studies.StudyError, match="jobs.0.gpu"):
        _study(tmp_path, GOOD.replace("timeout: 60\n    runs: [<RUN>]\n    steps",
                                      "timeout: 60\n    gpu: 2\n    runs: [<RUN>]\n    steps", 1))


def test_parity_jobs_cover_the_profile_once_on_both_releases():
    """Every point the parity profile's sweep runs (grid and one-engine-per-point arms) is
    chosen by exactly one job's --only; each one-engine group has its job; 0.26 has the same
    jobs as 0.22 (`also`), their `after` renamed alike."""
    import fnmatch

    from speclab import parity

    prof = profiles.load("tiny-dsv4-neartie-accept-h200")
    arms = parity.plan(prof, prof.parity.arms, k_values=prof.parity.k_values,
                       spec_k=prof.parity.spec_k)
    ids = {p.id for p in profiles.expand(prof) + parity.points_of(arms)}
    plan = studies.plan("S-vllm022", PY)
    jobs = [j for j in plan.jobs if j.study == "parity" and j.vllm == "0.22"]
    chosen = {}
    for j in jobs:
        if "--only" in j.cmd:
            globs = j.cmd[j.cmd.index("--only") + 1].split(",")
            for i in ids:
                if any(fnmatch.fnmatch(i, g) for g in globs):
                    chosen.setdefault(i, []).append(j.name)
    assert set(chosen) == ids and all(len(v) == 1 for v in chosen.values()), chosen
    grouped = {j.cmd[-1] for j in jobs if "groups" in j.cmd}
    assert grouped == {g.name for g in parity.groups_of(arms)}
    copies = {j.name: j for j in plan.jobs if j.study == "parity" and j.vllm == "0.26"}
    assert sorted(copies) == sorted(f"{j.name}-026" for j in jobs)
    assert all(copies[f"{j.name}-026"].after == tuple(f"{a}-026" for a in j.after)
               for j in jobs)


def test_also_copies_a_studys_jobs_to_another_release():
    st = studies.Study(name="s", order=1, also=["0.26"], vars={"RUN": "r-<stamp>"},
                       jobs=[{"name": "a", "timeout": 10, "runs": ["<RUN>"], "steps": [["x"]]},
                             {"name": "b", "timeout": 10, "runs": ["<RUN>"], "after": ["a"],
                              "steps": [["y"]]}])
    plan = studies.plan("S", PY, [st])
    assert [(j.name, j.vllm, j.after) for j in plan.jobs] == [
        ("a", "0.22", ()), ("b", "0.22", ("a",)), ("a-026", "0.26", ()),
        ("b-026", "0.26", ("a-026",))]
    with pytest.raises(ValueError):
        studies.Study(name="s", order=1, also=["0.26.1"])


STUB = """#!/bin/bash
echo "$* | $PYTHONPATH" >> "$CALLS"
[ "$3" != sweep ] || exit "${SWEEP_RC:-0}"
"""


def test_ray_realshape_sweeps_locally_then_on_ray_with_its_layer_and_compares(tmp_path):
    """Study ray-realshape (issue 23 item 5) run with a stand-in interpreter that records its
    argv and PYTHONPATH: k = 3 on both executors, then plain, each job after the one before;
    a local job builds the fixtures in a process of its own, then sweeps without Ray on its
    path; a Ray job stops before anything runs when no Ray layer was unpacked, else sweeps the
    same points with --executor ray, the Ray layer last on PYTHONPATH, and compares the two
    run folders; a failed sweep skips the comparison."""
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    plan = studies.plan("S", str(stub))
    jobs = [j for j in plan.jobs if j.study == "ray-realshape"]
    assert [(j.name, j.after) for j in jobs] == [
        ("realshape-local-k3-026", ()), ("ray-realshape-k3-026", ("realshape-local-k3-026",)),
        ("realshape-local-k0-026", ("ray-realshape-k3-026",)),
        ("ray-realshape-k0-026", ("realshape-local-k0-026",))]
    assert all(j.vllm == "0.26" and j.exclusive for j in jobs)
    base = {k: v for k, v in os.environ.items() if k != "SPECLAB_RAY_SITE"}

    def run(job, **env):
        calls = tmp_path / "calls"
        calls.unlink(missing_ok=True)
        r = subprocess.run(job.cmd, env={**base, **job.env, "CALLS": str(calls),
                                         "PYTHONPATH": "/bundle/site", **env},
                           capture_output=True, text=True, check=False)
        return r.returncode, calls.read_text().splitlines() if calls.exists() else []

    run_a, run_b = "data/runs/h200-realshape-sweep-S", "data/runs/h200-realshape-sweep-S-ray"
    compare = f"tools/gpu/compare_counters.py {run_a} {run_b} --out {run_b}/compare.json"
    for local, ray, k in ((jobs[0], jobs[1], "k3_*"), (jobs[2], jobs[3], "k0_*")):
        sweep = f"-m speclab sweep --profile realshape-ray-h200 --run-id {run_a[10:]}"
        assert run(local, SPECLAB_RAY_SITE="/ray") == (0, [
            "-m speclab fixtures build realshape-dsv4-eagle3 | /bundle/site",
            f"{sweep} --only {k} | /bundle/site"])
        rc, calls = run(ray)
        assert rc != 0 and calls == []
        assert run(ray, SPECLAB_RAY_SITE="/ray") == (0, [
            f"{sweep}-ray --executor ray --only {k} | /bundle/site:/ray",
            f"{compare} | /bundle/site:/ray"])
        assert run(ray, SPECLAB_RAY_SITE="/ray", SWEEP_RC="1") == (
            1, [f"{sweep}-ray --executor ray --only {k} | /bundle/site:/ray"])
        assert ray.env == {"RAY_USAGE_STATS_ENABLED": "0"} and ray.runs == [run_b[10:], run_a[10:]]


def test_ray_realshapes_profile_runs_batch_1_graphs_within_the_draft_vocabulary():
    """Its profile (realshape-ray-h200): plain and k = 3 at batch 1 with CUDA graphs and 3+
    timed passes on the 4-layer real-shape pair; every prompt is 256 ids (a power of two: a
    warmed mHC prefill) whose greedy continuation of max_tokens (+ k and the reference's extra
    tokens) stays in the draft vocabulary, so the oracle can draft at every position."""
    prof = profiles.load("realshape-ray-h200")
    assert [p.id for p in profiles.expand(prof)] == ["k0_kv-fp8_tp1_raw",
                                                     "k3_kv-fp8_dkv-auto_tp1_raw"]
    assert (prof.target, prof.draft) == ("fixture:realshape-dsv4",
                                         "fixture:realshape-dsv4-eagle3")
    assert R.TARGET_DEFAULTS["num_layers"] == 4 and prof.timed_passes >= 3
    assert prof.engine["max_num_seqs"] == 1 and prof.engine["enforce_eager"] is False
    succ, _ = RG.dial_successors(SH.REAL_CONFIG["vocab_size"], 0, R.TARGET_DEFAULTS["mismatch"])
    k = max(prof.grid.num_speculative_tokens)
    rows = prompts.load(profiles.prompt_file(prof))
    assert len(rows) == 4
    for row in rows:
        ids = row.prompt_token_ids
        cont = R.greedy(succ.tolist(), ids, prof.max_tokens + k + LR.EXTRA_TOKENS)
        assert len(ids) == 256 and max(*ids, *cont) < SH.DRAFT_VOCAB, row.id


def test_gpu_tag_names_the_model_and_the_ray_run_folder_carries_it():
    """`<gpu>` is the model from nvidia-smi's name, so a run on an H100 is not filed as an
    H200 one (the Ray study's run folder); a name without a model gives "gpu"."""
    assert [studies.gpu_tag(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200",
                                         "NVIDIA B200", "NVIDIA GeForce RTX 4090", "")] == [
        "h100", "h200", "b200", "4090", "gpu"]
    runs = {g: {r for j in studies.plan("S", "py", gpu=g).jobs
                if j.study == "ray-realshape" for r in j.runs} for g in ("h100", "h200")}
    assert runs["h100"] == {"h100-realshape-sweep-S", "h100-realshape-sweep-S-ray"}
    assert runs["h200"] == {"h200-realshape-sweep-S", "h200-realshape-sweep-S-ray"}
