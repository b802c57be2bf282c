#!/usr/bin/env python3
"""What a correct engine must give on a near-tie parity profile, computed before it runs:
greedy output, the top-1/top-2 margin at every position (the margin distribution the
detection power depends on) and vLLM's spec-decode counters per k and per prompt. Llama
targets: transformers (fp32) and the draft's PyTorch reference (speclab.fixtures.neartie.
reference); the DeepSeek-V4 near-tie bigram: its layer-free readout and the counting draft
(neartie.dial_reference).

  python tools/expected_neartie.py tiny-cpu-neartie data/expected/neartie-llama-tiny-cpu.json
  python tools/expected_neartie.py tiny-dsv4-neartie-accept-h200 \
      data/expected/neartie-dial-dsv4-h200.json
"""

import json
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from speclab import profiles, prompts
from speclab.fixtures import neartie
from speclab.fixtures.cache import read_metadata


def main(profile_name: str, out: str) -> None:
    prof = profiles.load(profile_name)
    tdir = Path(profiles.resolve_model(prof.target))
    ddir = Path(profiles.resolve_model(prof.draft))
    plist = prompts.load(profiles.prompt_file(prof), limit=prof.prompts.limit,
                         categories=prof.prompts.categories, seed=prof.prompts.seed)
    tok = None if prof.skip_tokenizer_init else AutoTokenizer.from_pretrained(tdir)
    ids = prompts.to_token_ids(plist, tok, "raw")
    ks = sorted({*prof.parity.k_values, prof.parity.spec_k,
                 *(c.k for c in prof.parity.controls if c.k)})
    t0 = time.time()
    if json.loads((tdir / "config.json").read_text())["model_type"] == "deepseek_v4":
        ref = neartie.dial_reference(tdir, ids, prof.max_tokens, ks)
    else:
        ref = neartie.reference(tdir, ddir, ids, prof.max_tokens, ks)
    for p, r in zip(plist, ref["prompts"]):
        r["prompt_id"] = p.id
    Path(out).write_text(json.dumps({
        "profile": prof.name, "target": prof.target, "draft": prof.draft,
        "fixtures": {n: read_metadata(d)["cache_key"][:12] for n, d in
                     (("target", tdir), ("draft", ddir))},
        "prompts": prof.prompts.model_dump(), "max_tokens": prof.max_tokens,
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": round(time.time() - t0, 1), "margins": ref["margins"],
        "counters": {str(k): v for k, v in ref["counters"].items()},
        "prompts_reference": ref["prompts"]}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
