"""mpipar's bf16 tensor-core flash attention (kernels/flash_mma.py) against numpy_ref in float64
on the same bf16-rounded inputs: ring blocks at global offsets (earlier, diagonal, zigzag,
invisible), rows without keys, non-causal, sliding windows, grouped-query heads, lengths off the
tiles, head dims 32/64/96/128; the backward from a ring-merged out and lse; tiles outside the mask
never read; outputs poisoned before every launch.

Tolerance, from bf16's 8-bit significand (unit roundoff u = 2^-9 ~ 2e-3 for round-to-nearest):
the kernel rounds P (forward) and P, dS (backward) to bf16 before the second GEMM, as FA2 does,
and the forward's output to bf16, so each output element carries a few independent errors of
relative size <= u; the relative Frobenius error ||got - ref|| / ||ref|| is then a small multiple
of u (about 1.5e-3 to 2.5e-3 measured on the CPU emulation of the kernel). Bound: TOL = 1e-2
(5 u) for out, dq, dk, dv; lse (float32 statistics, no bf16 rounding) within 1e-4 absolute.
A reference that is zero to rounding (window 1's dq: P = 1, dP = delta) is compared against
FLOOR * sqrt(n) instead of its own norm.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from mpipar.kernels import numpy_ref as ref

TOL = 1e-2
LSE_TOL = 1e-4
FLOOR = 1e-4

# id: (batch, sq, sk, hq, hkv, q_offset, k_offset, causal, window)
CASES = {
    "ring_earlier_block": (1, 96, 96, 4, 4, 96, 0, True, 0),
    "ring_diagonal_block": (2, 96, 96, 4, 2, 96, 96, True, 0),
    "zigzag_partial": (1, 40, 100, 8, 2, 70, 10, True, 0),
    "ring_invisible": (1, 64, 64, 4, 2, 0, 64, True, 0),
    "rows_without_keys": (1, 50, 60, 4, 1, 0, 20, True, 0),
    "causal_37": (2, 37, 37, 4, 4, 0, 0, True, 0),
    "causal_129": (1, 129, 129, 8, 2, 0, 0, True, 0),
    "causal_200": (1, 200, 200, 4, 1, 0, 0, True, 0),
    "noncausal_37x200": (1, 37, 200, 4, 2, 0, 0, False, 0),
    "noncausal_129": (2, 129, 129, 4, 4, 0, 0, False, 0),
    "noncausal_200x37": (1, 200, 37, 8, 2, 0, 0, False, 0),
    "window_1": (1, 150, 150, 4, 2, 0, 0, True, 1),
    "window_16_below_tile": (1, 150, 150, 4, 1, 0, 0, True, 16),
    "window_100_above_tile": (1, 200, 200, 8, 2, 0, 0, True, 100),
    "window_300_above_seq": (1, 200, 200, 4, 4, 0, 0, True, 300),
    "window_ring_partial": (1, 64, 64, 4, 2, 96, 0, True, 80),
    "window_ring_outside": (1, 40, 40, 4, 2, 600, 0, True, 100),
    "window_zigzag": (1, 48, 130, 4, 1, 100, 0, True, 60),
}
EXTRA_DIMS = ("causal_129", "zigzag_partial", "window_100_above_tile", "noncausal_37x200")


def _bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def _rng(*key) -> np.random.Generator:
    """Fresh inputs per case: a generator seeded from the case's identity."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _inputs(rng, b, sq, sk, hq, hkv, d):
    """q, k, v, dout as bf16 host arrays (standard normal, then rounded)."""
    bf = _bf16()
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d))
    return tuple(rng.standard_normal(shape).astype(bf) for shape in shapes)


def _f64(*arrays):
    import cupy

    return [np.asarray(cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a).astype(np.float64)
            for a in arrays]


def _dev(*arrays):
    import cupy

    return [cupy.asarray(a) for a in arrays]


@pytest.fixture
def poisoned(monkeypatch):
    """Every cupy.empty during the test comes back filled with 0xFF bytes (NaN in float32 and in
    bf16), so an element a kernel forgets to write fails the comparison."""
    import cupy

    real = cupy.empty

    def empty(shape, dtype=float, order="C"):
        a = real(shape, dtype, order)
        a.view(cupy.uint8).fill(0xFF)
        return a

    monkeypatch.setattr(cupy, "empty", empty)


