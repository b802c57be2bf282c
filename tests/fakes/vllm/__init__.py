"""Fake vLLM for CPU tests of speclab.gpubench: greedy outputs follow the fixture's bigram,
counters follow realshape.expected_counters, method mtp drafting the target's own bigram (with
FAKE_VLLM_GRAPHED_DRAFT_REJECTS=1 a drafter in its CUDA graphs accepts nothing, as vLLM 0.26
did before overlay 2.1.0)."""
import os
import time
from types import SimpleNamespace

__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)

class _M:
    def __init__(self, name, value=None, values=None):
        self.name, self.value, self.values = name, value, values

class LLM:
    def __init__(self, **args):
        from speclab.fixtures import realshape
        self.args = args
        sc = args.get("speculative_config")
        self.k = sc["num_speculative_tokens"] if sc else 0
        self.method = sc["method"] if sc else None
        self.succ = realshape.successors(args["model"])
        self.tot = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                    "accepted_per_pos": [0] * self.k}
        cc = SimpleNamespace(mode="CompilationMode.NONE", cudagraph_mode="FULL_AND_PIECEWISE",
                             cudagraph_capture_sizes=[1, 2, 4])
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(
            compilation_config=cc,
            model_config=SimpleNamespace(enforce_eager=args["enforce_eager"]),
            scheduler_config=SimpleNamespace(async_scheduling=True),
            cache_config=SimpleNamespace(cache_dtype=args["kv_cache_dtype"]),
            speculative_config=(SimpleNamespace(method=self.method, num_speculative_tokens=self.k)
                                if self.k else None)))
        print("Using 'MARLIN' Mxfp4 MoE backend (fake)", flush=True)

    def generate(self, prompts, sp, use_tqdm=False):
        from speclab.fixtures import realshape
        ids = [p["prompt_token_ids"] for p in prompts]
        if self.k and sp.max_tokens > 1:
            c = realshape.expected_counters(self.succ, ids, self.k, sp.max_tokens,
                                            self.succ if self.method == "mtp" else None)
            graphed = not self.args["speculative_config"].get("enforce_eager")
            if graphed and os.environ.get("FAKE_VLLM_GRAPHED_DRAFT_REJECTS") == "1":
                c = {**c, "num_accepted_tokens": 0, "accepted_per_pos": [0] * self.k}
            for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                self.tot[key] += c[key]
            self.tot["accepted_per_pos"] = [a + b for a, b in zip(self.tot["accepted_per_pos"],
                                                                  c["accepted_per_pos"])]
        time.sleep(0.001 * sp.max_tokens)
        if len(ids) == 4 and sp.max_tokens > 1 and not getattr(self, "_jit_once", False):
            self._jit_once = True  # the first full B=4 pass "compiles" (vLLM's jit_monitor line)
            print("WARNING [jit_monitor.py:135] TileLang JIT compilation during inference: "
                  "mhc_pre_big_fuse_tilelang. This causes a latency spike", flush=True)
        return [SimpleNamespace(outputs=[
                    SimpleNamespace(token_ids=realshape.greedy(self.succ, p, sp.max_tokens))])
                for p in ids]

    def get_metrics(self):
        if not self.k:
            return []
        p = "vllm:spec_decode_"
        return [_M(p + "num_drafts", self.tot["num_drafts"]),
                _M(p + "num_draft_tokens", self.tot["num_draft_tokens"]),
                _M(p + "num_accepted_tokens", self.tot["num_accepted_tokens"]),
                _M(p + "num_accepted_tokens_per_pos", values=list(self.tot["accepted_per_pos"]))]
