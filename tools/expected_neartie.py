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

`--along RUN POINT` (DeepSeek-V4 near-tie bigram only): the counters along the plain greedy
output that point of run folder RUN emitted, instead of the readout's own path, written to
RUN/expected_plain_path.json (notebook 03 adds the "plain-path expectation" re-analysis). A
GPU engine's bf16 logits can take the runner-up where the readout's margin is below their
resolution, in plain decoding too; the counting draft's acceptance then follows that path.

  python tools/expected_neartie.py tiny-dsv4-neartie-accept-h200 - \
      --along data/runs/h200-dsv4-neartie-accept-20261204-vllm026 k0_kv-fp8_tp1_raw
"""

import json
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from speclab import parity, profiles, prompts, store
from speclab.fixtures import neartie
from speclab.fixtures.cache import read_metadata


def main(profile_name: str, out: str, along: tuple[str, str] | None = None) -> None:
    prof = profiles.load(profile_name)
    tdir = Path(profiles.resolve_model(prof.target))
    ddir = Path(profiles.resolve_model(prof.draft))
    plist = prompts.load(profiles.prompt_file(prof), limit=prof.prompts.limit,
                         categories=prof.prompts.categories, seed=prof.prompts.seed)
    tok = None if prof.skip_tokenizer_init else AutoTokenizer.from_pretrained(tdir)
    ids = prompts.to_token_ids(plist, tok, "raw")
    ks = sorted({*prof.parity.k_values, prof.parity.spec_k,
                 *(c.k for c in prof.parity.controls if c.k)})
    dsv4 = json.loads((tdir / "config.json").read_text())["model_type"] == "deepseek_v4"
    t0 = time.time()
    source = {}
    if along:
        if not dsv4:
            raise SystemExit("--along: only the DeepSeek-V4 near-tie bigram (a readout target)")
        run_dir, point = along
        _, recs = store.load_results(run_dir)
        rows = recs[recs.point_id == point].set_index("prompt_id") if len(recs) else recs
        missing = [p.id for p in plist if p.id not in rows.index]
        if missing:
            raise SystemExit(f"{run_dir}: point {point} has no output for {missing}")
        ref = neartie.dial_counters_along(
            tdir, ids, [[int(t) for t in rows.loc[p.id].output_token_ids] for p in plist],
            prof.max_tokens, ks)
        out = str(Path(run_dir) / parity.PLAIN_PATH_FILE)
        source = {"along": {"run": Path(run_dir).name, "point": point}}
    elif dsv4:
        ref = neartie.dial_reference(tdir, ids, prof.max_tokens, ks)
    else:
        ref = neartie.reference(tdir, ddir, ids, prof.max_tokens, ks)
    for p, r in zip(plist, ref["prompts"]):
        r["prompt_id"] = p.id
    Path(out).write_text(json.dumps({
        "profile": prof.name, "target": prof.target, "draft": prof.draft, **source,
        "fixtures": {n: read_metadata(d)["cache_key"][:12] for n, d in
                     (("target", tdir), ("draft", ddir))},
        "prompts": prof.prompts.model_dump(), "max_tokens": prof.max_tokens,
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": round(time.time() - t0, 1), "margins": ref["margins"],
        "counters": {str(k): v for k, v in ref["counters"].items()},
        "prompts_reference": ref["prompts"]}, indent=1) + "\n")
    print(out)


if __name__ == "__main__":
    args = sys.argv[1:]
    along = None
    if "--along" in args:
        i = args.index("--along")
        along, args = tuple(args[i + 1:i + 3]), args[:i] + args[i + 3:]
    if len(args) != 2 or (along is not None and len(along) != 2):
        raise SystemExit(__doc__)
    main(args[0], args[1], along)
