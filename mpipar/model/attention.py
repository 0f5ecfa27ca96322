"""The attention core a decoder block calls, and the one that needs no other rank.

A block computes q, k, v (after RoPE) for its tokens and hands them to an *attention core*:
:class:`LocalAttention` here when one rank holds the whole sequence, or ring / Ulysses attention
over sequence parallelism (:mod:`mpipar.parallel.context`). A core says explicitly what its
backward reads, so the block's recomputation knows what it may drop:

- ``forward(q, k, v, positions, window) -> (out, saved)``: ``saved`` is what the core keeps
  beyond the block's own tensors (the lse, or Ulysses' all-to-all'ed copies); ``window`` is the
  block's sliding window (a query sees itself and the ``window - 1`` positions before it; 0 =
  full causal), which may differ from layer to layer;
- ``backward(dout, q, k, v, out, saved, window) -> (dq, dk, dv)``, in the dtype of the
  activations: the kernels' gradients are float32 under bf16 compute, and a core sums partial
  results (blocks of a ring, halos) in :func:`accumulator` dtype and rounds each gradient once,
  where it becomes an activation gradient (before a message that carries it as one);
- ``needs_inputs``: whether backward reads q, k, v (and ``out``) as given. When it does, the
  block keeps them (``--recompute none``) or recomputes q, k, v from its input
  (``selective``); when it does not, the block keeps none of them and passes None.

Shapes: q ``[B, S, hq, D]``, k/v ``[B, S, hkv, D]``, out ``[B, S, hq, D]``, lse ``[B, hq, S]``.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from mpipar.runtime.precision import is_bf16

Array = Any


def accumulator(dtype: Any) -> np.dtype:
    """The dtype partial results of activations of ``dtype`` are summed in (attention blocks and
    their gradients, RoPE tables): float32 for bfloat16 (rounded once, at the end), else the
    dtype itself."""
    return np.dtype(np.float32) if is_bf16(dtype) else np.dtype(dtype)


def as_activations(grads: tuple[Array, ...], like: Array) -> tuple[Array, ...]:
    """``grads`` in the dtype of the activation ``like`` (one rounding under bf16; no copy
    otherwise)."""
    return tuple(g.astype(like.dtype, copy=False) for g in grads)


class AttentionCore(Protocol):
    """Causal attention of this rank's queries over the whole (possibly distributed) sequence."""

    needs_inputs: bool

    def forward(self, q: Array, k: Array, v: Array,
                positions: np.ndarray) -> tuple[Array, Any]:
        """q ``[B, S, hq, D]``, k/v ``[B, S, hkv, D]``, global positions ``[S]`` -> (out, saved)."""

    def backward(self, dout: Array, q: Array | None, k: Array | None, v: Array | None,
                 out: Array, saved: Any) -> tuple[Array, Array, Array]:
        """dout ``[B, S, hq, D]`` -> (dq, dk, dv) for this rank's q, k, v."""


class LocalAttention:
    """Attention over a sequence held entirely by this rank (no SP): saves the lse only."""

    needs_inputs = True

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def forward(self, q: Array, k: Array, v: Array, positions: np.ndarray,
                window: int = 0) -> tuple[Array, Any]:
        offset = int(positions[0])
        out, lse = self.kernels.attention_fwd(q, k, v, offset, offset, True, window=window)
        return out, (lse, offset)

    def backward(self, dout, q, k, v, out, saved, window: int = 0):
        lse, offset = saved
        return as_activations(self.kernels.attention_bwd(q, k, v, out, lse, dout, offset, offset,
                                                         True, window=window), q)
