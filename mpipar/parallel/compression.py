"""Gradient compression with error feedback: what a compressed reduction sends, as bytes.

Two codecs, free of MPI, allocating from the array module they are given (the kernel
backend's ``xp``: NumPy or CuPy); :class:`mpipar.parallel.data_parallel.reducer.GradReducer` moves their bytes.

- :class:`Int8Codec`: each ``BLOCK`` elements become int8 values ``rint(x / s)`` with one
  float32 scale ``s = max|x| / 127``, packed per piece as ``[int8 values | float32 scales]``
  (``1 + 4 / BLOCK`` bytes an element). The reduction sends every rank's pieces to their owners
  (all-to-all), each owner sums the decoded pieces, re-encodes its sum and all-gathers it.
- :class:`TopKCodec`: the ``k = ceil(ratio * n)`` elements of largest magnitude, packed as
  ``[values | int32 indices]``; every rank all-gathers every rank's and adds them up.

**Error feedback** (Seide et al. 2014; Karimireddy et al. 2019): what a rank did not send —
``x - decode(encode(x))`` — is its *residual*, added to what it compresses next step, so over
steps everything is sent. :meth:`Codec.encode_feedback` does it in place on a residual buffer
the caller keeps (one per compressed direction). Decoding is deterministic and every rank
decodes the same bytes in the same order, so every rank ends with the same sum.
"""
from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Protocol

Array = Any
BLOCK = 128
"""Elements per int8 scale (the int8 payload is ``1 + 4 / BLOCK`` bytes an element)."""


class Codec(Protocol):
    """Encodes flat pieces of a gradient into bytes and back."""

    name: str

    def packed_bytes(self, n: int, itemsize: int) -> int:
        """Bytes one encoded piece of ``n`` elements of ``itemsize`` bytes takes."""

    def encode_feedback(self, x: Array, residual: Array | None, out: Array) -> None:
        """Encode ``x + residual`` (``x`` ``[pieces, n]``, modified) into ``out`` ``[pieces,
        packed_bytes]`` (uint8); the residual becomes what was not sent."""


