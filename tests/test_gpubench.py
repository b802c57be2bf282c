"""gpubench's driver and worker on the CPU, with a stand-in vLLM (tests/fakes/vllm: greedy
outputs follow the fixture's bigram, counters follow realshape.expected_counters): rounds
interleaved over engines, expectations checked per pass, resume, deadline, group packing;
and the step-timing plugin's recorder."""

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from speclab import benchplans as P
from speclab import benchworker as W
from speclab import cudagraphs, hostwatch, memory, steptiming, store, vllm_plugins
from speclab import gpubench as G
from speclab import mhcwarm as M
from speclab.fixtures import dsv4_shapes as SH
from speclab.fixtures import repeat_loader

FAKES = Path(__file__).parent / "fakes"


@pytest.fixture()
def fake_pair(tmp_path, monkeypatch):
    """A target folder the fake vLLM can serve: config, index and fixture metadata."""
    t = tmp_path / "target"
    t.mkdir()
    (t / "config.json").write_text(json.dumps({"vocab_size": 33000}))
    (t / "dsv4_fixture.json").write_text(json.dumps({"seed": 0, "params": {"mismatch": 0.3}}))
    (t / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 2**30}}))
    monkeypatch.setenv("PYTHONPATH",
                       os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(G.gpus, "memory_gib", lambda index=0: (139.8, 0.5))
    monkeypatch.setattr(G, "START_GAP_S", 0)
    return {(4, "fp4", 4, False): (str(t), str(tmp_path / "draft")),
            (4, "fp4", 4, True): (str(t), "")}  # the MTP's target: no draft


def test_drive_interleaves_checks_and_resumes(tmp_path, fake_pair):
    state = tmp_path / "state"
    assert G.drive(state, time.time() + 300, "smoke", 2, paths=fake_pair) == 0
    rows = [json.loads(x) for x in (state / "results.jsonl").read_text().splitlines()]
    passes = [r for r in rows if r["op"] == "pass"]
    # rounds 0..2 of B=1 for both engines, plain's extra B=4 in rounds 0..3, a split each
    assert sorted((r["engine"], r["round"], r["B"]) for r in passes) == sorted(
        [(e, r, 1) for e in ("L4-k0-graphs", "L4-k3-graphs") for r in range(3)]
        + [("L4-k0-graphs", r, 4) for r in range(4)])
    order = [(r["round"], r["engine"]) for r in passes if r["B"] == 1]
    assert order == sorted(order)  # round r of every engine before round r + 1
    for r in passes:
        assert r["outputs_exact"] == r["B"]
        if r["k"]:
            assert r["counters"]["accepted_per_pos"] == r["expected"]["accepted_per_pos"]
    splits = [(r["engine"], r["B"]) for r in rows if r["op"] == "split"]
    assert sorted(splits) == [("L4-k0-graphs", 1), ("L4-k3-graphs", 1)]  # plain's anatomy too
    jit = {(r["round"], r["B"]): r["jit_compiled"] for r in passes if r["k"] == 0}
    assert jit[(0, 4)] == ["mhc_pre_big_fuse_tilelang"] and not any(
        v for key, v in jit.items() if key != (0, 4))
    eng = [json.loads(x) for x in (state / "engines.jsonl").read_text().splitlines()]
    assert {e["engine"] for e in eng} == {"L4-k0-graphs", "L4-k3-graphs"}
    assert any("MARLIN" in f for e in eng for f in e["log_facts"])
    assert eng[1]["resolved"]["speculative"] == {"method": "eagle3", "k": 3}
    # the host was sampled all along, and each pass reads it over its own greedy window
    host = store.read_jsonl(state / "host.jsonl")
    assert host and all(r["t_full_start"] <= time.time() for r in rows)
    assert len(hostwatch.per_pass(host, rows)) > len(rows) / 2
    n = len(rows)
    G.drive(state, time.time() + 300, "smoke", 2, paths=fake_pair)  # nothing left to do
    assert len((state / "results.jsonl").read_text().splitlines()) == n


def test_mtp_engines_draft_with_the_targets_own_head(tmp_path, fake_pair, monkeypatch):
    """Method mtp: the target with its MTP module, no draft checkpoint, counters checked
    against the MTP's expectation (every draft right); the control: a drafter that accepts
    nothing makes every speculative pass inexact."""
    e = P.Engine(32, 3, batches=(1, 16), method="mtp")
    assert e.name == "L32-k3-graphs-mtp" and e.fixture == (32, "fp4", 4, True)
    assert P.Engine(32, 0, method="mtp").fixture == (32, "fp4", 4, False)  # plain is plain
    args = W.engine_args(e, "t", None, P.KV_BYTES, 0.2)
    assert args["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="method must be eagle3 or mtp"):
        P.Engine(4, 3, method="medusa")
    plan = P.PLANS["timing-deep-mtp"]()  # 32 layers: about 110 GiB each, one engine at a time
    assert [e.name for e in plan] == ["L32-k0-graphs", "L32-k1-graphs-mtp", "L32-k3-graphs-mtp"]
    assert plan[0].extra_batches == (2, 4, 32, 64)  # plain at every verify size of k = 1, 3
    assert [len(g) for g in G.pack_groups(plan, {32: 110.0}, G.CAPACITY * 139.8, 2.5)] == [1] * 3
    b4 = P.PLANS["timing-deep-b4"]()
    # B = 4's verify steps at k = 1..5 run 8, 18 (12 tokens padded), 16, 20, 24 rows
    assert b4[0].extra_batches == (8, 16, 18, 20, 24) and b4[1].k == 4
    nxt = P.PLANS["timing-deep-next"]()  # both on one plain engine, MTP before k = 4
    assert [e.name for e in nxt] == ["L32-k0-graphs", "L32-k1-graphs-mtp", "L32-k3-graphs-mtp",
                                     "L32-k4-graphs"]
    assert nxt[0].extra_batches == (2, 8, 18, 20, 24, 32, 64) and nxt[0].batches == (1, 4, 16)
    assert set(nxt[0].capture_sizes) >= {18, 20} and nxt[3].batches == (1, 4, 16)
    final = P.PLANS["timing-deep-final"]()  # k = 4 in full after its plain, then the fit
    assert [e.name for e in final] == ["L32-k0-graphs", "L32-k4-graphs", "L24-k0-graphs"]
    verify = {cudagraphs.graph_rows(b, 5) for b in final[1].batches}
    assert verify == {5, 20, 80} <= {*final[0].batches, *final[0].extra_batches}
    k4 = P.PLANS["timing-deep-k4"]()  # the same k = 4 beside plain at its batch sizes only
    assert [e.name for e in k4] == [e.name for e in final[:2]] and k4[1].batches == (1, 4, 16)
    assert k4[0].extra_batches == () and k4[0].batches == final[0].batches
    # plain at 24 layers at every row count a B = 1 or 4 verify step runs below 16, and at
    # B = 16's k = 4 and 5 rows, which the 43-layer fit lacks at 24 layers
    rows24 = {*final[2].batches, *final[2].extra_batches}
    assert rows24 == {1, 2, 3, 4, 5, 6, 8, 16, 80, 96} <= set(final[2].capture_sizes)
    assert final[2].max_num_seqs >= 96
    mtp2 = P.PLANS["timing-deep-mtp2"]()  # MTP k = 2 at B = 1, 4, 16 and k = 1 at B = 4
    assert [e.name for e in mtp2] == ["L32-k0-graphs", "L32-k2-graphs-mtp", "L32-k1-graphs-mtp"]
    assert mtp2[0].extra_batches == (2, 3, 8, 18, 32, 48) and mtp2[2].batches == (4,)
    assert {cudagraphs.graph_rows(4, 3)} == {18} <= set(mtp2[0].capture_sizes)
    b64 = P.PLANS["timing-deep-b64"]()  # B = 64 with speculation
    assert [e.name for e in b64] == ["L32-k0-graphs", "L32-k2-graphs", "L32-k1-graphs"]
    assert b64[0].extra_batches == (128, 192) and {128, 192} <= set(b64[0].capture_sizes)
    # 192 requests of ~1,100 tokens hold 2.9 GiB of KV: the plain engine gets 3 x 2 GiB
    need = 192 * memory.kv_request_bytes(SH.realshape_config(32), "fp8", 1100)
    assert P.KV_BYTES < need < b64[0].kv_bytes == 3 * P.KV_BYTES
    # 80 rows at 32 layers and 96 at 24: over the 64 that ran in 2 GiB
    assert [e.kv_bytes for e in (*b64[1:], *final)] == [P.KV_BYTES] * 2 + [2 * P.KV_BYTES] + \
        [P.KV_BYTES] + [2 * P.KV_BYTES]
    state = tmp_path / "state"
    assert G.drive(state, time.time() + 300, "smoke-mtp", 1, paths=fake_pair) == 0
    rows = [json.loads(x) for x in (state / "results.jsonl").read_text().splitlines()]
    mtp = [r for r in rows if r["op"] == "pass" and r["k"]]
    assert mtp and all(G.pass_exact(r) for r in mtp)
    assert all(r["counters"]["accepted_per_pos"] == [r["counters"]["num_drafts"]] * 3
               for r in mtp)
    eng = [json.loads(x) for x in (state / "engines.jsonl").read_text().splitlines()]
    assert [e["resolved"]["speculative"] for e in eng if e["k"]] == [{"method": "mtp", "k": 3}]
    monkeypatch.setenv("FAKE_VLLM_GRAPHED_DRAFT_REJECTS", "1")
    bad = tmp_path / "bad"
    G.drive(bad, time.time() + 300, "smoke-mtp", 1, paths=fake_pair)
    rows = [json.loads(x) for x in (bad / "results.jsonl").read_text().splitlines()]
    assert not any(G.pass_exact(r) for r in rows if r["op"] == "pass" and r["k"])


def test_breaks_then_fit_falls_back_to_the_eager_drafter_when_the_check_fails(tmp_path,
                                                                             fake_pair,
                                                                             monkeypatch):
    """The graphed drafter's check decides how k = 3 at 32 layers runs (a fake whose graphed
    drafter accepts nothing, as vLLM 0.26 did before overlay 2.1.0: eager)."""
    monkeypatch.setenv("FAKE_VLLM_GRAPHED_DRAFT_REJECTS", "1")
    paths = {**fake_pair, **{(n, "fp4", 4, False): fake_pair[(4, "fp4", 4, False)]
                             for n in (24, 32)}}
    state = tmp_path / "state"
    assert G.drive(state, time.time() + 300, "breaks-then-fit", 0, paths=paths, tokens=8) == 0
    rows = store.read_jsonl(state / "results.jsonl")
    ran = {r["engine"] for r in rows}
    assert ran == {"L4-k3-graphs", "L4-k3-graphs-drafteager", "L24-k0-graphs", "L32-k0-graphs",
                   "L32-k3-graphs-drafteager"}
    assert not any(G.pass_exact(r) for r in rows
                   if r["engine"] == "L4-k3-graphs" and r["op"] == "pass")
    assert all(G.pass_exact(r) for r in rows
               if r["op"] == "pass" and r["engine"] == "L32-k3-graphs-drafteager")
    assert "skipping L32-k3-graphs: L4-k3-graphs exact is not True" in (
        state / "driver.log").read_text()


def test_a_gate_waits_for_its_engine_then_follows_its_exactness():
    plan = P.PLANS["breaks-then-fit"]()
    graphed, eager = plan[3:5]
    assert (graphed.draft_eager, eager.draft_eager) == (False, True)
    ok = {"engine": "L4-k3-graphs", "op": "pass", "B": 1, "outputs_exact": 1,
          "counters": {"accepted_per_pos": [3, 2, 1]}, "expected": {"accepted_per_pos": [3, 2, 1]}}
    off = {**ok, "counters": {"accepted_per_pos": [1, 0, 0]}}
    assert G.gate_open(graphed, [ok], {"L4-k3-graphs"}) is None  # still running
    assert [G.gate_open(e, [ok], set()) for e in (graphed, eager)] == [True, False]
    assert [G.gate_open(e, [ok, off], set()) for e in (graphed, eager)] == [False, True]
    assert [G.gate_open(e, [], set()) for e in (graphed, eager)] == [False, True]  # never ran
    assert G.gate_open(plan[0], [], {"L4-k3-graphs"}) is True  # ungated


def test_pass_length_follows_tokens(tmp_path, fake_pair):
    state = tmp_path / "state"
    assert G.drive(state, time.time() + 300, "smoke", 0, paths=fake_pair, tokens=40) == 0
    passes = [r for r in store.read_jsonl(state / "results.jsonl") if r["op"] == "pass"]
    assert passes and all(r["output_tokens"] == 40 * r["B"] for r in passes)
    assert all(r["outputs_exact"] == r["B"] for r in passes)
    assert all(r["counters"]["accepted_per_pos"] == r["expected"]["accepted_per_pos"]
               for r in passes if r["k"])


def test_a_pass_longer_than_the_model_allows_is_refused_before_any_engine(tmp_path, capsys):
    with pytest.raises(SystemExit):
        G.main(["drive", "--state", str(tmp_path / "s"), "--deadline", "0", "--tokens", "4000"])
    assert "--tokens 4000" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
    for bad in (["--rounds", "0"], ["--warm", "-1"]):  # no timed round: nothing to report
        with pytest.raises(SystemExit):
            G.main(["drive", "--state", str(tmp_path / "s"), "--deadline", "0", *bad])
        assert "at least one timed round" in capsys.readouterr().err
        assert not (tmp_path / "s").exists()


def test_drive_starts_nothing_past_its_deadline(tmp_path, fake_pair):
    state = tmp_path / "state"
    G.drive(state, time.time() + 60, "smoke", 2, paths=fake_pair)
    assert not (state / "results.jsonl").exists()
    assert "not starting" in (state / "driver.log").read_text()


def test_the_h100_plan_fits_one_engine_at_a_time():
    """`timing-h100`: 18 layers with the EAGLE3.1-shaped draft fit an H100 one engine at a
    time; 24 layers (the control) would not."""
    h100 = P.PLANS["timing-h100"]()  # one engine at a time within an H100's 79.6 GiB
    gib = lambda cfg: sum(memory.weight_bytes(cfg)) / memory.GiB
    weights = {L: gib(cfg := SH.realshape_config(L)) + gib(SH.realshape_draft_config(cfg))
               for L in (12, 18, 24)}  # target + the EAGLE3.1-shaped draft
    assert [len(g) for g in G.pack_groups(h100, weights, G.CAPACITY * 79.6, 2.5)] == [1] * 5
    assert max(weights[e.layers] + e.kv_bytes / memory.GiB + 2.5 for e in h100) \
        < G.CAPACITY * 79.6 < weights[24] + 4.5  # the control: 24 layers would not fit
    assert h100[0].extra_batches == (2, 3, 4, 32, 48, 64) and h100[-1].layers == 12
    served = P.PLANS["timing-h100-serve"]()  # the same engines, plain and k = 3 also served
    assert [e.name for e in served if e.serve] == ["L18-k0-graphs-serve", "L18-k3-graphs-serve"]
    assert [e for e in served if not e.serve] == h100
    assert len(G.pack_groups(served, weights, G.CAPACITY * 79.6, 2.5)) == 7
    assert P.PLANS["serve-h100"]() == [e for e in served if e.serve]  # the served pair alone
    k3 = P.PLANS["timing-h100-serve-k3"]()  # offline and served k = 3, plain at its rows only
    assert [e.name for e in k3] == [served[i].name for i in (0, 1, 2, 3)]
    assert k3[0].extra_batches == (4, 64) and all(e.layers == 18 for e in k3)
    host = [e.name for e in P.PLANS["timing-h100-host"]()]  # k = 1, then the shallow pair
    assert host == ["L18-k0-graphs", "L18-k1-graphs", "L12-k0-graphs", "L12-k3-graphs",
                    "L18-k3-graphs"]


def test_the_held_depth_plan_fits_an_h200_one_engine_at_a_time():
    """`timing-deep-36`: 36 layers with the EAGLE3.1-shaped draft fit what an H200 group may
    plan (93% of 140.4 GiB), one engine at a time; 38 layers (the control) would not."""
    plan = P.PLANS["timing-deep-36"]()
    assert [e.name for e in plan] == ["L36-k0-graphs", "L36-k3-graphs", "L36-k1-graphs"]
    assert plan[0].extra_batches == (2, 8, 32, 64)  # k = 1 and 3's verify rows beside 1, 4, 16
    gib = lambda cfg: sum(memory.weight_bytes(cfg)) / memory.GiB
    weights = {L: gib(cfg := SH.realshape_config(L)) + gib(SH.realshape_draft_config(cfg))
               for L in (36, 38)}
    h200 = G.CAPACITY * 140.4
    assert [len(g) for g in G.pack_groups(plan, weights, h200, G.OVERHEAD_GIB)] == [1] * 3
    need = max(weights[36] + e.kv_bytes / memory.GiB + G.OVERHEAD_GIB for e in plan)
    assert need < h200 < weights[38] + 2 + G.OVERHEAD_GIB
    both = [e.name for e in P.PLANS["timing-deep-final-36"]()]  # k = 4 and 36's core first
    assert both == ["L32-k0-graphs", "L32-k4-graphs", "L36-k0-graphs", "L36-k3-graphs",
                    "L24-k0-graphs", "L36-k1-graphs"]
    assert P.PLANS["timing-deep-final-36"]()[0].extra_batches == ()  # ran 2026-12-07


def test_groups_pack_by_memory_and_layer_count():
    plan = P.timing_plan("drafteager")
    groups = G.pack_groups(plan, {4: 17.0, 8: 30.3}, 130.0, 2.5)
    assert [[e.name for e in g] for g in groups] == [
        ["L4-k0-graphs", *(f"L4-k{k}-graphs-drafteager" for k in range(1, 6))],
        ["L8-k0-graphs", "L8-k1-graphs-drafteager", "L8-k3-graphs-drafteager"],
        ["L4-k0-eager", "L4-k3-eager-drafteager", "L4-k3-graphs"]]
    assert P.verify_batches((1, 4), (1, 2, 3)) == (2, 3, 8, 16, 18)
    # the plain engines time the rows of every verify step of k = 1..5 at B = 1, 4, 16
    assert set(plan[0].extra_batches) | set(plan[0].batches) >= {
        cudagraphs.graph_rows(b, k + 1) for b in (1, 4, 16) for k in range(6)}


def test_timing_variants_set_the_draft_and_keep_plain_alike():
    names = [e.name for e in P.timing_plan("eagle31")]
    assert len(names) == len(set(names)) == 11  # the EAGLE3.1 graphs k = 3 engine once
    fa = P.timing_plan("fasplits0")
    assert all(e.fa_splits == 0 for e in fa if e.name != "L4-k3-graphs")  # plain too
    assert all(e.draft_eager == (e.k > 0) for e in P.timing_plan("drafteager")
               if e.name != "L4-k3-graphs")
    assert set(P.PLANS) >= {f"timing-{v}" for v in P.DRAFT_VARIANTS}


def test_prompt_lengths_prefill_in_one_warmed_step():
    for B in (1, 2, 3, 4, 5, 6, 8, 12, 16, 20, 24, 32, 48, 64, 80, 96):
        n = W.prompt_lengths(B)
        total = sum(n)
        assert len(n) == B and max(n) - min(n) <= 1 and max(n) <= W.PROMPT_LEN
        assert total & (total - 1) == 0 and total <= W.MAX_BATCHED  # a power of two
        assert 2 * total > min(B * W.PROMPT_LEN, W.MAX_BATCHED)  # the largest such
    assert W.prompt_lengths(3) == [171, 171, 170]
    assert W.prompt_lengths(16) == [256] * 16
    with pytest.raises(ValueError, match="does not fit"):
        W.prompt_lengths(8192)


def test_batch_prompts_keep_the_oracle_in_the_draft_vocabulary():
    from speclab.fixtures import realshape

    for B in (3, 96):
        prompts = W.batch_prompts(B, seed=7, k=5)
        assert [len(p) for p in prompts] == W.prompt_lengths(B)
        full = realshape.prompt_ids(B, max(map(len, prompts)), seed=7,
                                    max_tokens=W.MAX_TOKENS, k=5)
        assert [p[-1] for p in prompts] == [f[-1] for f in full]


def test_engine_args_capture_every_verify_step():
    e = P.Engine(4, 5, batches=(1, 16))
    args = W.engine_args(e, "t", "d", P.KV_BYTES, 0.2)
    assert args["compilation_config"]["max_cudagraph_capture_size"] == 96
    # a plain engine captures every size it runs beside vLLM's (18 is none of vLLM's), and
    # only the list: vLLM 0.26 refuses a list and a maximum that disagree
    plain = P.Engine(32, 0, batches=(4,), extra_batches=(16, 18, 24))
    assert W.engine_args(plain, "t", None, P.KV_BYTES, 0.2)["compilation_config"] == {
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 18, 24]}
    assert P.Engine(32, 0, batches=(1, 16)).capture_sizes is None  # vLLM's own
    assert args["speculative_config"]["num_speculative_tokens"] == 5
    assert "compilation_config" not in W.engine_args(P.Engine(4, 0, eager=True), "t", None,
                                                     P.KV_BYTES, 0.2)


class _Event:  # CPU stand-in for torch.cuda.Event
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_steptiming_records_only_while_active(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    calls = []

    def propose(self, scheduler_output):
        calls.append(scheduler_output)
        time.sleep(0.002)
        return "drafts"

    wrapped = steptiming.wrap(propose, steptiming._Recorder(tmp_path))
    so = type("S", (), {"total_num_scheduled_tokens": 8, "num_scheduled_tokens": {"a": 4,
                                                                                  "b": 4}})()
    assert wrapped(None, so) == "drafts" and steptiming.read(tmp_path) == []
    (tmp_path / steptiming.FLAG).touch()
    wrapped(None, so)
    wrapped(None, so)
    assert steptiming.read(tmp_path) == []  # pending until the flag goes
    (tmp_path / steptiming.FLAG).unlink()
    wrapped(None, so)
    rows = steptiming.read(tmp_path)
    assert len(rows) == 2 and len(calls) == 4
    assert all(r["tokens"] == 8 and r["reqs"] == 2 and r["ms"] >= 2 for r in rows)


def test_steptiming_times_each_part_of_a_step_on_host_and_gpu(tmp_path, monkeypatch):
    """The plugin patches the runner's forward, sampling and drafter; a step's records carry
    their op, the step's counts (sampling takes the forward's) and host and GPU times."""
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "Event", _Event)

    class Runner:  # GPUModelRunner's three timed methods, each a known duration
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            time.sleep(0.003)

        def sample_tokens(self, grammar_output):
            time.sleep(0.001)
            return self.propose_draft_token_ids(self.so, [[1]])

        def propose_draft_token_ids(self, scheduler_output, sampled):
            time.sleep(0.002)
            return "drafts"

    mod = types.ModuleType("vllm.v1.worker.gpu_model_runner")
    mod.GPUModelRunner = Runner
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", mod)
    monkeypatch.setenv(steptiming.ENV, str(tmp_path))
    steptiming.install()
    steptiming.install()  # a second plugin load wraps nothing twice
    r = Runner()
    r.so = type("S", (), {"total_num_scheduled_tokens": 12, "num_scheduled_tokens": [4] * 3})()
    (tmp_path / steptiming.FLAG).touch()
    r.execute_model(r.so)
    assert r.sample_tokens(None) == "drafts"
    (tmp_path / steptiming.FLAG).unlink()
    r.execute_model(r.so)  # the next step writes the pending records out
    rows = {x["op"]: x for x in steptiming.read(tmp_path)}
    assert set(rows) == {"execute", "sample", "propose"}
    assert all(x["tokens"] == 12 and x["reqs"] == 3 for x in rows.values())
    assert rows["execute"]["host_ms"] >= 3 and rows["execute"]["ms"] >= 3
    assert rows["propose"]["host_ms"] >= 2
    assert rows["sample"]["host_ms"] >= 3  # sampling includes the drafter
    assert len(steptiming.read(tmp_path)) == 3



def test_steptiming_places_the_gpus_wait_within_the_step(tmp_path, monkeypatch):
    """The calls' GPU start times (`t_ms`) say where a step's wait falls: host work of 4 ms
    before each target forward shows as `gap_execute_ms` of 4 ms and none before sampling;
    without it (the control) neither gap reaches 1 ms. Records without `t_ms` give NaN."""
    import torch

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    so = type("S", (), {"total_num_scheduled_tokens": 12, "num_scheduled_tokens": [4] * 3})()

    def gaps(prep_s):
        folder = tmp_path / str(prep_s)
        rec = steptiming._Recorder(folder)
        execute = steptiming.wrap(lambda self, s: time.sleep(0.002), rec, "execute")
        sample = steptiming.wrap(lambda self, g: time.sleep(0.001), rec, "sample")
        folder.mkdir()
        (folder / steptiming.FLAG).touch()
        for _ in range(5):
            time.sleep(prep_s)  # the host preparing the next step
            execute(None, so)
            sample(None, None)
        (folder / steptiming.FLAG).unlink()
        rec.flush()
        calls = steptiming.read(folder)
        assert [c["op"] for c in calls[:2]] == ["execute", "sample"] and calls[0]["t_ms"] == 0
        return calls, steptiming.gaps(calls, 3, 3)

    calls, slow = gaps(0.004)
    assert 4 <= slow["gap_execute_ms"] < 6 and slow["gap_sample_ms"] < 1
    _, quick = gaps(0)
    assert quick["gap_execute_ms"] < 1 and quick["gap_sample_ms"] < 1
    old = [{k: v for k, v in c.items() if k != "t_ms"} for c in calls]
    assert all(map(np.isnan, steptiming.gaps(old, 3, 3).values()))

def test_plugin_dist_is_found_by_entry_points(tmp_path):
    vllm_plugins.write_dist(tmp_path)
    code = ("from importlib.metadata import entry_points;"
            "print(sorted(e.value for e in entry_points(group='vllm.general_plugins')))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH":
                         str(tmp_path)}, capture_output=True, text=True, check=True).stdout
    assert "speclab.steptiming:install" in out
    assert "speclab.fixtures.repeat_loader:register" in out