def _rel(got, want) -> float:
    """||got - want|| / ||want|| (FLOOR * sqrt(n) where want is zero to rounding); got must be
    finite everywhere (a NaN means an element was never written)."""
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} elements not finite"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), FLOOR * np.sqrt(want.size)))


def _check_fwd(out, lse, want_out, want_lse, name):
    out, lse = _f64(out, lse)
    dead = ~np.isfinite(want_lse)
    assert not np.isnan(lse).any(), f"{name}: lse has unwritten (NaN) entries"
    assert np.array_equal(np.isneginf(lse), dead), f"{name}: lse -inf exactly where no key is seen"
    lse_err = float(np.abs(lse[~dead] - want_lse[~dead]).max(initial=0.0))
    assert lse_err <= LSE_TOL, f"{name}: lse error {lse_err}"
    dead_rows = dead.transpose(0, 2, 1)  # [B, Sq, Hq]
    assert (out[dead_rows] == 0).all(), f"{name}: rows without keys must be exactly 0"
    err = _rel(out, want_out)
    assert err <= TOL, f"{name}: out relative error {err:.3e} > {TOL}"
    return err, lse_err


def _run_case(name, b, sq, sk, hq, hkv, qo, ko, causal, window, d):
    """Forward and backward of one case on the device against numpy_ref; returns the errors."""
    from mpipar.kernels import flash_mma

    q, k, v, do = _inputs(_rng(name, d), b, sq, sk, hq, hkv, d)
    q64, k64, v64, do64 = _f64(q, k, v, do)
    want_out, want_lse = ref.attention_fwd(q64, k64, v64, qo, ko, causal, window=window)
    out, lse = flash_mma.attention_fwd(*_dev(q, k, v), qo, ko, causal, window=window)
    err_out, err_lse = _check_fwd(out, lse, want_out, want_lse, name)
    out64, lse64 = _f64(out, lse)  # the backward takes the kernel's own (bf16) out and lse
    want = ref.attention_bwd(q64, k64, v64, out64, lse64, do64, qo, ko, causal, window=window)
    got = flash_mma.attention_bwd(*_dev(q, k, v), out, lse, *_dev(do), qo, ko, causal,
                                  window=window)
    errs = [_rel(*_f64(g), w) for g, w in zip(got, want)]
    print(f"\nERR {name} d={d}: out {err_out:.2e} lse {err_lse:.1e} dq {errs[0]:.2e} "
          f"dk {errs[1]:.2e} dv {errs[2]:.2e}")
    for label, e in zip(("dq", "dk", "dv"), errs):
        assert e <= TOL, f"{name}: {label} relative error {e:.3e} > {TOL}"
    if not np.isfinite(want_lse).any():  # nothing visible: every gradient exactly 0
        assert all((_f64(g)[0] == 0).all() for g in got), f"{name}: gradients must be exactly 0"


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("name", list(CASES))
def test_attention(poisoned, name, d):
    _run_case(name, *CASES[name], d)


@pytest.mark.parametrize("d", (32, 96))
@pytest.mark.parametrize("name", EXTRA_DIMS)
def test_attention_other_head_dims(poisoned, name, d):
    _run_case(name, *CASES[name], d)


@pytest.mark.parametrize("d", (64, 128))
def test_ring_merged_backward(poisoned, d):
    """Ring attention: two key blocks' forwards merged by lse, then each block's backward from the
    merged out and lse; the summed gradients equal the gradient over all keys."""
    from mpipar.kernels import flash_mma

    b, s, hq, hkv = 1, 160, 8, 2
    q, k, v, do = _inputs(_rng("ring", d), b, s, s, hq, hkv, d)
    half = 96
    parts = [(k[:, :half], v[:, :half], 0), (k[:, half:], v[:, half:], half)]
    outs = [flash_mma.attention_fwd(*_dev(q, kk.copy(), vv.copy()), 0, ko) for kk, vv, ko in parts]
    (oa, la), (ob, lb) = [_f64(o, l_) for o, l_ in outs]
    merged, lse = ref.attention_merge(oa, la, ob, lb)
    merged_bf = merged.astype(_bf16())
    q64, k64, v64, do64 = _f64(q, k, v, do)
    want = ref.attention_bwd(q64, k64, v64, merged_bf.astype(np.float64), lse, do64, 0, 0)
    lse32 = _dev(lse.astype(np.float32))[0]
    got = [flash_mma.attention_bwd(*_dev(q, kk.copy(), vv.copy(), merged_bf), lse32, *_dev(do),
                                   0, ko) for kk, vv, ko in parts]
    dq = sum(_f64(g[0])[0] for g in got)
    dk = np.concatenate([_f64(g[1])[0] for g in got], axis=1)
    dv = np.concatenate([_f64(g[2])[0] for g in got], axis=1)
    errs = [_rel(g, w) for g, w in zip((dq, dk, dv), want)]
    print(f"\nERR ring_merged d={d}: dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}")
    assert max(errs) <= TOL, errs


