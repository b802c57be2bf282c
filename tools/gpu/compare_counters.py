#!/usr/bin/env python3
"""Compare the points two runs share (e.g. the Ray executor's run against the local one):
`compare_counters.py RUN_A RUN_B [--out FILE.json]`.

For each point both measured (status ok): the speculative-decoding counters and output tokens,
which must be identical, and each run's throughput with its 95% interval over the timing
rounds (speclab.analysis.speed): "within" when each run's mean lies inside the other's
interval ("no interval" below 2 rounds); B's throughput over A's with its 95% interval
(`analysis.unpaired_ratio_ci` of the passes: how large a difference the comparison could
have told from noise); and the niceness each run's engines ran at where its passes recorded
it (Ray's workers start at 15). Prints one line per shared point; --out
writes the same as JSON. Exits 1 if any counters or tokens differ or no point is shared;
throughput outside the intervals is reported (a measurement), not an error."""

import argparse
import json
import math
import sys
from pathlib import Path

from speclab import analysis, store


def num(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def speeds(points) -> dict[str, dict]:
    """Point id -> {tok_s, lo, hi, rounds, nice, passes} of a run's ok points; nice: the
    niceness values its passes recorded, sorted (empty where none did); passes: their tok/s."""
    passes = {r.point_id: r.passes if isinstance(r.passes, list) else [{}]
              for r in points.itertuples()}
    return {r.point_id: {"tok_s": num(r.throughput_tok_s), "lo": num(r.tput_lo),
                         "hi": num(r.tput_hi), "rounds": len(passes[r.point_id]),
                         "nice": sorted({p["nice"] for p in passes[r.point_id] if "nice" in p}),
                         "passes": [p["tok_s"] for p in passes[r.point_id] if "tok_s" in p]}
            for r in analysis.speed(points).itertuples()}


def within(a: dict, b: dict) -> bool | None:
    """Each mean inside the other's interval; None where a run has no interval."""
    if any(x[k] is None for x in (a, b) for k in ("lo", "hi")):
        return None
    return b["lo"] <= a["tok_s"] <= b["hi"] and a["lo"] <= b["tok_s"] <= a["hi"]


def compare(a: str, b: str) -> list[dict]:
    pa, ra = store.load_results(a)
    pb, rb = store.load_results(b)
    shared = sorted(set(pa.point_id[pa.status == "ok"]) & set(pb.point_id[pb.status == "ok"]))
    sa, sb = speeds(pa), speeds(pb)
    rows = []
    for pid in shared:
        ca, cb = store.read_meta(a, pid)["counters"], store.read_meta(b, pid)["counters"]
        ta = {r.prompt_id: list(r.output_token_ids) for r in ra[ra.point_id == pid].itertuples()}
        tb = {r.prompt_id: list(r.output_token_ids) for r in rb[rb.point_id == pid].itertuples()}
        ratio = analysis.unpaired_ratio_ci(sb[pid]["passes"] or [sb[pid]["tok_s"]],
                                           sa[pid]["passes"] or [sa[pid]["tok_s"]])
        rows.append({"point_id": pid, "counters_equal": ca == cb, "tokens_equal": ta == tb,
                     "counters": [ca, cb], "a": sa[pid], "b": sb[pid],
                     "throughput_within": within(sa[pid], sb[pid]),
                     "ratio": dict(zip(("b_over_a", "lo", "hi"), map(num, ratio)))})
    return rows


def line(r: dict) -> str:
    ca, cb = r["counters"]
    tput = " vs ".join(f"{x['tok_s']:.1f}" + (f" [{x['lo']:.1f}, {x['hi']:.1f}]"
                                               if x["lo"] is not None else "")
                       for x in (r["a"], r["b"]))
    verdict = {True: "within", False: "OUTSIDE", None: "no interval"}[r["throughput_within"]]
    nice = " vs ".join(",".join(map(str, x["nice"])) or "?" for x in (r["a"], r["b"]))
    q = r["ratio"]
    ratio = f"{q['b_over_a']:.2f}" + (f" [{q['lo']:.2f}, {q['hi']:.2f}]" if q["lo"] else "")
    return (f"{r['point_id']}: counters {'equal' if r['counters_equal'] else f'{ca} != {cb}'}, "
            f"tokens {'equal' if r['tokens_equal'] else 'differ'}; tok/s {tput} "
            f"({r['a']['rounds']} and {r['b']['rounds']} rounds): {verdict}; B/A {ratio}"
            + (f"; niceness {nice}" if r["a"]["nice"] or r["b"]["nice"] else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--out", type=Path, help="the comparison as JSON")
    a = ap.parse_args(argv)
    rows = compare(a.run_a, a.run_b)
    for r in rows:
        print(line(r))
    same = sum(r["counters_equal"] and r["tokens_equal"] for r in rows)
    inside = sum(r["throughput_within"] is True for r in rows)
    print(f"{same}/{len(rows)} shared points identical; throughput within the intervals for "
          f"{inside}/{len(rows)}")
    if a.out:
        a.out.write_text(json.dumps({"run_a": a.run_a, "run_b": a.run_b, "identical": same,
                                     "within": inside, "points": rows}, indent=1))
    return 1 if same < len(rows) or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
