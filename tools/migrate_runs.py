"""Bring run folders to the current layout (store.migrate): point files from points/ to
results/, request files rewritten as store.RequestRecord rows.

    python tools/migrate_runs.py data/runs/*/
"""

import sys
from pathlib import Path

from speclab import store

if __name__ == "__main__":
    for run in map(Path, sys.argv[1:]):
        if (run / "points").is_dir():
            print(f"{run}: {store.migrate(run)} file(s) changed")
