"""The shipped prompt sets (data/prompts/*.jsonl) and speclab.prompts on them: loading,
provenance, seeded sampling, raw vs chat forms."""

import hashlib
import importlib.util
import json
import re
import sys
import zipfile
from pathlib import Path

import pytest

from speclab import prompts

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "prompts"
PROMPT_FILES = sorted(DATA.glob("*.jsonl"))
# Sets whose provenance is kept elsewhere (not built by tools/build_prompts.py).
BUILT_ELSEWHERE = {"tiny-code"}  # speclab.fixtures.prompts, from data/corpus (PSF licence)
LICENCES = {"MIT", "Apache-2.0", "BSD-3-Clause", "CC-BY-4.0", "PSF-2.0"}


def _load_build_script():
    spec = importlib.util.spec_from_file_location("build_prompts",
                                                  ROOT / "tools" / "build_prompts.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


build_prompts = _load_build_script()
BUILT = sorted(build_prompts.SETS)


def raw_records(path):
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def provenance_table(name):
    text = (DATA / f"{name}.PROVENANCE.md").read_text(encoding="utf-8")
    return text, dict(re.findall(r"^\| ([a-z0-9 ]+) \| (.+) \|$", text, re.MULTILINE))


def test_built_sets_are_all_there():
    names = {p.stem for p in PROMPT_FILES}
    assert {"mtbench", "humaneval", "gsm-symbolic"} <= set(BUILT) <= names


@pytest.mark.parametrize("path", PROMPT_FILES, ids=lambda p: p.stem)
def test_every_set_loads_with_unique_ids_and_categories(path):
    recs = raw_records(path)
    loaded = prompts.load(path)
    assert len(loaded) == len(recs) > 0
    assert len({p.id for p in loaded}) == len(loaded)
    assert all(r.get("category") for r in recs), "every record names its category"
    assert [p.category for p in loaded] == [r["category"] for r in recs]
    assert all(p.raw_text().strip() or p.prompt_token_ids for p in loaded)


@pytest.mark.parametrize("name", BUILT)
def test_built_set_has_provenance_licence_and_matching_digest(name):
    path = DATA / f"{name}.jsonl"
    assert path.stat().st_size < 300_000, "keep prompt files small"
    text, table = provenance_table(name)
    ps = build_prompts.SETS[name]
    licence = table["licence"].split(" ")[0]
    assert licence in LICENCES and licence == ps.wheel.licence
    assert f"`{ps.wheel.package}` {ps.wheel.version}" in table["package"]
    assert ps.wheel.sha256 in table["archive sha256"]
    for member, digest in ps.wheel.members.items():
        assert f"| `{member}` | `{digest}` |" in text
    # the JSONL is exactly what the build wrote (not edited by hand since)
    assert hashlib.sha256(path.read_bytes()).hexdigest() in table["output sha256"]
    assert table["output"].endswith(f"{len(raw_records(path))} prompts")
    lic = (DATA / f"{name}.LICENSE").read_text()
    assert {"MIT": "Permission is hereby granted", "Apache-2.0": "Apache License"}[licence] in lic
    assert f"tools/build_prompts.py {name}" in text


@pytest.mark.parametrize("path", [p for p in PROMPT_FILES if p.stem not in BUILT_ELSEWHERE],
                         ids=lambda p: p.stem)
def test_every_set_here_has_a_provenance_naming_a_licence(path):
    prov = path.with_name(f"{path.stem}.PROVENANCE.md")
    assert prov.exists(), f"{path.name} needs {prov.name}"
    _, table = provenance_table(path.stem)
    assert table.get("licence", "").split(" ")[0] in LICENCES
    assert hashlib.sha256(path.read_bytes()).hexdigest() in table.get("output sha256", "")


def test_mtbench_content():
    recs = raw_records(DATA / "mtbench.jsonl")
    loaded = prompts.load(DATA / "mtbench.jsonl")
    assert [p.id for p in loaded] == [f"mtbench-{i}" for i in range(81, 161)]
    cats = {c: sum(p.category == c for p in loaded) for c in {p.category for p in loaded}}
    assert cats == dict.fromkeys(["writing", "roleplay", "reasoning", "math", "coding",
                                  "extraction", "stem", "humanities"], 10)
    for p, r in zip(loaded, recs):
        assert len(r["turns"]) == 2 and p.extra["turns"] == r["turns"]


def test_humaneval_content():
    loaded = prompts.load(DATA / "humaneval.jsonl")
    assert [p.id for p in loaded] == [f"HumanEval/{i}" for i in range(164)]
    for p in loaded:
        assert f"def {p.extra['entry_point']}(" in p.prompt
        assert "canonical_solution" not in p.extra and "test" not in p.extra


def test_gsm_symbolic_content():
    loaded = prompts.load(DATA / "gsm-symbolic.jsonl")
    assert [p.id for p in loaded] == [f"gsm-symbolic-s42-{i:04d}" for i in range(200)]
    assert {p.category for p in loaded} == {"math"}
    assert not any("Give the result" in p.prompt for p in loaded)
    assert all(p.prompt.rstrip().endswith("?") for p in loaded[:20])
    assert len({p.prompt for p in loaded}) == 200
    assert len({p.extra["template"] for p in loaded}) > 50
    assert all(0 <= p.extra["template"] < 100 and p.extra["answer"] for p in loaded)


# ---------------------------------------------------------------- sampling

@pytest.mark.parametrize("name", BUILT)
def test_sampling_is_seeded_stable_and_keeps_file_order(name):
    path = DATA / f"{name}.jsonl"
    full = prompts.load(path)
    order = {p.id: i for i, p in enumerate(full)}
    a = prompts.load(path, limit=16, seed=7)
    assert [p.id for p in a] == [p.id for p in prompts.load(path, limit=16, seed=7)]
    assert len(a) == 16 and len({p.id for p in a}) == 16
    assert [order[p.id] for p in a] == sorted(order[p.id] for p in a)
    b = prompts.load(path, limit=16, seed=8)
    assert {p.id for p in a} != {p.id for p in b}
    assert [p.id for p in prompts.load(path, limit=len(full) + 5, seed=3)] == list(order)
    assert prompts.load(path, limit=0) == []


def test_sampling_respects_categories_and_limit():
    path = DATA / "mtbench.jsonl"
    two = prompts.load(path, categories=["math", "coding"])
    assert len(two) == 20 and {p.category for p in two} == {"math", "coding"}
    few = prompts.load(path, categories=["writing"], limit=4, seed=1)
    assert len(few) == 4 and {p.category for p in few} == {"writing"}
    assert {p.id for p in few} <= {f"mtbench-{i}" for i in range(81, 91)}
    assert few == prompts.load(path, categories=["writing"], limit=4, seed=1)
    with pytest.raises(ValueError, match="no prompts in categories"):
        prompts.load(path, categories=["poetry"])


# ---------------------------------------------------------------- raw vs chat forms

def test_multi_turn_record_forms():
    p = prompts.load(DATA / "mtbench.jsonl")[0]
    first, second = p.extra["turns"]
    assert p.prompt is None
    assert p.turns() == [{"role": "user", "content": first}]
    assert p.raw_text() == first and second not in p.raw_text()
    p.turns()[0]["content"] = "changed"
    assert p.turns()[0]["content"] == first, "turns() hands out copies"


def test_single_turn_record_forms():
    p = prompts.load(DATA / "humaneval.jsonl")[0]
    assert p.messages == () and p.prompt.startswith("from typing import List")
    assert p.raw_text() == p.prompt
    assert p.turns() == [{"role": "user", "content": p.prompt}]


def test_conversation_record_forms(tmp_path):
    f = tmp_path / "conv.jsonl"
    f.write_text(json.dumps({"id": "c", "category": "chat", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]}) + "\n")
    (p,) = prompts.load(f)
    assert p.raw_text() == "Hi\n\nBye"  # user turns only
    assert [m["role"] for m in p.turns()] == ["system", "user", "assistant", "user"]


