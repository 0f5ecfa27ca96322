"""CPU kernels compiled with Numba: fused, multi-threaded loops over rows, tokens or heads.

Every public function has the signature and semantics of the function of the same name in
`numpy_ref` (see there for the maths); inputs are float32 or float64 NumPy arrays, other arrays
are cast to the dtype of the first one, outputs are new arrays.

What is here and why:
  * attention fwd/bwd: blocked, online softmax (flash-attention style); a `[block_q, block_k]`
    tile of scores is the largest temporary, fully masked key blocks are skipped under causality;
  * rmsnorm, rope, swiglu, attention_merge, cross-entropy: one fused pass per row instead of the
    several full-size temporaries of the NumPy expressions;
  * linear fwd/bwd: a row-panel matmul written in Numba (vectorised, threaded). OpenBLAS is about
    5x faster (see `python -m mpipar.bench kernels`), so the dispatcher routes linear_fwd/linear_bwd of the
    numba backend to NumPy; these two stay here for that comparison;
  * linear_swiglu_fwd: two BLAS matmuls (np.dot inside njit, through SciPy's BLAS) with the SwiGLU
    epilogue fused into one pass.

Threads: parallel loops use Numba's thread pool (`NUMBA_NUM_THREADS`, default: all cores); set it
(and `OPENBLAS_NUM_THREADS`) to cores / ranks-per-node under MPI. Importing this module sets
`OMP_WAIT_POLICY=PASSIVE` unless it is already set: with Numba's OpenMP threading layer, idle
workers otherwise spin after each parallel loop and starve the BLAS threads of the matmuls that
run between kernels (measured: a 1.1 ms matmul took 9-36 ms right after a Numba kernel).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read by libgomp when Numba first loads it

import numba  # noqa: E402  (after the OpenMP setting above)
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from . import numpy_ref as ref  # noqa: E402
from .numpy_ref import Array, require  # noqa: E402

# Ops implemented in this module (the dispatcher falls back to numpy_ref for the others).
IMPLEMENTED: tuple[str, ...] = (
    "linear_fwd", "linear_bwd", "linear_swiglu_fwd", "rmsnorm_fwd", "rmsnorm_bwd", "rope_fwd",
    "rope_bwd", "swiglu_fwd", "swiglu_bwd", "attention_fwd", "attention_bwd", "attention_merge",
    "cross_entropy_stats", "cross_entropy_fwd", "cross_entropy_bwd",
)
# Ops where NumPy is faster than the implementation above (measured by `python -m mpipar.bench
# kernels`): the numba backend uses numpy_ref for these, with this reason. The cross-entropy
# statistics are one exp per logit and little else; without Intel SVML, Numba's exp is a scalar
# libm call while NumPy's is SIMD, which outweighs the fused pass (0.8-0.95x measured on AVX-512).
SLOWER_THAN_NUMPY: dict[str, str] = {
    "linear_fwd": "numpy BLAS",
    "linear_bwd": "numpy BLAS",
}
if not numba.config.USING_SVML:
    SLOWER_THAN_NUMPY.update({"cross_entropy_stats": "numpy SIMD exp", "cross_entropy_fwd": "numpy SIMD exp"})

BLOCK_Q = 64  # query rows per attention tile
BLOCK_K = 64  # key rows per attention tile
TILE_M, TILE_N = 16, 256  # matmul tiles: rows of A per task, columns of B per panel

_NEG_INF = -np.inf


def _float_dtype(x: Array, name: str) -> np.dtype:
    require(isinstance(x, np.ndarray) and x.dtype in (np.float32, np.float64),
            f"{name}: expected a float32 or float64 numpy array, got {type(x).__name__} "
            f"of dtype {getattr(x, 'dtype', None)}")
    return x.dtype


def _c(a: Array, dtype: np.dtype) -> np.ndarray:
    """C-contiguous copy (or view) of `a` in `dtype`."""
    return np.ascontiguousarray(a, dtype=dtype)


def _chunks(n: int) -> int:
    """Number of row chunks for reductions across rows: a few per thread, at most n."""
    return max(1, min(n, 4 * numba.get_num_threads()))


# ----------------------------------------------------------------------------------------------
# Matmul (tiled) and linear
# ----------------------------------------------------------------------------------------------

@njit(cache=True, parallel=True, nogil=True)
def _matmul(a, b, tm, tn):
    """C = A @ B for C-contiguous A `[M, K]`, B `[K, N]`: row blocks of tm in parallel; each row of C is
    accumulated over all of K in a local strip of tn columns, reading B one cache-resident panel at a time."""
    m, kdim = a.shape
    n = b.shape[1]
    c = np.empty((m, n), a.dtype)
    for rt in prange((m + tm - 1) // tm):
        acc = np.empty(tn, a.dtype)
        for j0 in range(0, n, tn):
            width = min(tn, n - j0)
            for i in range(rt * tm, min(rt * tm + tm, m)):
                for j in range(width):
                    acc[j] = 0
                for kk in range(kdim):
                    aik = a[i, kk]
                    brow = b[kk, j0:j0 + width]
                    for j in range(width):
                        acc[j] += aik * brow[j]
                for j in range(width):
                    c[i, j0 + j] = acc[j]
    return c


def linear_fwd(x: Array, w: Array, b: Array | None = None) -> Array:
    """y `[..., out]` = x `[..., in]` @ w.T (w `[out, in]`) + b (`[out]` or None), tiled Numba
    matmul."""
    dt = _float_dtype(x, "linear_fwd")
    require(w.ndim == 2 and x.shape[-1] == w.shape[1],
            f"linear_fwd: x.shape[-1]={x.shape[-1]} must equal w.shape[1] of w {w.shape}")
    ref.check_bias(b, w, "linear_fwd")
    y = _matmul(_c(x, dt).reshape(-1, x.shape[-1]), _c(w.T, dt), TILE_M, TILE_N)
    if b is not None:
        y += _c(b, dt)
    return y.reshape(x.shape[:-1] + (w.shape[0],))


def linear_bwd(dy: Array, x: Array, w: Array) -> tuple[Array, Array]:
    """dx `[..., in]` = dy @ w, dw `[out, in]` = dy^T x summed over leading dims (tiled Numba matmul)."""
    dt = _float_dtype(x, "linear_bwd")
    require(dy.shape[:-1] == x.shape[:-1] and w.ndim == 2 and dy.shape[-1] == w.shape[0]
            and x.shape[-1] == w.shape[1],
            f"linear_bwd: shapes dy {dy.shape}, x {x.shape}, w {w.shape} must be [..., out], [..., in], [out, in]")
    dy2 = _c(dy, dt).reshape(-1, w.shape[0])
    x2 = _c(x, dt).reshape(-1, w.shape[1])
    dx = _matmul(dy2, _c(w, dt), TILE_M, TILE_N)
    dw = _matmul(_c(dy2.T, dt), x2, TILE_M, TILE_N)
    return dx.reshape(x.shape), dw


@njit(cache=True, parallel=True, nogil=True)
def _linear_swiglu(x, w_gate, w_up, one):
    gate = np.dot(x, w_gate.T)
    up = np.dot(x, w_up.T)
    h = np.empty_like(gate)
    n, f = gate.shape
    for i in prange(n):
        for j in range(f):
            g = gate[i, j]
            e = np.exp(-abs(g))
            sig = one / (one + e) if g >= 0 else e / (one + e)
            h[i, j] = g * sig * up[i, j]
    return h, gate, up


def linear_swiglu_fwd(x: Array, w_gate: Array, w_up: Array) -> tuple[Array, Array, Array]:
    """(h, gate, up) with gate = x @ w_gate.T, up = x @ w_up.T, h = silu(gate) * up; BLAS + fused epilogue.

    x: `[..., in]`, w_gate, w_up: `[ffn, in]` -> h, gate, up: `[..., ffn]`.
    """
    dt = _float_dtype(x, "linear_swiglu_fwd")
    require(w_gate.ndim == 2 and w_gate.shape == w_up.shape and x.shape[-1] == w_gate.shape[1],
            f"linear_swiglu_fwd: w_gate {w_gate.shape} and w_up {w_up.shape} must both be [ffn, in] "
            f"with in = x.shape[-1] = {x.shape[-1]}")
    h, gate, up = _linear_swiglu(_c(x, dt).reshape(-1, x.shape[-1]), _c(w_gate, dt), _c(w_up, dt), dt.type(1))
    shape = x.shape[:-1] + (w_gate.shape[0],)
    return h.reshape(shape), gate.reshape(shape), up.reshape(shape)


# ----------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------

@njit(cache=True, parallel=True, nogil=True)
def _rmsnorm_fwd(x, w, eps, y, rstd):
    n, h = x.shape
    for i in prange(n):
        acc = 0.0
        for j in range(h):
            xi = np.float64(x[i, j])
            acc += xi * xi
        rstd[i] = 1.0 / math.sqrt(acc / h + eps)
        r = rstd[i]
        for j in range(h):
            y[i, j] = x[i, j] * r * w[j]


def rmsnorm_fwd(x: Array, w: Array, eps: float) -> tuple[Array, Array]:
    """y `[..., H]` = x * rstd * w, rstd `[...]` = 1 / sqrt(mean(x**2) + eps); one pass per row."""
    dt = _float_dtype(x, "rmsnorm_fwd")
    require(w.ndim == 1 and w.shape[0] == x.shape[-1],
            f"rmsnorm_fwd: w.shape={w.shape} must be [H] with H = x.shape[-1] = {x.shape[-1]}")
    require(eps >= 0, f"rmsnorm_fwd: eps={eps} must be >= 0")
    x2 = _c(x, dt).reshape(-1, x.shape[-1])
    y = np.empty_like(x2)
    rstd = np.empty(x2.shape[0], dt)
    _rmsnorm_fwd(x2, _c(w, dt), float(eps), y, rstd)
    return y.reshape(x.shape), rstd.reshape(x.shape[:-1])


@njit(cache=True, parallel=True, nogil=True)
def _rmsnorm_bwd(dy, x, w, rstd, dx, dw_parts):
    n, h = x.shape
    nchunks = dw_parts.shape[0]
    for c in prange(nchunks):
        for i in range(c * n // nchunks, (c + 1) * n // nchunks):
            r = rstd[i]
            dot = 0.0
            for j in range(h):
                dot += dy[i, j] * w[j] * x[i, j]
            corr = r * r * r * (dot / h)
            for j in range(h):
                dx[i, j] = r * (dy[i, j] * w[j]) - corr * x[i, j]
                dw_parts[c, j] += dy[i, j] * x[i, j] * r


def rmsnorm_bwd(dy: Array, x: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """dx `[..., H]`, dw `[H]` of `rmsnorm_fwd`; dw is reduced per row chunk in float64."""
    dt = _float_dtype(x, "rmsnorm_bwd")
    require(dy.shape == x.shape and rstd.shape == x.shape[:-1] and w.shape == x.shape[-1:],
            f"rmsnorm_bwd: shapes dy {dy.shape}, x {x.shape}, w {w.shape}, rstd {rstd.shape} "
            "must be [..., H], [..., H], [H], [...]")
    hdim = x.shape[-1]
    x2 = _c(x, dt).reshape(-1, hdim)
    dx = np.empty_like(x2)
    parts = np.zeros((_chunks(x2.shape[0]), hdim), np.float64)
    _rmsnorm_bwd(_c(dy, dt).reshape(-1, hdim), x2, _c(w, dt), _c(rstd, dt).reshape(-1), dx, parts)
    return dx.reshape(x.shape), parts.sum(axis=0).astype(dt)


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------

@njit(cache=True, parallel=True, nogil=True)
def _rope(x, cos, sin, sign, y):
    b, s, nh, d = x.shape
    half = d // 2
    for bs in prange(b * s):
        bi = bs // s
        si = bs % s
        for hh in range(nh):
            for j in range(half):
                x1 = x[bi, si, hh, j]
                x2 = x[bi, si, hh, j + half]
                c = cos[si, j]
                sn = sign * sin[si, j]
                y[bi, si, hh, j] = x1 * c - x2 * sn
                y[bi, si, hh, j + half] = x2 * c + x1 * sn


def rope_fwd(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE. x `[B, S, H, D]`, cos, sin `[S, D // 2]` -> y like x."""
    dt = _float_dtype(x, "rope_fwd")
    ref.check_rope_shapes(x, cos, sin, "rope_fwd")
    y = np.empty(x.shape, dt)
    _rope(_c(x, dt), _c(cos, dt), _c(sin, dt), dt.type(1), y)
    return y


