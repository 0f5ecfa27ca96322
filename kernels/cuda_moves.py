"""GPU moves and the gradient norm's reduction: what a training step does to memory besides its
kernels' arithmetic, written for the device because CuPy's generic versions cost more.

- column copies (bf16): a stacked linear's output (q/k/v, gate/up: one GEMM against the weights
  stacked) cut into one contiguous array per weight, the gradients of those outputs joined back
  into one, and the weights stacked. CuPy copies a strided view with an index computed per
  element (about 0.8 TB/s on an H200); this kernel moves a 16-byte vector per thread where the
  widths and addresses allow. On the 1.1B model at seq 2048 the cuts and joins were 55 ms of a
  280 ms step; with these, 12 ms.
- the sum of squares of float32 / float64 arrays (the optimizer's gradient norm): each square
  exact in float64, float64 partials per block over a grid fixed by the array's size (the same
  bits every run), one launch per array and one synchronisation.

Moves only in the first: the results are the bytes numpy_ref's :func:`split_columns` and
:func:`concat` give. Importing this module never imports CuPy; `cuda_sources()` lists the source
and every instantiation for the compile gate.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .numpy_ref import Array, require

MOVE_OPS: tuple[str, ...] = ("split_columns", "concat")
"""The dispatcher's moves (bf16 CuPy arrays; every other dtype takes numpy_ref's)."""

_WIDTHS = (8, 4, 2, 1)   # bf16 elements a thread moves at once: the widest the shape allows
_THREADS = 256
_SQ_UNROLL, _SQ_BLOCKS = 8, 1024     # sum of squares: loads in flight a thread, most blocks
_SQ_TYPES = {"float32": "float", "float64": "double"}
_OPTIONS = ("--std=c++17",)

_SOURCE = r"""
// V bf16 (2V bytes) as one load / store.
template<int V> struct Vec;
template<> struct Vec<8> { using T = uint4; };
template<> struct Vec<4> { using T = uint2; };
template<> struct Vec<2> { using T = unsigned; };
template<> struct Vec<1> { using T = unsigned short; };

// dst[r * dst_stride + c] = src[r * src_stride + c] for r < rows, c < nvec * V (elements of 2
// bytes); a thread per vector, the rows' starts aligned to 2V bytes.
template<int V>
__global__ void __launch_bounds__(256)
mpipar_copy_cols(const unsigned short* __restrict__ src, long long src_stride,
                 unsigned short* __restrict__ dst, long long dst_stride, long long rows,
                 long long nvec) {
    using T = typename Vec<V>::T;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * nvec) return;
    const long long r = i / nvec, c = (i - r * nvec) * V;
    *reinterpret_cast<T*>(dst + r * dst_stride + c) =
        *reinterpret_cast<const T*>(src + r * src_stride + c);
}

// part[blockIdx.x] = sum over the block's elements of double(x)^2: thread t of block b takes
// elements b * T + t + k * gridDim.x * T, SQ_UNROLL loads in flight; the block's sum in a fixed
// order (warp tree, then the warps in order): the bits depend only on n and the grid.
constexpr int SQ_UNROLL = 8;
template<typename T>
__global__ void __launch_bounds__(256)
mpipar_sum_squares(const T* __restrict__ x, long long n, double* __restrict__ part) {
    __shared__ double sh[32];
    const long long stride = (long long)gridDim.x * blockDim.x;
    double acc = 0.0;
    for (long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x; i0 < n;
         i0 += SQ_UNROLL * stride) {
        T v[SQ_UNROLL];
#pragma unroll
        for (int u = 0; u < SQ_UNROLL; ++u) {
            const long long i = i0 + u * stride;
            v[u] = i < n ? x[i] : T(0);
        }
#pragma unroll
        for (int u = 0; u < SQ_UNROLL; ++u) {
            const double d = (double)v[u];
            acc += d * d;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) t += sh[w];
        part[blockIdx.x] = t;
    }
}
"""


def _names() -> tuple[str, ...]:
    """Every instantiation this module launches."""
    return tuple([f"mpipar_copy_cols<{v}>" for v in _WIDTHS]
                 + [f"mpipar_sum_squares<{t}>" for t in _SQ_TYPES.values()])


def cuda_sources() -> list[dict]:
    """This module's CUDA source for the NVRTC compile gate (see cuda_fused.cuda_sources)."""
    return [{"name": "cuda_moves", "code": _SOURCE, "names": _names(), "options": _OPTIONS,
             "dynamic_smem": {}}]


def _cupy() -> Any:
    import cupy
    return cupy


@functools.cache
def _kernel(name: str) -> Any:
    """One instantiation; the module is compiled whole on first use (:func:`.cuda_gate.
    runtime_module`: what the compile gate checks)."""
    from . import cuda_gate
    return cuda_gate.runtime_module(__name__).get_function(name)


def _check_bf16(name: str, arrays: dict[str, Array]) -> None:
    import ml_dtypes
    want = np.dtype(ml_dtypes.bfloat16)
    for arg, a in arrays.items():
        require(isinstance(a, _cupy().ndarray) and a.dtype == want,
                f"{name}: {arg} must be a bfloat16 CuPy array, got {type(a).__name__}"
                f"{'' if getattr(a, 'dtype', None) is None else f' of dtype {a.dtype}'}")


