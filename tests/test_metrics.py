import json
import math
import subprocess
import sys
from types import SimpleNamespace as NS

import numpy as np
import pytest

from speclab import metrics
from speclab.metrics import SpecCounters

# 10 drafts at k=3 whose accepted prefix lengths are 3,3,2,2,2,1,1,0,0,0:
# A_0 = 7, A_1 = 5, A_2 = 2, A = 14.
C = SpecCounters(10, 30, 14, (7, 5, 2))


def test_derived_rates_by_hand():
    assert C.acceptance_rate == pytest.approx(14 / 30)
    assert C.mean_acceptance_length == pytest.approx(2.4)
    assert C.per_position == pytest.approx([0.7, 0.5, 0.2])
    assert sum(C.per_position) == pytest.approx(C.mean_acceptance_length - 1)
    assert C.conditional == pytest.approx([0.7, 5 / 7, 2 / 5])


def test_delta_and_sum_of_snapshots():
    before = SpecCounters(4, 12, 5, (3, 2))
    after = SpecCounters(14, 42, 19, (10, 7, 2))
    assert after - before == C
    assert before + C == after


def test_empty_counters_are_nan_not_errors():
    e = SpecCounters()
    assert math.isnan(e.acceptance_rate) and e.mean_acceptance_length != e.mean_acceptance_length
    assert (SpecCounters(0, 0, 0, (0, 0)).conditional[1]
            != SpecCounters(0, 0, 0, (0, 0)).conditional[1])


def test_from_snapshot_sums_engines_and_ignores_other_metrics():
    snap = [
        NS(name="vllm:spec_decode_num_drafts", labels={"engine": "0"}, value=6),
        NS(name="vllm:spec_decode_num_drafts", labels={"engine": "1"}, value=4),
        NS(name="vllm:spec_decode_num_draft_tokens", labels={}, value=30),
        NS(name="vllm:spec_decode_num_accepted_tokens", labels={}, value=14),
        NS(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={"engine": "0"},
           values=[4, 3, 1]),
        NS(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels={"engine": "1"},
           values=[3, 2, 1]),
        NS(name="vllm:num_requests_running", labels={}, value=3),
    ]
    assert metrics.from_snapshot(snap) == C


PROM = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 14.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_from_prometheus_text():
    assert metrics.from_prometheus(PROM) == C


NEW = ("INFO 11-30 00:33:14 [metrics.py:121] SpecDecoding metrics: Mean acceptance length: 2.40, "
       "Accepted throughput: 12.00 tokens/s, Drafted throughput: 25.00 tokens/s, Accepted: 120 "
       "tokens, Drafted: 300 tokens, Per-position acceptance rate: 0.700, 0.450, 0.250, Avg Draft "
       "acceptance rate: 40.0%")
OLD = ("INFO 06-06 14:20:34 [metrics.py:86] SpecDecoding metrics: Draft acceptance rate: 38.8%, "
       "Mean acceptance length: 2.16, Accepted: 150 tokens, Drafted: 387 tokens, Per-position "
       "acceptance rate: 0.543, 0.357, 0.264")
OLDEST = ("INFO 04-02 18:03:41 [metrics.py:53] SpecDecoding metrics: Draft acceptance rate: 52.5%, "
          "Accepted: 21 tokens, Drafted: 40 tokens")


def test_parse_log_both_wordings():
    new, old, oldest = metrics.parse_log("\n".join(["noise", NEW, "more noise", OLD, OLDEST]))
    assert new == {"accepted": 120, "drafted": 300, "acceptance_rate": pytest.approx(0.4),
                   "mean_acceptance_length": 2.4, "per_position": [0.7, 0.45, 0.25]}
    assert old["acceptance_rate"] == pytest.approx(0.388)
    assert old["mean_acceptance_length"] == 2.16
    assert old["per_position"] == [0.543, 0.357, 0.264]
    assert (old["accepted"], old["drafted"]) == (150, 387)
    assert oldest["mean_acceptance_length"] is None
    assert oldest["per_position"] == []
    assert oldest["acceptance_rate"] == pytest.approx(0.525)


def test_parse_log_nan_rate_is_null():
    rec = metrics.parse_log_line("SpecDecoding metrics: Draft acceptance rate: nan%, Accepted: 0 "
                                 "tokens, Drafted: 0 tokens")
    assert rec["acceptance_rate"] is None and rec["accepted"] == 0


