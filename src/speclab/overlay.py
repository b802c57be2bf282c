"""Install, remove and inspect the DeepSeek-V4 EAGLE-3 overlay (see overlay/README.md).

The overlay is two modules loaded at every interpreter start by a ``.pth`` file:
``install()`` copies them into ``<site>/speclab_dsv4_overlay/`` and writes
``<site>/speclab-dsv4-eagle3-overlay.pth`` (a relative path line, so the site directory can
be moved or carried to another machine, and a guarded ``install()`` line). ``status()``
imports neither vLLM nor torch and needs no GPU; ``status(probe=True)`` runs one subprocess
that imports the patched vLLM modules and reports what the overlay did to them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

FILES = ("deepseek_v4_eagle3_aux.py", "eagle3_draft_kv_cache.py")
DIR_NAME = "speclab_dsv4_overlay"
PTH_NAME = "speclab-dsv4-eagle3-overlay.pth"
PTH_TEXT = (
    f"{DIR_NAME}\n"
    'import warnings; exec("try:\\n import deepseek_v4_eagle3_aux\\n'
    ' deepseek_v4_eagle3_aux.install()\\nexcept Exception as e:\\n'
    " warnings.warn('DeepSeek-V4 EAGLE-3 overlay not loaded: %r' % (e,), RuntimeWarning)\")\n"
)


# --------------------------------------------------------------------------- install
def source_dir() -> Path:
    """The overlay files shipped with speclab: ``speclab/_overlay`` in a wheel, else the
    repository's ``overlay/`` (editable installs)."""
    import speclab

    for folder in (Path(speclab.__file__).parent / "_overlay",
                   Path(__file__).resolve().parents[2] / "overlay"):
        if all((folder / name).is_file() for name in FILES):
            return folder
    raise FileNotFoundError(f"overlay files {FILES} not found next to speclab")


def default_site() -> Path:
    """site-packages of the running interpreter's environment."""
    return Path(sysconfig.get_paths()["purelib"])


def install(site: Path | None = None) -> Path:
    """Copy the overlay into ``site`` (default: this environment's site-packages) and write
    its ``.pth``; idempotent. Returns the ``.pth`` path."""
    site = Path(site) if site else default_site()
    folder = site / DIR_NAME
    folder.mkdir(parents=True, exist_ok=True)
    src = source_dir()
    for name in FILES:
        _write(folder / name, (src / name).read_bytes())
    pth = site / PTH_NAME
    _write(pth, PTH_TEXT.encode())
    return pth


def _write(path: Path, data: bytes) -> None:
    if not path.is_file() or path.read_bytes() != data:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)


def uninstall(site: Path | None = None) -> list[Path]:
    """Remove what ``install(site)`` wrote (and the bytecode Python cached for it);
    idempotent. Returns the removed paths."""
    site = Path(site) if site else default_site()
    folder = site / DIR_NAME
    cache = folder / "__pycache__"
    paths = [site / PTH_NAME, *(folder / name for name in FILES)]
    paths += [p for name in FILES for p in sorted(cache.glob(f"{Path(name).stem}.*.pyc"))]
    removed = []
    for path in paths:
        if path.is_file():
            path.unlink()
            removed.append(path)
    for folder_ in (cache, folder):
        if folder_.is_dir() and not any(folder_.iterdir()):
            folder_.rmdir()
            removed.append(folder_)
    return removed


# --------------------------------------------------------------------------- status
def _vllm_tree() -> Path | None:
    """The ``vllm`` package directory Python would import (nothing is executed)."""
    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent if spec and spec.origin else None


def _find_pths(site: Path | None) -> list[Path]:
    """``.pth`` files that load the overlay: in ``site`` (default: this environment's
    site-packages), ``$SPECLAB_SITE`` and the directories on ``sys.path``."""
    dirs = [Path(site) if site else default_site(), *map(Path, filter(None, sys.path))]
    if os.environ.get("SPECLAB_SITE"):
        dirs.append(Path(os.environ["SPECLAB_SITE"]))
    found = []
    for d in dict.fromkeys(p.resolve() for p in dirs if p.is_dir()):
        found += [p for p in sorted(d.glob("*.pth"))
                  if "deepseek_v4_eagle3_aux" in p.read_text(errors="replace")]
    return found


