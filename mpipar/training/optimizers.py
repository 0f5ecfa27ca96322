"""The ``--optimizer`` modes (:data:`OPTIMIZERS`: AdamW, Muon) and Muon on every layout.

A mode is an :class:`OptimizerMode`: it checks its settings (:meth:`~OptimizerMode.check`) and
builds the rank's optimizer over the reducer (ZeRO-0/1) or the sharded units (ZeRO-2/3)
(:meth:`~OptimizerMode.build`); the engine only sees :class:`mpipar.training.optim.Optimizer`.

:class:`Muon` updates the decoder blocks' matrices (:func:`mpipar.training.muon.is_muon_matrix`)
with Muon and hands every other parameter to AdamW (:class:`~mpipar.training.optim.AdamW` or
:class:`~mpipar.training.optim.ZeroAdamW` over those names). The momentum is elementwise, so
each rank keeps it for exactly the elements whose AdamW moments it would keep (its tp shard,
its ZeRO-owned slices); only Newton-Schulz needs a matrix whole. Each matrix gets one owner,
chosen by :func:`assign_owners` to balance the Newton-Schulz FLOPs over the ranks that hold
pieces of it (Megatron's layer-wise distributed optimizer): the pieces of its update travel to
the owner (ZeRO-1/2/3: one all-to-all-v over the shard group assembles each tp shard; tp: one
all-to-all-v over tp assembles the matrix), the owner orthogonalises it, and the orthogonalised
pieces travel back the same way (:class:`PieceExchange`). Every call goes through
:class:`mpipar.runtime.comm.Group`, so the ledger books it. At ZeRO-0 every data-parallel
replica orthogonalises its own copy, as AdamW updates its own copy.

Checkpoints: a matrix's momentum buffer is saved as its ``exp_avg`` (its ``exp_avg_sq`` as
zeros), so the checkpoint format is AdamW's and any layout loads it; the run's
``train.optimizer`` is recorded in its configuration, and a resume under another optimizer is
refused unless ``--reset-optimizer``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar.config import ConfigError, TrainConfig
from mpipar.layout import Layout
from mpipar.model.lora import Lora
from mpipar.parallel.placement import PlacementTable
from mpipar.runtime.comm import Group
from mpipar.training import muon
from mpipar.training.optim import (IDLE, AdamW, AdamWConfig, ExpertSplitOptimizer, Optimizer,
                                   StatePiece, ZeroAdamW, build_optimizer, grad_norm_sq,
                                   sum_squares)

Index = tuple[slice, ...]


class PieceExchange:
    """Pieces of named arrays held across ``group``, gathered whole on each array's owner and
    scattered back, each way one all-to-all-v of the pieces' elements.

    ``pieces[r]``: group rank r's pieces, ``(name, index)`` with ``index`` the region of the whole
    array (shape ``shapes[name]``) it holds, at most one per name; ``owner[name]``: the group rank
    that assembles ``name``. Every rank of the group builds it with the same arguments."""

    def __init__(self, group: Group, pieces: list[list[tuple[str, Index]]],
                 shapes: Mapping[str, tuple[int, ...]], owner: Mapping[str, int]) -> None:
        self.group, self.shapes, self.owner = group, dict(shapes), dict(owner)
        self.pieces = [sorted(p, key=lambda item: item[0]) for p in pieces]
        me = group.rank
        self.mine = {name: index for name, index in self.pieces[me]}
        self.assembled = sorted({n for p in self.pieces for n, _ in p if self.owner[n] == me})

    @staticmethod
    def _size(index: Index) -> int:
        n = 1
        for s in index:
            n *= s.stop - s.start
        return n

    def _rows(self, rank: int, to: int) -> int:
        """Elements group rank ``rank`` holds of the arrays group rank ``to`` owns."""
        return sum(self._size(i) for n, i in self.pieces[rank] if self.owner[n] == to)

    def gather(self, values: Mapping[str, Any], xp: Any, dtype: Any) -> dict[str, Any]:
        """``values[name]``: this rank's piece (flat); the arrays this rank owns, whole."""
        g = self.group
        parts = [values[n].reshape(-1) for r in range(g.size)
                 for n, _ in self.pieces[g.rank] if self.owner[n] == r]
        send = xp.concatenate(parts) if parts else xp.zeros(0, dtype)
        recv_rows = [self._rows(r, g.rank) for r in range(g.size)]
        recv = xp.empty(sum(recv_rows), dtype)
        g.alltoallv(send, [self._rows(g.rank, r) for r in range(g.size)], recv, recv_rows)
        whole = {n: xp.zeros(self.shapes[n], dtype) for n in self.assembled}
        at = 0
        for r in range(g.size):
            for n, index in self.pieces[r]:
                if self.owner[n] == g.rank:
                    k = self._size(index)
                    whole[n][index] = recv[at:at + k].reshape(whole[n][index].shape)
                    at += k
        return whole

    def scatter(self, whole: Mapping[str, Any], xp: Any, dtype: Any) -> dict[str, Any]:
        """``whole``: the arrays this rank owns; this rank's piece of each array it holds (flat)."""
        g = self.group
        parts = [whole[n][index].reshape(-1) for r in range(g.size)
                 for n, index in self.pieces[r] if self.owner[n] == g.rank]
        send = xp.concatenate(parts) if parts else xp.zeros(0, dtype)
        recv_rows = [self._rows(g.rank, r) for r in range(g.size)]
        recv = xp.empty(sum(recv_rows), dtype)
        g.alltoallv(send, [self._rows(r, g.rank) for r in range(g.size)], recv, recv_rows)
        out, at = {}, 0
        for r in range(g.size):
            for n, index in self.pieces[g.rank]:
                if self.owner[n] == r:
                    k = self._size(index)
                    out[n] = recv[at:at + k]
                    at += k
        return out


