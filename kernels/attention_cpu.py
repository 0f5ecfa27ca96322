"""Blockwise (flash-style) attention for the CPU: every inner product is a BLAS call on a tile.

Same contract as `numpy_ref.attention_fwd` / `attention_bwd` (grouped-query heads, causal
visibility with the global offsets of ring and zigzag blocks, the log-sum-exp that merges
blocks), float32 and float64. Outputs are new C-contiguous arrays: out and dq `[B, Sq, Hq, D]`,
dk and dv `[B, Sk, Hkv, D]`.

Tiles. A tile is `positions x keys` of one query head; the G = Hq / Hkv query heads that share a
kv head are done one after the other on the same key tile while it is in cache. Products read
q, dout and write dq in place (a head's rows are strided views: leading dimension Hq * D) and
fold the softmax scale into alpha, so nothing is packed. Tiles are sized so that each product
(positions * keys * D multiply-adds) stays under OpenBLAS's small-matrix limit (about 1e6): it
then runs without packing its operands and, with the tile in the L1/L2 caches, about as fast as
a large GEMM (see `python -m mpipar.bench kernels`). K and V are transposed once per call so
that the score products Q K^T and dO V^T are plain (NN) products.

Causality. Key blocks past the last visible key are never computed; a tile that crosses the
diagonal is cut into row segments of SEGMENT positions, each multiplied only with the keys it
can see, so that at most SEGMENT / 2 keys per row are computed in vain.

Forward softmax. Each row keeps a reference value m (one of its own scores, taken in its first
visible tile) and accumulates l = sum exp(s - m) and acc = sum exp(s - m) v. There is no
per-tile maximum pass: a tile whose row sum exceeds SUM_LIMIT (a score far above m) is redone
for that row with its exact maximum, rescaling l and acc. Since m is a score of the row and
exp(s - m) stays below SUM_LIMIT, nothing overflows and no weight underflows that exact online
softmax would keep. out = acc / l, lse = m + log l.

Backward (flash-attention 2): one task per kv head of one sequence walks the key blocks; for
each tile P = exp(s - lse), dP = dO V^T, dS = P (dP - delta) with delta = rowsum(dO * out),
then dV += P^T dO, dK += scale dS^T Q and dQ += scale dS K (five products per tile).

Threads: tasks run in parallel (Numba prange); the tile products are too small for OpenBLAS to
thread, so each task's products run on its own thread.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import numpy_ref as ref
from .numba_simd import REORDER, vexp
from .numba_gemm import gemm
from .numpy_ref import Array, require

POSITIONS = 64  # query positions per tile
SMALL_GEMM = 1 << 19  # positions * keys * head_dim of one tile product: under OpenBLAS's small-matrix limit
SEGMENT = 32  # query positions per row segment on the causal diagonal
SUM_LIMIT = 1e12  # a tile row sum above this redoes the row with its exact maximum


def tile_sizes(head_dim: int) -> tuple[int, int]:
    """(query positions, keys) per tile for `head_dim`: keys a multiple of 16 in [16, 512]."""
    keys = SMALL_GEMM // (POSITIONS * head_dim) // 16 * 16
    return POSITIONS, min(512, max(16, keys))


# ----------------------------------------------------------------------------------------------
# Tile helpers (compiled)
# ----------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _visible(causal, q_offset, k_offset, pos, j0, nk):  # pragma: no cover (njit)
    """How many of the keys [j0, j0 + nk) the query at local position `pos` sees."""
    if not causal:
        return nk
    return max(0, min(nk, q_offset + pos - k_offset - j0 + 1))


@njit(cache=True, nogil=True)
def _even_step(n, most):  # pragma: no cover (njit)
    """Block size <= most (a multiple of 16) that cuts n into ceil(n / most) nearly equal blocks
    (rounded up to a multiple of 16), instead of full blocks and a short last one."""
    if n <= most:
        return most
    blocks = (n + most - 1) // most
    return min(most, ((n + blocks - 1) // blocks + 15) // 16 * 16)


@njit(cache=True, nogil=True)
def _segments(causal, q_offset, k_offset, i0, nq, j0, nk, seg):  # pragma: no cover (njit)
    """Cut the tile (queries [i0, i0 + nq), keys [j0, j0 + nk)) into row segments: seg[s] =
    (first position, end position, keys) for the positions that see any key; segments that see all
    nk keys are merged. Returns the number of segments."""
    n = 0
    for t0 in range(0, nq, SEGMENT):
        t1 = min(nq, t0 + SEGMENT)
        width = _visible(causal, q_offset, k_offset, i0 + t1 - 1, j0, nk)
        if width == 0:
            continue
        if n > 0 and width == nk and seg[n - 1, 2] == nk:
            seg[n - 1, 1] = t1
        else:
            seg[n, 0], seg[n, 1], seg[n, 2] = t0, t1, width
            n += 1
    return n


@njit(cache=True, nogil=True, fastmath=REORDER)
def _exp_row(p, n, shift, width):  # pragma: no cover (njit)
    """p[:n] = exp(p[:n] - shift) in place, p[n:width] = 0; returns the sum (p's dtype)."""
    total = p.dtype.type(0)
    sh = p.dtype.type(shift)
    for j in range(n):
        e = vexp(p[j] - sh)
        p[j] = e
        total += e
    for j in range(n, width):
        p[j] = 0
    return total


@njit(cache=True, nogil=True)
def _row_max(p, n):  # pragma: no cover (njit)
    mx = p[0]
    for j in range(1, n):
        mx = max(mx, p[j])
    return mx


@njit(cache=True, nogil=True, parallel=True)
def _heads_major(x):  # pragma: no cover (njit)
    """x `[B, S, H, D]` -> `[B, H, D, S]` (C-contiguous), copied in 16 x 16 blocks."""
    nb, s, nh, d = x.shape
    y = np.empty((nb, nh, d, s), x.dtype)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        for s0 in range(0, s, 16):
            for c0 in range(0, d, 16):
                for c in range(c0, min(d, c0 + 16)):
                    for t in range(s0, min(s, s0 + 16)):
                        y[b, h, c, t] = x[b, t, h, c]
    return y


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=REORDER)
def _fwd_rows(p, t0, t1, i0, j0, width, causal, q_offset, k_offset, m, has_m, l, acc, qh, kta, sk,
              scale):  # pragma: no cover (njit)
    """Softmax weights of tile rows [t0, t1) of one head, in place in p (scores in, weights out);
    updates that head's m, l, acc `[positions(, D)]`. qh: the head's query rows `[positions, D]`,
    kta: address of the key tile's K^T (to redo a row)."""
    single = p.itemsize == 4
    d = acc.shape[1]
    for t in range(t0, t1):
        vis = _visible(causal, q_offset, k_offset, i0 + t, j0, width)
        if vis == 0:
            for j in range(width):
                p[t, j] = 0
            continue
        if not has_m[t]:
            m[t] = _row_max(p[t], min(vis, 8))
            has_m[t] = True
        total = _exp_row(p[t], vis, m[t], width)
        if not total <= SUM_LIMIT:  # a score far above m: redo the row with its exact maximum
            gemm(False, False, 1, width, d, scale, qh[t:].ctypes.data, qh.strides[0] // qh.itemsize, kta, sk,
                 0.0, p[t].ctypes.data, width, single)
            mx = _row_max(p[t], vis)
            corr = math.exp(m[t] - mx)
            l[t] *= corr
            for c in range(d):
                acc[t, c] *= corr
            m[t] = mx
            total = _exp_row(p[t], vis, mx, width)
        l[t] += total


