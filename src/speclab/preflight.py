"""Preflight: can this profile run on this machine? One line per problem, before any model
loads: vLLM installed (its version, KV-cache dtype names and engine arguments, read from its
source), GPUs for TP x DP, NUMA nodes for the CPU backend, model and prompt files, the
overlay, the aux-layer convention, the speculative methods (`methods.env_problems`), and
(`memory_problems`) whether each point fits."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from speclab import convention, gpus, methods, prompts
from speclab.profiles import Profile, prompt_file


def check_env(profile: Profile) -> list[str]:
    """Problems that stop this profile from running on this machine (empty list: ready)."""
    problems = []
    v = installed_vllm()
    if v is None:
        problems.append("vLLM is not installed (CPU: pip install '.[cpu]'; GPU: '.[gpu]')")
    else:
        if profile.min_vllm and _vtuple(v) < _vtuple(profile.min_vllm):
            problems.append(f"vLLM {v} is older than this profile's min_vllm {profile.min_vllm}")
        try:
            names = vllm_kv_dtypes()
        except (ImportError, OSError, SyntaxError, StopIteration, AttributeError,
                ValueError) as e:
            problems.append(f"cannot read vLLM's KV-cache dtypes: {e}")
        else:
            for field in ("kv_cache_dtype", "draft_kv_cache_dtype"):
                for dt in getattr(profile.grid, field):
                    if dt not in names:
                        problems.append(f"grid.{field}: {dt!r} is not a KV dtype of vLLM {v} "
                                        f"({', '.join(names)})")
        problems += engine_key_problems(profile)
    if profile.backend == "cuda" and profile.executor == "local":  # ray: checked on the cluster
        have = gpus.visible_count()
        if have < profile.max_gpus:
            problems.append(f"needs {profile.max_gpus} GPUs (largest TP x DP in grid.layout), "
                            f"{have} visible")
    elif profile.max_gpus > 1 and _auto_cpu_binding(profile):
        nodes = numa_nodes()
        if profile.max_gpus > nodes:
            problems.append(
                f"grid.layout: TP x DP = {profile.max_gpus} on the CPU backend needs as many "
                f"NUMA nodes, this machine has {nodes} (vLLM binds one worker per node; or set "
                "VLLM_CPU_OMP_THREADS_BIND to one CPU list per worker, separated by '|')")
    for ref in filter(None, (profile.target, profile.draft, profile.tokenizer)):
        if (msg := _model_problem(ref)) is not None:
            problems.append(msg)
    if profile.overlay == "required" and v is not None:
        from speclab import overlay

        st = overlay.status()
        if st["support"] == "none":
            problems.append(f"DeepSeek-V4 EAGLE-3: {st['support_detail']}")
    problems += convention.env_problems(profile)
    problems += methods.env_problems(profile)
    pfile = prompt_file(profile)
    if not pfile.exists():
        problems.append(f"prompts.file: {pfile} does not exist")
    else:
        try:
            prompts.load(pfile, limit=profile.prompts.limit,
                         categories=profile.prompts.categories, seed=profile.prompts.seed)
        except ValueError as e:
            problems.append(f"prompts.file: {e}")
    return problems


def memory_problems(estimates) -> list[str]:
    """The points of `memory.estimates` that do not fit."""
    return [f"{e.point}: does not fit in memory" for e in estimates if e.verdict == "does not fit"]


def _model_problem(ref: str) -> str | None:
    if ref.startswith("fixture:"):
        name = ref.split(":", 1)[1]
        try:
            from speclab import fixtures

            known = name in fixtures.FIXTURES  # the registry imports the builders
        except ImportError as e:  # fixtures are built with torch
            return f"{ref}: cannot be built here ({e}; pip install '.[cpu]')"
        return None if known else f"unknown fixture {name!r}"
    p = Path(ref).expanduser()
    if p.exists():
        return None if (p / "config.json").exists() else f"{ref}: no config.json"
    if ref.count("/") == 1 and not ref.startswith((".", "/", "~")):
        try:
            from huggingface_hub import try_to_load_from_cache

            if isinstance(try_to_load_from_cache(ref, "config.json"), str):
                return None
        except ImportError:
            pass
        return (f"{ref}: not in the local Hugging Face cache "
                "(download it first; this lab never does)")
    return f"{ref}: no such file or directory"


@cache
def installed_vllm() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


@cache
def vllm_kv_dtypes() -> tuple[str, ...]:
    """KV-cache dtype names the installed vLLM accepts: its `CacheDType` literal in
    config/cache.py, read from the source (importing vllm.config takes seconds)."""
    import ast

    tree = ast.parse(_vllm_source("config/cache.py"))
    node = next(n for n in tree.body if isinstance(n, ast.Assign)
                and [getattr(t, "id", None) for t in n.targets] == ["CacheDType"])
    names = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) \
        else [node.value.slice]
    return tuple(ast.literal_eval(n) for n in names)


def _vllm_source(rel: str) -> str:
    """The text of vllm/<rel> in the installed vLLM, not imported."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("vllm is not installed")
    return (Path(spec.origin).parent / rel).read_text()


@cache
def engine_arg_names() -> frozenset[str]:
    """Keyword arguments `vllm.LLM` accepts: its own parameters and the fields of
    `EngineArgs`, read from the installed vLLM's source (nothing is imported)."""
    import ast

    names: set[str] = set()
    for rel, cls, method in (("engine/arg_utils.py", "EngineArgs", None),
                             ("entrypoints/llm.py", "LLM", "__init__")):
        tree = ast.parse(_vllm_source(rel))
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        if method is None:
            names |= {n.target.id for n in node.body
                      if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        else:
            fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
            names |= {a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg != "self"}
    return frozenset(names)


def engine_key_problems(profile: Profile) -> list[str]:
    """`engine:` keys the installed vLLM does not accept, each with the closest valid one."""
    import difflib

    try:
        valid = engine_arg_names()
    except ModuleNotFoundError:
        return []  # check_env reports a missing vLLM on its own
    except (OSError, SyntaxError, StopIteration, AttributeError) as e:
        return [f"cannot read vLLM's engine arguments: {e}"]
    out = []
    for key in profile.engine:
        if key not in valid:
            close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
            out.append(f"engine.{key}: not an engine argument of vLLM {installed_vllm()}"
                       + (f" (did you mean {close[0]}?)" if close else ""))
    return out


def numa_nodes() -> int:
    """NUMA nodes with memory (1 where the system does not say)."""
    try:
        text = Path("/sys/devices/system/node/has_memory").read_text().strip()
    except OSError:
        return 1
    n = 0
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return max(n, 1)


def _auto_cpu_binding(profile: Profile) -> bool:
    bind = profile.env.get("VLLM_CPU_OMP_THREADS_BIND",
                           os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
    return bind == "auto"


def _vtuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)