def rope_bwd(dy: Array, cos: Array, sin: Array) -> Array:
    """Inverse rotation of `rope_fwd`. dy `[B, S, H, D]` -> dx like dy."""
    dt = _float_dtype(dy, "rope_bwd")
    ref.check_rope_shapes(dy, cos, sin, "rope_bwd")
    dx = np.empty(dy.shape, dt)
    _rope(_c(dy, dt), _c(cos, dt), _c(sin, dt), dt.type(-1), dx)
    return dx


# ----------------------------------------------------------------------------------------------
# SwiGLU
# ----------------------------------------------------------------------------------------------

@njit(cache=True, parallel=True, nogil=True)
def _swiglu_fwd(g, u, h, one):
    for i in prange(g.size):
        gi = g[i]
        e = np.exp(-abs(gi))
        sig = one / (one + e) if gi >= 0 else e / (one + e)
        h[i] = gi * sig * u[i]


@njit(cache=True, parallel=True, nogil=True)
def _swiglu_bwd(dh, g, u, dg, du, one):
    for i in prange(g.size):
        gi = g[i]
        e = np.exp(-abs(gi))
        sig = one / (one + e) if gi >= 0 else e / (one + e)
        dg[i] = dh[i] * u[i] * sig * (one + gi * (one - sig))
        du[i] = dh[i] * (gi * sig)


