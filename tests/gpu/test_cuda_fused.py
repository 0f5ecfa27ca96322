"""The fused bf16 kernels (kernels/cuda_fused.py) against numpy_ref computed in float64 on the
same bf16-rounded inputs (and float32 tables / statistics upcast), with fresh random inputs each
run (the seed is printed; set MPIPAR_TEST_SEED to replay one).

Tolerances. bf16 keeps 8 significant bits, so rounding a value to bf16 (nearest even) moves it by
at most u = 2**-8 (3.9e-3) of itself. Every bf16 output here is float32 math rounded once, and the
float32 math is good to ~1e-6 relative, so for products (RMSNorm y, SwiGLU h, ...):
    |got - want| <= RTOL |want|,  RTOL = u + 1e-5
(tighter than 2u: a truncating or double rounding shows). Outputs that are differences (dx of
RMSNorm, RoPE, softmax - onehot, the SwiGLU derivative near its zero) can cancel, and then the
float32 error is relative to the terms, not to the result: ATOL = 1e-5 of the largest |want| is
added (float32 leaves ~1e-7 of the terms; the terms are of the size of the outputs here).
float32 statistics (rstd, the softmax sum) come from at most ~100 chained float32 additions of
positive terms (2**-24 each) and exp's approximation (~2e-7): STAT_RTOL = 1e-5. The RMSNorm weight
gradient is a float32 sum over rows of terms of either sign: per column |err| <= 1e-5 of
sum |terms|. The maximum logit and the target logit are bf16 values, exact in float32: equal.
The embedding gradient is a float32 accumulation in numpy_ref's order: bit-identical to
numpy_ref run in float32.

Run: `python -m pytest -q tests/gpu/test_cuda_fused.py` (67 tests); `python
tests/gpu/test_cuda_fused.py` prints the achieved bandwidth at realistic sizes (H100 80GB HBM3:
rmsnorm_fwd 16384x4096 1.93 TB/s, cross_entropy_stats 8192x32000 1.63 TB/s, copy 2.65 TB/s).
"""
from __future__ import annotations

import os
import secrets

import numpy as np
import pytest

from mpipar.kernels import numpy_ref as ref

U = 2.0 ** -8
RTOL = U + 1e-5
ATOL = 1e-5
STAT_RTOL = 1e-5
DW_RTOL = 1e-5


def _cf():
    from mpipar.kernels import cuda_fused
    return cuda_fused


def _bf16():
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def rng():
    seed = int(os.environ.get("MPIPAR_TEST_SEED", secrets.randbits(32)))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


pytestmark = pytest.mark.usefixtures("poisoned_pool")   # tests/gpu/conftest.py


def _bf(rng, shape, scale=1.0, shift=0.0):
    """A host bf16 array of normal values (the test's inputs are these exact values)."""
    return (rng.standard_normal(shape) * scale + shift).astype(_bf16())


def _dev(*arrays):
    import cupy
    return [cupy.asarray(a) for a in arrays]


def _host(a) -> np.ndarray:
    import cupy
    return cupy.asnumpy(a)


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _assert_close(got, want, what: str, dtype=None, rtol=RTOL, atol=ATOL) -> None:
    """|got - want| <= rtol |want| + atol max|want| everywhere, got finite (not poison)."""
    g = _host(got)
    if dtype is not None:
        assert g.dtype == dtype, f"{what}: dtype {g.dtype}, want {dtype}"
    g, w = _f64(g), _f64(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape}, want {w.shape}"
    assert np.isfinite(g).all(), f"{what}: {np.count_nonzero(~np.isfinite(g))} non-finite values"
    err = np.abs(g - w)
    bound = rtol * np.abs(w) + atol * np.abs(w).max(initial=0.0)
    worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else ()
    assert (err <= bound).all(), (f"{what}: {np.count_nonzero(err > bound)} of {err.size} off; "
                                  f"at {worst} got {g[worst]!r} want {w[worst]!r}")


def _assert_bitwise(a, b, what: str) -> None:
    a, b = _host(a), _host(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), f"{what}: two runs differ"


def _misaligned(a):
    """A C-contiguous device copy of host `a` whose data pointer is off 16-byte alignment by one
    element (forces the kernels' narrowest loads)."""
    import cupy
    flat = cupy.empty(a.size + 1, a.dtype)
    out = flat[1:].reshape(a.shape)
    out[...] = cupy.asarray(a)
    return out