@njit(cache=True, nogil=True)
def _fwd_task(q, kt, v, b, kh, i0, nq, q_offset, k_offset, causal, scale, bk, out, lse):  # pragma: no cover
    """Queries [i0, i0 + nq) of the query heads of kv head kh in sequence b, over all keys."""
    hq, d = q.shape[2], q.shape[3]
    hkv, sk = kt.shape[1], kt.shape[3]
    group = hq // hkv
    single = q.itemsize == 4
    acc = np.zeros((group, nq, d), q.dtype)
    m = np.zeros((group, nq))
    has_m = np.zeros((group, nq), np.bool_)
    l = np.zeros((group, nq))
    p = np.empty((nq, bk), q.dtype)
    seg = np.empty((nq // SEGMENT + 2, 3), np.int64)
    kend = max(0, min(sk, q_offset + i0 + nq - k_offset)) if causal else sk
    step = _even_step(kend, bk)
    for j0 in range(0, kend, step):
        nk = min(step, kend - j0)
        kta = kt[b, kh, :, j0:].ctypes.data
        for g in range(group):
            qh = q[b, i0:, kh * group + g]
            for s in range(_segments(causal, q_offset, k_offset, i0, nq, j0, nk, seg)):
                t0, t1, width = seg[s, 0], seg[s, 1], seg[s, 2]
                gemm(False, False, t1 - t0, width, d, scale, qh[t0:].ctypes.data, hq * d, kta, sk, 0.0,
                     p[t0:].ctypes.data, bk, single)
                _fwd_rows(p, t0, t1, i0, j0, width, causal, q_offset, k_offset, m[g], has_m[g], l[g], acc[g],
                          qh, kta, sk, scale)
                gemm(False, False, t1 - t0, d, width, 1.0, p[t0:].ctypes.data, bk, v[b, j0:, kh].ctypes.data,
                     hkv * d, 1.0, acc[g, t0:].ctypes.data, d, single)
    for t in range(nq):
        for g in range(group):
            h = kh * group + g
            if l[g, t] > 0:
                inv = 1.0 / l[g, t]
                for c in range(d):
                    out[b, i0 + t, h, c] = acc[g, t, c] * inv
                lse[b, h, i0 + t] = m[g, t] + math.log(l[g, t])
            else:
                for c in range(d):
                    out[b, i0 + t, h, c] = 0
                lse[b, h, i0 + t] = -np.inf


@njit(cache=True, nogil=True, parallel=True)
def _attention_fwd(q, kt, v, q_offset, k_offset, causal, scale, bq, bk, out, lse):  # pragma: no cover
    """One task per (sequence, kv head, query block); query blocks in zigzag order (0, n-1, 1, ...)
    so that the equal shares of tasks that threads get hold equal causal work."""
    nb, sq = q.shape[0], q.shape[1]
    hkv = kt.shape[1]
    nqb = (sq + bq - 1) // bq
    for task in prange(nb * hkv * nqb):
        idx = task % nqb
        qb = idx // 2 if idx % 2 == 0 else nqb - 1 - idx // 2
        i0 = qb * bq
        _fwd_task(q, kt, v, task // (hkv * nqb), (task // nqb) % hkv, i0, min(bq, sq - i0), q_offset,
                  k_offset, causal, scale, bk, out, lse)


def _inputs(q: Array, k: Array, v: Array, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.dtype]:
    """Validate; q, k, v as C-contiguous arrays of q's dtype (float32 or float64)."""
    require(isinstance(q, np.ndarray) and q.dtype in (np.float32, np.float64),
            f"{name}: expected a float32 or float64 numpy array, got {type(q).__name__} "
            f"of dtype {getattr(q, 'dtype', None)}")
    ref.check_attention_shapes(q, k, v, name)
    dt = q.dtype
    return np.ascontiguousarray(q), np.ascontiguousarray(k, dt), np.ascontiguousarray(v, dt), dt


def attention_fwd(q: Array, k: Array, v: Array, q_offset: int = 0, k_offset: int = 0,
                  causal: bool = True, scale: float | None = None) -> tuple[Array, Array]:
    """Blockwise attention; same contract as `numpy_ref.attention_fwd`.

    q `[B, Sq, Hq, D]`, k, v `[B, Sk, Hkv, D]` -> out `[B, Sq, Hq, D]` (C-contiguous), lse `[B, Hq, Sq]`.
    """
    q, k, v, dt = _inputs(q, k, v, "attention_fwd")
    b, sq, hq, d = q.shape
    out = np.empty(q.shape, dt)
    lse = np.empty((b, hq, sq), ref.stat_dtype(dt))
    bq, bk = tile_sizes(d)
    _attention_fwd(q, _heads_major(k), v, int(q_offset), int(k_offset), bool(causal),
                   dt.type(ref.attention_scale(d, scale)), bq, bk, out, lse)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=REORDER)
def _bwd_rows(p, dp, t0, t1, i0, j0, width, causal, q_offset, k_offset, lse_h, delta_h):  # pragma: no cover
    """Tile rows [t0, t1) of one head: p = exp(s - lse) in place of the scores s and
    dp = p * (dp - delta) in place of dP; both 0 past each row's visible keys."""
    for t in range(t0, t1):
        vis = _visible(causal, q_offset, k_offset, i0 + t, j0, width)
        if lse_h[i0 + t] == -np.inf:
            vis = 0
        sh = p.dtype.type(lse_h[i0 + t])
        dl = p.dtype.type(delta_h[i0 + t])
        for j in range(vis):
            e = vexp(p[t, j] - sh)
            p[t, j] = e
            dp[t, j] = e * (dp[t, j] - dl)
        for j in range(vis, width):
            p[t, j] = 0
            dp[t, j] = 0


@njit(cache=True, nogil=True)
def _bwd_task(q, k, kt, vt, lse, delta, dout, b, kh, q_offset, k_offset, causal, scale, bq, bk, dq, dk,
              dv):  # pragma: no cover (njit)
    """All gradients of kv head kh of sequence b: dk, dv rows of that head and dq (+=) of its query
    heads. delta `[B, Hq, Sq]` = rowsum(dout * out)."""
    sq, hq, d = q.shape[1], q.shape[2], q.shape[3]
    hkv, sk = kt.shape[1], kt.shape[3]
    group = hq // hkv
    single = q.itemsize == 4
    ldq = hq * d  # row stride of one head in q, dout, dq
    p = np.empty((bq, bk), q.dtype)
    dp = np.empty((bq, bk), q.dtype)
    dk_acc = np.empty((bk, d), q.dtype)
    dv_acc = np.empty((bk, d), q.dtype)
    seg = np.empty((bq // SEGMENT + 2, 3), np.int64)
    for j0 in range(0, sk, bk):
        nk = min(bk, sk - j0)
        first = max(0, k_offset + j0 - q_offset) if causal else 0  # first query that sees key j0
        if first >= sq:
            break
        dk_acc[:] = 0
        dv_acc[:] = 0
        kta, vta = kt[b, kh, :, j0:].ctypes.data, vt[b, kh, :, j0:].ctypes.data
        for i0 in range(first - first % bq, sq, bq):
            nq = min(bq, sq - i0)
            nseg = _segments(causal, q_offset, k_offset, i0, nq, j0, nk, seg)
            for g in range(group):
                h = kh * group + g
                for s in range(nseg):
                    t0, t1, w = seg[s, 0], seg[s, 1], seg[s, 2]
                    nr, pa, dpa = t1 - t0, p[t0:].ctypes.data, dp[t0:].ctypes.data
                    qa, doa = q[b, i0 + t0:, h].ctypes.data, dout[b, i0 + t0:, h].ctypes.data
                    gemm(False, False, nr, w, d, scale, qa, ldq, kta, sk, 0.0, pa, bk, single)
                    gemm(False, False, nr, w, d, 1.0, doa, ldq, vta, sk, 0.0, dpa, bk, single)
                    _bwd_rows(p, dp, t0, t1, i0, j0, w, causal, q_offset, k_offset, lse[b, h], delta[b, h])
                    gemm(True, False, w, d, nr, 1.0, pa, bk, doa, ldq, 1.0, dv_acc.ctypes.data, d, single)
                    gemm(True, False, w, d, nr, scale, dpa, bk, qa, ldq, 1.0, dk_acc.ctypes.data, d, single)
                    gemm(False, False, nr, d, w, scale, dpa, bk, k[b, j0:, kh].ctypes.data, hkv * d, 1.0,
                         dq[b, i0 + t0:, h].ctypes.data, ldq, single)
        for j in range(nk):
            for c in range(d):
                dk[b, j0 + j, kh, c] = dk_acc[j, c]
                dv[b, j0 + j, kh, c] = dv_acc[j, c]


@njit(cache=True, nogil=True, parallel=True)
def _attention_bwd(q, k, kt, vt, lse, delta, dout, q_offset, k_offset, causal, scale, bq, bk, dq, dk,
                   dv):  # pragma: no cover (njit)
    """One task per (sequence, kv head)."""
    hkv = k.shape[2]
    for task in prange(q.shape[0] * hkv):
        _bwd_task(q, k, kt, vt, lse, delta, dout, task // hkv, task % hkv, q_offset, k_offset, causal, scale,
                  bq, bk, dq, dk, dv)


@njit(cache=True, nogil=True, parallel=True)
def _row_dots(a, b):  # pragma: no cover (njit)
    """delta `[B, H, S]` = sum over D of a * b for a, b `[B, S, H, D]` (accumulated in float64)."""
    nb, s, nh, d = a.shape
    out = np.empty((nb, nh, s), a.dtype)
    for bs in prange(nb * s):
        bi, t = bs // s, bs % s
        for h in range(nh):
            acc = 0.0
            for c in range(d):
                acc += a[bi, t, h, c] * b[bi, t, h, c]
            out[bi, h, t] = acc
    return out


def attention_bwd(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                  q_offset: int = 0, k_offset: int = 0, causal: bool = True,
                  scale: float | None = None) -> tuple[Array, Array, Array]:
    """Blockwise flash-attention backward from the given (possibly merged) out and lse.

    Same contract as `numpy_ref.attention_bwd`: dq `[B, Sq, Hq, D]`, dk, dv `[B, Sk, Hkv, D]`
    (C-contiguous).
    """
    q, k, v, dt = _inputs(q, k, v, "attention_bwd")
    b, sq, hq, d = q.shape
    require(out.shape == q.shape and dout.shape == q.shape and lse.shape == (b, hq, sq),
            f"attention_bwd: out {out.shape}, dout {dout.shape} must be {q.shape} and lse {lse.shape} "
            f"must be {(b, hq, sq)}")
    dout = np.ascontiguousarray(dout, dt)
    dq = np.zeros(q.shape, dt)
    dk = np.zeros(k.shape, dt)  # key blocks that no query sees stay 0
    dv = np.zeros(k.shape, dt)
    bq, bk = tile_sizes(d)
    _attention_bwd(q, k, _heads_major(k), _heads_major(v), np.ascontiguousarray(lse, ref.stat_dtype(dt)),
                   _row_dots(dout, np.ascontiguousarray(out, dt)), dout, int(q_offset), int(k_offset),
                   bool(causal), dt.type(ref.attention_scale(d, scale)), bq, bk, dq, dk, dv)
    return dq, dk, dv
