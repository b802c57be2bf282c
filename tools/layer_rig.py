#!/usr/bin/env python3
"""The layer-exact rig's expectations and run checks (speclab.layerrig):

  python tools/layer_rig.py expect [--out data/expected/layer-rig-dsv4-k3.json]   # CPU
  python tools/layer_rig.py check ARM data/runs/RUN    # writes RUN/expected_check_ARM.json"""

import sys

from speclab.layerrig import main

if __name__ == "__main__":
    sys.exit(main())
