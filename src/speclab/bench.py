"""Benchmark: split one sweep point's wall time into engine start, generation and the harness's
own work (worker spawn and imports, prompts, metrics, records, plotting). Prints numbers."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from speclab import analysis, plots, profiles, sweep


def main(profile_name: str, k: int, run_id: str) -> int:
    prof = profiles.load(profile_name)
    problems = profiles.check_env(prof)
    if problems:
        raise profiles.ProfileError("\n".join(problems))
    g = prof.grid
    point = sweep.Point(k=k, kv_cache_dtype=g.kv_cache_dtype[0],
                        draft_kv_cache_dtype=g.draft_kv_cache_dtype[0] if k else None,
                        layout=g.layout[0], prompt_format=g.prompt_format[0])
    run_dir = Path(tempfile.mkdtemp(prefix=f"speclab-{run_id}-"))
    try:
        t0 = time.perf_counter()
        meta = sweep.run_point(prof, point, run_dir)
        if meta["status"] != "ok":
            print(f"point failed: {meta['error']}\n{meta.get('log_tail', '')}")
            return 1
        p0 = time.perf_counter()
        pts, recs = sweep.load_results(run_dir)
        figs = []
        if k:
            acc = analysis.acceptance(recs)
            figs.append(plots.per_position(analysis.per_position_long(acc)))
            figs.append(plots.acceptance_histogram(analysis.histogram(recs)))
        for i, fig in enumerate(figs):
            plots.save(fig, run_dir / "figures", f"fig{i}")
        plot_s = time.perf_counter() - p0
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    t = meta["timings"]
    engine_s = t["import_s"] + t["engine_init_s"] + t.get("warmup_s", 0.0)
    gen_s = t["generate_s"]
    harness_s = wall - engine_s - gen_s
    print(f"BENCH point={point.id} profile={prof.name} wall_s={wall:.2f}")
    print(f"  engine start  {engine_s:7.2f} s  (import vllm {t['import_s']:.2f}, "
          f"LLM() {t['engine_init_s']:.2f}, warm-up {t.get('warmup_s', 0.0):.2f})")
    print(f"  generation    {gen_s:7.2f} s  ({meta['output_tokens']} tokens, "
          f"{meta['throughput_tok_s']:.1f} tok/s)")
    print(f"  harness       {harness_s:7.2f} s  = {harness_s / wall:.1%} of wall "
          f"(in-worker bookkeeping {t['harness_s']:.2f}, plotting {plot_s:.2f}, "
          f"process spawn + imports {harness_s - t['harness_s'] - plot_s:.2f})")
    return 0
