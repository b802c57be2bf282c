"""The committed notebooks: each .ipynb is its paired jupytext .py, has no outputs, opens
with a `parameters` cell that declares the suite's parameters, and is in the suite."""

from pathlib import Path

import jupytext
import papermill as pm
import pytest

from speclab import report

NOTEBOOKS = sorted(report.NOTEBOOK_DIR.glob("*.ipynb"))


def test_the_suite_is_every_notebook():
    assert [p.stem for p in NOTEBOOKS] == list(report.SUITE)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_paired_clean_and_parameterized(path: Path):
    nb = jupytext.read(path)
    py = jupytext.read(path.with_suffix(".py"))
    assert ([(c.cell_type, c.source) for c in nb.cells]
            == [(c.cell_type, c.source) for c in py.cells])
    assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells
               if c.cell_type == "code"), "commit notebooks without outputs"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", [])
    declared = pm.inspect_notebook(str(path))
    assert {"profile", "run_dir", "figures_dir", "overrides", "execute"} <= set(declared)
    assert "record(" in code[-1].source, "the last cell records results"
