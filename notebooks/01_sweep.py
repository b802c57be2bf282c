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
# # 01 · Sweep: acceptance length and throughput vs `num_speculative_tokens`
# Runs the profile's grid (k × target KV dtype × draft KV dtype × layout × prompt format), one
# engine per point, resuming where an earlier run stopped. k = 0 is the plain baseline.
# Acceptance uses vLLM's definitions: AL = 1 + accepted / drafts (bonus token included).

# %% tags=["parameters"]
profile = "tiny-cpu"
run_dir = "../data/runs/tiny-cpu"
figures_dir = "../figures/tiny-cpu"
overrides = {}
execute = True

# %%
from IPython.display import display

from speclab import analysis, parity, plots, sweep
from speclab.report import record

prof = sweep.profile_for(run_dir, profile, overrides, execute)
points = sweep.expand(prof)
if execute:
    sweep.run(prof, run_dir, points)
pts, recs = sweep.results_for(run_dir, points)
failed = pts[pts.status != "ok"]
display(failed[["point_id", "error"]] if len(failed) else "all points ok")

# %%
acc = analysis.acceptance(recs)
spd = analysis.speed(pts)
fig = plots.al_and_speed_vs_k(acc, spd, prof.draft_cost, title=f"{prof.name}: {prof.description}")
plots.save(fig, figures_dir, "al_speed_vs_k")
display(spd.round(3))

# %% [markdown]
# Greedy speculative output against plain greedy output of the same configuration
# (token ids; notebook 03 explains any difference).

# %%
summary, _ = parity.evaluate(parity.versus_plain(points), recs, pts,
                             near_tie=prof.parity.near_tie)
display(summary[[c for c in ("arm", "status", "exact", "n", "match_rate") if c in summary]])

# %%
record(
    profile=prof.name,
    points=len(points),
    failed=list(failed.point_id),
    acceptance={r.point_id: {"k": int(r.k), "al": r.mean_acceptance_length,
                             "per_position": r.per_position, "conditional": r.conditional,
                             "acceptance_rate": r.acceptance_rate}
                for r in acc.itertuples()},
    counters={pid: sweep.read_meta(run_dir, pid)["counters"]
              for pid in pts.point_id[pts.status == "ok"]},
    throughput={r.point_id: r.throughput_tok_s for r in spd.itertuples()},
    match_rate={r["arm"]: r.get("match_rate") for r in summary.to_dict("records")},
)
