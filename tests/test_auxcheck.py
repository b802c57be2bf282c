"""speclab.auxcheck on small synthetic streams: row selection (rejected drafts), the closest
layer, neighbour margins, and the verdict flipping when the engine captures the wrong layer or
one stream instead of the mean."""

from __future__ import annotations

import numpy as np
import pytest

from speclab import auxcheck as A

N, T, HC, H = 4, 10, 4, 32
SEQ = list(range(100, 100 + T))


def _streams(seed=0):
    """Per layer count n: 4 streams that drift apart layer by layer; means and stream 0."""
    rng = np.random.default_rng(seed)
    st = np.cumsum(rng.normal(size=(N + 1, T, HC, H)), axis=0).astype(np.float32)
    return st.mean(2), st[:, :, 0]


def _calls(source: np.ndarray, capture, noise=1e-3, seed=1):
    """A prefill call over positions 0..5 and two verify steps; the second step's last row
    is a rejected draft token (wrong id), and the row after it would be garbage."""
    rng = np.random.default_rng(seed)
    aux = lambda pos: np.concatenate([source[c, pos] for c in capture], -1) + \
        rng.normal(scale=noise, size=(len(pos), len(capture) * H))
    calls = [{"positions": np.arange(6), "token_ids": np.asarray(SEQ[:6]), "aux": aux(
        np.arange(6))}]
    calls.append({"positions": np.array([6, 7]), "token_ids": np.asarray(SEQ[6:8]),
                  "aux": aux(np.array([6, 7]))})
    bad = {"positions": np.array([8, 9]), "token_ids": np.array([SEQ[8], 5]),
           "aux": aux(np.array([8, 9]))}
    bad["aux"][1] = 99.0
    calls.append(bad)
    return calls


def test_usable_rows_stop_at_the_first_wrong_token():
    assert A.usable_rows(np.array([3, 4, 5]), np.array([103, 7, 105]), SEQ).tolist() == [0]
    assert A.usable_rows(np.array([8, 9, 10]), np.array([108, 109, 110]), SEQ).tolist() == [0, 1]


def test_right_capture_is_closest_with_margins():
    means, s0 = _streams()
    capture = [2, 3, 4]
    df = A.compare_request(_calls(means, capture), SEQ, means, s0, capture)
    assert set(df["position"]) == set(range(9))  # position 9 (rejected draft) dropped
    summ = A.summarize(df)
    assert A.verdict(summ)
    allp = summ[summ["phase"] == "all"].set_index("slot")
    assert allp.loc[0, "positions"] == 9 and allp.loc[0, "rel_err_max"] < 1e-2
    assert allp.loc[0, "margin_fewer"] > 10 and allp.loc[1, "margin_more"] > 10
    assert np.isnan(allp.loc[2, "margin_more"])  # no stream after 5 layers
    assert A.records(summ)[2]["margin_more"] is None  # JSON-ready
    assert allp.loc[0, "margin_stream0"] > 10
    assert set(summ["phase"]) == {"prefill", "decode", "all"}
    md = A.markdown(summ, "synthetic")
    assert md.count("\n| ") == len(summ) + 1 and "n/a" in md


@pytest.mark.parametrize("wrong", ["input", "stream0"])
def test_wrong_capture_is_caught(wrong):
    means, s0 = _streams()
    capture = [2, 3, 4]
    engine = ([1, 2, 3], means) if wrong == "input" else (capture, s0)
    df = A.compare_request(_calls(engine[1], engine[0]), SEQ, means, s0, capture)
    summ = A.summarize(df)
    assert not A.verdict(summ)
    allp = summ[summ["phase"] == "all"].set_index("slot")
    if wrong == "input":
        assert allp.loc[0, "closest_layers"] == [1] and allp.loc[0, "margin_fewer"] < 0.1
    else:
        assert allp.loc[0, "margin_stream0"] < 0.1
    assert "NO" in A.markdown(summ)