def test_a_deep_target_loads_with_the_repeat_format(tmp_path):
    """The deep plan's engines: plain with the verify sizes of k = 3, k = 3 with the drafter
    eager; a target with a layer-sources file gets `speclab_repeat`, another does not."""
    plain, spec = P.deep_plan()
    assert (plain.layers, plain.k, plain.extra_batches) == (32, 0, (4, 64))
    assert (spec.k, spec.draft_eager, spec.batches) == (3, True, (1, 16))
    fit = P.PLANS["timing-deep-fit"]()
    assert [(e.layers, e.k) for e in fit] == [(24, 0), (32, 0), (32, 3)]
    assert fit[0].extra_batches == plain.extra_batches and len({e.name for e in fit}) == 3
    graphs = P.PLANS["timing-deep-fit-graphs"]()
    assert [e.name for e in graphs] == ["L24-k0-graphs", "L32-k0-graphs", "L32-k3-graphs"]
    assert [e.name for e in P.PLANS["breaks-check"]()] == ["L4-k3-graphs",
                                                           "L4-k3-graphs-drafteager"]
    deep, shallow = tmp_path / "deep", tmp_path / "shallow"
    for d in (deep, shallow):
        d.mkdir()
    (deep / repeat_loader.SOURCES).write_text(json.dumps({"sources": {"5": 3}}))
    assert W.engine_args(spec, str(deep), "d", P.KV_BYTES, 0.5)["load_format"] == "speclab_repeat"
    assert "load_format" not in W.engine_args(spec, str(shallow), "d", P.KV_BYTES, 0.5)