def _overlay_module(folder: Path):
    """The overlay's aux module: the copy loaded in this process, else the one in ``folder``
    (importing it only defines functions: no hook is installed)."""
    if "deepseek_v4_eagle3_aux" not in sys.modules:
        sys.path.insert(0, str(folder))
        try:
            importlib.import_module("deepseek_v4_eagle3_aux")
        finally:
            sys.path.remove(str(folder))
    return sys.modules["deepseek_v4_eagle3_aux"]


def aux_module():
    """The overlay's ``deepseek_v4_eagle3_aux``: the copy this process loaded, else the
    shipped one."""
    return _overlay_module(source_dir())


def _probe(folder: Path) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import deepseek_v4_eagle3_aux"
            " as m; m.install(); print(json.dumps(m.probe()))")
    done = subprocess.run([sys.executable, "-c", code, str(folder)], check=False,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"overlay probe failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plan_for_tree(root: Path, aux=None) -> tuple[dict, dict]:
    """(facts, plan) for the vLLM under ``root`` (a directory holding ``vllm/``, or a
    wheel), read from its source without importing it."""
    aux = aux or _overlay_module(source_dir())
    facts = aux.release_facts(aux.base.Source(str(root)))
    return facts, aux.release_plan(facts)


def read_json_config(path: Path) -> dict:
    """A model's ``config.json``, given the file or its directory."""
    path = Path(path)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    return json.loads(path.read_text())


def aux_plan(draft_config: Path, num_layers: int | None = None,
             target_config: Path | None = None) -> dict:
    """The aux-id resolution for a draft (``resolve_aux_convention``): what the overlay logs
    at engine start, without vLLM or a GPU. ``num_layers`` (or the target config's
    ``num_hidden_layers``) checks the capture range; without either it is unchecked."""
    aux = _overlay_module(source_dir())
    if num_layers is None and target_config is not None:
        cfg = read_json_config(target_config)
        num_layers = cfg.get("num_hidden_layers", (cfg.get("text_config") or {}).get(
            "num_hidden_layers"))
        if num_layers is None:
            raise ValueError(f"{target_config}: no num_hidden_layers")
    return aux.resolve_aux_convention(read_json_config(draft_config), num_layers)


def not_patched(plan: dict) -> list[str]:
    """Plain sentences for every feature the plan leaves unpatched and unsupported."""
    scopes = {**plan["platforms"], "engine": plan["engine"]}
    return [f"{scope} {feature}: {e['detail']}" for scope, features in scopes.items()
            for feature, e in features.items() if e["action"] == "refused"]


def status(site: Path | None = None, probe: bool = False,
           draft_config: Path | None = None) -> dict:
    """vLLM version, the overlay's per-feature plan for it (per platform model module and
    engine-wide, read from vLLM's source), where the ``.pth`` is, what is not patched, the
    draft KV dtype and aux-id convention in force, and ``horizon``: a warning when vLLM is
    newer than the matrix. Imports no vLLM unless ``probe`` (a subprocess that imports the
    patched modules and reports what was applied)."""
    from speclab import releases

    tree = _vllm_tree()
    pths = _find_pths(site)
    ours = [p.parent / DIR_NAME for p in pths if p.name == PTH_NAME]
    folder = next((d for d in ours if all((d / f).is_file() for f in FILES)), None)
    aux = _overlay_module(folder or source_dir())
    base = aux.base
    loaded = bool(pths) or base.installed()
    facts, plan = plan_for_tree(tree.parent, aux) if tree else (None, None)
    version = facts["vllm"] if facts else None
    gaps = not_patched(plan) if plan else []
    if tree is None:
        support, detail = "none", "vLLM is not installed"
    elif not facts["models"]:
        support, detail = "none", f"vLLM {version} has no deepseek_v4 model"
    elif base.mode() == "off":
        support, detail = "none", f"overlay disabled ({base.MODE_ENV}=off): nothing is patched"
    elif not loaded:
        support, detail = "none", (f"vLLM {version} needs the overlay (id convention, draft "
                                   "cache config...), which is not installed: nothing is "
                                   "patched (speclab overlay install)")
    else:
        support, detail = "overlay", f"vLLM {version} with overlay {base.OVERLAY_VERSION}"
        if gaps:
            detail += f"; not patched: {len(gaps)} feature(s), see below"

    if probe and tree is not None:
        found = _probe(folder or source_dir())
        patches, source = found["patches"], "probe"
    elif base.PATCHES:
        patches, source = {k: dict(v) for k, v in base.PATCHES.items()}, "process"
    else:
        state = "planned" if support == "overlay" else "not applied"
        scopes = {**plan["platforms"], "engine": plan["engine"]} if plan else {}
        patches = {f"{name} ({scope})" if scope != "engine" else name:
                   {"target": target, "status": state, "detail": ""}
                   for scope, features in scopes.items()
                   for name, target in base.plan_patches(features).items()}
        source = "plan"

    env = os.environ.get(base.DTYPE_ENV, "").strip()
    if plan and plan["engine"]["draft-kv-dtype"]["action"] == "native":
        dtype = {"value": env or "auto", "source": (
            "speculative_config.kv_cache_dtype when set; else " +
            (base.DTYPE_ENV if env else "the overlay's default"))}
    else:
        dtype = {"value": env or "auto", "source": base.DTYPE_ENV if env else "default"}
    if draft_config is not None:
        convention = aux_plan(draft_config)
    else:
        convention = {"convention": os.environ.get(aux.CONVENTION_ENV) or None,
                      "why": (f"{aux.CONVENTION_ENV} is set" if os.environ.get(
                          aux.CONVENTION_ENV) else "resolved per draft at engine start "
                          "(speclab overlay plan --draft-config PATH)")}
    return {
        "vllm": {"version": version, "path": str(tree) if tree else None},
        "support": support,
        "support_detail": detail,
        "horizon": releases.horizon(version),
        "plan": plan,
        "not_patched": gaps,
        "facts": facts,
        "pth": [str(p) for p in pths],
        "overlay_dir": str(folder or source_dir()),
        "overlay_version": base.OVERLAY_VERSION,
        "mode": base.mode(),
        "draft_kv_cache_dtype": dtype,
        "aux_convention": convention,
        "patches": patches,
        "patches_source": source,
    }


def plan_table(plan: dict) -> list[str]:
    """The plan as text: one column per platform model module, engine-wide features below."""
    platforms = list(plan["platforms"])
    features = list(next(iter(plan["platforms"].values()), {}))
    rows = [["feature", *platforms]]
    rows += [[f, *(plan["platforms"][p][f]["action"] for p in platforms)] for f in features]
    engine = [[f, f"{e['action']} (engine-wide)"] for f, e in plan["engine"].items()]
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    width[0] = max(width[0], *(len(r[0]) for r in engine))  # engine rows span the platforms
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip()
            for r in rows + engine]


