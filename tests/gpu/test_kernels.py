"""The float32/float64 CuPy kernels (mpipar.kernels.cupy_gpu) equal numpy_ref on the same
inputs: float64 <= 1e-12, float32 <= 1e-5, relative to the scale stated in `_close` (the
largest reference value; for attention gradients the largest sum of |terms|, see
`_grad_scales`). Attention over the blocks ring attention and zigzag produce (global offsets),
sliding windows, grouped-query heads, lengths off the tiles, and every head dim the product
uses (8 to 128). Self-contained: imports mpipar.kernels, numpy and cupy only."""
from __future__ import annotations

import numpy as np
import pytest

from mpipar.kernels import numpy_ref as ref

TOL = {"float64": 1e-12, "float32": 1e-5}
DTYPES = ("float64", "float32")
HEAD_DIMS = (8, 16, 32, 64, 80, 96, 128)


def _host(a) -> np.ndarray:
    import cupy
    return np.asarray(cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a, np.float64)


def _close(got, want, dtype: str, scale: float | None = None) -> None:
    """max |got - want| <= TOL * scale over the finite reference values (the same entries
    finite on both sides); scale: max |want| unless given."""
    got, want = _host(got), _host(want)
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got))
    if scale is None:
        scale = np.abs(want[finite]).max(initial=0.0)
    err = np.abs(got[finite] - want[finite]).max(initial=0.0)
    assert err <= TOL[dtype] * max(scale, 1e-300), f"error {err:.3g} > {TOL[dtype]} * {scale:.3g}"


def _dev(*arrays):
    import cupy
    return [cupy.asarray(a) for a in arrays]