def test_log_facts_keep_what_ran():
    text = ("INFO 12-02 [a.py:1] Using 'MARLIN' Mxfp4 MoE backend\n"
            "INFO 12-02 [b.py:2] something else\n"
            "INFO 12-02 [a.py:1] Using 'MARLIN' Mxfp4 MoE backend\n"
            "INFO [c.py:3] Model loading took 15.45 GiB memory\n")
    assert W.log_facts(text) == ["Using 'MARLIN' Mxfp4 MoE backend",
                                 "Model loading took 15.45 GiB memory"]


def test_oracle_diag_plan_separates_kv_grouping_and_graphs():
    plan = P.oracle_diag_plan()
    assert [e.name for e in plan] == ["L4-k3-graphs", "L4-k3-eager", "L4-k3-graphs-kvg1",
                                      "L4-k3-eager-kvg1", "L4-k3-graphs-drafteager",
                                      "L4-k3-graphs-fasplits0"]
    assert {e.fixture for e in plan} == {(4, "fp4", 4, False), (4, "fp4", 1, False)}


def test_oracle_diag_arms_set_draft_eager_and_fa_splits():
    eager_draft, heuristic_splits = P.oracle_diag_plan()[-2:]
    a = W.engine_args(eager_draft, "t", "d", 1 << 30, 0.1)
    assert a["speculative_config"]["enforce_eager"] is True and not a["enforce_eager"]
    assert "attention_config" not in a
    b = W.engine_args(heuristic_splits, "t", "d", 1 << 30, 0.1)
    assert b["attention_config"] == {"flash_attn_max_num_splits_for_cuda_graph": 0}
    assert "enforce_eager" not in b["speculative_config"]


