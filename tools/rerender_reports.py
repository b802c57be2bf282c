"""Re-render committed runs' reports and figures from their results (no engine runs).

For each run folder under data/runs with a provenance.json (default: all, or the names given),
runs `speclab run -p execute false` with the profile, notebooks and notebook parameters that
rendered (or executed) it last, so the page picks up the current report format.

    python tools/rerender_reports.py [RUN ...]
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "data" / "runs"
PATH_PARAMS = ("profile", "run_dir", "figures_dir", "interactive", "execute")


def command(run: Path) -> list[str]:
    prov = json.loads((run / "provenance.json").read_text())
    params = prov["parameters"]
    cmd = [sys.executable, "-m", "speclab", "run", "--profile", params["profile"], "--run-id",
           run.name, "--notebooks", ",".join(prov["notebook_wall_s"]), "-p", "execute", "false"]
    for key, value in params.items():
        if key not in PATH_PARAMS:
            cmd += ["-p", key, json.dumps(value)]
    return cmd


def main(names: list[str]) -> int:
    runs = [RUNS / n for n in names] if names else sorted(
        p.parent for p in RUNS.glob("*/provenance.json"))
    failed = []
    for run in runs:
        cmd = command(run)
        print(f"[rerender] {run.name}: {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode:
            failed.append(run.name)
    if failed:
        print(f"[rerender] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
