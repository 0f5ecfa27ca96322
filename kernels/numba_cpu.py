"""CPU kernels compiled with Numba: fused, multi-threaded loops over rows, tokens or heads.

Every public function has the signature and semantics of the function of the same name in
`numpy_ref` (see there for the maths); inputs are float32 or float64 NumPy arrays, other arrays
are cast to the dtype of the first one, outputs are new arrays. bfloat16 inputs follow numpy_ref's
mixed-precision recipe (`numpy_ref.mixed_precision`: upcast once, these float32 kernels, the
marked outputs rounded once), with the same rounding points: a bf16 result is, bit for bit, the
float32 kernel's result on the upcast inputs, rounded.

What is here and why (exp is `numba_simd.vexp` throughout: Numba's own is a scalar libm call
without Intel SVML, 10x slower than NumPy's SIMD exp, which made several of these kernels lose):
  * attention fwd/bwd: `attention_cpu` (blockwise, online softmax, every inner product a BLAS
    call on a tile that stays in cache; fully masked key blocks are skipped under causality);
  * rmsnorm (also fused with the residual add before it: add_rmsnorm_fwd/bwd), rope, swiglu, geglu,
    attention_merge, cross-entropy: one fused pass per row instead of the
    several full-size temporaries of the NumPy expressions;
  * linear fwd/bwd: a row-panel matmul written in Numba (vectorised, threaded). OpenBLAS is about
    5x faster (see `python -m mpipar.bench kernels`), so the dispatcher routes linear_fwd/linear_bwd of the
    numba backend to NumPy; these two stay here for that comparison;

Threads: parallel loops use Numba's thread pool (`NUMBA_NUM_THREADS`, default: all cores); set it
(and `OPENBLAS_NUM_THREADS`) to cores / ranks-per-node under MPI. Importing this module sets
`OMP_WAIT_POLICY=PASSIVE` unless it is already set: with Numba's OpenMP threading layer, idle
workers otherwise spin after each parallel loop and starve the BLAS threads of the matmuls that
run between kernels (measured: a 1.1 ms matmul took 9-36 ms right after a Numba kernel).
"""

from __future__ import annotations

import math
import os
from typing import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read by libgomp when Numba first loads it

import numba  # noqa: E402  (after the OpenMP setting above)
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from . import numpy_ref as ref  # noqa: E402
from .attention_cpu import attention_bwd, attention_fwd  # noqa: E402,F401  (this backend's attention)
from .numba_simd import REORDER, vexp  # noqa: E402
from .numpy_ref import Array, require  # noqa: E402

# Ops implemented in this module (the dispatcher falls back to numpy_ref for the others).
IMPLEMENTED: tuple[str, ...] = (
    "linear_fwd", "linear_bwd", "rmsnorm_fwd", "rmsnorm_bwd", "add_rmsnorm_fwd",
    "add_rmsnorm_bwd", "rope_fwd",
    "rope_bwd", "swiglu_fwd", "swiglu_bwd", "geglu_fwd", "geglu_bwd", "attention_fwd", "attention_bwd", "attention_merge",
    "cross_entropy_stats", "cross_entropy_bwd",
)
# Ops where NumPy is faster than the implementation above (measured by `python -m mpipar.bench
# kernels`): the numba backend uses numpy_ref for these, with this reason.
SLOWER_THAN_NUMPY: dict[str, str] = {
    "linear_fwd": "numpy BLAS",
    "linear_bwd": "numpy BLAS",
}

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

@njit(cache=True, parallel=True, nogil=True, fastmath=False)
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


@ref.mixed_precision(0)
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


@ref.mixed_precision(0)
def linear_bwd(dy: Array, x: Array, w: Array | None, dw: Array | None = None) -> tuple[Array, Array]:
    """dx `[..., in]` = dy @ w, dw `[out, in]` = dy^T x summed over leading dims (tiled Numba matmul);
    a given dw is added into in place, and w None gives dx None (as `numpy_ref.linear_bwd`)."""
    dt = _float_dtype(x, "linear_bwd")
    out, inp = ref.check_linear_bwd(dy, x, w, dw)
    dy2 = _c(dy, dt).reshape(-1, out)
    dx = None if w is None else _matmul(dy2, _c(w, dt), TILE_M, TILE_N).reshape(x.shape)
    grad = _matmul(_c(dy2.T, dt), _c(x, dt).reshape(-1, inp), TILE_M, TILE_N)
    if dw is None:
        return dx, grad
    dw += grad
    return dx, dw