def test_jit_lines_count_every_tilelang_variant():
    # lines as vLLM 0.26 wrote them on the H200 (2026-12-03): the jit_monitor warns once per
    # kernel name; TileLang logs every compile, also of a name already warned about
    log = ("(EngineCore pid=6797) WARNING 12-03 18:01:57 [jit_monitor.py:135] TileLang JIT "
           "compilation during inference: mhc_pre_big_fuse_broadcast_with_norm_tilelang. This "
           "causes a latency spike\n"
           "(EngineCore pid=6797) 2026-12-03 18:10:25  [TileLang:tilelang.jit.kernel:INFO] "
           "(kernel.py:133): TileLang begins to compile kernel `mhc_pre_big_fuse_with_norm_"
           "tilelang` with `out_idx=None`\n"
           "(EngineCore pid=6797) 2026-12-03 18:10:38  [TileLang:tilelang.jit.kernel:INFO] "
           "(kernel.py:141): TileLang completes to compile kernel `mhc_pre_big_fuse_with_norm_"
           "tilelang`\n")
    assert sorted(set(W.JIT_LINE.findall(log))) == [
        "mhc_pre_big_fuse_broadcast_with_norm_tilelang", "mhc_pre_big_fuse_with_norm_tilelang"]
    assert W.JIT_LINE.findall(log.splitlines()[2]) == []  # a finished compile is not a new one


