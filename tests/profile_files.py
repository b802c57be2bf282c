"""A minimal CPU profile file for tests that check profile parsing and validation."""

import yaml


def write(tmp_path, **data):
    """`tmp_path/t.yaml`: a cpu profile with target, draft and prompts in `tmp_path`,
    `data` laid over it."""
    base = {"name": "t", "backend": "cpu", "target": str(tmp_path), "draft": str(tmp_path),
            "prompts": {"file": str(tmp_path / "p.jsonl")}}
    p = tmp_path / "t.yaml"
    p.write_text(yaml.safe_dump({**base, **data}))
    return p
