"""Row-major GEMMs on cuBLAS through CuPy: bf16 inputs with float32 compute on tensor cores,
float32 and float64 exact, bf16 or float32 outputs, accumulation into an existing output
(beta = 1: weight gradients straight into a float32 buffer), and a strided-batched variant.

    y  = matmul(x, w, trans_b=True)                  # x [T, in] bf16, w [out, in] bf16 -> [T, out]
    dx = matmul(dy, w)                               # dy [T, out] -> [T, in]
    matmul(dy, x, trans_a=True, out=dw32, beta=1.0)  # dw32 [out, in] float32 += dy^T x

cuBLAS is column-major: a row-major ``[r, c]`` matrix is the column-major ``[c, r]`` matrix with
leading dimension c, so the row-major ``C = op(a) op(b)`` is the column-major
``C^T = op(b)^T op(a)^T``: cuBLAS's A is our b and its B our a (:func:`gemm_args`, pure, tested
on the host against the same index arithmetic). ``cupy.matmul`` would do for 2-D bf16 but in
CuPy 14.2 raises on batched bf16, and it cannot accumulate into a float32 output.

CuPy names used: ``cupy.cuda.cublas.gemmEx`` / ``gemmStridedBatchedEx`` (they bind CuPy's current
stream), ``getPointerMode`` / ``setPointerMode``, ``cupy.cuda.device.get_cublas_handle``.
Importing this module does not import CuPy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .numpy_ref import Array, require

CUDA_R_32F, CUDA_R_64F, CUDA_R_16BF = 0, 1, 14
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F = 68, 70
CUBLAS_GEMM_DEFAULT, CUBLAS_GEMM_DEFAULT_TENSOR_OP = -1, 99
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0

_DATA_TYPE = {"bfloat16": CUDA_R_16BF, "float32": CUDA_R_32F, "float64": CUDA_R_64F}
_OUTPUTS = {"bfloat16": ("bfloat16", "float32"), "float32": ("float32",), "float64": ("float64",)}
"""Output dtypes allowed for each input dtype (bf16 in, float32 out: weight gradients)."""


@dataclasses.dataclass(frozen=True)
class GemmArgs:
    """The column-major cuBLAS call for one row-major product: cuBLAS's A is the row-major b,
    its B the row-major a; C (``m x n`` column-major, ``ldc``) is the row-major ``[M, N]``
    output. Strides (elements between batch entries; 0 broadcasts) and batch only for the
    strided-batched call."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int = 0
    stride_b: int = 0
    stride_c: int = 0
    batch: int = 1


@dataclasses.dataclass(frozen=True)
class GemmTypes:
    """cuBLAS data types, compute type and algorithm for one dtype combination; ``scalar``: the
    NumPy dtype of alpha and beta (host pointers; float32 under CUBLAS_COMPUTE_32F)."""

    a: int
    b: int
    c: int
    compute: int
    algo: int
    scalar: str


def gemm_args(a_shape: tuple[int, ...], b_shape: tuple[int, ...], trans_a: bool = False,
              trans_b: bool = False) -> GemmArgs:
    """Map row-major ``C[M, N] = op(a) op(b)`` (a ``[M, K]``, or ``[K, M]`` with trans_a; b
    ``[K, N]``, or ``[N, K]`` with trans_b; either may carry a leading batch dimension, a 2-D
    operand of a batched product is broadcast) to cuBLAS's column-major arguments. Pure."""
    require(len(a_shape) in (2, 3) and len(b_shape) in (2, 3),
            f"matmul: a {a_shape} and b {b_shape} must be 2-D or 3-D")
    (a_rows, a_cols), (b_rows, b_cols) = a_shape[-2:], b_shape[-2:]
    m_, k_ = (a_cols, a_rows) if trans_a else (a_rows, a_cols)
    kb, n_ = (b_cols, b_rows) if trans_b else (b_rows, b_cols)
    require(k_ == kb, f"matmul: inner dimensions differ: op(a) is [{m_}, {k_}], op(b) [{kb}, {n_}] "
                      f"(a {a_shape}, trans_a={trans_a}; b {b_shape}, trans_b={trans_b})")
    batches = {s[0] for s in (a_shape, b_shape) if len(s) == 3}
    require(len(batches) <= 1, f"matmul: batch sizes of a {a_shape} and b {b_shape} differ")
    batch = batches.pop() if batches else 1
    return GemmArgs(
        transa=CUBLAS_OP_T if trans_b else CUBLAS_OP_N,
        transb=CUBLAS_OP_T if trans_a else CUBLAS_OP_N,
        m=n_, n=m_, k=k_, lda=max(1, b_cols), ldb=max(1, a_cols), ldc=max(1, n_),
        stride_a=b_rows * b_cols if len(b_shape) == 3 else 0,
        stride_b=a_rows * a_cols if len(a_shape) == 3 else 0,
        stride_c=m_ * n_, batch=batch)


