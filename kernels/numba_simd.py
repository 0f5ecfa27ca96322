"""What lets LLVM vectorise Numba loops: `vexp` and the `REORDER` fastmath flags.

`REORDER` allows a loop's sums to be reassociated (so that reductions are vectorised) while keeping
the semantics of infinities and NaNs, which the kernels rely on (-inf log-sum-exp of empty rows).

`vexp` is an exp for float32 and float64 scalars. Numba compiles `np.exp` in a loop to a call of the C library's scalar exp unless Intel SVML is
installed, which leaves softmax-style loops 10x slower than NumPy's SIMD exp. `vexp` is plain
arithmetic that LLVM vectorises: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2),
exp(r) by its Taylor polynomial (degree 12 for float64, 7 for float32), and 2**n put together
from its exponent bits. Relative error: below 4e-16 (float64) and 2e-7 (float32).

The argument is clamped to [-708, 709] (float64) and [-87, 88] (float32): above, the result
would overflow; below, it returns exp(-708) (exp(-87)) instead of a subnormal or 0.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

REORDER = {"reassoc", "nsz", "contract", "arcp"}  # fastmath flags: no "nnan"/"ninf"


def vexp(x):  # pragma: no cover (replaced in compiled code by the overload below)
    """exp(x) of a float32 or float64 scalar inside Numba-compiled code (see the module docstring)."""
    return np.exp(x)


# The exps carry their own fastmath flags: a Numba function without them inherits its first
# caller's, and a caller with REORDER ("reassoc") would let LLVM fold the two-part ln2 back into
# one product (x - n*(hi + lo)), losing the split's exactness: 2.4e-14 relative instead of 4e-16,
# depending on which kernel happened to compile first. "contract" (FMA) only removes roundings.
EXP_FLAGS = {"contract"}


@njit(fastmath=EXP_FLAGS)
def _exp64(x):  # pragma: no cover (njit)
    x = min(max(x, -708.0), 709.0)
    n = np.floor(x * 1.4426950408889634 + 0.5)
    r = x - n * 0.6931471803691238 - n * 1.9082149292705877e-10  # ln2 = hi + lo
    p = 1.0 + r * (1.0 + r * (1 / 2 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (
        1 / 720 + r * (1 / 5040 + r * (1 / 40320 + r * (1 / 362880 + r * (
            1 / 3628800 + r * (1 / 39916800 + r * (1 / 479001600))))))))))))
    return p * np.int64((np.int64(n) + 1023) << 52).view(np.float64)


@njit(fastmath=EXP_FLAGS)
def _exp32(x):  # pragma: no cover (njit)
    one = np.float32(1)
    x = min(max(x, np.float32(-87)), np.float32(88))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - n * np.float32(0.693145751953125) - n * np.float32(1.4286068203094173e-06)
    p = one + r * (one + r * (np.float32(1 / 2) + r * (np.float32(1 / 6) + r * (np.float32(1 / 24) + r * (
        np.float32(1 / 120) + r * (np.float32(1 / 720) + r * np.float32(1 / 5040)))))))
    return p * np.int32((np.int32(n) + 127) << 23).view(np.float32)


@overload(vexp)
def _vexp_overload(x):
    if x == types.float64:
        return lambda x: _exp64(x)
    if x == types.float32:
        return lambda x: _exp32(x)
    return None
