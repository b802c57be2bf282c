"""Capture tools/gpu/lab.py's job plan as it is before the studies move (run once from the old lab.py; deleted once lab.py reads the studies).

For each environment release (0.22.0, 0.26.0) and two LAB_STAMP values: every job (name,
gpus, timeout, cmd, runs, env, expect_fail, vllm, after, exclusive) in order, plus the
stamp-dependent module values the set-up uses (STAMP, RELTAG, DIAL, COST, FIXTURES). The
interpreter path is written as {python}."""
import importlib.util
import json
import os
import sys
from pathlib import Path

WT = Path(__file__).resolve().parents[2]
PY = sys.executable


def norm(x):
    if isinstance(x, str):
        return x.replace(PY, "{python}")
    if isinstance(x, (list, tuple)):
        return [norm(v) for v in x]
    if isinstance(x, dict):
        return {k: norm(v) for k, v in x.items()}
    return x


out = {}
for release in ("0.22.0", "0.26.0"):
    for stamp in ("20990101", "20261205b"):
        os.environ["SPECLAB_VLLM"] = release
        os.environ["LAB_STAMP"] = stamp
        spec = importlib.util.spec_from_file_location("lab", WT / "tools/gpu/lab.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out[f"{release} {stamp}"] = {
            "STAMP": mod.STAMP, "RELTAG": mod.RELTAG, "RELEASE": mod.RELEASE,
            "DIAL": mod.DIAL, "COST": mod.COST, "FIXTURES": list(mod.FIXTURES),
            "jobs": norm(mod.JOBS)}
(WT / "tests/data").mkdir(exist_ok=True)
(WT / "tests/data/lab_plan.json").write_text(json.dumps(out, indent=1) + "\n")
print({k: len(v["jobs"]) for k, v in out.items()})
