"""A failing rank's last words, made durable: ``RUN_DIR/failure.txt`` and ``summary.json``.

When one rank must end the whole job (an uncaught exception, the collective watchdog, a stop
signal before the first step) it calls :meth:`FailureReport.abort`. ``MPI_Abort`` makes the
launcher tear every process down, and a launcher may drop output it has not yet forwarded (seen
with MPICH's hydra: the whole stderr of an aborted job lost about one run in ten). So before
aborting, the rank:

1. appends one JSON line to ``RUN_DIR/failure.txt`` (``rank``, ``exit``, ``kind``, ``message``,
   ``time``), under an exclusive lock, and fsyncs it: this is the report that cannot be lost;
2. rewrites ``RUN_DIR/summary.json`` as ``status: "failed"`` with every line of
   ``failure.txt`` so far (written through a rename: never half a file);
3. writes the message to stderr unbuffered;
4. waits :data:`ABORT_GRACE_S` so the launcher can forward stderr, then aborts (a process of
   a job that outlived a dead rank under ULFM exits with the status itself, and the other
   survivors follow as their calls fail on it: :func:`mpipar.runtime.ulfm.peers_lost`).

Before the run directory is known (config still being read) only steps 3 and 4 happen. A stop
that is not an abort (``--on-nan stop``) records its line with :meth:`FailureReport.record`.
Every run (resumed or not) removes a stale ``failure.txt`` (:meth:`FailureReport.attach` on
rank 0), so the file, when present, describes the latest run in that directory.
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from mpipar.runtime import ulfm
from mpipar.runtime.mpi_init import MPI

FAILURE_FILE = "failure.txt"
SUMMARY_FILE = "summary.json"
ABORT_GRACE_S = 1.0  # seconds between writing a failing rank's report and MPI_Abort

# Exit statuses of the programs (the README's table), the same on every rank.
EXIT_USAGE = 2
EXIT_NONFINITE = 3
EXIT_WATCHDOG = 4
EXIT_EXCEPTION = 1


class FailureReport:
    """Where this rank reports a failure that ends the run (see the module docstring)."""

    def __init__(self, comm: MPI.Comm | None = None) -> None:
        comm = MPI.COMM_WORLD if comm is None else comm
        self.comm = comm
        self.rank = comm.Get_rank()
        self.run_dir: str | None = None
        self.in_flight: Callable[[], str | None] = lambda: None
        """What this rank has in flight beyond the failing call (an asynchronous checkpoint
        write: :meth:`mpipar.checkpoint.background.AsyncSaver.describe`), added to a report."""

    def attach(self, run_dir: str, fresh: bool) -> None:
        """From now on reports also go to ``run_dir``; ``fresh`` (rank 0, before any collective)
        removes an earlier run's report first."""
        self.run_dir = run_dir
        if fresh:
            try:
                os.remove(os.path.join(run_dir, FAILURE_FILE))
            except FileNotFoundError:
                pass

    def record(self, kind: str, message: str, code: int) -> list[dict[str, Any]]:
        """Append this rank's line to ``failure.txt`` (fsynced) and mark ``summary.json`` as
        failed; returns every line of the file. Does nothing before :meth:`attach`. Never
        raises: a report that cannot be written must not hide the failure it reports."""
        if self.run_dir is None:
            return []
        line = {"rank": self.rank, "exit": code, "kind": kind, "message": message,
                "time": time.time()}
        in_flight = self._in_flight()
        if in_flight:
            line["in_flight"] = in_flight
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, FAILURE_FILE), "a+") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)  # one writer at a time: whole lines, a whole summary
                fh.write(json.dumps(line) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
                fh.seek(0)
                lines = read_lines(fh.read())
                _write_failed_summary(self.run_dir, lines)
            return lines
        except OSError as exc:
            os.write(2, f"mpipar: rank {self.rank}: could not write {FAILURE_FILE} in "
                        f"{self.run_dir}: {exc}\n".encode())
            return []

    def _in_flight(self) -> str | None:
        try:
            return self.in_flight()
        except Exception:  # a report must not fail on its context
            return None

    def abort(self, kind: str, message: str, code: int) -> NoReturn:
        """Report ``message`` durably and on stderr, give the launcher time to forward it, then
        abort every rank with exit status ``code``."""
        self.record(kind, message, code)
        in_flight = self._in_flight()
        if in_flight:
            message = f"{message.rstrip()}\nmpipar: rank {self.rank}: {in_flight}"
        sys.stderr.flush()
        os.write(2, (message.rstrip("\n") + "\n").encode())
        time.sleep(ABORT_GRACE_S)
        if ulfm.peers_lost(self.comm):   # MPI_Abort is not to be trusted (module docstring)
            ulfm.leave(code)
        self.comm.Abort(code)
        raise SystemExit(code)  # unreachable: MPI_Abort does not return


def read_lines(text: str) -> list[dict[str, Any]]:
    """The records of a ``failure.txt`` text (a torn last line, from a crash, is skipped)."""
    out = []
    for raw in text.splitlines():
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return out


def read(run_dir: str) -> list[dict[str, Any]]:
    """The failure records of ``run_dir`` (empty when the latest run reported none)."""
    try:
        with open(os.path.join(run_dir, FAILURE_FILE)) as fh:
            return read_lines(fh.read())
    except FileNotFoundError:
        return []


def _write_failed_summary(run_dir: str, lines: list[dict[str, Any]]) -> None:
    """``summary.json`` of a run that failed: what failed, where, and how far it got."""
    from mpipar.observe.metrics import write_json
    first = lines[0] if lines else {}
    summary = {
        "status": "failed",
        "exit_code": first.get("exit"),
        "failure": f"rank {first.get('rank')}: {first.get('kind')}",
        "failures": lines,
        "last_step": _last_logged_step(run_dir),
    }
    write_json(os.path.join(run_dir, SUMMARY_FILE), summary)


def _last_logged_step(run_dir: str) -> int:
    """The last step in ``metrics.jsonl`` (0 if none; a torn last line is ignored)."""
    step = 0
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            for record in read_lines(fh.read()):
                step = record.get("step", step)
    except FileNotFoundError:
        pass
    return step


def install_abort_hook(report: FailureReport) -> None:
    """Make an uncaught exception on any rank abort the whole job (never a hang), reported
    durably first (:class:`FailureReport`)."""

    def hook(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        report.abort("exception", f"mpipar: rank {report.rank} failed; aborting all ranks\n{text}",
                     EXIT_EXCEPTION)

    sys.excepthook = hook


def fail_usage(message: str, comm: MPI.Comm | None = None) -> None:
    """Print the error once (rank 0) and exit 2 on every rank, without any collective."""
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_rank() == 0:
        sys.stderr.write(f"mpipar: error: {message}\n")
        sys.stderr.flush()
    raise SystemExit(EXIT_USAGE)