# ---------------------------------------------------------------------------------- RMSNorm
# (shape, what it exercises): vector width 8/4/2/1, the register cache and its overflow (2051:
# 512 threads x 4 vectors of 1 < 2051), blocks looping over rows (> 2048 forward blocks, > 512
# backward partials).
NORM_SHAPES = [(3, 5, 40), (2, 4096), (3, 4100), (2, 2051), (7, 6), (2500, 24), (600, 48)]


def _norm_check_fwd(x, w, y, rstd, what):
    want_y, want_r = ref.rmsnorm_fwd(_f64(x), _f64(w), 1e-5)
    _assert_close(y, want_y, f"{what} y", _bf16())
    _assert_close(rstd, want_r, f"{what} rstd", np.float32, rtol=STAT_RTOL, atol=0.0)


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("aligned", [True, False])
def test_rmsnorm_fwd(rng, shape, aligned):
    x, w = _bf(rng, shape, 2.0), _bf(rng, shape[-1:], 0.5, 1.0)
    dx_ = _dev(x, w) if aligned else [_misaligned(x), _misaligned(w)]
    y, rstd = _cf().rmsnorm_fwd(*dx_, 1e-5)
    assert rstd.shape == shape[:-1]
    _norm_check_fwd(x, w, y, rstd, "rmsnorm_fwd")
    _assert_bitwise(y, _cf().rmsnorm_fwd(*dx_, 1e-5)[0], "rmsnorm_fwd y")


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_add_rmsnorm_fwd(rng, shape):
    x, r, w = _bf(rng, shape), _bf(rng, shape), _bf(rng, shape[-1:], 0.5, 1.0)
    s, y, rstd = _cf().add_rmsnorm_fwd(*_dev(x, r, w), 1e-5)
    _assert_close(s, _f64(x) + _f64(r), "add_rmsnorm_fwd s", _bf16(), atol=0.0)
    # y is the norm of the rounded s the kernel returns (what the backward sees).
    _norm_check_fwd(_host(s), w, y, rstd, "add_rmsnorm_fwd")


def _norm_bwd_inputs(rng, shape):
    x, w, dy = _bf(rng, shape, 2.0), _bf(rng, shape[-1:], 0.5, 1.0), _bf(rng, shape)
    rstd = (1.0 / np.sqrt((_f64(x) ** 2).mean(-1) + 1e-5)).astype(np.float32)
    return x, w, dy, rstd


def _check_dw(dw, dy, x, rstd, want, what):
    terms = np.abs(_f64(dy) * _f64(x) * _f64(rstd)[..., None]).reshape(-1, x.shape[-1])
    g = _host(dw)
    assert g.dtype == np.float32 and g.shape == want.shape
    err = np.abs(_f64(g) - want)
    assert (err <= DW_RTOL * terms.sum(0)).all(), f"{what}: dw off by {err.max()}"


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rmsnorm_bwd(rng, shape):
    x, w, dy, rstd = _norm_bwd_inputs(rng, shape)
    args = _dev(dy, x, w, rstd)
    dx, dw = _cf().rmsnorm_bwd(*args)
    want_dx, want_dw = ref.rmsnorm_bwd(_f64(dy), _f64(x), _f64(w), _f64(rstd))
    _assert_close(dx, want_dx, "rmsnorm_bwd dx", _bf16())
    _check_dw(dw, dy, x, rstd, want_dw, "rmsnorm_bwd")
    dx2, dw2 = _cf().rmsnorm_bwd(*args)
    _assert_bitwise(dx, dx2, "rmsnorm_bwd dx")
    _assert_bitwise(dw, dw2, "rmsnorm_bwd dw")


@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_add_rmsnorm_bwd(rng, shape):
    s, w, dy, rstd = _norm_bwd_inputs(rng, shape)
    ds = _bf(rng, shape)
    dsum, dw = _cf().add_rmsnorm_bwd(*_dev(dy, ds, s, w, rstd))
    want_dx, want_dw = ref.add_rmsnorm_bwd(_f64(dy), _f64(ds), _f64(s), _f64(w), _f64(rstd))
    _assert_close(dsum, want_dx, "add_rmsnorm_bwd dsum", _bf16())
    _check_dw(dw, dy, s, rstd, want_dw, "add_rmsnorm_bwd")
    misaligned = _cf().add_rmsnorm_bwd(*(_misaligned(a) for a in (dy, ds, s, w, rstd)))
    _assert_close(misaligned[0], want_dx, "add_rmsnorm_bwd dsum (misaligned)", _bf16())
    _check_dw(misaligned[1], dy, s, rstd, want_dw, "add_rmsnorm_bwd (misaligned)")


