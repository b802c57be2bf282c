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
# # 01 · Sweep: acceptance length and throughput vs `num_speculative_tokens`
# Runs the profile's grid (method × k × target KV dtype × draft KV dtype × layout × prompt
# format), one engine per point, resuming where an earlier run stopped. k = 0 is the plain
# baseline, shared by every method (eagle3, mtp, ngram).
# Acceptance uses vLLM's definitions: AL = 1 + accepted / drafts (bonus token included).

# %% tags=["parameters"]
profile = "tiny-cpu"
# None: data/runs/<profile name> and figures/<profile name> (speclab.notebook.folders)
run_dir = None
figures_dir = None
overrides = {}
execute = True
# "offline" (vllm.LLM in a worker per point) or "server" (`vllm serve` per point, driven at
# each concurrency level over the OpenAI API; README "Offline or server mode?")
mode = "offline"
concurrency = [1, 4]
# offline points run "local" (here, one after another) or on a "ray" cluster; None: the
# profile's choice (README "On a Ray cluster")
executor = None

# %%
from IPython.display import display

from speclab import analysis, notebook, parity, plots, provenance, server, store, summary, sweep
from speclab.notebook import record
from speclab.progress import log_to_stdout

log_to_stdout()  # progress as [speclab] lines (`speclab run` forwards them)

run_dir, figures_dir = notebook.folders(profile, run_dir, figures_dir)
prof = notebook.profile_for(run_dir, profile, overrides, execute)
prof = prof.model_copy(update={"executor": executor or prof.executor})
points = sweep.expand(prof)
if mode == "server":
    ids = [server.level_id(p, c) for p in points for c in concurrency]
    if execute:
        for p in points:
            server.run_point(prof, p, run_dir, concurrency)
else:
    ids = [p.id for p in points]
    if execute:
        sweep.run(prof, run_dir, points)
pts, recs = store.results_for(run_dir, ids)
failed = pts[pts.status != "ok"]
if len(failed):
    display(failed[["point_id", "error"]])
else:
    print(f"all {len(pts)} points ok")
caption = provenance.caption(run_dir)

# %%
acc = analysis.acceptance(recs, points=pts)
spd = analysis.speed(pts)
fig = plots.al_and_speed_vs_k(acc, spd, prof.draft_cost, title=f"{prof.name}: {prof.description}")
plots.save(fig, figures_dir, "al_speed_vs_k" + ("_server" if mode == "server" else ""), caption)
table = summary.table(run_dir)
display(summary.display_table(table[table.point_id.isin(ids)]))
print(summary.AL_METHOD)

# %% [markdown]
# ### Methods compared
# Per method and k (and concurrency level in server mode): AL (vLLM's, over the verify steps
# that carried a draft), tokens per decode step (every step; ngram drafts only where its lookup
# matches: `drafted_share`) and per-position acceptance with 95% bootstrap CIs over requests,
# speedup over the shared plain point with its 95% interval over timing rounds; then the best
# method and k per concurrency level (by speedup when the run's speeds are results, else by
# tokens per decode step).

# %%
cmp = analysis.methods_table(acc, spd)
fig = plots.methods_comparison(cmp, title=f"{prof.name}: methods compared")
plots.save(fig, figures_dir, "methods" + ("_server" if mode == "server" else ""), caption)
display(summary.readable(cmp.drop(columns=["concurrency"]) if cmp.concurrency.isna().all()
                         else cmp))
best_by = "speedup" if summary.speed_trusted(table, prof) else "tokens_per_step"
best = analysis.best_per_concurrency(cmp, by=best_by)
print(f"best method and k per concurrency level, by {best_by}:")
display(summary.readable(best))

# %% [markdown]
# Server-mode points of this run (from this or an earlier server-mode execution): throughput,
# time to first token, time per output token and AL against the number of concurrent
# requests, one line per k.

# %%
curve = analysis.load_curve(*store.load_results(run_dir))
if len(curve):
    fig = plots.load_vs_concurrency(curve, title=f"{prof.name}: server mode")
    plots.save(fig, figures_dir, "load_vs_concurrency", caption)
    display(summary.readable(curve))

# %% [markdown]
# Greedy speculative output against plain greedy output of the same configuration
# (token ids; notebook 03 explains any difference). Offline mode.

# %%
par, _ = parity.evaluate(parity.versus_plain(points) if mode == "offline" else [], recs, pts,
                         near_tie=prof.parity.near_tie)
display(summary.readable(par[[c for c in ("arm", "status", "exact", "n", "match_rate", "match_lo",
                                          "match_hi") if c in par]]))

# %%
record(
    profile=prof.name,
    points=len(points),
    failed=list(failed.point_id),
    acceptance={r.point_id: {"k": int(r.k), "method": r.method, "al": r.mean_acceptance_length,
                             "per_position": r.per_position, "conditional": r.conditional,
                             "acceptance_rate": r.acceptance_rate}
                for r in acc.itertuples()},
    counters={pid: {**m["counters"], "attribution": m.get("attribution")}
              for pid in pts.point_id[pts.status == "ok"] if (m := store.read_meta(run_dir, pid))},
    throughput={r.point_id: r.throughput_tok_s for r in spd.itertuples()},
    methods=cmp.astype(object).where(cmp.notna(), None).to_dict("records"),
    best={"by": best_by, "rows": best.astype(object).where(best.notna(), None).to_dict("records")},
    load_curve=curve.to_dict("records"),
    match_rate={r["arm"]: r.get("match_rate") for r in par.to_dict("records")},
)
