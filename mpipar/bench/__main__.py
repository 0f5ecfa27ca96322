"""``python -m mpipar.bench``: see :mod:`mpipar.bench.sections`."""
import sys

from mpipar.bench.sections import main

sys.exit(main())
