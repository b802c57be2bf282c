"""Aux hidden states vLLM hands an EAGLE-3 draft, against an independent reference, with
negative controls (issue 12, item 4).

The device job (`tools/gpu/aux_check.py`) records every drafter call of a request (prefill
and decode/verify steps): positions, input token ids and the concatenated aux states. Here,
on any machine, each recorded row is compared with the transformers reference's residual
streams of the same sequence: the hc-mean stream after every number of layers 0..N, and
hyper-connection stream 0 after the configured number. The configured layer must be the
closest of all at every position; the margin is how much farther the neighbours are
(min over positions of err(neighbour) / err(configured)).

Rows are usable when their token is the sequence's token at that position, and every earlier
row of the same call is too (a rejected draft token changes the context of what follows it
in that verify step).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd


def usable_rows(positions: np.ndarray, token_ids: np.ndarray, seq: Sequence[int]) -> np.ndarray:
    """Indices of one call's rows that hold states of `seq` (see module doc)."""
    keep = []
    for r, (p, t) in enumerate(zip(positions.tolist(), token_ids.tolist())):
        if not 0 <= p < len(seq) or seq[p] != t:
            break
        keep.append(r)
    return np.asarray(keep, dtype=np.int64)


def _err_cos(got: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Relative L2 error |got - ref| / |ref| and cosine, per row (float64)."""
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    nr = np.linalg.norm(ref, axis=-1)
    err = np.linalg.norm(got - ref, axis=-1) / np.maximum(nr, 1e-30)
    cos = (got * ref).sum(-1) / np.maximum(np.linalg.norm(got, axis=-1) * nr, 1e-30)
    return err, cos


def compare_request(calls: list[dict], seq: Sequence[int], means: np.ndarray,
                    stream0: np.ndarray, capture: Sequence[int],
                    request: str = "0") -> pd.DataFrame:
    """One request's recorded drafter calls against its reference streams.

    calls: [{"positions": [R], "token_ids": [R], "aux": [R, n_slots * H]}] in call order
    (call 0 = prefill). means, stream0: [N + 1, T, H], the hc-mean and stream 0 after 0..N
    layers for `seq`. capture: the configured number of layers before each slot's capture.
    Returns one row per (position, slot, candidate): candidate `L<n>` (hc-mean after n
    layers) or `stream0`, with rel_err, cosine and `configured` (the slot's layer count).
    """
    n_slots, H = len(capture), means.shape[-1]
    frames = []
    for ci, call in enumerate(calls):
        rows = usable_rows(np.asarray(call["positions"]), np.asarray(call["token_ids"]), seq)
        if not len(rows):
            continue
        pos = np.asarray(call["positions"])[rows]
        aux = np.asarray(call["aux"], dtype=np.float32)[rows].reshape(len(rows), n_slots, H)
        for k, c in enumerate(capture):
            cands = {f"L{n}": means[n, pos] for n in range(means.shape[0])}
            cands["stream0"] = stream0[c, pos]
            for name, ref in cands.items():
                err, cos = _err_cos(aux[:, k], ref)
                frames.append(pd.DataFrame({
                    "request": request, "call": ci, "phase": "prefill" if ci == 0 else "decode",
                    "position": pos, "slot": k, "configured": int(c), "candidate": name,
                    "layers": int(name[1:]) if name[0] == "L" else int(c),
                    "rel_err": err, "cosine": cos}))
    if not frames:
        raise ValueError(f"request {request}: no recorded row matches the sequence")
    return pd.concat(frames, ignore_index=True)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per slot and phase (and `all`): positions, the configured layer's worst error and
    cosine, the closest hc-mean layer (must be the configured one at every position), and the
    margins err(neighbour) / err(configured) (min over positions) for one layer fewer, one
    more, and stream 0 instead of the mean."""
    out = []
    for phase in ("prefill", "decode", "all"):
        part = df if phase == "all" else df[df["phase"] == phase]
        for slot, g in part.groupby("slot"):
            c = int(g["configured"].iloc[0])
            key = ["request", "call", "position"]
            wide = g.pivot_table(index=key, columns="candidate", values="rel_err")
            cosw = g.pivot_table(index=key, columns="candidate", values="cosine")
            layers = [col for col in wide.columns if col.startswith("L")]
            closest = wide[layers].idxmin(axis=1).str[1:].astype(int)
            conf = wide[f"L{c}"]
            ratios = {col: float((wide[col] / conf).min()) for col in wide.columns}
            out.append({
                "slot": int(slot), "phase": phase, "configured": c, "positions": len(wide),
                "rel_err_max": float(conf.max()), "rel_err_median": float(conf.median()),
                "cosine_min": float(cosw[f"L{c}"].min()),
                "closest_is_configured": bool((closest == c).all()),
                "closest_layers": sorted(set(closest.tolist())),
                "margin_fewer": ratios.get(f"L{c - 1}"), "margin_more": ratios.get(f"L{c + 1}"),
                "margin_stream0": ratios.get("stream0")})
    return pd.DataFrame(out)


def records(summary: pd.DataFrame) -> list[dict]:
    """The summary as JSON-ready records (missing margins as None)."""
    return [{k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in r.items()}
            for r in summary.to_dict("records")]


def verdict(summary: pd.DataFrame) -> bool:
    """The configured layer is the closest at every position of every slot and phase."""
    return bool(len(summary)) and bool(summary["closest_is_configured"].all())


def markdown(summary: pd.DataFrame, title: str = "") -> str:
    """The summary as a markdown table (for reports and notes)."""
    fmt = lambda v, f="{:.3g}": "n/a" if v is None or (isinstance(v, float) and np.isnan(v)) \
        else f.format(v)
    header = ("| slot | phase | after layers | positions | rel. err. max | cos min | closest | "
              "fewer / conf. | more / conf. | stream 0 / conf. |")
    lines = ([f"**{title}**", ""] if title else []) + [
        header, "|---:|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in summary.to_dict("records"):
        lines.append(
            f"| {r['slot']} | {r['phase']} | {r['configured']} | {r['positions']} | "
            f"{fmt(r['rel_err_max'])} | {fmt(r['cosine_min'], '{:.4f}')} | "
            f"{'yes' if r['closest_is_configured'] else 'NO ' + str(r['closest_layers'])} | "
            f"{fmt(r['margin_fewer'])} | {fmt(r['margin_more'])} | {fmt(r['margin_stream0'])} |")
    return "\n".join(lines) + "\n"


def rows_npz(served: list[dict]) -> dict:
    """npz arrays of the usable recorded rows per served request i: `r{i}_seq`,
    `r{i}_prompt_len`, `r{i}_call`, `r{i}_position`, `r{i}_aux` (float16: what the engine
    handed the draft, compact enough to carry back and compare releases offline).
    served: [{"prompt", "output", "calls"}] (calls as in `compare_request`)."""
    out = {}
    for i, s in enumerate(served):
        seq = list(s["prompt"]) + list(s["output"])
        keep = [(j, r) for j, c in enumerate(s["calls"]) for r in
                usable_rows(np.asarray(c["positions"]), np.asarray(c["token_ids"]), seq)]
        out[f"r{i}_seq"] = np.asarray(seq, dtype=np.int64)
        out[f"r{i}_prompt_len"] = np.int64(len(s["prompt"]))
        out[f"r{i}_call"] = np.asarray([j for j, _ in keep], dtype=np.int64)
        out[f"r{i}_position"] = np.asarray([s["calls"][j]["positions"][r] for j, r in keep],
                                           dtype=np.int64)
        out[f"r{i}_aux"] = np.stack([np.asarray(s["calls"][j]["aux"][r]) for j, r in keep]
                                    ).astype(np.float16)
    return out


def analyse(served: list[dict], ref, capture: Sequence[int], tag: str = "") -> dict:
    """Every served request against the reference (`DSV4Reference`), plain and then with its
    FP8-activation simulation switched on (it stays on): {mode: {verdict, summary, table}}."""
    from speclab.fixtures.dsv4_reference import enable_fp8_simulation

    results = {}
    for mode in ("plain", "fp8-sim"):
        if mode == "fp8-sim":
            enable_fp8_simulation(ref.model, ref.cfg)
        frames = []
        for i, s in enumerate(served):
            seq = list(s["prompt"]) + list(s["output"])
            means, s0 = reference_streams(ref, seq)
            frames.append(compare_request(s["calls"], seq, means, s0, capture, request=str(i)))
        summ = summarize(pd.concat(frames, ignore_index=True))
        results[mode] = {"verdict": verdict(summ), "summary": records(summ),
                         "table": markdown(summ, f"{tag}: reference {mode}".strip(": "))}
    return results


def reference_streams(ref, seq: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(means, stream0), each [N + 1, T, H] float32, from a `DSV4Reference` forward."""
    st = ref.forward(list(seq), streams=True)["streams"]
    order = sorted(st)
    return (np.stack([st[n].mean(1).numpy() for n in order]),
            np.stack([st[n][:, 0].numpy() for n in order]))


def report_html(run_dir: Path) -> Path:
    """Render a folder of aux checks (`aux_check_<tag>.{json,md}`, tools/gpu/aux_check.py) as
    one page, `report.html`: per check, where and on what it was measured, the verdict and
    the tables (configured layer vs neighbours and stream 0). Returns the page's path."""
    import html

    import mistune

    run_dir = Path(run_dir)
    checks = sorted(run_dir.glob("aux_check_*.json"))
    if not checks:
        raise FileNotFoundError(
            f"{run_dir}: no aux_check_*.json (tools/gpu/aux_check.py writes them)")
    parts = []
    for path in checks:
        meta = json.loads(path.read_text())
        v = meta.get("versions", {})
        table = path.with_suffix(".md")
        parts.append(
            f"<h2>{html.escape(path.stem.removeprefix('aux_check_'))}: "
            f"{'configured layer closest everywhere' if meta.get('verdict') else 'FAILED'}</h2>"
            f"<p>Measured {html.escape(str(meta.get('date')))} on {html.escape(str(v.get('gpu')))}"
            f" ×{html.escape(str(v.get('gpu_count')))}, vLLM {html.escape(str(v.get('vllm')))}, "
            f"torch {html.escape(str(v.get('torch')))}, CUDA {html.escape(str(v.get('cuda')))}; "
            f"target {html.escape(str(meta.get('target')))}, draft "
            f"{html.escape(str(meta.get('draft')))}, k={meta.get('k')}, "
            f"{'eager' if meta.get('enforce_eager') else 'compiled'}.<br>"
            f"Command: <code>{html.escape(str(meta.get('command')))}</code></p>"
            + (mistune.html(table.read_text()) if table.exists() else "<p>no table</p>"))
    page = ("<!doctype html><meta charset='utf-8'><title>aux check: " + html.escape(run_dir.name)
            + "</title><style>body{font-family:sans-serif;max-width:70em;margin:auto}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;"
            "text-align:right}</style>"
            f"<h1>Aux states vs the transformers reference: {html.escape(run_dir.name)}</h1>"
            "<p>Per captured slot and phase: the relative error and cosine of the states vLLM "
            "hands the draft against the reference's stream mean after the configured number of "
            "layers, whether that layer is the closest at every position, and how many times "
            "further one layer fewer, one more, and hyper-connection stream 0 are (margin / "
            "configured error).</p>" + "".join(parts))
    out = run_dir / "report.html"
    from speclab import store

    store.atomic_write(out, page)
    return out