def gemm_types(in_dtype: str, out_dtype: str) -> GemmTypes:
    """cuBLAS types for inputs of ``in_dtype`` and an output of ``out_dtype`` (NumPy names):
    bf16 -> bf16 or float32 with float32 compute on tensor cores; float32 -> float32 and float64
    -> float64 with their own compute type (no TF32, no reduced precision). Pure."""
    require(in_dtype in _OUTPUTS, f"matmul: input dtype {in_dtype} must be one of "
                                  f"{tuple(_OUTPUTS)}")
    require(out_dtype in _OUTPUTS[in_dtype],
            f"matmul: output dtype {out_dtype} must be one of {_OUTPUTS[in_dtype]} for "
            f"{in_dtype} inputs")
    wide = in_dtype == "float64"
    return GemmTypes(a=_DATA_TYPE[in_dtype], b=_DATA_TYPE[in_dtype], c=_DATA_TYPE[out_dtype],
                     compute=CUBLAS_COMPUTE_64F if wide else CUBLAS_COMPUTE_32F,
                     algo=CUBLAS_GEMM_DEFAULT_TENSOR_OP if in_dtype == "bfloat16"
                     else CUBLAS_GEMM_DEFAULT,
                     scalar="float64" if wide else "float32")


def result_shape(a_shape: tuple[int, ...], b_shape: tuple[int, ...], args: GemmArgs) -> tuple:
    """Shape of the row-major result: ``[M, N]``, or ``[batch, M, N]`` if either is 3-D."""
    batched = len(a_shape) == 3 or len(b_shape) == 3
    return ((args.batch,) if batched else ()) + (args.n, args.m)


def matmul(a: Array, b: Array, trans_a: bool = False, trans_b: bool = False,
           out: Array | None = None, beta: float = 0.0, out_dtype: Any = None,
           alpha: float = 1.0) -> Array:
    """``out = alpha * op(a) @ op(b) + beta * out`` on cuBLAS, row-major.

    a ``[M, K]`` (``[K, M]`` with trans_a), b ``[K, N]`` (``[N, K]`` with trans_b), either with a
    leading batch dimension (strided batched; a 2-D operand is shared by every batch entry) ->
    ``[M, N]`` or ``[batch, M, N]``. a and b: CuPy arrays of one dtype, bf16
    (``ml_dtypes.bfloat16``), float32 or float64. ``out``: an existing C-contiguous result (its
    dtype is the output dtype; needed for beta != 0); else a new one of ``out_dtype`` (default:
    the input dtype; float32 allowed for bf16 inputs)."""
    import cupy

    require(isinstance(a, cupy.ndarray) and isinstance(b, cupy.ndarray),
            f"matmul: a and b must be cupy arrays, got {type(a).__name__}, {type(b).__name__}")
    require(a.dtype == b.dtype, f"matmul: a ({a.dtype}) and b ({b.dtype}) must share a dtype")
    args = gemm_args(a.shape, b.shape, trans_a, trans_b)
    shape = result_shape(a.shape, b.shape, args)
    if out is None:
        require(beta == 0, f"matmul: beta={beta} needs an existing out")
        out = cupy.empty(shape, a.dtype if out_dtype is None else cupy.dtype(out_dtype))
    else:
        require(out.shape == shape and out.flags.c_contiguous,
                f"matmul: out {out.shape} must be a C-contiguous array of shape {shape}")
        require(out_dtype is None or cupy.dtype(out_dtype) == out.dtype,
                f"matmul: out_dtype={out_dtype} differs from out.dtype={out.dtype}")
    types = gemm_types(a.dtype.name, out.dtype.name)
    if out.size == 0:
        return out
    if args.k == 0:  # an empty sum: out = beta * out (0 * garbage would keep NaNs)
        if beta == 0:
            out.fill(0)
        else:
            out *= out.dtype.type(beta)
        return out
    a, b = cupy.ascontiguousarray(a), cupy.ascontiguousarray(b)
    _call(args, types, b, a, out, alpha, beta, batched=len(shape) == 3)
    return out


def _call(args: GemmArgs, types: GemmTypes, a_blas: Array, b_blas: Array, c: Array,
          alpha: float, beta: float, batched: bool) -> None:
    """One cuBLAS call (cuBLAS's A = the row-major b, its B = the row-major a), with host
    alpha/beta under the host pointer mode (restored afterwards)."""
    from cupy.cuda import cublas, device

    handle = device.get_cublas_handle()
    scal = np.array([alpha, beta], dtype=types.scalar)
    al, be = scal.ctypes.data, scal.ctypes.data + scal.itemsize
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    try:
        if batched:
            cublas.gemmStridedBatchedEx(
                handle, args.transa, args.transb, args.m, args.n, args.k, al,
                a_blas.data.ptr, types.a, args.lda, args.stride_a,
                b_blas.data.ptr, types.b, args.ldb, args.stride_b, be,
                c.data.ptr, types.c, args.ldc, args.stride_c, args.batch, types.compute,
                types.algo)
        else:
            cublas.gemmEx(handle, args.transa, args.transb, args.m, args.n, args.k, al,
                          a_blas.data.ptr, types.a, args.lda, b_blas.data.ptr, types.b, args.ldb,
                          be, c.data.ptr, types.c, args.ldc, types.compute, types.algo)
    finally:
        cublas.setPointerMode(handle, mode)
