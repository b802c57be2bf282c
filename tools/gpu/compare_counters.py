#!/usr/bin/env python3
"""Compare the speculative-decoding counters and output tokens of the points two runs share
(e.g. the Ray executor's run against the local one): `compare_counters.py RUN_A RUN_B`.
Prints one line per shared point; exits 1 if any differs or no point is shared."""

import sys

from speclab import store


def main(a: str, b: str) -> int:
    pa, ra = store.load_results(a)
    pb, rb = store.load_results(b)
    shared = sorted(set(pa.point_id[pa.status == "ok"]) & set(pb.point_id[pb.status == "ok"]))
    bad = 0
    for pid in shared:
        ca, cb = store.read_meta(a, pid)["counters"], store.read_meta(b, pid)["counters"]
        ta = {r.prompt_id: list(r.output_token_ids) for r in ra[ra.point_id == pid].itertuples()}
        tb = {r.prompt_id: list(r.output_token_ids) for r in rb[rb.point_id == pid].itertuples()}
        same = ca == cb and ta == tb
        bad += not same
        print(f"{pid}: counters {'equal' if ca == cb else f'{ca} != {cb}'}, tokens "
              f"{'equal' if ta == tb else 'differ'}")
    print(f"{len(shared) - bad}/{len(shared)} shared points identical")
    return 1 if bad or not shared else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
