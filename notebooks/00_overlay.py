# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
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
run_dir = "../data/runs/tiny-cpu"
figures_dir = "../figures/tiny-cpu"
overrides = {}
execute = True

# %%
from IPython.display import display

from speclab import engine, overlay, profiles, sweep
from speclab.report import record

prof = sweep.profile_for(run_dir, profile, overrides, execute)
env = engine.versions()
display(env)

# %%
status = overlay.status()
print(overlay.format_status(status))

# %%
problems = profiles.check_env(prof) if execute else []
print("\n".join(problems) or f"profile {prof.name} can run here")

# %%
record(versions=env, overlay=status, env_problems=problems)
