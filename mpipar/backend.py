"""Where the arithmetic runs: CPU thread budgets per rank.

Ranks that share a node share its cores: ``configure_threads`` gives each rank
``cores // ranks_on_this_node`` threads for BLAS, OpenMP and Numba. It sets environment variables,
so it must run before NumPy or Numba are imported (``python -m mpipar.train`` does this); a
variable the user already set wins.
"""
from __future__ import annotations

import os

from mpi4py import MPI

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def local_size_from_env() -> int | None:
    """Ranks on this node as the launcher says (MPICH/Hydra, Open MPI, MVAPICH), or None."""
    for var in LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def local_ranks(comm: MPI.Comm = MPI.COMM_WORLD) -> tuple[int, int]:
    """(this rank's index among the ranks of its node, how many ranks share the node)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def configure_threads(comm: MPI.Comm | None = MPI.COMM_WORLD) -> int:
    """Split this node's cores among its ranks; returns the threads per rank.

    The launcher's environment is used when it tells the ranks per node; otherwise ``comm`` is
    split by node (a collective), and with ``comm=None`` a lone process is assumed."""
    ranks = local_size_from_env()
    if ranks is None:
        ranks = local_ranks(comm)[1] if comm is not None else 1
    threads = max(1, cpu_count() // ranks)
    for var in THREAD_VARS:
        os.environ.setdefault(var, str(threads))
    return int(os.environ["NUMBA_NUM_THREADS"])

