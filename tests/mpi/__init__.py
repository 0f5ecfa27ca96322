"""Multi-rank tests (``@pytest.mark.mpi``), all in one job:
``mpirun -n 8 python -m pytest -q --only-mpi tests/mpi``."""
