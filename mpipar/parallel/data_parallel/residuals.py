"""Error-feedback residuals in checkpoints: what a rank keeps of each compressed direction, as
ranges of the parameters (the kinds and their slots:
:mod:`mpipar.parallel.data_parallel.reducer`'s module docstring)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from mpipar.parallel.data_parallel.buckets import Bucket, FlatBuffers, param_ranges

RESIDUAL_SEND = "residual_send"
RESIDUAL_GATHER = "residual_gather"


def _residual_ranges(flat: FlatBuffers, b: Bucket) -> Iterator[tuple[str, Any, int]]:
    """(kind, residual buffer, its start in the bucket) of this rank's residuals."""
    slot = flat.groups.inter.rank
    if RESIDUAL_SEND in b.residual:
        yield f"{RESIDUAL_SEND}.{slot}", b.residual[RESIDUAL_SEND], flat.node_range(b)[0]
    if RESIDUAL_GATHER in b.residual:
        yield RESIDUAL_GATHER, b.residual[RESIDUAL_GATHER], flat.owned_range(b)[0]


def residual_kinds(flat: FlatBuffers) -> list[str]:
    """Every residual kind the ranks of the reduction's group save (each slot's sends, the
    owners' second direction): what tiles each of its parameters in a checkpoint."""
    held = flat.buckets[0].residual if flat.buckets else {}
    sends = ([f"{RESIDUAL_SEND}.{s}" for s in range(flat.groups.inter.size)]
             if RESIDUAL_SEND in held else [])
    return sends + ([RESIDUAL_GATHER] if RESIDUAL_GATHER in held else [])


def residual_pieces(flat: FlatBuffers) -> Iterator[tuple[str, str, int, int, Any]]:
    """``(kind, name, lo, hi, values)``: this rank's residuals as flat ranges ``[lo, hi)`` of
    its local shards."""
    for b in flat.buckets:
        for kind, buf, start in _residual_ranges(flat, b):
            for name, p_lo, p_hi, lo, hi in param_ranges(b, start, start + buf.size):
                yield kind, name, p_lo, p_hi, buf[lo:hi]


def load_residuals(flat: FlatBuffers, local: Callable[[str, str], Any], kinds: set[str]) -> None:
    """Set the residuals from ``local(kind, name)`` (this rank's whole local shard of a saved
    residual) given the residual ``kinds`` a checkpoint holds: slot by slot when it has this
    run's slots and codec, else their sum into slot 0."""
    slots = sorted(k for k in kinds if k.startswith(RESIDUAL_SEND + "."))
    mine = {k for b in flat.buckets[:1] for k, _, _ in _residual_ranges(flat, b)}
    exact = len(slots) == flat.groups.inter.size and \
        (RESIDUAL_GATHER in kinds) == (RESIDUAL_GATHER in mine)
    owed = slots + sorted(kinds & {RESIDUAL_GATHER})
    for b in flat.buckets:
        for kind, buf, start in _residual_ranges(flat, b):
            buf.fill(0)
            if not exact and (kind == RESIDUAL_GATHER or flat.groups.inter.rank != 0):
                continue
            for name, p_lo, p_hi, lo, hi in param_ranges(b, start, start + buf.size):
                for saved in ([kind] if exact else owed):
                    buf[lo:hi] += flat.xp.asarray(local(saved, name).reshape(-1)[p_lo:p_hi])
