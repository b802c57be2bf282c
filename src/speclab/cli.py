"""`speclab` command line: run the lab, check profiles, manage the overlay and fixtures,
parse metrics logs, benchmark the harness."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path


def _params(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if not _:
            raise SystemExit(f"-p expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_run(a) -> int:
    from speclab import report

    t0 = time.time()
    path = report.run_suite(a.profile, run_id=a.run_id,
                            notebooks=a.notebooks.split(",") if a.notebooks else report.SUITE,
                            parameters=_params(a.param))
    print(f"BENCH main-job profile={a.profile} wall_s={time.time() - t0:.1f} report={path}")
    return 0


def cmd_sweep(a) -> int:
    import fnmatch

    from speclab import parity, profiles, server, sweep

    prof = profiles.load(a.profile, json.loads(a.override) if a.override else None)
    problems = profiles.check_env(prof)
    if problems:
        raise profiles.ProfileError("\n".join(problems))
    points = sweep.expand(prof)
    if a.with_parity:
        points += parity.points_of(parity.plan(prof, prof.parity.arms,
                                               k_values=prof.parity.k_values,
                                               spec_k=prof.parity.spec_k))
    points = list({p.id: p for p in points}.values())
    if a.only:
        points = [p for p in points if any(fnmatch.fnmatch(p.id, g) for g in a.only.split(","))]
    run_dir, _ = sweep.run_dirs(a.run_id or prof.name)
    if a.mode == "server":
        levels = [int(c) for c in a.concurrency.split(",")]
        res = [m for p in points for m in server.run_point(prof, p, run_dir, levels)]
    else:
        res = sweep.run(prof, run_dir, points, retry_failed=not a.no_retry)
    failed = [r["point_id"] for r in res if r["status"] != "ok"]
    print(f"{len(res) - len(failed)}/{len(res)} points ok in {run_dir}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def cmd_profile(a) -> int:
    from speclab import engine, profiles, sweep

    if a.action == "list":
        print("\n".join(profiles.available()))
        return 0
    prof = profiles.load(a.name)
    points = sweep.expand(prof)
    print(f"profile {prof.name}: valid ({len(points)} points)")
    print(f"  {prof.description}".rstrip())
    seen = set()
    for p in points:
        args, env = engine.engine_args(prof, p, prof.target, prof.draft, native_draft_kv=True)
        key = json.dumps([args, env], sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        print(f"  {p.id}:\n    LLM(**{json.dumps(args, default=str)})" + (
            f"\n    env {json.dumps(env)}" if env else ""))
    problems = profiles.check_env(prof)
    for msg in problems:
        print(f"  not runnable here: {msg}")
    return 1 if problems and a.strict else 0


def cmd_overlay(a) -> int:
    from speclab import overlay

    site = Path(a.site) if a.site else None
    if a.action == "install":
        print(f"installed: {overlay.install(site)}")
    elif a.action == "uninstall":
        removed = overlay.uninstall(site)
        print("removed: " + (", ".join(map(str, removed)) if removed else "nothing (not installed)"))
    elif a.action == "plan":
        if not a.draft_config:
            raise ValueError("overlay plan needs --draft-config PATH (a config.json or its folder)")
        print(json.dumps(overlay.aux_plan(Path(a.draft_config), a.num_layers,
                                          Path(a.target_config) if a.target_config else None)))
    else:
        st = overlay.status(draft_config=Path(a.draft_config) if a.draft_config else None)
        print(json.dumps(st, indent=1, default=str) if a.json else overlay.format_status(st))
    return 0


def cmd_fixtures(a) -> int:
    from speclab import fixtures

    cache = Path(a.cache) if a.cache else None
    names = a.names or list(fixtures.FIXTURES)
    if a.action == "list":
        for name in fixtures.FIXTURES:
            print(name)
        return 0
    for name in names:
        t0 = time.time()
        path = fixtures.build(name, cache, seed=a.seed, force=a.force)
        print(f"{name}: {path} ({time.time() - t0:.1f} s)")
    return 0


def cmd_metrics(a) -> int:
    from speclab import metrics

    text = sys.stdin.read() if a.file == "-" else Path(a.file).read_text(errors="replace")
    for rec in metrics.parse_log(text):
        print(json.dumps(rec))
    return 0


def cmd_bench(a) -> int:
    from speclab import bench

    return bench.main(a.profile, a.k, a.run_id)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="speclab", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="main job: execute the notebook suite, write the HTML report")
    p.add_argument("--profile", default="tiny-cpu")
    p.add_argument("--run-id", help="run folder name under data/runs (default: the profile name)")
    p.add_argument("--notebooks", help="comma-separated subset, e.g. 00_overlay,01_sweep")
    p.add_argument("-p", "--param", action="append", default=[],
                   help="notebook parameter KEY=JSON (repeatable)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("sweep", help="run a profile's grid only (resumes)")
    p.add_argument("--profile", default="tiny-cpu")
    p.add_argument("--run-id")
    p.add_argument("--no-retry", action="store_true", help="do not retry failed points")
    p.add_argument("--with-parity", action="store_true",
                   help="also run the points of the profile's parity arms")
    p.add_argument("--only", help="comma-separated globs over point ids, e.g. 'k0_*,k3_*'")
    p.add_argument("--override", help="JSON merged into the profile, e.g. "
                   "'{\"engine\": {\"enforce_eager\": false}}'")
    p.add_argument("--mode", choices=["offline", "server"], default="offline")
    p.add_argument("--concurrency", default="1,4",
                   help="server mode: comma-separated concurrency levels")
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("profile", help="list or check profiles (no model is loaded)")
    p.add_argument("action", choices=["list", "check"])
    p.add_argument("name", nargs="?", default="tiny-cpu")
    p.add_argument("--strict", action="store_true", help="exit 1 if not runnable on this machine")
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("overlay", help="install/uninstall/status of the DeepSeek-V4 EAGLE-3 "
                       "overlay; plan: a draft's aux-layer ids (no vLLM, no GPU)")
    p.add_argument("action", choices=["install", "uninstall", "status", "plan"])
    p.add_argument("--site", help="site-packages directory (default: the active environment's)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--draft-config", help="the draft's config.json (or its folder)")
    p.add_argument("--num-layers", type=int,
                   help="target decoder layers, to check the capture range")
    p.add_argument("--target-config", help="the target's config.json (or folder), read for "
                   "num_hidden_layers when --num-layers is absent")
    p.set_defaults(fn=cmd_overlay)

    p = sub.add_parser("fixtures", help="build the project's small checkpoints (cached)")
    p.add_argument("action", choices=["build", "list"])
    p.add_argument("names", nargs="*")
    p.add_argument("--cache", help="cache directory (default: $SPECLAB_CACHE/fixtures)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true")
    p.set_defaults(fn=cmd_fixtures)

    p = sub.add_parser("metrics", help="metrics utilities")
    msub = p.add_subparsers(dest="action", required=True)
    m = msub.add_parser("parse-log", help="JSON per 'SpecDecoding metrics:' line of a vLLM log")
    m.add_argument("file", help="log file, or - for stdin")
    m.set_defaults(fn=cmd_metrics)

    p = sub.add_parser("bench", help="split one point's wall time: engine start, generation, harness")
    p.add_argument("--profile", default="tiny-cpu")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--run-id", default="bench")
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    from speclab.profiles import ProfileError

    a = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so worker processes and servers are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return a.fn(a)
    except (ProfileError, ValueError, FileNotFoundError) as e:
        print(f"speclab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
