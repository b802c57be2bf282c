"""Several passes through one engine, and prefix rescoring: the parity study's same-engine
noise arm, its positive controls (one engine, one pass per injected defect) and the margins
no plain pass saw.

A `Group` is one engine (`engine_point`: its configuration, and any defect that must exist
before the model loads) and the passes it runs, each recorded as its own point of the run
folder in the sweep's format (`points/<id>.parquet`, `results/<id>.json` with `engine_group`
and `pass_index`), so `store.load_results` reads them with the rest; a pass is resumed only
when its fingerprint still matches, like a sweep point. Plain passes request top-2 logprobs
in the pass itself. `python -m speclab.multipass SPEC.json` runs one group (or one rescoring
job) in a fresh process tied to its parent (speclab.launch), like `speclab.worker`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from speclab import engine, fingerprint, launch, runlock, store
from speclab.profiles import Point, Profile

log = logging.getLogger(__name__)
GROUP_ENV = "SPECLAB_ENGINE_GROUP"
RESCORE_FILE = "rescore.parquet"


@dataclass(frozen=True)
class Group:
    name: str
    engine_point: Point
    passes: tuple[Point, ...]


def same_engine_repeats(name: str, base: Point, n: int) -> Group:
    """n plain (or speculative) passes of `base` in one engine."""
    tag = {GROUP_ENV: name}
    passes = tuple(base.model_copy(update={"env": {**base.env, **tag}, "repeat": i})
                   for i in range(n))
    return Group(name, base, passes)


def prefix_sha(ids) -> str:
    return hashlib.sha1(json.dumps([int(i) for i in ids]).encode()).hexdigest()[:16]


def _subprocess(spec: dict, run_dir: Path, name: str, env: dict, timeout: float) -> str | None:
    """Run `python -m speclab.multipass` on `spec` (launch.run_module; forked from a zygote
    on the CPU backend); None or the error."""
    return launch.run_module("speclab.multipass", spec, run_dir / "logs" / f"{name}.spec.json",
                             run_dir / "logs" / f"{name}.log", env, timeout,
                             fork=spec["profile"]["backend"] == "cpu")


def run_groups(profile: Profile, run_dir: Path, groups: list[Group]) -> None:
    """Run every group with a pass to measure, holding the run folder's lock: a pass is kept
    only when it finished with this machine's and profile's fingerprint (mode "multipass");
    otherwise it is set aside with one line saying why (`store.needs_run`)."""
    run_dir = Path(run_dir)
    with runlock.hold(run_dir):
        _run_groups(profile, run_dir, groups)


def _run_groups(profile: Profile, run_dir: Path, groups: list[Group]) -> None:
    stamp = store.stamp()
    store.save_profile(profile, run_dir, stamp)
    if groups:
        launch.prepare_models(profile, [g.engine_point for g in groups])
    fps = {p.id: fingerprint.of_point(profile, p, mode="multipass")
           for g in groups for p in g.passes}
    todo = [g for g in groups  # every pass is checked: a changed one is set aside
            if any([store.needs_run(run_dir, p.id, fps[p.id], stamp) for p in g.passes])]
    for g in todo:
        spec = {"job": "group", "profile": profile.model_dump(mode="json"),
                "engine_point": g.engine_point.model_dump(mode="json"), "name": g.name,
                "passes": [p.model_dump(mode="json") for p in g.passes], "run_dir": str(run_dir),
                "fingerprints": {p.id: fps[p.id] for p in g.passes}}
        err = _subprocess(spec, run_dir, f"group-{g.name}",
                          {**profile.env, **g.engine_point.env},
                          profile.timeout_s * (1 + len(g.passes) / 4))
        for i, p in enumerate(g.passes):
            meta = store.read_meta(run_dir, p.id)
            if meta is None or meta.get("status") != "ok":
                log.warning(f"group {g.name} pass {i} ({p.id}) failed: {err or 'no result'}")
                if meta is None:
                    store.write_point(run_dir, store.PointResult(
                        point_id=p.id, status="error", point=p.model_dump(mode="json"),
                        engine_group=g.name, pass_index=i, error=err or "no result",
                        fingerprint=fps[p.id]))


def rescore(profile: Profile, run_dir: Path, requests: pd.DataFrame) -> pd.DataFrame:
    """Top-1/top-2 margins of the plain engine after given prefixes (prompt_id, position,
    prefix: the output token ids before position), one token each with logprobs; appended to
    the run's `rescore.parquet` (returned whole). Prefixes already there are not rerun.
    Holds the run folder's lock."""
    run_dir = Path(run_dir)
    with runlock.hold(run_dir):
        return _rescore(profile, run_dir, requests)


def _rescore(profile: Profile, run_dir: Path, requests: pd.DataFrame) -> pd.DataFrame:
    path = run_dir / RESCORE_FILE
    have = pd.read_parquet(path) if path.exists() else pd.DataFrame(
        columns=["prompt_id", "position", "prefix_sha", "margin", "top1", "runner_up"])
    req = requests.assign(prefix_sha=[prefix_sha(p) for p in requests.prefix])
    req = req[~(req.prompt_id + ":" + req.prefix_sha).isin(have.prompt_id + ":" + have.prefix_sha)]
    req = req.drop_duplicates(["prompt_id", "prefix_sha"])
    if not len(req):
        return have
    g = profile.grid
    base = Point(k=0, kv_cache_dtype=g.kv_cache_dtype[0], layout=g.layout[0],
                 prompt_format=g.prompt_format[0])
    launch.prepare_models(profile, [base])
    spec = {"job": "rescore", "profile": profile.model_dump(mode="json"),
            "engine_point": base.model_dump(mode="json"), "run_dir": str(run_dir),
            "requests": [{"prompt_id": r.prompt_id, "position": int(r.position),
                          "prefix": [int(x) for x in r.prefix]} for r in req.itertuples()]}
    err = _subprocess(spec, run_dir, "rescore", profile.env, profile.timeout_s)
    if err:
        log.warning(f"rescoring {len(req)} prefixes failed: {err}")
    return pd.read_parquet(path) if path.exists() else have