# ------------------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("shape", [(2, 5, 3, 16), (1, 7, 2, 128), (1, 3, 2, 8), (2, 3, 2, 12),
                                   (1, 4, 3, 6)])
def test_rope(rng, shape):
    b, s, h, d = shape
    positions = np.arange(100, 100 + s)
    cos, sin = ref.rope_cos_sin(positions, d, 10000.0, np.float32)
    x = _bf(rng, shape)
    args = _dev(x, cos, sin)
    y = _cf().rope_fwd(*args)
    _assert_close(y, ref.rope_fwd(_f64(x), _f64(cos), _f64(sin)), "rope_fwd", _bf16())
    dx = _cf().rope_bwd(*args)
    _assert_close(dx, ref.rope_bwd(_f64(x), _f64(cos), _f64(sin)), "rope_bwd", _bf16())
    _assert_bitwise(y, _cf().rope_fwd(*args), "rope_fwd")


# ----------------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("shape", [(3, 5, 40), (4, 4100), (3, 7), (2, 3), (1, 12)])
def test_swiglu(rng, shape):
    g, u, dh = _bf(rng, shape, 3.0), _bf(rng, shape), _bf(rng, shape)
    h = _cf().swiglu_fwd(*_dev(g, u))
    _assert_close(h, ref.swiglu_fwd(_f64(g), _f64(u)), "swiglu_fwd", _bf16())
    args = _dev(dh, g, u)
    dg, du = _cf().swiglu_bwd(*args)
    want_dg, want_du = ref.swiglu_bwd(_f64(dh), _f64(g), _f64(u))
    _assert_close(dg, want_dg, "swiglu_bwd dgate", _bf16())
    _assert_close(du, want_du, "swiglu_bwd dup", _bf16())
    dg2, du2 = _cf().swiglu_bwd(*args)
    _assert_bitwise(dg, dg2, "swiglu_bwd dgate")
    _assert_bitwise(du, du2, "swiglu_bwd dup")


# ---------------------------------------------------------------------------- cross-entropy
# (rows, columns of the shard, vocab_start, vocab_size, logit shift): padding columns (ids >=
# vocab_size) in a vector's middle, widths 8/4/1, a large vocab shard, logits far from 0, and a
# shard of padding only.
CE_CASES = [(9, 40, 0, None, 0.0), (7, 1000, 1000, 1990, 0.0), (5, 4100, 4100, 8195, 0.0),
            (6, 37, 0, 30, 0.0), (4, 32000, 32000, 64000, 30.0), (3, 64, 64, 50, 0.0),
            (300, 24, 48, 1000, -5.0)]


def _ce_inputs(rng, n, cols, start, vsize, shift):
    logits = _bf(rng, (n, cols), 4.0, shift)
    total = vsize if vsize is not None else start + cols
    nvalid = ref.valid_columns(cols, start, vsize)
    inside = start + rng.integers(0, max(nvalid, 1), n)
    targets = np.where(rng.random(n) < 0.5, inside, rng.integers(0, total, n)).astype(np.int64)
    return logits, np.minimum(targets, total - 1)


@pytest.mark.parametrize("n,cols,start,vsize,shift", CE_CASES)
def test_cross_entropy_stats(rng, n, cols, start, vsize, shift):
    logits, targets = _ce_inputs(rng, n, cols, start, vsize, shift)
    args = _dev(logits, targets.astype(np.int32))
    m, s, t = _cf().cross_entropy_stats(*args, start, vsize)
    want = ref.cross_entropy_stats(_f64(logits), targets, start, vsize)
    for got, name in zip((m, s, t), "mst"):
        assert _host(got).dtype == np.float32 and got.shape == (n,), name
    assert np.array_equal(_f64(_host(m)), want[0]), "m: the max of bf16 values is exact"
    assert np.array_equal(_f64(_host(t)), want[2]), "t: a bf16 value is exact"
    _assert_close(s, want[1], "cross_entropy_stats s", rtol=STAT_RTOL, atol=0.0)
    _assert_bitwise(s, _cf().cross_entropy_stats(*args, start, vsize)[1], "cross_entropy_stats s")