@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("kind", ("causal", "window"))
def test_masked_tiles_never_read(poisoned, kind, d):
    """Keys that no query of the block sees, in tiles of their own (128-key aligned), are NaN: a
    kernel that loaded them would turn its output NaN (0 * NaN in the MMA). Their dk, dv are 0."""
    from mpipar.kernels import flash_mma

    if kind == "causal":  # keys at or after 256 are after every query
        sq, sk, qo, window, nan_keys = 256, 512, 0, 0, slice(256, 512)
    else:  # queries at 1024.. see keys after 1024 - 256 only; keys 0..639 are outside
        sq, sk, qo, window, nan_keys = 256, 1024, 1024, 256, slice(0, 640)
    q, k, v, do = _inputs(_rng("nan", kind, d), 1, sq, sk, 4, 2, d)
    q64, k64, v64, do64 = _f64(q, k, v, do)
    want_out, want_lse = ref.attention_fwd(q64, k64, v64, qo, 0, True, window=window)
    k[:, nan_keys] = np.nan
    v[:, nan_keys] = np.nan
    out, lse = flash_mma.attention_fwd(*_dev(q, k, v), qo, 0, True, window=window)
    _check_fwd(out, lse, want_out, want_lse, kind)
    dq, dk, dv = flash_mma.attention_bwd(*_dev(q, k, v), out, lse, *_dev(do), qo, 0, True,
                                         window=window)
    want = ref.attention_bwd(q64, k64, v64, *_f64(out, lse), do64, qo, 0, True, window=window)
    assert _rel(*_f64(dq), want[0]) <= TOL
    assert (_f64(dk)[0][:, nan_keys] == 0).all() and (_f64(dv)[0][:, nan_keys] == 0).all()


@pytest.fixture(params=[pytest.param(True, id="aligned"), pytest.param(False, id="unaligned")])
def doc_tiles(request, monkeypatch):
    """flash_mma's document kernels with a block's first tile aligned (as timed) and not
    (`DOC_TILES_ALIGNED`; the module compiled for each)."""
    from mpipar.kernels import flash_mma

    monkeypatch.setattr(flash_mma, "DOC_TILES_ALIGNED", request.param)
    return request.param


@pytest.mark.parametrize("d", (64, 128, 32))
def test_packed_documents(poisoned, doc_tiles, d):
    """Document ids in the kernels (a query sees only its own document's keys): the layouts
    tests/unit/test_flash_hip_cpu.py runs (documents of ~7 to ~150 tokens, a ring hop, a window,
    keys after every query, not causal, two documents, none), against numpy_ref in float64 on
    the same bf16 inputs, every output written (poisoned); the tables given or found from the ids
    give the same bits. With the first tiles aligned and not."""
    import cupy

    from mpipar.kernels import flash_mma
    from tests.unit.test_flash_hip_cpu import _cases

    for name, b, sq, sk, hq, hkv, qo, ko, causal, window, q_docs, k_docs in _cases():
        q, k, v, do = _inputs(_rng("docs", name, d), b, sq, sk, hq, hkv, d)
        kw = {} if q_docs is None else {"q_docs": q_docs, "k_docs": k_docs}
        q64, k64, v64, do64 = _f64(q, k, v, do)
        want_out, want_lse = ref.attention_fwd(q64, k64, v64, qo, ko, bool(causal), None, window,
                                               **kw)
        out, lse = flash_mma.attention_fwd(*_dev(q, k, v), qo, ko, bool(causal), None, window,
                                           **kw)
        _check_fwd(out, lse, want_out, want_lse, name)
        want = ref.attention_bwd(q64, k64, v64, *_f64(out, lse), do64, qo, ko, bool(causal),
                                 None, window, **kw)
        got = flash_mma.attention_bwd(*_dev(q, k, v), out, lse, *_dev(do), qo, ko, bool(causal),
                                      None, window, **kw)
        for label, g, w in zip(("dq", "dk", "dv"), got, want):
            e = _rel(*_f64(g), w)
            assert e <= TOL, f"{name}: {label} relative error {e:.3e} > {TOL}"
        if kw:
            tables = flash_mma.document_tables(q_docs, k_docs)
            again = flash_mma.attention_fwd(*_dev(q, k, v), qo, ko, bool(causal), None, window,
                                            tables=tables)
            assert bool((again[0] == out).all()) and bool(cupy.array_equal(again[1], lse)), name


