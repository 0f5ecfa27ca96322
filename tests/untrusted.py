"""Runs of mpipar's programs for the tests of untrusted inputs. In process: the exit status and
what the run printed to stderr, without launching a job (a launched run costs seconds on a
2-core CI; the refusals these tests show happen before any collective, so one process shows
them); a launched multi-rank run checks the same on every rank where it matters. Also: the flags
of a tiny run, what an earlier run left in its directory, a snapshot of the files that must
not change, and a crafted checkpoint sealed again (:func:`reseal`)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
from pathlib import Path

import h5py
from mpi4py import MPI

from mpipar.checkpoint.directory import sha256_file

_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _run(main, argv: list[str], out: io.StringIO | None = None) -> tuple[int, str]:
    """(exit status, stderr) of ``main(argv, MPI.COMM_SELF)`` (its stdout into ``out``); the
    abort hook and the signal handlers a program installs are put back afterwards. An exception
    other than SystemExit escapes (a traceback is a failure of the test)."""
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    hook = sys.excepthook
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out or io.StringIO()):
            try:
                code = main(argv, MPI.COMM_SELF)
            except SystemExit as exc:
                code = exc.code
    finally:
        sys.excepthook = hook
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return code, err.getvalue()


def run_train(argv: list[str], out: io.StringIO | None = None) -> tuple[int, str]:
    """``python -m mpipar.train ARGV`` on one rank, in this process: (status, stderr); its
    stdout into ``out``."""
    from mpipar import train
    return _run(train.main, argv, out)


def run_generate(argv: list[str]) -> tuple[int, str]:
    """``python -m mpipar.generate ARGV`` on one rank, in this process: (status, stderr)."""
    from mpipar import generate
    return _run(generate.main, argv)


RUN = ["--seq-len", "8", "--global-batch-size", "2", "--steps", "3", "--backend", "numpy",
       "--log-every", "0", "--tensorboard", "off"]
TINY = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", *RUN]
"""A fresh run's flags; a resumed one takes the model from its checkpoint (:data:`RUN`)."""


def earlier_run(run_dir, steps: int = 50) -> None:
    """What an earlier run left in ``run_dir``: its metrics, config and summaries."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as fh:
        for k in range(1, steps + 1):
            fh.write(json.dumps({"step": k, "loss": 5.0 - k / 100}) + "\n")
    for name in ("config.toml", "summary.json", "summary.txt"):
        with open(os.path.join(run_dir, name), "w") as fh:
            fh.write(f"the earlier run's {name}\n")


def snapshot(root) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes (what must not change), but the run locks (a
    ``lock`` file names the last run that held it, whatever it did)."""
    return {os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(root) for n in names if n != "lock"}


def reseal(ck: Path) -> None:
    """Record every shard's present size and sha256 in the index, and the index's sha256: what
    an attacker who writes the whole directory does."""
    with h5py.File(ck / "index.h5", "r+") as f:
        shards = f.get("shards", getlink=True)
        if isinstance(shards, h5py.HardLink) and isinstance(f["shards"], h5py.Group):
            for name in f["shards"]:
                try:
                    g, file = f["shards"][name], ck / name
                    if file.exists():
                        g.attrs["sha256"], g.attrs["size"] = sha256_file(file), file.stat().st_size
                except (KeyError, OSError, RuntimeError, TypeError, AttributeError):
                    pass  # a member the mutation made a link or a dataset
    (ck / "index.sha256").write_text(f"{sha256_file(ck / 'index.h5')}  index.h5\n")


def run_bounded(argv: list[str], cwd, memory: int = 3 << 30, timeout: float = 120
                ) -> tuple[int, str, float]:
    """``python ARGV`` in a child whose address space is capped at ``memory`` bytes
    (``RLIMIT_AS``) and whose wall time at ``timeout`` seconds: (status, stderr, seconds). An
    input that makes a program allocate what it declares fails here instead of in the node's
    OOM killer."""
    import resource
    import subprocess
    import time

    from conftest import launch_env

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    start = time.monotonic()
    done = subprocess.run([sys.executable, *argv], cwd=cwd, env=launch_env(), capture_output=True,
                          text=True, timeout=timeout, preexec_fn=cap)
    return done.returncode, done.stderr, time.monotonic() - start
