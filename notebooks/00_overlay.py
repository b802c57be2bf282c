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
# # 00 · Environment and overlay
# What this run uses: package versions, hardware, whether vLLM's `deepseek_v4` model supports
# EAGLE-3 natively or through the overlay (and what the overlay patched), the draft KV dtype in
# force, and whether the profile can run on this machine.

# %% tags=["parameters"]
profile = "tiny-cpu"
# None: data/runs/<profile name> and figures/<profile name> (speclab.notebook.folders)
run_dir = None
figures_dir = None
overrides = {}
execute = True

# %%
import pandas as pd
from IPython.display import display

from speclab import engine, notebook, overlay, preflight
from speclab.notebook import record

run_dir, figures_dir = notebook.folders(profile, run_dir, figures_dir)
prof = notebook.profile_for(run_dir, profile, overrides, execute)
env = engine.versions()
display(pd.Series(env, name="this machine (executing the notebooks)").dropna().to_frame())

# %%
status = overlay.status()
print(overlay.format_status(status))

# %%
problems = preflight.check_env(prof) if execute else []
print("\n".join(problems) or f"profile {prof.name} can run here")

# %%
record(versions=env, overlay=status, env_problems=problems)
