"""`speclab.steptiming`'s GPU start times (`t_ms`) on a real GPU, without vLLM: a stand-in
forward (20 matmuls of 1024 x 1024, ~1.1 ms) and sampling (one matmul) wrapped as the plugin
wraps vLLM's, 30 steps with 0, 10 and again 0 ms of host work before each forward. The gap
before the forward must read about the host work less the GPU work still queued (10 ms:
~9.6 ms), and ~0 without it (the controls); the gap before sampling ~0 throughout.

    PYTHONPATH=src python3 tools/gpu/steptiming_check.py      (on the device; torch only)
"""

import pathlib
import statistics
import tempfile
import time

import torch

from speclab import steptiming as st

folder = pathlib.Path(tempfile.mkdtemp())
rec = st._Recorder(folder)
a = torch.randn(1024, 1024, device="cuda")


def forward(self, scheduler_output):
    for _ in range(20):
        a @ a


execute = st.wrap(forward, rec, "execute")
sample = st.wrap(lambda self, grammar_output: a @ a, rec, "sample")
step = type("S", (), {"total_num_scheduled_tokens": 4, "num_scheduled_tokens": [4]})()
for _ in range(5):
    forward(None, step)
torch.cuda.synchronize()
print(torch.cuda.get_device_name(), "torch", torch.__version__)
for prep_s in (0.0, 0.010, 0.0):
    (folder / st.FLAG).touch()
    first = len(st.read(folder))
    for _ in range(30):
        time.sleep(prep_s)  # the host preparing the next step
        execute(None, step)
        sample(None, None)
    (folder / st.FLAG).unlink()
    rec.flush()
    calls = st.read(folder)[first:]
    gaps = st.gaps(calls, 1, 3)  # the stand-in step: 4 tokens of one request
    fwd = [c for c in calls if c["op"] == "execute"]
    print(f"host work {prep_s * 1e3:.0f} ms: forward {statistics.median(c['ms'] for c in fwd):.3f}"
          f" ms GPU, {statistics.median(c['host_ms'] for c in fwd):.3f} ms host; gap before the "
          f"forward {gaps['gap_execute_ms']:.3f} ms, before sampling "
          f"{gaps['gap_sample_ms']:.3f} ms")
