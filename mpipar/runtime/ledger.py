"""The ledger of a run's MPI calls: what each call puts on the wire and where, and the books.

Counting convention (what the planner predicts): ``bytes`` is the payload this rank hands to the
operation — the buffer size of an all-reduce, the send buffer of an all-gather, reduce-scatter,
all-to-all or point-to-point send — and ``messages`` the number of calls. A receive counts
messages and seconds but no bytes (the sender counted them), and so does an object collective
(mpi4py pickles the object inside the call). The ledger books a bf16 array's bytes (2 a value).

Links: the ledger splits what each call puts on the wire into ``intra``- and ``inter``-node
bytes. Wire bytes are the payload times the per-rank factor of the bandwidth-optimal algorithm
of the operation (:func:`wire_bytes`: ring all-reduce ``2(n-1)/n``, reduce-scatter and
all-to-all ``(n-1)/n``, all-gather ``n-1``, point-to-point and broadcast 1); an all-reduce under
a named ``--allreduce-algorithm`` (or the one ``auto`` picks from a hardware file for its size)
books that algorithm's bytes for the rank's place in its schedule (:func:`allreduce_wire`). A
collective's wire bytes are inter-node when its group spans more than one node (it runs at the
pace of the slow link), else intra-node; a point-to-point message's are inter-node when its peer
is on another node.

While a call is blocked in MPI the ledger holds it in ``in_flight`` (group, operation, group
size, start), so :class:`mpipar.runtime.comm.Watchdog` can name a call that never returns. The
calls themselves, and how each is booked, are :mod:`mpipar.runtime.comm`'s.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpi4py import MPI


WIRE_FACTORS: dict[str, Callable[[int], tuple[int, int]]] = {
    "allreduce": lambda n: (2 * (n - 1), n), "allreduce_max": lambda n: (2 * (n - 1), n),
    "iallreduce": lambda n: (2 * (n - 1), n),
    "reduce_scatter": lambda n: (n - 1, n), "ireduce_scatter": lambda n: (n - 1, n),
    "alltoall": lambda n: (n - 1, n), "ialltoall": lambda n: (n - 1, n),
    "allgather": lambda n: (n - 1, 1), "iallgather": lambda n: (n - 1, 1),
}
"""Per operation, the wire bytes per payload byte of a group of ``n`` as (numerator,
denominator); operations not listed (point-to-point, broadcast) put their payload on the wire."""

LINKS = ("intra", "inter")


ALLREDUCE_OPS = ("allreduce", "allreduce_max", "iallreduce")


def wire_bytes(op: str, nbytes: int, size: int, rank: int = 0,
               algorithm: str | None = None) -> int:
    """Bytes one rank puts on the wire for ``op`` with a payload of ``nbytes`` in a group of
    ``size`` (rounded down to whole bytes), under the bandwidth-optimal algorithm; an all-reduce
    under a named ``algorithm`` (:func:`allreduce_wire`) as group rank ``rank`` of that
    algorithm's schedule."""
    if op in ALLREDUCE_OPS and algorithm is not None:
        return allreduce_wire(nbytes, size, rank, algorithm)
    num, den = WIRE_FACTORS[op](size) if op in WIRE_FACTORS else (1, 1)
    return int(nbytes) * num // den


def allreduce_wire(nbytes: int, size: int, rank: int, algorithm: str) -> int:
    """Bytes group rank ``rank`` of ``size`` sends in an all-reduce of ``nbytes`` under the
    textbook schedule of ``algorithm``:

    - ``ring``: reduce-scatter then all-gather around the ring, ``2 (n-1)/n`` of the payload;
    - ``rabenseifner``: over the largest power of two ``p <= n``, recursive halving then
      doubling, ``2 (p-1)/p``; the ``n - p`` extra ranks first hand their whole buffer to a
      partner (the even rank of each of the first ``2 (n - p)`` pairs sends, the odd one keeps
      it and later sends the result back);
    - ``tree``: a binomial tree rooted at rank 0, a reduce then a broadcast: the whole payload
      to the parent (every rank but 0) and to each child (rank ``r``'s children are
      ``r + 2^j < n`` for ``2^j`` below the lowest set bit of ``r``; rank 0's all ``2^j < n``).
      Over the group that is ``2 (n-1)`` payloads, as the ring, but rank 0 sends
      ``ceil(log2 n)`` of them.
    """
    n, r, b = int(size), int(rank), int(nbytes)
    if n <= 1:
        return 0
    if algorithm == "ring":
        return b * 2 * (n - 1) // n
    if algorithm == "rabenseifner":
        p = 1 << (n.bit_length() - 1)
        extra = n - p
        if r < 2 * extra and r % 2 == 0:
            return b                                   # folded into its odd partner
        return b * 2 * (p - 1) // p + (b if r < 2 * extra else 0)
    if algorithm == "tree":
        low = (r & -r) if r else 1 << n.bit_length()
        children = sum(1 for j in range(n.bit_length()) if (1 << j) < low and r + (1 << j) < n)
        return b * ((1 if r else 0) + children)
    raise ValueError(f"all-reduce algorithm {algorithm!r}: no wire model (ring, rabenseifner, "
                     f"tree)")


