"""Studies: the GPU jobs the lab runs on the device, as data (src/speclab/studies/*.yaml).

A study file holds jobs: each a name, the vLLM release it needs, its GPUs and timeout, the
jobs it must start after, whether it needs its GPUs to itself (timing) or is expected to
fail, the run folders it writes (under data/runs) and its steps. A step is an argv list, a
line of shell (`shell:`), or a command the job's shell runs on exit (`on_exit:`, armed where
it stands). One argv step runs as it is; several run in one `bash -c`, joined by `&&`
(`join: and`, the default) or `;` (`join: then`), each argv shell-quoted.

Strings are templated: `<stamp>` (the run folders' suffix: date or LAB_STAMP and the release,
`stamp()`), `<python>` (the interpreter that runs the jobs), `<gpu>` (the GPU model the jobs
run on, `gpu_tag()`: h100, h200, ...) and the study's `vars` (in order; a var may use earlier
ones). An unknown `<name>` is an error.

`plan(stamp, python, gpu)` reads every study, in `order`, and returns the jobs as
`tools/gpu/lab.py` runs them, plus the fixtures its set-up builds. lab.py keeps the running:
order, slots, resume across calls, stopping. `load_studies` and `plan` fail with one line
per problem (`StudyError`).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

STUDY_DIR = Path(__file__).resolve().parent / "studies"
RELEASE = r"^\d+\.\d+$"  # major.minor, as lab.py's --vllm
_VAR = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)>")


class StudyError(ValueError):
    """A study that cannot be planned; the message says why, one problem per line."""


def release_tag(release: str) -> str:
    """The release as run folders carry it: 0.22 -> vllm022, 0.26.0 -> vllm026."""
    major, minor = release.split(".")[:2]
    return f"vllm{int(major)}{int(minor):02d}"


def stamp(label: str, release: str | None) -> str:
    """Run-folder suffix: the label (a date, or LAB_STAMP to keep a second session of the same
    day apart) and, where known, the release: 20261201-vllm022."""
    return "-".join(filter(None, (label, release and release_tag(release))))


class Shell(BaseModel):
    """A line of shell, run as written (no quoting), e.g. an `export`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    shell: str


class OnExit(BaseModel):
    """A command the job's shell runs when it exits (`trap '…' EXIT`), armed at this step:
    undoes what the steps before it installed."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    on_exit: list[str] = Field(min_length=1)


Step = list[str] | Shell | OnExit


class Job(BaseModel):
    """One GPU job as a study file writes it (strings not yet templated)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    gpus: int = Field(1, ge=1)
    timeout: int = Field(ge=10)  # seconds
    vllm: str | None = Field(None, pattern=RELEASE)  # None: the study's
    after: list[str] = []  # jobs of the same call it starts after (JIT caches they fill)
    exclusive: bool = False  # its GPUs to itself (timing)
    expect_fail: bool = False  # a failure is the result (counts as done)
    runs: list[str] = Field(min_length=1)  # run folders it writes, under data/runs
    env: dict[str, str] = {}
    steps: list[Step] = Field(min_length=1)
    join: Literal["and", "then"] = "and"

    @model_validator(mode="after")
    def _steps(self) -> Job:
        if len(self.steps) == 1 and not isinstance(self.steps[0], list):
            raise ValueError("a job of one step runs an argv list (shell: and on_exit: need "
                             "other steps)")
        if any(not s for s in self.steps if isinstance(s, list)):
            raise ValueError("an argv step is empty")
        if sum(isinstance(s, OnExit) for s in self.steps) > 1:
            raise ValueError("at most one on_exit step (bash keeps one EXIT trap)")
        return self


GIVEN = ("stamp", "python", "gpu")  # template names every study has


class Study(BaseModel):
    """One study file: its jobs in priority order and what they share."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    order: int  # where its jobs go in the plan, lower first
    vllm: str = Field("0.22", pattern=RELEASE)  # release of the jobs that name none
    # more releases every job also runs on: a copy named <job>-<minor> (mtp -> mtp-026 for
    # 0.26), its `after` jobs renamed alike; the run folders differ by <stamp>'s release
    also: list[Annotated[str, Field(pattern=RELEASE)]] = []
    vars: dict[str, str] = {}
    fixtures: list[str] = []  # checkpoints lab.py's set-up builds (speclab fixtures build)
    setup_run: str | None = None  # run folder of lab.py's set-up (selftest.json, env.json)
    jobs: list[Job] = []

    @field_validator("vars")
    @classmethod
    def _var_names(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
               or k in GIVEN]
        if bad:
            raise ValueError(f"vars: {bad} (names are identifiers; {', '.join(GIVEN)} are given)")
        return v


class PlannedJob(BaseModel):
    """A job as lab.py runs it: templated, its steps made one command."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    gpus: int
    timeout: int
    cmd: list[str]
    runs: list[str]
    env: dict[str, str]
    expect_fail: bool
    vllm: str
    after: tuple[str, ...]
    exclusive: bool
    study: str

    def lab_dict(self) -> dict:
        """The job as lab.py's runner keeps it (a dict; `study` left out)."""
        return {k: v for k, v in self.model_dump().items() if k != "study"}


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    stamp: str
    jobs: list[PlannedJob]
    fixtures: list[str]  # in order, each once
    setup_run: str | None
    vars: dict[str, str]  # every study's, templated

    def job(self, name: str) -> PlannedJob:
        return next(j for j in self.jobs if j.name == name)