@njit(cache=True, nogil=True, inline="always", fastmath=False)
def _sigmoid(g, one):
    """Overflow-free logistic function of a scalar: exp is only taken of -|g|. Inlined into the
    callers' parallel loops (whose NumPy error model drops the division checks), which vectorise."""
    e = vexp(-abs(g))
    return one / (one + e) if g >= 0 else e / (one + e)


# ----------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=REORDER, inline="always")
def _norm_row(src, w, eps, y):  # pragma: no cover (njit)
    """y = src * rstd * w of one row `[H]`; returns rstd. The one body both callers of
    `_rmsnorm_fwd` inline, so that rmsnorm(x + r) is bit for bit the same fused or not."""
    acc = 0.0
    for j in range(src.shape[0]):
        acc += np.float64(src[j]) * src[j]
    rs = y.dtype.type(1.0 / math.sqrt(acc / src.shape[0] + eps))  # rstd as stored, then used
    for j in range(src.shape[0]):
        y[j] = src[j] * rs * w[j]
    return rs


@njit(cache=True, parallel=True, nogil=True, fastmath=REORDER)
def _rmsnorm_fwd(x, r, add, w, eps, s, y, rstd):  # pragma: no cover (njit)
    """y = rmsnorm(x (+ r if add)) * w per row; with add, s = x + r is written first (the row
    then stays in cache for the norm: one pass over memory)."""
    n, h = x.shape
    for i in prange(n):
        if add:
            for j in range(h):
                s[i, j] = x[i, j] + r[i, j]
            rstd[i] = _norm_row(s[i], w, eps, y[i])
        else:
            rstd[i] = _norm_row(x[i], w, eps, y[i])


def _rmsnorm_forward(x: Array, r: Array | None, w: Array, eps: float, name: str) -> tuple[Array, ...]:
    """(y, rstd), or (s, y, rstd) with s = x + r when r is given; shapes as in numpy_ref."""
    dt = _float_dtype(x, name)
    require(w.ndim == 1 and w.shape[0] == x.shape[-1],
            f"{name}: w.shape={w.shape} must be [H] with H = x.shape[-1] = {x.shape[-1]}")
    require(r is None or r.shape == x.shape, f"{name}: x.shape={x.shape} must equal r.shape={getattr(r, 'shape', None)}")
    require(eps >= 0, f"{name}: eps={eps} must be >= 0")
    x2 = _c(x, dt).reshape(-1, x.shape[-1])
    y = np.empty_like(x2)
    s = x2 if r is None else np.empty_like(x2)
    rstd = np.empty(x2.shape[0], dt)
    _rmsnorm_fwd(x2, x2 if r is None else _c(r, dt).reshape(x2.shape), r is not None, _c(w, dt), float(eps),
                 s, y, rstd)
    y, rstd = y.reshape(x.shape), rstd.reshape(x.shape[:-1])
    return (y, rstd) if r is None else (s.reshape(x.shape), y, rstd)


@ref.mixed_precision(0)
def rmsnorm_fwd(x: Array, w: Array, eps: float) -> tuple[Array, Array]:
    """y `[..., H]` = x * rstd * w, rstd `[...]` = 1 / sqrt(mean(x**2) + eps); one pass per row."""
    return _rmsnorm_forward(x, None, w, eps, "rmsnorm_fwd")


def add_rmsnorm_fwd(x: Array, r: Array, w: Array, eps: float) -> tuple[Array, Array, Array]:
    """s = x + r, y = rmsnorm(s) * w, rstd, all `[..., H]` (rstd `[...]`) in one pass per row.
    bf16: s = r(f(x) + f(r)) and `rmsnorm_fwd` of that rounded s, as numpy_ref."""
    if ref.is_bf16(x.dtype):
        require(x.shape == r.shape, f"add_rmsnorm_fwd: x.shape={x.shape} must equal r.shape={r.shape}")
        s = (x.astype(np.float32) + ref.upcast(r)).astype(x.dtype)
        return (s, *rmsnorm_fwd(s, w, eps))
    return _rmsnorm_forward(x, r, w, eps, "add_rmsnorm_fwd")


