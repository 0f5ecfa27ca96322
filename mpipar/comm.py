"""Every MPI call of a run, and the ledger that counts them.

A :class:`Group` wraps one communicator of the process grid under a name ("tp", "sp", "pp",
"dp_sp", ...). The hot path uses its buffer methods, the uppercase mpi4py calls on contiguous
arrays; the run's control collectives outside the engine (agreeing on errors, the per-step
telemetry, checkpoint commits, the timeline, shutdown) use its ``*_object`` methods and
:meth:`Group.barrier` on a group of their own ("world", with its own ledger, so the engine's
byte counts stay the planner's). Each call is recorded in the group's :class:`Ledger`: bytes,
messages and seconds per (group, operation).

While a call is blocked in MPI the ledger holds it in ``in_flight`` (group, operation, group
size, start), so a :class:`Watchdog` thread can abort a job stuck in one call and name the call;
the watchdog watches the engine's ledger and the control group's, i.e. every collective of a
run but those that build the process grid.

Counting convention (what the planner predicts): ``bytes`` is the payload this rank hands to the
operation — the buffer size of an all-reduce, the send buffer of an all-gather, reduce-scatter,
all-to-all or point-to-point send — and ``messages`` the number of calls. A receive counts
messages and seconds but no bytes (the sender counted them), and so does an object collective
(mpi4py pickles the object inside the call). A group of size 1 makes no MPI call and records
nothing. A phase with books of its own (evaluation between training steps) points the groups at
another ledger for its duration (:func:`booked_to`).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI


@dataclass
class LedgerEntry:
    bytes: int = 0
    messages: int = 0
    seconds: float = 0.0


@dataclass
class Ledger:
    """Bytes, messages and seconds per (group, operation), since the last ``reset``."""

    entries: dict[tuple[str, str], LedgerEntry] = field(
        default_factory=lambda: defaultdict(LedgerEntry))
    in_flight: tuple[str, str, int, float] | None = None
    """(group, operation, group size, time.monotonic() at entry) of the call blocked now."""

    def begin(self, group: str, op: str, size: int) -> None:
        """Mark the call about to block (``add`` clears the mark when it returns)."""
        self.in_flight = (group, op, size, time.monotonic())

    def add(self, group: str, op: str, nbytes: int, seconds: float) -> None:
        self.in_flight = None
        e = self.entries[(group, op)]
        e.bytes += int(nbytes)
        e.messages += 1
        e.seconds += seconds

    def reset(self) -> None:
        self.entries.clear()

    def bytes_by_group(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (group, _), e in self.entries.items():
            out[group] += e.bytes
        return dict(out)

    def seconds_by_group(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (group, _), e in self.entries.items():
            out[group] += e.seconds
        return dict(out)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{"group/op": {"bytes", "messages", "seconds"}}`` for the metrics log."""
        return {f"{g}/{op}": {"bytes": e.bytes, "messages": e.messages, "seconds": e.seconds}
                for (g, op), e in sorted(self.entries.items())}


class Request:
    """A non-blocking operation; ``wait`` books its time in the ledger."""

    def __init__(self, req: MPI.Request | None, ledger: Ledger, group: str, op: str,
                 nbytes: int, size: int = 1) -> None:
        self._req, self._ledger, self._group, self._op = req, ledger, group, op
        self._size, self._nbytes = size, nbytes
        self.done = req is None

    def wait(self) -> None:
        if self.done:
            return
        t0 = time.perf_counter()
        self._ledger.begin(self._group, self._op, self._size)
        self._req.Wait()
        # Seconds spent blocked in wait are the exposed communication time.
        self._ledger.add(self._group, self._op, self._nbytes, time.perf_counter() - t0)
        self.done = True


def _contig(buf: np.ndarray, name: str) -> np.ndarray:
    if not buf.flags.c_contiguous:
        raise ValueError(f"{name}: MPI buffers must be C-contiguous")
    return buf


