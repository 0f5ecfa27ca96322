"""RoPE of a stage's blocks: the rotation of queries and keys (and its inverse in backward)
at their global positions, or at packed documents' positions inside their documents, with the
model's frequency scaling (``rope_type``), whose dynamic rule depends on the length of the
whole sequence (``seq_len``), not of a rank's chunk. The tables are made once per position set.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mpipar.config import ModelConfig
from mpipar.model.attention import accumulator, documents_of

Array = Any


class Rotary:
    """The rotary embedding of one stage: ``rotate`` queries and keys at their positions."""

    def __init__(self, cfg: ModelConfig, kernels, seq_len: int) -> None:
        """``seq_len``: the length of the whole sequences whose positions are rotated (0: the
        largest position + 1)."""
        self.cfg, self.kernels, self.seq_len = cfg, kernels, seq_len
        self._rope: dict[bytes, tuple[Array, Array]] = {}

    def _cos_sin(self, positions: np.ndarray, dtype, local: bool) -> tuple[Array, Array]:
        """RoPE cos, sin ``[S, D/2]`` of ``positions`` for activations of ``dtype`` (computed
        once per position set; float32 tables for bf16 activations)."""
        dtype = accumulator(dtype)
        key = positions.tobytes() + np.dtype(dtype).str.encode() + bytes([local])
        if key not in self._rope:
            self._rope[key] = self._tables(positions, dtype, local)
        return self._rope[key]

    def _tables(self, positions: np.ndarray, dtype, local: bool) -> tuple[Array, Array]:
        """``local``: a sliding-window layer's tables of ``rope_local_theta``, unscaled."""
        c, xp = self.cfg, self.kernels.xp
        if local:
            return self.kernels.rope_cos_sin(xp.asarray(positions), c.head_dim,
                                             c.rope_local_theta, dtype)
        return self.kernels.rope_cos_sin(
            self.kernels.xp.asarray(positions), c.rope_dim, c.rope_theta, dtype,
            seq_len=self.seq_len, **c.rope.table_arguments(c))

    def rotate(self, xs: Sequence[Array], positions: np.ndarray, backward: bool = False,
               local: bool = False) -> list[Array]:
        """RoPE (``backward``: its inverse) of each of ``xs`` ``[B, S, h, D]`` at ``positions``;
        packed documents (:class:`~mpipar.model.attention.DocumentPositions`): each row at its
        tokens' positions inside their documents (tables made once per microbatch).
        ``local``: with a sliding-window layer's base (:meth:`ModelConfig.local_rope`)."""
        op = self.kernels.rope_bwd if backward else self.kernels.rope_fwd
        docs = documents_of(positions)
        if docs is None:
            cos, sin = self._cos_sin(positions, xs[0].dtype, local)
            return [op(x, cos, sin) for x in xs]
        dtype = accumulator(xs[0].dtype)   # float32 tables for bf16 activations, as above
        tables = docs.remember(("rope", np.dtype(dtype).str, local),
                               lambda: [self._tables(row, dtype, local) for row in docs.rope])
        return [self.kernels.xp.concatenate([op(x[b:b + 1], *tables[b]) for b in range(len(x))])
                for x in xs]
