# Scratch scripts of the 2026-12-02 CPU diagnosis (docs/realshape-oracle-diagnosis.md); they write under /tmp/dd.
"""Llama counting target at the real draft's hidden size (4096) and a 33000-id vocab."""
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

out = Path(sys.argv[1]); H = 4096; V = 33000
cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=0,
                  eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("meta"):
    pass
m = LlamaForCausalLM(cfg).to(torch.bfloat16)
g = torch.Generator().manual_seed(0)
e = torch.randn(V, H, generator=g); e = e / e.norm(dim=-1, keepdim=True)
with torch.no_grad():
    m.model.embed_tokens.weight.copy_(e)
    m.lm_head.weight.copy_(e.roll(1, dims=0))
    for l in m.model.layers:
        l.self_attn.o_proj.weight.zero_(); l.mlp.down_proj.weight.zero_()
m.save_pretrained(out, safe_serialization=True)
print("ok")
