"""Blockwise CPU attention (kernels/attention_cpu.py) against numpy_ref, and its building blocks:
the BLAS gemm callable from Numba and the vectorisable exp.

Shapes span several tiles (tile_sizes(64) = 64 positions x 128 keys), with lengths that are not
multiples of the tile and the causal diagonal crossing tiles at every offset. No MPI.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpipar.kernels import numpy_ref as ref

ac = pytest.importorskip("mpipar.kernels.attention_cpu")
from numba import njit  # noqa: E402  (after the importorskip: numba is there)

from mpipar.kernels.numba_simd import REORDER, address, row_at, vexp  # noqa: E402
from mpipar.kernels.numba_gemm import gemm  # noqa: E402

TOL = {np.float64: 1e-12, np.float32: 1e-5}


@njit
def gemm_call(ta, tb, m, n, k, a, lda, b, ldb, c, ldc, single):
    """gemm with alpha 0.5 and beta 2 on the arrays' first elements."""
    gemm(ta, tb, m, n, k, 0.5, a.ctypes.data, lda, b.ctypes.data, ldb, 2.0, c.ctypes.data, ldc, single)


@njit
def vexp_all(x, out):
    for i in range(x.size):
        out[i] = vexp(x[i])


@njit(fastmath=REORDER)
def vexp_all_reorder(x, out):
    """As the kernels call it: from a loop compiled with REORDER (whose flags a callee without
    its own would inherit)."""
    for i in range(x.size):
        out[i] = vexp(x[i])


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max|b| over the finite entries of b; the infinities of a and b must agree."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.array_equal(np.isinf(a), np.isinf(b)) and not np.isnan(a).any()
    fin = np.isfinite(b)
    scale = np.abs(b[fin]).max(initial=0.0)
    diff = np.abs(a[fin] - b[fin]).max(initial=0.0)
    return diff / scale if scale > 0 else diff


def inputs(rng, b, sq, sk, hq, hkv, d, dtype):
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    return q, k, v


