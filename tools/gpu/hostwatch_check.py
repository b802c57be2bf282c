"""`speclab.hostwatch` on a real GPU, without vLLM: the sampler runs through 4 s idle, 8 s of
bf16 matmuls on GPU 0 and 4 s idle again, writing `host.jsonl` to OUT. Every sample must carry
`gpu` (SM clock, power, temperature; `reasons` where the driver names them), and `per_pass`
over the busy window must read more power than over the idle ones (the control: a sampler
whose GPU fields were stale or misparsed would read the same power in both).

    PYTHONPATH=SHARED_SITE:src python3 tools/gpu/hostwatch_check.py OUT
    (SHARED_SITE: the bundle's shared layer, for pydantic; the image has torch and pandas)
"""

import json
import pathlib
import subprocess
import sys
import time

import torch

from speclab import gpus, hostwatch

out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
path = out / "host.jsonl"
path.unlink(missing_ok=True)
raw = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,power.draw,"
                      "temperature.gpu,clocks_event_reasons.active",
                      "--format=csv,noheader,nounits"], capture_output=True, text=True)
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("nvidia-smi:", raw.stdout.strip() or raw.stderr.strip())
print("gpus.clocks():", gpus.clocks())

a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
watch = hostwatch.Watch(path).start()
windows = {}
for name, busy_s in (("idle-before", 0), ("busy", 8), ("idle-after", 0)):
    t0 = time.time()
    if busy_s:
        while time.time() - t0 < busy_s:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
    else:
        time.sleep(4)
    windows[name] = (t0, time.time() - t0)
time.sleep(1.5)
watch.stop()

rows = [json.loads(line) for line in path.read_text().splitlines()]
passes = [{"engine": name, "t_full_start": t0 + 1, "t_full_s": dt - 1}  # a second's margin
          for name, (t0, dt) in windows.items()]
seen = {p["engine"]: p for p in hostwatch.per_pass(rows, passes)}
for name, p in seen.items():
    print(f"{name:12s} sm_mhz {p.get('sm_mhz')} power_w {p.get('power_w')} "
          f"temp_c {p.get('temp_c')} events {p.get('clock_events')} busy {p['busy']} "
          f"top {p['top']}")
checks = {
    "samples": len(rows) >= 12,
    "every sample has gpu": all("gpu" in r for r in rows),
    "reasons where the driver names them": all("reasons" in r["gpu"] for r in rows
                                               if "gpu" in r) or "[N/A]" in raw.stdout,
    "busy power above both idle windows": all(
        seen["busy"]["power_w"] > 1.2 * seen[w]["power_w"] for w in ("idle-before", "idle-after")),
}
for name, ok in checks.items():
    print(("ok  " if ok else "FAIL"), name)
print(f"{len(rows)} samples, {sum('gpu' in r for r in rows)} with gpu -> {path}")
sys.exit(0 if all(checks.values()) else 1)
