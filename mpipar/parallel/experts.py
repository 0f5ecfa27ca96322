"""The sparse blocks' exchange over the grid (:class:`mpipar.model.moe.ExpertExchange`), and the
mixture of experts' configuration rules.

A sequence split over sp has its balance-loss statistics summed over the sp group (the ranks
holding the other tokens of the same rows), so the loss and its gradient do not depend on the
split. Experts are unsplit by tp: each tp rank holds every expert (role ``replicated`` in the
placement table) and computes the sparse FFN on the whole stream it holds, as the tp ranks do
for the norms; its gradients are the same on every tp rank and counted once (tp rank 0).
"""
from __future__ import annotations

from typing import Any

from mpipar.config import ConfigError
from mpipar.kernels import moe as K_moe
from mpipar.layout import Layout
from mpipar.runtime.comm import Group

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


def check_config(layout: Layout) -> None:
    """The mixture of experts' rules with the layout: the sparse FFN runs on whole token rows, so
    not on tp sequence parallelism's token shards; its record is not offloaded."""
    m, p, t = layout.config.model, layout.config.parallel, layout.config.train
    if not m.moe_experts:
        return
    if p.tp_sequence_parallel and p.tp > 1:
        raise ConfigError("model.moe_experts with parallel.tp_sequence_parallel: not supported "
                          "(the sparse FFN needs whole token rows; experts are unsplit by tp)")
    if t.recompute == "offload":
        raise ConfigError("model.moe_experts with train.recompute='offload': not supported "
                          "(use none, selective or full)")
