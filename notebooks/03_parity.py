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
# # 03 · Greedy parity: speculative vs plain decoding
# Each arm compares a candidate run with a reference plain greedy run on the same prompts,
# token by token. At the first divergence the reference's top-1 − top-2 logprob margin says
# whether the target itself was at a near-tie there (numerics: a verify pass over k+1 tokens,
# FP8 KV, expert-parallel combine order or batch composition can flip it) or not (a real
# difference to investigate). Each plain run decodes twice (the second pass, with logprobs,
# is untimed); where the two passes disagree the target flipped its own argmax, and the
# largest margin at which that happened is the run's noise floor: divergences at or below
# it are "within-noise", those no plain pass saw are "unscored".

# %% tags=["parameters"]
profile = "tiny-cpu"
run_dir = "../data/runs/tiny-cpu"
figures_dir = "../figures/tiny-cpu"
overrides = {}
execute = True
# None: the profile's parity.arms and parity.near_tie (nats)
arms = None
near_tie = None
# other run folders (paths or names under data/runs) of the same target and prompts, e.g. a
# repeat of this run: their plain runs also serve the margin lookup and the noise floor
plain_runs = []

# %%
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display

from speclab import parity, plots, sweep
from speclab.report import record

prof = sweep.profile_for(run_dir, profile, overrides, execute)
near_tie = near_tie if near_tie is not None else prof.parity.near_tie
plan = parity.plan(prof, arms if arms is not None else prof.parity.arms,
                   k_values=prof.parity.k_values, spec_k=prof.parity.spec_k)
needed = parity.points_of(plan)
more_plain = parity.plain_from_runs(prof, plain_runs, base=Path(run_dir).parent)
if execute:
    sweep.run(prof, run_dir, needed)
pts, recs = sweep.results_for(run_dir, needed)
recs = pd.concat([recs, more_plain], ignore_index=True)
summary, cmp = parity.evaluate(plan, recs, pts, near_tie=near_tie)
display(summary.drop(columns=["first_divergence", "margins"], errors="ignore").round(3))

# %%
fig = plots.parity_overview(summary, cmp, near_tie, title=f"{prof.name}: greedy parity")
plots.save(fig, figures_dir, "parity")

# %% [markdown]
# ## Findings

# %%
flips = parity.self_flips(recs)
lines = parity.findings(summary, near_tie, flips=flips,
                        n_plain=int((recs.k == 0).sum()) if len(recs) else 0)
display(Markdown("\n".join(f"- {line}" for line in lines)))

# %%
record(parity=summary.to_dict("records"), findings=lines, near_tie=near_tie,
       self_flips=flips.to_dict("records"))
