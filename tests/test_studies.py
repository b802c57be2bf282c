"""The GPU study plan as data (speclab.studies, src/speclab/studies/*.yaml): it plans exactly
the jobs tools/gpu/lab.py defined in code before the move (tests/data/lab_plan.json, captured
from that code for both releases and two stamps), and a study that cannot be planned fails
with one line per problem."""

import itertools
import json
import shlex
from pathlib import Path

import pytest

from speclab import profiles, studies

ROOT = Path(__file__).resolve().parents[1]
BEFORE = json.loads((ROOT / "tests/data/lab_plan.json").read_text())
# studies added after the move (their jobs come after the captured ones), and studies whose
# jobs changed since (left out on both sides; test_parity_jobs_cover_the_profile holds them)
LATER = ("mtp",)
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
    named = set()
    for j in plan.jobs:
        words = shlex.split(j.cmd[2]) if j.cmd[:2] == ["bash", "-c"] else j.cmd
        named |= {b for a, b in itertools.pairwise(words) if a == "--profile"}
        for w in words:
            if w.endswith(".py"):
                assert (ROOT / w).is_file(), (j.name, w)
    assert len(named) == 7
    for name in named:
        profiles.load(name)


def test_study_files_live_in_the_package():
    """Shipped in the wheel with the package (hatch's packages = src/speclab)."""
    assert studies.STUDY_DIR.parent == Path(studies.__file__).parent
    assert [s.name for s in studies.load_studies()] == ["dsv4-overlay", "layer-rig",
                                                        "convention", "parity", "mtp"]


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