class Int8Codec:
    """int8 values with a float32 scale per ``block`` elements."""

    name = "int8"

    def __init__(self, xp: ModuleType, block: int = BLOCK) -> None:
        self.xp, self.block = xp, block

    def packed_bytes(self, n: int, itemsize: int = 4) -> int:
        if n % self.block:
            raise ValueError(f"int8 pieces of {n} elements: must be a multiple of {self.block}")
        return n + 4 * (n // self.block)

    def encode(self, x: Array, out: Array) -> None:
        """``x`` ``[pieces, n]`` (n a multiple of the block) -> ``out`` ``[pieces, n + 4 n /
        block]`` uint8: the int8 values, then the float32 scales."""
        xp = self.xp
        pieces, n = x.shape
        blocks = x.reshape(pieces, n // self.block, self.block)
        scale = (xp.abs(blocks).max(axis=2) / 127.0).astype(xp.float32)
        safe = xp.where(scale > 0, scale, 1.0).astype(x.dtype)
        q = xp.clip(xp.rint(blocks / safe[:, :, None]), -127, 127).astype(xp.int8)
        out[:, :n] = q.reshape(pieces, n).view(xp.uint8)
        out[:, n:] = scale.view(xp.uint8)

    def decode(self, packed: Array, out: Array) -> Array:
        """``packed`` ``[pieces, P]`` uint8 -> ``out`` ``[pieces, n]`` (its dtype); returns it."""
        xp = self.xp
        pieces, n = out.shape
        q = packed[:, :n].view(xp.int8).reshape(pieces, n // self.block, self.block)
        scale = xp.ascontiguousarray(packed[:, n:]).view(xp.float32).astype(out.dtype)
        xp.multiply(q, scale[:, :, None], out=out.reshape(q.shape))
        return out

    def decode_sum(self, packed: Array, out: Array) -> Array:
        """Sum of the decoded pieces of ``packed`` ``[pieces, P]``, in piece order, into
        ``out`` ``[n]``; returns it."""
        xp = self.xp
        parts = self.decode(packed, xp.empty((packed.shape[0], out.size), out.dtype))
        out[...] = parts[0]
        for part in parts[1:]:
            out += part
        return out

    def encode_feedback(self, x: Array, residual: Array | None, out: Array) -> None:
        if residual is not None:
            x += residual.reshape(x.shape)
        self.encode(x, out)
        if residual is not None:
            xp = self.xp
            xp.subtract(x, self.decode(out, xp.empty_like(x)), out=residual.reshape(x.shape))


class TopKCodec:
    """The ``ceil(ratio * n)`` largest-magnitude elements of a piece, as values and indices."""

    name = "topk"

    def __init__(self, xp: ModuleType, ratio: float) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"topk ratio={ratio}: must be in (0, 1]")
        self.xp, self.ratio = xp, ratio

    def k(self, n: int) -> int:
        return max(1, math.ceil(self.ratio * n))

    def packed_bytes(self, n: int, itemsize: int) -> int:
        return self.k(n) * (itemsize + 4)

    def encode(self, x: Array, out: Array) -> Array:
        """``x`` ``[1, n]`` -> ``out`` ``[1, k * (itemsize + 4)]`` uint8 (values, then int32
        indices, ascending); returns the indices."""
        xp = self.xp
        flat = x.reshape(-1)
        k = self.k(flat.size)
        idx = xp.sort(xp.argpartition(-xp.abs(flat), k - 1)[:k])
        vb = k * flat.itemsize
        out[0, :vb] = xp.ascontiguousarray(flat[idx]).view(xp.uint8)
        out[0, vb:] = idx.astype(xp.int32).view(xp.uint8)
        return idx

    def decode_sum(self, packed: Array, out: Array) -> Array:
        """Sum of the sparse pieces of ``packed`` ``[pieces, P]``, in piece order, into the
        dense ``out`` ``[n]`` (zeroed first); returns it."""
        xp = self.xp
        k = self.k(out.size)
        vb = k * out.itemsize
        out.fill(0)
        for piece in packed:
            values = xp.ascontiguousarray(piece[:vb]).view(out.dtype)
            index = xp.ascontiguousarray(piece[vb:]).view(xp.int32)
            out[index] += values
        return out

    def encode_feedback(self, x: Array, residual: Array | None, out: Array) -> None:
        if residual is not None:
            x += residual.reshape(x.shape)
        idx = self.encode(x, out)
        if residual is not None:
            r = residual.reshape(-1)
            r[...] = x.reshape(-1)
            r[idx] = 0


def local_work_seconds(codec: Codec, elements: int = 1 << 20, group: int = 2,
                       dtype: str = "float32", repeats: int = 3) -> float:
    """Seconds per element of what a rank computes in one compressed reduction of
    ``elements`` over ``group`` ranks (encoding with error feedback, decoding and summing what
    it receives; int8 also re-encodes its sum), the fastest of ``repeats``: the planner's probe
    of compression's cost (pure arithmetic, no MPI)."""
    import time

    xp = codec.xp
    x = xp.asarray(xp.linspace(-1.0, 1.0, elements, dtype=dtype) ** 3)
    residual = xp.zeros_like(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        if isinstance(codec, Int8Codec):
            n = elements // group
            packed = xp.empty((group, codec.packed_bytes(n)), xp.uint8)
            codec.encode_feedback(x.copy().reshape(group, n), residual, packed)
            total = codec.decode_sum(packed, xp.empty(n, x.dtype))
            codec.encode_feedback(total.reshape(1, n), residual[:n], packed[:1])
            codec.decode(packed, xp.empty((group, n), x.dtype))
        else:
            packed = xp.empty((1, codec.packed_bytes(elements, x.itemsize)), xp.uint8)
            codec.encode_feedback(x.copy().reshape(1, -1), residual, packed)
            codec.decode_sum(xp.concatenate([packed] * group), xp.empty_like(x))
        best = min(best, time.perf_counter() - t0)
    return best / elements
