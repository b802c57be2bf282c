"""The layer-exact rig's arms, expectations and run checks (issue 12).

Fixtures and design: `speclab.fixtures.dsv4_layer_rig`. Arms (`ARMS`, one engine each on the
GPU): positive (the resolved convention: capture after [2, 3, 4]), neg-input (the other
convention: after [1, 2, 3], every slot holds J - J'), neg-stream0 (hc stream 0 instead of the
mean: 2(J - J') in slot 0, nothing in slots 1 and 2), neg-perm (the slot-rotated draft: slots
read J - J', J - J', J''). Every negative leaves the right token's vote at ~0 in every slot.
`expected_arms` computes every arm's counters from the transformers reference and
`vote_stats` the per-slot votes and margins in units of the measured cross-talk noise;
`check_run` compares a GPU run folder with them. CLI: `tools/layer_rig.py`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from speclab.fingerprint import file_sha256
from speclab.fixtures import dsv4_rigs as RG
from speclab.fixtures import dsv4_target as T
from speclab.fixtures.dsv4_layer_rig import EXTRA_TOKENS, junk_maps

# --------------------------------------------------------------------------- arms
ARMS: dict = {
    "positive": {"draft": "layer-rig-dsv4-eagle3", "convention": None, "reduce": "mean"},
    "neg-input": {"draft": "layer-rig-dsv4-eagle3", "convention": "input", "reduce": "mean"},
    "neg-stream0": {"draft": "layer-rig-dsv4-eagle3", "convention": None, "reduce": "stream0"},
    "neg-perm": {"draft": "layer-rig-dsv4-eagle3-perm", "convention": None, "reduce": "mean"},
}
"""Per arm: the draft fixture, the convention forced through EAGLE3_AUX_LAYER_CONVENTION
(None: resolved from the draft config) and how the engine reduces the hc streams."""


def overlay_module():
    """The overlay's `deepseek_v4_eagle3_aux` (pure functions; importing installs nothing)."""
    import importlib

    from speclab import overlay

    if "deepseek_v4_eagle3_aux" not in sys.modules:
        folder = str(overlay.source_dir())
        sys.path.insert(0, folder)
        try:
            importlib.import_module("deepseek_v4_eagle3_aux")
        finally:
            sys.path.remove(folder)
    return sys.modules["deepseek_v4_eagle3_aux"]


def arm_capture(draft_cfg: dict, num_layers: int, convention: str | None) -> dict:
    """The overlay's resolution for an arm (capture-after-layers and why)."""
    aux = overlay_module()
    env = {aux.CONVENTION_ENV: convention} if convention else {}
    return aux.resolve_aux_convention(draft_cfg, num_layers, env=env)


def arm_aux(means: torch.Tensor, stream0: torch.Tensor, capture, reduce: str) -> torch.Tensor:
    """[T, n_aux * H] aux input: the hc-mean (or stream 0) after each capture layer count.
    means, stream0: [N + 1, T, H] (index = layers completed)."""
    src = {"mean": means, "stream0": stream0}[reduce]
    return torch.cat([src[c] for c in capture], dim=-1)


def slot_votes(draft_sd: dict, draft_cfg: dict, aux: torch.Tensor) -> torch.Tensor:
    """[T, n_aux, V_target] per-slot votes for the target id each position's draft proposes:
    vote_k[y] = D[y - 2] . fc_k(fc_norm_k(aux_k)), i.e. the slot's share of the draft logit
    before the draft's final RMSNorm (which rescales all candidates alike)."""
    n = draft_cfg["num_aux_hidden_states"]
    H = draft_cfg["target_hidden_size"]
    fc = draft_sd["fc.weight"].float()
    head = draft_sd["lm_head.weight"].float()
    d2t = draft_sd["d2t"].long()
    tid = torch.arange(len(d2t)) + d2t
    eps = draft_cfg["rms_norm_eps"]
    out = torch.full((aux.shape[0], n, draft_cfg["vocab_size"]), float("nan"))
    for k in range(n):
        a = aux[:, k * H:(k + 1) * H].float()
        a = a / torch.sqrt(a.pow(2).mean(-1, keepdim=True) + eps)
        a = a * draft_sd[f"fc_norm.{k}.weight"].float()
        out[:, k, tid] = (a @ fc[:, k * H:(k + 1) * H].T) @ head.T
    return out


