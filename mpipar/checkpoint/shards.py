"""What a checkpoint needs of one rank's training state, and how global regions reach its shards.

A checkpoint stores global tensors; a rank holds pieces of them (tensor-parallel shards, ZeRO's
owned slices, vocabulary padding rows that belong to no global tensor). :class:`RankState` is the
whole of what saving and loading ask of the training side (the engine passes its
:class:`~mpipar.training.state.TrainState`, which has this shape): its share of the unique state
as :data:`Piece` s going out, global regions read through a :data:`Reader` coming in.
:func:`read_shard` is how any layout (training, or generation under its own tp x pp) fills one
local shard from a checkpoint of any other layout, and :func:`require_finite` what the training
side asks of every tensor it loads.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from mpipar.checkpoint.directory import CheckpointError
from mpipar.parallel.placement import Placement

Slices = tuple[slice, ...]

Reader = Callable[[str, str, Slices], np.ndarray]
"""``read(kind, name, region)``: ``region`` of the global tensor ``kind/name`` (kind "param",
"exp_avg", "exp_avg_sq", or a residual kind the checkpoint holds)."""

Piece = tuple[str, str, int, int, Any]
"""``(kind, name, lo, hi, values)``: ``[lo, hi)`` a range of the row-major flattened local shard
of ``name``, ``values`` its ``hi - lo`` values as a 1-D host array."""


class RankState(Protocol):
    """One rank's share of the training state, seen as pieces of global tensors."""

    dtype: np.dtype
    """The dtype the tensors are held (and saved) in."""

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Global shape of every parameter of the model, in forward order (the order of the
        index's groups)."""

    @property
    def step(self) -> int:
        """Optimizer updates applied so far."""

    def local_shape(self, name: str) -> tuple[int, ...]:
        """Shape of this rank's local shard of ``name``, padding rows included."""

    def region(self, name: str) -> tuple[Slices, Slices]:
        """(the region of the global tensor ``name`` this rank's shard covers, the part of the
        local shard holding it)."""

    def pieces(self, host: Callable[[Any], np.ndarray] = ...) -> Iterator[Piece]:
        """This rank's share of the unique state: every element of every global tensor of every
        kind is reported by exactly one rank of the world; ``host`` (when given) makes each
        piece's host array (a copy that outlives the step, for a background write)."""

    def load(self, read: Reader, step: int, kinds: set[str] = frozenset()) -> None:
        """Set every tensor of this rank from ``read`` (global regions), the optimizer's update
        count from ``step``, and the state of ``kinds`` (those the source holds beyond
        parameters and moments). Collective-free."""


def read_shard(read: Reader, kind: str, placement: Placement, tp_rank: int, tp_size: int,
               dtype: np.dtype) -> np.ndarray:
    """tp rank ``tp_rank``'s shard of the global tensor ``kind/<placement.name>``, read region
    by region through ``read`` (vocabulary padding rows stay zero), as a host array of
    ``dtype`` shaped ``placement.local_shape(tp_size)``: how a checkpoint of any layout loads
    into this one."""
    glob, loc = placement.region(tp_rank, tp_size)
    full = np.zeros(placement.local_shape(tp_size), dtype)
    full[loc] = read(kind, placement.name, glob)
    return full


class NonFiniteError(CheckpointError):
    """A tensor to load holds a NaN or an infinity."""


def require_finite(values: np.ndarray, what: str) -> None:
    """Raise NonFiniteError naming ``what`` (the tensor) when ``values`` holds a NaN or an
    infinity: a model loaded with one computes NaN from its first step."""
    finite = np.isfinite(values)
    if finite.all():
        return
    bad = values[~finite]
    first = tuple(int(i) for i in np.argwhere(~finite)[0])
    raise NonFiniteError(f"{what} holds {bad.size} non-finite value(s) of {values.size} "
                         f"({int(np.isnan(bad).sum())} NaN, {int(np.isinf(bad).sum())} "
                         f"infinite; the first at index {first}); training from it would "
                         f"compute NaN from step 1")
