"""BLAS matrix products callable from Numba nopython code, on views with leading dimensions.

`gemm` is C = alpha * op(A) @ op(B) + beta * C on row-major operands given by a view of their
first element and a leading dimension (the row stride, in elements), so that tiles of larger
arrays (a block of rows of `k[b, :, h, :]`, say) are used in place, and products accumulate
into an existing tile (beta = 1) without a temporary. Numba's `np.dot` allows neither.

The routines are SciPy's BLAS (`scipy.linalg.cython_blas` sgemm/dgemm), registered as named
symbols so that the calling functions can be cached on disk (`cache=True`) like any other.
SciPy's OpenBLAS is a separate library from NumPy's, with its own thread pool: both read
`OPENBLAS_NUM_THREADS` at load, which `mpipar.runtime.nodes` sets per rank (`THREAD_VARS`).
"""

from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from numba import njit, types
from numba.extending import get_cython_function_address

for _name in ("sgemm", "dgemm"):
    llvm.add_symbol(f"mpipar_{_name}", get_cython_function_address("scipy.linalg.cython_blas", _name))
_GEMM_SIG = types.void(*([types.uintp] * 13))  # Fortran BLAS: every argument by address
_sgemm = types.ExternalFunction("mpipar_sgemm", _GEMM_SIG)
_dgemm = types.ExternalFunction("mpipar_dgemm", _GEMM_SIG)

_N, _T = 78, 84  # ord("N"), ord("T")


@njit(cache=True, nogil=True, fastmath=False)
def gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, single):  # pragma: no cover (njit)
    """C[m, n] = alpha * op(A) @ op(B) + beta * C, all row-major, float32 if `single` else float64.

    a, b, c: addresses of the first elements of A, B, C (`view.ctypes.data`); op(A) is `[m, k]`
    (A is `[k, m]` when trans_a), op(B) is `[k, n]` (B is `[n, k]` when trans_b); lda, ldb, ldc are
    the row strides in elements. Addresses rather than arrays give one compiled version for every
    kind of view. BLAS is column-major, so this computes C^T = op(B)^T op(A)^T.
    """
    flags = np.empty(2, np.uint8)
    flags[0] = _T if trans_b else _N
    flags[1] = _T if trans_a else _N
    dims = np.empty(6, np.int32)
    dims[0], dims[1], dims[2] = n, m, k
    dims[3], dims[4], dims[5] = ldb, lda, ldc
    if single:
        coef = np.empty(2, np.float32)
        coef[0], coef[1] = alpha, beta
        _sgemm(flags.ctypes.data, flags[1:].ctypes.data, dims.ctypes.data, dims[1:].ctypes.data,
               dims[2:].ctypes.data, coef.ctypes.data, b, dims[3:].ctypes.data, a, dims[4:].ctypes.data,
               coef[1:].ctypes.data, c, dims[5:].ctypes.data)
    else:
        coef64 = np.empty(2, np.float64)
        coef64[0], coef64[1] = alpha, beta
        _dgemm(flags.ctypes.data, flags[1:].ctypes.data, dims.ctypes.data, dims[1:].ctypes.data,
               dims[2:].ctypes.data, coef64.ctypes.data, b, dims[3:].ctypes.data, a, dims[4:].ctypes.data,
               coef64[1:].ctypes.data, c, dims[5:].ctypes.data)