def vote_stats(votes: torch.Tensor, tokens: torch.Tensor, maps: torch.Tensor) -> dict:
    """Per-slot vote of the right token (x + 2 from the aux of x), the largest other vote,
    the background (candidates the design never votes for: their spread is the cross-talk
    noise), and the total-logit margin right - best other, over all positions."""
    T_, _, Vt = votes.shape
    x = tokens[:T_]
    right = x + 2
    designed = torch.zeros(T_, Vt, dtype=torch.bool)
    designed[torch.arange(T_), right] = True
    for j in range(maps.shape[1] * maps.shape[2]):
        designed[torch.arange(T_), maps.view(maps.shape[0], -1)[x, j] + 2] = True
    valid = ~torch.isnan(votes[:, 0])
    bg = votes.permute(1, 0, 2)[:, valid & ~designed]  # [n, M]
    total = votes.sum(1)
    r = total[torch.arange(T_), right]
    others = total.clone()
    others[torch.arange(T_), right] = float("-inf")
    others[~valid] = float("-inf")
    best = others.max(-1)
    noise = bg.pow(2).mean(-1).sqrt()  # per slot
    noise_total = bg.sum(0).pow(2).mean().sqrt()
    per_slot_right = votes[torch.arange(T_), :, right]  # [T, n]
    return {
        "right_vote": per_slot_right,
        "right_vote_min": per_slot_right.min(0).values.tolist(),
        "right_vote_max_abs": per_slot_right.abs().max(0).values.tolist(),
        "noise_rms": noise.tolist(), "noise_total_rms": float(noise_total),
        "margin": (r - best.values), "argmax_right": best.values < r}


def _ref_sequences(ref, prompts, max_new: int) -> list[dict]:
    """Greedy continuation, hc-mean and stream-0 after 0..N layers, margins per prompt.

    The greedy continuation is found in one stateless forward: the counting continuation is
    proposed and kept iff the argmax at every position of prompt + proposal is the proposal's
    next token (which is what greedy decoding produces, prefix by prefix); otherwise the
    reference decodes greedily."""
    from speclab.fixtures.dsv4_reference import logit_margins

    out = []
    for prompt in prompts:
        p = len(prompt)
        seq = list(prompt) + list(range(prompt[-1] + 1, prompt[-1] + 1 + max_new))
        f = ref.forward(seq, streams=True)
        if f["logits"][p - 1:-1].argmax(-1).tolist() != seq[p:]:
            seq = list(prompt) + ref.greedy(prompt, max_new)
            f = ref.forward(seq, streams=True)
        st = f["streams"]
        out.append({"tokens": torch.tensor(seq), "prompt_len": p,
                    "means": torch.stack([st[L].mean(1) for L in sorted(st)]),
                    "stream0": torch.stack([st[L][:, 0] for L in sorted(st)]),
                    "margin": logit_margins(f["logits"])[p - 1:-1]})
    return out


