"""What lets LLVM vectorise Numba loops: `vexp`, the `REORDER` fastmath flags, `transpose_tile`;
and what keeps the kernels' inner loops free of reference counting: `address`, `row_at`.

`REORDER` allows a loop's sums to be reassociated (so that reductions are vectorised) while keeping
the semantics of infinities and NaNs, which the kernels rely on (-inf log-sum-exp of empty rows).

`vexp` is an exp for float32 and float64 scalars. Numba compiles `np.exp` in a loop to a call of the C library's scalar exp unless Intel SVML is
installed, which leaves softmax-style loops 10x slower than NumPy's SIMD exp. `vexp` is plain
arithmetic that LLVM vectorises: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite split of ln2),
exp(r) by its Taylor polynomial (degree 12 for float64, 7 for float32), and 2**n put together
from its exponent bits. Relative error: below 4e-16 (float64) and 2e-7 (float32).

The argument is clamped to [-708, 709] (float64) and [-87, 88] (float32): above, the result
would overflow; below, it returns exp(-708) (exp(-87)) instead of a subnormal or 0.

Every Numba array view (a slice, `x[b, i, h]`) and every `.ctypes` takes a reference to its
array's memory and drops it after: two atomic operations, each of which on x86 also waits for
the stores before it. Loops over rows and tile segments made hundreds of thousands a call
(`perf`: 1.3 ms of the packed row's 57 ms attention backward). The kernels reach rows and
tiles by address instead (`address`, then arithmetic) and hand rows to vectorised loops as
`row_at` arrays, which hold no reference.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic, overload
from numba.np.arrayobj import make_array

REORDER = {"reassoc", "nsz", "contract", "arcp"}  # fastmath flags: no "nnan"/"ninf"


def vexp(x):  # pragma: no cover (replaced in compiled code by the overload below)
    """exp(x) of a float32 or float64 scalar inside Numba-compiled code (see the module docstring)."""
    return np.exp(x)


# The exps carry their own fastmath flags: a Numba function without them inherits its first
# caller's, and a caller with REORDER ("reassoc") would let LLVM fold the two-part ln2 back into
# one product (x - n*(hi + lo)), losing the split's exactness: 2.4e-14 relative instead of 4e-16.
# "contract" (FMA) only removes roundings.
#
# Every compiled function of the kernels states its flags (`fastmath=` REORDER, EXP_FLAGS or
# False) and `cache=True` (tests/unit/test_kernel_flags.py): Numba's on-disk cache keys a
# function by its signature, not by the flags it inherited, so a function that inherits is
# compiled with whichever caller compiled first in the process that filled the cache. A run that
# compiles some kernels and loads others (a cache filled by another run, another dtype, or by
# ranks racing to fill it) would then compute other bits than a run that compiled them all.
EXP_FLAGS = {"contract"}


@njit(cache=True, nogil=True, fastmath=EXP_FLAGS)
def _exp64(x):  # pragma: no cover (njit)
    x = min(max(x, -708.0), 709.0)
    n = np.floor(x * 1.4426950408889634 + 0.5)
    r = x - n * 0.6931471803691238 - n * 1.9082149292705877e-10  # ln2 = hi + lo
    p = 1.0 + r * (1.0 + r * (1 / 2 + r * (1 / 6 + r * (1 / 24 + r * (1 / 120 + r * (
        1 / 720 + r * (1 / 5040 + r * (1 / 40320 + r * (1 / 362880 + r * (
            1 / 3628800 + r * (1 / 39916800 + r * (1 / 479001600))))))))))))
    return p * np.int64((np.int64(n) + 1023) << 52).view(np.float64)


@njit(cache=True, nogil=True, fastmath=EXP_FLAGS)
def _exp32(x):  # pragma: no cover (njit)
    one = np.float32(1)
    x = min(max(x, np.float32(-87)), np.float32(88))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - n * np.float32(0.693145751953125) - n * np.float32(1.4286068203094173e-06)
    p = one + r * (one + r * (np.float32(1 / 2) + r * (np.float32(1 / 6) + r * (np.float32(1 / 24) + r * (
        np.float32(1 / 120) + r * (np.float32(1 / 720) + r * np.float32(1 / 5040)))))))
    return p * np.int32((np.int32(n) + 127) << 23).view(np.float32)


@overload(vexp, jit_options={"fastmath": EXP_FLAGS})
def _vexp_overload(x):
    if x == types.float64:
        return lambda x: _exp64(x)
    if x == types.float32:
        return lambda x: _exp32(x)
    return None


# ----------------------------------------------------------------------------------------------
# Transposing a square tile in vector registers
# ----------------------------------------------------------------------------------------------

def _shuffle(builder, x, y, mask):
    return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(ir.IntType(32), len(mask)), mask))


def _tile_codegen(ftype, lanes, steps, align):
    """LLVM IR of an n x n transpose (n = lanes) through vector shuffles: load n rows of n
    elements, interleave them in log2(n) rounds (`steps`: each round's pairs and masks), store n
    rows (unaligned loads and stores, `align`: the element's). LLVM lowers the shuffles to the
    CPU's unpack and permute instructions (AVX: 24 for 8 x 8 float32): about 2.2x faster than
    element copies eight keys at a time (0.13-0.15 against 0.30-0.33 ns an element, rows of K
    from memory). Addresses are unsigned integers (uintp), row strides in elements."""
    vec = ir.VectorType(ftype, lanes)

    def codegen(context, builder, signature, args):
        src, sld, dst, dld = args

        def row(base, ld, r):
            ptr = builder.gep(builder.inttoptr(base, ftype.as_pointer()), [builder.mul(ld, ir.Constant(ld.type, r))])
            return builder.bitcast(ptr, vec.as_pointer())

        rows = []
        for r in range(lanes):
            load = builder.load(row(src, sld, r))
            load.align = align
            rows.append(load)
        for pairs in steps:
            rows = [_shuffle(builder, rows[i], rows[j], mask) for i, j, mask in pairs]
        for r in range(lanes):
            store = builder.store(rows[r], row(dst, dld, r))
            store.align = align
        return context.get_dummy_value()
    return codegen


_LO8, _HI8 = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
_EV8, _OD8 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
_LH8, _HH8 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
_STEPS8 = (  # rows r0..r7 -> columns: interleave pairs of elements, then pairs of pairs, then halves
    [(r, r + 1, m) for r in range(0, 8, 2) for m in (_LO8, _HI8)],
    [(i, i + 2, m) for i in (0, 1, 4, 5) for m in (_EV8, _OD8)],
    [(i, i + 4, m) for m in (_LH8, _HH8) for i in range(4)],
)
_STEPS4 = (
    [(0, 1, [0, 4, 2, 6]), (0, 1, [1, 5, 3, 7]), (2, 3, [0, 4, 2, 6]), (2, 3, [1, 5, 3, 7])],
    [(0, 2, [0, 1, 4, 5]), (1, 3, [0, 1, 4, 5]), (0, 2, [2, 3, 6, 7]), (1, 3, [2, 3, 6, 7])],
)
_TILE_SIG = types.void(types.uintp, types.intp, types.uintp, types.intp)


@intrinsic
def _transpose8_f32(typingctx, src, sld, dst, dld):
    return _TILE_SIG, _tile_codegen(ir.FloatType(), 8, _STEPS8, 4)


@intrinsic
def _transpose4_f64(typingctx, src, sld, dst, dld):
    return _TILE_SIG, _tile_codegen(ir.DoubleType(), 4, _STEPS4, 8)


@njit(cache=True, nogil=True, fastmath=False)
def transpose_tile(src, sld, dst, dld, single):  # pragma: no cover (njit)
    """dst[i, j] = src[j, i] for an n x n tile (n = `tile_lanes(single)`: 8 float32, 4 float64),
    given by the addresses of their first elements and their row strides in elements."""
    if single:
        _transpose8_f32(src, sld, dst, dld)
    else:
        _transpose4_f64(src, sld, dst, dld)


@njit(cache=True, nogil=True, fastmath=False)
def tile_lanes(single):  # pragma: no cover (njit)
    """The side of `transpose_tile`'s tile: one AVX vector of float32 (8) or float64 (4)."""
    return 8 if single else 4


# ----------------------------------------------------------------------------------------------
# Addresses and views without reference counts
# ----------------------------------------------------------------------------------------------

@intrinsic
def address(typingctx, arr):
    """The address (uintp) of array arr's first element. `arr.ctypes.data` gives the same, but
    takes and drops a reference (two atomic operations, each a barrier to the stores before it)
    every time, which the kernels' per-row and per-segment loops did by the hundred thousand."""
    def codegen(context, builder, signature, args):
        ary = make_array(signature.args[0])(context, builder, args[0])
        return builder.ptrtoint(ary.data, context.get_value_type(types.uintp))
    return types.uintp(arr), codegen


@intrinsic
def _pointer(typingctx, addr, like):
    ptr = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))
    return ptr(types.uintp, like), codegen


@njit(cache=True, nogil=True, fastmath=False)
def row_at(addr, n, like):  # pragma: no cover (njit)
    """A 1-D array of n elements of like's dtype at `addr`, which holds no reference (like a
    slice of `like` that Numba need not count): for rows handed to vectorised loops."""
    return carray(_pointer(addr, like), n)
