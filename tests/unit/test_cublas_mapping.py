"""The row-major -> column-major mapping of mpipar.kernels.cublas (pure, no CuPy): the cuBLAS
arguments it produces, run through an emulated column-major GEMM that indexes flat buffers as
cuBLAS does (element (i, j) of a column-major matrix with leading dimension ld at i + j * ld),
give NumPy's row-major product, for every transpose combination, beta 0 and 1, odd shapes and
strided batches (a shared 2-D operand: stride 0)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpipar.kernels import cublas

SHAPES = [(3, 5, 7), (1, 4, 2), (6, 1, 5), (7, 3, 1), (2, 2, 2)]  # (M, K, N)


def _colmajor(buf: np.ndarray, offset: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """The column-major ``rows x cols`` matrix at ``buf[offset:]`` with leading dimension ld, as
    cuBLAS reads it (order='F' strides); refuses what cuBLAS would read out of bounds."""
    assert ld >= max(1, rows), f"leading dimension {ld} < rows {rows}"
    assert offset + (rows - 1) + (cols - 1) * ld < buf.size, "reads past the buffer"
    return np.lib.stride_tricks.as_strided(buf[offset:], (rows, cols),
                                           (buf.itemsize, ld * buf.itemsize))


def emulated_gemm(g: cublas.GemmArgs, alpha: float, a_buf: np.ndarray, b_buf: np.ndarray,
                  beta: float, c_buf: np.ndarray) -> None:
    """cublasGemmStridedBatchedEx on flat float64 host buffers: for each batch entry,
    C = alpha op(A) op(B) + beta C, op(X) = X or X^T by transa / transb."""
    for e in range(g.batch):
        op_a = (_colmajor(a_buf, e * g.stride_a, g.m, g.k, g.lda) if g.transa == cublas.CUBLAS_OP_N
                else _colmajor(a_buf, e * g.stride_a, g.k, g.m, g.lda).T)
        op_b = (_colmajor(b_buf, e * g.stride_b, g.k, g.n, g.ldb) if g.transb == cublas.CUBLAS_OP_N
                else _colmajor(b_buf, e * g.stride_b, g.n, g.k, g.ldb).T)
        c = _colmajor(c_buf, e * g.stride_c, g.m, g.n, g.ldc)
        c[...] = alpha * (op_a @ op_b) + beta * c


def _operands(rng, m, k, n, trans_a, trans_b, batch_a=None, batch_b=None):
    a = rng.standard_normal(((batch_a,) if batch_a else ()) + ((k, m) if trans_a else (m, k)))
    b = rng.standard_normal(((batch_b,) if batch_b else ()) + ((n, k) if trans_b else (k, n)))
    op_a = np.swapaxes(a, -1, -2) if trans_a else a
    op_b = np.swapaxes(b, -1, -2) if trans_b else b
    return a, b, op_a @ op_b


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_gemm_mapping(m, k, n, trans_a, trans_b, beta):
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a, b, want = _operands(rng, m, k, n, trans_a, trans_b)
    c0 = rng.standard_normal((m, n))
    g = cublas.gemm_args(a.shape, b.shape, trans_a, trans_b)
    assert cublas.result_shape(a.shape, b.shape, g) == (m, n) and g.batch == 1
    c = c0.ravel().copy()
    emulated_gemm(g, 1.0, b.ravel().copy(), a.ravel().copy(), beta, c)  # cuBLAS's A is our b
    np.testing.assert_allclose(c.reshape(m, n), want + beta * c0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("m,k,n", SHAPES[:3])
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize("batch_a,batch_b", [(3, 3), (3, None), (None, 3)])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_batched_mapping(m, k, n, trans_a, trans_b, batch_a, batch_b, beta):
    """3-D operands with their batch strides; a 2-D operand is shared (stride 0)."""
    rng = np.random.default_rng(7)
    a, b, want = _operands(rng, m, k, n, trans_a, trans_b, batch_a, batch_b)
    c0 = rng.standard_normal((3, m, n))
    g = cublas.gemm_args(a.shape, b.shape, trans_a, trans_b)
    assert cublas.result_shape(a.shape, b.shape, g) == (3, m, n) and g.batch == 3
    assert (g.stride_a == 0) == (batch_b is None) and (g.stride_b == 0) == (batch_a is None)
    c = c0.ravel().copy()
    emulated_gemm(g, 0.5, b.ravel().copy(), a.ravel().copy(), beta, c)
    np.testing.assert_allclose(c.reshape(3, m, n), 0.5 * want + beta * c0, rtol=1e-12,
                               atol=1e-12)


def test_emulator_catches_a_wrong_mapping():
    """The check can fail: with the operands not swapped, square shapes read in bounds and give
    (b a) instead of (a b); other shapes read past a buffer."""
    rng = np.random.default_rng(3)
    a, b, want = _operands(rng, 4, 4, 4, False, False)
    g = cublas.gemm_args(a.shape, b.shape)
    c = np.zeros(16)
    emulated_gemm(g, 1.0, a.ravel().copy(), b.ravel().copy(), 0.0, c)
    np.testing.assert_allclose(c.reshape(4, 4), b @ a, rtol=1e-12)
    assert not np.allclose(c.reshape(4, 4), want)
    a, b, want = _operands(rng, 3, 5, 7, False, False)
    with pytest.raises(AssertionError, match="past the buffer"):
        emulated_gemm(cublas.gemm_args(a.shape, b.shape), 1.0, a.ravel().copy(),
                      b.ravel().copy(), 0.0, np.zeros(21))


def test_argument_checks():
    with pytest.raises(ValueError, match="inner dimensions differ"):
        cublas.gemm_args((3, 4), (5, 6))
    with pytest.raises(ValueError, match="batch sizes"):
        cublas.gemm_args((2, 3, 4), (3, 4, 6))
    with pytest.raises(ValueError, match="2-D or 3-D"):
        cublas.gemm_args((4,), (4, 6))


def test_types():
    bf = cublas.gemm_types("bfloat16", "bfloat16")
    assert (bf.a, bf.c, bf.compute, bf.algo, bf.scalar) == (
        cublas.CUDA_R_16BF, cublas.CUDA_R_16BF, cublas.CUBLAS_COMPUTE_32F,
        cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP, "float32")
    assert cublas.gemm_types("bfloat16", "float32").c == cublas.CUDA_R_32F
    f64 = cublas.gemm_types("float64", "float64")
    assert (f64.compute, f64.scalar, f64.algo) == (cublas.CUBLAS_COMPUTE_64F, "float64",
                                                   cublas.CUBLAS_GEMM_DEFAULT)
    assert cublas.gemm_types("float32", "float32").compute == cublas.CUBLAS_COMPUTE_32F
    with pytest.raises(ValueError, match="output dtype"):
        cublas.gemm_types("float32", "bfloat16")
    with pytest.raises(ValueError, match="input dtype"):
        cublas.gemm_types("float16", "float16")