class _Tok:
    """Records what speclab.prompts asks a tokenizer for."""

    def __init__(self):
        self.calls = []

    def encode(self, text):
        self.calls.append(("encode", text))
        return [len(text)]

    def apply_chat_template(self, turns, add_generation_prompt, tokenize):
        self.calls.append(("chat", turns, add_generation_prompt, tokenize))
        return {"input_ids": [len(turns)]}


def test_to_token_ids_uses_raw_text_or_chat_turns():
    mt = prompts.load(DATA / "mtbench.jsonl", limit=1, seed=0)
    he = prompts.load(DATA / "humaneval.jsonl", limit=1, seed=0)
    tok = _Tok()
    assert prompts.to_token_ids(mt + he, tok, "raw") == [[len(mt[0].raw_text())],
                                                         [len(he[0].prompt)]]
    assert tok.calls == [("encode", mt[0].raw_text()), ("encode", he[0].prompt)]
    tok = _Tok()
    assert prompts.to_token_ids(mt + he, tok, "chat") == [[1], [1]]
    assert tok.calls == [("chat", mt[0].turns(), True, True), ("chat", he[0].turns(), True, True)]


# ---------------------------------------------------------------- the build script offline

def test_build_script_rejects_a_source_file_that_does_not_match_its_digest(tmp_path):
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("x/data.jsonl", b'{"a": 1}\n')
        zf.writestr("x-1.0.dist-info/LICENSE", b"MIT")
    good = hashlib.sha256(b'{"a": 1}\n').hexdigest()
    w = build_prompts.Wheel("x", "1.0", wheel.name, "", "MIT", "x-1.0.dist-info/LICENSE",
                            {"x/data.jsonl": good})
    assert build_prompts.read_members(w, wheel)["x/data.jsonl"] == b'{"a": 1}\n'
    bad = build_prompts.Wheel("x", "1.0", wheel.name, "", "MIT", "x-1.0.dist-info/LICENSE",
                              {"x/data.jsonl": "0" * 64})
    with pytest.raises(ValueError, match="sha256"):
        build_prompts.read_members(bad, wheel)
    w_pinned = build_prompts.Wheel("x", "1.0", wheel.name, "0" * 64, "MIT", "", {})
    with pytest.raises(ValueError, match="pinned"):
        build_prompts.fetch(w_pinned, tmp_path)  # cached file present: no download attempted