# ------------------------------------------------------------------------------- column copies
def _copy_cols(src: Array, src_stride: int, dst: Array, dst_stride: int, rows: int,
               width: int) -> None:
    """dst[r, :width] = src[r, :width] for r < rows, rows ``*_stride`` elements apart (``src``
    and ``dst`` bf16 arrays or views whose data starts at the first element)."""
    if not rows or not width:
        return
    n = math.gcd(width, src_stride, dst_stride)
    v = next(v for v in _WIDTHS if n % v == 0 and src.data.ptr % (2 * v) == 0
             and dst.data.ptr % (2 * v) == 0)
    nvec = width // v
    _kernel(f"mpipar_copy_cols<{v}>")((-(-(rows * nvec) // _THREADS),), (_THREADS,),
                                      (src, np.int64(src_stride), dst, np.int64(dst_stride),
                                       np.int64(rows), np.int64(nvec)))


def split_columns(y: Array, widths: Any) -> list[Array]:
    """numpy_ref.split_columns for a bf16 CuPy ``y``: one column-copy launch per piece."""
    require(sum(widths) == y.shape[-1] and all(w >= 0 for w in widths),
            f"split_columns: widths {list(widths)} must be >= 0 and sum to y.shape[-1] = "
            f"{y.shape[-1]}")
    _check_bf16("split_columns", {"y": y})
    cp = _cupy()
    y = cp.ascontiguousarray(y)
    total = y.shape[-1]
    rows = y.size // total if total else 0
    flat, out, at = y.reshape(-1), [], 0
    for w in widths:
        piece = cp.empty(y.shape[:-1] + (w,), y.dtype)
        _copy_cols(flat[at:], total, piece, w, rows, w)
        out.append(piece)
        at += w
    return out


def concat(arrays: Any, axis: int = -1) -> Array:
    """numpy_ref.concat for bf16 CuPy arrays joined along their last axis or their first: one
    copy launch per array (other axes: CuPy's concatenate)."""
    cp = _cupy()
    arrays = list(arrays)
    require(len(arrays) > 0, "concat: needs at least one array")
    _check_bf16("concat", {f"arrays[{i}]": a for i, a in enumerate(arrays)})
    nd = arrays[0].ndim
    last = axis in (-1, nd - 1)
    if nd == 0 or not (last or axis == 0) or any(a.ndim != nd for a in arrays):
        return cp.concatenate(arrays, axis=axis)
    keep = arrays[0].shape[:-1] if last else arrays[0].shape[1:]
    require(all((a.shape[:-1] if last else a.shape[1:]) == keep for a in arrays),
            f"concat: shapes {[a.shape for a in arrays]} must agree except on axis {axis}")
    arrays = [cp.ascontiguousarray(a) for a in arrays]
    if last:
        total = sum(a.shape[-1] for a in arrays)
        out = cp.empty(keep + (total,), arrays[0].dtype)
        rows, flat, at = out.size // total if total else 0, out.reshape(-1), 0
        for a in arrays:
            _copy_cols(a, a.shape[-1], flat[at:], total, rows, a.shape[-1])
            at += a.shape[-1]
        return out
    out = cp.empty((sum(a.shape[0] for a in arrays),) + keep, arrays[0].dtype)
    flat, at = out.reshape(-1), 0
    for a in arrays:        # each a contiguous block of the output: one row of a.size
        _copy_cols(a, a.size, flat[at:], a.size, 1, a.size)
        at += a.size
    return out


# ------------------------------------------------------------------------------ sum of squares
def sum_squares(arrays: Any) -> float:
    """The sum over ``arrays`` (CuPy float32 or float64, any shapes) of the sum of their squares,
    each square exact in float64 and summed there: one launch per array into float64 partials
    (a grid fixed by the array's size: the same bits every run), their sum, one
    synchronisation. Non-contiguous arrays are copied first. The loop is kept lean (a model's
    gradients are ~200 arrays, many small): the launches, not the device, bounded it."""
    cp = _cupy()
    items, chunk = [], _THREADS * _SQ_UNROLL
    for a in arrays:
        if not a.flags.c_contiguous:
            a = cp.ascontiguousarray(a)
        kind = _SQ_TYPES.get(a.dtype.name)
        if kind is None:
            raise ValueError(f"sum_squares: dtype {a.dtype} must be one of {', '.join(_SQ_TYPES)}")
        if a.size:
            items.append((a, kind, min(_SQ_BLOCKS, -(-a.size // chunk))))
    if not items:
        return 0.0
    part = cp.empty(sum(grid for _, _, grid in items), cp.float64)
    launch = {kind: _kernel(f"mpipar_sum_squares<{kind}>") for kind in _SQ_TYPES.values()}
    at, block = part.data.ptr, (_THREADS,)
    for a, kind, grid in items:       # part's address passed as a 64-bit value (no view made)
        launch[kind]((grid,), block, (a, np.int64(a.size), np.uint64(at)))
        at += grid * 8
    return float(part.sum())
