"""MPI's initialisation under a deadline: the first import of ``mpi4py.MPI`` (``MPI_Init``).

A launch whose ranks cannot find each other (a lost PMI connection, an address exchange that
never completes) leaves every rank blocked inside ``MPI_Init`` for good, before any mpipar code
or watchdog runs, and a batch job then burns its whole allocation printing nothing. mpi4py
holds the GIL there, so no Python thread can notice; :mod:`faulthandler`'s watchdog is a C
thread that needs no GIL. Importing this module arms it for ``MPIPAR_INIT_TIMEOUT`` seconds
(default :data:`DEFAULT_SECONDS`; 0: no deadline) around the import: a rank still inside
``MPI_Init`` then prints ``Timeout (h:mm:ss)!`` and every thread's stack (naming
:func:`_initialise` below) and exits with status 1, so ``srun --kill-on-bad-exit`` or mpirun
ends the launch. The deadline is disarmed as soon as ``MPI_Init`` returns; later blocking is the
business of ``--collective-timeout`` (:class:`mpipar.runtime.comm.Watchdog`).

MPI start-up under ``srun --mpi=pmi2`` with the MPICH wheel fails now and then, also after a
probe launch went through. A training launch marks, through :func:`mark_started`, that every
rank came through it (the file ``MPIPAR_STARTED_FILE`` names, when set): the srun job scripts
launch again, up to three times, a launch that failed without it, which did nothing.

Every module imports ``MPI`` from here: an object that imports ``mpi4py.MPI`` (under the
deadline) when a program first reads one of its names, never when a module is imported; a
process that already initialised MPI is left alone. ``python -m mpipar.runtime.nodes``, the
job scripts' probe, which is nothing but start-up, runs whole under :func:`deadline` (its node
detection is the first traffic between the nodes). The variable is read before MPI
(and before any argument parsing), so a bad value is refused here: one message, status 2.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
from collections.abc import Iterator

VARIABLE = "MPIPAR_INIT_TIMEOUT"
DEFAULT_SECONDS = 300.0
"""Generous: MPI_Init of thousands of ranks takes seconds to a minute; a hang takes forever."""
RANK_VARS = ("PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def init_timeout(environ=os.environ) -> float:
    """Seconds allowed for ``MPI_Init`` (``MPIPAR_INIT_TIMEOUT``; 0: no deadline); a value
    that is not a number >= 0 raises ValueError naming it and the rule."""
    text = environ.get(VARIABLE, "").strip()
    if not text:
        return DEFAULT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{VARIABLE}={text!r}: must be a number of seconds >= 0 "
                         f"(0: no deadline for MPI_Init)")
    return seconds


def _launcher_rank(environ=os.environ) -> int:
    """This process's rank as its launcher exported it (0 when none did)."""
    for name in RANK_VARS:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return 0


@contextlib.contextmanager
def deadline() -> Iterator[None]:
    """Run the block under the ``MPIPAR_INIT_TIMEOUT`` deadline: past it, the process prints
    every thread's stack and exits with status 1. A bad value: one message, status 2."""
    try:
        seconds = init_timeout()
    except ValueError as error:
        if _launcher_rank() == 0:  # once per launch: no communicator exists yet
            print(f"mpipar: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        if seconds > 0:
            faulthandler.cancel_dump_traceback_later()


def _initialise() -> None:
    """Import ``mpi4py.MPI`` (``MPI_Init``) under the deadline."""
    if "mpi4py.MPI" in sys.modules:
        return
    with deadline():
        from mpi4py import MPI  # noqa: F401  (MPI_Init: past the deadline, this line is the stack)


STARTED_VARIABLE = "MPIPAR_STARTED_FILE"
"""A file for rank 0 to create once every rank of the launch is past MPI start-up: a job script
that finds it missing after a failed launch knows the launch did nothing, and launches again."""


def mark_started(rank: int, environ=os.environ) -> None:
    """Call after the first collective over the world has completed (every rank is past
    ``MPI_Init``): rank 0 creates the file ``$MPIPAR_STARTED_FILE`` names, when one is named
    (a warning, never an error, when it cannot)."""
    path = environ.get(STARTED_VARIABLE, "")
    if rank != 0 or not path:
        return
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        print(f"mpipar: warning: {STARTED_VARIABLE}={path!r}: cannot create it ({error}); a "
              f"job script may take a later failure for a failed start-up", file=sys.stderr,
              flush=True)


class _LazyMPI:
    """``mpi4py.MPI``, imported at the first attribute read (``MPI.COMM_WORLD``, ``MPI.SUM``,
    ...), which runs ``MPI_Init`` under the deadline (:func:`_initialise`). Modules import this
    object instead of ``mpi4py.MPI``, so importing one never starts MPI: the offline planner
    (``python -m mpipar.plan``) runs where no MPI library is installed. Each name read is then
    cached on the object."""

    def __getattr__(self, name: str):
        _initialise()
        from mpi4py import MPI as module
        value = getattr(module, name)
        setattr(self, name, value)
        return value

    def __repr__(self) -> str:
        return "<mpi4py.MPI, imported on first use by mpipar.runtime.mpi_init>"


MPI = _LazyMPI()

__all__ = ["MPI", "deadline", "init_timeout", "mark_started", "VARIABLE", "DEFAULT_SECONDS",
           "STARTED_VARIABLE"]