@pytest.mark.parametrize("n,cols,start,vsize,shift", CE_CASES)
def test_cross_entropy_bwd(rng, n, cols, start, vsize, shift):
    logits, targets = _ce_inputs(rng, n, cols, start, vsize, shift)
    m, s, _ = ref.cross_entropy_stats(_f64(logits), targets, start, vsize)
    # The global lse: this shard's plus what other shards add (or any value, all padding).
    local = np.where(np.isfinite(m), m + np.log(np.where(s > 0, s, 1.0)), shift)
    lse = (local + rng.uniform(0.0, 2.0, n)).astype(np.float32)
    dloss = rng.uniform(0.5, 1.5, n).astype(np.float32)
    args = _dev(logits, targets, lse, dloss)
    got = _cf().cross_entropy_bwd(*args, start, vsize)
    want = ref.cross_entropy_bwd(_f64(logits), targets, _f64(lse), _f64(dloss), start, vsize)
    _assert_close(got, want, "cross_entropy_bwd", _bf16())
    nvalid = ref.valid_columns(cols, start, vsize)
    assert not _f64(_host(got))[:, nvalid:].any(), "padding columns must be 0"
    _assert_bitwise(got, _cf().cross_entropy_bwd(*args, start, vsize), "cross_entropy_bwd")


# -------------------------------------------------------------------------------- embedding
@pytest.mark.parametrize("ids_shape,hidden,aligned", [((3, 50), 40, True), ((2, 70), 4096, True),
                                                      ((4, 33), 4100, True), ((5, 9), 6, True),
                                                      ((3, 50), 40, False)])
def test_embedding_bwd(rng, ids_shape, hidden, aligned):
    import cupy
    rows, row_start = 64, 32
    ids = rng.integers(0, 128, ids_shape)  # a quarter in [32, 96): repeats, and other shards'
    ids.flat[:5] = 40  # one id many times
    dx = _bf(rng, ids_shape + (hidden,))
    dw0 = rng.standard_normal((rows, hidden)).astype(np.float32)
    want = ref.embedding_bwd(dw0.copy(), dx, ids, row_start)  # float32 add.at, token order
    dw = cupy.asarray(dw0)
    got = _cf().embedding_bwd(dw, _dev(dx)[0] if aligned else _misaligned(dx),
                              cupy.asarray(ids), row_start)
    assert got is dw
    assert _host(dw).tobytes() == want.tobytes(), "dw must equal numpy_ref's float32 add.at bits"
    untouched = cupy.asarray(dw0)
    _cf().embedding_bwd(untouched, _dev(dx)[0], cupy.asarray(ids + 1000), row_start)
    assert _host(untouched).tobytes() == dw0.tobytes(), "ids of other shards must change nothing"


# ------------------------------------------------------------------------------- arguments
def test_argument_errors(rng):
    import cupy
    cf = _cf()
    x, w = _dev(_bf(rng, (4, 8)), _bf(rng, (8,)))
    with pytest.raises(ValueError, match="rmsnorm_fwd: x must be a bfloat16 CuPy array"):
        cf.rmsnorm_fwd(x.astype(cupy.float32), w, 1e-5)
    with pytest.raises(ValueError, match="rmsnorm_fwd: w.shape"):
        cf.rmsnorm_fwd(x, w[:4], 1e-5)
    with pytest.raises(ValueError, match="rmsnorm_bwd: rstd must be a float32"):
        cf.rmsnorm_bwd(x, x, w, cupy.ones(4, cupy.float64))
    with pytest.raises(ValueError, match="add_rmsnorm_fwd: x.shape"):
        cf.add_rmsnorm_fwd(x, x[:2], w, 1e-5)
    with pytest.raises(ValueError, match="swiglu_bwd: shapes"):
        cf.swiglu_bwd(x, x, x[:, :4])
    with pytest.raises(ValueError, match="rope_fwd: cos"):
        cf.rope_fwd(x.reshape(1, 2, 2, 8), *_dev(*ref.rope_cos_sin(np.arange(3), 8, 1e4, np.float32)))
    with pytest.raises(ValueError, match="cross_entropy_stats: target id"):
        cf.cross_entropy_stats(x, cupy.asarray([0, 1, 2, 9]), 0, 8)
    with pytest.raises(ValueError, match="cross_entropy_bwd: lse must be a float32"):
        cf.cross_entropy_bwd(x, cupy.zeros(4, cupy.int64), cupy.zeros(4), cupy.zeros(4, cupy.float32))
    with pytest.raises(ValueError, match="embedding_bwd: dw must be a float32"):
        cf.embedding_bwd(cupy.zeros((8, 8), cupy.float64), x, cupy.zeros(4, cupy.int64))


