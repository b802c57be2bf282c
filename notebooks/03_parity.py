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
# # 03 · Greedy parity: speculative vs plain decoding, and what this study can detect
# Each arm compares a candidate run with a reference plain greedy run on the same prompts,
# token by token. At the first divergence the reference's top-1 − top-2 logprob margin says
# whether the target itself was at a near-tie there (numerics: a verify pass over k+1 tokens,
# FP8 KV, expert-parallel combine order or batch composition can flip it) or not (a real
# difference to investigate). The analysis is **pre-registered** in the profile's `parity:`
# block (near-tie threshold, noise-floor method, acceptance tolerance, detection rule) and
# printed below before any result. The noise floor is measured in the same run by the
# plain-repeat arm (`noise`: plain passes in separate engines and in one engine, every pair
# compared). A divergence no plain pass saw is rescored: its prefix is re-run through the
# plain engine with logprobs. Positive controls inject defects of known size (`controls`);
# the share of their runs the analysis flags is its detection power, and the smallest size
# it always detects is the study's resolution. Acceptance is shown next to parity for every
# speculative arm, against the CPU reference's expected counters where the profile has them.

# %% tags=["parameters"]
profile = "tiny-cpu"
# None: data/runs/<profile name> and figures/<profile name> (speclab.notebook.folders)
run_dir = None
figures_dir = None
overrides = {}
execute = True
# None: the profile's parity.arms
arms = None
# a near-tie threshold other than the profile's is a named re-analysis ("near_tie=X"),
# shown beside the pre-registered one; so is every entry of `reanalyses`:
# {name: {near_tie: nats, noise_floor: "max-flip" | nats, acceptance_tolerance: ...,
#         expected_from: "reference" | "plain-path"}}; a run folder holding
# expected_plain_path.json (tools/expected_neartie.py --along) adds "plain-path expectation"
near_tie = None
reanalyses = {}
# re-run the prefixes of divergences no plain pass saw through the plain engine (needs vLLM)
rescore = True
# other run folders (paths or names under data/runs) of the same target and prompts, e.g. a
# repeat of this run: their plain runs also serve the margin lookup and the noise floor
plain_runs = []

# %%
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display

from speclab import multipass, notebook, parity, plots, provenance, store, summary, sweep
from speclab.notebook import record
from speclab.profiles import REPO
from speclab.progress import log_to_stdout

log_to_stdout()  # progress as [speclab] lines (`speclab run` forwards them)

run_dir, figures_dir = notebook.folders(profile, run_dir, figures_dir)
prof = notebook.profile_for(run_dir, profile, overrides, execute)
prereg = parity.settings(prof)
if near_tie is not None and near_tie != prereg.near_tie:
    reanalyses = {f"near_tie={near_tie:g}": {"near_tie": near_tie}, **reanalyses}
if (Path(run_dir) / parity.PLAIN_PATH_FILE).exists():
    reanalyses = {"plain-path expectation": {"expected_from": "plain-path"}, **reanalyses}
plan = parity.plan(prof, arms if arms is not None else prof.parity.arms,
                   k_values=prof.parity.k_values, spec_k=prof.parity.spec_k)
expected = parity.load_expected(REPO / prof.parity.expected if prof.parity.expected else None)
display(Markdown("**Pre-registered analysis** (profile `parity:` block) — " + prereg.describe()))

# %%
if execute:
    sweep.run(prof, run_dir, parity.points_of(plan))
    multipass.run_groups(prof, run_dir, parity.groups_of(plan))
pts, recs = store.results_for(run_dir, parity.points_of(plan, grouped=None))
more_plain = parity.plain_from_runs(prof, plain_runs, base=Path(run_dir).parent)
recs = pd.concat([recs, more_plain], ignore_index=True)
rescore_path = Path(run_dir) / multipass.RESCORE_FILE
rescored = pd.read_parquet(rescore_path) if rescore_path.exists() else None
result = parity.analyze(plan, recs, pts, prereg, rescored=rescored, expected=expected)
todo = parity.rescore_requests(result.cmp)
if len(todo) and execute and rescore:
    rescored = multipass.rescore(prof, run_dir, todo)
    result = parity.analyze(plan, recs, pts, prereg, rescored=rescored, expected=expected)
display(summary.readable(result.summary.drop(columns=["first_divergence", "margins"],
                                              errors="ignore")))

# %%
# the arms here; the positive controls get the power figure below
healthy = result.summary[result.summary.role != "control"] if len(result.summary) else result.summary
fig = plots.parity_overview(healthy, result.cmp[result.cmp.arm.isin(healthy.arm)]
                            if len(result.cmp) else result.cmp, prereg.near_tie,
                            title=f"{prof.name}: greedy parity ({prereg.name})")
plots.save(fig, figures_dir, "parity", provenance.caption(run_dir))

# %% [markdown]
# ## Detection power (positive controls)

# %%
pw = parity.power(result.summary)
res = {by: parity.resolution(pw, prereg.detect_share, by)
       for by in ("flagged_parity", "flagged_acceptance", "flagged")}
display(pw)
if len(pw):
    fig = plots.detection_power(pw, prereg.near_tie, result.floor["floor"],
                                title=f"{prof.name}: detection power ({prereg.name})")
    plots.save(fig, figures_dir, "detection_power")

# %% [markdown]
# ## Findings

# %%
flips = parity.self_flips(recs)
lines = parity.findings(result.summary, prereg.near_tie, flips=flips,
                        n_plain=int((recs.k == 0).sum()) if len(recs) else 0, floor=result.floor)
lines += parity.power_findings(pw, res, prereg, result.summary)
display(Markdown("\n".join(f"- {line}" for line in lines)))

# %% [markdown]
# ## Named re-analyses (beside the pre-registered one, never replacing it)

# %%
settings = [parity.settings(prof, name, **dict(o)) for name, o in reanalyses.items()]
others = [parity.analyze(plan, recs, pts, st, rescored=rescored,
                         expected=parity.expected_for(st, expected, run_dir)) for st in settings]
powers = {}
for a in others:
    display(Markdown(f"**{a.settings.describe()}**"))
    cols = ["arm", "status", "n", "exact", *parity.KIND_COLUMNS, "acceptance_rate",
            "expected_rate", "flagged_acceptance", "flagged"]
    display(a.summary[[c for c in cols if c in a.summary]]
            if len(a.summary) and "n" in a.summary else a.summary)
    a_pw = powers[a.settings.name] = parity.power(a.summary)
    if len(a_pw):
        display(a_pw)
        fig = plots.detection_power(a_pw, a.settings.near_tie, a.floor["floor"],
                                    title=f"{prof.name}: detection power ({a.settings.name})")
        plots.save(fig, figures_dir, "detection_power_" + "-".join(a.settings.name.split()))

# %%
record(parity=result.summary.to_dict("records"), findings=lines, near_tie=prereg.near_tie,
       preregistered=prereg.describe(), noise=result.floor, power=pw.to_dict("records"),
       resolution=res, self_flips=flips.to_dict("records"),
       reanalyses={a.settings.name: {
           "settings": a.settings.describe(), "parity": a.summary.to_dict("records"),
           "noise": a.floor, "power": powers[a.settings.name].to_dict("records"),
           "resolution": {by: parity.resolution(powers[a.settings.name],
                                                a.settings.detect_share, by)
                          for by in ("flagged_parity", "flagged_acceptance", "flagged")}}
           for a in others})
