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
# # 02 · Per-position acceptance
# For each speculative point of the sweep: the **unconditional** per-position rate vLLM prints
# (A_i / D: all of positions 0..i accepted; sums to AL − 1) and the **conditional** rate the
# EAGLE papers plot (A_i / A_(i−1)), with 95% bootstrap CIs over prompts; the distribution of
# tokens emitted per verify step; and acceptance by prompt category for each prompt format.

# %% tags=["parameters"]
profile = "tiny-cpu"
# None: data/runs/<profile name> and figures/<profile name> (speclab.notebook.folders)
run_dir = None
figures_dir = None
overrides = {}
execute = True
# prompt formats compared at k = parity.spec_k (None: the profile's compare_formats)
formats = None

# %%
from IPython.display import display

from speclab import (analysis, convention_compare, notebook, plots, provenance, store, summary,
                     sweep)
from speclab.notebook import record
from speclab.progress import log_to_stdout

log_to_stdout()  # progress as [speclab] lines (`speclab run` forwards them)

run_dir, figures_dir = notebook.folders(profile, run_dir, figures_dir)
prof = notebook.profile_for(run_dir, profile, overrides, execute)
grid_points = [p for p in sweep.expand(prof) if p.k > 0]
base = grid_points[0] if grid_points else None
fmt_points = [base.model_copy(update={"k": prof.parity.spec_k, "prompt_format": f})
              for f in (formats if formats is not None else prof.compare_formats)] if base else []
if execute:
    sweep.run(prof, run_dir, fmt_points)
pts, recs = store.results_for(run_dir, grid_points + fmt_points)
caption = provenance.caption(run_dir)

# %%
acc = analysis.acceptance(recs[recs.point_id.isin([p.id for p in grid_points])],
                          n_boot=summary.N_BOOT)
fig = plots.per_position(analysis.per_position_long(acc), title=f"{prof.name}: per-position acceptance")
plots.save(fig, figures_dir, "per_position", caption)
display(summary.readable(acc.reindex(columns=[
    "point_id", "k", "n_requests", "mean_acceptance_length", "al_lo", "al_hi", "per_position",
    "conditional"])))
print(summary.AL_METHOD)

# %%
hist = analysis.histogram(recs[recs.point_id.isin(acc.point_id)])
fig = plots.acceptance_histogram(hist, title=f"{prof.name}: tokens per verify step")
plots.save(fig, figures_dir, "acceptance_histogram", caption)

# %%
cat = analysis.acceptance(recs[recs.point_id.isin([p.id for p in fmt_points])], by=["category"],
                          n_boot=summary.N_BOOT)
if len(cat):
    fig = plots.by_category(cat, title=f"{prof.name}: AL by category, k={prof.parity.spec_k}")
    plots.save(fig, figures_dir, "by_category", caption)
    display(summary.readable(cat[["prompt_format", "category", "n_requests",
                                  "mean_acceptance_length", "al_lo", "al_hi"]]))

# %% [markdown]
# ### Aux-layer convention
# Where the grid sweeps `aux_layer_convention` (output: id L = output of layer L; input:
# vLLM's id L = input of layer L), per-position acceptance per convention side by side; the
# convention the draft was trained with is the one with clearly higher acceptance.

# %%
conv = convention_compare.by_convention(pts, recs[recs.point_id.isin(acc.point_id)])
conv_found = convention_compare.findings(conv)
if conv.convention.nunique() > 1:
    fig = convention_compare.plot(
        conv, title=f"{prof.name}: acceptance per aux-layer convention")
    plots.save(fig, figures_dir, "aux_convention")
    display(conv[["point_id", "convention", "applied", "effective_capture_after_layers",
                  "position", "unconditional", "u_lo", "u_hi"]].round(3))
print(conv_found["text"])

# %%
record(
    aux_convention={"winner": conv_found["winner"], "text": conv_found["text"],
                    "groups": conv_found["groups"]},
    per_position={r.point_id: {"k": int(r.k), "unconditional": r.per_position,
                               "u_lo": r.pp_lo, "u_hi": r.pp_hi, "conditional": r.conditional,
                               "al": r.mean_acceptance_length} for r in acc.itertuples()},
    histogram={pid: list(g.steps) for pid, g in hist.groupby("point_id")} if len(hist) else {},
    by_category=[{"prompt_format": r.prompt_format, "category": r.category,
                  "al": r.mean_acceptance_length, "al_lo": r.al_lo, "al_hi": r.al_hi}
                 for r in cat.itertuples()] if len(cat) else [],
)