@dataclass
class LedgerEntry:
    bytes: int = 0
    messages: int = 0
    seconds: float = 0.0
    intra: int = 0      # wire bytes on links inside a node
    inter: int = 0      # wire bytes on links between nodes
    tested: float = 0.0
    """Of ``seconds``, those spent in ``test`` calls of non-blocking operations: MPI's progress
    engine at work. On a CPU MPI that is mostly the rank copying the data itself (MPICH's
    shared memory moves a large message with a single-copy read, process_vm_readv, by the
    receiver); the rest of ``seconds`` is waiting."""


@dataclass
class Ledger:
    """Bytes, messages and seconds per (group, operation), since the last ``reset``."""

    entries: dict[tuple[str, str], LedgerEntry] = field(
        default_factory=lambda: defaultdict(LedgerEntry))
    in_flight: tuple[str, str, int, float] | None = None
    """(group, operation, group size, time.monotonic() at entry) of the call blocked now."""
    staging: LedgerEntry = field(default_factory=LedgerEntry)
    """Copies between arrays and MPI's host buffers (:mod:`mpipar.runtime.staging`): bytes copied
    either way, copies, seconds; apart from ``entries``, which hold what the planner predicts."""
    trace: list | None = None
    """When a list (a traced step: :mod:`mpipar.observe.trace`), every call is appended to it as
    ``(group, operation, start, end, bytes)`` in ``time.perf_counter()`` seconds, ``start`` =
    ``end`` - the seconds booked."""

    def begin(self, group: str, op: str, size: int) -> None:
        """Mark the call about to block (``add`` clears the mark when it returns)."""
        self.in_flight = (group, op, size, time.monotonic())

    def add(self, group: str, op: str, nbytes: int, seconds: float, wire: int = 0,
            link: str = "intra", tested: float = 0.0) -> None:
        """Count one call: its payload ``nbytes``, ``seconds`` (``tested`` of them in ``test``
        calls), and ``wire`` bytes on ``link``."""
        self.in_flight = None
        if self.trace is not None:
            end = time.perf_counter()
            self.trace.append((group, op, end - seconds, end, int(nbytes)))
        e = self.entries[(group, op)]
        e.bytes += int(nbytes)
        e.messages += 1
        e.seconds += seconds
        e.tested += tested
        setattr(e, link, getattr(e, link) + int(wire))

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

    def bytes_by_link(self) -> dict[str, dict[str, int]]:
        """``{group: {"intra": wire bytes, "inter": wire bytes}}`` of the groups that sent any."""
        out: dict[str, dict[str, int]] = {}
        for (group, _), e in self.entries.items():
            if e.intra or e.inter:
                links = out.setdefault(group, dict.fromkeys(LINKS, 0))
                links["intra"] += e.intra
                links["inter"] += e.inter
        return out

    def seconds_by_group(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (group, _), e in self.entries.items():
            out[group] += e.seconds
        return dict(out)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{"group/op": {"bytes", "messages", "seconds"}}`` for the metrics log."""
        return {f"{g}/{op}": {"bytes": e.bytes, "messages": e.messages, "seconds": e.seconds,
                              "intra": e.intra, "inter": e.inter}
                for (g, op), e in sorted(self.entries.items())}


class Request:
    """A non-blocking operation; ``wait`` (or a ``test`` that finds it complete) books it in the
    ledger, with the seconds spent blocked in ``wait`` and ``test``: the exposed time; then runs
    ``on_done`` (staged buffers copied back and returned to their pool)."""

    def __init__(self, req: MPI.Request | None, ledger: Ledger, group: str, op: str,
                 nbytes: int, size: int = 1, link: str = "intra",
                 on_done: Callable[[], None] | None = None, wire: int | None = None) -> None:
        self._req, self._ledger, self._group, self._op = req, ledger, group, op
        self._size, self._nbytes, self._link, self._on_done = size, nbytes, link, on_done
        self._wire = wire_bytes(op, nbytes, size) if wire is None else wire
        self._waited = self._tested = 0.0
        self.done = req is None

    def _book(self) -> None:
        self._ledger.add(self._group, self._op, self._nbytes, self._waited + self._tested,
                         self._wire, self._link, tested=self._tested)
        self.done = True
        if self._on_done is not None:
            self._on_done()

    def wait(self) -> None:
        if self.done:
            return
        t0 = time.perf_counter()
        self._ledger.begin(self._group, self._op, self._size)
        self._req.Wait()
        self._waited += time.perf_counter() - t0
        self._book()

    def test(self) -> bool:
        """Whether the operation has completed (it progresses MPI; never blocks)."""
        if self.done:
            return True
        t0 = time.perf_counter()
        complete = self._req.Test()
        self._tested += time.perf_counter() - t0
        if complete:
            self._book()
        return complete
