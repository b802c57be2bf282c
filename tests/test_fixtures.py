"""speclab.fixtures: corpus, prompt set, tokenizer, cache, the EAGLE-3 draft's format and
reference forward, the Llama rig; vLLM end to end (`-m vllm`)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from speclab import fixtures
from speclab import prompts as prompt_sets
from speclab import prompts as speclab_prompts
from speclab.fixtures import cache, corpus, eagle3_draft, llama_target, prompts, rigs, tokenizer

torch.set_num_threads(2)

# Smoke-sized builds (determinism and format): seconds, not minutes.
SMALL_TARGET = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                "num_key_value_heads": 1, "seq_len": 32, "batch_size": 2, "steps": 3}
SMALL_DRAFT = {"intermediate_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1,
               "draft_vocab_size": 1024, "prompt_len": 8, "gen_len": 8, "train_sequences": 8,
               "valid_sequences": 4, "batch_size": 4, "steps": 2, "warmup_steps": 1}
SMALL_T = {"tiny-llama": SMALL_TARGET}
SMALL = {**SMALL_T, "tiny-llama-eagle3": SMALL_DRAFT}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def tok_dir(fixture_cache) -> Path:
    return fixtures.build("tokenizer", fixture_cache)


@pytest.fixture(scope="session")
def rig(fixture_cache) -> tuple[Path, Path]:
    return fixtures.build("rig-llama", fixture_cache), fixtures.build("rig-llama-eagle3",
                                                                      fixture_cache)


@pytest.fixture(scope="session")
def small_pair(fixture_cache) -> tuple[Path, Path]:
    draft = fixtures.build("tiny-llama-eagle3", fixture_cache, params=SMALL)
    return fixtures.fixture_dir("tiny-llama", fixture_cache, params=SMALL_T), draft


# ------------------------------------------------------------------ corpus and prompts
def test_corpus_is_small_licensed_split_and_canonical():
    assert corpus.CORPUS_FILE.stat().st_size <= 2_000_000
    assert ("PYTHON SOFTWARE FOUNDATION LICENSE"
            in (corpus.CORPUS_DIR / "LICENSE-PSF.txt").read_text())
    assert "3.11.7" in (corpus.CORPUS_DIR / "PROVENANCE.md").read_text()
    paths = {s: set(corpus.document_paths(s)) for s in corpus.SPLITS}
    assert all(paths.values())
    assert not (paths["train"] & paths["valid"] or paths["train"] & paths["test"]
                or paths["valid"] & paths["test"])
    for s in corpus.SPLITS:
        for path, text in zip(corpus.document_paths(s), corpus.documents(s)):
            assert corpus.split_of(path.removeprefix("Lib/")) == s
            assert corpus.canonical_code(text) == text, path


def test_tiny_code_prompts_are_held_out_and_reproducible(tmp_path):
    loaded = prompt_sets.load(prompts.PROMPTS_FILE)
    assert 16 <= len(loaded) <= 24
    assert {p.category for p in loaded} == set(prompts.PER_CATEGORY)
    test_docs = dict(zip(corpus.document_paths("test"), corpus.documents("test")))
    train_text = "\n".join(corpus.documents("train") + corpus.documents("valid"))
    for p in loaded:
        assert not p.prompt.endswith("\n") and p.prompt + "\n" in test_docs[p.extra["source"]]
        assert p.prompt not in train_text, p.id
    prompts.build_tiny_code_prompts(tmp_path / "p.jsonl")
    assert (tmp_path / "p.jsonl").read_bytes() == prompts.PROMPTS_FILE.read_bytes()


# ------------------------------------------------------------------ tokenizer
def test_tokenizer_special_ids_bos_roundtrip_and_chat_template(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == 4096
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    text = corpus.documents("test")[0][:2000]
    ids = tok.encode(text)
    assert ids[0] == 0 and 0 not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(a):"}]
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == "<s>### system\nBe brief.\n\n### user\ndef f(a):\n\n### assistant\n"
    # what the sweep feeds vLLM for prompt_format=chat: the rendered template's token ids
    p = speclab_prompts.Prompt(id="x", category="c", messages=tuple(chat))
    assert speclab_prompts.to_token_ids([p], tok, "chat") == [
        tok.encode(rendered, add_special_tokens=False)]


# ------------------------------------------------------------------ cache
def test_cache_key_tracks_seed_params_code_and_dependencies(monkeypatch, tmp_path):
    d = fixtures.fixture_dir("rig-llama", tmp_path)
    assert d.parent == tmp_path and d.name.startswith("rig-llama-seed0-")
    assert fixtures.fixture_dir("rig-llama", tmp_path, seed=1) != d
    assert fixtures.fixture_dir("rig-llama", tmp_path,
                                params={"rig-llama": {"layer_out_scale": 0.0}}) != d
    assert fixtures.fixture_dir("rig-llama", tmp_path,
                                params={"tokenizer": {"vocab_size": 2048}}) != d
    assert fixtures.fixture_dir("tokenizer", tmp_path, seed=1) == \
        fixtures.fixture_dir("tokenizer", tmp_path)  # the tokenizer does not use the seed
    with pytest.raises(ValueError, match="unknown parameters"):
        fixtures.fixture_dir("rig-llama", tmp_path, params={"rig-llama": {"layer_out_sclae": 0}})
    with pytest.raises(ValueError, match="does not build"):
        fixtures.fixture_dir("rig-llama", tmp_path, params={"tiny-llama": {"steps": 1}})
    real = cache._module_digest
    monkeypatch.setattr(cache, "_module_digest",
                        lambda m: "edited" if m == "tokenizer" else real(m))
    assert fixtures.fixture_dir("rig-llama", tmp_path) != d  # upstream code change
    monkeypatch.setattr(cache, "_module_digest", real)
    assert fixtures.fixture_dir("rig-llama", tmp_path) == d
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "c"))
    assert fixtures.default_cache_dir() == tmp_path / "c" / "fixtures"


def test_build_is_atomic_cached_and_forced(monkeypatch, tmp_path):
    calls = []

    def ok(out: Path, *, seed: int, size: int) -> dict:
        calls.append(seed)
        (out / "w.bin").write_bytes(bytes(size))
        return {"size": size}

    def boom(out: Path, *, seed: int, size: int) -> dict:
        (out / "partial.bin").write_bytes(b"x")
        raise RuntimeError("interrupted")

    monkeypatch.setitem(fixtures.FIXTURES, "ok", cache.Fixture(ok, {"size": 3}, ()))
    monkeypatch.setitem(fixtures.FIXTURES, "boom", cache.Fixture(boom, {"size": 3}, ()))
    with pytest.raises(RuntimeError, match="interrupted"):
        fixtures.build("boom", tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / (fixtures.fixture_dir("boom", tmp_path).name
                                                    + ".lock")]
    d = fixtures.build("ok", tmp_path, seed=5)
    meta = cache.read_metadata(d)
    assert (meta["name"], meta["seed"], meta["params"], meta["stats"]) == \
        ("ok", 5, {"size": 3}, {"size": 3})
    assert fixtures.build("ok", tmp_path, seed=5) == d and calls == [5]
    assert fixtures.build("ok", tmp_path, seed=5, force=True) == d and calls == [5, 5]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == \
        [d.name]  # no temporary or replaced directories left
    with pytest.raises(KeyError, match="unknown fixture"):
        fixtures.build("nope", tmp_path)


# ------------------------------------------------------------------ trained fixtures (small)
def test_small_builds_are_deterministic_from_the_seed(small_pair, tmp_path):
    target, draft = small_pair
    draft2 = fixtures.build("tiny-llama-eagle3", tmp_path, params=SMALL)  # from scratch
    target2 = fixtures.fixture_dir("tiny-llama", tmp_path, params=SMALL_T)
    assert draft2.name == draft.name and target2.name == target.name
    assert _sha(target2 / "model.safetensors") == _sha(target / "model.safetensors")
    assert _sha(draft2 / "model.safetensors") == _sha(draft / "model.safetensors")
    other = fixtures.build("tiny-llama", tmp_path, seed=1, params=SMALL_T)
    assert _sha(other / "model.safetensors") != _sha(target / "model.safetensors")
    stats = cache.read_metadata(draft)["stats"]
    assert len(stats["valid"]["step_accuracy"]) == eagle3_draft.DEFAULTS["ttt_steps"]
    assert 0 < stats["draft_vocab_coverage"] <= 1


def test_draft_checkpoint_layout(small_pair):
    """Names, shapes and config fields that vLLM's llama_eagle3.py reads (the `vllm` test
    below loads them into vLLM's own module)."""
    target, draft = small_pair
    tcfg = json.loads((target / "config.json").read_text())
    cfg = json.loads((draft / "config.json").read_text())
    t = load_file(str(draft / "model.safetensors"))
    h, n_aux = cfg["hidden_size"], cfg["num_aux_hidden_states"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and h == tcfg["hidden_size"]  # shares embed_tokens
    ids = cfg["eagle_aux_hidden_state_layer_ids"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids and len(ids) == n_aux
    assert all(0 <= i <= tcfg["num_hidden_layers"] for i in ids)
    inter, dv = cfg["intermediate_size"], cfg["draft_vocab_size"]
    expected = {
        "fc.weight": (h, n_aux * cfg["target_hidden_size"]),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, nh * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h), "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,), "lm_head.weight": (dv, h),
        "d2t": (dv,), "t2d": (cfg["vocab_size"],),
    }
    assert {k: tuple(v.shape) for k, v in t.items()} == expected
    d2t, t2d = t["d2t"], t["t2d"]
    target_ids = torch.arange(dv) + d2t
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert bool((target_ids.diff() > 0).all()) and int(target_ids[-1]) < cfg["vocab_size"]
    assert t2d.sum() == dv and bool(t2d[target_ids].all())


# ------------------------------------------------------------------ reference forward
def _incremental_chain(draft: eagle3_draft.Eagle3Draft, aux, tokens, i: int, k: int) -> list:
    """The k draft tokens for last verified position i, computed the way vLLM's proposer
    does: a KV cache filled by the context pass over positions 0..i, then one chained step
    per extra token, each appending its key and value."""
    scale = draft.config["head_dim"] ** -0.5
    q, kc, vc = draft._qkv(tokens[:, 1:i + 2], draft.fc(aux[:, :i + 1]),
                           torch.arange(i + 1)[None])
    att = torch.einsum("bihd,bjhd->bhij", q[:, -1:], kc) * scale
    ctx = torch.einsum("bhij,bjhd->bihd", att.softmax(-1), vc)
    hidden = draft._finish(ctx, draft.fc(aux[:, i:i + 1]))
    out = [int(draft.to_target_ids(draft.logits(hidden).argmax(-1)))]
    for s in range(1, k):
        q, k1, v1 = draft._qkv(torch.tensor([[out[-1]]]), hidden, torch.tensor([[i + s]]))
        kc, vc = torch.cat([kc, k1], 1), torch.cat([vc, v1], 1)
        att = torch.einsum("bihd,bjhd->bhij", q, kc) * scale
        hidden = draft._finish(torch.einsum("bhij,bjhd->bihd", att.softmax(-1), vc), hidden)
        out.append(int(draft.to_target_ids(draft.logits(hidden).argmax(-1))))
    return out


@torch.no_grad()
def test_unroll_equals_incremental_kv_cache_decoding(small_pair):
    target_dir, draft_dir = small_pair
    target = llama_target.load_target(target_dir)
    draft = eagle3_draft.load_draft(draft_dir, target.model.embed_tokens.weight)
    for p in draft.parameters():  # a random draft: varied, tie-free argmaxes
        p.add_(torch.randn_like(p) * 0.5)
    tokens = torch.randint(3, 4096, (1, 24), generator=torch.Generator().manual_seed(0))
    _, aux = llama_target.aux_hidden_states(target, tokens, tuple(draft.config[
        "eagle_aux_hidden_state_layer_ids"]))
    chains = eagle3_draft.draft_chains(draft, aux, tokens, 4)[0]
    for i in (0, 5, 22):
        assert chains[i].tolist() == _incremental_chain(draft, aux, tokens, i, 4)
    assert len(set(chains.flatten().tolist())) > 10  # not a degenerate constant draft


def test_simulated_counters():
    tokens = torch.arange(20)
    perfect = torch.stack([torch.arange(i + 2, i + 5) for i in range(19)])  # always right
    c = eagle3_draft.simulate_greedy_spec_decode(perfect, tokens, 4, 3)
    # rounds commit 4 tokens: verified positions 3, 7, 11, 15; 19 is the end
    assert c == {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 12,
                 "accepted_per_pos": [4, 4, 4]}
    c = eagle3_draft.simulate_greedy_spec_decode(perfect * 0, tokens, 4, 3)
    assert c["num_drafts"] == 15 and c["accepted_per_pos"] == [0, 0, 0]
    # output of 11 tokens (positions 4..14) and greedy tokens beyond it: the last round
    # (verified position 11) is checked in full, past the output, as vLLM does
    c = eagle3_draft.simulate_greedy_spec_decode(perfect, tokens, 4, 3, max_tokens=11)
    assert c["num_drafts"] == 3 and c["accepted_per_pos"] == [3, 3, 3]
    c = eagle3_draft.simulate_greedy_spec_decode(perfect[:14], tokens[:15], 4, 3)
    assert c["num_drafts"] == 3 and c["accepted_per_pos"] == [3, 3, 2]


# ------------------------------------------------------------------ rig
@torch.no_grad()
def test_rig_reference_counts_and_drafts_one_right(rig):
    target_dir, draft_dir = rig
    target = llama_target.load_target(target_dir)
    vocab = target.config.vocab_size
    meta = cache.read_metadata(target_dir)["stats"]
    assert meta["counting_accuracy"] == 1.0 and meta["min_logit_margin"] > 5
    draft = eagle3_draft.load_draft(draft_dir, target.model.embed_tokens.weight)
    k, n_new = 3, 32
    for prompt in rigs.rig_prompt_token_ids(vocab, n=4, max_tokens=n_new):
        tokens = torch.tensor(prompt + [prompt[-1] + 1 + j for j in range(n_new)])[None]
        logits, aux = llama_target.aux_hidden_states(
            target, tokens, tuple(draft.config["eagle_aux_hidden_state_layer_ids"]))
        assert torch.equal(logits[0].argmax(-1)[:-1], tokens[0, :-1] + 1)
        chains = eagle3_draft.draft_chains(draft, aux, tokens, k)[0]
        assert torch.equal(chains, (tokens[0, :-1] + 2)[:, None].expand(-1, k))
        c = eagle3_draft.simulate_greedy_spec_decode(chains, tokens[0], len(prompt), k)
        assert c["accepted_per_pos"] == [c["num_drafts"], 0, 0]
        assert c["num_drafts"] == math.ceil((n_new - 1) / 2)


# ------------------------------------------------------------------ vLLM
def _vllm(target: Path, draft: Path, token_prompts: list, ks: list[int], max_tokens: int,
          tmp_path: Path) -> tuple[dict, str]:
    pfile = tmp_path / "prompts.json"
    pfile.write_text(json.dumps(token_prompts))
    r = subprocess.run(
        [sys.executable, "-m", "speclab.fixtures.verify", str(target), str(draft),
         "--prompts", str(pfile), "--k", *map(str, ks), "--max-tokens", str(max_tokens)],
        check=False, capture_output=True, text=True, timeout=900,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stdout + r.stderr


@pytest.mark.vllm
def test_vllm_loads_the_draft_checkpoint_into_its_eagle3_module(rig):
    """vLLM's own Eagle3LlamaForCausalLM accepts every tensor (unknown names raise) and
    ends up with exactly ours in every parameter (fused q/k/v and gate/up)."""
    code = r"""
import json, socket, sys, torch
from safetensors.torch import load_file
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
target, draft = sys.argv[1:3]
cfg = EngineArgs(model=target, dtype="float32", enforce_eager=True, max_model_len=256,
                 speculative_config={"method": "eagle3", "model": draft,
                                     "num_speculative_tokens": 3}).create_engine_config()
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
with set_current_vllm_config(cfg):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
    initialize_model_parallel(1, 1)
    model = Eagle3LlamaForCausalLM(vllm_config=cfg)
ours = load_file(draft + "/model.safetensors")
model.load_weights(ours.items())
a = "midlayer.self_attn."; m = "midlayer.mlp."
expected = {
    "model.fc.weight": ours["fc.weight"], "model.norm.weight": ours["norm.weight"],
    "lm_head.weight": ours["lm_head.weight"],
    "model.layers.0.self_attn.qkv_proj.weight": torch.cat([ours[a + x + "_proj.weight"] for x in "qkv"]),
    "model.layers.0.self_attn.o_proj.weight": ours[a + "o_proj.weight"],
    "model.layers.0.mlp.gate_up_proj.weight": torch.cat([ours[m + "gate_proj.weight"], ours[m + "up_proj.weight"]]),
    "model.layers.0.mlp.down_proj.weight": ours[m + "down_proj.weight"],
}
for n in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
    expected[f"model.layers.0.{n}.weight"] = ours[f"midlayer.{n}.weight"]
params = dict(model.named_parameters())
print(json.dumps({
    "unset": sorted(set(params) - set(expected) - {"model.embed_tokens.weight"}),
    "mismatch": sorted(n for n, t in expected.items() if not torch.equal(params[n].data, t)),
    "has_own_embed_tokens": model.has_own_embed_tokens, "has_own_lm_head": model.has_own_lm_head,
    "num_aux_hidden_states": model.model.num_aux_hidden_states,
}))
"""
    target, draft = rig
    r = subprocess.run([sys.executable, "-c", code, str(target), str(draft)],
                       check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"unset": [], "mismatch": [], "has_own_embed_tokens": False,
                   "has_own_lm_head": True, "num_aux_hidden_states": 3}


@pytest.mark.vllm
def test_vllm_rig_counts_exactly(rig, tmp_path):
    target, draft = rig
    vocab = rigs.rig_vocab_size(target)
    max_tokens = 32
    token_prompts = rigs.rig_prompt_token_ids(vocab, n=4, max_tokens=max_tokens)
    res, log = _vllm(target, draft, token_prompts, [1, 3], max_tokens, tmp_path)
    aux_ids = tuple(json.loads((draft / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"])
    assert f"Using auxiliary layers from speculative config: {aux_ids}" in log
    for p, out in zip(token_prompts, res["base"]):
        assert out == [p[-1] + 1 + j for j in range(max_tokens)]
    drafts_per_prompt = math.ceil((max_tokens - 1) / 2)  # each round: 1 accepted + bonus
    for k in (1, 3):
        r = res["k"][str(k)]
        assert r["outputs"] == res["base"]
        assert r["num_drafts"] == len(token_prompts) * drafts_per_prompt
        assert r["accepted_per_pos"] == [r["num_drafts"]] + [0] * (k - 1)
        assert r["num_draft_tokens"] == k * r["num_drafts"]
        assert r["num_accepted_tokens"] == r["num_drafts"]


@pytest.mark.vllm
def test_vllm_trained_pair_matches_the_reference_and_accepts(fixture_cache, tmp_path):
    """The trained pair on the held-out tiny-code prompts: vLLM's counters equal the PyTorch
    reference's (draft forward + greedy spec-decode walk) exactly, and AL(k=3) >= 1.8.
    Builds the trained fixtures (~4 min on 2 cores) unless $SPECLAB_CACHE has them."""
    target_dir = fixtures.build("tiny-llama", fixture_cache)
    draft_dir = fixtures.build("tiny-llama-eagle3", fixture_cache)
    tok = tokenizer.load(target_dir)
    token_prompts = [tok.encode(p.prompt).ids for p in prompt_sets.load(prompts.PROMPTS_FILE)]
    max_tokens, ks = 64, [1, 3]
    res, _ = _vllm(target_dir, draft_dir, token_prompts, ks, max_tokens, tmp_path)
    target = llama_target.load_target(target_dir)
    draft = eagle3_draft.load_draft(draft_dir, target.model.embed_tokens.weight)
    aux_ids = tuple(draft.config["eagle_aux_hidden_state_layer_ids"])
    expected = {k: {"num_drafts": 0, "accepted_per_pos": [0] * k} for k in ks}
    for prompt, out in zip(token_prompts, res["base"]):
        # vLLM's greedy output plus the target's next greedy tokens (the last round's drafts
        # are verified past max_tokens)
        tokens = llama_target.greedy_continue(target, torch.tensor([prompt + out]), max(ks))
        _, aux = llama_target.aux_hidden_states(target, tokens, aux_ids)
        for k in ks:
            chains = eagle3_draft.draft_chains(draft, aux, tokens, k)[0]
            c = eagle3_draft.simulate_greedy_spec_decode(chains, tokens[0], len(prompt), k,
                                                         max_tokens=max_tokens)
            expected[k]["num_drafts"] += c["num_drafts"]
            expected[k]["accepted_per_pos"] = [
                a + b for a, b in zip(expected[k]["accepted_per_pos"], c["accepted_per_pos"])]
    for k in ks:
        r = res["k"][str(k)]
        assert r["outputs"] == res["base"]
        assert {"num_drafts": r["num_drafts"], "accepted_per_pos": r["accepted_per_pos"]} == \
            expected[k]
    r3 = res["k"]["3"]
    assert 1 + r3["num_accepted_tokens"] / r3["num_drafts"] >= 1.8


def test_a_fixtures_identity_needs_no_build_and_once_noted_no_torch(tmp_path):
    """`fixtures.key` (a point's model identity in its fingerprint): computed where the fixture
    is not built (nothing is built), read from the built fixture's metadata where it is; a
    sweep driver that found the fixture once computes it without importing torch."""
    env = {**os.environ, "SPECLAB_CACHE": str(tmp_path)}
    code = ("import json, sys; from speclab import fingerprint, fixtures; "
            "print(json.dumps([fingerprint.model_identity('fixture:tokenizer'), "
            "'torch' in sys.modules, any(fixtures.default_cache_dir().glob('tokenizer-*'))]))")

    def identity() -> list:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300, check=True)
        return json.loads(out.stdout.splitlines()[-1])

    ident, _, built = identity()
    assert not built and ident == f"fixture:tokenizer@{fixtures.key('tokenizer')}"
    fixtures.build("tokenizer", tmp_path / "fixtures")
    meta = json.loads(next((tmp_path / "fixtures").glob("tokenizer-*/speclab_fixture.json"))
                      .read_text())
    assert identity()[0] == f"fixture:tokenizer@{meta['cache_key']}" == ident
    assert identity() == [ident, False, True]  # the second process: the dirs' note, no torch