def assign_owners(matrices: Mapping[str, tuple[int, int]], split: Collection[str], slots: int,
                  tp: int, steps: int) -> dict[str, tuple[int, int]]:
    """Owner ``(shard slot, tp rank)`` of each matrix (name -> global shape), balancing the
    Newton-Schulz FLOPs greedily, largest first: a tp-``split`` matrix goes to the least loaded
    (slot, tp rank); one every tp rank holds whole is orthogonalised by every tp rank of one
    slot (tp rank 0 named). The same answer on every rank."""
    load = [[0] * tp for _ in range(slots)]
    owners = {}
    order = sorted(matrices, key=lambda n: (-muon.ns_flops(*matrices[n], steps), n))
    for name in order:
        flops = muon.ns_flops(*matrices[name], steps)
        if name in split:
            a, b = min(((a, b) for a in range(slots) for b in range(tp)),
                       key=lambda ab: load[ab[0]][ab[1]])
            load[a][b] += flops
        else:
            a, b = min(range(slots), key=lambda a: max(load[a])), 0
            load[a] = [x + flops for x in load[a]]
        owners[name] = (a, b)
    return owners


@dataclass
class _Piece:
    """This rank's part of one Muon matrix: elements ``[start, stop)`` of its flattened local
    (tp) shard, as views of the master weights and the gradient, and their momentum."""

    p: Any
    g: Any
    buf: Any
    start: int
    stop: int


