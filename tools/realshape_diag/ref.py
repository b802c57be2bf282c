# Scratch scripts of the 2026-12-02 CPU diagnosis (docs/realshape-oracle-diagnosis.md); they write under /tmp/dd.
import json
import sys

import torch

sys.path.insert(0, "/tmp/dd")
from pathlib import Path

import oracle
from safetensors.torch import load_file

from speclab.fixtures.eagle3_draft import Eagle3Draft, draft_chains, simulate_greedy_spec_decode


class D(Eagle3Draft):
    def _finish(self, attn_out, residual):
        if self.config.get("norm_before_residual"):
            residual = self.midlayer["hidden_norm"](residual)
        return super()._finish(attn_out, residual)
def load(d):
    d = Path(d); cfg = json.loads((d / "config.json").read_text())
    ts = load_file(str(d / "model.safetensors"))
    E = load_file(str(oracle.TARGET / "model.safetensors"))["model.embed_tokens.weight"].float()
    m = D(cfg, E, ts.get("d2t")); m.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in ts.items()}); return m.eval()
name = sys.argv[1]
m = load(f"/tmp/dd/drafts/{name}")
max_tokens = 24
prompts = [[5 + 97 * i + j for j in range(8)][::-1] for i in range(4)]
tot = [0, [0, 0, 0]]
for p in prompts:
    toks = torch.tensor(p + [p[-1] + 1 + j for j in range(max_tokens + 3)])[None]
    aux = torch.zeros(1, toks.shape[1], 3 * m.config["hidden_size"])
    with torch.no_grad(): ch = draft_chains(m, aux, toks, 3)[0]
    exp = toks[0, 1:, None] + torch.arange(1, 4)
    bad = (ch != exp).nonzero().tolist()
    c = simulate_greedy_spec_decode(ch, toks[0], len(p), 3, max_tokens)
    tot[0] += c["num_drafts"]; tot[1] = [a + b for a, b in zip(tot[1], c["accepted_per_pos"])]
    print(p[-1], "wrong (row,pos):", bad[:10])
print(name, "ref counters", tot)
