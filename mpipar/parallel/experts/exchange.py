"""The sparse blocks' exchange (:class:`mpipar.model.moe.ExpertExchange`): the statistics of a
sequence split over sp summed over sp, and under ``--ep N`` the rows sent to their experts'
ranks and back by all-to-all(v) over the ``ep`` group."""
from __future__ import annotations

from typing import Any

import numpy as np

from mpipar.kernels import expert_routing
from mpipar.model.moe import Done, LocalExperts, Plan, Transfer
from mpipar.parallel.sequence_split import SeqLayout, balanced_chunks, split_parts
from mpipar.runtime.comm import Group, Request

Array = Any


def block_length(seq: SeqLayout) -> int:
    """The length ``L`` of the position blocks ``[j L, (j+1) L)`` that every sp rank's share of
    a sequence is a union of, whatever the microbatch: ``S / sp`` (contiguous; Ulysses and
    hybrid split as it or zigzag), ``S / (2 sp)`` (zigzag), the finest chunk of ``--sp-split
    balanced`` (its deals' chunks are unions of it). The capacity's per-sequence counts are
    summed over sp per block."""
    if seq.split == "balanced":
        per = seq.seq_len // seq.sp
        return per // balanced_chunks(per, seq.min_chunk)
    return seq.seq_len // split_parts(seq.sp, seq.split)


class SequenceExperts(LocalExperts):
    """Every expert on this rank; a sequence's statistics summed over the ``sp`` group, whose
    ranks hold the sequence as ``seq`` says (None: whole sequences). The rows stay on the rank
    (:class:`~mpipar.model.moe.LocalExperts`' plan and transfers)."""

    def __init__(self, *, num_experts: int, sp: Group, seq: SeqLayout | None = None) -> None:
        super().__init__(num_experts)
        self.sp, self.seq = sp, seq

    def sequence_sum(self, a: Array) -> Array:
        """``a`` ``[..., B, E]`` summed over sp (a new contiguous array)."""
        return self.sp.allreduce_(a.copy())

    def blocks(self, positions: np.ndarray) -> tuple[int, int]:
        """(``L``, ``G``): the sequences cut into ``G`` blocks of ``L`` positions, each held
        whole by one sp rank (:func:`block_length`)."""
        if self.seq is None:
            return int(np.max(positions)) + 1, 1
        L = block_length(self.seq)
        return L, self.seq.seq_len // L


class ExpertParallel(SequenceExperts):
    """Experts split over the ``ep`` group (consecutive ranks of dp x sp): this rank computes
    experts ``[r E/ep, (r+1) E/ep)`` for the tokens of every rank of its group. The plan: the
    counts per (rank, local expert) (all-to-all); the rows then travel by all-to-all-v, regrouped
    by local expert (this rank's own rows first, then the other source ranks' in order, each
    source's rows in its order); the way back and the gradients' retrace the same plan.
    ``overlap`` (``parallel.ep_overlap``, the default): the all-to-all-v are non-blocking
    (``Ialltoallv``), the sparse block computing what needs no message while they travel
    (:func:`mpipar.model.moe.experts_fwd`); else blocking. The same bytes either way."""

    def __init__(self, *, num_experts: int, sp: Group, ep: Group, xp,
                 seq: SeqLayout | None = None, overlap: bool = True) -> None:
        super().__init__(num_experts=num_experts, sp=sp, seq=seq)
        self.ep, self.xp, self.per_rank, self.overlap = ep, xp, num_experts // ep.size, overlap
        self.local_experts = range(ep.rank * self.per_rank, (ep.rank + 1) * self.per_rank)

    def plan(self, counts: Array) -> Plan:
        n, el, r = self.ep.size, self.per_rank, self.ep.rank
        mine = np.ascontiguousarray(expert_routing.host(counts).reshape(n, el))    # [dest, local e]
        theirs = self.ep.alltoall(mine, np.empty_like(mine))              # [source, local e]
        send_rows, recv_rows = mine.sum(axis=1).tolist(), theirs.sum(axis=1).tolist()
        starts = np.cumsum(np.r_[0, theirs.reshape(-1)[:-1]]).reshape(n, el)
        sources = [r] + [i for i in range(n) if i != r]                   # own rows first
        regroup = np.concatenate([np.arange(starts[i, e], starts[i, e] + theirs[i, e])
                                  for e in range(el) for i in sources]).astype(np.int64)
        handle = (send_rows, recv_rows, self.xp.asarray(regroup))
        bounds = [0] + np.cumsum(theirs.sum(axis=0)).tolist()
        return Plan(bounds, theirs[r].tolist(), sum(send_rows[:r]), handle)

    def send(self, xs: Array, plan: Plan) -> Transfer:
        send_rows, recv_rows, regroup = plan.handle
        recv = self.xp.empty((sum(recv_rows),) + xs.shape[1:], xs.dtype)
        return self._start(self.xp.ascontiguousarray(xs), send_rows, recv, recv_rows,
                           lambda rows: rows[regroup])

    def send_back(self, ys: Array, plan: Plan) -> Transfer:
        send_rows, recv_rows, regroup = plan.handle
        back = self.xp.empty_like(ys)
        back[regroup] = ys
        out = self.xp.empty((sum(send_rows),) + ys.shape[1:], ys.dtype)
        return self._start(back, recv_rows, out, send_rows, lambda rows: rows)

    def _start(self, send: Array, send_rows: list[int], recv: Array, recv_rows: list[int],
               then) -> Transfer:
        """The all-to-all-v of rows ``send`` -> ``recv``, non-blocking under ``overlap``; the
        transfer's rows are ``then(recv)``."""
        if not self.overlap:
            return Done(then(self.ep.alltoallv(send, send_rows, recv, recv_rows)))
        return Arriving(self.ep.ialltoallv(send, send_rows, recv, recv_rows), recv, then)


class Arriving:
    """Rows on their way: a request, its receive buffer, and what the rows are of it."""

    def __init__(self, request: Request, recv: Array, then) -> None:
        self.request, self.recv, self.then, self.rows = request, recv, then, None

    def test(self) -> bool:
        return self.request.test()

    def wait(self) -> Array:
        if self.rows is None:
            self.request.wait()
            self.rows = self.then(self.recv)
        return self.rows
