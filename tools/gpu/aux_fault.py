#!/usr/bin/env python3
"""Fault injection for the layer rig's `neg-stream0` arm (device only; never part of a result
that claims to be correct).

The overlay reduces each captured [T, hc_mult, H] residual stream with the module-level
function `deepseek_v4_eagle3_aux.capture_aux(stream)` (the hc mean). With
`SPECLAB_AUX_FAULT=stream0` in the environment, `install()` replaces it by `stream[:, 0]`
(hyper-connection stream 0 instead of the mean) as soon as the overlay module is imported,
before vLLM builds a model, in every process (engine core included). Without the variable it
does nothing. An overlay without `capture_aux` ends the process (exit status 3) the moment
the fault would be applied: the arm then fails instead of silently running as a positive.

    python tools/gpu/aux_fault.py install --site "$SPECLAB_SITE"   # writes the .pth
    python tools/gpu/aux_fault.py uninstall --site "$SPECLAB_SITE"
"""

from __future__ import annotations

import argparse
import importlib.abc
import os
import shutil
import sys
from pathlib import Path

FAULT_ENV = "SPECLAB_AUX_FAULT"
MODULE = "deepseek_v4_eagle3_aux"
HOOK = "capture_aux"
FAULTS = {"stream0": lambda stream: stream[:, 0]}
DIR_NAME = "speclab_aux_fault"
# processed after the overlay's speclab-dsv4-eagle3-overlay.pth (site sorts .pth names)
PTH_NAME = "zz-speclab-aux-fault.pth"
PTH_TEXT = f"{DIR_NAME}\nimport aux_fault; aux_fault.install()\n"


def fault() -> str | None:
    """The requested fault (None: no fault); an unknown name raises."""
    name = os.environ.get(FAULT_ENV, "").strip()
    if name and name not in FAULTS:
        raise ValueError(f"{FAULT_ENV}={name!r}: known faults {sorted(FAULTS)}")
    return name or None


def apply(module, name: str) -> None:
    if not callable(getattr(module, HOOK, None)):
        # .pth lines and the overlay's own loader swallow exceptions: exit instead
        print(f"speclab aux fault: {FAULT_ENV}={name}, but {module.__name__} has no "
              f"{HOOK}(stream) to replace; this overlay cannot run the fault arm",
              file=sys.stderr, flush=True)
        os._exit(3)
    module.capture_aux = FAULTS[name]
    module._speclab_aux_fault = name
    print(f"speclab aux fault: {module.__name__}.{HOOK} -> {name} (pid {os.getpid()})",
          file=sys.stderr, flush=True)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds MODULE with the other finders and applies the fault right after it executes."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    apply(module, self.name)

                spec.loader.exec_module = exec_module
                return spec
        return None


def install() -> None:
    """Apply the fault now (overlay already imported) or when the overlay is imported."""
    name = fault()
    if name is None:
        return
    if MODULE in sys.modules:
        apply(sys.modules[MODULE], name)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name))


def write_pth(site: Path) -> Path:
    """Copy this file to `<site>/speclab_aux_fault/` and write the .pth that loads it."""
    site = Path(site)
    (site / DIR_NAME).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(__file__, site / DIR_NAME / "aux_fault.py")
    (site / PTH_NAME).write_text(PTH_TEXT)
    return site / PTH_NAME


def remove_pth(site: Path) -> None:
    (Path(site) / PTH_NAME).unlink(missing_ok=True)
    shutil.rmtree(Path(site) / DIR_NAME, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["install", "uninstall"])
    ap.add_argument("--site", type=Path, default=os.environ.get("SPECLAB_SITE"),
                    help="site directory (default: $SPECLAB_SITE)")
    a = ap.parse_args(argv)
    if a.site is None:
        ap.error("no --site and no $SPECLAB_SITE")
    if a.action == "install":
        print(write_pth(a.site))
    else:
        remove_pth(a.site)
    return 0


if __name__ == "__main__":
    sys.exit(main())