@torch.no_grad()
def expected_arms(target_dir: Path, drafts: dict, prompts, max_tokens: int, k: int = 3,
                  arms: dict | None = None, fp8_sim: bool = False,
                  threads: int | None = 2) -> dict:
    """Counters and vote margins of every arm from the transformers reference (float32,
    dequantized FP8 weights; `fp8_sim` adds its FP8 activation estimate).

    drafts: {draft fixture name: directory}. Returns {"arms": {arm: {...}}, "target": ...}.
    """
    from speclab.fixtures.dsv4_reference import DSV4Reference, enable_fp8_simulation
    from speclab.fixtures.eagle3_draft import (
        draft_chains,
        load_draft,
        simulate_greedy_spec_decode,
        spec_decode_rounds,
    )

    arms = arms or ARMS
    ref = DSV4Reference(target_dir, threads=threads)
    if fp8_sim:
        enable_fp8_simulation(ref.model, ref.cfg)
    N = ref.n_layers
    maps = junk_maps(ref.cfg["vocab_size"], N,
                     json.loads((Path(target_dir) / T.FIXTURE_META).read_text())["seed"])
    t0 = time.time()
    seqs = _ref_sequences(ref, prompts, max_tokens + k + EXTRA_TOKENS)
    counting = all(bool((s["tokens"][s["prompt_len"]:] - s["tokens"][s["prompt_len"] - 1:-1]
                         == 1).all()) for s in seqs)
    res = {"target": {"counting": counting, "margin_min": round(float(min(
        s["margin"].min() for s in seqs)), 3), "reference_s": round(time.time() - t0, 1)},
        "arms": {}}
    embed = RG._target_tensor(target_dir, "embed.weight")
    loaded = {name: (load_draft(Path(d), embed), _draft_state(d)) for name, d in drafts.items()}
    for arm, spec in arms.items():
        draft, (sd, dcfg) = loaded[spec["draft"]]
        plan = arm_capture(dcfg, N, spec["convention"])
        tot = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
               "accepted_per_pos": [0] * k, "per_prompt": []}
        margins, right_all, stats_all = [], [], []
        for s in seqs:
            aux = arm_aux(s["means"], s["stream0"], plan["capture_after_layers"],
                          spec["reduce"])
            chains = draft_chains(draft, aux[None], s["tokens"][None], k)[0]
            c = simulate_greedy_spec_decode(chains, s["tokens"], s["prompt_len"], k,
                                            max_tokens)
            for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                tot[key] += c[key]
            tot["accepted_per_pos"] = [a + b for a, b in zip(tot["accepted_per_pos"],
                                                             c["accepted_per_pos"])]
            last = spec_decode_rounds(chains, s["tokens"], s["prompt_len"], k, max_tokens)[-1]
            tot["per_prompt"].append({"num_drafts": c["num_drafts"],
                                      "accepted_per_pos": c["accepted_per_pos"],
                                      "last_round_accepted": last})
            st = vote_stats(slot_votes(sd, dcfg, aux[:-1]), s["tokens"], maps)
            stats_all.append(st)
            margins.append(st["margin"])
            right_all.append(chains[:, 0] == s["tokens"][:-1] + 2)
        nd = max(tot["num_drafts"], 1)
        tot["per_pos_rate"] = [round(a / nd, 4) for a in tot["accepted_per_pos"]]
        tot["mean_acceptance_length"] = round(1 + tot["num_accepted_tokens"] / nd, 4)
        m = torch.cat(margins)
        noise = float(np.mean([st["noise_total_rms"] for st in stats_all]))
        rv = torch.cat([st["right_vote"] for st in stats_all])
        res["arms"][arm] = {
            **{k2: plan[k2] for k2 in ("convention", "capture_after_layers", "why")},
            "draft": spec["draft"], "reduce": spec["reduce"], "k": k, "counters": tot,
            "draft_right_share": round(float(torch.cat(right_all).double().mean()), 4),
            "votes": {"positions": int(m.numel()),
                      "right_vote_per_slot_min": rv.min(0).values.tolist(),
                      "right_vote_per_slot_max_abs": rv.abs().max(0).values.tolist(),
                      "noise_rms_per_slot": np.mean([st["noise_rms"] for st in stats_all],
                                                    axis=0).tolist(),
                      "noise_total_rms": noise,
                      "margin_min": float(m.min()), "margin_max": float(m.max()),
                      "margin_min_in_noise": float(m.min()) / noise,
                      "margin_max_in_noise": float(m.max()) / noise,
                      "argmax_right_share": round(float(torch.cat(
                          [st["argmax_right"] for st in stats_all]).double().mean()), 4)}}
    return res


