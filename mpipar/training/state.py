"""The training state one rank holds, seen as pieces of global tensors (what checkpoints need:
:class:`mpipar.checkpoint.shards.RankState`).

A rank holds shards of some parameters (:mod:`mpipar.parallel.placement`) and the optimizer's
moments for them (all of them, or ZeRO's owned slices: :mod:`mpipar.training.optim`); at
ZeRO-2/3 the parameters are held as units sharded over dp x sp (:mod:`mpipar.parallel.fsdp`).
The state is the master weights and the moments (float32 under bf16 compute: the bf16 compute
copies are not state, they are refreshed from the masters after every load).
A checkpoint stores global tensors, so this module answers, for this rank:

- :meth:`TrainState.pieces`: its share of the unique state as flat ranges of its local shards,
  every element of every global tensor reported by exactly one rank of the world: parameters by
  dp = sp = 0 (ZeRO-2/3, and ZeRO-1 under bf16 compute: by the rank owning the slice), and, for
  tp-replicated ones, tp = 0
  (for a tied embedding, its first pipeline rank); moments by whichever rank the optimizer says
  (and the same tp and pp rules);
- :meth:`TrainState.region`: which region of a global tensor a local shard covers (vocabulary
  padding rows belong to no global tensor);
- :meth:`TrainState.load`: set every parameter and moment from a reader of global regions, so
  a checkpoint of any layout loads into this one.

With gradient compression and error feedback the state also holds the reducer's residuals, as
global tensors per slot (kinds ``residual_send.<slot>`` and ``residual_gather``: see
:mod:`mpipar.parallel.data_parallel` for what they are and how another layout loads them).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from mpipar.checkpoint.shards import Piece, Reader, Slices, read_shard, require_finite
from mpipar.parallel.data_parallel.reducer import GradReducer
from mpipar.parallel.experts.split import ExpertSplitReducer
from mpipar.parallel.fsdp.sharded import ShardedParams
from mpipar.parallel.placement import PlacementTable
from mpipar.runtime.device import to_host
from mpipar.training.optim import Optimizer


class TrainState:
    """This rank's parameters and optimizer state as pieces of global tensors (a
    :class:`~mpipar.checkpoint.shards.RankState`: what checkpoints save and load)."""

    def __init__(self, store: GradReducer | ExpertSplitReducer | ShardedParams, optimizer: Optimizer,
                 table: PlacementTable, *, tp_rank: int, tp_size: int, pp_rank: int,
                 dtype: np.dtype) -> None:
        """``store``: what holds this rank's parameters, the gradient reducer (ZeRO-0/1, whose
        error-feedback residuals are state too) or ZeRO-2/3's units; it says which master
        pieces this rank reports (``param_pieces``) and sets them (``load_local``).
        With the experts sharded over ep the store is the dense and the experts' reducers
        (:class:`~mpipar.parallel.experts.split.ExpertSplitReducer`): each expert is reported by
        the ranks of its ``ep_dp`` group alone. ``pp_rank``: its pipeline rank (a tied embedding is reported by its first pipeline rank
        only); ``dtype``: the masters' (what is saved)."""
        self.store, self.optimizer, self.table = store, optimizer, table
        self.reducer = None if isinstance(store, ShardedParams) else store
        self.tp_rank, self.tp_size, self.pp_rank = tp_rank, tp_size, pp_rank
        self.dtype = np.dtype(dtype)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Global shape of every trained parameter of the model, in forward order (under LoRA
        the adapters: the frozen base is no state of a run)."""
        return {p.name: p.spec.shape for p in self.table if p.trainable}

    @property
    def step(self) -> int:
        """Optimizer updates applied so far."""
        return self.optimizer.step_count

    def local_shape(self, name: str) -> tuple[int, ...]:
        return self.store.local_shapes()[name]

    def region(self, name: str) -> tuple[Slices, Slices]:
        """(region of the global tensor ``name`` this rank's shard covers, the part of the local
        shard holding it)."""
        return self.table[name].region(self.tp_rank, self.tp_size)

    def pieces(self, host=to_host) -> Iterator[Piece]:
        """``(kind, name, lo, hi, values)``: this rank's share of the unique state, ``[lo, hi)``
        a range of the flattened local shard of ``name``, ``values`` its host view or copy
        made by ``host`` (:func:`~mpipar.runtime.device.host_copy` for a copy that outlives the
        step)."""
        def owned(name: str) -> bool:
            return self.table[name].owned_by(self.tp_rank, self.pp_rank)

        for name, lo, hi, values in self.store.param_pieces():
            if owned(name):
                yield "param", name, lo, hi, host(values)
        residuals = self.reducer.residual_pieces() if self.reducer is not None else ()
        for kind, name, lo, hi, values in (*self.optimizer.state(), *residuals):
            if owned(name):
                yield kind, name, lo, hi, host(values)

    def load(self, read: Reader, step: int, kinds: set[str] = frozenset()) -> None:
        """Set every parameter and moment of this rank from ``read`` (global regions), the
        optimizer's update count from ``step``, and the residuals from those of ``kinds`` (the
        kinds the source holds beyond parameters and moments). A tensor holding a NaN or an
        infinity raises :class:`~mpipar.checkpoint.shards.NonFiniteError` naming it, before
        anything is trained from it. Collective-free."""
        def local(kind: str, name: str) -> np.ndarray:
            value = read_shard(read, kind, self.table[name], self.tp_rank, self.tp_size,
                               self.dtype)
            require_finite(value, f"{kind}/{name}")
            return value

        for name in self.store.local_shapes():
            self.store.load_local(name, local("param", name))
        self.optimizer.load_state(local, step, kinds)
        if self.reducer is not None:
            self.reducer.load_residuals(local, set(kinds))
