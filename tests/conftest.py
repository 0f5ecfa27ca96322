"""Shared helpers for multi-rank tests.

A multi-rank test must never leave ranks waiting in a collective: each rank collects its own
failures, the failures are gathered, and every rank asserts on the union.
"""
from __future__ import annotations

import itertools
import os
import sys

import pytest

import mpipar.engine  # noqa: F401  (every component's configuration rules, for Config.validate)

# Tests that launch jobs use the mpirun installed beside this Python (the [mpich] extra).
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
needs_mpirun = pytest.mark.skipif(not os.path.exists(MPIRUN),
                                  reason="no mpirun beside this Python (install mpipar[mpich])")


def factorisations(n: int, parts: int = 4) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    out = []
    for combo in itertools.product(divisors, repeat=parts):
        prod = 1
        for c in combo:
            prod *= c
        if prod == n:
            out.append(combo)
    return out


def assert_all_ranks(comm, failures: list[str]) -> None:
    """Gather every rank's failure messages and fail on every rank if any rank failed."""
    everything = comm.allgather(failures)
    bad = [f"rank {r}: {m}" for r, msgs in enumerate(everything) for m in msgs]
    assert not bad, "\n".join(bad[:20])


@pytest.fixture
def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD
