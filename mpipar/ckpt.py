"""``python -m mpipar.ckpt``: look at, check and convert mpipar checkpoints (inspect, verify,
consolidate, export-hf, merge-adapter). The command line is :mod:`mpipar.checkpoint.cli`'s."""
from __future__ import annotations

import sys

from mpipar.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
