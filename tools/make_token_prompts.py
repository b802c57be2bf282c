#!/usr/bin/env python3
"""Token-id prompt sets for the tokenizer-less DeepSeek-V4 fixtures (vocab 2048):
data/prompts/tiny-dsv4-ids.jsonl (16 prompts of 16/64/256/1024 tokens: the longer ones reach
the C4/C128 compressed-attention layers) and data/prompts/rig-dsv4-ids.jsonl (8 prompts of 8
tokens for the counting rig). Random ids from `speclab.fixtures.dsv4_rigs.rig_prompt_token_ids`
(seeded), which keeps every prompt and its 64-token counting continuation clear of special
tokens and of the vocabulary's end. data/prompts/layer-rig-dsv4-ids.jsonl: 16 prompts of
8/16/32/64 tokens for the layer-exact rig (vocab 512,
`speclab.fixtures.dsv4_layer_rig.rig_prompts`). data/prompts/realshape-dsv4-ids.jsonl: 4
prompts of 256 tokens for the real-shape pair (`speclab.fixtures.realshape.prompt_ids`: ids
in the draft vocabulary, the last one low enough that the greedy continuation of
`REALSHAPE_MAX_TOKENS` tokens at k <= 3 stays inside it; 256 tokens, a power of two, is a
prefill size vLLM 0.26 warms DeepSeek-V4's mHC kernels up for: `benchworker.prompt_lengths`).
Deterministic: `python tools/make_token_prompts.py`."""

import json
from pathlib import Path

from speclab.fixtures.dsv4_layer_rig import LAYER_RIG_CONFIG, rig_prompts
from speclab.fixtures.dsv4_rigs import rig_prompt_token_ids
from speclab.fixtures.realshape import prompt_ids

REALSHAPE_MAX_TOKENS = 256  # profiles/realshape-ray-h200.yaml's max_tokens

OUT = Path(__file__).resolve().parents[1] / "data" / "prompts"


def write(name: str, rows: list[dict]) -> None:
    (OUT / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    rows = []
    for j, length in enumerate((16, 64, 256, 1024)):
        for i, ids in enumerate(rig_prompt_token_ids(2048, n=4, length=length, seed=100 + j)):
            rows.append({"id": f"len{length}-{i}", "category": f"len{length}",
                         "prompt_token_ids": ids})
    write("tiny-dsv4-ids", rows)
    write("rig-dsv4-ids", [{"id": f"rig-{i}", "category": "rig", "prompt_token_ids": ids}
                           for i, ids in enumerate(rig_prompt_token_ids(2048, n=8, length=8,
                                                                        seed=7))])
    ids = rig_prompts(LAYER_RIG_CONFIG["vocab_size"], n=16, max_tokens=64, k=3, seed=11)
    write("layer-rig-dsv4-ids", [{"id": f"layer-rig-{i}-len{len(p)}", "category": f"len{len(p)}",
                                  "prompt_token_ids": p} for i, p in enumerate(ids)])
    ids = prompt_ids(4, 256, seed=23, max_tokens=REALSHAPE_MAX_TOKENS, k=3)
    write("realshape-dsv4-ids", [{"id": f"realshape-{i}", "category": "len256",
                                  "prompt_token_ids": p} for i, p in enumerate(ids)])


if __name__ == "__main__":
    main()
