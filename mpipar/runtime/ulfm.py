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

A process that stops answering without dying (SIGSTOP, a hung node) ends no connection, so
nothing fails by itself. :func:`preset` turns on Open MPI's heartbeat failure detector before
``MPI_Init`` (its MCA parameters ``mpi_ft_detector*``, from a thread of its own, so a rank busy
computing keeps beating): a process silent for half of ``--collective-timeout`` is declared
failed, and the survivors' calls fail as for a dead one. A rank declared failed may still be
alive (SIGCONT would wake it): after the shrink, a survivor on its node kills it
(:func:`fence`), so that it writes nothing more and the launcher can end. A silent process on
another node is left to the launcher. A rank that goes on beating but never reaches the next
collective (a deadlock of its own) is not failed in ULFM's eyes: the survivors could not shrink
without it, so the watchdog ends the job with the failure report, as under ``abort``.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Iterable, MutableMapping

from mpipar.runtime.mpi_init import MPI

FT_VARIABLE = "mpi_ft_enable"
"""Open MPI's MCA parameter (an MPI_T control variable) that turns ULFM on."""

LAUNCH = "mpirun --with-ft ulfm --mca btl tcp,self"
"""How Open MPI 5 is launched for ULFM (the flags the docs and the refusal name)."""


DETECTOR_SHARE = 0.5
"""The heartbeat detector's timeout as a share of ``--collective-timeout``: a silent rank is
declared failed before the watchdog would end the job."""


def detector_controls(collective_timeout: float) -> dict[str, str]:
    """Open MPI's heartbeat detector settings for ``--collective-timeout`` seconds (none when
    0: no timeout, no detector); a beat every quarter of its timeout (Open MPI wants more than
    three beats a timeout)."""
    if not collective_timeout > 0:
        return {}
    timeout = DETECTOR_SHARE * collective_timeout
    return {"OMPI_MCA_mpi_ft_detector": "true", "OMPI_MCA_mpi_ft_detector_thread": "true",
            "OMPI_MCA_mpi_ft_detector_timeout": f"{timeout:g}",
            "OMPI_MCA_mpi_ft_detector_period": f"{timeout / 4:g}"}


def early_settings(argv: list[str]) -> tuple[str, float]:
    """``--on-rank-failure`` and ``--collective-timeout`` of a command line (or ``[train]`` of
    its ``--config`` TOML file), read before MPI starts; a value the full parser refuses reads
    as ("abort", 0.0)."""
    import argparse
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--on-rank-failure", default=None)
    parser.add_argument("--collective-timeout", default=None)
    parser.add_argument("--config", default=None)
    args, _ = parser.parse_known_args(argv)
    train: dict = {}
    if args.config:
        try:
            import tomllib
            with open(args.config, "rb") as fh:
                train = dict(tomllib.load(fh).get("train", {}))
        except (OSError, ValueError):
            train = {}   # the full parser reports the file
    mode = args.on_rank_failure or train.get("on_rank_failure", "abort")
    timeout = args.collective_timeout or train.get("collective_timeout", 0.0)
    try:
        return str(mode), float(timeout)
    except (TypeError, ValueError):
        return str(mode), 0.0


def preset(argv: list[str], environ: MutableMapping[str, str] = os.environ) -> None:
    """Before ``MPI_Init``: under ``--on-rank-failure shrink`` with a ``--collective-timeout``,
    the heartbeat detector's settings into ``environ`` (a value set already stays)."""
    mode, timeout = early_settings(argv)
    if mode == "shrink":
        for key, value in detector_controls(timeout).items():
            environ.setdefault(key, value)


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


def peers(comm: MPI.Comm) -> list[tuple[str, int]]:
    """(node name, process id) of every rank of ``comm`` (a collective)."""
    return comm.allgather((MPI.Get_processor_name(), os.getpid()))


def fence(failed: list[int], peers: list[tuple[str, int]], me: int) -> list[int]:
    """Kill the processes of the ``failed`` ranks (old numbering) that run on this node, when
    this rank is the first survivor there (``peers``: every old rank's node and process id,
    ``me``: this rank's old number); returns the ranks it killed. A process gone already is
    skipped."""
    node = peers[me][0]
    survivors = [r for r, (name, _) in enumerate(peers) if name == node and r not in failed]
    if not survivors or survivors[0] != me:
        return []
    killed = []
    for r in failed:
        name, pid = peers[r]
        if name != node or pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(r)
        except (ProcessLookupError, PermissionError):
            pass
    return killed


def peers_lost(comm: MPI.Comm) -> bool:
    """Whether some other process of ``comm`` is known to have failed (local; False where the
    MPI cannot say). A survivor then ends a failed job itself (:func:`leave`) instead of calling
    ``MPI_Abort``: Open MPI 5's ``mpirun`` with ULFM reported exit 0 for a job whose last live
    process called ``MPI_Abort(1)``, and, about one run in four on the test machine, never
    ended a job whose survivor called it after a process had died (the survivors gone, the
    launcher waiting for good). The other survivors' calls fail on the one that left, and they
    end the same way, in turn."""
    if comm.Get_size() == 1:
        return False
    try:
        return comm.Get_failed().Get_size() > 0
    except Exception:   # no ULFM (MPICH's wheel, Open MPI without it): MPI_Abort as ever
        return False


def leave(code: int) -> None:
    """End this process with ``code`` without ``MPI_Finalize``: after a process of the job
    has died, Open MPI 5's finalize waits now and then for the dead process in its closing
    fence, for good, and with the heartbeat detector on (:func:`preset`) a run with no failure
    at all was seen spinning in it. The survivors have passed a last barrier by then; output
    is flushed first."""
    import os
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
