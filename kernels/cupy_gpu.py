"""GPU kernels on CuPy arrays, written to mirror `numpy_ref`'s signatures.

- matmuls (linear layers) are `numpy_ref`'s generic code on CuPy arrays: `cupy.matmul`, i.e.
  cuBLAS GEMMs;
- flash attention forward and backward are CUDA kernels (`_FLASH`, one RawModule compiled per
  dtype and head width): K/V tiles in shared memory, online softmax, the log-sum-exp returned
  for the ring merge, causal masks at global query/key offsets (ring and zigzag blocks) and
  sliding windows (key tiles outside a block's window skipped), grouped-query heads,
  accumulation in float32 (float64 for float64); no S x S matrix exists;
- fused RMSNorm forward/backward (one block per row), RoPE and SwiGLU (elementwise kernels), and
  the vocabulary-parallel cross-entropy statistics (one block per row).

None of these has run in this repository's CI, which has no CUDA device: `tests/gpu/` holds
their equality tests against `numpy_ref` (float64 <= 1e-12, float32 <= 1e-5), skipped without
one. Importing this module never imports CuPy: that happens on first use, so the package imports
cleanly on machines without CuPy or without a GPU (`unavailable_reason` says why).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from . import numpy_ref as ref
from .numpy_ref import Array, require

# Ops implemented in this module (the dispatcher uses numpy_ref's generic code for the others).
IMPLEMENTED: tuple[str, ...] = ("rope_cos_sin", "rope_fwd", "rope_bwd", "swiglu_fwd", "swiglu_bwd",
                                 "rmsnorm_fwd", "rmsnorm_bwd", "attention_fwd", "attention_bwd",
                                 "cross_entropy_stats")

_SIGMOID = "T e = exp(-fabs(g)); T sig = g >= 0 ? 1 / (1 + e) : e / (1 + e);"


def unavailable_reason() -> str | None:
    """None if CuPy imports and sees at least one CUDA device, else a sentence saying why not."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy.cuda.runtime.CUDARuntimeError when no driver is present
        return f"cupy found no usable CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return "cupy found no CUDA device"
    return None


def array_module() -> ModuleType:
    """The `cupy` module (imported on demand)."""
    import cupy

    return cupy


@functools.cache
def _elementwise_kernels() -> tuple[Any, Any]:
    """Compile (once) the SwiGLU forward and backward CUDA kernels."""
    cupy = array_module()
    fwd = cupy.ElementwiseKernel(
        "T g, T u", "T h",
        _SIGMOID + " h = g * sig * u;",
        "mpipar_swiglu_fwd",
    )
    bwd = cupy.ElementwiseKernel(
        "T dh, T g, T u", "T dg, T du",
        _SIGMOID + " dg = dh * u * sig * (1 + g * (1 - sig)); du = dh * (g * sig);",
        "mpipar_swiglu_bwd",
    )
    return fwd, bwd


def _device_float(a: Array, name: str) -> Array:
    cupy = array_module()
    require(isinstance(a, cupy.ndarray) and a.dtype.kind == "f" and a.dtype.itemsize in (4, 8),
            f"{name}: expected a float32 or float64 cupy array, got {type(a).__name__} "
            f"of dtype {getattr(a, 'dtype', None)}")
    return a


def rope_cos_sin(positions: Array, head_dim: int, theta: float, dtype: Any,
                 **scaling: Any) -> tuple[Array, Array]:
    """cos, sin `[S, head_dim // 2]` on the device for global positions `[S]` (host or device
    array); ``scaling``: the RoPE scaling arguments of :func:`numpy_ref.rope_cos_sin`."""
    return ref.rope_cos_sin(array_module().asarray(positions), head_dim, theta, dtype, **scaling)


def swiglu_fwd(gate: Array, up: Array) -> Array:
    """h = silu(gate) * up in one CUDA kernel; gate, up `[..., ffn]`."""
    _device_float(gate, "swiglu_fwd")
    require(gate.shape == up.shape, f"swiglu_fwd: gate.shape={gate.shape} must equal up.shape={up.shape}")
    fwd, _ = _elementwise_kernels()
    return fwd(gate, up.astype(gate.dtype, copy=False))


