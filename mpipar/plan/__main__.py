"""``python -m mpipar.plan``: see :mod:`mpipar.plan.cli`."""
import sys

from mpipar.plan.cli import main

sys.exit(main())
