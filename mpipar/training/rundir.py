"""The directories a training run writes into, claimed before step 1 so that no work is lost.

:func:`prepare_outputs` (every rank, before anything is allocated) creates every output
directory the run owns, with its parents, and proves each writable by creating and removing a
file: ``--run-dir``, ``--save-dir``, the parent of ``--export-hf`` (which must also be new, empty
or a previous export), ``RUN_DIR/activations`` with ``--dump-activations``, ``RUN_DIR/scratch``
with ``--recompute offload`` and the TensorBoard event directory (``--tensorboard``). A read-only
or file-typed target is a configuration error naming the flag, found before step 1 rather than
at the first save after the whole run has trained.

:class:`RunLock` (rank 0) holds an exclusive ``flock`` on ``RUN_DIR/lock`` and ``SAVE_DIR/lock``
for the whole run and writes its holder into them (host, pid, start time, command). A second run
in the same run or save directory exits 2 naming the holder. The kernel releases the lock when
the process ends however it ends (even SIGKILL), so a crashed run never leaves a stale lock; the
file itself stays, naming the last holder.

A fresh run (no ``--resume``) refuses a save directory that already holds checkpoints: saving
beside them would overwrite the same-numbered ones and point ``latest`` into a mix of two runs
(:func:`refuse_earlier_checkpoints`, rank 0, under the lock).
"""
from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from mpipar.config import Config, ConfigError

LOCK_FILE = "lock"


def output_dirs(cfg: Config) -> list[tuple[str, Path]]:
    """``(flag, directory)`` of every directory the run writes into (``save_dir`` resolved)."""
    tr = cfg.train
    run = Path(tr.run_dir)
    out = [("--run-dir", run), ("--save-dir", Path(tr.save_dir))]
    if tr.export_hf:
        out.append(("--export-hf", Path(tr.export_hf).absolute().parent))
    if cfg.dump_steps:
        out.append(("--dump-activations", run / "activations"))
    if tr.recompute == "offload":
        out.append(("--recompute offload", run / "scratch"))
    from mpipar.observe.tensorboard import log_dir
    events = log_dir(tr.tensorboard, tr.run_dir)
    if events:
        out.append(("--tensorboard", Path(events)))
    return out


def prepare_outputs(cfg: Config) -> None:
    """Create every output directory (with its parents) and prove it writable; check that
    ``--export-hf`` may be written. Raises ConfigError naming the flag and the path."""
    for flag, path in output_dirs(cfg):
        _create(flag, path)
        _probe(flag, path)
    if cfg.train.export_hf:
        from mpipar.checkpoint import huggingface as hf
        try:
            hf.check_export_target(cfg.train.export_hf)
        except ValueError as exc:
            raise ConfigError(f"--export-hf {cfg.train.export_hf}: {exc}") from None


def _create(flag: str, path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create the directory "
                          f"({exc.strerror or exc}: {exc.filename or path})") from None


def _probe(flag: str, path: Path) -> None:
    """Create and remove a file in ``path`` (a unique name per process)."""
    probe = path / f".mpipar-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: not writable ({exc.strerror or exc})") from None


class RunLock:
    """Exclusive locks on ``dirs`` (their ``lock`` files) for the lifetime of a run."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = list(dict.fromkeys(Path(d).resolve() for d in dirs))
        self._files: list = []

    def acquire(self) -> "RunLock":
        """Take every lock or none; ConfigError names the directory and the run holding it."""
        try:
            for d in self.dirs:
                self._files.append(_lock(d))
        except ConfigError:
            self.release()
            raise
        return self

    def release(self) -> None:
        for fh in self._files:
            fh.close()  # closing the file drops its flock
        self._files = []


def _lock(directory: Path):
    path = directory / LOCK_FILE
    try:
        fh = open(path, "a+")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be opened ({exc.strerror or exc})") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "a process that has not written its name yet"
        fh.close()
        raise ConfigError(f"{directory} is in use by another run ({holder}); wait for it to "
                          f"end, or choose another --run-dir / --save-dir") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on {socket.gethostname()} since "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.orig_argv)}\n")
    fh.flush()
    return fh


def refuse_earlier_checkpoints(cfg: Config) -> None:
    """A fresh run (no ``--resume``) must not save beside an earlier run's checkpoints."""
    from mpipar.checkpoint.directory import list_checkpoints
    tr = cfg.train
    found = list_checkpoints(tr.save_dir)
    if not tr.resume and found:
        raise ConfigError(f"--save-dir {tr.save_dir} holds checkpoints of an earlier run "
                          f"(newest {found[0].name}); a fresh run would overwrite them: use "
                          f"--resume auto to continue it, or a new --run-dir")
