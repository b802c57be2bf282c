"""`speclab.hostwatch` on a real GPU, without vLLM: the sampler runs through 4 s idle, 8 s of
bf16 matmuls on GPU 0 and 4 s idle again, writing `host.jsonl` to OUT. Every sample must carry
`gpu` (SM clock, power, temperature; `reasons` where the driver names them), and `per_pass`
over the busy window must read more power than over the idle ones (the control: a sampler
whose GPU fields were stale or misparsed would read the same power in both). With
`--copy S`, then S seconds of copying 2 GiB on the GPU under the sampler (`copy.jsonl`): the
HBM rate, power, SM clock and clock events of a memory-bound load, like a decode step's
weight reads.

    PYTHONPATH=SHARED_SITE:src python3 tools/gpu/hostwatch_check.py OUT [--copy S]
    (SHARED_SITE: the bundle's shared layer, for pydantic; the image has torch and pandas)
"""

import json
import pathlib
import sys
import time

import torch

from speclab import gpus, hostwatch


def watched(path: pathlib.Path, step, busy_s: float, idle_s: float):
    """The sampler on `path` through `idle_s` idle, `step()` (then synchronised) again and again
    for `busy_s`, and `idle_s` idle: (its samples, {window: (start, seconds)})."""
    path.unlink(missing_ok=True)
    watch = hostwatch.Watch(path).start()
    windows = {}
    for name in ("idle-before", "busy", "idle-after"):
        t0 = time.time()
        if name == "busy":
            while time.time() - t0 < busy_s:
                step()
                torch.cuda.synchronize()
        else:
            time.sleep(idle_s)
        windows[name] = (t0, time.time() - t0)
    time.sleep(1.5)  # the last idle second's sample
    watch.stop()
    return [json.loads(line) for line in path.read_text().splitlines()], windows


out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
path = out / "host.jsonl"
QUERY = "name,driver_version,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
raw = gpus._query(QUERY)  # the package's one nvidia-smi query, [] where it fails
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("nvidia-smi:", raw)
print("gpus.clocks():", gpus.clocks())

a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
rows, windows = watched(path, lambda: [a @ a for _ in range(20)], busy_s=8, idle_s=4)
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
                                               if "gpu" in r) or any("[N/A]" in row for row in raw),
    "busy power above both idle windows": all(
        seen["busy"]["power_w"] > 1.2 * seen[w]["power_w"] for w in ("idle-before", "idle-after")),
}
for name, ok in checks.items():
    print(("ok  " if ok else "FAIL"), name)
print(f"{len(rows)} samples, {sum('gpu' in r for r in rows)} with gpu -> {path}")
if "--copy" in sys.argv:
    del a
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copies = 0

    def copy_10():
        global copies
        for _ in range(10):
            dst.copy_(src)
        copies += 10

    rows, windows = watched(out / "copy.jsonl", copy_10,
                            busy_s=float(sys.argv[sys.argv.index("--copy") + 1]), idle_s=3)
    t0, dt = windows["busy"]
    print(f"copy: {copies} x 2 GiB read + write in {dt:.1f} s = "
          f"{copies * 4 * 2**30 / dt / 1e9:.0f} GB/s")
    for r in rows:
        g = r.get("gpu", {})
        print(f"{r['t'] - t0:6.1f} s  sm_mhz {g.get('sm_mhz')} power_w {g.get('power_w')} "
              f"temp_c {g.get('temp_c')} reasons {g.get('reasons')}")
sys.exit(0 if all(checks.values()) else 1)