def test_no_usable_row_is_an_error():
    means, s0 = _streams()
    calls = [{"positions": np.arange(3), "token_ids": np.array([1, 2, 3]),
              "aux": np.zeros((3, 3 * H))}]
    with pytest.raises(ValueError, match="no recorded row"):
        A.compare_request(calls, SEQ, means, s0, [2, 3, 4])


@pytest.mark.parametrize("version", ["0.22.0", "0.26.0"])
def test_proposal_recorder_binds_the_release_signature(version):
    """tools/gpu/aux_check.py's wrapper on a stub with the exact `propose` signature of the
    release's llm_base_proposer.py, called the way its gpu_model_runner calls it."""
    import ast
    import importlib.util
    from pathlib import Path

    import torch
    from vllm022 import Unavailable, vllm_py_tree

    try:
        tree = vllm_py_tree(version)
    except Unavailable as e:
        pytest.skip(str(e))
    src = (tree / "vllm/v1/spec_decode/llm_base_proposer.py").read_text()
    fn = next(n for n in ast.walk(ast.parse(src))
              if isinstance(n, ast.FunctionDef) and n.name == "propose")
    fn.body, fn.decorator_list = [ast.parse("return 'drafted'").body[0]], []
    ns: dict = {}
    stub_module = ast.fix_missing_locations(ast.Module(
        [ast.ImportFrom("__future__", [ast.alias("annotations")], 0), fn], []))
    exec(compile(stub_module, "stub", "exec"), ns)  # noqa: S102
    stub = type("Proposer", (), {"propose": ns["propose"]})()
    tool = Path(__file__).resolve().parents[1] / "tools" / "gpu" / "aux_check.py"
    spec = importlib.util.spec_from_file_location("aux_check_tool", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls: list = []
    mod.record_proposals(stub, calls)
    runner = ast.parse((tree / "vllm/v1/worker/gpu_model_runner.py").read_text())
    call = next(n for n in ast.walk(runner) if isinstance(n, ast.Call)
                and getattr(n.func, "attr", "") == "propose"
                and any(kw.arg == "target_positions" for kw in n.keywords))
    assert not call.args  # the runner passes everything by keyword
    kwargs = {kw.arg: None for kw in call.keywords}
    kwargs.update(target_token_ids=torch.tensor([5, 6]), target_positions=torch.tensor([7, 8]),
                  target_hidden_states=torch.ones(2, 6, dtype=torch.bfloat16))
    assert stub.propose(**kwargs) == "drafted"
    assert calls[0]["positions"].tolist() == [7, 8]
    assert calls[0]["token_ids"].tolist() == [5, 6] and calls[0]["aux"].shape == (2, 6)


def test_aux_report_page_carries_verdict_provenance_and_tables(tmp_path):
    import json

    from speclab import cli

    meta = {"verdict": False, "date": "2026-12-01T10:00:00Z", "target": "tgt<1>", "draft": "d",
            "k": 3, "enforce_eager": True, "command": "python3 tools/gpu/aux_check.py --x",
            "versions": {"gpu": "NVIDIA H200", "gpu_count": 1, "vllm": "0.22.0",
                         "torch": "2.11.0", "cuda": "13.0"}}
    (tmp_path / "aux_check_rig.json").write_text(json.dumps(meta))
    (tmp_path / "aux_check_rig.md").write_text("| slot | margin |\n| --- | --- |\n| 1 | 20.7 |\n")
    (tmp_path / "aux_check_ok.json").write_text(json.dumps({**meta, "verdict": True}))
    assert cli.main(["aux-report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert "<h2>rig: FAILED</h2>" in page and "<h2>ok: configured layer closest" in page
    assert "NVIDIA H200 ×1, vLLM 0.22.0" in page and "tgt&lt;1&gt;" in page  # escaped
    assert "<td>20.7</td>" in page and "eager" in page and "no table" in page


def test_aux_report_refuses_a_folder_without_checks(tmp_path):
    with pytest.raises(FileNotFoundError, match="no aux_check_"):
        A.report_html(tmp_path)