def test_a_32_kv_head_draft_gets_the_kv_cache_its_pages_need():
    assert P.Engine(4, 3, draft_kv_group=1).kv_bytes == 2 * P.KV_BYTES
    assert P.Engine(4, 3).kv_bytes == P.Engine(4, 0, draft_kv_group=1).kv_bytes == P.KV_BYTES
    groups = G.pack_groups(P.oracle_diag_plan(), {4: 17.0}, 130.0, 2.5)
    assert [len(g) for g in groups] == [5, 1]  # 4 x 21.5 + 2 x 23.5 GiB exceed 130


def test_mhc_warm_sizes_cover_every_split_variant():
    sizes = M.mhc_warm_sizes()
    variants = {(M.mhc_splits(n, 64), M.mhc_splits(n, 16)) for n in range(1, W.MAX_BATCHED + 1)}
    assert {(M.mhc_splits(n, 64), M.mhc_splits(n, 16)) for n in sizes} == variants
    assert len(sizes) == len(variants) and max(sizes) <= W.MAX_BATCHED
    # the step sizes seen compiling on the H200 (2026-12-03) are among the variants
    assert M.mhc_splits(768, 64) == 11 and M.mhc_splits(4096, 64) == 2


def test_a_failed_warm_up_does_not_stop_the_driver(tmp_path, fake_pair):
    state = tmp_path / "state"
    assert G.drive(state, time.time() + 900, "smoke", 1, paths=fake_pair, warm_procs=2) == 0
    log = (state / "driver.log").read_text()
    assert "mHC warm-up: exit codes [1, 1]" in log  # the stand-in vLLM has no mHC kernels
    assert "No module named" in (state / "logs" / "warm0.log").read_text()
    assert len(store.read_jsonl(state / "results.jsonl")) > 0


