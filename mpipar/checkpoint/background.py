"""Asynchronous checkpoints (``--async-save``): the shard written by a background thread while
training goes on, committed on the main thread.

A save has three parts (:mod:`.writer`): :func:`~.writer.begin` (collective: rank 0 makes the
temporary directory), the shard write (no collective), :func:`~.writer.commit` (collective:
the gather that proves every shard complete, the index, the renames, ``latest``).
:class:`AsyncSaver` runs them apart:

1. at the step boundary of a save, :meth:`AsyncSaver.start` copies this rank's pieces to host
   memory (pinned on a GPU: :func:`~mpipar.runtime.device.host_copy`) and starts a thread that
   writes and fsyncs the shard from the copy; training continues at once;
2. at every later step boundary the loop's per-step all-gather carries whether this rank's
   write is still running (:meth:`AsyncSaver.writing`); the first boundary at which no rank's
   is, every rank calls :meth:`AsyncSaver.finish`, which commits on the main thread;
3. the next save, the end of the run and a stop signal call :meth:`finish` whatever the flags
   say: it waits for the write in flight (marked in the control group's ledger, so the
   collective watchdog names a write that hangs), then commits.

No MPI call runs on the background thread, so any MPI thread level will do. Until the commit
the write lives in ``.step_N.tmp/`` and ``latest`` names the previous checkpoint: a crash or a
SIGKILL during the write leaves that checkpoint, verified and resumable.
:meth:`describe` says what is in flight, for ``failure.txt`` when a rank aborts meanwhile.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpipar.checkpoint import writer
from mpipar.checkpoint.records import RunPosition
from mpipar.checkpoint.shards import RankState
from mpipar.runtime.comm import Group


class AsyncSaver:
    """At most one checkpoint write in flight on this rank (see the module docstring).

    ``group``: the run's control group (watched); ``copy``: how a piece reaches host memory
    (:func:`~mpipar.runtime.device.host_copy`). ``spans`` (a list of the caller's, or a new
    one) collects ``(what, thread, start,
    end)`` (``time.perf_counter()`` seconds) of every copy, write, wait and commit, for
    traces."""

    def __init__(self, *, group: Group, save_dir: str, keep_last: int,
                 copy: Callable[[Any], Any], spans: list | None = None) -> None:
        self.group, self.save_dir, self.keep_last, self.copy = group, save_dir, keep_last, copy
        self.pending: writer.PendingSave | None = None
        self._thread: threading.Thread | None = None
        self._since = 0.0
        self.spans: list[tuple[str, str, float, float]] = [] if spans is None else spans

    def start(self, state: RankState, position: RunPosition) -> None:
        """Begin the save of ``position.step`` (collective), copy this rank's pieces and start
        writing them in the background. A write still in flight must be finished first."""
        if self.pending is not None:
            raise RuntimeError(f"a checkpoint write ({self.pending.final.name}) is in flight: "
                               f"finish() it before starting another")
        t0 = time.perf_counter()
        self.pending = writer.begin(state, position, self.save_dir, self.group, copy=self.copy)
        self._since = time.perf_counter()
        self.spans.append((f"checkpoint copy {self.pending.final.name}", "main", t0, self._since))
        self._thread = threading.Thread(target=self._write, name="mpipar-checkpoint",
                                        daemon=True)
        self._thread.start()

    def _write(self) -> None:
        t0 = time.perf_counter()
        self.pending.write()
        self.spans.append((f"checkpoint write {self.pending.final.name}", "checkpoint", t0,
                           time.perf_counter()))

    def writing(self) -> bool:
        """Whether this rank's shard of the save in flight is still being written."""
        return self._thread is not None and self._thread.is_alive()

    def finish(self) -> Path | None:
        """Wait for this rank's write in flight, then commit the save (collective over the
        group: every rank has the same save in flight). Returns the committed directory (None
        when nothing was in flight). Raises CheckpointError on every rank when a shard failed."""
        if self.pending is None:
            return None
        t0 = time.perf_counter()
        if self.writing():
            ledger = self.group.ledger
            ledger.begin("checkpoint", f"wait for the background write of "
                                       f"{self.pending.final.name}", 1)
            self._thread.join()
            ledger.in_flight = None
        t1 = time.perf_counter()
        pending, self.pending, self._thread = self.pending, None, None
        path = writer.commit(pending, self.group, self.keep_last)
        if t1 > t0 + 1e-4:
            self.spans.append((f"checkpoint wait {path.name}", "main", t0, t1))
        self.spans.append((f"checkpoint commit {path.name}", "main", t1, time.perf_counter()))
        return path

    def describe(self) -> str | None:
        """What is in flight, for a failure report (None: nothing)."""
        pending = self.pending
        if pending is None:
            return None
        state = ("still being written" if self.writing() else
                 f"failed: {pending.outcome[1]}" if pending.outcome[1] else
                 "written, not yet committed")
        return (f"an asynchronous checkpoint save of step {pending.position.step} was in flight "
                f"({pending.tmp}: this rank's shard {state}, "
                f"{time.perf_counter() - self._since:.1f} s after it began); it is not "
                f"committed: {writer.latest_note(Path(self.save_dir))}")
