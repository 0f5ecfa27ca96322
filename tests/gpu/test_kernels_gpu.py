"""The CuPy kernels equal numpy_ref on the same inputs: float64 <= 1e-12, float32 <= 1e-5
(relative to the largest reference value). Attention over the blocks ring attention and zigzag
produce (global offsets), grouped-query heads and lengths off the tiles."""
from __future__ import annotations

import numpy as np
import pytest

from mpipar.kernels import numpy_ref as ref

TOL = {"float64": 1e-12, "float32": 1e-5}
DTYPES = ("float64", "float32")


def _close(got, want, dtype: str) -> None:
    from mpipar.runtime.device import to_host
    got, want = np.asarray(to_host(got), np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got))
    scale = max(np.abs(want[finite]).max(initial=0.0), 1e-300)
    assert np.abs(got[finite] - want[finite]).max(initial=0.0) / scale <= TOL[dtype]


def _dev(*arrays):
    import cupy
    return [cupy.asarray(a) for a in arrays]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,q_off,k_off,causal", [
    (37, 37, 0, 0, True),      # one block, off the tiles
    (32, 32, 32, 0, True),     # ring: an earlier key block, all visible
    (32, 32, 64, 64, True),    # ring: the diagonal block
    (16, 48, 40, 8, True),     # zigzag: partly visible
    (24, 24, 0, 48, True),     # nothing visible: out 0, lse -inf
    (29, 53, 0, 0, False),
])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2)])
def test_attention(dtype, sq, sk, q_off, k_off, causal, hq, hkv):
    from mpipar.kernels import cupy_gpu
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, sq, hq, 64)).astype(dtype)
    k, v = (rng.standard_normal((2, sk, hkv, 64)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse = ref.attention_fwd(q, k, v, q_off, k_off, causal)
    got_out, got_lse = cupy_gpu.attention_fwd(*_dev(q, k, v), q_off, k_off, causal)
    _close(got_out, out, dtype)
    _close(got_lse, lse, dtype)
    want = ref.attention_bwd(q, k, v, out, lse, dout, q_off, k_off, causal)
    got = cupy_gpu.attention_bwd(*_dev(q, k, v, out, lse, dout), q_off, k_off, causal)
    for g, w in zip(got, want):
        _close(g, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,q_off,k_off,window", [
    (150, 150, 0, 0, 1),       # each query sees itself only
    (150, 150, 0, 0, 16),      # smaller than a tile (16 keys in float64, 32 in float32)
    (150, 150, 0, 0, 64),      # equal to a block of query rows
    (150, 150, 0, 0, 100),     # larger than a block
    (32, 32, 64, 32, 40),      # ring: an earlier key block, partly inside the window
    (40, 40, 600, 0, 100),     # a key block wholly outside the window: out 0, lse -inf
    (16, 48, 40, 8, 20),       # zigzag offsets
])
def test_attention_window(dtype, sq, sk, q_off, k_off, window):
    """Issue 14: the sliding window on the device, forward and backward, against numpy_ref."""
    from mpipar.kernels import cupy_gpu
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, sq, 4, 64)).astype(dtype)
    k, v = (rng.standard_normal((1, sk, 2, 64)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse = ref.attention_fwd(q, k, v, q_off, k_off, True, window=window)
    got_out, got_lse = cupy_gpu.attention_fwd(*_dev(q, k, v), q_off, k_off, True, window=window)
    _close(got_out, out, dtype)
    _close(got_lse, lse, dtype)
    want = ref.attention_bwd(q, k, v, out, lse, dout, q_off, k_off, True, window=window)
    got = cupy_gpu.attention_bwd(*_dev(q, k, v, out, lse, dout), q_off, k_off, True,
                                 window=window)
    for g, w in zip(got, want):
        _close(g, w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_rope_swiglu(dtype):
    from mpipar.kernels import cupy_gpu
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((3, 17, 96)).astype(dtype) for _ in range(2))
    w = rng.standard_normal(96).astype(dtype)
    y, rstd = ref.rmsnorm_fwd(x, w, 1e-5)
    gy, grstd = cupy_gpu.rmsnorm_fwd(*_dev(x, w), 1e-5)
    _close(gy, y, dtype), _close(grstd, rstd, dtype)
    for g, want in zip(cupy_gpu.rmsnorm_bwd(*_dev(dy, x, w, rstd)), ref.rmsnorm_bwd(dy, x, w, rstd)):
        _close(g, want, dtype)
    xr = rng.standard_normal((2, 17, 4, 64)).astype(dtype)
    cos, sin = ref.rope_cos_sin(np.arange(5, 22), 64, 10000.0, dtype)
    _close(cupy_gpu.rope_fwd(*_dev(xr, cos, sin)), ref.rope_fwd(xr, cos, sin), dtype)
    _close(cupy_gpu.rope_bwd(*_dev(xr, cos, sin)), ref.rope_bwd(xr, cos, sin), dtype)
    _close(cupy_gpu.swiglu_fwd(*_dev(x, dy)), ref.swiglu_fwd(x, dy), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start,size", [(0, None), (13, 40), (48, 40)])
def test_cross_entropy_stats(dtype, start, size):
    from mpipar.kernels import cupy_gpu
    rng = np.random.default_rng(2)
    logits = (4 * rng.standard_normal((33, 16))).astype(dtype)
    targets = rng.integers(0, size or 16, 33)
    want = ref.cross_entropy_stats(logits, targets, start, size)
    got = cupy_gpu.cross_entropy_stats(*_dev(logits, targets), start, size)
    for g, w in zip(got, want):
        _close(g, w, dtype)