def swiglu_bwd(dh: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """(dgate, dup) of `swiglu_fwd` in one CUDA kernel; all `[..., ffn]`."""
    _device_float(gate, "swiglu_bwd")
    require(dh.shape == gate.shape == up.shape,
            f"swiglu_bwd: shapes dh {dh.shape}, gate {gate.shape}, up {up.shape} must be equal")
    _, bwd = _elementwise_kernels()
    return bwd(dh.astype(gate.dtype, copy=False), gate, up.astype(gate.dtype, copy=False))


# ------------------------------------------------------------------------------------- RoPE
@functools.cache
def _rope_kernel() -> Any:
    """y1 = x1*c - sgn*x2*s, y2 = x2*c + sgn*x1*s on pairs (i, i + D/2): sgn = 1 forward, -1
    backward (the inverse rotation). One thread per pair."""
    return array_module().ElementwiseKernel(
        "raw T x, raw T cos, raw T sin, int64 seq, int64 heads, int64 half, T sgn",
        "raw T y",
        """
        long long pair = i % half, row = i / half;          // row = (b*seq + s)*heads + h
        long long s = (row / heads) % seq;
        long long a = row * 2 * half + pair, b = a + half;
        T c = cos[s * half + pair], n = sgn * sin[s * half + pair];
        T x1 = x[a], x2 = x[b];
        y[a] = x1 * c - x2 * n;
        y[b] = x2 * c + x1 * n;
        """, "mpipar_rope")


def _rope(x: Array, cos: Array, sin: Array, sgn: float, name: str) -> Array:
    ref.check_rope_shapes(x, cos, sin, name)
    _device_float(x, name)
    cupy = array_module()
    x = cupy.ascontiguousarray(x)
    b, s, h, d = x.shape
    y = cupy.empty_like(x)
    _rope_kernel()(x, cupy.ascontiguousarray(cos, x.dtype), cupy.ascontiguousarray(sin, x.dtype),
                   s, h, d // 2, x.dtype.type(sgn), y, size=x.size // 2)
    return y


def rope_fwd(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate pairs (x[..., i], x[..., i + D/2]); x `[B, S, H, D]`, cos, sin `[S, D // 2]`."""
    return _rope(x, cos, sin, 1.0, "rope_fwd")


def rope_bwd(dy: Array, cos: Array, sin: Array) -> Array:
    """Gradient of `rope_fwd` (the inverse rotation); dy `[B, S, H, D]`."""
    return _rope(dy, cos, sin, -1.0, "rope_bwd")


# ---------------------------------------------------------------------------------- RMSNorm
_ROWS = r"""
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
template<typename T> __device__ T block_sum(T v, T* scratch) {
    // Sum over the block (blockDim.x a power of two <= 1024), returned to every thread.
    scratch[threadIdx.x] = v;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step /= 2) {
        if (threadIdx.x < step) scratch[threadIdx.x] += scratch[threadIdx.x + step];
        __syncthreads();
    }
    T total = scratch[0];
    __syncthreads();
    return total;
}

template<typename T> __device__ T block_max(T v, T* scratch) {
    scratch[threadIdx.x] = v;
    __syncthreads();
    for (int step = blockDim.x / 2; step > 0; step /= 2) {
        if (threadIdx.x < step) scratch[threadIdx.x] = max(scratch[threadIdx.x],
                                                           scratch[threadIdx.x + step]);
        __syncthreads();
    }
    T total = scratch[0];
    __syncthreads();
    return total;
}

// y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps): one block per row of H.
template<typename T> __global__ void rmsnorm_fwd(const T* x, const T* w, T* y, T* rstd,
                                                 long long H, double eps) {
    extern __shared__ unsigned char smem[];
    T* scratch = reinterpret_cast<T*>(smem);
    const T* xr = x + blockIdx.x * H;
    T acc = 0;
    for (long long j = threadIdx.x; j < H; j += blockDim.x) acc += xr[j] * xr[j];
    T r = (T)1 / sqrt(block_sum(acc, scratch) / (T)H + (T)eps);
    for (long long j = threadIdx.x; j < H; j += blockDim.x) y[blockIdx.x * H + j] = xr[j] * r * w[j];
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// dx = r * dy*w - r^3 * x * mean(dy*w*x): one block per row.
template<typename T> __global__ void rmsnorm_bwd(const T* dy, const T* x, const T* w,
                                                 const T* rstd, T* dx, long long H) {
    extern __shared__ unsigned char smem[];
    T* scratch = reinterpret_cast<T*>(smem);
    long long base = blockIdx.x * H;
    T acc = 0;
    for (long long j = threadIdx.x; j < H; j += blockDim.x) acc += dy[base + j] * w[j] * x[base + j];
    T dot = block_sum(acc, scratch) / (T)H, r = rstd[blockIdx.x];
    for (long long j = threadIdx.x; j < H; j += blockDim.x)
        dx[base + j] = r * dy[base + j] * w[j] - r * r * r * x[base + j] * dot;
}

// Softmax statistics of one vocabulary shard, one block per row: m (max over the nvalid real
// columns), s = sum exp(l - m), t = the target's logit if this shard holds it, else 0.
template<typename T> __global__ void ce_stats(const T* logits, const long long* targets,
                                              T* m, T* s, T* t, long long V, long long nvalid,
                                              long long vocab_start) {
    extern __shared__ unsigned char smem[];
    T* scratch = reinterpret_cast<T*>(smem);
    const T* row = logits + blockIdx.x * V;
    T mx = -INFINITY;
    for (long long j = threadIdx.x; j < nvalid; j += blockDim.x) mx = max(mx, row[j]);
    mx = block_max(mx, scratch);
    T acc = 0;
    for (long long j = threadIdx.x; j < nvalid; j += blockDim.x) acc += exp(row[j] - mx);
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        long long local = targets[blockIdx.x] - vocab_start;
        m[blockIdx.x] = mx;
        s[blockIdx.x] = acc;
        t[blockIdx.x] = (local >= 0 && local < nvalid) ? row[local] : (T)0;
    }
}
"""

_THREADS = 256


@functools.cache
def _rows_module() -> Any:
    names = [f"{k}<{t}>" for k in ("rmsnorm_fwd", "rmsnorm_bwd", "ce_stats")
             for t in ("float", "double")]
    return array_module().RawModule(code=_ROWS, options=("-std=c++14",), name_expressions=names)


def _row_kernel(name: str, dtype: Any) -> Any:
    ctype = "double" if array_module().dtype(dtype).itemsize == 8 else "float"
    return _rows_module().get_function(f"{name}<{ctype}>")


def _launch_rows(name: str, rows: int, dtype: Any, args: tuple) -> None:
    if rows:
        itemsize = array_module().dtype(dtype).itemsize
        _row_kernel(name, dtype)((rows,), (_THREADS,), args, shared_mem=_THREADS * itemsize)


def rmsnorm_fwd(x: Array, w: Array, eps: float) -> tuple[Array, Array]:
    """y = x / sqrt(mean(x**2) + eps) * w, fused; x `[..., H]`, w `[H]` -> y, rstd `[...]`."""
    require(w.ndim == 1 and x.shape[-1] == w.shape[0],
            f"rmsnorm_fwd: w.shape={w.shape} must be [H] with H = x.shape[-1] = {x.shape[-1]}")
    require(eps >= 0, f"rmsnorm_fwd: eps={eps} must be >= 0")
    _device_float(x, "rmsnorm_fwd")
    cupy = array_module()
    x = cupy.ascontiguousarray(x)
    h = x.shape[-1]
    y, rstd = cupy.empty_like(x), cupy.empty(x.shape[:-1], x.dtype)
    _launch_rows("rmsnorm_fwd", x.size // max(h, 1), x.dtype,
                 (x, cupy.ascontiguousarray(w, x.dtype), y, rstd, cupy.int64(h),
                  cupy.float64(eps)))
    return y, rstd


def rmsnorm_bwd(dy: Array, x: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """Gradients of `rmsnorm_fwd`: dx fused per row; dw `[H]` a column sum (cuBLAS-free
    reduction of dy * x * rstd)."""
    require(dy.shape == x.shape and rstd.shape == x.shape[:-1] and w.shape == x.shape[-1:],
            f"rmsnorm_bwd: shapes dy {dy.shape}, x {x.shape}, w {w.shape}, rstd {rstd.shape} "
            "must be [..., H], [..., H], [H], [...]")
    _device_float(x, "rmsnorm_bwd")
    cupy = array_module()
    dy, x, rstd = (cupy.ascontiguousarray(a, x.dtype) for a in (dy, x, rstd))
    h = x.shape[-1]
    dx = cupy.empty_like(x)
    _launch_rows("rmsnorm_bwd", x.size // max(h, 1), x.dtype,
                 (dy, x, cupy.ascontiguousarray(w, x.dtype), rstd, dx, cupy.int64(h)))
    dw = (dy * x * rstd[..., None]).reshape(-1, h).sum(axis=0)
    return dx, dw


def cross_entropy_stats(logits: Array, targets: Array, vocab_start: int = 0,
                        vocab_size: int | None = None) -> tuple[Array, Array, Array]:
    """Per-row softmax statistics (m, s, t) of one vocabulary shard, one block per row; as
    `numpy_ref.cross_entropy_stats` (float32 statistics for float32 logits)."""
    ref.check_ce_inputs(logits, targets, vocab_size, "cross_entropy_stats")
    cupy = array_module()
    n = logits.shape[0]
    nvalid = ref.valid_columns(logits.shape[1], vocab_start, vocab_size)
    sd = ref.stat_dtype(logits.dtype)
    if nvalid == 0:
        return cupy.full(n, -cupy.inf, sd), cupy.zeros(n, sd), cupy.zeros(n, sd)
    lv = cupy.ascontiguousarray(logits, sd)
    m, s, t = (cupy.empty(n, sd) for _ in range(3))
    _launch_rows("ce_stats", n, sd, (lv, cupy.ascontiguousarray(targets, cupy.int64), m, s, t,
                                     cupy.int64(lv.shape[1]), cupy.int64(nvalid),
                                     cupy.int64(vocab_start)))
    return m, s, t


# --------------------------------------------------------------------------- flash attention
_FLASH = r"""
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
// q [B, Sq, Hq, D], k, v [B, Sk, Hkv, D] (contiguous), lse [B, Hq, Sq]. Query head h reads kv
// head h / G. Query i sits at q_off + i, key j at k_off + j; causal: visible iff kpos <= qpos,
// and with a sliding window W > 0 (causal only) also qpos - kpos < W.
// One thread per query row (forward, dq) or key row (dk, dv); tiles of the other side in
// shared memory; A is the accumulation type (float for float, double for double).

__device__ inline bool visible(long long i, long long j, long long q_off, long long k_off,
                               int causal, long long window) {
    long long gap = (q_off + i) - (k_off + j);
    return !causal || (gap >= 0 && (window == 0 || gap < window));
}

// The first key tile a block of queries starting at row first_q can see (0 without a window).
__device__ inline long long first_key(long long first_q, long long q_off, long long k_off,
                                      int causal, long long window, int tile) {
    if (!causal || window == 0) return 0;
    long long j = max(0LL, q_off + first_q - (window - 1) - k_off);
    return j - j % tile;
}

// The key tiles [*kbeg, *kend) a block of query rows can see: after the causal diagonal's last
// visible key none, and with a window none before its first (rounded down to a tile).
__device__ inline void key_range(int Sq, int Sk, long long q_off, long long k_off, int causal,
                                 long long window, int tile, long long* kbeg, long long* kend) {
    long long first_q = (long long)blockIdx.x * blockDim.x;
    long long last_q = min((long long)Sq, first_q + blockDim.x) - 1;
    *kend = causal ? min((long long)Sk, q_off + last_q - k_off + 1) : Sk;
    *kbeg = first_key(first_q, q_off, k_off, causal, window, tile);
}

// Keys [k0, k0 + BN) of kv head hk of sequence b into shared memory (zeros past Sk).
template<typename T, int D, int BN>
__device__ inline void load_kv(const T* k, const T* v, T (*ks)[D], T (*vs)[D], int b, int hk,
                               long long k0, int Sk, int Hkv) {
    for (int e = threadIdx.x; e < BN * D; e += blockDim.x) {
        long long j = k0 + e / D;
        long long at = (((long long)b * Sk + j) * Hkv + hk) * D + e % D;
        ks[e / D][e % D] = j < Sk ? k[at] : (T)0;
        vs[e / D][e % D] = j < Sk ? v[at] : (T)0;
    }
}

template<typename T, typename A, int D, int BN>
__global__ void flash_fwd(const T* q, const T* k, const T* v, T* out, A* lse, int Sq, int Sk,
                          int Hq, int Hkv, long long q_off, long long k_off, int causal,
                          long long window, A scale) {
    __shared__ T ks[BN][D];
    __shared__ T vs[BN][D];
    int bh = blockIdx.y, b = bh / Hq, h = bh % Hq, hk = h / (Hq / Hkv);
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    bool row = i < Sq;
    A qr[D], o[D];
    const T* qp = q + (((long long)b * Sq + (row ? i : 0)) * Hq + h) * D;
    for (int d = 0; d < D; ++d) { qr[d] = row ? (A)qp[d] * scale : 0; o[d] = 0; }
    A m = -INFINITY, l = 0;
    // Keys past the block's last visible one are never loaded.
    long long kbeg, kend;
    key_range(Sq, Sk, q_off, k_off, causal, window, BN, &kbeg, &kend);
    for (long long k0 = kbeg; k0 < kend; k0 += BN) {
        load_kv<T, D, BN>(k, v, ks, vs, b, hk, k0, Sk, Hkv);
        __syncthreads();
        for (int jj = 0; jj < BN && row; ++jj) {
            long long j = k0 + jj;
            if (j >= Sk || !visible(i, j, q_off, k_off, causal, window)) continue;
            A s = 0;
            for (int d = 0; d < D; ++d) s += qr[d] * (A)ks[jj][d];
            A m_new = max(m, s), corr = exp(m - m_new), p = exp(s - m_new);
            l = l * corr + p;
            for (int d = 0; d < D; ++d) o[d] = o[d] * corr + p * (A)vs[jj][d];
            m = m_new;
        }
        __syncthreads();
    }
    if (!row) return;
    T* op = out + (((long long)b * Sq + i) * Hq + h) * D;
    for (int d = 0; d < D; ++d) op[d] = l > 0 ? (T)(o[d] / l) : (T)0;
    lse[((long long)b * Hq + h) * Sq + i] = l > 0 ? m + log(l) : -INFINITY;
}

// dq_i = scale * sum_j p_ij (dO_i . v_j - delta_i) k_j, p_ij = exp(scale q_i.k_j - lse_i).
template<typename T, typename A, int D, int BN>
__global__ void flash_bwd_dq(const T* q, const T* k, const T* v, const T* dout, const A* lse,
                             const A* delta, T* dq, int Sq, int Sk, int Hq, int Hkv,
                             long long q_off, long long k_off, int causal, long long window,
                             A scale) {
    __shared__ T ks[BN][D];
    __shared__ T vs[BN][D];
    int bh = blockIdx.y, b = bh / Hq, h = bh % Hq, hk = h / (Hq / Hkv);
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    bool row = i < Sq;
    long long at_q = (((long long)b * Sq + (row ? i : 0)) * Hq + h) * D;
    A L = row ? lse[((long long)b * Hq + h) * Sq + i] : -INFINITY;
    A dl = row ? delta[((long long)b * Hq + h) * Sq + i] : 0;
    bool live = row && isfinite(L);
    A qr[D], dor[D], acc[D];
    for (int d = 0; d < D; ++d) {
        qr[d] = row ? (A)q[at_q + d] * scale : 0; dor[d] = row ? (A)dout[at_q + d] : 0; acc[d] = 0;
    }
    long long kbeg, kend;
    key_range(Sq, Sk, q_off, k_off, causal, window, BN, &kbeg, &kend);
    for (long long k0 = kbeg; k0 < kend; k0 += BN) {
        load_kv<T, D, BN>(k, v, ks, vs, b, hk, k0, Sk, Hkv);
        __syncthreads();
        for (int jj = 0; jj < BN && live; ++jj) {
            long long j = k0 + jj;
            if (j >= Sk || !visible(i, j, q_off, k_off, causal, window)) continue;
            A s = 0, dp = 0;
            for (int d = 0; d < D; ++d) { s += qr[d] * (A)ks[jj][d]; dp += dor[d] * (A)vs[jj][d]; }
            A ds = exp(s - L) * (dp - dl);
            for (int d = 0; d < D; ++d) acc[d] += ds * (A)ks[jj][d];
        }
        __syncthreads();
    }
    if (row) for (int d = 0; d < D; ++d) dq[at_q + d] = (T)(acc[d] * scale);
}

// dv_j = sum over the G query heads of kv head hk and the rows i: p_ij dO_i;
// dk_j = scale * sum p_ij (dO_i . v_j - delta_i) q_i. One thread per key row.
template<typename T, typename A, int D, int BM>
__global__ void flash_bwd_dkdv(const T* q, const T* k, const T* v, const T* dout, const A* lse,
                               const A* delta, T* dk, T* dv, int Sq, int Sk, int Hq, int Hkv,
                               long long q_off, long long k_off, int causal, long long window,
                               A scale) {
    __shared__ T qs[BM][D];
    __shared__ T ds_[BM][D];
    __shared__ A ls[BM];
    __shared__ A dls[BM];
    int bh = blockIdx.y, b = bh / Hkv, hk = bh % Hkv, G = Hq / Hkv;
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    bool row = j < Sk;
    long long at_k = (((long long)b * Sk + (row ? j : 0)) * Hkv + hk) * D;
    A kr[D], vr[D], dka[D], dva[D];
    for (int d = 0; d < D; ++d) {
        kr[d] = row ? (A)k[at_k + d] : 0; vr[d] = row ? (A)v[at_k + d] : 0; dka[d] = 0; dva[d] = 0;
    }
    // Queries before the block's first key are never visible to it.
    long long first_k = (long long)blockIdx.x * blockDim.x;
    long long qbeg = causal ? max(0LL, k_off + first_k - q_off) : 0;
    // With a window, queries past the block's last key + window - 1 see none of its keys.
    long long last_k = min((long long)Sk, first_k + blockDim.x) - 1;
    long long qend = causal && window ? min((long long)Sq, k_off + last_k + window - q_off)
                                      : (long long)Sq;
    for (int g = 0; g < G; ++g) {
        int h = hk * G + g;
        for (long long i0 = qbeg - qbeg % BM; i0 < qend; i0 += BM) {
            for (int e = threadIdx.x; e < BM * D; e += blockDim.x) {
                long long i = i0 + e / D;
                long long at = (((long long)b * Sq + i) * Hq + h) * D + e % D;
                qs[e / D][e % D] = i < Sq ? q[at] : (T)0;
                ds_[e / D][e % D] = i < Sq ? dout[at] : (T)0;
            }
            for (int e = threadIdx.x; e < BM; e += blockDim.x) {
                long long i = i0 + e;
                ls[e] = i < Sq ? lse[((long long)b * Hq + h) * Sq + i] : -INFINITY;
                dls[e] = i < Sq ? delta[((long long)b * Hq + h) * Sq + i] : 0;
            }
            __syncthreads();
            for (int ii = 0; ii < BM && row; ++ii) {
                long long i = i0 + ii;
                if (i >= Sq || !isfinite(ls[ii]) || !visible(i, j, q_off, k_off, causal, window)) continue;
                A s = 0, dp = 0;
                for (int d = 0; d < D; ++d) { s += (A)qs[ii][d] * kr[d]; dp += (A)ds_[ii][d] * vr[d]; }
                A p = exp(s * scale - ls[ii]);
                A dsv = p * (dp - dls[ii]);
                for (int d = 0; d < D; ++d) {
                    dva[d] += p * (A)ds_[ii][d];
                    dka[d] += dsv * (A)qs[ii][d];
                }
            }
            __syncthreads();
        }
    }
    if (!row) return;
    for (int d = 0; d < D; ++d) { dk[at_k + d] = (T)(dka[d] * scale); dv[at_k + d] = (T)dva[d]; }
}
"""

_HEAD_DIMS = (32, 64, 80, 96, 128)
"""Head widths the flash kernels are compiled for (a template argument: registers per row)."""
_ROWS_PER_BLOCK = 64


def _tile(dtype: Any) -> int:
    """Keys (or queries) per shared-memory tile: two tiles of `[tile, 128]` fit in 48 KiB."""
    return 16 if array_module().dtype(dtype).itemsize == 8 else 32


@functools.cache
def _flash_module() -> Any:
    names = []
    for t, a in (("float", "float"), ("double", "double")):
        tile = 16 if t == "double" else 32
        for d in _HEAD_DIMS:
            names += [f"flash_fwd<{t},{a},{d},{tile}>", f"flash_bwd_dq<{t},{a},{d},{tile}>",
                      f"flash_bwd_dkdv<{t},{a},{d},{tile}>"]
    return array_module().RawModule(code=_FLASH, options=("-std=c++14",), name_expressions=names)


def _flash(name: str, dtype: Any, head_dim: int) -> Any:
    require(head_dim in _HEAD_DIMS, f"{name}: head_dim={head_dim} must be one of {_HEAD_DIMS} "
                                    f"on the GPU")
    t = "double" if array_module().dtype(dtype).itemsize == 8 else "float"
    return _flash_module().get_function(f"{name}<{t},{t},{head_dim},{_tile(dtype)}>")


def _flash_args(q: Array, k: Array, q_offset: int, k_offset: int, causal: bool,
                scale: float | None, acc: Any, window: int = 0) -> tuple:
    cupy = array_module()
    b, sq, hq, d = q.shape
    return (cupy.int32(sq), cupy.int32(k.shape[1]), cupy.int32(hq), cupy.int32(k.shape[2]),
            cupy.int64(q_offset), cupy.int64(k_offset), cupy.int32(bool(causal)),
            cupy.int64(window), acc.type(ref.attention_scale(d, scale)))


def attention_fwd(q: Array, k: Array, v: Array, q_offset: int = 0, k_offset: int = 0,
                  causal: bool = True, scale: float | None = None,
                  window: int = 0) -> tuple[Array, Array]:
    """Flash attention forward (`numpy_ref.attention_fwd`'s contract, sliding `window`
    included): q `[B, Sq, Hq, D]`, k, v `[B, Sk, Hkv, D]` -> out like q, lse `[B, Hq, Sq]`
    (float32; float64 for float64). Key tiles wholly before a block's window are not loaded."""
    ref.check_attention_shapes(q, k, v, "attention_fwd")
    ref.check_window(window, causal, "attention_fwd")
    _device_float(q, "attention_fwd")
    cupy = array_module()
    q, k, v = (cupy.ascontiguousarray(a, q.dtype) for a in (q, k, v))
    b, sq, hq, d = q.shape
    acc = cupy.dtype(ref.stat_dtype(q.dtype))
    out, lse = cupy.empty_like(q), cupy.empty((b, hq, sq), acc)
    if sq:
        grid = (-(-sq // _ROWS_PER_BLOCK), b * hq)
        _flash("flash_fwd", q.dtype, d)(grid, (_ROWS_PER_BLOCK,), (
            q, k, v, out, lse, *_flash_args(q, k, q_offset, k_offset, causal, scale, acc,
                                            window)))
    return out, lse


def attention_bwd(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                  q_offset: int = 0, k_offset: int = 0, causal: bool = True,
                  scale: float | None = None, window: int = 0) -> tuple[Array, Array, Array]:
    """Flash attention backward for one key block given the (possibly ring-merged) out and lse
    (`numpy_ref.attention_bwd`'s contract): dq by query rows, dk and dv by key rows (summed over
    each kv head's query heads), without atomics."""
    ref.check_attention_shapes(q, k, v, "attention_bwd")
    ref.check_window(window, causal, "attention_bwd")
    b, sq, hq, d = q.shape
    require(out.shape == q.shape and dout.shape == q.shape and lse.shape == (b, hq, sq),
            f"attention_bwd: out {out.shape}, dout {dout.shape} must be {q.shape} and lse "
            f"{lse.shape} must be {(b, hq, sq)}")
    _device_float(q, "attention_bwd")
    cupy = array_module()
    acc = cupy.dtype(ref.stat_dtype(q.dtype))
    q, k, v, dout = (cupy.ascontiguousarray(a, q.dtype) for a in (q, k, v, dout))
    lse = cupy.ascontiguousarray(lse, acc)
    delta = cupy.ascontiguousarray((dout.astype(acc) * out.astype(acc)).sum(axis=-1)
                                   .transpose(0, 2, 1))  # [B, Hq, Sq]
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    args = _flash_args(q, k, q_offset, k_offset, causal, scale, acc, window)
    if sq:
        _flash("flash_bwd_dq", q.dtype, d)((-(-sq // _ROWS_PER_BLOCK), b * hq), (_ROWS_PER_BLOCK,),
                                          (q, k, v, dout, lse, delta, dq, *args))
    if k.shape[1]:
        _flash("flash_bwd_dkdv", q.dtype, d)((-(-k.shape[1] // _ROWS_PER_BLOCK), b * k.shape[2]),
                                            (_ROWS_PER_BLOCK,),
                                            (q, k, v, dout, lse, delta, dk, dv, *args))
    return dq, dk, dv