def _grad_scales(q, k, v, out, lse, dout, q_off, k_off, causal, window=0):
    """For dq, dk, dv: the largest sum of |terms| of the flash-attention formulas (float64),
    the scale the gradients' rounding errors are proportional to.

    A floating-point sum's error is bounded by a few unit roundoffs times the sum of the
    magnitudes of its terms, not times the magnitude of the result. Where the terms cancel,
    max |want| is the wrong scale: with window=1 each query sees only its own key, so
    dS = P (dO.v - delta) is exactly 0 (delta = dO.out = dO.v) and the true dq is 0; both
    sides are then rounding noise of the size eps * |dO||v||k| and a relative check against
    max |dq| = noise fails for a correct kernel. The scales here are |P| (|dO||V|^T + |dO*out|
    row sums) times |K| (dq) or |Q| (dk), and |P|^T |dO| (dv): equal to max |want| up to a
    small factor where nothing cancels, meaningful where something does."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, sc = hq // hkv, ref.attention_scale(d, None)
    q, k, v, out, lse, dout = (np.asarray(a, np.float64) for a in (q, k, v, out, lse, dout))
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # [B, Sk, Hq, D]
    p = np.exp(np.einsum("bihd,bjhd->bhij", q, kk) * sc
               - np.where(np.isfinite(lse), lse, np.inf)[..., None])
    if causal:
        p = p * ref.visible_mask(np, sq, sk, q_off, k_off, window)
    ds = p * (np.einsum("bihd,bjhd->bhij", np.abs(dout), np.abs(vv))
              + np.abs(dout * out).sum(-1).transpose(0, 2, 1)[..., None])
    dq = sc * np.einsum("bhij,bjhd->bihd", ds, np.abs(kk))
    dk = sc * np.einsum("bhij,bihd->bjhd", ds, np.abs(q)).reshape(b, sk, hkv, g, d).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", p, np.abs(dout)).reshape(b, sk, hkv, g, d).sum(3)
    return dq.max(initial=0.0), dk.max(initial=0.0), dv.max(initial=0.0)


def _check_attention(dtype, q, k, v, q_off, k_off, causal, window=0):
    """Forward (out, lse) and backward (dq, dk, dv) of cupy_gpu against numpy_ref."""
    from mpipar.kernels import cupy_gpu
    dout = np.random.default_rng(5).standard_normal(q.shape).astype(dtype)
    out, lse = ref.attention_fwd(q, k, v, q_off, k_off, causal, window=window)
    got_out, got_lse = cupy_gpu.attention_fwd(*_dev(q, k, v), q_off, k_off, causal, window=window)
    _close(got_out, out, dtype)
    _close(got_lse, lse, dtype)
    want = ref.attention_bwd(q, k, v, out, lse, dout, q_off, k_off, causal, window=window)
    got = cupy_gpu.attention_bwd(*_dev(q, k, v, out, lse, dout), q_off, k_off, causal,
                                 window=window)
    scales = _grad_scales(q, k, v, out, lse, dout, q_off, k_off, causal, window)
    for g, w, s in zip(got, want, scales):
        _close(g, w, dtype, s)


def _qkv(rng, dtype, b, sq, sk, hq, hkv, d):
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k, v = (rng.standard_normal((b, sk, hkv, d)).astype(dtype) for _ in range(2))
    return q, k, v


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
    q, k, v = _qkv(np.random.default_rng(0), dtype, 2, sq, sk, hq, hkv, 64)
    _check_attention(dtype, q, k, v, q_off, k_off, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,q_off,k_off,window", [
    (150, 150, 0, 0, 1),       # each query sees itself only: dq = 0 exactly (see _grad_scales)
    (150, 150, 0, 0, 16),      # smaller than a tile
    (150, 150, 0, 0, 64),      # equal to a tile of keys
    (150, 150, 0, 0, 100),     # larger than a block of query rows
    (32, 32, 64, 32, 40),      # ring: an earlier key block, partly inside the window
    (40, 40, 600, 0, 100),     # a key block wholly outside the window: out 0, lse -inf
    (16, 48, 40, 8, 20),       # zigzag offsets
])
def test_attention_window(dtype, sq, sk, q_off, k_off, window):
    """The sliding window on the device, forward and backward, against numpy_ref."""
    q, k, v = _qkv(np.random.default_rng(1), dtype, 1, sq, sk, 4, 2, 64)
    _check_attention(dtype, q, k, v, q_off, k_off, True, window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_attention_head_dims(dtype, d):
    """Every head dim the product uses (the engine's test model: 8), each with its own lane
    count and tile size: causal ring offsets with GQA, a window over zigzag offsets, and
    non-causal, with more rows than one block holds."""
    rng = np.random.default_rng(d)
    q, k, v = _qkv(rng, dtype, 2, 300, 300, 4, 2, d)
    _check_attention(dtype, q, k, v, 300, 0, True)
    _check_attention(dtype, q, k, v, 0, 0, True)
    q, k, v = _qkv(rng, dtype, 1, 70, 90, 6, 3, d)
    _check_attention(dtype, q, k, v, 130, 50, True, window=33)
    _check_attention(dtype, q, k, v, 0, 0, False)


def test_attention_refuses_other_head_dims():
    from mpipar.kernels import cupy_gpu
    q, k, v = _qkv(np.random.default_rng(0), "float32", 1, 4, 4, 2, 2, 24)
    with pytest.raises(ValueError, match="head_dim=24 must be one of"):
        cupy_gpu.attention_fwd(*_dev(q, k, v))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_rope_swiglu(dtype):
    from mpipar.kernels import cupy_gpu
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((3, 17, 96)).astype(dtype) for _ in range(2))
    w = rng.standard_normal(96).astype(dtype)
    y, rstd = ref.rmsnorm_fwd(x, w, 1e-5)
    gy, grstd = cupy_gpu.rmsnorm_fwd(*_dev(x, w), 1e-5)
    _close(gy, y, dtype)
    _close(grstd, rstd, dtype)
    for g, want in zip(cupy_gpu.rmsnorm_bwd(*_dev(dy, x, w, rstd)),
                       ref.rmsnorm_bwd(dy, x, w, rstd)):
        _close(g, want, dtype)
    xr = rng.standard_normal((2, 17, 4, 64)).astype(dtype)
    cos, sin = ref.rope_cos_sin(np.arange(5, 22), 64, 10000.0, dtype)
    _close(cupy_gpu.rope_fwd(*_dev(xr, cos, sin)), ref.rope_fwd(xr, cos, sin), dtype)
    _close(cupy_gpu.rope_bwd(*_dev(xr, cos, sin)), ref.rope_bwd(xr, cos, sin), dtype)
    _close(cupy_gpu.swiglu_fwd(*_dev(x, dy)), ref.swiglu_fwd(x, dy), dtype)
    dh = rng.standard_normal(x.shape).astype(dtype)
    for g, want in zip(cupy_gpu.swiglu_bwd(*_dev(dh, x, dy)), ref.swiglu_bwd(dh, x, dy)):
        _close(g, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_past_one_block(dtype):
    """Rows longer than a block's 256 threads (strided loops) and a grid-stride RoPE over many
    pairs."""
    from mpipar.kernels import cupy_gpu
    rng = np.random.default_rng(4)
    x, dy = (rng.standard_normal((5, 1000)).astype(dtype) for _ in range(2))
    w = rng.standard_normal(1000).astype(dtype)
    y, rstd = ref.rmsnorm_fwd(x, w, 1e-6)
    for g, want in zip(cupy_gpu.rmsnorm_fwd(*_dev(x, w), 1e-6), (y, rstd)):
        _close(g, want, dtype)
    for g, want in zip(cupy_gpu.rmsnorm_bwd(*_dev(dy, x, w, rstd)),
                       ref.rmsnorm_bwd(dy, x, w, rstd)):
        _close(g, want, dtype)
    xr = rng.standard_normal((3, 129, 8, 16)).astype(dtype)
    cos, sin = ref.rope_cos_sin(np.arange(129), 16, 500000.0, dtype)
    _close(cupy_gpu.rope_fwd(*_dev(xr, cos, sin)), ref.rope_fwd(xr, cos, sin), dtype)


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


def test_gate_reports_what_rawmodule_builds():
    """The compile gate's options are CuPy RawModule's: for every kernel of cupy_gpu on this
    device's architecture, the registers, local memory and static shared memory the gate reports
    (NVRTC without a device) equal the attributes of the kernel RawModule compiled."""
    import cupy
    from mpipar.kernels import cuda_gate, cupy_gpu
    arch = f"sm_{cupy.cuda.Device().compute_capability}"
    sources = cupy_gpu.cuda_sources()
    reports = {(r.module, r.name): r for r in cuda_gate.compile_report(arch, sources)}
    for src in sources:
        module = cupy.RawModule(code=src["code"], options=src["options"],
                                name_expressions=src["names"])
        for name in src["names"]:
            kernel, report = module.get_function(name), reports[src["name"], name]
            assert (kernel.num_regs, kernel.local_size_bytes, kernel.shared_size_bytes) == (
                report.registers, report.stack_bytes, report.static_smem), (src["name"], name)
