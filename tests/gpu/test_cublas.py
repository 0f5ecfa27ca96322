"""mpipar.kernels.cublas on a device against float64 NumPy.

Tolerances, elementwise, with S = |op(a)| @ |op(b)| (the sum of |terms| of each output):
- the inputs are bf16 values (rounded on the host first), so their products are exact in
  float32 (8 + 8 significant bits <= 24) and the float64 reference sees the same inputs;
- a float32 accumulation of K terms errs by at most about K * 2^-24 * S; we allow
  2 K 2^-24 S (tensor cores' float32 adds are not all IEEE round-to-nearest);
- a bf16 output adds one rounding to 8 significant bits: 2^-8 |result|;
- float32 inputs: the same 2 K 2^-24 S (no TF32: that would err by 2^-11 S and fail);
  float64: 2 K 2^-53 S.
Self-contained: imports mpipar.kernels, numpy, ml_dtypes and cupy only."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = ml_dtypes.bfloat16
EPS = {"float32": 2.0 ** -24, "float64": 2.0 ** -53}
BF16_OUT = 2.0 ** -8  # unit roundoff of bf16's 8 significant bits


def _operand(rng, shape, dtype):
    """Random values exactly representable in ``dtype`` (returned as the host float64 copy
    and the device array)."""
    import cupy
    x = rng.standard_normal(shape)
    host = x.astype(BF16) if dtype == "bfloat16" else x.astype(dtype)
    return host.astype(np.float64), cupy.asarray(host)


def _op(x, trans):
    return np.swapaxes(x, -1, -2) if trans else x


def _check(got, want, terms, k, acc, out_bf16):
    """|got - want| <= 2 K eps_acc S (+ 2^-8 |want| for a bf16 output), elementwise."""
    import cupy
    got = cupy.asnumpy(got).astype(np.float64)
    bound = 2 * k * EPS[acc] * terms + (BF16_OUT * np.abs(want) if out_bf16 else 0.0)
    excess = np.abs(got - want) - bound
    assert excess.max(initial=-1.0) <= 0, f"error exceeds the bound by {excess.max():.3g}"


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize("m,k,n", [(33, 257, 65), (1, 8, 3), (128, 1024, 96)])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_bf16(trans_a, trans_b, m, k, n, out_dtype):
    from mpipar.kernels import cublas
    rng = np.random.default_rng(m + k + n)
    a, da = _operand(rng, (k, m) if trans_a else (m, k), "bfloat16")
    b, db = _operand(rng, (n, k) if trans_b else (k, n), "bfloat16")
    got = cublas.matmul(da, db, trans_a, trans_b, out_dtype=BF16 if out_dtype == "bfloat16"
                        else np.float32)
    assert got.shape == (m, n) and got.dtype == np.dtype(BF16 if out_dtype == "bfloat16"
                                                         else np.float32)
    want = _op(a, trans_a) @ _op(b, trans_b)
    _check(got, want, np.abs(_op(a, trans_a)) @ np.abs(_op(b, trans_b)), k, "float32",
           out_dtype == "bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
def test_float(dtype, trans_a, trans_b):
    from mpipar.kernels import cublas
    rng = np.random.default_rng(3)
    m, k, n = 45, 300, 29
    a, da = _operand(rng, (k, m) if trans_a else (m, k), dtype)
    b, db = _operand(rng, (n, k) if trans_b else (k, n), dtype)
    got = cublas.matmul(da, db, trans_a, trans_b, alpha=0.5)
    assert got.dtype == np.dtype(dtype)
    oa, ob = _op(a, trans_a), _op(b, trans_b)
    _check(got, 0.5 * (oa @ ob), 0.5 * np.abs(oa) @ np.abs(ob), k, dtype, False)


def test_weight_gradient_accumulates_into_float32():
    """dW [out, in] (float32) += dy^T x with bf16 dy [T, out], x [T, in], twice (beta = 1):
    two microbatches' gradients summed in float32, never rounded to bf16."""
    import cupy
    from mpipar.kernels import cublas
    rng = np.random.default_rng(4)
    t, n_out, n_in = 300, 40, 24
    dw0 = rng.standard_normal((n_out, n_in)).astype(np.float32)
    dw = cupy.asarray(dw0)
    want, terms = dw0.astype(np.float64), np.abs(dw0).astype(np.float64)
    for _ in range(2):
        dy, ddy = _operand(rng, (t, n_out), "bfloat16")
        x, dx = _operand(rng, (t, n_in), "bfloat16")
        assert cublas.matmul(ddy, dx, trans_a=True, out=dw, beta=1.0) is dw
        want, terms = want + dy.T @ x, terms + np.abs(dy.T) @ np.abs(x)
    _check(dw, want, terms, 2 * t + 2, "float32", False)


