"""User-Level Failure Mitigation (ULFM): the MPI calls that let a run outlive a dead rank.

Under an MPI with ULFM a process that dies (SIGKILL, a lost node) does not end the job: a call
of the survivors that involves it fails with the error class ``MPI_ERR_PROC_FAILED`` (or
``MPI_ERR_REVOKED`` once a survivor has revoked the communicator). The survivors then
:func:`revoke` every communicator they hold (so no rank stays blocked in one), :func:`shrink` the
world to themselves (a collective of the survivors that agrees on who is gone) and build their
ranks again on it (:mod:`mpipar.training.recovery`).

:func:`unsupported` says, at start-up, why this MPI cannot do it (None when it can). The rule,
read at run time from the library itself:

- Open MPI 5 has ULFM built in but enables it only when its MCA parameter ``mpi_ft_enable`` is
  set, which ``mpirun --with-ft ulfm`` does. It is read back through the MPI tool interface
  (``MPI_T_cvar_read``, :class:`mpipar.runtime.allreduce.MpiT`), so a value set in the
  environment or in an MCA parameter file counts alike. On this machine the survivors also
  needed ``--mca btl tcp,self`` (with the shared-memory transport they hung).
- Any other library: unsupported unless it exposes ``mpi_ft_enable`` as Open MPI does. MPICH's
  wheel (its ``MPI_ERR_PROC_FAILED`` and ``MPI_ERR_REVOKED`` are one and the same class, and a
  dead rank aborted its peers with an internal error) is refused.
"""
from __future__ import annotations

from collections.abc import Iterable

from mpipar.runtime.mpi_init import MPI

FT_VARIABLE = "mpi_ft_enable"
"""Open MPI's MCA parameter (an MPI_T control variable) that turns ULFM on."""

LAUNCH = "mpirun --with-ft ulfm --mca btl tcp,self"
"""How Open MPI 5 is launched for ULFM (the flags the docs and the refusal name)."""


def unsupported() -> str | None:
    """Why this MPI cannot keep the survivors of a dead rank running (None: it can; the module
    docstring says how that is read). Local: no collective."""
    version = MPI.Get_library_version().splitlines()[0].strip() or "unknown MPI"
    failed = getattr(MPI, "ERR_PROC_FAILED", None)
    revoked = getattr(MPI, "ERR_REVOKED", None)
    if failed is None or failed == revoked:
        return (f"{version} has no ULFM (MPI_ERR_PROC_FAILED is not a class of its own); "
                f"use Open MPI 5 launched as '{LAUNCH}'")
    from mpipar.runtime.allreduce import MpiT
    try:
        enabled = MpiT().read(FT_VARIABLE)
    except OSError:
        return (f"{version} has no ULFM control variable {FT_VARIABLE}; use Open MPI 5 "
                f"launched as '{LAUNCH}'")
    if not enabled:
        return (f"{version} was launched without ULFM ({FT_VARIABLE}=0); launch it as "
                f"'{LAUNCH}'")
    return None


def error_type() -> type[BaseException]:
    """The exception an MPI call raises (mpi4py's ``MPI.Exception``)."""
    return MPI.Exception


def revoke(comms: Iterable[MPI.Comm]) -> None:
    """Revoke each communicator: every survivor blocked in a call on it, or calling it later,
    gets ``MPI_ERR_REVOKED`` (one already revoked, or freed, is skipped)."""
    for comm in comms:
        if comm == MPI.COMM_NULL:
            continue
        try:
            comm.Revoke()
        except MPI.Exception:
            pass


def shrink(comm: MPI.Comm) -> tuple[MPI.Comm, list[int]]:
    """The survivors of ``comm`` as a new communicator (a collective of the survivors, in the
    order of their old ranks) and the old ranks of those gone, the same list on every survivor."""
    new = comm.Shrink()
    kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())),
                                     comm.Get_group())
    return new, sorted(set(range(comm.Get_size())) - set(kept))


def leave(code: int) -> None:
    """End this process with ``code`` without ``MPI_Finalize``: after a process of the job
    has died, Open MPI 5's finalize waits now and then for the dead process in its closing
    fence, for good. The survivors have passed a last barrier by then; output is flushed
    first."""
    import os
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