class Muon:
    """Muon for the decoder blocks' matrices of one reducer, AdamW (``rest``) for its other
    parameters (module docstring). ``zero``: the ZeRO stage (>= 1: the reducer's owned slices);
    ``tensor``: the tp group and placement (which matrices tp splits, which region each tp rank
    holds)."""

    def __init__(self, zero: int, reducer, cfg: AdamWConfig, mcfg: muon.MuonConfig,
                 decay: Mapping[str, bool], table: PlacementTable, tp: Group,
                 catch_up: bool = False) -> None:
        self.zero, self.reducer, self.cfg, self.mcfg = zero, reducer, cfg, mcfg
        shapes = {n: table[n].spec.shape for n in reducer.local_shapes()}
        names = sorted(n for n, s in shapes.items() if muon.is_muon_matrix(n, s))
        self.shapes = {n: shapes[n] for n in names}
        self.rest = _rest_optimizer(zero, reducer, cfg, decay, set(names), catch_up)
        self.pieces = dict(self._local_pieces(names))
        self.step_count, self.grad_scale = 0, 1.0
        self._exchanges(table, tp)

    def _local_pieces(self, names: list[str]) -> Iterator[tuple[str, _Piece]]:
        """Each matrix's piece: the whole local shard (ZeRO-0, its own momentum buffer), or
        the owned slice (ZeRO-1/2/3, its momentum in the AdamW first-moment buffer that spans
        the slice anyway)."""
        red, xp, wanted = self.reducer, self.reducer.xp, set(names)
        if not self.zero:
            for n in names:
                p, g = red.masters[n].reshape(-1), red.grads[n].reshape(-1)
                yield n, _Piece(p, g, xp.zeros_like(p), 0, p.size)
            return
        for b, n, lo, hi in red.owned_pieces():
            if n in wanted and hi > lo:
                a0, _ = red.owned_range(b)
                start = a0 + lo - b.offsets[n][0]
                yield n, _Piece(b.owned[lo:hi], b.owned_grad[lo:hi],
                                self.rest.first_moment(b, lo, hi), start, start + hi - lo)

    def _exchanges(self, table: PlacementTable, tp: Group) -> None:
        """The owners and the two exchanges (over the shard group; over tp)."""
        shard = self.reducer.group if self.zero and self.reducer.group.size > 1 else None
        slots, slot = (shard.size, shard.rank) if shard is not None else (1, 0)
        split = {n for n in self.shapes if table[n].split_dim is not None and tp.size > 1}
        self.split = split
        owners = assign_owners(self.shapes, split, slots, tp.size, self.mcfg.ns_steps)
        local = self.reducer.local_shapes()
        self.shard_exchange = None
        if shard is not None:
            mine = [(n, q.start, q.stop) for n, q in self.pieces.items()]
            held = shard.allgather_object(mine)
            self.shard_exchange = PieceExchange(
                shard, [[(n, (slice(a, b),)) for n, a, b in r] for r in held],
                {n: (math.prod(local[n]),) for n in self.shapes},
                {n: owners[n][0] for n in self.shapes})
        self.tp_exchange = None
        if split:
            pieces = [[(n, table[n].region(t, tp.size)[0]) for n in sorted(split)
                       if owners[n][0] == slot] for t in range(tp.size)]
            self.tp_exchange = PieceExchange(tp, pieces, self.shapes,
                                             {n: owners[n][1] for n in split})
        # What this rank orthogonalises: the matrices it assembles whole.
        self.assembles = ({n for n in split if owners[n] == (slot, tp.rank)}
                          | {n for n in self.shapes if n not in split and owners[n][0] == slot})
        self.local = {n: local[n] for n in self.shapes}

    def grad_norm_sq(self, counted: Callable[[str], bool]) -> float:
        """As the AdamW it replaces: this rank's gradients (ZeRO: owned slices, summed over the
        shard group in one all-reduce)."""
        if not self.zero:
            return grad_norm_sq(self.reducer.grads, counted)
        red = self.reducer
        total = sum_squares(b.owned_grad[lo:hi] for b, name, lo, hi in red.owned_pieces()
                            if counted(name))
        return float(red.group.allreduce_(red.xp.array([total]))[0])

    def clip(self, max_norm: float, total_norm: float) -> float:
        self.grad_scale = self.rest.clip(max_norm, total_norm)
        return self.grad_scale

    def step(self, lr: float) -> None:
        """Muon on the matrices, then AdamW on the rest (which publishes the compute copies)."""
        self.step_count += 1
        scale, self.grad_scale = self.grad_scale, 1.0
        m, xp = self.mcfg, self.reducer.xp
        updates = {n: muon.momentum_update(q.buf, q.g, m.momentum, m.nesterov, scale)
                   for n, q in self.pieces.items()}
        ortho = self._orthogonalise(updates, xp)
        for n, q in self.pieces.items():
            rows, cols = self.shapes[n]
            muon.apply_update(q.p, ortho[n], lr, self.cfg.weight_decay,
                              m.adjust.ratio(rows, cols))
        self.rest.step(lr)

    def _orthogonalise(self, updates: dict[str, Any], xp: Any) -> dict[str, Any]:
        """This rank's pieces of NS(update) of every matrix, each matrix orthogonalised by its
        owner alone."""
        dtype = next((q.p.dtype for q in self.pieces.values()), None)
        if dtype is None:
            dtype = xp.float64
        local = (self.shard_exchange.gather(updates, xp, dtype) if self.shard_exchange
                 else updates)
        whole = (self.tp_exchange.gather({n: local[n] for n in self.split if n in local},
                                         xp, dtype) if self.tp_exchange else {})
        for n in self.assembles:
            if n not in self.split:
                whole[n] = local[n].reshape(self.local[n])
        ortho = {n: muon.newton_schulz(whole[n], self.mcfg.ns_steps) for n in self.assembles}
        back = self.tp_exchange.scatter(ortho, xp, dtype) if self.tp_exchange else {}
        for n in self.assembles:
            if n not in self.split:
                back[n] = ortho[n].reshape(-1)
        if self.shard_exchange:
            return self.shard_exchange.scatter(back, xp, dtype)
        return back

    def state(self) -> Iterator[StatePiece]:
        """AdamW's state of the rest; each matrix's momentum as its ``exp_avg`` (its
        ``exp_avg_sq``, and wait counts with top-k's catch-up, as zeros)."""
        yield from self.rest.state()
        if not self.zero and self.reducer.group is not None and self.reducer.group.rank != 0:
            return
        extra = ("exp_avg_sq",) + ((IDLE,) if self.rest.catch_up is not None else ())
        for n, q in sorted(self.pieces.items()):
            yield "exp_avg", n, q.start, q.stop, q.buf
            for kind in extra:
                yield kind, n, q.start, q.stop, self.reducer.xp.zeros_like(q.buf)

    def load_state(self, local: Callable[[str, str], Any], step: int,
                   kinds: Collection[str] = ()) -> None:
        self.rest.load_state(local, step, kinds)
        xp = self.reducer.xp
        for n, q in self.pieces.items():
            q.buf[...] = xp.asarray(local("exp_avg", n).reshape(-1)[q.start:q.stop],
                                    dtype=q.buf.dtype)
        self.step_count = int(step)