def _draft_state(draft_dir: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return (load_file(str(Path(draft_dir) / "model.safetensors")),
            json.loads((Path(draft_dir) / "config.json").read_text()))


# --------------------------------------------------------------------------- files
EXPECTED_FILE = "data/expected/layer-rig-dsv4-k3.json"
PROMPT_FILE = "data/prompts/layer-rig-dsv4-ids.jsonl"
TARGET = "layer-rig-dsv4"


def expectations(prompt_file: str = PROMPT_FILE, max_tokens: int = 64, k: int = 3,
                 fp8_sim: bool = False) -> dict:
    """Build the rig's fixtures (registry cache) and compute every arm's expectations, with
    the provenance the GPU run is checked against (fixture cache keys and weight hashes)."""
    from importlib import metadata

    from speclab import fixtures, prompts

    plist = prompts.load(prompt_file)
    dirs = {name: fixtures.build(name) for name in
            (TARGET, *sorted({a["draft"] for a in ARMS.values()}))}
    t0 = time.time()
    res = expected_arms(dirs[TARGET], {n: d for n, d in dirs.items() if n != TARGET},
                        [list(p.prompt_token_ids) for p in plist], max_tokens, k,
                        fp8_sim=fp8_sim)
    fx = {n: {"dir": d.name, "safetensors_sha256": json.loads(
        (d / T.FIXTURE_META).read_text()).get("safetensors_sha256") or file_sha256(
        d / "model.safetensors")} for n, d in dirs.items()}
    return {"prompts": prompt_file, "prompt_ids": [p.id for p in plist],
            "max_tokens": max_tokens, "k": k, "fp8_sim": fp8_sim, "fixtures": fx,
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "libraries": {m: metadata.version(m) for m in ("torch", "transformers")},
            "wall_s": round(time.time() - t0, 1), **res}


def check_run(expected: dict, arm: str, run_dir: Path) -> dict:
    """An arm's GPU run against its expectations: the engine's counters exact and every
    output the counting continuation (speculation must not change greedy output); `exact`
    needs both. Per prompt (recorded, not part of `exact`): counters from engine steps miss
    the final verify round, which ends the request (run h200-dsv4-rig-20261130-h4096: 31 of
    32 drafts per prompt, totals exact), so each prompt must read its expectation less that
    round; vLLM's own per-request counters (`attribution_source` native) count it in full."""
    from speclab import store

    exp = expected["arms"][arm]["counters"]
    k = expected["k"]
    points = [m for m in store.point_metas(run_dir)
              if m["point_id"].startswith(f"k{k}_") and m["status"] == "ok"]
    if len(points) != 1:
        raise ValueError(f"{run_dir}: want one finished k={k} point, found {len(points)}")
    got = points[0]["counters"]
    rows = store.requests(run_dir, points[0]["point_id"])
    rows = rows.set_index("prompt_id").loc[expected["prompt_ids"]]
    per_prompt = [{"num_drafts": int(r.drafts), "accepted_per_pos": [int(a) for a in
                                                                      r.accepted_per_pos]}
                  for r in rows.itertuples()]
    cut = points[0].get("attribution_source") != "native"
    want = [{"num_drafts": e["num_drafts"] - cut, "accepted_per_pos": [
        a - cut * (e["last_round_accepted"] > j) for j, a in
        enumerate(e["accepted_per_pos"])]} for e in exp["per_prompt"]]
    counting = all(list(r.output_token_ids) == list(range(
        last + 1, last + 1 + len(r.output_token_ids)))
        for r, last in zip(rows.itertuples(), _last_prompt_tokens(expected)))
    match = {key: got[key] == exp[key] for key in ("num_drafts", "accepted_per_pos")}
    return {"arm": arm, "run_dir": str(run_dir), "point": points[0]["point_id"],
            "exact": all(match.values()), "match": match, "outputs_counting": counting,
            "per_prompt_match": per_prompt == want, "per_prompt_measured": per_prompt,
            "expected": {key: exp[key] for key in ("num_drafts", "accepted_per_pos")},
            "measured": {key: got[key] for key in ("num_drafts", "accepted_per_pos")},
            "env": points[0].get("env", {})}


def same_weights(expected: dict, arm: str) -> dict[str, bool]:
    """Whether this machine's build of the arm's target and draft has the weights the
    expectations were computed on (sha256 of model.safetensors)."""
    from speclab import fixtures

    return {n: file_sha256(fixtures.build(n) / "model.safetensors")
            == expected["fixtures"][n]["safetensors_sha256"] for n in (TARGET, ARMS[arm]["draft"])}


def _last_prompt_tokens(expected: dict) -> list[int]:
    from speclab import prompts

    by_id = {p.id: p for p in prompts.load(expected["prompts"])}
    return [by_id[i].prompt_token_ids[-1] for i in expected["prompt_ids"]]


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="layer-exact rig: expectations and run checks "
                                 "(tools/layer_rig.py)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("expect", help="compute every arm's expected counters (CPU)")
    e.add_argument("--prompts", default=PROMPT_FILE)
    e.add_argument("--max-tokens", type=int, default=64)
    e.add_argument("--k", type=int, default=3)
    e.add_argument("--fp8-sim", action="store_true")
    e.add_argument("--out", type=Path, default=Path(EXPECTED_FILE))
    c = sub.add_parser("check", help="compare an arm's run folder with the expectations")
    c.add_argument("arm", choices=sorted(ARMS))
    c.add_argument("run_dir", type=Path)
    c.add_argument("--expected", type=Path, default=Path(EXPECTED_FILE))
    a = ap.parse_args(argv)
    if a.cmd == "expect":
        res = expectations(a.prompts, a.max_tokens, a.k, a.fp8_sim)
        from speclab import store

        store.atomic_write(a.out, json.dumps(res, indent=1) + "\n")
        print(json.dumps({arm: r["counters"]["accepted_per_pos"] for arm, r in
                          res["arms"].items()}))
        return 0
    expected = json.loads(a.expected.read_text())
    out = check_run(expected, a.arm, a.run_dir)
    out["same_weights"] = same_weights(expected, a.arm)
    from speclab import store

    store.atomic_write(a.run_dir / f"expected_check_{a.arm}.json",
                       json.dumps(out, indent=1) + "\n")
    print(json.dumps({key: out[key] for key in ("arm", "exact", "outputs_counting",
                                                "per_prompt_match", "same_weights")}))
    return 0 if out["exact"] and out["outputs_counting"] else 1
