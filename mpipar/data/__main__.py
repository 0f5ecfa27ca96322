"""``python -m mpipar.data``: see :mod:`mpipar.data.cli`."""
import sys

from mpipar.data.cli import main

sys.exit(main())
