"""cuDNN attention (bf16) against numpy_ref in float64 on the same bf16-rounded inputs.

Error measure: ||got - ref|| / ||ref|| over a whole tensor (float64). Tolerances from bf16's unit
roundoff u = 2^-9 (8-bit significand):
  * out: cuDNN rounds P to bf16 before P V, and the result to bf16: two roundings, <= 4u (7.8e-3);
  * lse: float32 statistics of exact bf16 products (no bf16 rounding on the way): <= 1e-6;
  * dq, dk, dv: dS rounded to bf16 before dS K and dS^T Q, the forward's bf16 out in
    delta = rowsum(dout * out), the gradients written in bf16: three roundings, <= 6u (1.2e-2).
Measured on an H100 (cuDNN 9.19.0): out 1.5e-3 .. 2.7e-3 (the ring merge's re-rounding the
largest), lse <= 7.6e-8, dq 2.4e-3 .. 3.1e-3, dk 2.5e-3 .. 3.3e-3, dv 1.8e-3 .. 3.0e-3.
Exact structure besides: rows with no visible key have out exactly 0 and lse exactly -inf, dq 0;
keys no row sees have dk = dv = 0. Outputs are allocated from a CuPy pool poisoned with NaN
first, so a value cuDNN did not write shows. Inputs are fresh random numbers each run (the seed
is in every failure message). Set CUDNN_ERRORS_JSON to a path to get every measured error.
Self-contained: imports only mpipar.kernels, numpy, ml_dtypes and cupy."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mpipar.kernels import cudnn_attention as ca
from mpipar.kernels import numpy_ref as ref

U = 2.0 ** -9
TOL = {"out": 4 * U, "lse": 1e-6, "dq": 6 * U, "dk": 6 * U, "dv": 6 * U}
MEASURED: dict[str, dict[str, float]] = {}

pytestmark = pytest.mark.skipif(ca.frontend_unavailable() is not None,
                                reason=f"{ca.frontend_unavailable()}")


@pytest.fixture(scope="module", autouse=True)
def _write_measured():
    yield
    path = os.environ.get("CUDNN_ERRORS_JSON")
    if path:
        with open(path, "w") as fh:
            json.dump({"tolerances": TOL, "grad_dtype": ca.GRAD_DTYPE, "errors": MEASURED},
                      fh, indent=1, sort_keys=True)


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def _host(rng, shape):
    """Standard normal numbers rounded to bf16: (bf16 host array, the same values in float64)."""
    x = rng.standard_normal(shape).astype(np.float32).astype(_bf16())
    return x, x.astype(np.float64)


def _dev(x):
    """A host bf16 array on the device (through its bits, whatever CuPy's ml_dtypes support)."""
    import cupy
    return cupy.asarray(x.view(np.uint16)).view(_bf16())


def _back(a):
    """A device array as float64 on the host (bf16 through its bits)."""
    import cupy
    if a.dtype == np.dtype(_bf16()):
        return cupy.asnumpy(a.view(cupy.uint16)).view(_bf16()).astype(np.float64)
    return cupy.asnumpy(a).astype(np.float64)


def _poison(nbytes: int = 64 << 20) -> None:
    """Fill free memory of CuPy's pool with NaN bytes, so that empty() returns NaN garbage."""
    import cupy
    junk = cupy.empty(nbytes, dtype=cupy.uint8)
    junk.fill(0xFF)
    del junk


def _compare(name: str, got, want, key: str, seed) -> None:
    """Relative error within TOL[name], and -inf exactly where the reference has it. Where the
    reference is exactly 0 throughout (dq when every row sees one key: a true zero, computed as
    rounding noise) the error is the rms of ``got`` against the unit scale of the inputs."""
    g, w = _back(got), np.asarray(want, np.float64)
    assert g.shape == w.shape, (name, g.shape, w.shape)
    finite = np.isfinite(w)
    assert np.array_equal(np.isfinite(g), finite), f"{key} {name}: non-finite pattern (seed {seed})"
    assert np.array_equal(g[~finite], w[~finite]), f"{key} {name}: -inf rows differ (seed {seed})"
    norm = np.linalg.norm(w[finite])
    diff = np.linalg.norm(g[finite] - w[finite])
    err = diff / norm if norm > 0 else diff / np.sqrt(max(g[finite].size, 1))
    MEASURED.setdefault(key, {})[name] = float(err)
    assert err <= TOL[name], \
        f"{key} {name}: relative error {err:.3g} > {TOL[name]:.3g} (seed {seed})"


def _check_masked_zero(got, blind, axis, key, name, seed):
    """Entries along sequence ``axis`` (1 for ``[B, S, H, D]``, 2 for lse ``[B, H, S]``) marked
    ``blind`` (query rows that see no key, keys no row sees) are exactly 0 (lse: -inf)."""
    g = np.take(_back(got), np.flatnonzero(blind), axis=axis)
    want = -np.inf if name == "lse" else 0.0
    assert np.all(g == want), f"{key} {name}: masked entries are not exactly {want} (seed {seed})"


def _run(b, sq, sk, hq, hkv, d, q_off, k_off, causal, window, key):
    """Forward and backward through cuDNN against numpy_ref (float64, same bf16 inputs)."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64), (v, v64) = (_host(rng, s) for s in ((b, sq, hq, d), (b, sk, hkv, d),
                                                            (b, sk, hkv, d)))
    dout, do64 = _host(rng, (b, sq, hq, d))
    seen = (np.asarray(ref.visible_mask(np, sq, sk, q_off, k_off, window)) if causal
            else np.ones((sq, sk), bool))
    blind_rows, blind_keys = ~seen.any(axis=1), ~seen.any(axis=0)
    out_ref, lse_ref = ref.attention_fwd(q64, k64, v64, q_off, k_off, causal, window=window)
    _poison()
    out, lse = ca.attention_fwd(_dev(q), _dev(k), _dev(v), q_off, k_off, causal, window=window)
    assert out.dtype == np.dtype(_bf16()) and lse.dtype == np.float32
    _compare("out", out, out_ref, key, seed)
    _compare("lse", lse, lse_ref, key, seed)
    _check_masked_zero(out, blind_rows, 1, key, "out", seed)
    _check_masked_zero(lse, blind_rows, 2, key, "lse", seed)
    grads_ref = ref.attention_bwd(q64, k64, v64, out_ref, lse_ref, do64, q_off, k_off, causal,
                                  window=window)
    _poison()
    grads = ca.attention_bwd(_dev(q), _dev(k), _dev(v), out, lse, _dev(dout), q_off, k_off,
                             causal, window=window)
    for name, got, want, blind in zip(("dq", "dk", "dv"), grads, grads_ref,
                                      (blind_rows, blind_keys, blind_keys)):
        assert got.dtype == np.float32, (name, got.dtype)
        _compare(name, got, want, key, seed)
        _check_masked_zero(got, blind, 1, key, name, seed)
    # grad_dtype bf16 (the seam's request for gradients it keeps): cuDNN's own bf16 buffers,
    # the same bits as the float32 gradients rounded back, zero margins included
    _poison()
    narrow = ca.attention_bwd(_dev(q), _dev(k), _dev(v), out, lse, _dev(dout), q_off, k_off,
                              causal, window=window, grad_dtype=np.dtype(_bf16()))
    for name, got, wide in zip(("dq", "dk", "dv"), narrow, grads):
        assert got.dtype == np.dtype(_bf16()) and got.shape == wide.shape, (name, got.dtype)
        assert np.array_equal(_back(got), _back(wide)), f"{key} {name}: bf16 gradients differ"


# (sq, sk, q_offset, k_offset, causal, window, (hq, hkv, d)): every ring / zigzag block kind,
# cuDNN's mask forms, ragged lengths; GQA and head dims spread over the cases.
CASES = {
    "causal": (128, 128, 0, 0, True, 0, (4, 4, 128)),
    "ring_earlier_block": (128, 128, 256, 128, True, 0, (8, 2, 128)),
    "ring_diagonal": (128, 128, 256, 256, True, 0, (4, 2, 64)),
    "zigzag_partial": (64, 192, 200, 72, True, 0, (8, 2, 128)),
    "invisible": (96, 96, 0, 192, True, 0, (4, 2, 64)),
    "leading_rows_blind": (48, 80, 0, 40, True, 0, (4, 1, 64)),
    "shifted_band_ragged": (100, 107, 37, 0, True, 0, (4, 2, 128)),
    "noncausal_ragged": (77, 133, 0, 0, False, 0, (8, 4, 64)),
    "window_1": (200, 200, 0, 0, True, 1, (4, 2, 64)),
    "window_48": (200, 200, 0, 0, True, 48, (4, 4, 128)),
    "window_earlier_block": (64, 64, 128, 64, True, 80, (8, 2, 64)),
    "window_zigzag": (64, 192, 200, 72, True, 100, (4, 2, 128)),
    "window_out_of_reach": (64, 64, 600, 0, True, 100, (4, 2, 64)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_attention_cases(name):
    sq, sk, q_off, k_off, causal, window, (hq, hkv, d) = CASES[name]
    _run(2, sq, sk, hq, hkv, d, q_off, k_off, causal, window, name)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_head_dims(group, d):
    """Grouped-query heads 1, 2, 4 per kv head, head dims 64 and 128, a ragged causal block."""
    _run(1, 131, 131, 4 * group, 4, d, 0, 0, True, 0, f"gqa{group}_d{d}")


def test_merged_backward_over_ring_blocks():
    """Two key blocks (an earlier one and the diagonal), forwards merged by numpy_ref's
    attention_merge, backwards from the merged out/lse summed: the gradient of the whole."""
    import cupy
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    s, hq, hkv, d = 96, 8, 2, 128
    (q, q64), (dout, do64) = _host(rng, (1, s, hq, d)), _host(rng, (1, s, hq, d))
    (k, k64), (v, v64) = _host(rng, (1, 2 * s, hkv, d)), _host(rng, (1, 2 * s, hkv, d))
    out_ref, lse_ref = ref.attention_fwd(q64, k64, v64, s, 0, True)
    want = ref.attention_bwd(q64, k64, v64, out_ref, lse_ref, do64, s, 0, True)
    blocks = [(_dev(k[:, :s]), _dev(v[:, :s]), 0), (_dev(k[:, s:]), _dev(v[:, s:]), s)]
    parts = [ca.attention_fwd(_dev(q), kb, vb, s, off, True) for kb, vb, off in blocks]
    o_a, l_a = _back(parts[0][0]), _back(parts[0][1])
    o_b, l_b = _back(parts[1][0]), _back(parts[1][1])
    merged, lse = ref.attention_merge(o_a, l_a, o_b, l_b)
    _compare("out", _dev(merged.astype(np.float32).astype(_bf16())), out_ref, "ring_merge", seed)
    out_dev = _dev(merged.astype(np.float32).astype(_bf16()))
    lse_dev = cupy.asarray(lse.astype(np.float32))
    grads = [ca.attention_bwd(_dev(q), kb, vb, out_dev, lse_dev, _dev(dout), s, off, True)
             for kb, vb, off in blocks]
    _compare("dq", grads[0][0] + grads[1][0], want[0], "ring_merge", seed)
    for i, name in ((1, "dk"), (2, "dv")):
        got = cupy.concatenate([grads[0][i], grads[1][i]], axis=1)
        _compare(name, got, want[i], "ring_merge", seed)


def test_strided_views_of_a_fused_qkv():
    """q, k, v as views of one fused projection output [B, S, Hq + 2 Hkv, D] (strides, no
    copies) give the same results as contiguous copies."""
    import cupy
    rng = np.random.default_rng(7)
    hq, hkv, d = 8, 2, 64
    fused, _ = _host(rng, (2, 70, hq + 2 * hkv, d))
    qkv = _dev(fused)
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    out_s, lse_s = ca.attention_fwd(q, k, v, 0, 0, True)
    out_c, lse_c = ca.attention_fwd(*(cupy.ascontiguousarray(a) for a in (q, k, v)), 0, 0, True)
    assert np.array_equal(_back(out_s), _back(out_c)) and np.array_equal(_back(lse_s), _back(lse_c))


def test_refusals_raise():
    """float32 inputs and head dims cuDNN lacks are refused with a reason, not computed."""
    import cupy
    x = cupy.zeros((1, 8, 2, 64), cupy.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        ca.attention_fwd(x, x, x)
    y = _dev(np.zeros((1, 8, 2, 12), _bf16()))
    with pytest.raises(ca.CudnnRefused, match="multiple of 8"):
        ca.attention_fwd(y, y, y)


def test_benchmark_small():
    """The bench's timing function runs and reports positive rates (tiny shape)."""
    from mpipar.bench.gpu_attention import cudnn_rates
    r = cudnn_rates(seq=512, batch=1, heads=4, kv_heads=2, head_dim=64, repeats=3, warmup=1)
    assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwd_tflops"] > 0