def test_a_cold_jit_engine_starts_alone_with_an_empty_home(tmp_path, fake_pair, monkeypatch):
    """`jit-cold`: the cold engine runs in a group of its own with HOME an empty folder of
    the state (no JIT cache), the warm one with the driver's HOME."""
    cold, warm = P.PLANS["jit-cold"]()
    assert [[e.name for e in g] for g in G.pack_groups([cold, warm], {4: 17.0}, 130.0, 2.5)] \
        == [["L4-k3-graphs-coldjit"], ["L4-k3-graphs"]]
    assert len(G.pack_groups([warm, replace(warm, k=1)], {4: 17.0}, 130.0, 2.5)) == 1
    # both 4-layer checks on one H100 (2026-12-05): the MTP pair shares the GPU, cold alone
    both = P.PLANS["smoke-mtp-jit-cold"]()
    assert [[e.name for e in g] for g in G.pack_groups(both, {4: 18.6}, 79.6, 1.5)] == [
        ["L4-k0-graphs", "L4-k3-graphs-mtp"], ["L4-k3-graphs-coldjit"], ["L4-k3-graphs"]]
    seen = []
    from speclab import launch

    monkeypatch.setattr(launch, "start", lambda cmd, fh, env, **kw: seen.append(env["HOME"]) or
                        subprocess.Popen(["true"], stdin=subprocess.PIPE, text=True))
    (tmp_path / "state" / "coldhome" / cold.name).mkdir(parents=True)
    (tmp_path / "state" / "coldhome" / cold.name / "stale").write_text("x")
    for e in (cold, warm):
        G.start_worker(e, {}, tmp_path / "state").proc.wait()
    assert seen == [str(tmp_path / "state" / "coldhome" / cold.name), os.environ["HOME"]]
    assert not any((tmp_path / "state" / "coldhome" / cold.name).iterdir())


