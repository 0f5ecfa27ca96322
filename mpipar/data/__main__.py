"""``python -m mpipar.data``: see :mod:`mpipar.data.sources`."""
import sys

from mpipar.data.sources import main

sys.exit(main())