def format_status(st: dict) -> str:
    """Human-readable ``status()``."""
    v = st["vllm"]
    lines = [
        f"vLLM            {v['version'] or 'not installed'}"
        + (f"  ({v['path']})" if v["path"] else ""),
        f"DeepSeek-V4     EAGLE-3 {st['support']}: {st['support_detail']}",
        *([f"warning         {st['horizon']}"] if st["horizon"] else []),
        f".pth            {', '.join(st['pth']) or 'not installed'}",
        f"overlay         {st['overlay_version']} in {st['overlay_dir']}  (mode {st['mode']})",
        (f"draft KV dtype  {st['draft_kv_cache_dtype']['value'] or '-'}"
         f"  ({st['draft_kv_cache_dtype']['source']})"),
        (f"aux-id conv.    {st['aux_convention'].get('convention') or '-'}"
         f"  ({st['aux_convention']['why']})"),
    ]
    if st["plan"]:
        lines += ["plan (per feature; read from vLLM's source):", *plan_table(st["plan"])]
        if st["support"] == "none":
            lines.append(f"not patched:    everything ({st['support_detail']})")
        else:
            lines.append("not patched:" + ("" if st["not_patched"] else "    nothing"))
        lines += [f"  {gap}" for gap in st["not_patched"]]
    lines.append(f"patches ({st['patches_source']}):")
    width = max((len(k) for k in st["patches"]), default=0)
    for name, p in st["patches"].items():
        detail = f"  {p['detail']}" if p.get("detail") else ""
        lines.append(f"  {name:<{width}}  {p['status']:<12} {p['target']}{detail}")
    return "\n".join(lines)