def test_serve_engines_time_passes_behind_an_http_server(tmp_path, fake_pair, monkeypatch):
    """`serve-smoke`'s engines, and the same k = 3 with the drafter eager, through a fake
    `vllm serve` (token-id prompts, streaming, /metrics) whose graphed drafter accepts
    nothing: each serve pass checks outputs and counters like an offline one (the graphed
    server is flagged: the control) and lands in `predict`'s serve table."""
    from speclab import stepcosts

    monkeypatch.setenv("FAKE_VLLM_GRAPHED_DRAFT_REJECTS", "1")
    plain, graphed = P.PLANS["serve-smoke"]()
    monkeypatch.setitem(P.PLANS, "serve-test",
                        lambda: [plain, graphed, replace(graphed, draft_eager=True)])
    state = tmp_path / "state"
    assert G.drive(state, time.time() + 300, "serve-test", 1, paths=fake_pair, tokens=64) == 0
    rows = store.read_jsonl(state / "results.jsonl")
    names = ("L4-k0-graphs-serve", "L4-k3-graphs-serve", "L4-k3-graphs-drafteager-serve")
    assert {(r["engine"], r["op"], r["round"], r["B"]) for r in rows} == {
        (e, "serve", r, B) for e in names for r in (0, 1) for B in (1, 4)}
    assert all(r["outputs_exact"] == r["B"] and r["output_tokens"] == 64 * r["B"] for r in rows)
    exact = {e: all(G.pass_exact(r) for r in rows if r["engine"] == e) for e in names}
    assert exact == {names[0]: True, names[1]: False, names[2]: True}
    eng = store.read_jsonl(state / "engines.jsonl")
    assert all(e["vllm"] == "0.0-fake" and any("MARLIN" in f for f in e["log_facts"])
               for e in eng)
    served = stepcosts.serve_costs(stepcosts.load(state))
    assert set(zip(served.k, served.B)) == {(0, 1), (0, 4), (3, 1), (3, 4)}
    assert served[served.k == 3].speedup.notna().all()
    assert stepcosts.step_costs(stepcosts.load(state)).empty  # no offline pass among them
    # the served passes beside the host samples of their windows, in the served-only report
    from speclab import predictreport

    host = predictreport.report(state).read_text().split("## The host during")[1]
    assert {line.split(" | ")[0] for line in host.splitlines()
            if "-serve |" in line} == set(names)
