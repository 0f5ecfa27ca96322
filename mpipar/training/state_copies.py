"""``--state-copies 1``: every rank's share of the training state kept on a partner rank, so
that ``--on-rank-failure shrink`` restores any layout (ZeRO, tp, pp, sp, ep) from the survivors'
memory instead of the last checkpoint.

A rank's share is its :meth:`mpipar.training.state.TrainState.pieces`: the unique state it
reports to a checkpoint (master weights and optimizer moments; every element of every global
tensor is reported by exactly one rank of the world). At the start of each step every rank

- keeps a host copy of its own share (its live state moves on during the step), and
- sends that copy to its *holder* and receives the share of the rank it holds for, one
  ``sendrecv`` on the group ``copy`` (booked in the rank's ledger like every call of a step).

The holder of rank ``r`` is ``(r + s) % world``, ``s`` the smallest shift that puts every rank's
holder on another node (:func:`holders`; ``s = 1`` on one node). The last
:data:`mpipar.training.recovery.COPIES_KEPT` steps' copies are kept (a survivor may be one step
ahead of another when a failure reaches them): a rank holds ``COPIES_KEPT`` x (its share + its
partner's share), and sends its share once a step; :mod:`mpipar.plan.state_copies` predicts both.

After a failure, when every lost rank's holder survived, the survivors pool their own shares and
the copies of the lost ones (:func:`assemble`): the whole state as global tensors, which the
rebuilt rank of the smaller layout loads region by region through
:meth:`~mpipar.training.state.TrainState.load`, exactly as it reads a checkpoint. The pooling is
an all-gather: each survivor holds the whole state for the length of the recovery.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpipar.runtime.comm import Group
from mpipar.runtime.device import host_copy

GROUP = "copy"
BASE_KINDS = ("param", "exp_avg", "exp_avg_sq")


def holders(nodes: list[Any]) -> list[int]:
    """The holder of each rank's copy, by rank: ``(r + s) % n`` for the smallest shift ``s``
    that puts every holder on another node than its rank (``nodes``: each rank's node), else
    ``s = 1`` (one node; a single rank holds its own)."""
    n = len(nodes)
    for s in range(1, n):
        if all(nodes[(r + s) % n] != nodes[r] for r in range(n)):
            return [(r + s) % n for r in range(n)]
    return [(r + 1) % n for r in range(n)]


class Share:
    """One rank's share of the state at the start of a step: ``meta`` lists its pieces
    ``(kind, name, lo, hi)``, ``regions`` each name's ``(global region, local part, local
    shape)``, ``values`` their values end to end (the masters' dtype)."""

    def __init__(self, meta: list[tuple[str, str, int, int]],
                 regions: dict[str, tuple], values: np.ndarray, moe_bias: dict) -> None:
        self.meta, self.regions, self.values, self.moe_bias = meta, regions, values, moe_bias

    @classmethod
    def of(cls, rank) -> "Share":
        state = rank.state
        meta, parts = [], []
        for kind, name, lo, hi, values in state.pieces(host_copy):
            meta.append((kind, name, lo, hi))
            parts.append(np.asarray(values, dtype=state.dtype).reshape(-1))
        regions = {name: (*state.region(name), state.local_shape(name))
                   for _, name, _, _ in meta}
        values = np.concatenate(parts) if parts else np.zeros(0, state.dtype)
        return cls(meta, regions, values,
                   {k: np.array(v) for k, v in rank.model.routing.host().items()})


class StateCopies:
    """This rank's own shares and its partner's, by step (module docstring)."""

    def __init__(self, group: Group, nodes: list[Any], kept: int) -> None:
        self.group, self.kept = group, kept
        self.holder = holders(nodes)
        self.holds_for = self.holder.index(group.rank)
        self.own: dict[int, Share] = {}
        self.partner: dict[int, Share] = {}
        self._partner_meta: tuple | None = None

    def refresh(self, rank, step: int) -> None:
        """Step ``step`` begins: copy this rank's share and swap it with the partners."""
        if step in self.own:
            return
        mine = Share.of(rank)
        dest, source = self.holder[self.group.rank], self.holds_for
        if self._partner_meta is None:   # what the partner sends never changes: once, unbooked
            self._partner_meta = self.group.comm.sendrecv(
                (mine.meta, mine.regions, mine.values.size), dest, source=source)
        meta, regions, size = self._partner_meta
        got = self.group.sendrecv(mine.values, dest, np.empty(size, mine.values.dtype), source)
        # the partner's routing biases travel pickled with the copy's metadata: a few scalars
        bias = self.group.comm.sendrecv(mine.moe_bias, dest, source=source)
        self.own[step], self.partner[step] = mine, Share(meta, regions, got, bias)
        for old in sorted(self.own)[:-self.kept]:
            del self.own[old], self.partner[old]

    def steps(self) -> list[int]:
        return sorted(self.own)

    def contribution(self, step: int, failed: list[int]) -> dict[int, Share]:
        """What this rank adds to the pool (:func:`assemble`): its own share of ``step`` under
        its old rank, and the copy it holds when that rank is among ``failed``."""
        out = {self.group.rank: self.own[step]}
        if self.holds_for in failed:
            out[self.holds_for] = self.partner[step]
        return out


def recoverable(old_world: int, holder: list[int], failed: list[int]) -> bool:
    """Whether every failed rank's holder survived."""
    return len(holder) == old_world and all(holder[f] not in failed for f in failed)


def assemble(shares: dict[int, Share], shapes: dict[str, tuple[int, ...]]
             ) -> tuple[dict[tuple[str, str], np.ndarray], set[str], dict]:
    """The global tensors ``{(kind, name): array}`` of every old rank's share, the kinds beyond
    parameters and moments they hold, and the routing biases."""
    tensors: dict[tuple[str, str], np.ndarray] = {}
    bias: dict = {}
    for share in shares.values():
        at = 0
        for kind, name, lo, hi in share.meta:
            glob, loc, local_shape = share.regions[name]
            values = share.values[at:at + hi - lo]
            at += hi - lo
            index = np.arange(math.prod(local_shape)).reshape(local_shape)[loc]
            chosen = (index >= lo) & (index < hi)
            whole = tensors.setdefault((kind, name), np.zeros(shapes[name], share.values.dtype))
            whole[glob][chosen] = values[index[chosen] - lo]
        bias.update(share.moe_bias)
    kinds = {kind for kind, _ in tensors} - set(BASE_KINDS)
    return tensors, kinds, bias
