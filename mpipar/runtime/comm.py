"""Every MPI call of a run, and how each is booked in the ledger (:mod:`mpipar.runtime.ledger`).

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

What a call books (payload bytes, messages, seconds, wire bytes inside and across nodes) is
:mod:`mpipar.runtime.ledger`'s counting convention. A group of size 1 makes no MPI call and
records nothing. A phase with books of its own (evaluation between training steps) points the
groups at another ledger for its duration (:func:`booked_to`).

bfloat16: MPI has no bf16 type, so the group hands MPI the raw 16-bit words of a bf16 array (a
``uint16`` view, :func:`mpi_view`): point-to-point, broadcasts, all-gathers and all-to-alls move
them as they are. A sum of bf16 arrays (tensor-parallel activations and their gradients,
``--reduce-dtype bfloat16``) uses a user-defined MPI operation (:func:`bf16_sum`, commutative)
that upcasts both operands to float32, adds, and rounds to nearest even: bf16 stays on the wire
and each step of the reduction rounds once. The ledger books a bf16 array's bytes (2 a value).

Links: a group knows the node of each of its ranks (:mod:`mpipar.runtime.topology`), which
decides whether a call's wire bytes are booked as intra- or inter-node.

A :class:`Group` is its calls on top of :class:`GroupBooking`, what every call goes through:
the communicator under its name, its ranks' nodes, what MPI sees of each array (the path) and
the booking of the call in the ledger.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from mpipar.runtime import allreduce
from mpipar.runtime.mpi_init import MPI

from mpipar.runtime.ledger import ALLREDUCE_OPS, Ledger, Request, wire_bytes
from mpipar.runtime.precision import is_bf16, numpy_dtype
from mpipar.runtime.staging import DirectPath, HostCopies, MpiPath, StagedPath, copies_for


def mpi_view(buf: Any) -> Any:
    """What MPI is handed of an array: the array, or for a bfloat16 array (MPI has no bf16
    type) a view of its raw 16-bit words."""
    return buf.view(np.uint16) if is_bf16(buf.dtype) else buf


def _add_bf16(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    """The body of :func:`bf16_sum`: ``inout = bf16(float32(in) + float32(inout))`` on raw bf16
    words (round to nearest even)."""
    bf16 = numpy_dtype("bfloat16")
    a = np.frombuffer(inbuf, np.uint16).view(bf16)
    b = np.frombuffer(inoutbuf, np.uint16).view(bf16)
    b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(bf16)


@functools.cache
def bf16_sum() -> MPI.Op:
    """The MPI operation that sums bfloat16 words in float32 arithmetic (created once)."""
    return MPI.Op.Create(_add_bf16, commute=True)


def _sum_op(buf: Any, op: MPI.Op | None = None) -> MPI.Op:
    """The reduction of ``buf``: ``op`` (default MPI.SUM), or :func:`bf16_sum` for bf16."""
    if not is_bf16(buf.dtype):
        return MPI.SUM if op is None else op
    if op is not None and op is not MPI.SUM:
        raise ValueError("bfloat16 arrays reduce by sum only (bf16_sum)")
    return bf16_sum()


def _contig(buf: np.ndarray, name: str) -> np.ndarray:
    if not buf.flags.c_contiguous:
        raise ValueError(f"{name}: MPI buffers must be C-contiguous")
    return buf


class SharedArray:
    """One array in node shared memory (:meth:`Group.shared_array`): ``array``, the window
    behind it. A rank writes only its own slice; :meth:`Group.sync_shared` publishes the
    writes. :meth:`free` (a collective) unmaps it: no view of ``array`` may be used after."""

    def __init__(self, win: MPI.Win, array: np.ndarray) -> None:
        self.win, self.array = win, array

    def free(self) -> None:
        self.array = None
        self.win.Unlock_all()
        self.win.Free()


class GroupBooking:
    """What every call of a :class:`Group` goes through: the communicator ``comm`` under
    ``name``, the ``ledger`` its calls are booked in, and how a call reaches MPI and the ledger.

    ``nodes``: the node of each rank of the group (by group rank; default: all on one node),
    which decides whether a call's wire bytes are intra- or inter-node. ``path`` decides what MPI
    sees of each array (:mod:`mpipar.runtime.staging`): the array itself (default: host arrays), or a
    staged host buffer; every buffer method goes through it. ``allreduce_algorithm``: the wire
    model of an all-reduce (:func:`mpipar.runtime.ledger.wire_bytes`)."""

    def __init__(self, comm: MPI.Comm, name: str, ledger: Ledger,
                 nodes: list[int] | None = None, path: MpiPath | None = None,
                 allreduce_algorithm: str = "auto") -> None:
        self.comm, self.name, self.ledger = comm, name, ledger
        self.allreduce_algorithm = allreduce_algorithm   # --allreduce-algorithm: the wire model
        self.path = path or DirectPath(HostCopies(), "host arrays")
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.nodes = list(nodes) if nodes is not None else [0] * self.size
        if len(self.nodes) != self.size:
            raise ValueError(f"group {name}: {len(self.nodes)} node ids for {self.size} ranks")
        self.crosses_nodes = len(set(self.nodes)) > 1
        self._host_sums: StagedPath | None = None
        self._collective_link = "inter" if self.crosses_nodes else "intra"

    def link_to(self, peer: int) -> str:
        """"intra" when group rank ``peer`` shares this rank's node, else "inter"."""
        return "intra" if self.nodes[peer] == self.nodes[self.rank] else "inter"

    def _path_of(self, arrays: tuple, summed: bool) -> MpiPath:
        """The path of one call: the group's, except that a bf16 sum of device arrays handed
        straight to MPI is staged through host buffers (:func:`bf16_sum` is host code)."""
        if not (summed and not self.path.staging and any(
                is_bf16(a.dtype) and not isinstance(a, np.ndarray) for a in arrays)):
            return self.path
        if self._host_sums is None:
            self._host_sums = StagedPath(copies_for(True), "bf16 sums run on the host")
        return self._host_sums

    @contextlib.contextmanager
    def _buffers(self, send: tuple = (), recv: tuple = (), both: tuple = (),
                 summed: bool = False) -> Iterator[list]:
        """What MPI sees of ``send`` (read), ``recv`` (written) and ``both`` (in place), in that
        order (bf16 as raw words, :func:`mpi_view`); received values reach the arrays when the
        block ends. ``summed``: the call reduces them."""
        led, path = self.ledger, self._path_of(send + recv + both, summed)
        leases = ([(a, path.lease(a, led, True), False) for a in send]
                  + [(a, path.lease(a, led, False), True) for a in recv]
                  + [(a, path.lease(a, led, True), True) for a in both])
        try:
            yield [mpi_view(buf) for _, buf, _ in leases]
        finally:
            for a, buf, store in leases:
                path.release(a, buf, led, store)

    def _leased(self, send: tuple = (), recv: tuple = (), both: tuple = (),
                summed: bool = False) -> tuple[list, Callable[[], None]]:
        """:meth:`_buffers` for a non-blocking call: the buffers MPI sees, and what its request
        runs when it completes (received values back to the arrays, buffers to the pool)."""
        led, path = self.ledger, self._path_of(send + recv + both, summed)
        leases = ([(a, path.lease(a, led, True), False) for a in send]
                  + [(a, path.lease(a, led, False), True) for a in recv]
                  + [(a, path.lease(a, led, True), True) for a in both])

        def release() -> None:
            for a, buf, store in leases:
                path.release(a, buf, led, store)
        return [mpi_view(buf) for _, buf, _ in leases], release

    def stage_ahead(self, buf: Any) -> None:
        """A coming call will send ``buf``: a staging path starts copying it now, overlapping
        the call in progress (the next gradient bucket during the current one's reduction)."""
        if self.size > 1:
            self.path.ahead(buf, self.ledger)

    def _wire(self, op: str, nbytes: int) -> int:
        """What this rank puts on the wire for ``op`` of ``nbytes``: an all-reduce by the
        algorithm in effect for its size (:func:`mpipar.runtime.allreduce.in_effect`)."""
        algorithm = (allreduce.in_effect(self.allreduce_algorithm, nbytes, allreduce.ACTIVE)
                     if op in ALLREDUCE_OPS else None)
        return wire_bytes(op, nbytes, self.size, self.rank, algorithm)

    def _timed(self, op: str, nbytes: int, fn, *args, link: str | None = None) -> Any:
        self.ledger.begin(self.name, op, self.size)
        t0 = time.perf_counter()
        out = fn(*args)
        self.ledger.add(self.name, op, nbytes, time.perf_counter() - t0,
                        self._wire(op, nbytes), link or self._collective_link)
        return out

    def _request(self, req: MPI.Request, op: str, nbytes: int, link: str | None = None,
                 on_done: Callable[[], None] | None = None) -> Request:
        return Request(req, self.ledger, self.name, op, nbytes, self.size,
                       link or self._collective_link, on_done, wire=self._wire(op, nbytes))