def test_cli_parse_log_prints_json_lines(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("\n".join([NEW, "x", OLD]))
    out = subprocess.run([sys.executable, "-m", "speclab", "metrics", "parse-log", str(log)],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    recs = [json.loads(line) for line in out]
    assert len(recs) == 2
    assert set(recs[0]) == {"line", "timestamp", "accepted", "drafted", "acceptance_rate",
                            "mean_acceptance_length", "per_position"}
    assert recs[1]["per_position"] == [0.543, 0.357, 0.264]


def test_request_counters_from_step_tokens():
    # prefill emits 1, then verify steps emit 1 + accepted; a 0-token step is ignored
    c = metrics.request_counters([1, 4, 0, 3, 1, 2], k=3)
    assert c == SpecCounters(4, 12, 3 + 2 + 0 + 1, (3, 2, 1))
    assert metrics.request_counters([1, 1, 1], k=0) == SpecCounters()
    # a finished request (max_tokens or stop may cut its last round): that round is left out
    assert metrics.request_counters([1, 4, 3, 1, 2], k=3, finished=True) == SpecCounters(
        3, 9, 3 + 2 + 0, (2, 2, 1))
    assert metrics.dropped_rounds([1, 4, 3, 1, 2], finished=True) == 1
    assert metrics.dropped_rounds([1, 4, 3, 1, 2], finished=False) == 0
    # finished right after prefill: no round to leave out
    assert metrics.request_counters([0, 1], k=3, finished=True) == SpecCounters(0, 0, 0, (0, 0, 0))
    assert metrics.dropped_rounds([0, 1], finished=True) == 0


def test_attribution_of_per_request_counters():
    eng = SpecCounters(10, 30, 14, (7, 5, 2))
    assert metrics.attribution(eng, eng, 0) == "exact"
    assert metrics.attribution(eng, SpecCounters(8, 24, 11, (5, 4, 2)), 2) == "consistent"
    assert metrics.attribution(eng, SpecCounters(8, 24, 8, (3, 3, 2)), 2) == "mismatch"
    assert metrics.attribution(eng, SpecCounters(9, 27, 14, (7, 5, 2)), 2) == "mismatch"


def test_histogram_counts_steps_by_length():
    h = metrics.acceptance_length_histogram([[1, 4, 3, 1], [1, 2, 4]], k=3)
    assert list(h) == [1, 1, 1, 2]  # lengths 1..4


def test_bootstrap_ci_brackets_point_estimate_and_is_seeded():
    rng = np.random.default_rng(1)
    drafts = rng.integers(5, 20, size=40)
    acc0 = rng.binomial(drafts, 0.7)
    acc1 = rng.binomial(acc0, 0.6)
    app = np.stack([acc0, acc1], axis=1)
    ci = metrics.bootstrap_ci(drafts, app, n_boot=500, seed=3)
    al = 1 + app.sum() / drafts.sum()
    lo, hi = ci["mean_acceptance_length"]
    assert lo < al < hi and hi - lo < 0.5
    assert np.all(ci["per_position"][0] <= app.sum(0) / drafts.sum())
    again = metrics.bootstrap_ci(drafts, app, n_boot=500, seed=3)
    assert np.array_equal(again["conditional"], ci["conditional"])


def test_speedup_bounds():
    assert metrics.expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)
    assert metrics.expected_tokens_per_step(1.0, 3) == 4
    assert metrics.ideal_speedup(2.4, 3, 0.1) == pytest.approx(2.4 / 1.3)


def test_acceptance_uses_engine_counters_where_attribution_failed():
    """Server mode at c=1 on the H200: stream chunks merged verify steps, so a point's
    per-request counters (356 drafts) fell short of /metrics (378): that point must be
    reported from the engine's counters, without CIs, and left out of per-category rows."""
    import pandas as pd

    from speclab import analysis

    def recs(pid, per_request):
        return [{"point_id": pid, "k": 2, "kv_cache_dtype": "fp8", "layout": "tp1",
                 "prompt_format": "raw", "category": cat, "drafts": d,
                 "accepted_per_pos": list(a)} for cat, d, a in per_request]

    rows = recs("ok", [("a", 10, (8, 4)), ("b", 10, (6, 2))]) + \
        recs("merged", [("a", 3, (3, 3)), ("b", 2, (2, 2))])
    records = pd.DataFrame(rows)
    points = pd.DataFrame([
        {"point_id": "ok", "status": "ok", "attribution": "consistent",
         "counters.num_drafts": 21, "counters.num_draft_tokens": 42,
         "counters.num_accepted_tokens": 21, "counters.accepted_per_pos": [15, 6]},
        {"point_id": "merged", "status": "ok", "attribution": "mismatch",
         "counters.num_drafts": 20, "counters.num_draft_tokens": 40,
         "counters.num_accepted_tokens": 22, "counters.accepted_per_pos": [14, 8]}])
    acc = analysis.acceptance(records, points=points, n_boot=50).set_index("point_id")
    assert acc.loc["ok", "source"] == "requests" and acc.loc["ok", "num_drafts"] == 20
    assert acc.loc["ok", "per_position"] == pytest.approx([0.7, 0.3])
    assert acc.loc["merged", "source"] == "engine" and acc.loc["merged", "num_drafts"] == 20
    assert acc.loc["merged", "mean_acceptance_length"] == pytest.approx(1 + 22 / 20)
    assert acc.loc["merged", "per_position"] == pytest.approx([0.7, 0.4])
    assert math.isnan(acc.loc["merged", "al_lo"]) and not math.isnan(acc.loc["ok", "al_lo"])
    by_cat = analysis.acceptance(records, by=["category"], points=points, n_boot=50)
    assert set(by_cat.point_id) == {"ok"} and len(by_cat) == 2
    # without points every row comes from the per-request counters
    assert (analysis.acceptance(records, n_boot=50).source == "requests").all()


def _parse_log_cli(tmp_path, text: str):
    log = tmp_path / "engine.log"
    log.write_text(text)
    return subprocess.run([sys.executable, "-m", "speclab", "metrics", "parse-log", str(log)],
                          capture_output=True, text=True)


def test_cli_parse_log_keeps_good_lines_around_a_bad_one(tmp_path):
    bad = NEW.replace("Mean acceptance length: 2.40", "Mean acceptance length: 2.4.0")
    assert bad != NEW
    r = _parse_log_cli(tmp_path, "\n".join([NEW, "noise", bad, OLD]))
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["line"] for x in recs] == [1, 4]
    assert recs[1]["accepted"] == 150
    assert r.returncode == 1
    assert "engine.log:3: malformed mean acceptance length: '2.4.0'" in r.stderr