def _rest_optimizer(zero: int, reducer, cfg: AdamWConfig, decay: Mapping[str, bool],
                    matrices: set[str], catch_up: bool) -> Optimizer:
    """AdamW over the reducer's parameters other than ``matrices``."""
    sparse = (lambda: reducer.sparse_sums) if catch_up else None
    if zero:
        return ZeroAdamW(reducer, cfg, decay, sparse, skip=matrices)
    keep = [n for n in reducer.masters if n not in matrices]
    return AdamW({n: reducer.masters[n] for n in keep}, {n: reducer.grads[n] for n in keep},
                 cfg, {n: decay[n] for n in keep}, reducer.group, sparse,
                 publish=reducer.gather_params)


@dataclass(frozen=True)
class OptimizerMode:
    """One ``--optimizer``: how a rank builds it."""

    name: str
    muon: bool
    """Whether the blocks' matrices get Muon (else AdamW updates everything)."""

    def build(self, zero: int, reducer, cfg: AdamWConfig, decay: Mapping[str, bool],
              catch_up: bool, train: TrainConfig, table: PlacementTable, tp: Group) -> Optimizer:
        """The rank's optimizer over ``reducer`` (with the experts sharded over ep: one each
        for the dense weights and the experts)."""
        if not self.muon:
            return build_optimizer(zero, reducer, cfg, decay, catch_up)
        if hasattr(reducer, "experts"):
            parts = [{n: decay[n] for n in part.local_shapes()}
                     for part in (reducer.dense, reducer.experts)]
            return ExpertSplitOptimizer(
                self.build(zero, reducer.dense, cfg, parts[0], catch_up, train, table, tp),
                self.build(zero, reducer.experts, cfg, parts[1], False, train, table, tp),
                reducer.ep, reducer.xp)
        return Muon(zero, reducer, cfg, muon_config(train), decay, table, tp, catch_up)


OPTIMIZERS = {"adamw": OptimizerMode("adamw", muon=False),
              "muon": OptimizerMode("muon", muon=True)}
"""The ``--optimizer`` modes by name (the config field's choices, in this order)."""


def optimizer_mode(train: TrainConfig) -> OptimizerMode:
    """The mode ``train.optimizer`` names."""
    return OPTIMIZERS[train.optimizer]


def muon_config(train: TrainConfig) -> muon.MuonConfig:
    """Muon's settings of a run's train section."""
    return muon.MuonConfig(train.muon_momentum, train.muon_ns_steps, train.muon_nesterov,
                           muon.ADJUST_LR[train.muon_adjust_lr])


def check_config(layout: Layout) -> None:
    """Muon's settings, whichever optimizer runs; Muon without LoRA; ``--reset-optimizer``
    only with ``--resume`` (AdamW's and the schedule's rules:
    :func:`mpipar.training.optim.check_config`)."""
    t = layout.train
    problem = muon_config(t).problem()
    if problem is not None:
        raise ConfigError(f"train.{problem}")
    if optimizer_mode(t).muon and Lora.of(t) is not None:
        raise ConfigError(
            f"train.optimizer={t.optimizer!r} with train.lora_rank={t.lora_rank}: --optimizer "
            f"muon orthogonalises whole weight matrices, and under --lora-rank the only "
            f"trained matrices are the low-rank factors A and B, whose orthogonalised updates "
            f"are not LoRA; give --optimizer adamw with --lora-rank")
    if layout.train.reset_optimizer and not layout.train.resume:
        raise ConfigError("train.reset_optimizer=True: needs --resume (it starts a resumed "
                          "run's optimizer state afresh)")


def check_resume(saved: TrainConfig, now: TrainConfig, source: str) -> None:
    """A run resuming from a checkpoint of ``saved``'s run keeps its optimizer, or starts the
    optimizer state afresh when asked (``--reset-optimizer``); ConfigError otherwise."""
    if saved.optimizer != now.optimizer and not now.reset_optimizer:
        raise ConfigError(
            f"train.optimizer={now.optimizer!r}: the checkpoint {source} was trained with "
            f"{saved.optimizer!r}, whose state (moments, momentum buffers) does not carry over "
            f"to another optimizer; keep --optimizer {saved.optimizer}, or give "
            f"--reset-optimizer to start the optimizer state afresh")


def reset_state(optimizer: Optimizer, local_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The optimizer as a fresh one (``--reset-optimizer``): every moment and momentum zero, no
    update counted."""
    optimizer.load_state(lambda kind, name: np.zeros(local_shapes[name]), 0)
