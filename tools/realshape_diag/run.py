# Scratch scripts of the 2026-12-02 CPU diagnosis (docs/realshape-oracle-diagnosis.md); they write under /tmp/dd.
import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, "/tmp/dd")
import oracle

from speclab.fixtures import verify

variants = json.loads(sys.argv[1])
max_tokens = 24
prompts = [[5 + 97 * i + j for j in range(8)][::-1] for i in range(4)]
# expected: every draft right: rounds of 4 tokens
for name, kw in variants.items():
    d = oracle.build(f"/tmp/dd/drafts/{name}", **kw)
    t0 = time.time()
    outs, c = verify._generate(str(oracle.TARGET), prompts, max_tokens,
                               {"method": "eagle3", "model": str(d), "num_speculative_tokens": 3})
    ok = all(o == [p[-1] + 1 + j for j in range(max_tokens)] for p, o in zip(prompts, outs))
    print("RESULT", name, json.dumps(kw), "target_ok", ok, json.dumps(c), f"{time.time()-t0:.0f}s", flush=True)
