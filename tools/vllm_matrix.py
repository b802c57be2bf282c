"""Rebuild the overlay's compatibility matrix from the official vLLM wheels.

    python tools/vllm_matrix.py              # every release in speclab.vllm_matrix.RELEASES
    python tools/vllm_matrix.py 0.35.0       # add (or refresh) releases in the committed matrix
    python tools/vllm_matrix.py --all        # every release >= 0.21.0 on the package index

Writes data/vllm_matrix.json, data/vllm_matrix.md and the plan table of overlay/README.md.
Not run in CI: each release is a ~240-300 MB download the first time (cached in
$SPECLAB_CACHE/wheels; --delete-wheels removes each one once read). A new vLLM release is
this one command, adding it to RELEASES and a review of the diff;
tests/test_overlay_matrix.py then holds the overlay's plan against the committed matrix.
"""

from __future__ import annotations

import argparse
import sys

from speclab import progress, vllm_matrix


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="*", help="releases to add (default: all of RELEASES)")
    ap.add_argument("--all", action="store_true",
                    help=f"every release >= {vllm_matrix.FIRST} on the package index "
                         "(pip index versions vllm)")
    ap.add_argument("--delete-wheels", action="store_true",
                    help="delete each wheel from the cache once its facts are read")
    a = ap.parse_args(argv)
    progress.log_to_stdout()  # one line per release read
    if a.all and a.versions:
        ap.error("--all reads every release: give no versions with it")
    previous = vllm_matrix.load() if a.versions and vllm_matrix.MATRIX_JSON.is_file() else None
    versions = (vllm_matrix.index_releases() if a.all
                else a.versions or list(vllm_matrix.RELEASES))
    matrix = vllm_matrix.build(versions, previous, a.delete_wheels)
    vllm_matrix.write(matrix)
    print(f"wrote {vllm_matrix.MATRIX_JSON}, {vllm_matrix.MATRIX_MD} and the plan table of "
          f"{vllm_matrix.README}")
    missing = [v for v in matrix["releases"] if v not in vllm_matrix.RELEASES]
    if missing:
        print(f"add {', '.join(missing)} to speclab.vllm_matrix.RELEASES", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
