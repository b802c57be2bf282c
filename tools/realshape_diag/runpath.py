# Scratch scripts of the 2026-12-02 CPU diagnosis (docs/realshape-oracle-diagnosis.md); they write under /tmp/dd.
import gc
import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

target, dtype = sys.argv[1], sys.argv[2]
max_tokens = 24
prompts = [[100 + 997 * i + 13 * j for j in range(12)] for i in range(4)]
for d in sys.argv[3:]:
    t0 = time.time()
    llm = LLM(model=target, dtype=dtype, enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
              kv_cache_memory_bytes=256 << 20, max_num_seqs=4, seed=0, disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": d, "num_speculative_tokens": 3})
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False), use_tqdm=False)
    c = {}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts": c["num_drafts"] = m.value
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos": c["per_pos"] = list(m.values)
    ok = all(list(o.outputs[0].token_ids) == [p[-1] + 1 + j for j in range(max_tokens)] for p, o in zip(prompts, outs))
    print("RESULT", d, dtype, "target_ok", ok, json.dumps(c), f"{time.time()-t0:.0f}s", flush=True)
    del llm; gc.collect()
