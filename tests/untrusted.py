"""In-process runs of mpipar's programs for the tests of untrusted inputs: the exit status and
what the run printed to stderr, without launching a job (a launched run costs seconds on a
2-core CI; the refusals these tests show happen before any collective, so one process shows
them). A launched multi-rank run checks the same on every rank where it matters."""
from __future__ import annotations

import contextlib
import io
import signal
import sys

from mpi4py import MPI

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _run(main, argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of ``main(argv, MPI.COMM_SELF)``; the abort hook and the signal
    handlers a program installs are put back afterwards. An exception other than SystemExit
    escapes (a traceback is a failure of the test)."""
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    hook = sys.excepthook
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv, MPI.COMM_SELF)
            except SystemExit as exc:
                code = exc.code
    finally:
        sys.excepthook = hook
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return code, err.getvalue()


def run_train(argv: list[str]) -> tuple[int, str]:
    """``python -m mpipar.train ARGV`` on one rank, in this process: (status, stderr)."""
    from mpipar import train
    return _run(train.main, argv)


def run_generate(argv: list[str]) -> tuple[int, str]:
    """``python -m mpipar.generate ARGV`` on one rank, in this process: (status, stderr)."""
    from mpipar import generate
    return _run(generate.main, argv)
