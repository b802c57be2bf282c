"""`speclab` command line: run the lab, check profiles, manage the overlay and fixtures, predict
speed, parse metrics logs, benchmark the harness."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from pathlib import Path

from speclab import progress


def _value(text: str):
    """A parameter value as papermill's -p reads it, plus YAML/JSON lists and mappings:
    1 → int, 0.5 → float, true/True → bool, None/null → None, [1, 4] → list, else str."""
    import yaml

    if text in ("None", "none"):
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _params(pairs: list[list[str]], files: list[str]) -> dict:
    """Notebook parameters: `-f FILE` YAML mappings in order, then `-p KEY VALUE` pairs
    (`-p KEY=VALUE` is read the same way)."""
    import yaml

    out: dict = {}
    for f in files:
        try:
            data = yaml.safe_load(Path(f).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"-f {f}: cannot read parameters: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"-f {f}: expected a mapping of parameter names to values")
        out.update(data)
    for pair in pairs:
        if len(pair) == 1 and "=" in pair[0]:
            pair = pair[0].split("=", 1)
        if len(pair) != 2:
            raise ValueError(f"-p expects KEY VALUE, got {' '.join(pair)!r}")
        out[pair[0]] = _value(pair[1])
    return out


def _override(text: str | None) -> dict | None:
    """--override: a YAML/JSON mapping merged into the profile."""
    if not text:
        return None
    value = _value(text)
    if not isinstance(value, dict):
        raise ValueError(f"--override expects a mapping, e.g. '{{max_tokens: 32}}', got {text!r}")
    return value


def _out_roots(a) -> tuple[Path | None, Path | None]:
    """--out DIR: runs under DIR/data/runs, figures under DIR/figures."""
    if not getattr(a, "out", None):
        return None, None
    root = Path(a.out).expanduser().resolve()
    return root / "data" / "runs", root / "figures"


def _run_id(a, prof) -> str:
    """--run-id, else `<profile>-local`; --fresh adds the time (a new, empty run folder).
    Sets a.resume, the line an interrupt prints."""
    from speclab import store

    run_id = a.run_id or store.default_run_id(prof.name)
    if a.fresh:
        run_id = store.fresh_run_id(run_id)
    again = f"speclab {a.cmd} --profile {a.profile} --run-id {run_id}" + (
        f" --override {shlex.quote(a.override)}" if a.override else "")
    a.resume = (f"finished points are kept in {store.run_dirs(run_id)[0]}; resume with "
                f"`{again}`")
    return run_id


def _notebooks(names: str | None) -> list[str]:
    import difflib

    from speclab import report

    if not names:
        return list(report.SUITE)
    out = names.split(",")
    have = sorted(p.stem for p in report.NOTEBOOK_DIR.glob("*.ipynb"))
    for name in out:
        if name not in have:
            close = difflib.get_close_matches(name, have, n=1)
            raise ValueError(f"--notebooks: unknown notebook {name!r}"
                             + (f" (did you mean {close[0]}?)" if close else "")
                             + f"; available: {', '.join(have)}")
    return out


def cmd_run(a) -> int:
    from speclab import profiles, report, runlock, store

    t0 = time.time()
    notebooks = _notebooks(a.notebooks)
    params = _params(a.param, a.param_file)
    if a.override:
        params["overrides"] = {**params.get("overrides", {}), **_override(a.override)}
    runs_root, figures_root = _out_roots(a)
    run_id = _run_id(a, profiles.load(a.profile, params.get("overrides")))
    try:
        with runlock.hold(store.run_dirs(run_id, runs_root)[0]):
            path = report.run_suite(a.profile, run_id=run_id, notebooks=notebooks,
                                    parameters=params, runs_root=runs_root,
                                    figures_root=figures_root)
    except report.NotebookFailed as e:
        print(f"speclab: error: {e}", file=sys.stderr)
        return 1
    print(f"BENCH main-job profile={a.profile} wall_s={time.time() - t0:.1f} report={path}")
    return 0


def _levels(text: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency {text}: give request counts >= 1, e.g. 1,4,16")
    return levels


def cmd_sweep(a) -> int:
    import fnmatch

    from speclab import parity, preflight, profiles, server, store, sweep

    over = _override(a.override) or {}
    if a.executor:
        over["executor"] = a.executor
    if a.ray_address:
        over.setdefault("ray", {})["address"] = a.ray_address
    prof = profiles.load(a.profile, over)
    if a.mode == "server" and prof.executor != "local":
        raise ValueError("server mode runs on this machine only (--executor local)")
    if a.mode == "server" and a.dry_run:
        raise ValueError("--dry-run previews offline sweeps (server mode keeps a result per "
                         "concurrency level)")
    if a.concurrency and a.mode != "server":
        raise ValueError(f"--concurrency {a.concurrency} sets server mode's levels: add "
                         "--mode server (offline points run every prompt as one batch)")
    levels = _levels(a.concurrency or "1,4") if a.mode == "server" else []
    problems = preflight.check_env(prof)
    if problems:
        raise profiles.ProfileError("\n".join(problems))
    points = profiles.expand(prof)
    if a.with_parity:
        points += parity.points_of(parity.plan(prof, prof.parity.arms,
                                               k_values=prof.parity.k_values,
                                               spec_k=prof.parity.spec_k))
    points = list({p.id: p for p in points}.values())
    if a.only:
        chosen = [p for p in points if any(fnmatch.fnmatch(p.id, g) for g in a.only.split(","))]
        if not chosen:
            raise ValueError(f"--only {a.only}: matches none of the {len(points)} points "
                             f"({', '.join(p.id for p in points)})")
        points = chosen
    run_dir, _ = store.run_dirs(_run_id(a, prof), _out_roots(a)[0])
    if a.dry_run:
        return _print_preview(prof, run_dir, sweep.preview(prof, run_dir, points,
                                                           retry_failed=not a.no_retry))
    if a.mode == "server":
        res = [m for p in points for m in server.run_point(prof, p, run_dir, levels)]
    else:
        res = sweep.run(prof, run_dir, points, retry_failed=not a.no_retry)
    failed = [r["point_id"] for r in res if r["status"] != "ok"]
    print(f"{len(res) - len(failed)}/{len(res)} points ok in {run_dir}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _print_preview(prof, run_dir: Path, rows: list[dict]) -> int:
    """`speclab sweep --dry-run`: one line per point, then what would run."""
    print(f"sweep {prof.name} into {run_dir} (dry run: nothing is measured or moved)")
    verbs = {"keep": "keep", "new": "measure", "changed": "again", "damaged": "again",
             "failed": "retry"}
    for r in rows:
        rounds = f" (+{r['rounds']} timing round{'s' * (r['rounds'] > 1)})" if r["rounds"] \
            else ""
        print(f"  {verbs[r['action']]:<8}{r['id']}{rounds}"
              + (f": {r['detail']}" if r["detail"] else ""))
    runs = sum(r["action"] != "keep" for r in rows)
    print(f"{runs} of {len(rows)} points would be measured, "
          f"{sum(r['action'] == 'changed' for r in rows)} of them set aside first "
          f"(changed settings); {sum(r['rounds'] for r in rows)} timing rounds")
    return 0


def cmd_profile(a) -> int:
    from speclab import engine, memory, methods, preflight, profiles, releases, revisions

    if a.action == "list":
        print("\n".join(profiles.available()))
        return 0
    prof = profiles.load(a.name)
    points = profiles.expand(prof)
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
    ests = memory.estimates(prof, points, memory.gpu_for(prof, a.gpu))
    for est in ests:
        print(f"  memory {est.point}: {est.line()}")
    for note in dict.fromkeys(n for e in ests for n in e.notes):
        print(f"  memory from {note}")
    print(f"  methods: {methods.support_line(prof)} (releases whose source was read)")
    problems = preflight.check_env(prof) + preflight.memory_problems(ests)
    for msg in problems:
        print(f"  not runnable here: {msg}")
    for warning in filter(None, (releases.horizon(preflight.installed_vllm()),
                                 revisions.mismatch(prof))):
        print(f"  warning: {warning}")
    return 1 if problems and a.strict else 0


def cmd_overlay(a) -> int:
    from speclab import overlay

    site = Path(a.site) if a.site else None
    if a.action == "install":
        print(f"installed: {overlay.install(site)}")
    elif a.action == "uninstall":
        removed = overlay.uninstall(site)
        print("removed: "
              + (", ".join(map(str, removed)) if removed else "nothing (not installed)"))
    elif a.action == "plan":
        if not a.draft_config:
            raise ValueError("overlay plan needs --draft-config PATH (a config.json or its folder)")
        print(json.dumps(overlay.aux_plan(Path(a.draft_config), a.num_layers,
                                          Path(a.target_config) if a.target_config else None)))
    else:
        st = overlay.status(draft_config=Path(a.draft_config) if a.draft_config else None)
        print(json.dumps(st, indent=1, default=str) if a.json else overlay.format_status(st))
    return 0


def cmd_aux_report(a) -> int:
    from speclab import auxcheck

    print(auxcheck.report_html(Path(a.run_dir)))
    return 0


def cmd_predict(a) -> int:
    from speclab import predictreport

    def profile(flag: str, text: str, method: str):
        try:
            return predictreport.acceptance_from(text, method)
        except ValueError as e:
            raise ValueError(f"{flag} {text!r}: {e}") from None

    try:
        rates, measured = profile("--acceptance", a.acceptance, "eagle3")
        mtp_rates, measured_mtp = profile("--acceptance-mtp", a.acceptance_mtp, "mtp")
        runs = [Path(r) for r in a.run_dir] or predictreport.reference_runs()
        if not runs:
            raise ValueError("no run folder given, and this installation has no committed "
                             "H200 runs to default to")
        path = predictreport.report(
            runs, rates, a.layers, Path(a.out) if a.out else None, a.gpus, mtp_rates,
            measured=[m for m in (measured, measured_mtp) if m])
    except (FileNotFoundError, ValueError) as e:
        print(f"speclab: error: {e}", file=sys.stderr)
        return 1
    print(path.read_text())
    print(f"wrote {path} and {path.with_suffix('.html')}")
    return 0


def cmd_fixtures(a) -> int:
    from speclab import fixtures

    cache = Path(a.cache) if a.cache else None
    names = a.names or [n for n, fx in fixtures.FIXTURES.items() if fx.by_default]
    if a.action == "list":
        for name, fx in fixtures.FIXTURES.items():
            print(name if fx.by_default else f"{name} (built only when named)")
        return 0
    import yaml

    params: dict[str, dict] = {}
    for item in a.param:
        key, sep, value = item.partition("=")
        fixture, dot, field = key.rpartition(".")
        if not (sep and dot and fixture and field):
            raise SystemExit(f"speclab: --param wants FIXTURE.KEY=VALUE (e.g. "
                             f"realshape-dsv4.num_layers=8), got {item!r}")
        params.setdefault(fixture, {})[field] = yaml.safe_load(value)
    for name in names:
        t0 = time.time()
        mine = {f: v for f, v in params.items() if f in fixtures.closure(name)}
        path = fixtures.build(name, cache, seed=a.seed, force=a.force, params=mine or None)
        print(f"{name}: {path} ({time.time() - t0:.1f} s)")
    return 0


def cmd_metrics(a) -> int:
    from speclab import metrics

    text = sys.stdin.read() if a.file == "-" else Path(a.file).read_text(errors="replace")
    found = errors = 0
    for n, ts, rec, err in metrics.scan_log(text):
        if err:
            errors += 1
            print(f"speclab: {a.file}:{n}: {err}", file=sys.stderr)
            continue
        found += 1
        print(json.dumps({"line": n, "timestamp": ts, **rec}, allow_nan=False), flush=True)
    if not found and not errors:
        print(f"speclab: error: no 'SpecDecoding metrics:' line in {a.file}", file=sys.stderr)
    return 0 if found and not errors else 1


def cmd_bench(a) -> int:
    from speclab import bench

    if a.overhead:
        return bench.overhead(a.profile, a.k, a.rounds)
    return bench.main(a.profile, a.k, a.run_id)


def _run_id_arg(value: str) -> str:
    """--run-id checked as argparse reads it: a bad one stops before anything loads."""
    from speclab import paths

    try:
        return paths.check_run_id(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _at_least(low: int):
    """An argparse type: a whole number of at least `low` (a count, k), checked as argparse
    reads it, before anything loads."""
    def whole(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or n < low:
            raise argparse.ArgumentTypeError(f"{value!r}: a whole number of at least {low}")
        return n

    return whole


def _common(p) -> None:
    """The options `run` and `sweep` share, spelled the same."""
    p.add_argument("--profile", default="tiny-cpu", help="profile name or YAML path")
    p.add_argument("--run-id", type=_run_id_arg,
                   help="run folder name under data/runs, or an absolute path (default: "
                   "<profile>-local; a finished point is resumed when its fingerprint matches)")
    p.add_argument("--out", metavar="DIR", help="output root: runs in DIR/data/runs, figures in "
                   "DIR/figures (default: $SPECLAB_OUT, else the checkout, else the working "
                   "directory)")
    p.add_argument("--override", metavar="YAML", help="mapping merged into the profile, e.g. "
                   "'{max_tokens: 32, engine: {enforce_eager: false}}'")


def build_parser() -> argparse.ArgumentParser:
    from speclab.memory import GPUS

    ap = argparse.ArgumentParser(prog="speclab", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="main job: execute the notebook suite, write the HTML report")
    _common(p)
    p.add_argument("--fresh", action="store_true",
                   help="measure into a new run folder (<run-id>-<UTC time>), resume nothing")
    p.add_argument("--notebooks", help="comma-separated subset, e.g. 00_overlay,01_sweep")
    p.add_argument("-p", "--parameters", dest="param", nargs="+", action="append", default=[],
                   metavar=("KEY", "VALUE"),
                   help="notebook parameter, as papermill's -p (repeatable); VALUE may be YAML/"
                        "JSON: -p mode server -p concurrency '[1, 4]'")
    p.add_argument("-f", "--parameters-file", dest="param_file", action="append", default=[],
                   metavar="FILE", help="YAML file of notebook parameters (as papermill's -f)")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("sweep", help="run a profile's grid only (resumes)")
    _common(p)
    p.add_argument("--fresh", action="store_true",
                   help="measure into a new run folder (<run-id>-<UTC time>), resume nothing")
    p.add_argument("--no-retry", action="store_true", help="do not retry failed points")
    p.add_argument("--with-parity", action="store_true",
                   help="also run the points of the profile's parity arms")
    p.add_argument("--only", help="comma-separated globs over point ids, e.g. 'k0_*,k3_*'")
    p.add_argument("--dry-run", action="store_true",
                   help="say per point whether it would be kept, measured or measured again "
                        "(and why), then stop: nothing is built, measured or moved")
    p.add_argument("--executor", choices=["local", "ray"],
                   help="where points run (default: the profile's, local unless it says ray)")
    p.add_argument("--ray-address", help="Ray cluster address (default: the profile's, else "
                   "RAY_ADDRESS, else a Ray instance started here)")
    p.add_argument("--mode", choices=["offline", "server"], default="offline")
    p.add_argument("--concurrency",
                   help="server mode: comma-separated concurrency levels (default 1,4)")
    p.set_defaults(fn=cmd_sweep)

    p = sub.add_parser("profile", help="list or check profiles (no model is loaded)")
    p.add_argument("action", choices=["list", "check"])
    p.add_argument("name", nargs="?", default="tiny-cpu")
    p.add_argument("--strict", action="store_true", help="exit 1 if not runnable on this machine")
    p.add_argument("--gpu", choices=sorted(GPUS), help="GPU to check memory against "
                   "(default: this machine's, else the one the profile's name names)")
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("overlay", help="install/uninstall/status of the DeepSeek-V4 EAGLE-3 "
                       "overlay; plan: a draft's aux-layer ids (no vLLM, no GPU)")
    p.add_argument("action", choices=["install", "uninstall", "status", "plan"])
    p.add_argument("--site", help="site-packages directory (default: the active environment's)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--draft-config", help="the draft's config.json (or its folder)")
    p.add_argument("--num-layers", type=_at_least(1),
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
    p.add_argument("--param", action="append", default=[], metavar="FIXTURE.KEY=VALUE",
                   help="a build parameter (YAML value), e.g. realshape-dsv4.num_layers=8")
    p.set_defaults(fn=cmd_fixtures)

    p = sub.add_parser("predict", help="speedup per k and batch size from measured step "
                       "costs (a gpubench run): measured, predicted, extrapolated")
    p.add_argument("run_dir", nargs="*", help="a gpubench run folder, or several of one GPU "
                   "model and vLLM release to pool (then --out); none: the committed H200 "
                   "runs the README's answer pools (then --out)")
    p.add_argument("--acceptance", default="0.617,0.433,0.294",
                   help="per-position unconditional acceptance, comma-separated, or a folder "
                   "of `speclab run` / `sweep` whose EAGLE-3 point with the largest k (or "
                   "RUN:POINT_ID) measured it (default: published EAGLE3.1)")
    p.add_argument("--acceptance-mtp", default="0.769,0.381",
                   help="the same for MTP engines (default: DeepSeek-V4-Flash's MTP in vLLM "
                   "PR #41044)")
    p.add_argument("--layers", type=_at_least(1), default=43,
                   help="target depth to extrapolate to")
    p.add_argument("--gpus", type=_at_least(1), default=8,
                   help="GPUs of the TP + EP node the extrapolation is carried to (a bracket, "
                   "not a measurement; 1: none)")
    p.add_argument("--out", help="output folder (default: the run folder; several runs need one)")
    p.set_defaults(fn=cmd_predict)

    p = sub.add_parser("aux-report", help="render a folder of GPU aux checks as report.html")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_aux_report)

    p = sub.add_parser("metrics", help="metrics utilities")
    msub = p.add_subparsers(dest="action", required=True)
    m = msub.add_parser("parse-log", help="JSON per 'SpecDecoding metrics:' line of a vLLM log")
    m.add_argument("file", help="log file, or - for stdin")
    m.set_defaults(fn=cmd_metrics)

    p = sub.add_parser("bench",
                       help="split one point's wall time: engine start, generation, harness")
    p.add_argument("--profile", default="tiny-cpu")
    p.add_argument("--k", type=_at_least(0), default=3)
    p.add_argument("--run-id", default="bench")
    p.add_argument("--overhead", action="store_true", help="instead: stepped generation (the "
                   "sweep's per-request attribution) against LLM.generate on one engine")
    p.add_argument("--rounds", type=_at_least(1), default=10, help="--overhead: alternating rounds")
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    from speclab.profiles import ProfileError
    from speclab.runlock import RunLocked

    a = build_parser().parse_args(argv)
    progress.log_to_stdout()  # the package's progress lines (sweeps, fixture builds, ...)
    # SIGTERM unwinds like Ctrl-C, so worker processes and servers are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return a.fn(a)
    except (ProfileError, ValueError, OSError, RunLocked) as e:  # OSError: unwritable, full
        print(f"speclab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # the worker in flight was stopped on the way out; nothing partial was recorded
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # no second one mid-message
        hint = getattr(a, "resume", None)
        print(f"speclab: interrupted{'; ' + hint if hint else ''}", file=sys.stderr)
        signal.signal(signal.SIGINT, previous)  # a caller in this process keeps its Ctrl-C
        return 130


if __name__ == "__main__":
    sys.exit(main())
