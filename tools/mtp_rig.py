#!/usr/bin/env python3
"""MTP vs EAGLE-3 on the dial target with an MTP module (speclab.mtprig):

  python tools/mtp_rig.py expect [--out data/expected/mtp-dial-dsv4-h200.json]   # CPU
  python tools/mtp_rig.py check data/runs/RUN    # writes RUN/mtp_check.json; rc 1 unless exact"""

import sys

from speclab.mtprig import main

if __name__ == "__main__":
    sys.exit(main())