@njit(cache=True, parallel=True, nogil=True, fastmath=REORDER)
def _rmsnorm_bwd(dy, x, w, rstd, ds, add, dx, dw_parts):
    """dx = rmsnorm_bwd(dy) (+ ds if add) per row; dw summed per row chunk into dw_parts."""
    n, h = x.shape
    nchunks = dw_parts.shape[0]
    for c in prange(nchunks):
        for i in range(c * n // nchunks, (c + 1) * n // nchunks):
            r = rstd[i]
            dot = 0.0
            for j in range(h):
                dot += np.float64(dy[i, j] * w[j]) * x[i, j]
            corr = r * r * r * (dot / h)
            for j in range(h):
                g = r * (dy[i, j] * w[j]) - corr * x[i, j]
                dx[i, j] = g + ds[i, j] if add else g
                dw_parts[c, j] += dy[i, j] * x[i, j] * r


def _rmsnorm_backward(dy: Array, ds: Array | None, x: Array, w: Array, rstd: Array, name: str) -> tuple[Array, Array]:
    """(dx (+ ds), dw) for x `[..., H]`; dw is reduced per row chunk in float64."""
    dt = _float_dtype(x, name)
    require(dy.shape == x.shape and rstd.shape == x.shape[:-1] and w.shape == x.shape[-1:],
            f"{name}: shapes dy {dy.shape}, x {x.shape}, w {w.shape}, rstd {rstd.shape} "
            "must be [..., H], [..., H], [H], [...]")
    require(ds is None or ds.shape == x.shape, f"{name}: ds.shape={getattr(ds, 'shape', None)} must equal {x.shape}")
    hdim = x.shape[-1]
    x2 = _c(x, dt).reshape(-1, hdim)
    dx = np.empty_like(x2)
    parts = np.zeros((_chunks(x2.shape[0]), hdim), np.float64)
    _rmsnorm_bwd(_c(dy, dt).reshape(-1, hdim), x2, _c(w, dt), _c(rstd, dt).reshape(-1),
                 x2 if ds is None else _c(ds, dt).reshape(x2.shape), ds is not None, dx, parts)
    return dx.reshape(x.shape), parts.sum(axis=0).astype(dt)


@ref.mixed_precision(0)
def rmsnorm_bwd(dy: Array, x: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """dx `[..., H]`, dw `[H]` of `rmsnorm_fwd`."""
    return _rmsnorm_backward(dy, None, x, w, rstd, "rmsnorm_bwd")


@ref.mixed_precision(0)
def add_rmsnorm_bwd(dy: Array, ds: Array, s: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """dsum `[..., H]` = rmsnorm_bwd(dy) + ds and dw `[H]` of `add_rmsnorm_fwd`, in one pass per row."""
    return _rmsnorm_backward(dy, ds, s, w, rstd, "add_rmsnorm_bwd")


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------

@njit(cache=True, parallel=True, nogil=True, fastmath=False)
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


@ref.mixed_precision(0)
def rope_fwd(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE. x `[B, S, H, D]`, cos, sin `[S, D // 2]` -> y like x."""
    dt = _float_dtype(x, "rope_fwd")
    ref.check_rope_shapes(x, cos, sin, "rope_fwd")
    y = np.empty(x.shape, dt)
    _rope(_c(x, dt), _c(cos, dt), _c(sin, dt), dt.type(1), y)
    return y


@ref.mixed_precision(0)
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

@njit(cache=True, parallel=True, nogil=True, fastmath=False)
def _swiglu_fwd(g, u, h, one):
    for i in prange(g.size):
        h[i] = g[i] * _sigmoid(g[i], one) * u[i]


@njit(cache=True, parallel=True, nogil=True, fastmath=False)
def _swiglu_bwd(dh, g, u, dg, du, one):
    for i in prange(g.size):
        gi = g[i]
        sig = _sigmoid(gi, one)
        dg[i] = dh[i] * u[i] * sig * (one + gi * (one - sig))
        du[i] = dh[i] * (gi * sig)


def _gated_fwd(name: str, kernel: Callable, gate: Array, up: Array, *constants: float) -> Array:
    """A gated activation's forward ``h = act(gate) * up`` through its elementwise ``kernel(g,
    u, h, *constants)``, the constants in the arrays' dtype."""
    dt = _float_dtype(gate, name)
    require(gate.shape == up.shape, f"{name}: gate.shape={gate.shape} must equal up.shape={up.shape}")
    h = np.empty(gate.shape, dt)
    kernel(_c(gate, dt).reshape(-1), _c(up, dt).reshape(-1), h.reshape(-1),
           *(dt.type(c) for c in constants))
    return h


def _gated_bwd(name: str, kernel: Callable, dh: Array, gate: Array, up: Array,
               *constants: float) -> tuple[Array, Array]:
    """(dgate, dup) of a gated activation through its elementwise ``kernel(dh, g, u, dg, du,
    *constants)``, the constants in the arrays' dtype."""
    dt = _float_dtype(gate, name)
    require(dh.shape == gate.shape == up.shape,
            f"{name}: shapes dh {dh.shape}, gate {gate.shape}, up {up.shape} must be equal")
    dg = np.empty(gate.shape, dt)
    du = np.empty(gate.shape, dt)
    kernel(_c(dh, dt).reshape(-1), _c(gate, dt).reshape(-1), _c(up, dt).reshape(-1),
           dg.reshape(-1), du.reshape(-1), *(dt.type(c) for c in constants))
    return dg, du


@ref.mixed_precision(0)
def swiglu_fwd(gate: Array, up: Array) -> Array:
    """h = silu(gate) * up, elementwise over `[..., ffn]`."""
    return _gated_fwd("swiglu_fwd", _swiglu_fwd, gate, up, 1)


@ref.mixed_precision(0, 1)
def swiglu_bwd(dh: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """(dgate, dup) of `swiglu_fwd`, elementwise over `[..., ffn]`."""
    return _gated_bwd("swiglu_bwd", _swiglu_bwd, dh, gate, up, 1)


# ----------------------------------------------------------------------------------------------
# GeGLU (tanh-approximated GELU)
# ----------------------------------------------------------------------------------------------

@njit(cache=True, parallel=True, nogil=True, fastmath=False)
def _geglu_fwd(g, u, h, c, k, half, one):
    for i in prange(g.size):
        gi = g[i]
        t = math.tanh(c * (gi + k * gi * gi * gi))
        h[i] = half * gi * (one + t) * u[i]


@njit(cache=True, parallel=True, nogil=True, fastmath=False)
def _geglu_bwd(dh, g, u, dg, du, c, k, half, one):
    for i in prange(g.size):
        gi = g[i]
        g2 = gi * gi
        t = math.tanh(c * (gi + k * g2 * gi))
        slope = half * (one + t) + half * gi * (one - t * t) * c * (one + 3 * k * g2)
        dg[i] = dh[i] * u[i] * slope
        du[i] = dh[i] * (half * gi * (one + t))


_GELU_TANH = (ref.GELU_TANH_C, ref.GELU_TANH_K, 0.5, 1)
"""The GeGLU kernels' constants: tanh-GELU's c and k, one half and one."""


@ref.mixed_precision(0)
def geglu_fwd(gate: Array, up: Array) -> Array:
    """h = gelu_tanh(gate) * up, elementwise over `[..., ffn]`."""
    return _gated_fwd("geglu_fwd", _geglu_fwd, gate, up, *_GELU_TANH)


@ref.mixed_precision(0, 1)
def geglu_bwd(dh: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """(dgate, dup) of `geglu_fwd`, elementwise over `[..., ffn]`."""
    return _gated_bwd("geglu_bwd", _geglu_bwd, dh, gate, up, *_GELU_TANH)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------

@njit(cache=True, parallel=True, nogil=True, fastmath=False)
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


@ref.mixed_precision(0)
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

@njit(cache=True, parallel=True, nogil=True, fastmath=REORDER)
def _ce_stats(logits, targets, vocab_start, nvalid, m, s, t):
    """One pass per row (the row stays in cache): its max, sum of exp(logit - max), target logit."""
    for i in prange(logits.shape[0]):
        mx = logits[i, 0]
        for j in range(1, nvalid):
            mx = max(mx, logits[i, j])
        acc = logits.dtype.type(0)
        for j in range(nvalid):
            acc += vexp(logits[i, j] - mx)
        m[i] = mx
        s[i] = acc
        local = targets[i] - vocab_start
        t[i] = logits[i, local] if 0 <= local < nvalid else 0


@ref.mixed_precision()
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


@njit(cache=True, parallel=True, nogil=True, fastmath=REORDER)
def _ce_bwd(logits, targets, lse, dloss, vocab_start, nvalid, one, grad):
    n, ncols = logits.shape
    for i in prange(n):
        local = targets[i] - vocab_start
        li = lse[i]
        gi = dloss[i]
        for j in range(nvalid):
            grad[i, j] = vexp(logits[i, j] - li) * gi
        if 0 <= local < nvalid:
            grad[i, local] -= one * gi
        for j in range(nvalid, ncols):
            grad[i, j] = 0


@ref.mixed_precision(0)
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
