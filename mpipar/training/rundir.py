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

A run never overwrites another run's outputs (:func:`refuse_earlier_run`, rank 0, under the
lock): a fresh run (no ``--resume``) refuses a save directory that already holds checkpoints
(saving beside them would overwrite the same-numbered ones and point ``latest`` into a mix of
two runs); ``--resume auto`` refuses one whose checkpoints all fail verification (it would start
fresh over them); a run resumed from another save directory refuses one that holds checkpoints;
and a fresh run (no ``--resume``) refuses a run directory whose ``metrics.jsonl`` holds steps
(it would replace the metrics, config and summaries of the run that wrote them, which saved
elsewhere). ``--resume auto`` with no committed checkpoint (a run stopped before its first
save, or during it, then requeued) begins again and sets an earlier ``metrics.jsonl`` aside as
``metrics.jsonl.N``, saying so in the log. A resumed run keeps the records of the steps it
resumes after, as always. A ``metrics.jsonl`` that cannot be read
back is refused too, before step 1 rather than at the first record.
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
    if tr.export_adapter:
        out.append(("--export-adapter", Path(tr.export_adapter).absolute().parent))
    if cfg.dump_steps:
        out.append(("--dump-activations", run / "activations"))
    if tr.recompute_mode.offloads:
        out.append((f"--recompute {tr.recompute}", run / "scratch"))
    from mpipar.observe.tensorboard import log_dir
    events = log_dir(tr.tensorboard, tr.run_dir)
    if events:
        out.append(("--tensorboard", Path(events)))
    return out


def prepare_outputs(cfg: Config) -> None:
    """Create every output directory (with its parents) and prove it writable; check that
    ``--export-hf`` may be written and that the model has a Hugging Face architecture to be
    exported as. Raises ConfigError naming the flag and the path or fields."""
    for flag, path in output_dirs(cfg):
        _create(flag, path)
        _probe(flag, path)
    if cfg.train.export_hf:
        from mpipar.checkpoint import huggingface as hf
        try:
            hf.check_export_target(cfg.train.export_hf)
            hf.model_type(cfg.model)
        except ValueError as exc:
            raise ConfigError(f"--export-hf {cfg.train.export_hf}: {exc}") from None
    if cfg.train.export_adapter:
        from mpipar.checkpoint import peft
        try:
            peft.check_export_target(cfg.train.export_adapter)
        except ValueError as exc:
            raise ConfigError(f"--export-adapter {cfg.train.export_adapter}: {exc}") from None


def _create(flag: str, path: Path) -> None:
    try:
        exists = path.exists() and not path.is_dir()
    except ValueError:  # a NUL in a path given on the command line or by the API
        raise ConfigError(f"{flag} {str(path)[:80]!r}: must not contain a NUL character") from None
    except OSError as exc:  # a name longer than the filesystem holds
        raise ConfigError(f"{flag} {path}: cannot create the directory "
                          f"({exc.strerror or exc}: {exc.filename or path})") from None
    if exists:
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


def refuse_earlier_run(cfg: Config) -> list[str]:
    """Refuse (ConfigError) a run that would overwrite another run's checkpoints
    (:func:`mpipar.checkpoint.reader.resume_policy`) or metrics (the module docstring); rank 0,
    under the lock. Returns notes for the log: the earlier metrics set aside when ``--resume
    auto`` restarts a run that never committed a checkpoint. Checkpoint verification is cached,
    so asking which checkpoint ``--resume auto`` takes again costs a ``stat`` per file."""
    from mpipar.checkpoint.reader import resume_policy
    tr = cfg.train
    start = resume_policy(tr.resume, tr.save_dir)
    if start.restart:
        return _set_metrics_aside(Path(tr.run_dir), tr.save_dir)
    _check_metrics(Path(tr.run_dir), start.fresh)
    return []


def _set_metrics_aside(run_dir: Path, save_dir: str) -> list[str]:
    """``--resume auto`` with no committed checkpoint in ``save_dir``: the run begins again, so
    an earlier ``metrics.jsonl`` becomes ``metrics.jsonl.N`` (the first N free), kept whole."""
    path = run_dir / "metrics.jsonl"
    note = (f"--resume auto: no committed checkpoint in {save_dir}; starting the run again "
            f"from step 1")
    if not path.is_file() or path.stat().st_size == 0:
        return [note]
    n = 1
    while os.path.lexists(f"{path}.{n}"):
        n += 1
    try:
        os.rename(path, f"{path}.{n}")
    except OSError as exc:
        raise ConfigError(f"--run-dir {run_dir}: cannot set the earlier metrics.jsonl aside "
                          f"({exc.strerror or exc}); move it aside, or choose a new "
                          f"--run-dir") from None
    return [f"{note}; the earlier run's metrics.jsonl is kept as {path.name}.{n}"]


def _check_metrics(run_dir: Path, fresh: bool) -> None:
    """The run directory's metrics.jsonl must be readable, and hold no step when the run starts
    at step 0 (``fresh``)."""
    from mpipar.observe.metrics import read_records
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    try:
        records = read_records(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--run-dir {run_dir}: {exc}; move metrics.jsonl aside, or choose a "
                          f"new --run-dir") from None
    if records and fresh:
        raise ConfigError(f"--run-dir {run_dir} holds the metrics of an earlier run "
                          f"({len(records)} step(s), the last step {records[-1]['step']}); this "
                          f"run would replace them, its config and summaries: continue that run "
                          f"with --resume, or choose a new --run-dir")
