"""Install, remove and inspect the DeepSeek-V4 EAGLE-3 overlay (see overlay/README.md).

The overlay is two modules loaded at every interpreter start by a ``.pth`` file:
``install()`` copies them into ``<site>/speclab_dsv4_overlay/`` and writes
``<site>/speclab-dsv4-eagle3-overlay.pth`` (a relative path line, so the site directory can
be moved or carried to another machine, and a guarded ``install()`` line). ``status()``
imports neither vLLM nor torch and needs no GPU; ``status(probe=True)`` runs one subprocess
that imports the patched vLLM modules and reports what the overlay did to them.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
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
MODEL_FILES = ("models/deepseek_v4/nvidia/model.py", "model_executor/models/deepseek_v4.py",
               "models/deepseek_v4/cpu/model.py", "models/deepseek_v4/amd/model.py")


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


def _vllm_version(tree: Path) -> str | None:
    for name in ("_version.py", "version.py"):
        text = (tree / name).read_text() if (tree / name).is_file() else ""
        found = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text)
        if found:
            return found.group(1)
    return None


def _declares_eagle3(path: Path) -> bool:
    """Whether ``class DeepseekV4ForCausalLM`` in ``path`` lists SupportsEagle3 as a base."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "DeepseekV4ForCausalLM":
            return any(getattr(b, "id", getattr(b, "attr", None)) == "SupportsEagle3"
                       for b in node.bases)
    return False


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


def _probe(folder: Path) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import deepseek_v4_eagle3_aux"
            " as m; m.install(); print(json.dumps(m.probe()))")
    done = subprocess.run([sys.executable, "-c", code, str(folder)], check=False,
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"overlay probe failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def status(site: Path | None = None, probe: bool = False) -> dict:
    """vLLM version, how DeepSeek-V4 gets EAGLE-3 (native | overlay | none), where the
    ``.pth`` is, the overlay's patches (applied in this process or a probe, else planned) and
    the draft KV dtype in force. Imports no vLLM unless ``probe``."""
    tree = _vllm_tree()
    version = _vllm_version(tree) if tree else None
    pths = _find_pths(site)
    ours = [p.parent / DIR_NAME for p in pths if p.name == PTH_NAME]
    folder = next((d for d in ours if all((d / f).is_file() for f in FILES)), None)
    aux = _overlay_module(folder or source_dir())
    base = aux.base
    models = {rel: _declares_eagle3(tree / rel) for rel in MODEL_FILES
              if tree and (tree / rel).is_file()}
    native = bool(models) and models.get(MODEL_FILES[0], models.get(MODEL_FILES[1], False))
    loaded = bool(pths) or base.installed()

    if tree is None:
        support, detail = "none", "vLLM is not installed"
    elif not models:
        support, detail = "none", f"vLLM {version} has no deepseek_v4 model"
    elif native:
        support, detail = "native", f"vLLM {version} declares SupportsEagle3 for DeepSeek-V4"
    elif base.mode() == "off":
        support, detail = "none", f"overlay disabled ({base.MODE_ENV}=off)"
    elif not (version or "").startswith(base.KNOWN_VLLM) and base.mode() != "force":
        support, detail = "none", (f"vLLM {version} is not 0.21.x/0.22.x: the overlay refuses "
                                   f"to patch it ({base.MODE_ENV}=force to try)")
    elif not loaded:
        support, detail = "none", (f"vLLM {version} needs the overlay, which is not installed "
                                   "(speclab overlay install)")
    else:
        support, detail = "overlay", f"vLLM {version} patched by overlay {base.OVERLAY_VERSION}"
        if not (version or "").startswith(base.KNOWN_VLLM):
            detail += f" (forced: {base.MODE_ENV}=force, untested version)"

    if probe and tree is not None:
        found = _probe(folder or source_dir())
        patches, source = found["patches"], "probe"
    elif support == "native":
        patches, source = {}, "native: nothing to patch"
    elif aux.PATCHES:
        patches, source = {k: dict(v) for k, v in aux.PATCHES.items()}, "process"
    else:
        state = "planned" if support == "overlay" else "not applied"
        patches = {k: {"target": t, "status": state, "detail": ""}
                   for k, t in aux.plan(version or "").items()}
        source = "plan"

    if support == "native":
        dtype = {"value": None, "source": "native option speculative_config['kv_cache_dtype']; "
                 "unset: the target's KV dtype"}
    elif support == "overlay":
        dtype = {"value": base.draft_kv_cache_dtype(),
                 "source": base.DTYPE_ENV if os.environ.get(base.DTYPE_ENV) else "default"}
    else:
        dtype = {"value": None, "source": "-"}
    return {
        "vllm": {"version": version, "path": str(tree) if tree else None},
        "support": support,
        "support_detail": detail,
        "model_files": models,
        "pth": [str(p) for p in pths],
        "overlay_dir": str(folder or source_dir()),
        "overlay_version": base.OVERLAY_VERSION,
        "mode": base.mode(),
        "draft_kv_cache_dtype": dtype,
        "patches": patches,
        "patches_source": source,
    }


def format_status(st: dict) -> str:
    """Human-readable ``status()``."""
    v = st["vllm"]
    lines = [
        f"vLLM            {v['version'] or 'not installed'}"
        + (f"  ({v['path']})" if v["path"] else ""),
        f"DeepSeek-V4     EAGLE-3 {st['support']}: {st['support_detail']}",
        f".pth            {', '.join(st['pth']) or 'not installed'}",
        f"overlay         {st['overlay_version']} in {st['overlay_dir']}  (mode {st['mode']})",
        (f"draft KV dtype  {st['draft_kv_cache_dtype']['value'] or '-'}"
         f"  ({st['draft_kv_cache_dtype']['source']})"),
        f"patches ({st['patches_source']}):",
    ]
    width = max((len(k) for k in st["patches"]), default=0)
    for name, p in st["patches"].items():
        detail = f"  {p['detail']}" if p.get("detail") else ""
        lines.append(f"  {name:<{width}}  {p['status']:<11} {p['target']}{detail}")
    return "\n".join(lines)
