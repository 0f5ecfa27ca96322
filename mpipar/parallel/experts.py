"""The sparse blocks' exchange over the grid (:class:`mpipar.model.moe.ExpertExchange`), and the
mixture of experts' configuration rules.

Expert parallelism (``--ep N``): groups of N consecutive ranks of dp x sp split the experts,
E/N each (:class:`ExpertParallel`); tokens travel to their experts' ranks and back by
all-to-all(v) over the ``ep`` group. Every rank still holds every expert's weights (the
placement replicates them over dp x sp): a rank's gradient of the experts it does not compute
is zero and the dp x sp reduction sums each expert's gradient from the ranks that computed it,
so the update equals the one-process run; the experts' weights, gradients and optimizer state
are not yet sharded over ep (memory as ep = 1).

A sequence split over sp has its balance-loss statistics summed over the sp group (the ranks
holding the other tokens of the same rows), so the loss and its gradient do not depend on the
split. Experts are unsplit by tp: each tp rank holds every expert (role ``replicated`` in the
placement table) and computes the sparse FFN on the whole stream it holds, as the tp ranks do
for the norms; its gradients are the same on every tp rank and counted once (tp rank 0).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mpipar.config import ConfigError
from mpipar.kernels import moe as K_moe
from mpipar.layout import Layout
from mpipar.parallel.traffic import Call, element_bytes
from mpipar.runtime.comm import Group
from mpipar.runtime.precision import Precision

Array = Any


class SequenceExperts:
    """Every expert on this rank; a sequence's statistics summed over the ``sp`` group."""

    def __init__(self, *, num_experts: int, sp: Group) -> None:
        self.local_experts = range(num_experts)
        self.sp = sp

    def sequence_sum(self, a: Array) -> Array:
        """``a`` ``[B, E]`` summed over sp (a new contiguous array)."""
        return self.sp.allreduce_(a.copy())

    def dispatch(self, xs: Array, counts: Array) -> tuple[Array, list[int], Any]:
        return xs, K_moe.offsets(counts), None

    def redispatch(self, xs: Array, handle: Any) -> Array:
        return xs

    def combine(self, ys: Array, handle: Any) -> Array:
        return ys


class ExpertParallel(SequenceExperts):
    """Experts split over the ``ep`` group (consecutive ranks of dp x sp): this rank computes
    experts ``[r E/ep, (r+1) E/ep)`` for the tokens of every rank of its group. Dispatch: the
    counts per (rank, local expert) first (all-to-all), then the rows (all-to-all-v), regrouped
    by local expert (source ranks in order, each source's rows in its order); combine and the
    gradients' dispatch retrace the same plan."""

    def __init__(self, *, num_experts: int, sp: Group, ep: Group, xp) -> None:
        super().__init__(num_experts=num_experts, sp=sp)
        self.ep, self.xp, self.per_rank = ep, xp, num_experts // ep.size
        self.local_experts = range(ep.rank * self.per_rank, (ep.rank + 1) * self.per_rank)

    def dispatch(self, xs: Array, counts: Array) -> tuple[Array, list[int], Any]:
        n, el = self.ep.size, self.per_rank
        mine = np.ascontiguousarray(K_moe.host(counts).reshape(n, el))    # [dest, local e]
        theirs = self.ep.alltoall(mine, np.empty_like(mine))              # [source, local e]
        send_rows, recv_rows = mine.sum(axis=1).tolist(), theirs.sum(axis=1).tolist()
        starts = np.cumsum(np.r_[0, theirs.reshape(-1)[:-1]]).reshape(n, el)
        regroup = np.concatenate([np.arange(starts[i, e], starts[i, e] + theirs[i, e])
                                  for e in range(el) for i in range(n)]).astype(np.int64)
        handle = (send_rows, recv_rows, self.xp.asarray(regroup))
        bounds = [0] + np.cumsum(theirs.sum(axis=0)).tolist()
        return self.redispatch(xs, handle), bounds, handle

    def redispatch(self, xs: Array, handle: Any) -> Array:
        send_rows, recv_rows, regroup = handle
        recv = self.xp.empty((sum(recv_rows),) + xs.shape[1:], xs.dtype)
        return self.ep.alltoallv(self.xp.ascontiguousarray(xs), send_rows, recv,
                                 recv_rows)[regroup]

    def combine(self, ys: Array, handle: Any) -> Array:
        send_rows, recv_rows, regroup = handle
        back = self.xp.empty_like(ys)
        back[regroup] = ys
        out = self.xp.empty((sum(send_rows),) + ys.shape[1:], ys.dtype)
        return self.ep.alltoallv(back, recv_rows, out, send_rows)


def expert_calls(layout: Layout, layers: list[int], passes: int, train: bool) -> list[Call]:
    """The sparse blocks' MPI calls of a rank holding blocks ``layers`` in a step (``train``) or
    a validation pass of ``passes`` forwards per chunk, with *uniform routing* (each expert gets
    ``A / E`` of a rank's ``A`` assignments; the ledger's real loads differ): per sparse block
    and forward, the counts' sum over sp (all-reduce), and under ep the counts (all-to-all) and
    the rows there and back (two all-to-all-v, each the ``A (ep-1)/ep`` rows to other ranks);
    backward sends the gradients' rows there and back again, and ``--recompute full`` repeats
    the forward's calls."""
    m, p, t = layout.config.model, layout.config.parallel, layout.config.train
    sparse = sum(1 for i in layers if m.is_sparse(i))
    forwards = passes * (1 + (train and t.recompute == "full"))
    dt = element_bytes(Precision.of(t, p).compute)
    tokens = layout.micro_batch_size * (t.seq_len // p.sp)
    calls = [Call("sp", "allreduce", layout.micro_batch_size * m.moe_experts * dt,
                  sparse * forwards)] if p.sp > 1 else []
    if p.ep > 1:
        rows = tokens * m.moe_top_k * (p.ep - 1) // p.ep
        calls += [Call("ep", "alltoall", m.moe_experts * 8, sparse * forwards),
                  Call("ep", "alltoallv", rows * m.hidden * dt,
                       sparse * (2 * forwards + 2 * passes * train))]
    return calls


def check_config(layout: Layout) -> None:
    """The mixture of experts' rules with the layout: the sparse FFN runs on whole token rows, so
    not on tp sequence parallelism's token shards; its record is not offloaded."""
    m, p, t = layout.config.model, layout.config.parallel, layout.config.train
    if p.ep < 1:
        raise ConfigError(f"parallel.ep={p.ep}: must be >= 1")
    if p.ep > 1 and not m.moe_experts:
        raise ConfigError(f"parallel.ep={p.ep}: needs a mixture of experts (--moe-experts)")
    if not m.moe_experts:
        return
    if m.moe_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep}: must divide model.moe_experts={m.moe_experts}")
    if (layout.dp * layout.sp) % p.ep:
        raise ConfigError(f"parallel.ep={p.ep}: must divide dp x sp = {layout.dp} x "
                          f"{layout.sp} (the expert-parallel group is carved out of dp x sp)")
    if p.tp_sequence_parallel and p.tp > 1:
        raise ConfigError("model.moe_experts with parallel.tp_sequence_parallel: not supported "
                          "(the sparse FFN needs whole token rows; experts are unsplit by tp)")
    if t.recompute == "offload":
        raise ConfigError("model.moe_experts with train.recompute='offload': not supported "
                          "(use none, selective or full)")