def check_against_reference(rng, q, k, v, q_offset, k_offset, causal, dtype):
    """Forward (out, lse) and backward (dq, dk, dv) equal numpy_ref within TOL[dtype]."""
    out, lse = ac.attention_fwd(q, k, v, q_offset, k_offset, causal)
    r_out, r_lse = ref.attention_fwd(q, k, v, q_offset, k_offset, causal)
    assert out.dtype == dtype and lse.dtype == r_lse.dtype and out.flags.c_contiguous
    assert rel_err(out, r_out) < TOL[dtype] and rel_err(lse, r_lse) < TOL[dtype]
    dout = rng.standard_normal(q.shape).astype(dtype)
    grads = ac.attention_bwd(q, k, v, r_out, r_lse, dout, q_offset, k_offset, causal)
    r_grads = ref.attention_bwd(q, k, v, r_out, r_lse, dout, q_offset, k_offset, causal)
    for g, r in zip(grads, r_grads):
        assert g.dtype == dtype and g.flags.c_contiguous and g.shape == r.shape
        assert rel_err(g, r) < TOL[dtype]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("q_offset,k_offset,causal,sq,sk", [
    (0, 0, True, 203, 203),      # causal self-attention, 203 = 3 x 64 + 11 positions
    (300, 0, True, 150, 170),    # ring: the key block lies wholly before the query block
    (130, 130, True, 190, 190),  # ring: equal offsets (a rank's own block)
    (0, 0, False, 77, 260),      # non-causal, keys 2 x 128 + 4
    (40, 100, True, 150, 140),   # keys start after the first queries: rows without keys, partial tiles
])
def test_matches_reference(rng, dtype, group, q_offset, k_offset, causal, sq, sk):
    q, k, v = inputs(rng, 2 if group < 4 else 1, sq, sk, 2 * group, 2, 64, dtype)
    check_against_reference(rng, q, k, v, q_offset, k_offset, causal, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("d", [8, 128])
def test_head_dims(rng, dtype, d):
    """Other head dims give other tile widths (512 keys for d=8, 64 for d=128)."""
    q, k, v = inputs(rng, 1, 150, 150, 4, 2, d, dtype)
    check_against_reference(rng, q, k, v, 0, 0, True, dtype)


def test_zigzag_pairs_merge_to_the_whole_sequence(rng):
    """A sequence of 4 chunks as 2 zigzag ranks hold it (rank 0: chunks 0, 3; rank 1: 1, 2): every
    (query chunk, key chunk) pair the mask does not empty, merged by log-sum-exp, equals numpy_ref on
    the whole sequence; the blockwise backward with the merged out/lse sums to the whole gradient."""
    c, hq, hkv, d = 70, 4, 2, 64
    q, k, v = inputs(rng, 1, 4 * c, 4 * c, hq, hkv, d, np.float64)
    dout = rng.standard_normal(q.shape)
    r_out, r_lse = ref.attention_fwd(q, k, v)
    r_dq, r_dk, r_dv = ref.attention_bwd(q, k, v, r_out, r_lse, dout)
    chunk = [slice(i * c, (i + 1) * c) for i in range(4)]
    for rank_chunks in ([0, 3], [1, 2]):
        for qi in rank_chunks:
            pairs = [ki for ki in range(4) if ki <= qi]
            merged = None
            for ki in pairs:
                part = ac.attention_fwd(q[:, chunk[qi]], k[:, chunk[ki]], v[:, chunk[ki]], qi * c, ki * c)
                merged = part if merged is None else ref.attention_merge(*merged, *part)
            assert rel_err(merged[0], r_out[:, chunk[qi]]) < 1e-12
            assert rel_err(merged[1], r_lse[:, :, chunk[qi]]) < 1e-12
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for qi in range(4):
        for ki in range(qi + 1):
            g = ac.attention_bwd(q[:, chunk[qi]], k[:, chunk[ki]], v[:, chunk[ki]], r_out[:, chunk[qi]],
                                 r_lse[:, :, chunk[qi]], dout[:, chunk[qi]], qi * c, ki * c)
            dq[:, chunk[qi]] += g[0]
            dk[:, chunk[ki]] += g[1]
            dv[:, chunk[ki]] += g[2]
    assert rel_err(dq, r_dq) < 1e-12 and rel_err(dk, r_dk) < 1e-12 and rel_err(dv, r_dv) < 1e-12


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_score_far_above_the_first_ones(rng, dtype):
    """Key 200 scores ~60 above the first keys of every row: the tile sum passes SUM_LIMIT and the row
    is redone with its exact maximum (float32 would overflow exp(s - m) without it)."""
    q, k, v = inputs(rng, 1, 260, 260, 2, 1, 64, dtype)
    k[0, 200, 0] = q[0, 230, 0] * (480 / np.sum(q[0, 230, 0].astype(np.float64) ** 2))  # score 480 / 8 = 60
    check_against_reference(rng, q, k, v, 0, 0, True, dtype)
    out, lse = ac.attention_fwd(q, k, v)
    assert np.all(np.isfinite(out)) and lse[0, 0, 230] > 50


def test_non_contiguous_and_mixed_dtype_inputs(rng):
    """Strided q and float32 k, v with float64 q: cast to q's dtype like numpy_ref's arithmetic."""
    q, k, v = inputs(rng, 2, 90, 90, 4, 2, 16, np.float64)
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not qt.flags.c_contiguous
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    out, lse = ac.attention_fwd(qt, k32, v32)
    r_out, r_lse = ref.attention_fwd(q, k32.astype(np.float64), v32.astype(np.float64))
    assert rel_err(out, r_out) < 1e-12 and rel_err(lse, r_lse) < 1e-12


def test_bad_inputs_raise(rng):
    q, k, v = inputs(rng, 1, 5, 5, 3, 2, 4, np.float64)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ac.attention_fwd(q, k, v)
    with pytest.raises(ValueError, match="float32 or float64 numpy array"):
        ac.attention_fwd(q.astype(np.int64), k, v)
    q, k, v = inputs(rng, 1, 5, 5, 2, 2, 4, np.float64)
    with pytest.raises(ValueError, match="lse"):
        ac.attention_bwd(q, k, v, q, np.zeros((1, 2, 4)), q)


def test_tile_sizes_stay_under_the_small_gemm_limit():
    for d in (8, 16, 32, 64, 96, 128, 256):
        positions, keys = ac.tile_sizes(d)
        assert keys % 16 == 0 and 16 <= keys <= 512
        assert positions * keys * d <= ac.SMALL_GEMM or keys == 16


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_key_rows_padded_to_an_odd_count_of_cache_lines(rng, dtype):
    """The forward's K^T: rows of whole 64-byte lines, an odd count (never a multiple of 4 KiB,
    the stride that puts a key block's rows in one cache set), the fewest such that hold S keys,
    and the S first columns exactly K transposed."""
    size = np.dtype(dtype).itemsize
    for n in range(1, 9000):
        ld = ac._row_stride(n, size)
        assert ld >= n and ld * size % 128 == 64 and ld * size - 128 < n * size, (n, ld)
    x = rng.standard_normal((2, 1000, 3, 64)).astype(dtype)
    y = ac._heads_major(x, ac._row_stride(1000, size), np.ones((2, 1000), bool))
    assert y.shape == (2, 3, 64, ac._row_stride(1000, size))
    assert np.array_equal(y[..., :1000], x.transpose(0, 2, 3, 1))
    need = np.zeros((2, 1000), bool)  # only the keys asked for (and the rest of their 16-key group)
    need[0, 100:130], need[1, 990:] = True, True
    y = ac._heads_major(x, ac._row_stride(1000, size), need)
    assert np.array_equal(y[0, ..., 96:144], x[0, 96:144].transpose(1, 2, 0))
    assert np.array_equal(y[1, ..., 976:1000], x[1, 976:].transpose(1, 2, 0))


# ----------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_on_strided_views(rng, dtype, trans_a, trans_b):
    """C[2:9, 1:6] = 0.5 op(A) op(B) + 2 C on row-major views inside larger arrays; the rest of C
    is left alone."""
    m, n, k = 7, 5, 4
    a = rng.standard_normal((10, 12)).astype(dtype)
    b = rng.standard_normal((11, 9)).astype(dtype)
    c = rng.standard_normal((12, 8)).astype(dtype)
    av, bv = a[1:, 2:], b[3:, 1:]
    op_a = av[:k, :m].T if trans_a else av[:m, :k]
    op_b = bv[:n, :k].T if trans_b else bv[:k, :n]
    expect = c.astype(np.float64)
    expect[2:9, 1:6] = 0.5 * op_a.astype(np.float64) @ op_b + 2 * expect[2:9, 1:6]
    gemm_call(trans_a, trans_b, m, n, k, av, 12, bv, 9, c[2:, 1:], 8, dtype == np.float32)
    assert rel_err(c, expect) < TOL[dtype] / 10
    assert np.array_equal(c[:2], expect[:2].astype(dtype))
    assert np.array_equal(c[:, 6:], expect[:, 6:].astype(dtype))


@njit
def _probe_row(x, b, i, h, n):
    row = row_at(ac._at(x, b, i, h), n, x)
    total = row.sum()
    row[0] = -1.0
    return address(x), ac._at(x, b, i, h), total


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_addresses_and_rows_without_references(rng, dtype):
    """The kernels reach rows and tiles through addresses, not views (a view takes a reference):
    `address` is the first element's (as `.ctypes.data`), `_at(x, b, i, h)` that of x[b, i, h]
    in a `[B, S, H, D]` array, and `row_at` n elements there, read and written in the array
    itself (rows running on into the next heads included); `_at` by the strides, also of a view
    that skips positions."""
    x = rng.standard_normal((2, 5, 3, 4)).astype(dtype)
    for b, i, h in ((0, 0, 0), (1, 3, 2), (1, 4, 1), (0, 2, 1)):
        n = 4 * (3 - h)
        flat = x.reshape(-1)
        first = ((b * 5 + i) * 3 + h) * 4
        expect = flat[first:first + n].astype(np.float64).sum()
        base, at, total = _probe_row(x, b, i, h, n)
        assert base == x.ctypes.data and at == x[b, i, h].ctypes.data
        assert abs(total - expect) <= 1e-5 * np.abs(flat[first:first + n]).sum()
        assert flat[first] == -1.0
    every_other = x[:, ::2]
    for b, i, h in ((0, 0, 0), (1, 2, 2), (1, 1, 1)):
        assert _probe_row(every_other, b, i, h, 4)[1] == every_other[b, i, h].ctypes.data


@pytest.mark.parametrize("caller", [vexp_all_reorder, vexp_all], ids=["reorder", "plain"])
@pytest.mark.parametrize("dtype,bound", [(np.float64, 4e-16), (np.float32, 2e-7)])
def test_vexp_accuracy_and_clamps(dtype, bound, caller):
    """The bound holds whichever caller compiles the exp first (a REORDER kernel did, in a fresh
    process, and its reassociation cost the float64 exp two digits)."""
    lo, hi = (-708.0, 709.0) if dtype == np.float64 else (-87.0, 88.0)
    x = np.concatenate([np.linspace(lo, hi, 100001), [0.0, -1e-30, 1e-30, np.log(2.0)]]).astype(dtype)
    out = np.empty_like(x)
    caller(x, out)
    assert np.max(np.abs(out / np.exp(x.astype(np.float64)) - 1)) < bound
    edges = np.array([lo - 50, -np.inf, hi + 50], dtype)  # clamped to lo, lo, hi
    caller(edges, out[:3])
    assert np.max(np.abs(out[:3] / np.exp([lo, lo, hi]) - 1)) < bound


def test_outputs_feed_the_projections_without_a_copy(rng):
    """out is C-contiguous, so the block's o_proj reads out.reshape(B, S, Hq * D) as a view of it;
    dq, dk, dv likewise for the q/k/v weight gradients."""
    q, k, v = inputs(rng, 2, 70, 70, 4, 2, 16, np.float32)
    out, lse = ac.attention_fwd(q, k, v)
    assert out.flags.c_contiguous and np.shares_memory(out.reshape(2, 70, -1), out)
    grads = ac.attention_bwd(q, k, v, out, lse, np.ones_like(out))
    assert all(g.flags.c_contiguous for g in grads)


# Sliding windows against numpy_ref. tile_sizes(64) = 64 positions x 128 keys: windows smaller
# than, equal to and larger than a tile's positions and keys, with the offsets of ring blocks
# (keys several windows back, partly and wholly outside the window) and zigzag chunks.
WINDOW_CASES = [  # (sq, sk, q_offset, k_offset, window)
    (200, 200, 0, 0, 1), (200, 200, 0, 0, 5), (200, 200, 0, 0, 64), (200, 200, 0, 0, 128),
    (300, 300, 0, 0, 200), (150, 150, 0, 0, 1000),
    (100, 100, 100, 0, 30), (100, 100, 100, 0, 101), (64, 64, 128, 0, 64),  # ring: earlier block
    (97, 150, 150, 0, 33), (70, 130, 200, 60, 64),  # ragged lengths, offsets off the tile
    (40, 40, 600, 0, 100),  # a block wholly outside the window: nothing computed, no key seen
]


@pytest.mark.parametrize("sq,sk,q_offset,k_offset,window", WINDOW_CASES)
def test_window_matches_reference(rng, sq, sk, q_offset, k_offset, window):
    q, k, v = inputs(rng, 2, sq, sk, 4, 2, 64, np.float64)
    out, lse = ac.attention_fwd(q, k, v, q_offset, k_offset, True, window=window)
    r_out, r_lse = ref.attention_fwd(q, k, v, q_offset, k_offset, True, window=window)
    assert rel_err(out, r_out) < 1e-12 and rel_err(lse, r_lse) < 1e-12
    dout = rng.standard_normal(q.shape)
    grads = ac.attention_bwd(q, k, v, r_out, r_lse, dout, q_offset, k_offset, True, window=window)
    r_grads = ref.attention_bwd(q, k, v, r_out, r_lse, dout, q_offset, k_offset, True,
                                window=window)
    for g, r in zip(grads, r_grads):  # window 1: dq = dk = 0 up to round-off, hence the floor
        assert np.abs(g - r).max() < 1e-12 * max(np.abs(r).max(), 1.0)


def test_window_zigzag_chunks_merge_to_full(rng):
    """A zigzag rank's two chunks against every chunk, windowed, merged: equal to numpy_ref over
    the whole sequence (forward and backward, float64 1e-12)."""
    S, c, W = 320, 40, 70
    q, k, v = inputs(rng, 1, S, S, 4, 2, 32, np.float64)
    dout = rng.standard_normal(q.shape)
    r_out, r_lse = ref.attention_fwd(q, k, v, window=W)
    r_dq, r_dk, r_dv = ref.attention_bwd(q, k, v, r_out, r_lse, dout, window=W)
    chunk = [slice(i * c, (i + 1) * c) for i in range(S // c)]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for qi in (1, S // c - 2):  # rank 1 of sp = 4 holds chunks 1 and 6
        out = np.zeros_like(q[:, chunk[qi]])
        lse = np.full((1, 4, c), -np.inf)
        for ki in range(S // c):
            part = ac.attention_fwd(q[:, chunk[qi]], k[:, chunk[ki]], v[:, chunk[ki]], qi * c, ki * c,
                                    window=W)
            out, lse = ref.attention_merge(out, lse, *part)
            g = ac.attention_bwd(q[:, chunk[qi]], k[:, chunk[ki]], v[:, chunk[ki]], r_out[:, chunk[qi]],
                                 r_lse[:, :, chunk[qi]], dout[:, chunk[qi]], qi * c, ki * c, window=W)
            dq[:, chunk[qi]] += g[0]
            dk[:, chunk[ki]] += g[1]
            dv[:, chunk[ki]] += g[2]
        assert rel_err(out, r_out[:, chunk[qi]]) < 1e-12
        assert rel_err(lse, r_lse[:, :, chunk[qi]]) < 1e-12
    rows = np.r_[chunk[1], chunk[S // c - 2]]
    assert rel_err(dq[:, rows], r_dq[:, rows]) < 1e-12
    # dK/dV from these queries only: numpy_ref with only rank 1's query rows
    ref_dk = np.zeros_like(k)
    ref_dv = np.zeros_like(v)
    for qi in (1, S // c - 2):
        g = ref.attention_bwd(q[:, chunk[qi]], k, v, r_out[:, chunk[qi]], r_lse[:, :, chunk[qi]],
                              dout[:, chunk[qi]], qi * c, 0, window=W)
        ref_dk += g[1]
        ref_dv += g[2]
    assert rel_err(dk, ref_dk) < 1e-12 and rel_err(dv, ref_dv) < 1e-12


def test_window_skips_tiles():
    """Key tiles wholly outside the window are not computed: the score entries computed for a
    window of 64 over 2048 positions are under 10% of the causal ones and at least the visible
    entries (tile_work counts the kernel's own loops)."""
    causal = ac.tile_work(2048, 2048, 64)
    tiles, entries = ac.tile_work(2048, 2048, 64, window=64)
    visible = 64 * 65 // 2 + (2048 - 64) * 64
    assert tiles < causal[0] and visible <= entries < 0.1 * causal[1]
    assert ac.tile_work(40, 40, 64, 600, 0, True, 100) == (0, 0)  # wholly outside the window