# --------------------------------------------------------------------- in the subprocess
def _engine(profile: Profile, point: Point):
    from speclab import defects, prompts
    from speclab.profiles import prompt_file, resolve_model

    plist = prompts.load(prompt_file(profile), limit=profile.prompts.limit,
                         categories=profile.prompts.categories, seed=profile.prompts.seed)
    target = resolve_model(profile.target)
    draft = resolve_model(profile.draft) if point.k > 0 else None
    native = engine.native_draft_kv_dtype() if point.k > 0 else True
    args, env = engine.engine_args(profile, point, target, draft, native,
                                   engine.native_request_metrics())
    os.environ.update(env)
    defects.install(defects.from_env())  # an aux-layers defect must precede the model load
    return plist, args, env


def _run_group(spec: dict) -> None:
    from vllm import SamplingParams

    from speclab import defects, metrics, prompts
    from speclab.worker import request_records

    profile = Profile.model_validate(spec["profile"])
    base = Point.model_validate(spec["engine_point"])
    passes = [Point.model_validate(p) for p in spec["passes"]]
    run_dir = Path(spec["run_dir"])
    plist, args, env = _engine(profile, base)
    engine_defect = defects.from_env()
    t0 = time.perf_counter()
    with engine.open_llm(args, shutdown=not launch.forked()) as llm:
        init_s = time.perf_counter() - t0
        tok = None if profile.skip_tokenizer_init else llm.get_tokenizer()
        ids = prompts.to_token_ids(plist, tok, base.prompt_format)
        sp_args = dict(temperature=profile.temperature, max_tokens=profile.max_tokens,
                       ignore_eos=profile.ignore_eos, seed=profile.seed,
                       detokenize=not profile.skip_tokenizer_init)
        if profile.warmup:
            llm.generate([{"prompt_token_ids": x[::-1]} for x in ids],
                         SamplingParams(**{**sp_args, "max_tokens": profile.warmup_tokens}),
                         use_tqdm=False)
        for i, p in enumerate(passes):
            if (store.read_meta(run_dir, p.id) or {}).get("status") == "ok":
                continue
            started = time.time()
            defect = defects.from_env(p.env) or engine_defect
            defects.set_defect(defect)
            before = metrics.from_snapshot(llm.get_metrics())
            g0 = time.perf_counter()
            sp = SamplingParams(**sp_args, logprobs=p.logprobs or None)
            traces = engine.generate_stepwise(llm, ids, sp, p.concurrency)
            gen_s = time.perf_counter() - g0
            delta = metrics.from_snapshot(llm.get_metrics()) - before
            counters, attributed = metrics.attribute(delta, traces, p.k, "stepped")
            records = request_records(p, plist, ids, traces, counters)
            n_out = sum(r.n_output for r in records)
            store.write_point(run_dir, store.PointResult(
                point_id=p.id, status="ok", point=p.model_dump(mode="json"),
                profile=profile.name, engine_group=spec["name"], pass_index=i,
                engine_args=args, env=env, defect=defects.describe(defect),
                counters=delta.to_dict(), **attributed, n_requests=len(records),
                output_tokens=n_out, throughput_tok_s=n_out / gen_s, versions=engine.versions(),
                timings={"engine_init_s": init_s, "generate_s": gen_s},
                started_at=started, finished_at=time.time(), command=" ".join(sys.argv),
                fingerprint=spec["fingerprints"][p.id]), records)


def _run_rescore(spec: dict) -> None:
    from vllm import SamplingParams

    from speclab import prompts

    profile = Profile.model_validate(spec["profile"])
    base = Point.model_validate(spec["engine_point"])
    run_dir = Path(spec["run_dir"])
    plist, args, _ = _engine(profile, base)
    with engine.open_llm(args, shutdown=not launch.forked()) as llm:
        tok = None if profile.skip_tokenizer_init else llm.get_tokenizer()
        ids = dict(zip((p.id for p in plist), prompts.to_token_ids(plist, tok, base.prompt_format)))
        reqs = spec["requests"]
        outs = llm.generate([{"prompt_token_ids": ids[r["prompt_id"]] + r["prefix"]} for r in reqs],
                            SamplingParams(temperature=0.0, max_tokens=1, logprobs=2,
                                           detokenize=not profile.skip_tokenizer_init),
                            use_tqdm=False)
    rows = []
    for r, o in zip(reqs, outs):
        top = engine._top_logprobs(o.outputs[0].logprobs)[0]
        rows.append({"prompt_id": r["prompt_id"], "position": r["position"],
                     "prefix_sha": prefix_sha(r["prefix"]), "margin": top[0][1] - top[1][1],
                     "top1": top[0][0], "runner_up": top[1][0]})
    path = run_dir / RESCORE_FILE
    old = pd.read_parquet(path) if path.exists() else None
    new = pd.concat([old, pd.DataFrame(rows)], ignore_index=True) if old is not None \
        else pd.DataFrame(rows)
    store.write_parquet(path, new)


def preload() -> None:
    """What a zygote imports before it forks multipass jobs (`launch.Zygote`)."""
    engine.preload()


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if not launch.guard_parent(spec):
        return 1
    try:
        (_run_group if spec["job"] == "group" else _run_rescore)(spec)
        return 0
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    launch.child_main(main)
