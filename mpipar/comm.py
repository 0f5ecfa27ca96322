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

from mpipar.staging import DirectPath, HostCopies, MpiPath


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
    staging: LedgerEntry = field(default_factory=LedgerEntry)
    """Copies between arrays and MPI's host buffers (:mod:`mpipar.staging`): bytes copied
    either way, copies, seconds; apart from ``entries``, which hold what the planner predicts."""

    def begin(self, group: str, op: str, size: int) -> None:
        """Mark the call about to block (``add`` clears the mark when it returns)."""
        self.in_flight = (group, op, size, time.monotonic())

    def add(self, group: str, op: str, nbytes: int, seconds: float) -> None:
        self.in_flight = None
        e = self.entries[(group, op)]
        e.bytes += int(nbytes)
        e.messages += 1
        e.seconds += seconds

    def stage(self, nbytes: int, seconds: float) -> None:
        """Book a staging copy of ``nbytes`` (0: time spent waiting for one) and its seconds."""
        self.staging.bytes += int(nbytes)
        self.staging.messages += 1 if nbytes else 0
        self.staging.seconds += seconds

    def reset(self) -> None:
        self.entries.clear()
        self.staging = LedgerEntry()

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
    """A non-blocking operation; ``wait`` books its time in the ledger, then runs ``on_done``
    (a staged buffer copied back and returned to its pool)."""

    def __init__(self, req: MPI.Request | None, ledger: Ledger, group: str, op: str,
                 nbytes: int, size: int = 1, on_done: Callable[[], None] | None = None) -> None:
        self._req, self._ledger, self._group, self._op = req, ledger, group, op
        self._size, self._nbytes, self._on_done = size, nbytes, on_done
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
        if self._on_done is not None:
            self._on_done()


def _contig(buf: np.ndarray, name: str) -> np.ndarray:
    if not buf.flags.c_contiguous:
        raise ValueError(f"{name}: MPI buffers must be C-contiguous")
    return buf


class Group:
    """One communicator of the grid, with ledger-counted buffer collectives and point-to-point.

    ``path`` decides what MPI sees of each array (:mod:`mpipar.staging`): the array itself
    (default: host arrays), or a staged host buffer; every buffer method goes through it."""

    def __init__(self, comm: MPI.Comm, name: str, ledger: Ledger,
                 path: MpiPath | None = None) -> None:
        self.comm, self.name, self.ledger = comm, name, ledger
        self.path = path or DirectPath(HostCopies(), "host arrays")
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()

    @contextlib.contextmanager
    def _buffers(self, send: tuple = (), recv: tuple = (), both: tuple = ()) -> Iterator[list]:
        """What MPI sees of ``send`` (read), ``recv`` (written) and ``both`` (in place), in that
        order; received values reach the arrays when the block ends."""
        led, path = self.ledger, self.path
        leases = ([(a, path.lease(a, led, True), False) for a in send]
                  + [(a, path.lease(a, led, False), True) for a in recv]
                  + [(a, path.lease(a, led, True), True) for a in both])
        try:
            yield [buf for _, buf, _ in leases]
        finally:
            for a, buf, store in leases:
                path.release(a, buf, led, store)

    def stage_ahead(self, buf: Any) -> None:
        """A coming call will send ``buf``: a staging path starts copying it now, overlapping
        the call in progress (the next gradient bucket during the current one's reduction)."""
        if self.size > 1:
            self.path.ahead(buf, self.ledger)

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
            with self._buffers(both=(buf,)) as (mbuf,):
                self._timed("allreduce" if op is MPI.SUM else "allreduce_max", buf.nbytes,
                            self.comm.Allreduce, MPI.IN_PLACE, mbuf, op)
        return buf

    def allreduce_max_(self, buf: np.ndarray) -> np.ndarray:
        """In-place element-wise maximum over the group; returns it."""
        return self.allreduce_(buf, MPI.MAX)

    def iallreduce_(self, buf: np.ndarray) -> Request:
        """Start an in-place sum all-reduce; ``wait()`` the result (the buffer is busy until then)."""
        if self.size == 1:
            return Request(None, self.ledger, self.name, "iallreduce", 0)
        _contig(buf, "iallreduce")
        mbuf = self.path.lease(buf, self.ledger, True)
        return Request(self.comm.Iallreduce(MPI.IN_PLACE, mbuf, MPI.SUM), self.ledger, self.name,
                       "iallreduce", buf.nbytes, self.size, self._release(buf, mbuf, True))

    def _release(self, a: Any, buf: Any, store: bool) -> Callable[[], None]:
        """What a request does when it completes: ``buf`` back to ``a`` (``store``), pooled."""
        ledger = self.ledger
        return lambda: self.path.release(a, buf, ledger, store)

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        """Gather equal blocks: ``recv`` is ``[size, *send.shape]`` (or its flat equivalent)."""
        if self.size == 1:
            recv.reshape(send.shape)[...] = send
            return recv
        with self._buffers((_contig(send, "allgather"),), (_contig(recv, "allgather"),)) as b:
            self._timed("allgather", send.nbytes, self.comm.Allgather, *b)
        return recv

    def reduce_scatter_(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        """Sum ``send`` (``size`` equal blocks) over the group; block ``rank`` lands in ``recv``."""
        if self.size == 1:
            recv[...] = send.reshape(recv.shape)
            return recv
        with self._buffers((_contig(send, "reduce_scatter"),),
                           (_contig(recv, "reduce_scatter"),)) as b:
            self._timed("reduce_scatter", send.nbytes, self.comm.Reduce_scatter_block, *b,
                        MPI.SUM)
        return recv

    def alltoall(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        """Block ``j`` of ``send`` goes to rank ``j``; block ``i`` of ``recv`` came from rank ``i``."""
        if self.size == 1:
            recv[...] = send
            return recv
        with self._buffers((_contig(send, "alltoall"),), (_contig(recv, "alltoall"),)) as b:
            self._timed("alltoall", send.nbytes, self.comm.Alltoall, *b)
        return recv

    def bcast_(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        if self.size > 1:
            root_side = self.rank == root
            with self._buffers((_contig(buf, "bcast"),) if root_side else (),
                               () if root_side else (_contig(buf, "bcast"),)) as (mbuf,):
                self._timed("bcast", buf.nbytes if root_side else 0, self.comm.Bcast, mbuf, root)
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
        with self._buffers((_contig(send, "sendrecv"),), (_contig(recv, "sendrecv"),)) as b:
            self._timed("sendrecv", send.nbytes, self.comm.Sendrecv, b[0], dest, tag, b[1],
                        source, tag)
        return recv

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        mbuf = self.path.lease(_contig(buf, "isend"), self.ledger, True)
        return Request(self.comm.Isend(mbuf, dest, tag), self.ledger, self.name, "send",
                       buf.nbytes, self.size, self._release(buf, mbuf, False))

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        mbuf = self.path.lease(_contig(buf, "irecv"), self.ledger, False)
        return Request(self.comm.Irecv(mbuf, source, tag), self.ledger, self.name, "recv", 0,
                       self.size, self._release(buf, mbuf, True))

    def recv(self, buf: np.ndarray, source: int, tag: int) -> np.ndarray:
        with self._buffers(recv=(_contig(buf, "recv"),)) as (mbuf,):
            self._timed("recv", 0, self.comm.Recv, mbuf, source, tag)
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
