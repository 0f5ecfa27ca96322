"""MPI start-up under a deadline (:mod:`mpipar.runtime.mpi_init`), in process: the values
``MPIPAR_INIT_TIMEOUT`` takes. Launched ranks under the deadline: e2e/test_mpi_init.py."""
from __future__ import annotations

import pytest

from mpipar.runtime.mpi_init import DEFAULT_SECONDS, init_timeout


def test_init_timeout_values():
    assert init_timeout({}) == DEFAULT_SECONDS == 300.0
    assert init_timeout({"MPIPAR_INIT_TIMEOUT": " "}) == DEFAULT_SECONDS
    assert init_timeout({"MPIPAR_INIT_TIMEOUT": "0"}) == 0.0
    assert init_timeout({"MPIPAR_INIT_TIMEOUT": "12.5"}) == 12.5
    for bad in ("abc", "-1", "inf", "nan", "1e999"):
        with pytest.raises(ValueError, match=rf"MPIPAR_INIT_TIMEOUT='{bad}': must be a number of "
                                             r"seconds >= 0 \(0: no deadline for MPI_Init\)"):
            init_timeout({"MPIPAR_INIT_TIMEOUT": bad})
