# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Explorer
# Flip through finished sweeps without re-running anything: pick one or more runs (side by
# side), then k, target and draft KV dtype, layout, prompt format, prompt category and variant
# (parity arms, server mode); per-position acceptance, AL and throughput vs k and the greedy
# match with plain decoding follow the selection. Reads result files only. In JupyterLab
# (`make lab`) the cell below shows the widgets; a headless run (`interactive = False`, as
# `speclab run` sets it) renders the default slice as a static figure instead.

# %% tags=["parameters"]
profile = "tiny-cpu"
# None: data/runs/<profile name> and figures/<profile name> (speclab.notebook.folders)
run_dir = None
figures_dir = None
overrides = {}
execute = True
# True: ipywidgets explorer; False: the default slice as a static figure
interactive = True
# run folders the run picker offers besides run_dir (None: every run next to run_dir)
runs = None

# %%
from pathlib import Path

from IPython.display import display

from speclab import explorer, notebook, plots, provenance
from speclab.notebook import record

run_dir, figures_dir = notebook.folders(profile, run_dir, figures_dir)
prof = notebook.profile_for(run_dir, profile, overrides, execute=False)  # results only
others = runs if runs is not None else explorer.find_runs(Path(run_dir).parent)
run_dirs = [Path(run_dir), *(Path(d) for d in others if Path(d).name != Path(run_dir).name)]

# %%
if interactive:
    display(explorer.explorer(run_dirs, selected=[Path(run_dir).name],
                              draft_cost=prof.draft_cost))
    text = None
else:
    fig, text = explorer.static([run_dir], prof.draft_cost)
    plots.save(fig, figures_dir, "explorer_default", provenance.caption(run_dir))
    print(text)

# %%
record(explorer={"interactive": interactive, "runs": [d.name for d in run_dirs],
                 "summary": text})
