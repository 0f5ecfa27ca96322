"""Sums under each MPI all-reduce algorithm on 8 ranks (:mod:`mpipar.runtime.allreduce`, forced
through MPICH's control variables at run time): blocking and non-blocking, in float64, every rank
holds the same sum, within the documented tolerance of the exact sum; ``auto`` with a table
writes the fastest algorithm for each size before the call."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import assert_all_ranks

ALGORITHMS = ("auto", "ring", "tree", "rabenseifner")


@pytest.mark.mpi(min_size=8)
def test_every_algorithm_sums_to_the_exact_sum(world):
    """Each algorithm adds the 8 terms in its own order: |sum - exact| <= (n - 1) eps sum|x_i|
    per element (n - 1 roundings of partial sums no larger than sum|x_i|); exact: math.fsum of
    every rank's terms."""
    from mpi4py import MPI
    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("forces the algorithm through MPICH's control variables")
    from mpipar.runtime.allreduce import MpiT
    from mpipar.runtime.comm import Group, Ledger

    mpit, group = MpiT(), Group(world, "dp_sp", Ledger())
    rng = np.random.default_rng(40 + world.rank)
    n = 3 * 4096 + 5                                  # not a multiple of the group
    x = rng.normal(size=n) * 10.0 ** rng.uniform(-8, 8, n)
    terms = np.array(world.allgather(x))
    exact = np.array([math.fsum(col) for col in terms.T])
    bound = (world.size - 1) * np.finfo(np.float64).eps * np.abs(terms).sum(axis=0)
    fails, sums = [], {}
    for algorithm in ALGORITHMS:
        mpit.set_algorithm(algorithm)
        held = mpit.algorithm()
        if algorithm != "auto" and held["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"] == "auto":
            fails.append(f"{algorithm}: not set")
        blocking = group.allreduce_(x.copy())
        nonblocking = x.copy()
        group.iallreduce_(nonblocking).wait()
        for how, got in (("allreduce", blocking), ("iallreduce", nonblocking)):
            worst = np.max(np.abs(got - exact) / bound)
            if worst > 1:
                fails.append(f"{algorithm} {how}: {worst:.3g} x the bound")
            if not all(np.array_equal(got, o) for o in world.allgather(got)):
                fails.append(f"{algorithm} {how}: ranks differ")
        sums[algorithm] = blocking
    mpit.set_algorithm("auto")
    assert_all_ranks(world, fails)


@pytest.mark.mpi(min_size=8)
def test_auto_with_a_table_sets_the_fastest_per_size(world):
    from mpi4py import MPI
    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("writes MPICH's control variables")
    from mpipar.runtime import allreduce as ar
    from mpipar.runtime.comm import Group, Ledger

    table = {"ring": {1024: 2.0, 2**20: 1.0}, "tree": {1024: 1.0, 2**20: 2.0}}
    group, fails = Group(world, "dp_sp", Ledger()), []
    ar.ACTIVE = ar.SizeChoice(table, ar.MpiT())
    try:
        for count, want in ((100, "tree"), (2**18, "ring"), (10, "tree")):
            got = group.allreduce_(np.full(count, world.rank, np.float64))
            if not np.all(got == 28):
                fails.append(f"{count}: wrong sum")
            held = ar.ACTIVE.mpit.algorithm()["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"]
            if held != ar.MPICH_NAMES[want]["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"]:
                fails.append(f"{count * 8} bytes: MPICH holds {held}, want {want}")
    finally:
        ar.ACTIVE.mpit.set_algorithm("auto")
        ar.ACTIVE = None
    assert_all_ranks(world, fails)