@pytest.mark.parametrize("d", (64, 128))
def test_other_documents_keys_never_read(poisoned, d):
    """Keys of a document no query of the block belongs to, in whole tiles before the queries'
    document, are NaN: the forward and dq never load them, and their dk, dv are exactly 0."""
    from mpipar.kernels import flash_mma

    sq, sk = 128, 384
    q, k, v, do = _inputs(_rng("other documents", d), 1, sq, sk, 4, 2, d)
    q_docs = np.full((1, sq), 1)
    k_docs = np.concatenate([np.zeros((1, 256), int), np.ones((1, 128), int)], axis=1)
    kw = {"q_docs": q_docs, "k_docs": k_docs}
    q64, k64, v64, do64 = _f64(q, k, v, do)
    want_out, want_lse = ref.attention_fwd(q64, k64, v64, 256, 0, True, **kw)
    k[:, :256] = np.nan
    v[:, :256] = np.nan
    out, lse = flash_mma.attention_fwd(*_dev(q, k, v), 256, 0, True, **kw)
    _check_fwd(out, lse, want_out, want_lse, "other documents")
    dq, dk, dv = flash_mma.attention_bwd(*_dev(q, k, v), out, lse, *_dev(do), 256, 0, True, **kw)
    want = ref.attention_bwd(q64, k64, v64, *_f64(out, lse), do64, 256, 0, True, **kw)
    assert _rel(*_f64(dq), want[0]) <= TOL
    assert (_f64(dk)[0][:, :256] == 0).all() and (_f64(dv)[0][:, :256] == 0).all()
    assert _rel(_f64(dk)[0][:, 256:], want[1][:, 256:]) <= TOL


@pytest.mark.parametrize("d", (64, 128))
def test_unaligned_first_tiles_start_at_the_document(poisoned, monkeypatch, d):
    """With `DOC_TILES_ALIGNED` off, a block's first key tile starts at its queries' document
    (here key 200, mid-tile): keys before it are NaN and never loaded, so out, lse and dq are
    finite and right, and dk, dv of the document's keys too. Aligned, the tile from key 192 loads
    eight NaN rows (masked scores, but 0 x NaN in P V): the output is not finite, so this
    test fails where the unaligned start does not reach the kernels."""
    from mpipar.kernels import flash_mma

    sq, sk, start = 128, 384, 200
    q, k, v, do = _inputs(_rng("unaligned documents", d), 1, sq, sk, 4, 2, d)
    q_docs = np.full((1, sq), 1)
    k_docs = (np.arange(sk) >= start).astype(int)[None]
    kw = {"q_docs": q_docs, "k_docs": k_docs}
    q64, k64, v64, do64 = _f64(q, k, v, do)
    want_out, want_lse = ref.attention_fwd(q64, k64, v64, 256, 0, True, **kw)
    k[:, :start] = np.nan
    v[:, :start] = np.nan
    monkeypatch.setattr(flash_mma, "DOC_TILES_ALIGNED", True)
    out, _ = flash_mma.attention_fwd(*_dev(q, k, v), 256, 0, True, **kw)
    assert not np.isfinite(_f64(out)[0]).all()
    monkeypatch.setattr(flash_mma, "DOC_TILES_ALIGNED", False)
    out, lse = flash_mma.attention_fwd(*_dev(q, k, v), 256, 0, True, **kw)
    _check_fwd(out, lse, want_out, want_lse, "unaligned documents")
    dq, dk, dv = flash_mma.attention_bwd(*_dev(q, k, v), out, lse, *_dev(do), 256, 0, True, **kw)
    want = ref.attention_bwd(q64, k64, v64, *_f64(out, lse), do64, 256, 0, True, **kw)
    assert _rel(*_f64(dq), want[0]) <= TOL
    assert _rel(_f64(dk)[0][:, start:], want[1][:, start:]) <= TOL
    assert _rel(_f64(dv)[0][:, start:], want[2][:, start:]) <= TOL