class Group(GroupBooking):
    """One communicator of the grid, with ledger-counted buffer collectives, control (pickled
    object) collectives, node shared memory and point-to-point (:class:`GroupBooking`: the
    communicator, its nodes, the MPI path and the booking every call goes through)."""

    # ------------------------------------------------------------ collectives
    def allreduce_(self, buf: np.ndarray, op: MPI.Op | None = None) -> np.ndarray:
        """In-place all-reduce (sum by default) of a contiguous array; returns it."""
        if self.size > 1:
            name = "allreduce" if op is None or op is MPI.SUM else "allreduce_max"
            op = _sum_op(buf, op)
            allreduce.before_allreduce(buf.nbytes)
            with self._buffers(both=(_contig(buf, "allreduce"),), summed=True) as (mbuf,):
                self._timed(name, buf.nbytes, self.comm.Allreduce, MPI.IN_PLACE, mbuf, op)
        return buf

    def allreduce_max_(self, buf: np.ndarray) -> np.ndarray:
        """In-place element-wise maximum over the group; returns it."""
        return self.allreduce_(buf, MPI.MAX)

    def iallreduce_(self, buf: np.ndarray) -> Request:
        """Start an in-place sum all-reduce; ``wait()`` the result (the buffer is busy until then)."""
        if self.size == 1:
            return Request(None, self.ledger, self.name, "iallreduce", 0)
        (mbuf,), done = self._leased(both=(_contig(buf, "iallreduce"),), summed=True)
        allreduce.before_allreduce(buf.nbytes)
        return self._request(self.comm.Iallreduce(MPI.IN_PLACE, mbuf, _sum_op(buf)),
                             "iallreduce", buf.nbytes, on_done=done)

    def allgather(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        """Gather equal blocks: ``recv`` is ``[size, *send.shape]`` (or its flat equivalent)."""
        if self.size == 1:
            recv.reshape(send.shape)[...] = send
            return recv
        with self._buffers((_contig(send, "allgather"),), (_contig(recv, "allgather"),)) as b:
            self._timed("allgather", send.nbytes, self.comm.Allgather, *b)
        return recv

    def allgather_in_place(self, buf: np.ndarray, count: int, offsets: list[int]) -> np.ndarray:
        """Group rank ``j``'s ``count`` elements at ``buf[offsets[j]:offsets[j] + count]``, on
        every rank; this rank's own are already in place (an in-place ``Allgatherv``). Booked
        as an all-gather of ``count`` elements (host arrays)."""
        if self.size > 1:
            from mpi4py.util.dtlib import from_numpy_dtype
            words = mpi_view(_contig(buf, "allgather"))
            spec = [words, [count] * self.size, list(offsets), from_numpy_dtype(words.dtype)]
            self._timed("allgather", count * buf.itemsize, self.comm.Allgatherv, MPI.IN_PLACE,
                        spec)
        return buf

    def iallgather(self, send: np.ndarray, recv: np.ndarray) -> Request:
        """Start :meth:`allgather` (``send`` and ``recv`` are busy until the request completes)."""
        if self.size == 1:
            recv.reshape(send.shape)[...] = send
            return Request(None, self.ledger, self.name, "iallgather", 0)
        b, done = self._leased((_contig(send, "iallgather"),), (_contig(recv, "iallgather"),))
        return self._request(self.comm.Iallgather(*b), "iallgather", send.nbytes, on_done=done)

    def reduce_scatter_(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        """Sum ``send`` (``size`` equal blocks) over the group; block ``rank`` lands in ``recv``."""
        if self.size == 1:
            recv[...] = send.reshape(recv.shape)
            return recv
        with self._buffers((_contig(send, "reduce_scatter"),),
                           (_contig(recv, "reduce_scatter"),), summed=True) as b:
            self._timed("reduce_scatter", send.nbytes, self.comm.Reduce_scatter_block, *b,
                        _sum_op(send))
        return recv

    def ireduce_scatter_(self, send: np.ndarray, recv: np.ndarray) -> Request:
        """Start :meth:`reduce_scatter_` (both buffers are busy until the request completes)."""
        if self.size == 1:
            recv[...] = send.reshape(recv.shape)
            return Request(None, self.ledger, self.name, "ireduce_scatter", 0)
        b, done = self._leased((_contig(send, "ireduce_scatter"),),
                               (_contig(recv, "ireduce_scatter"),), summed=True)
        return self._request(self.comm.Ireduce_scatter_block(*b, _sum_op(send)),
                             "ireduce_scatter", send.nbytes, on_done=done)

    def alltoall(self, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
        """Block ``j`` of ``send`` goes to rank ``j``; block ``i`` of ``recv`` came from rank ``i``."""
        if self.size == 1:
            recv[...] = send
            return recv
        with self._buffers((_contig(send, "alltoall"),), (_contig(recv, "alltoall"),)) as b:
            self._timed("alltoall", send.nbytes, self.comm.Alltoall, *b)
        return recv

    def _v_spec(self, send: np.ndarray, send_rows: list[int], recv_rows: list[int]) -> tuple:
        """An all-to-all-v of rows: (send counts, displacements), (receive counts,
        displacements) in elements, and the bytes booked (those sent to the other ranks)."""
        row = int(np.prod(send.shape[1:], dtype=np.int64))
        sc, rc = [n * row for n in send_rows], [n * row for n in recv_rows]
        sd, rd = np.cumsum([0] + sc[:-1]).tolist(), np.cumsum([0] + rc[:-1]).tolist()
        return (sc, sd), (rc, rd), (sum(send_rows) - send_rows[self.rank]) * row * send.itemsize

    def alltoallv(self, send: np.ndarray, send_rows: list[int], recv: np.ndarray,
                  recv_rows: list[int]) -> np.ndarray:
        """Rows ``[n, ...]``: ``send_rows[j]`` consecutive rows of ``send`` go to rank ``j`` (in
        rank order), ``recv_rows[i]`` rows from rank ``i`` land in ``recv`` in rank order. Booked
        as the bytes sent to the other ranks."""
        if self.size == 1:
            recv[...] = send
            return recv
        (sc, sd), (rc, rd), sent = self._v_spec(send, send_rows, recv_rows)
        with self._buffers((_contig(send, "alltoallv"),), (_contig(recv, "alltoallv"),)) as b:
            self._timed("alltoallv", sent, self.comm.Alltoallv, [b[0], (sc, sd)],
                        [b[1], (rc, rd)])
        return recv

    def ialltoallv(self, send: np.ndarray, send_rows: list[int], recv: np.ndarray,
                   recv_rows: list[int]) -> Request:
        """Start :meth:`alltoallv` (both buffers are busy until the request completes); booked
        as it, the bytes sent to the other ranks."""
        if self.size == 1:
            recv[...] = send
            return Request(None, self.ledger, self.name, "ialltoallv", 0)
        (sc, sd), (rc, rd), sent = self._v_spec(send, send_rows, recv_rows)
        b, done = self._leased((_contig(send, "ialltoallv"),), (_contig(recv, "ialltoallv"),))
        return self._request(self.comm.Ialltoallv([b[0], (sc, sd)], [b[1], (rc, rd)]),
                             "ialltoallv", sent, on_done=done)

    def ialltoall(self, send: np.ndarray, recv: np.ndarray) -> Request:
        """Start :meth:`alltoall` (both buffers are busy until the request completes)."""
        if self.size == 1:
            recv[...] = send
            return Request(None, self.ledger, self.name, "ialltoall", 0)
        b, done = self._leased((_contig(send, "ialltoall"),), (_contig(recv, "ialltoall"),))
        return self._request(self.comm.Ialltoall(*b), "ialltoall", send.nbytes, on_done=done)

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

    def idle_barrier(self, poll: float = 0.05) -> None:
        """A barrier whose waiting ranks sleep ``poll`` seconds between tests, so that they
        leave the cores they share to the ranks still working (a blocking barrier spins)."""
        if self.size == 1:
            return
        request = self._request(self.comm.Ibarrier(), "barrier", 0)
        while not request.test():
            time.sleep(poll)

    # ------------------------------------------------------ node shared memory
    def on_one_node(self) -> bool:
        """Whether every rank of the group shares memory with every other (one node, as MPI's
        ``COMM_TYPE_SHARED`` split sees it). A collective; the same answer on every rank."""
        if self.size == 1:
            return True
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return local.Get_size() == self.size
        finally:
            local.Free()

    def shared_array(self, count: int, dtype: Any) -> SharedArray:
        """A flat array of ``size * count`` elements that every rank of a one-node group maps
        (an MPI-3 shared-memory window; a collective): this rank allocates elements
        ``[rank * count, (rank + 1) * count)``, MPI lays the slices back to back (the window's
        default, contiguous allocation), and every rank's ``array`` is the whole."""
        dtype = np.dtype(dtype)
        win = MPI.Win.Allocate_shared(count * dtype.itemsize, dtype.itemsize, comm=self.comm)
        win.Lock_all(MPI.MODE_NOCHECK)          # one passive epoch: Sync orders loads and stores
        base, _ = win.Shared_query(0)
        whole = MPI.buffer.fromaddress(base.address, self.size * count * dtype.itemsize)
        return SharedArray(win, np.frombuffer(whole, dtype))

    def sync_shared(self, arrays: Iterable[SharedArray]) -> None:
        """After it, every rank's writes to its slices of ``arrays`` are visible to every rank
        (memory barrier, group barrier, memory barrier)."""
        arrays = list(arrays)
        for a in arrays:
            a.win.Sync()
        self.barrier()
        for a in arrays:
            a.win.Sync()

    # ---------------------------------------------------------- point-to-point
    def sendrecv(self, send: np.ndarray, dest: int, recv: np.ndarray, source: int,
                 tag: int = 0) -> np.ndarray:
        """Send ``send`` to ``dest`` while receiving ``recv`` from ``source`` (ring step)."""
        if self.size == 1:
            recv[...] = send
            return recv
        with self._buffers((_contig(send, "sendrecv"),), (_contig(recv, "sendrecv"),)) as b:
            self._timed("sendrecv", send.nbytes, self.comm.Sendrecv, b[0], dest, tag, b[1],
                        source, tag, link=self.link_to(dest))
        return recv

    def isend(self, buf: np.ndarray, dest: int, tag: int) -> Request:
        (mbuf,), done = self._leased((_contig(buf, "isend"),))
        return self._request(self.comm.Isend(mbuf, dest, tag), "send", buf.nbytes,
                             self.link_to(dest), done)

    def irecv(self, buf: np.ndarray, source: int, tag: int) -> Request:
        (mbuf,), done = self._leased(recv=(_contig(buf, "irecv"),))
        return self._request(self.comm.Irecv(mbuf, source, tag), "recv", 0,
                             self.link_to(source), done)

    def recv(self, buf: np.ndarray, source: int, tag: int) -> np.ndarray:
        with self._buffers(recv=(_contig(buf, "recv"),)) as (mbuf,):
            self._timed("recv", 0, self.comm.Recv, mbuf, source, tag, link=self.link_to(source))
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

    def rewatch(self, ledgers: list[Ledger]) -> None:
        """Watch ``ledgers`` instead of those watched so far (a rank rebuilt on a smaller world:
        the old ledgers still hold the calls that failed)."""
        self.ledgers = list(ledgers)

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
