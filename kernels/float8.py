"""FP8 training's numerics on NumPy: the float8 formats, the scales, the saturating casts and a
model of the scaled GEMM that Hopper's tensor cores run through cuBLASLt.

A linear's operands are cast to 8-bit floats after multiplying them by a scale ``s`` that maps
their largest magnitude (``amax``) onto the format's largest value, so the 8 bits cover the
range the values use: ``q = sat(x * s)`` rounded to nearest even, and ``x ~ q / s``. Two formats
(:data:`E4M3`, :data:`E5M2`, ml_dtypes' ``float8_e4m3fn`` and ``float8_e5m2``): e4m3 (3 mantissa
bits, largest 448) for weights and activations, e5m2 (2 bits, largest 57344) where range matters
more than precision (gradients).

How many values share a scale is the :class:`Scaling`:

- ``tensorwise``: one scale for the tensor (current scaling: from this tensor's own amax);
- ``rowwise``: one per row of each operand (a token's activations, a weight's output row): the
  GEMM's result is scaled by the outer product of the two operands' scales;
- ``blockwise`` (DeepSeek-V3's): an activation's scale per 1 x 128 tile along the reduced
  dimension, a weight's per 128 x 128 block; each 128-wide slice of the reduction is summed in
  float32, scaled by its two scales, then added (the promotion every 128 that keeps the
  tensor cores' limited accumulator from mattering).

A scale may be rounded down to a power of two (``power_of_two``): dequantizing is then exact and
the scale never saturates. An all-zero tensor, row or tile gets the scale 1. The cast saturates
at the format's largest value (ml_dtypes' own cast of a value beyond it gives NaN for e4m3,
infinity for e5m2), which matters when a scale was computed from an older amax.

:func:`scaled_matmul` is the GEMM's model: cuBLASLt's ``D = (scale_a A)(scale_b B)^T`` with the
float8 operands exactly representable in float32 and the products summed in float32 (the
tensor cores' accumulator keeps fewer bits than float32 between promotions: a difference this
model does not carry). Operands are ``[rows, k]``: activations ``[tokens, in]``, weights
``[out, in]`` as a linear holds them.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

BLOCK = 128
"""The tile width along the reduced dimension of ``blockwise`` scaling (and a weight block's
height)."""


@dataclass(frozen=True)
class Float8Format:
    """A float8 format: its name, NumPy dtype and largest finite value."""

    name: str
    dtype: np.dtype
    max: float


E4M3 = Float8Format("e4m3", np.dtype(ml_dtypes.float8_e4m3fn), 448.0)
E5M2 = Float8Format("e5m2", np.dtype(ml_dtypes.float8_e5m2), 57344.0)
FORMATS = {f.name: f for f in (E4M3, E5M2)}


@dataclass(frozen=True)
class Scaling:
    """How many values share a scale: the tile of an activation and of a weight, as (rows,
    columns) with None for the whole dimension."""

    name: str
    activation: tuple[int | None, int | None]
    weight: tuple[int | None, int | None]

    def tile(self, operand: str) -> tuple[int | None, int | None]:
        """The tile of ``operand`` ("activation" or "weight")."""
        return self.activation if operand == "activation" else self.weight


TENSORWISE = Scaling("tensorwise", (None, None), (None, None))
ROWWISE = Scaling("rowwise", (1, None), (1, None))
BLOCKWISE = Scaling("blockwise", (1, BLOCK), (BLOCK, BLOCK))
SCALINGS = {s.name: s for s in (TENSORWISE, ROWWISE, BLOCKWISE)}


@dataclass(frozen=True)
class Quantized:
    """An operand ``[rows, k]`` in float8 (``data``) with its dequantization multipliers
    ``inverse`` (``1 / s``, float32) of shape ``[rows / tile rows, k / tile columns]`` and the
    ``tile`` they cover (whole dimensions resolved to their sizes)."""

    data: np.ndarray
    inverse: np.ndarray
    tile: tuple[int, int]

    def dequantized(self) -> np.ndarray:
        """``q / s`` in float64 (exact: a float8 value times a float32 multiplier)."""
        tm, tk = self.tile
        scale = np.repeat(np.repeat(self.inverse.astype(np.float64), tm, 0), tk, 1)
        return self.data.astype(np.float64) * scale


def scale_for(amax: np.ndarray, fmt: Float8Format, power_of_two: bool = False) -> np.ndarray:
    """The float32 scales mapping ``amax`` onto ``fmt.max`` (1 where amax is 0); rounded down to
    a power of two with ``power_of_two``."""
    amax = np.asarray(amax, np.float64)
    scale = np.where(amax > 0, fmt.max / np.where(amax > 0, amax, 1.0), 1.0)
    if power_of_two:
        scale = np.exp2(np.floor(np.log2(scale)))
    return scale.astype(np.float32)


def cast(x: np.ndarray, scale: np.ndarray, fmt: Float8Format) -> np.ndarray:
    """``x * scale`` in ``fmt``, rounded to nearest even, saturated at ``±fmt.max`` (``scale``
    broadcast against ``x``)."""
    y = np.asarray(x, np.float32) * np.asarray(scale, np.float32)
    return np.clip(y, -fmt.max, fmt.max).astype(fmt.dtype)


def _tile(shape: tuple[int, int], tile: tuple[int | None, int | None]) -> tuple[int, int]:
    rows, k = shape
    tm, tk = tile[0] or rows, tile[1] or k
    if rows % tm or k % tk:
        raise ValueError(f"float8 scaling: an operand of shape {list(shape)} does not split into "
                         f"{tm} x {tk} tiles (blockwise scaling needs rows and the reduced "
                         f"dimension in multiples of {BLOCK}: pad them)")
    return tm, tk


def quantize(x: np.ndarray, fmt: Float8Format, scaling: Scaling, operand: str = "activation",
             power_of_two: bool = False) -> Quantized:
    """``x`` ``[rows, k]`` in ``fmt`` with a scale per tile of ``scaling`` for ``operand``
    (current scaling: each tile's own amax maps onto ``fmt.max``)."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"float8 scaling: operands are [rows, k]; got shape {list(x.shape)}")
    tm, tk = _tile(x.shape, scaling.tile(operand))
    rows, k = x.shape
    tiles = np.abs(x.astype(np.float32)).reshape(rows // tm, tm, k // tk, tk)
    scale = scale_for(tiles.max(axis=(1, 3)), fmt, power_of_two)
    full = np.repeat(np.repeat(scale, tm, 0), tk, 1)
    return Quantized(cast(x, full, fmt), (1.0 / scale.astype(np.float64)).astype(np.float32),
                     (tm, tk))


def scaled_matmul(a: Quantized, b: Quantized) -> np.ndarray:
    """``a @ b.T`` (``[m, k]`` by ``[n, k]`` -> float32 ``[m, n]``) as the scaled FP8 GEMM computes
    it: per slice of the reduced dimension as wide as the finer of the two operands' tiles,
    the float8 products summed in float32, scaled by the slice's multipliers of each row of
    ``a`` and of ``b``, and the slices added in float32."""
    (m, k), (n, kb) = a.data.shape, b.data.shape
    if k != kb:
        raise ValueError(f"scaled_matmul: a {[m, k]} and b {[n, kb]} must share k")
    width = min(a.tile[1], b.tile[1])
    a32, b32 = a.data.astype(np.float32), b.data.astype(np.float32)
    out = np.zeros((m, n), np.float32)
    for j in range(0, k, width):
        part = a32[:, j:j + width] @ b32[:, j:j + width].T
        sa = np.repeat(a.inverse[:, j // a.tile[1]], a.tile[0])[:, None]
        sb = np.repeat(b.inverse[:, j // b.tile[1]], b.tile[0])[None, :]
        out += part * sa * sb
    return out