def swiglu_fwd(gate: Array, up: Array) -> Array:
    """h = silu(gate) * up, elementwise over `[..., ffn]`."""
    dt = _float_dtype(gate, "swiglu_fwd")
    require(gate.shape == up.shape, f"swiglu_fwd: gate.shape={gate.shape} must equal up.shape={up.shape}")
    h = np.empty(gate.shape, dt)
    _swiglu_fwd(_c(gate, dt).reshape(-1), _c(up, dt).reshape(-1), h.reshape(-1), dt.type(1))
    return h


def swiglu_bwd(dh: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """(dgate, dup) of `swiglu_fwd`, elementwise over `[..., ffn]`."""
    dt = _float_dtype(gate, "swiglu_bwd")
    require(dh.shape == gate.shape == up.shape,
            f"swiglu_bwd: shapes dh {dh.shape}, gate {gate.shape}, up {up.shape} must be equal")
    dg = np.empty(gate.shape, dt)
    du = np.empty(gate.shape, dt)
    _swiglu_bwd(_c(dh, dt).reshape(-1), _c(gate, dt).reshape(-1), _c(up, dt).reshape(-1),
                dg.reshape(-1), du.reshape(-1), dt.type(1))
    return dg, du


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------

@njit(cache=True, parallel=True, nogil=True)
def _attention_fwd(q, k, v, q_offset, k_offset, causal, scale, bq, bk, out, lse):
    """One task per (batch, query head, query block); online softmax over key blocks."""
    nb, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    nqb = (sq + bq - 1) // bq
    for task in prange(nb * hq * nqb):
        b = task // (hq * nqb)
        h = (task // nqb) % hq
        i0 = (task % nqb) * bq
        nq = min(bq, sq - i0)
        kh = h // group
        qs = np.empty((nq, d), q.dtype)
        for i in range(nq):
            for t in range(d):
                qs[i, t] = q[b, i0 + i, h, t] * scale
        acc = np.zeros((nq, d), q.dtype)
        m = np.full(nq, _NEG_INF, q.dtype)
        den = np.zeros(nq, q.dtype)
        kt = np.empty((d, bk), q.dtype)
        vb = np.empty((bk, d), q.dtype)
        row = np.empty(bk, q.dtype)
        kend = sk
        if causal:  # keys j with k_offset + j <= q_offset + (last query of the block)
            kend = max(0, min(sk, q_offset + i0 + nq - k_offset))
        for j0 in range(0, kend, bk):
            nk = min(bk, kend - j0)
            for jj in range(nk):
                for t in range(d):
                    kt[t, jj] = k[b, j0 + jj, kh, t]
                    vb[jj, t] = v[b, j0 + jj, kh, t]
            for i in range(nq):
                vis = nk
                if causal:
                    vis = max(0, min(nk, q_offset + i0 + i - k_offset - j0 + 1))
                if vis == 0:
                    continue
                for jj in range(vis):
                    row[jj] = 0
                for t in range(d):
                    qv = qs[i, t]
                    for jj in range(vis):
                        row[jj] += qv * kt[t, jj]
                mx = m[i]
                for jj in range(vis):
                    if row[jj] > mx:
                        mx = row[jj]
                corr = np.exp(m[i] - mx)
                den[i] *= corr
                for t in range(d):
                    acc[i, t] *= corr
                m[i] = mx
                for jj in range(vis):
                    p = np.exp(row[jj] - mx)
                    den[i] += p
                    for t in range(d):
                        acc[i, t] += p * vb[jj, t]
        for i in range(nq):
            if den[i] > 0:
                for t in range(d):
                    out[b, i0 + i, h, t] = acc[i, t] / den[i]
                lse[b, h, i0 + i] = m[i] + np.log(den[i])
            else:
                for t in range(d):
                    out[b, i0 + i, h, t] = 0
                lse[b, h, i0 + i] = _NEG_INF


def attention_fwd(q: Array, k: Array, v: Array, q_offset: int = 0, k_offset: int = 0,
                  causal: bool = True, scale: float | None = None) -> tuple[Array, Array]:
    """Blocked online-softmax attention; same contract as `numpy_ref.attention_fwd`.

    q `[B, Sq, Hq, D]`, k, v `[B, Sk, Hkv, D]` -> out `[B, Sq, Hq, D]`, lse `[B, Hq, Sq]`.
    """
    dt = _float_dtype(q, "attention_fwd")
    ref.check_attention_shapes(q, k, v, "attention_fwd")
    b, sq, hq, d = q.shape
    out = np.empty(q.shape, dt)
    lse = np.empty((b, hq, sq), ref.stat_dtype(dt))
    _attention_fwd(_c(q, dt), _c(k, dt), _c(v, dt), int(q_offset), int(k_offset), bool(causal),
                   dt.type(ref.attention_scale(d, scale)), BLOCK_Q, BLOCK_K, out, lse)
    return out, lse


@njit(cache=True, parallel=True, nogil=True)
def _attention_bwd(q, k, v, lse, dout, delta, q_offset, k_offset, causal, scale, bq, bk, dq, dk_h, dv_h):
    """One task per (batch, query head): for each key block, dk and dv accumulate locally over the
    query blocks that see it; dk_h, dv_h `[B, Hq, Sk, D]` receive the per-query-head parts."""
    nb, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    for task in prange(nb * hq):
        b = task // hq
        h = task % hq
        kh = h // group
        kb = np.empty((bk, d), q.dtype)
        kt = np.empty((d, bk), q.dtype)
        vt = np.empty((d, bk), q.dtype)
        dk_acc = np.empty((bk, d), q.dtype)
        dv_acc = np.empty((bk, d), q.dtype)
        qb = np.empty((bq, d), q.dtype)
        gb = np.empty((bq, d), q.dtype)
        dqb = np.empty((bq, d), q.dtype)
        p_blk = np.empty((bq, bk), q.dtype)
        ds_blk = np.empty((bq, bk), q.dtype)
        lse_b = np.empty(bq, q.dtype)
        delta_b = np.empty(bq, q.dtype)
        for j0 in range(0, sk, bk):
            nk = min(bk, sk - j0)
            i_first = 0
            if causal:  # first query that sees key j0: q_offset + i >= k_offset + j0
                i_first = max(0, k_offset + j0 - q_offset)
            if i_first >= sq:
                continue
            for jj in range(nk):
                for t in range(d):
                    kb[jj, t] = k[b, j0 + jj, kh, t]
                    kt[t, jj] = kb[jj, t]
                    vt[t, jj] = v[b, j0 + jj, kh, t]
                    dk_acc[jj, t] = 0
                    dv_acc[jj, t] = 0
            for i0 in range(i_first - i_first % bq, sq, bq):
                nq = min(bq, sq - i0)
                for i in range(nq):
                    lse_b[i] = lse[b, h, i0 + i]
                    delta_b[i] = delta[b, i0 + i, h]
                    for t in range(d):
                        qb[i, t] = q[b, i0 + i, h, t]
                        gb[i, t] = dout[b, i0 + i, h, t]
                        dqb[i, t] = 0
                for i in range(nq):
                    vis = nk
                    if causal:
                        vis = max(0, min(nk, q_offset + i0 + i - k_offset - j0 + 1))
                    if vis == 0 or lse_b[i] == _NEG_INF:
                        continue
                    prow = p_blk[i]
                    dsrow = ds_blk[i]
                    for jj in range(vis):
                        prow[jj] = 0
                        dsrow[jj] = 0
                    for t in range(d):  # scores and dP = dout V^T, vectorised over keys
                        qv = qb[i, t]
                        gv = gb[i, t]
                        for jj in range(vis):
                            prow[jj] += qv * kt[t, jj]
                            dsrow[jj] += gv * vt[t, jj]
                    for jj in range(vis):
                        p = np.exp(prow[jj] * scale - lse_b[i])
                        prow[jj] = p
                        dsrow[jj] = p * (dsrow[jj] - delta_b[i]) * scale
                    for jj in range(vis):
                        p = prow[jj]
                        ds = dsrow[jj]
                        for t in range(d):
                            dv_acc[jj, t] += p * gb[i, t]
                            dk_acc[jj, t] += ds * qb[i, t]
                            dqb[i, t] += ds * kb[jj, t]
                for i in range(nq):
                    for t in range(d):
                        dq[b, i0 + i, h, t] += dqb[i, t]
            for jj in range(nk):
                for t in range(d):
                    dk_h[b, h, j0 + jj, t] = dk_acc[jj, t]
                    dv_h[b, h, j0 + jj, t] = dv_acc[jj, t]


def attention_bwd(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                  q_offset: int = 0, k_offset: int = 0, causal: bool = True,
                  scale: float | None = None) -> tuple[Array, Array, Array]:
    """Blocked flash-attention backward from the given (possibly merged) out and lse.

    Same contract as `numpy_ref.attention_bwd`: dq `[B, Sq, Hq, D]`, dk, dv `[B, Sk, Hkv, D]`.
    """
    dt = _float_dtype(q, "attention_bwd")
    ref.check_attention_shapes(q, k, v, "attention_bwd")
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    require(out.shape == q.shape and dout.shape == q.shape and lse.shape == (b, hq, sq),
            f"attention_bwd: out {out.shape}, dout {dout.shape} must be {q.shape} and lse {lse.shape} "
            f"must be {(b, hq, sq)}")
    dq = np.zeros(q.shape, dt)
    dk_h = np.zeros((b, hq, sk, d), dt)  # key blocks no query sees stay 0
    dv_h = np.zeros((b, hq, sk, d), dt)
    dout_c = _c(dout, dt)
    delta = (dout_c * out).sum(axis=-1, dtype=dt)  # [B, Sq, Hq]
    _attention_bwd(_c(q, dt), _c(k, dt), _c(v, dt), _c(lse, dt), dout_c, delta, int(q_offset), int(k_offset),
                   bool(causal), dt.type(ref.attention_scale(d, scale)), BLOCK_Q, BLOCK_K, dq, dk_h, dv_h)
    group = hq // hkv
    dk = dk_h.reshape(b, hkv, group, sk, d).sum(axis=2).transpose(0, 2, 1, 3)
    dv = dv_h.reshape(b, hkv, group, sk, d).sum(axis=2).transpose(0, 2, 1, 3)
    return dq, np.ascontiguousarray(dk), np.ascontiguousarray(dv)


@njit(cache=True, parallel=True, nogil=True)
def _attention_merge(out_a, lse_a, out_b, lse_b, out, lse):
    nb, s, nh, d = out_a.shape
    for bs in prange(nb * s):
        b = bs // s
        si = bs % s
        for h in range(nh):
            la = lse_a[b, h, si]
            lb = lse_b[b, h, si]
            mx = max(la, lb)
            if mx == _NEG_INF:
                lse[b, h, si] = _NEG_INF
                for t in range(d):
                    out[b, si, h, t] = 0
                continue
            wa = np.exp(la - mx)
            wb = np.exp(lb - mx)
            tot = wa + wb
            lse[b, h, si] = mx + np.log(tot)
            wa = wa / tot
            wb = wb / tot
            for t in range(d):
                out[b, si, h, t] = wa * out_a[b, si, h, t] + wb * out_b[b, si, h, t]


def attention_merge(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Log-sum-exp merge of two partial attentions: out `[B, S, H, D]`, lse `[B, H, S]`; -inf safe."""
    dt = _float_dtype(out_a, "attention_merge")
    require(out_a.shape == out_b.shape and lse_a.shape == lse_b.shape and out_a.ndim == 4
            and lse_a.shape == (out_a.shape[0], out_a.shape[2], out_a.shape[1]),
            f"attention_merge: out shapes {out_a.shape}, {out_b.shape} must be equal [B, S, H, D] and lse shapes "
            f"{lse_a.shape}, {lse_b.shape} must be [B, H, S]")
    ld = ref.stat_dtype(lse_a.dtype)
    out = np.empty(out_a.shape, dt)
    lse = np.empty(lse_a.shape, ld)
    _attention_merge(_c(out_a, dt), _c(lse_a, ld), _c(out_b, dt), _c(lse_b, ld), out, lse)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Cross-entropy
# ----------------------------------------------------------------------------------------------

@njit(cache=True, parallel=True, nogil=True)
def _ce_stats(logits, targets, vocab_start, nvalid, m, s, t):
    for i in prange(logits.shape[0]):
        mx = logits[i, 0]
        for j in range(1, nvalid):
            if logits[i, j] > mx:
                mx = logits[i, j]
        acc = 0.0
        for j in range(nvalid):
            acc += np.exp(logits[i, j] - mx)
        m[i] = mx
        s[i] = acc
        local = targets[i] - vocab_start
        t[i] = logits[i, local] if 0 <= local < nvalid else 0


def cross_entropy_stats(logits: Array, targets: Array, vocab_start: int = 0,
                        vocab_size: int | None = None) -> tuple[Array, Array, Array]:
    """(m, s, t) `[N]` of one vocab shard `[N, Vloc]`; same contract as `numpy_ref.cross_entropy_stats`."""
    _float_dtype(logits, "cross_entropy_stats")
    ref.check_ce_inputs(logits, targets, vocab_size, "cross_entropy_stats")
    n = logits.shape[0]
    nvalid = ref.valid_columns(logits.shape[1], vocab_start, vocab_size)
    sd = ref.stat_dtype(logits.dtype)
    if nvalid == 0:
        return np.full(n, -np.inf, sd), np.zeros(n, sd), np.zeros(n, sd)
    m, s, t = np.empty(n, sd), np.empty(n, sd), np.empty(n, sd)
    _ce_stats(_c(logits, sd), _c(targets, np.int64), int(vocab_start), nvalid, m, s, t)
    return m, s, t


def cross_entropy_fwd(logits: Array, targets: Array, vocab_size: int | None = None) -> tuple[Array, Array]:
    """loss `[N]` = lse - target logit and lse `[N]` of unsharded logits `[N, V]`."""
    nvalid = ref.valid_columns(logits.shape[1] if logits.ndim == 2 else 0, 0, vocab_size)
    require(nvalid > 0, f"cross_entropy_fwd: vocab_size={vocab_size} must leave at least one column")
    m, s, t = cross_entropy_stats(logits, targets, 0, nvalid)
    lse = m + np.log(s)
    return lse - t, lse


@njit(cache=True, parallel=True, nogil=True)
def _ce_bwd(logits, targets, lse, dloss, vocab_start, nvalid, one, grad):
    n, ncols = logits.shape
    for i in prange(n):
        local = targets[i] - vocab_start
        li = lse[i]
        gi = dloss[i]
        for j in range(nvalid):
            p = np.exp(logits[i, j] - li)
            if j == local:
                p -= one
            grad[i, j] = p * gi
        for j in range(nvalid, ncols):
            grad[i, j] = 0


def cross_entropy_bwd(logits: Array, targets: Array, lse: Array, dloss: Array, vocab_start: int = 0,
                      vocab_size: int | None = None) -> Array:
    """dlogits `[N, Vloc]` = (softmax - onehot) * dloss for one vocab shard; padding columns 0."""
    dt = _float_dtype(logits, "cross_entropy_bwd")
    ref.check_ce_inputs(logits, targets, vocab_size, "cross_entropy_bwd")
    n = logits.shape[0]
    require(lse.shape == (n,) and dloss.shape == (n,),
            f"cross_entropy_bwd: lse {lse.shape} and dloss {dloss.shape} must be [tokens] = ({n},)")
    sd = ref.stat_dtype(dt)
    nvalid = ref.valid_columns(logits.shape[1], vocab_start, vocab_size)
    grad = np.empty(logits.shape, sd)
    _ce_bwd(_c(logits, sd), _c(targets, np.int64), _c(lse, sd), _c(dloss, sd), int(vocab_start), nvalid,
            sd.type(1), grad)
    return grad.astype(dt, copy=False)