def _fill(text: str, values: dict[str, str], where: str) -> str:
    unknown = sorted({m for m in _VAR.findall(text) if m not in values})
    if unknown:
        raise StudyError(f"{where}: unknown {', '.join(f'<{u}>' for u in unknown)} "
                         f"(known: {', '.join(f'<{k}>' for k in values)})")
    return _VAR.sub(lambda m: values[m.group(1)], text)


def command(steps: list[list[str] | Shell | OnExit], join: str = "and") -> list[str]:
    """The argv of templated steps: one argv step as it is, else `bash -c` over the steps."""
    if len(steps) == 1:
        return list(steps[0])
    parts = []
    for s in steps:
        if isinstance(s, Shell):
            parts.append(s.shell)
        elif isinstance(s, OnExit):
            parts.append(f"trap {shlex.quote(shlex.join(s.on_exit))} EXIT")
        else:
            parts.append(shlex.join(s))
    return ["bash", "-c", {"and": " && ", "then": "; "}[join].join(parts)]


def copy_for(job: Job, release: str) -> Job:
    """The job on another release (`Study.also`): `<name>-<minor>`, after jobs alike."""
    tag = "-" + release_tag(release).removeprefix("vllm")
    return job.model_copy(update={"name": job.name + tag, "vllm": release,
                                  "after": [a + tag for a in job.after]})


def load_study(path: Path) -> Study:
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise StudyError(f"{path}: {e}") from None
    try:
        return Study.model_validate(raw)
    except ValidationError as e:
        raise StudyError("\n".join(
            f"{Path(path).name}: {'.'.join(map(str, err['loc'])) or '(top)'}: {err['msg']}"
            for err in e.errors())) from None


def load_studies(directory: Path | None = None) -> list[Study]:
    """Every study file (*.yaml) of the directory, in `order` (then name)."""
    found = sorted(Path(directory or STUDY_DIR).glob("*.yaml"))
    if not found:
        raise StudyError(f"no study files in {directory or STUDY_DIR}")
    return sorted((load_study(p) for p in found), key=lambda s: (s.order, s.name))


def gpu_tag(name: str) -> str:
    """A run-folder prefix for a GPU model from its `nvidia-smi` name: "NVIDIA H100 80GB HBM3"
    -> h100, "NVIDIA H200" -> h200, "NVIDIA B200" -> b200; "gpu" for a name without a model
    number."""
    m = re.search(r"\b([A-Z]{0,2}\d{3,4})\b", name.upper())
    return m.group(1).lower() if m else "gpu"


def plan(stamp: str, python: str = sys.executable, studies: list[Study] | None = None,
         gpu: str = "h200") -> Plan:
    """The lab's jobs for one stamp and GPU model (`gpu_tag`), in priority order, with the
    set-up's fixtures."""
    studies = load_studies() if studies is None else studies
    jobs: list[PlannedJob] = []
    fixtures: list[str] = []
    all_vars: dict[str, str] = {}
    setup_runs = []
    problems = []
    for st in studies:
        values = {"stamp": stamp, "python": python, "gpu": gpu}
        try:
            for k, v in st.vars.items():
                values[k] = _fill(v, values, f"{st.name}: vars.{k}")
            if st.setup_run:
                setup_runs.append(_fill(st.setup_run, values, f"{st.name}: setup_run"))
            for j in [*st.jobs, *(copy_for(j, r) for r in st.also for j in st.jobs)]:
                where = f"{st.name}: {j.name}"
                steps = [s if not isinstance(s, list) else [_fill(x, values, where) for x in s]
                         for s in j.steps]
                steps = [OnExit(on_exit=[_fill(x, values, where) for x in s.on_exit])
                         if isinstance(s, OnExit) else
                         Shell(shell=_fill(s.shell, values, where)) if isinstance(s, Shell)
                         else s for s in steps]
                jobs.append(PlannedJob(
                    name=j.name, gpus=j.gpus, timeout=j.timeout, cmd=command(steps, j.join),
                    runs=[_fill(r, values, where) for r in j.runs],
                    env={k: _fill(v, values, where) for k, v in j.env.items()},
                    expect_fail=j.expect_fail, vllm=j.vllm or st.vllm, after=tuple(j.after),
                    exclusive=j.exclusive, study=st.name))
        except StudyError as e:
            problems.append(str(e))
        all_vars.update({k: v for k, v in values.items() if k in st.vars})
        fixtures += [f for f in st.fixtures if f not in fixtures]
    names = [j.name for j in jobs]
    problems += [f"job {n}: named twice" for n in sorted({n for n in names if names.count(n) > 1})]
    problems += [f"job {j.name}: after {a}, which no study has" for j in jobs for a in j.after
                 if a not in names]
    problems += [f"job {j.name}: after itself" for j in jobs if j.name in j.after]
    if len(setup_runs) > 1:
        problems.append(f"setup_run set by more than one study: {setup_runs}")
    if problems:
        raise StudyError("\n".join(problems))
    return Plan(stamp=stamp, jobs=jobs, fixtures=fixtures,
                setup_run=setup_runs[0] if setup_runs else None, vars=all_vars)


def describe(job: PlannedJob) -> str:
    """One line: name, release, GPUs, timeout, flags, command (lab.py --list)."""
    flags = [f"after {', '.join(job.after)}"] if job.after else []
    flags += [f for f, on in (("exclusive", job.exclusive), ("expect-fail", job.expect_fail))
              if on]
    cmd = job.cmd[2] if job.cmd[:2] == ["bash", "-c"] else shlex.join(job.cmd)
    return (f"{job.name:26s} vLLM {job.vllm}  {job.gpus} GPU  {job.timeout:4d} s  {cmd}"
            + (f"  ({'; '.join(flags)})" if flags else ""))