def test_cuda_sources_list_every_launch():
    """The compile gate's view: one source, every name expression the wrappers launch."""
    (src,) = _cf().cuda_sources()
    names = set(src["names"])
    assert len(names) == len(src["names"]) == 41 and src["dynamic_smem"] == {}
    for kernel in ("mpipar_rms_fwd<8, true>", "mpipar_rms_bwd<1, false>", "mpipar_dw_reduce<8>",
                   "mpipar_ce_stats<4>", "mpipar_embed_bwd<2>", "mpipar_rope<1>"):
        assert kernel in names and kernel.split("<")[0] in src["code"]


# ------------------------------------------------------------------------------- bandwidth
def _median_seconds(fn, reps: int = 20) -> float:
    import cupy
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e-3)
    return float(np.median(times))


def bandwidth_report() -> list[tuple[str, float, float]]:
    """(what, bytes moved, median seconds) at realistic sizes, with a device-to-device copy for
    the ceiling. Bytes: each bf16 array read or written once (2 B an element) plus the float32
    statistics and gradients; intermediate partials (RMSNorm dw: 512 x H float32) not counted."""
    import cupy
    cf = _cf()
    cupy.random.seed(0)

    def dev(shape, scale=1.0):
        return (cupy.random.standard_normal(shape, cupy.float32) * scale).astype(_bf16())

    n, h = 16384, 4096
    x, r, dy, w = dev((n, h)), dev((n, h)), dev((n, h)), dev((h,))
    _, rstd = cf.rmsnorm_fwd(x, w, 1e-5)
    copy_dst = cupy.empty_like(x)
    logits = dev((8192, 32000), 4.0)
    targets = cupy.random.randint(0, 32000, 8192).astype(cupy.int64)
    m, s, t = cf.cross_entropy_stats(logits, targets)
    lse, dloss = m + cupy.log(s), cupy.full(8192, 1 / 8192, cupy.float32)
    g, u = dev((8192, 14336), 3.0), dev((8192, 14336))
    q = dev((4, 4096, 32, 128))
    cos, sin = (cupy.asarray(a) for a in ref.rope_cos_sin(np.arange(4096), 128, 5e5, np.float32))
    ids = cupy.random.randint(0, 32000, n)
    dw_emb = cupy.zeros((32000, h), cupy.float32)
    e = n * h
    rows = [("copy 16384x4096 bf16 (copyto)", 4 * e, lambda: cupy.copyto(copy_dst, x)),
            ("rmsnorm_fwd 16384x4096", 4 * e + 4 * n, lambda: cf.rmsnorm_fwd(x, w, 1e-5)),
            ("rmsnorm_bwd 16384x4096", 6 * e + 4 * n, lambda: cf.rmsnorm_bwd(dy, x, w, rstd)),
            ("add_rmsnorm_fwd 16384x4096", 8 * e + 4 * n,
             lambda: cf.add_rmsnorm_fwd(x, r, w, 1e-5)),
            ("add_rmsnorm_bwd 16384x4096", 8 * e + 4 * n,
             lambda: cf.add_rmsnorm_bwd(dy, r, x, w, rstd)),
            ("cross_entropy_stats 8192x32000", 2 * logits.size,
             lambda: cf.cross_entropy_stats(logits, targets)),
            ("cross_entropy_bwd 8192x32000", 4 * logits.size,
             lambda: cf.cross_entropy_bwd(logits, targets, lse, dloss)),
            ("swiglu_fwd 8192x14336", 6 * g.size, lambda: cf.swiglu_fwd(g, u)),
            ("swiglu_bwd 8192x14336", 10 * g.size, lambda: cf.swiglu_bwd(u, g, u)),
            ("rope_fwd 4x4096x32x128", 4 * q.size, lambda: cf.rope_fwd(q, cos, sin)),
            ("embedding_bwd 16384 tokens x 4096", 2 * e + 8 * e,
             lambda: cf.embedding_bwd(dw_emb, x, ids))]
    return [(what, nbytes, _median_seconds(fn)) for what, nbytes, fn in rows]


if __name__ == "__main__":
    import cupy
    print(cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for what, nbytes, sec in bandwidth_report():
        print(f"{what:36s} {sec * 1e6:9.1f} us {nbytes / sec / 1e9:8.0f} GB/s")
    # python tests/gpu/test_cuda_fused.py: bandwidth at realistic sizes (not a test).
