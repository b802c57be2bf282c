# speclab GPU bundle: make the bundle directory a *site* directory.
#
# pack.sh copies this file to the top of the bundle (next to vllm/). The
# device puts that directory on PYTHONPATH (unpack.sh prints the export), so
# every Python process started with that environment -- `vllm serve`, its API
# server and engine-core subprocesses, multiprocessing spawn children -- imports
# this module at start-up (site.py imports `sitecustomize` after the standard
# site directories are set up).
#
# PYTHONPATH entries are plain path entries: Python does not read the `.pth`
# files in them. site.addsitedir() does, so this module calls it on its own
# directory. That activates
#   - nvidia_cutlass_dsl.pth (puts nvidia_cutlass_dsl/python_packages, where the
#     `cutlass` package lives, on sys.path), and
#   - any `.pth` overlay dropped here later, e.g. by
#     `speclab overlay install --site $SPECLAB_SITE`.
# The directory is already on sys.path, so addsitedir only processes the .pth
# files (paths they add go to the end of sys.path).
#
# Then it runs the next `sitecustomize` further down sys.path, if any (e.g. a
# distribution's), so that one is not silently shadowed. Nothing here may stop
# the interpreter from starting: errors are reported on stderr and ignored.
import os
import sys


def _speclab_activate() -> None:
    import site

    here = os.path.dirname(os.path.abspath(__file__))
    site.addsitedir(here)
    os.environ.setdefault("SPECLAB_SITE", here)

    import importlib.machinery
    import importlib.util

    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.origin and os.path.dirname(os.path.abspath(spec.origin)) != here:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)


try:
    _speclab_activate()
except Exception as exc:  # never break interpreter start-up
    print(f"speclab sitecustomize: {exc!r}", file=sys.stderr)
del _speclab_activate
