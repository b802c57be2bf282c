#!/usr/bin/env python3
"""Expected spec-decode counters for a DeepSeek-V4 fixture pair on a token-id prompt set,
from the CPU transformers reference (greedy) and the draft's PyTorch reference
(speclab.fixtures.dsv4_rigs.expected_counters): what vLLM must report when its kernels compute
the same function. Writes JSON (per k: drafts, accepted per position, AL) with provenance.

  python tools/expected_dsv4_counters.py dial-dsv4 dial-dsv4-eagle3 \
      data/prompts/tiny-dsv4-ids.jsonl 64 OUT.json"""

import json
import sys
import time
from pathlib import Path

from speclab import fixtures, prompts
from speclab.fixtures import dsv4_reference, dsv4_rigs


def main(target: str, draft: str, prompt_file: str, max_tokens: int, out: str) -> None:
    tdir, ddir = fixtures.build(target), fixtures.build(draft)
    plist = prompts.load(prompt_file)
    ids = [list(p.prompt_token_ids) for p in plist]
    aux = json.loads((ddir / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    t0 = time.time()
    # a few extra tokens: vLLM verifies the last batch of drafts past max_tokens
    ref = dsv4_reference.reference_run(tdir, ids, max_tokens + 8, aux, full_logits=False)
    draft_ref = dsv4_rigs.load_draft_reference(ddir, tdir)
    exp = dsv4_rigs.expected_counters(ref, draft_ref, ks=(1, 2, 3, 4), max_tokens=max_tokens)
    Path(out).write_text(json.dumps({
        "target": target, "draft": draft, "prompts": prompt_file, "max_tokens": max_tokens,
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": round(time.time() - t0, 1), "expected": exp}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