class Group:
    """One communicator of the grid, with ledger-counted buffer collectives and point-to-point."""

    def __init__(self, comm: MPI.Comm, name: str, ledger: Ledger) -> None:
        self.comm, self.name, self.ledger = comm, name, ledger
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()

    def _timed(self, op: str, nbytes: int, fn, *args) -> Any:
        self.ledger.begin(self.name, op, self.size)
        t0 = time.perf_counter()
        out = fn(*args)
        self.ledger.add(self.name, op, nbytes, time.perf_counter() - t0)
        return out

    # ------------------------------------------------------------ collectives
    def allreduce_(self, buf: np.ndarray, op: MPI.Op = MPI.SUM) -> np.ndarray:
        """In-place all-reduce (sum by default) of a contiguous array; returns it."""
        if self.size > 1:
            _contig(buf, "allreduce")
            self._timed("allreduce" if op is MPI.SUM else "allreduce_max", buf.nbytes,
                        self.comm.Allreduce, MPI.IN_PLACE, buf, op)
        return buf

    def allreduce_max_(self, buf: np.ndarray) -> np.ndarray:
        """In-place element-wise maximum over the group; returns it."""
        return self.allreduce_(buf, MPI.MAX)

    def iallreduce_(self, buf: np.ndarray) -> Request:
        """Start an in-place sum all-reduce; ``wait()`` the result (the buffer is busy until then)."""
        if self.size == 1:
            return Request(None, self.ledger, self.name, "iallreduce", 0)
        _contig(buf, "iallreduce")
        return Request(self.comm.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM), self.ledger, self.name,
                       "iallreduce", buf.nbytes, self.size)

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        """Gather equal blocks: ``recv`` is ``[size, *send.shape]`` (or its flat equivalent)."""
        if self.size == 1:
            recv.reshape(send.shape)[...] = send
            return recv
        self._timed("allgather", send.nbytes, self.comm.Allgather, _contig(send, "allgather"),
                    _contig(recv, "allgather"))
        return recv

    def reduce_scatter_(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        """Sum ``send`` (``size`` equal blocks) over the group; block ``rank`` lands in ``recv``."""
        if self.size == 1:
            recv[...] = send.reshape(recv.shape)
            return recv
        self._timed("reduce_scatter", send.nbytes, self.comm.Reduce_scatter_block,
                    _contig(send, "reduce_scatter"), _contig(recv, "reduce_scatter"), MPI.SUM)
        return recv

    def alltoall(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        """Block ``j`` of ``send`` goes to rank ``j``; block ``i`` of ``recv`` came from rank ``i``."""
        if self.size == 1:
            recv[...] = send
            return recv
        self._timed("alltoall", send.nbytes, self.comm.Alltoall, _contig(send, "alltoall"),
                    _contig(recv, "alltoall"))
        return recv

    def bcast_(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        if self.size > 1:
            self._timed("bcast", buf.nbytes if self.rank == root else 0, self.comm.Bcast,
                        _contig(buf, "bcast"), root)
        return buf

    # ------------------------------------------------ control (pickled objects)
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        return self._timed("allgather_object", 0, self.comm.allgather, obj)

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on ``root``; None elsewhere."""
        if self.size == 1:
            return [obj]
        return self._timed("gather_object", 0, self.comm.gather, obj, root)

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s ``obj`` on every rank."""
        if self.size == 1:
            return obj
        return self._timed("bcast_object", 0, self.comm.bcast, obj, root)

    def barrier(self) -> None:
        if self.size > 1:
            self._timed("barrier", 0, self.comm.Barrier)

    # ---------------------------------------------------------- point-to-point
    def sendrecv(self, send: np.ndarray, dest: int, recv: np.ndarray, source: int,
                 tag: int = 0) -> np.ndarray:
        """Send ``send`` to ``dest`` while receiving ``recv`` from ``source`` (ring step)."""
        if self.size == 1:
            recv[...] = send
            return recv
        self._timed("sendrecv", send.nbytes, self.comm.Sendrecv, _contig(send, "sendrecv"), dest,
                    tag, _contig(recv, "sendrecv"), source, tag)
        return recv

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        return Request(self.comm.Isend(_contig(buf, "isend"), dest, tag), self.ledger, self.name,
                       "send", buf.nbytes, size=self.size)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        return Request(self.comm.Irecv(_contig(buf, "irecv"), source, tag), self.ledger,
                       self.name, "recv", 0, size=self.size)

    def recv(self, buf: np.ndarray, source: int, tag: int) -> np.ndarray:
        self._timed("recv", 0, self.comm.Recv, _contig(buf, "recv"), source, tag)
        return buf


@contextlib.contextmanager
def booked_to(groups: Iterable[Group], ledger: Ledger) -> Iterator[None]:
    """Book every call of ``groups`` in ``ledger`` while the block runs, then give each group
    its own ledger back (a phase with its own books, e.g. evaluation: the training step's
    ledger keeps exactly what the planner predicts for a step)."""
    groups = list(groups)
    saved = [g.ledger for g in groups]
    for g in groups:
        g.ledger = ledger
    try:
        yield
    finally:
        for g, own in zip(groups, saved):
            g.ledger = own


class Watchdog:
    """A daemon thread that ends the job when one MPI call of ``ledgers`` has been blocked longer
    than ``timeout`` seconds: it calls ``on_stuck`` with a message naming the call, the group and
    how long (the caller reports it and aborts; ``MPI_Abort`` from this thread needs
    ``MPI_THREAD_MULTIPLE``, mpi4py's default).

    Until :meth:`steady` is called the limit is ``max(timeout, startup)``: the first step of a
    run compiles kernels and touches its memory for the first time, and a rank that does so
    while its peers already wait must not look stuck (``startup`` None: no allowance)."""

    def __init__(self, ledgers: list[Ledger], timeout: float, rank: int,
                 on_stuck: Callable[[str], None], startup: float | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"watchdog timeout={timeout!r}: must be > 0 seconds")
        self.ledgers, self.timeout, self.rank = list(ledgers), timeout, rank
        self.on_stuck = on_stuck
        self.startup = startup if startup is not None and startup > timeout else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mpipar-watchdog", daemon=True)

    def watch(self, ledger: Ledger) -> None:
        """Watch ``ledger`` too (one created after the watchdog started)."""
        self.ledgers = [*self.ledgers, ledger]

    def steady(self) -> None:
        """Start-up is over: from now on the limit is ``timeout``."""
        self.startup = None

    def stuck(self, now: float | None = None) -> str | None:
        """The message naming the call blocked longer than the limit, or None."""
        now = time.monotonic() if now is None else now
        limit = self.startup or self.timeout
        for ledger in self.ledgers:
            entry = ledger.in_flight
            if entry is not None and now - entry[3] > limit:
                group, op, size, start = entry
                which = (f"--startup-timeout {limit:g} s (start-up and step 1)" if self.startup
                         else f"--collective-timeout {limit:g} s")
                return (f"mpipar: rank {self.rank}: collective watchdog: {op} on "
                        f"group '{group}' (size {size}) has been blocked {now - start:.1f} s, "
                        f"longer than {which}; another rank is stuck or gone. Aborting all "
                        f"ranks")
        return None

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 4)
        while not self._stop.wait(poll):
            message = self.stuck()
            if message is not None:
                self.on_stuck(message)
                return

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