def test_backward_is_deterministic():
    """No atomics: two backward runs give bit-identical gradients."""
    from mpipar.kernels import flash_mma

    q, k, v, do = _dev(*_inputs(_rng("det"), 2, 300, 300, 8, 2, 128))
    out, lse = flash_mma.attention_fwd(q, k, v)
    first = [g.copy() for g in flash_mma.attention_bwd(q, k, v, out, lse, do)]
    second = flash_mma.attention_bwd(q, k, v, out, lse, do)
    assert all(bool((a == b).all()) for a, b in zip(first, second))


@pytest.mark.parametrize("d", (64, 128, 32, 96))
def test_bf16_gradients_are_the_float32_gradients_rounded(poisoned, d):
    """``grad_dtype`` bf16 (the seam's request for a gradient it keeps as it is): dq, dk, dv
    written by the kernels in bf16 are, bit for bit, the float32 kernels' gradients rounded to
    nearest even (what the seam's cast made of them), every element written (poisoned), on
    plain, grouped-query, windowed, ring-offset and packed-document calls."""
    import cupy

    from mpipar.kernels import flash_mma
    from tests.unit.test_flash_hip_cpu import _cases

    plain = [(n, *CASES[n], None, None) for n in ("causal_129", "ring_diagonal_block",
                                                   "window_zigzag", "noncausal_200x37")]
    documents = [c for c in _cases()
                 if c[0] in ("documents ~7", "documents, window 37", "documents, ring hop")]
    assert len(documents) == 3
    for name, b, sq, sk, hq, hkv, qo, ko, causal, window, q_docs, k_docs in plain + documents:
        q, k, v, do = _dev(*_inputs(_rng("grad_dtype", name, d), b, sq, sk, hq, hkv, d))
        kw = {} if q_docs is None else {"q_docs": q_docs, "k_docs": k_docs}
        out, lse = flash_mma.attention_fwd(q, k, v, qo, ko, bool(causal), None, window, **kw)
        wide = flash_mma.attention_bwd(q, k, v, out, lse, do, qo, ko, bool(causal), None,
                                       window, **kw)
        narrow = flash_mma.attention_bwd(q, k, v, out, lse, do, qo, ko, bool(causal), None,
                                         window, grad_dtype=np.dtype(_bf16()), **kw)
        for label, w, n in zip(("dq", "dk", "dv"), wide, narrow):
            assert w.dtype == cupy.float32 and n.dtype == np.dtype(_bf16()), (name, label)
            assert bool(cupy.array_equal(n.view(cupy.uint16),
                                         w.astype(_bf16()).view(cupy.uint16))), (name, label)


def test_refusals():
    """Non-contiguous views, other dtypes and head dims are refused with a reason."""
    import cupy

    from mpipar.kernels import flash_mma

    q, k, v, _ = _dev(*_inputs(_rng("refuse"), 1, 16, 16, 2, 2, 64))
    with pytest.raises(ValueError, match="C-contiguous"):
        flash_mma.attention_fwd(q[:, ::2], k[:, ::2], v[:, ::2])
    with pytest.raises(ValueError, match="bfloat16"):
        flash_mma.attention_fwd(*(a.astype(cupy.float32) for a in (q, k, v)))
    assert flash_mma.supports(_bf16(), 128) is None
    assert "head_dim" in flash_mma.supports(_bf16(), 80)
    assert "bfloat16" in flash_mma.supports(np.float32, 64)
    assert "8.0" in flash_mma.supports(_bf16(), 64, compute_capability=75)