def test_linear_forward_and_input_gradient():
    """y = x W^T and dx = dy W, bf16 in and out: the engine's linear."""
    from mpipar.kernels import cublas
    rng = np.random.default_rng(5)
    x, dx_ = _operand(rng, (77, 96), "bfloat16")
    w, dw_ = _operand(rng, (160, 96), "bfloat16")
    _check(cublas.matmul(dx_, dw_, trans_b=True), x @ w.T, np.abs(x) @ np.abs(w.T), 96,
           "float32", True)
    dy, ddy = _operand(rng, (77, 160), "bfloat16")
    _check(cublas.matmul(ddy, dw_), dy @ w, np.abs(dy) @ np.abs(w), 160, "float32", True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize("batch_a,batch_b", [(5, 5), (5, None), (None, 5)])
def test_strided_batched(dtype, trans_a, trans_b, batch_a, batch_b):
    """3-D operands (gemmStridedBatchedEx); a 2-D operand is shared by the batch."""
    from mpipar.kernels import cublas
    rng = np.random.default_rng(6)
    m, k, n = 19, 72, 23
    a, da = _operand(rng, ((batch_a,) if batch_a else ()) + ((k, m) if trans_a else (m, k)), dtype)
    b, db = _operand(rng, ((batch_b,) if batch_b else ()) + ((n, k) if trans_b else (k, n)), dtype)
    got = cublas.matmul(da, db, trans_a, trans_b)
    assert got.shape == (5, m, n)
    oa, ob = _op(a, trans_a), _op(b, trans_b)
    acc = "float32" if dtype == "bfloat16" else "float64"
    _check(got, oa @ ob, np.abs(oa) @ np.abs(ob), k, acc, dtype == "bfloat16")


def test_batched_accumulate_and_empty():
    """beta = 1 on a batched float32 output from bf16; K = 0 gives beta * out (0 for a new
    output)."""
    import cupy
    from mpipar.kernels import cublas
    rng = np.random.default_rng(7)
    a, da = _operand(rng, (3, 8, 16), "bfloat16")
    b, db = _operand(rng, (3, 16, 4), "bfloat16")
    c0 = rng.standard_normal((3, 8, 4)).astype(np.float32)
    c = cupy.asarray(c0)
    cublas.matmul(da, db, out=c, beta=1.0)
    _check(c, c0 + a @ b, np.abs(c0) + np.abs(a) @ np.abs(b), 17, "float32", False)
    empty = cublas.matmul(cupy.zeros((3, 0), np.float32), cupy.zeros((0, 5), np.float32))
    assert empty.shape == (3, 5) and not cupy.asnumpy(empty).any()


def test_argument_errors():
    import cupy
    from mpipar.kernels import cublas
    a = cupy.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="inner dimensions"):
        cublas.matmul(a, a)
    with pytest.raises(ValueError, match="needs an existing out"):
        cublas.matmul(a, a, trans_b=True, beta=1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        cublas.matmul(a, a.astype(np.float64), trans_b=True)
    with pytest.raises(ValueError, match="output dtype"):
        cublas.matmul(a, a, trans_b=True, out_dtype=BF16)
