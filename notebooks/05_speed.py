# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · How much faster at DeepSeek-V4-Flash's real shapes
# What the tiny CPU sweep cannot say: speedup over plain decoding at the real shapes on a GPU
# (a `speclab.gpubench` run), per k and batch size with 95% intervals, the cost model beside
# every measured point, the prediction at the production depth for a draft card's acceptance,
# and what a TP + EP node changes (a bracket computed on paper, not a measurement). By default
# it pools the committed H200 runs the README's answer comes from; nothing runs an engine.

# %% tags=["parameters"]
profile = "tiny-cpu"
# None: data/runs/<profile name> and figures/<profile name> (speclab.notebook.folders)
run_dir = None
figures_dir = None
overrides = {}  # the suite's common parameters: this notebook reads run folders only
execute = True
# a gpubench run folder, or a list of several of one GPU and vLLM release to pool
# (None: the committed H200 runs, where this checkout has them)
speed_run = None
# per-position unconditional acceptance: EAGLE-3 (published EAGLE3.1) and MTP engines; or
# the folder of a `speclab run` whose point measured it ("RUN" or "RUN:POINT_ID")
acceptance = [0.617, 0.433, 0.294]
acceptance_mtp = [0.769, 0.381]
layers = 43  # the production depth the plain step is extrapolated to
gpus = 8  # the TP + EP node of the bracket (1: none)

# %%
from pathlib import Path

from IPython.display import Image, Markdown, display

from speclab import notebook, predictreport, stepcosts
from speclab.notebook import record

run_dir, figures_dir = notebook.folders(profile, run_dir, figures_dir)
source = stepcosts.run_dirs(speed_run) if speed_run else predictreport.reference_runs()
rates, measured = predictreport.acceptance_from(acceptance, "eagle3")
rates_mtp, measured_mtp = predictreport.acceptance_from(acceptance_mtp, "mtp")

# %%
if source is None:
    md = None
    print("No gpubench run here: pass speed_run (this installation has no committed H200 runs).")
else:
    md = predictreport.report(source, rates, layers, Path(run_dir) / "speed", gpus, rates_mtp,
                              [m for m in (measured, measured_mtp) if m])
    text = md.read_text()
    display(Markdown("\n".join(line for line in text.splitlines()
                               if not line.startswith("!["))))
    for png in sorted((md.parent / "figures").glob("*.png")):
        display(Image(filename=str(png)))

# %%
record(speed={"runs": [r.name for r in source] if source else None,
              "report": str(md) if md else None, "acceptance": rates,
              "acceptance_from": [m.describe() for m in (measured, measured_mtp) if m],
              "sections": [line[3:] for line in text.splitlines() if line.startswith("## ")]
              if md else []})
