"""Stand-in for `speclab.worker` in the trust tests: keeps the worker's contract (tied to its
parent by `launch.guard_parent`; writes the point's records and metadata, or a timing round's
pass) without loading an engine, so sweeps run in seconds.

Environment: TRUST_LOG appends "<point id> <mode> <round>" per start; TRUST_SLEEP waits that
many seconds first; TRUST_CHILD starts a child process in the worker's group (vLLM's engine
core stands for it) whose command line names the run folder."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fake_requests import requests

from speclab import fingerprint, launch, store
from speclab.profiles import Point, Profile


def main(spec_path: str) -> int:
    started = time.time()
    spec = json.loads(Path(spec_path).read_text())
    if not launch.guard_parent(spec):
        return 1
    profile = Profile.model_validate(spec["profile"])
    point = Point.model_validate(spec["point"])
    mode, rnd = spec.get("mode", "full"), spec.get("round", 1)
    if os.environ.get("TRUST_CHILD"):
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", spec["run_dir"]])
    if os.environ.get("TRUST_LOG"):
        with open(os.environ["TRUST_LOG"], "a") as f:
            f.write(f"{point.id} {mode} {rnd}\n")
    print(f"stand-in worker: {point.id} {mode} {rnd}", flush=True)  # lands in the point's log
    time.sleep(float(os.environ.get("TRUST_SLEEP", "0")))
    tok_s = 100.0 * (1 + point.k) + rnd
    passed = {"round": rnd, "generate_s": 1.0, "output_tokens": 2 * profile.max_tokens,
              "tok_s": tok_s, "at": time.time()}
    if mode == "timing":
        Path(spec["output"]).write_text(json.dumps(passed))
        return 0
    records = requests([{"point_id": point.id, "k": point.k, "prompt_id": f"p{i}",
                         "n_output": profile.max_tokens} for i in range(2)])
    store.write_point(Path(spec["run_dir"]), store.PointResult(
        point_id=point.id, status="ok", point=point.model_dump(mode="json"),
        started_at=started, sampling=fingerprint.sampling(profile, point),
        fingerprint=spec["fingerprint"], n_requests=2, throughput_tok_s=tok_s,
        passes=[passed]), records)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