def test_cli_parse_log_keeps_timestamps_and_writes_null_for_nan(tmp_path):
    nan_line = ("INFO 06-06 14:20:40 [metrics.py:86] SpecDecoding metrics: Mean acceptance "
                "length: nan, Accepted: 0 tokens, Drafted: 0 tokens, Per-position acceptance "
                "rate: nan, nan")
    r = _parse_log_cli(tmp_path, "\n".join([OLD, nan_line]))
    assert r.returncode == 0, r.stderr
    assert "NaN" not in r.stdout
    old, nan = (json.loads(line) for line in r.stdout.splitlines())
    assert old["timestamp"] == "06-06 14:20:34" and nan["timestamp"] == "06-06 14:20:40"
    assert nan["mean_acceptance_length"] is None and nan["per_position"] == [None, None]
    assert nan["acceptance_rate"] is None


def test_cli_parse_log_fails_when_nothing_matches(tmp_path):
    r = _parse_log_cli(tmp_path, "INFO just an engine log\nno metrics here\n")
    assert r.returncode == 1 and r.stdout == ""
    assert "no 'SpecDecoding metrics:' line" in r.stderr


def test_parse_log_names_the_bad_line():
    with pytest.raises(ValueError, match="line 2: malformed"):
        metrics.parse_log("\n".join([OLD, OLD.replace("0.357", "0.3x7").replace(
            "acceptance rate: 0.543", "acceptance rate: 0.5.43")]))


def test_first_divergence():
    assert metrics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert metrics.first_divergence([1, 2, 3], [1, 2]) == 2
    assert metrics.first_divergence([], [5]) == 0


def test_cli_parse_log_names_a_line_without_counters(tmp_path):
    r = _parse_log_cli(tmp_path, "INFO SpecDecoding metrics: garbage\n")
    assert r.returncode == 1 and r.stdout == ""
    assert "engine.log:1: no counters or rates after 'SpecDecoding metrics:'" in r.stderr


def test_cli_parse_log_of_a_folder_is_one_error_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "speclab", "metrics", "parse-log", str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("speclab: error: ") and str(tmp_path) in r.stderr
