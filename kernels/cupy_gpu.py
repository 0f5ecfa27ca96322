"""GPU kernels on CuPy arrays for float32 and float64, written to mirror `numpy_ref`'s signatures.

These are the exactness kernels (float64 layouts on a GPU equal the CPU's to 1e-10 and better);
the bf16 tensor-core kernels live beside them. Every CUDA source here is a CuPy ``RawModule``
(:func:`cuda_sources` hands them to the compile gate, `mpipar.kernels.cuda_gate`):

- the rows module: RMSNorm forward/backward and the vocabulary-parallel cross-entropy
  statistics (one block per row), SwiGLU forward/backward and RoPE (grid-stride elementwise);
- flash attention forward and backward, one module per (dtype, head_dim) compiled on first use:
  K/V tiles in shared memory, online softmax, the log-sum-exp returned for the ring merge,
  causal masks at global query/key offsets (ring and zigzag blocks), sliding windows (key tiles
  outside a block's window skipped), packed documents (document ids: blocks aligned to the
  documents, each block reads only its documents' keys, `_documents`), grouped-query heads, accumulation in float32 (float64 for
  float64), no S x S matrix. A few lanes of a warp share one row and sum dot products with warp
  shuffles, so no thread holds a D-long vector and nothing spills (:func:`flash_config`).

matmuls (linear layers) are `numpy_ref`'s generic code on CuPy arrays (cuBLAS through
``cupy.matmul``; `mpipar.kernels.cublas` is the explicit wrapper). Importing this module never
imports CuPy: that happens on first use, so the package imports cleanly without CuPy or a GPU
(`unavailable_reason` says why).
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

HEAD_DIMS: tuple[int, ...] = (8, 16, 32, 64, 80, 96, 128)
"""Head widths the flash kernels support (a template argument; each one passes the compile gate
with no spills for float32 and float64)."""

_OPTIONS: tuple[str, ...] = ("--std=c++17",)
"""NVRTC options of every RawModule here (CuPy adds its own; see `cuda_gate`)."""
_THREADS = 256
"""Threads per block of every kernel here (the flash kernels' NT template argument)."""
_CTYPES = {4: "float", 8: "double"}


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


def _device_float(a: Array, name: str) -> Array:
    cupy = array_module()
    require(isinstance(a, cupy.ndarray) and a.dtype.kind == "f" and a.dtype.itemsize in (4, 8),
            f"{name}: expected a float32 or float64 cupy array, got {type(a).__name__} "
            f"of dtype {getattr(a, 'dtype', None)}")
    return a


def _ctype(dtype: Any) -> str:
    """The C type ("float" or "double") of a float32 or float64 dtype."""
    return _CTYPES[array_module().dtype(dtype).itemsize]


# ------------------------------------------------------------------- rows and elementwise
_ROWS = r"""
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
// Sum (or max) over the block (blockDim.x a power of two <= 1024), returned to every thread.
template<typename T> __device__ T block_sum(T v, T* scratch) {
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

// Elementwise kernels: a grid-stride loop over n items.
#define GRID_STRIDE(idx, n) \
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < (n); \
         idx += (long long)gridDim.x * blockDim.x)

// The logistic function without overflow: exp is only taken of -|g|.
template<typename T> __device__ inline T sigmoid(T g) {
    T e = exp(-fabs(g));
    return g >= 0 ? (T)1 / ((T)1 + e) : e / ((T)1 + e);
}

// h = silu(g) * u.
template<typename T> __global__ void swiglu_fwd(const T* g, const T* u, T* h, long long n) {
    GRID_STRIDE(i, n) { T sg = sigmoid(g[i]); h[i] = g[i] * sg * u[i]; }
}

// dg = dh * u * sig * (1 + g (1 - sig)), du = dh * silu(g).
template<typename T> __global__ void swiglu_bwd(const T* dh, const T* g, const T* u, T* dg,
                                                T* du, long long n) {
    GRID_STRIDE(i, n) {
        T sg = sigmoid(g[i]);
        dg[i] = dh[i] * u[i] * sg * ((T)1 + g[i] * ((T)1 - sg));
        du[i] = dh[i] * (g[i] * sg);
    }
}

// RoPE on pairs (a, a + half) of rows (b*seq + s)*heads + h: y1 = x1 c - x2 n, y2 = x2 c + x1 n
// with n = sgn * sin (sgn = 1 forward, -1 backward: the inverse rotation); cos, sin [seq, half].
template<typename T> __global__ void rope(const T* x, const T* cos_, const T* sin_, T* y,
                                          long long pairs, long long seq, long long heads,
                                          long long half, T sgn) {
    GRID_STRIDE(i, pairs) {
        long long pair = i % half, row = i / half;
        long long s = (row / heads) % seq;
        long long a = row * 2 * half + pair, b = a + half;
        T c = cos_[s * half + pair], n = sgn * sin_[s * half + pair];
        T x1 = x[a], x2 = x[b];
        y[a] = x1 * c - x2 * n;
        y[b] = x2 * c + x1 * n;
    }
}
"""

_ROW_KERNELS = ("rmsnorm_fwd", "rmsnorm_bwd", "ce_stats", "swiglu_fwd", "swiglu_bwd", "rope")


def _rows_names() -> tuple[str, ...]:
    """Name expressions of the rows module: every kernel for float and double."""
    return tuple(f"{k}<{t}>" for k in _ROW_KERNELS for t in ("float", "double"))


@functools.cache
def _rows_module() -> Any:
    return array_module().RawModule(code=_ROWS, options=_OPTIONS, name_expressions=_rows_names())


def _launch_rows(name: str, rows: int, dtype: Any, args: tuple) -> None:
    """One block of `_THREADS` per row, with `_THREADS` items of scratch shared memory."""
    if rows:
        kernel = _rows_module().get_function(f"{name}<{_ctype(dtype)}>")
        itemsize = array_module().dtype(dtype).itemsize
        kernel((rows,), (_THREADS,), args, shared_mem=_THREADS * itemsize)


def _launch_flat(name: str, n: int, dtype: Any, args: tuple) -> None:
    """A grid-stride kernel over `n` items (`n` is its last argument)."""
    if n:
        kernel = _rows_module().get_function(f"{name}<{_ctype(dtype)}>")
        kernel((min(-(-n // _THREADS), 1 << 16),), (_THREADS,), args)


def rope_cos_sin(positions: Array, head_dim: int, theta: float, dtype: Any,
                 **scaling: Any) -> tuple[Array, Array]:
    """cos, sin `[S, head_dim // 2]` on the device for global positions `[S]` (host or device
    array); ``scaling``: the RoPE scaling arguments of :func:`numpy_ref.rope_cos_sin`."""
    return ref.rope_cos_sin(array_module().asarray(positions), head_dim, theta, dtype, **scaling)


def swiglu_fwd(gate: Array, up: Array) -> Array:
    """h = silu(gate) * up in one CUDA kernel; gate, up `[..., ffn]`."""
    _device_float(gate, "swiglu_fwd")
    require(gate.shape == up.shape,
            f"swiglu_fwd: gate.shape={gate.shape} must equal up.shape={up.shape}")
    cupy = array_module()
    g, u = (cupy.ascontiguousarray(a, gate.dtype) for a in (gate, up))
    h = cupy.empty_like(g)
    _launch_flat("swiglu_fwd", g.size, g.dtype, (g, u, h, cupy.int64(g.size)))
    return h


def swiglu_bwd(dh: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """(dgate, dup) of `swiglu_fwd` in one CUDA kernel; all `[..., ffn]`."""
    _device_float(gate, "swiglu_bwd")
    require(dh.shape == gate.shape == up.shape,
            f"swiglu_bwd: shapes dh {dh.shape}, gate {gate.shape}, up {up.shape} must be equal")
    cupy = array_module()
    d, g, u = (cupy.ascontiguousarray(a, gate.dtype) for a in (dh, gate, up))
    dg, du = cupy.empty_like(g), cupy.empty_like(g)
    _launch_flat("swiglu_bwd", g.size, g.dtype, (d, g, u, dg, du, cupy.int64(g.size)))
    return dg, du


def _rope(x: Array, cos: Array, sin: Array, sgn: float, name: str) -> Array:
    ref.check_rope_shapes(x, cos, sin, name)
    _device_float(x, name)
    cupy = array_module()
    x = cupy.ascontiguousarray(x)
    b, s, h, d = x.shape
    y = cupy.empty_like(x)
    _launch_flat("rope", x.size // 2, x.dtype,
                 (x, cupy.ascontiguousarray(cos, x.dtype), cupy.ascontiguousarray(sin, x.dtype), y,
                  cupy.int64(x.size // 2), cupy.int64(s), cupy.int64(h), cupy.int64(d // 2),
                  x.dtype.type(sgn)))
    return y


def rope_fwd(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate pairs (x[..., i], x[..., i + D/2]); x `[B, S, H, D]`, cos, sin `[S, D // 2]`."""
    return _rope(x, cos, sin, 1.0, "rope_fwd")


def rope_bwd(dy: Array, cos: Array, sin: Array) -> Array:
    """Gradient of `rope_fwd` (the inverse rotation); dy `[B, S, H, D]`."""
    return _rope(dy, cos, sin, -1.0, "rope_bwd")


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
    """Gradients of `rmsnorm_fwd`: dx fused per row; dw `[H]` a column sum of dy * x * rstd."""
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
    """Per-row softmax statistics (m, s, t) `[N]` of one vocabulary shard `[N, Vloc]`, one block
    per row; as `numpy_ref.cross_entropy_stats` (float32 statistics for float32 logits)."""
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
// Layouts: q, out, dout [B, Sq, Hq, D], k, v [B, Sk, Hkv, D] (contiguous), lse, delta
// [B, Hq, Sq]. Query head h reads kv head h / (Hq / Hkv). Query i sits at q_off + i, key j at
// k_off + j; causal: visible iff kpos <= qpos and, with a sliding window W > 0, qpos - kpos < W.
//
// L lanes (a power of two <= 32) share one row: lane l keeps the E = D / L elements
// d = l + L*e of that row's vectors in registers, and dot products are summed over the L lanes
// with warp shuffles (no thread holds a D-long array, so nothing spills). A block of NT threads
// owns R = NT / L rows; tiles of the other side are staged in shared memory. A is the
// accumulation type (float for float, double for double).

template<int L, typename A> __device__ inline A lanes_sum(A v) {
#pragma unroll
    for (int off = L / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ inline bool visible(long long i, long long j, long long q_off, long long k_off,
                               int causal, long long window) {
    long long gap = (q_off + i) - (k_off + j);
    return !causal || (gap >= 0 && (window == 0 || gap < window));
}

// Rows [r0, r0 + N) of one (batch, head) slice of a [B, S, H, D] tensor into sh (zeros past S);
// base: the slice's first element, stride: H * D.
template<typename T, int D, int N>
__device__ inline void load_rows(const T* x, T (*sh)[D], long long base, long long stride,
                                 long long r0, int S) {
    for (int e = threadIdx.x; e < N * D; e += blockDim.x) {
        long long r = r0 + e / D;
        sh[e / D][e % D] = r < S ? x[base + r * stride + e % D] : (T)0;
    }
}

// Rows [*first, *stop) of block x of sequence b: the fixed grid's R-row blocks, or with packed
// documents the block table starts [B, nb] (blocks of at most R rows aligned to document
// starts, `attention_cpu.document_blocks`; columns past a sequence's blocks hold S).
__device__ inline void block_rows(const long long* starts, int nb, int b, int x, int R, int S,
                                  long long* first, long long* stop) {
    if (starts) {
        *first = starts[(long long)b * nb + x];
        *stop = starts[(long long)b * nb + x + 1];
    } else {
        *first = (long long)x * R;
        *stop = min((long long)S, *first + R);
    }
}

// The keys [*kbeg, *kend) that queries [first_q, last_q] can see: none after the causal diagonal
// of the last query, none before the window of the first (kbeg rounded down to a tile).
__device__ inline void key_range(long long first_q, long long last_q, int Sk, long long q_off,
                                 long long k_off, int causal, long long window, int tile,
                                 long long* kbeg, long long* kend) {
    *kend = causal ? min((long long)Sk, q_off + last_q - k_off + 1) : (long long)Sk;
    long long j = causal && window ? max(0LL, q_off + first_q - (window - 1) - k_off) : 0LL;
    *kbeg = j - j % tile;
}

// Packed documents (lo, hi: per position [B, S] of this side, the other side's positions
// [lo, hi) of its document; null without documents): the block's rows [first, stop) see only
// [lo[first], hi[stop - 1]) (both bounds grow along a row), so *beg, *end shrink to it; row i
// sees [*rlo, *rhi) (everything without documents).
__device__ inline void doc_keys(const long long* lo, const long long* hi, long long at,
                                long long first, long long stop, long long i, bool row, int S,
                                long long* beg, long long* end, long long* rlo, long long* rhi) {
    *rlo = 0;
    *rhi = S;
    if (!lo) return;
    *beg = max(*beg, lo[at + first]);
    *end = min(*end, hi[at + stop - 1]);
    if (row) { *rlo = lo[at + i]; *rhi = hi[at + i]; }
}

// One warp's rows ((32 / L) consecutive ones: the lanes of a row are adjacent threads) within the
// block's [first, stop): [*w0, *w1] (empty: *w1 < *w0). A warp loops only over what its rows see,
// so the causal square's upper half and the other documents' keys are skipped warp by warp, not
// only block by block; its lanes share the bounds, so the shuffles stay converged.
template<int L> __device__ inline void warp_rows(long long first, long long stop, long long* w0,
                                                 long long* w1) {
    *w0 = first + (long long)(threadIdx.x / 32) * (32 / L);
    *w1 = min(stop, *w0 + 32 / L) - 1;
}

// The keys [*beg, *end) that queries [i0, i1] see (both bounds grow with the query: causal,
// window, document), or with `keys` the queries that keys [i0, i1] are seen by; at: the
// sequence's first entry of lo, hi.
__device__ inline void warp_span(long long i0, long long i1, bool keys, int N, long long q_off,
                                 long long k_off, int causal, long long window,
                                 const long long* lo, const long long* hi, long long at,
                                 long long* beg, long long* end) {
    *beg = 0;
    *end = N;
    if (i1 < i0) { *end = 0; return; }
    if (causal && !keys) {          // keys: kpos <= qpos, and qpos - kpos < window
        *end = min(*end, q_off + i1 - k_off + 1);
        if (window) *beg = max(*beg, q_off + i0 - (window - 1) - k_off);
    } else if (causal) {            // queries: qpos >= kpos, and qpos - kpos < window
        *beg = max(*beg, k_off + i0 - q_off);
        if (window) *end = min(*end, k_off + i1 + window - q_off);
    }
    if (lo) { *beg = max(*beg, lo[at + i0]); *end = min(*end, hi[at + i1]); }
}

// out_i = sum_j p_ij v_j / sum_j p_ij, p_ij = exp(scale q_i.k_j - m_i) (online softmax),
// lse_i = m_i + log sum_j p_ij (-inf and out 0 where no key is visible).
template<typename T, typename A, int D, int L, int BN, int NT>
__global__ void __launch_bounds__(NT, 1) flash_fwd(
        const T* q, const T* k, const T* v, T* out, A* lse, int Sq, int Sk, int Hq, int Hkv,
        long long q_off, long long k_off, int causal, long long window, A scale,
        const long long* lo, const long long* hi, const long long* starts, int nb) {
    constexpr int E = D / L, R = NT / L;
    __shared__ T ks[BN][D];
    __shared__ T vs[BN][D];
    const int lane = threadIdx.x % L, b = blockIdx.y / Hq, h = blockIdx.y % Hq;
    long long first, stop;
    block_rows(starts, nb, b, blockIdx.x, R, Sq, &first, &stop);
    if (first >= stop) return;
    const long long i = first + threadIdx.x / L;
    const bool row = i < stop;
    const long long at_q = (((long long)b * Sq + (row ? i : 0)) * Hq + h) * D;
    const long long kv_base = ((long long)b * Sk * Hkv + h / (Hq / Hkv)) * D;
    A qr[E], o[E];
#pragma unroll
    for (int e = 0; e < E; ++e) { qr[e] = row ? (A)q[at_q + lane + L * e] * scale : (A)0; o[e] = 0; }
    A m = -INFINITY, l = 0;
    long long kbeg, kend, klo, khi;
    key_range(first, stop - 1, Sk, q_off, k_off, causal, window, BN, &kbeg, &kend);
    doc_keys(lo, hi, (long long)b * Sq, first, stop, i, row, Sk, &kbeg, &kend, &klo, &khi);
    long long w0, w1, wbeg, wend;
    warp_rows<L>(first, stop, &w0, &w1);
    warp_span(w0, w1, false, Sk, q_off, k_off, causal, window, lo, hi, (long long)b * Sq, &wbeg,
              &wend);
    for (long long k0 = kbeg; k0 < kend; k0 += BN) {
        load_rows<T, D, BN>(k, ks, kv_base, (long long)Hkv * D, k0, Sk);
        load_rows<T, D, BN>(v, vs, kv_base, (long long)Hkv * D, k0, Sk);
        __syncthreads();
        const int n = (int)min(min((long long)BN, kend - k0), wend - k0);
        for (int jj = (int)max(0LL, wbeg - k0); jj < n; ++jj) {
            A s = 0;
#pragma unroll
            for (int e = 0; e < E; ++e) s += qr[e] * (A)ks[jj][lane + L * e];
            s = lanes_sum<L>(s);
            if (row && visible(i, k0 + jj, q_off, k_off, causal, window) && k0 + jj >= klo
                    && k0 + jj < khi) {
                // One exp a key: the larger of m and s is the new maximum (exp(0) = 1).
                A corr = 1, p = 1;
                if (s > m) { corr = exp(m - s); m = s; } else { p = exp(s - m); }
                l = l * corr + p;
#pragma unroll
                for (int e = 0; e < E; ++e) o[e] = o[e] * corr + p * (A)vs[jj][lane + L * e];
            }
        }
        __syncthreads();
    }
    if (!row) return;
#pragma unroll
    for (int e = 0; e < E; ++e) out[at_q + lane + L * e] = l > 0 ? (T)(o[e] / l) : (T)0;
    if (lane == 0) lse[((long long)b * Hq + h) * Sq + i] = l > 0 ? m + log(l) : -INFINITY;
}

// dq_i = scale * sum_j p_ij (dO_i . v_j - delta_i) k_j, p_ij = exp(scale q_i.k_j - lse_i).
template<typename T, typename A, int D, int L, int BN, int NT>
__global__ void __launch_bounds__(NT, 1) flash_bwd_dq(
        const T* q, const T* k, const T* v, const T* dout, const A* lse, const A* delta, T* dq,
        int Sq, int Sk, int Hq, int Hkv, long long q_off, long long k_off, int causal,
        long long window, A scale, const long long* lo, const long long* hi,
        const long long* starts, int nb) {
    constexpr int E = D / L, R = NT / L;
    __shared__ T ks[BN][D];
    __shared__ T vs[BN][D];
    const int lane = threadIdx.x % L, b = blockIdx.y / Hq, h = blockIdx.y % Hq;
    long long first, stop;
    block_rows(starts, nb, b, blockIdx.x, R, Sq, &first, &stop);
    if (first >= stop) return;
    const long long i = first + threadIdx.x / L;
    const bool row = i < stop;
    const long long at_q = (((long long)b * Sq + (row ? i : 0)) * Hq + h) * D;
    const long long kv_base = ((long long)b * Sk * Hkv + h / (Hq / Hkv)) * D;
    const A lse_i = row ? lse[((long long)b * Hq + h) * Sq + i] : (A)-INFINITY;
    const A delta_i = row ? delta[((long long)b * Hq + h) * Sq + i] : (A)0;
    const bool live = row && isfinite(lse_i);
    A qr[E], dor[E], acc[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        qr[e] = row ? (A)q[at_q + lane + L * e] * scale : (A)0;
        dor[e] = row ? (A)dout[at_q + lane + L * e] : (A)0;
        acc[e] = 0;
    }
    long long kbeg, kend, klo, khi;
    key_range(first, stop - 1, Sk, q_off, k_off, causal, window, BN, &kbeg, &kend);
    doc_keys(lo, hi, (long long)b * Sq, first, stop, i, row, Sk, &kbeg, &kend, &klo, &khi);
    long long w0, w1, wbeg, wend;
    warp_rows<L>(first, stop, &w0, &w1);
    warp_span(w0, w1, false, Sk, q_off, k_off, causal, window, lo, hi, (long long)b * Sq, &wbeg,
              &wend);
    for (long long k0 = kbeg; k0 < kend; k0 += BN) {
        load_rows<T, D, BN>(k, ks, kv_base, (long long)Hkv * D, k0, Sk);
        load_rows<T, D, BN>(v, vs, kv_base, (long long)Hkv * D, k0, Sk);
        __syncthreads();
        const int n = (int)min(min((long long)BN, kend - k0), wend - k0);
        for (int jj = (int)max(0LL, wbeg - k0); jj < n; ++jj) {
            A s = 0, dp = 0;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                s += qr[e] * (A)ks[jj][lane + L * e];
                dp += dor[e] * (A)vs[jj][lane + L * e];
            }
            s = lanes_sum<L>(s);
            dp = lanes_sum<L>(dp);
            if (live && visible(i, k0 + jj, q_off, k_off, causal, window) && k0 + jj >= klo
                    && k0 + jj < khi) {
                A ds = exp(s - lse_i) * (dp - delta_i);
#pragma unroll
                for (int e = 0; e < E; ++e) acc[e] += ds * (A)ks[jj][lane + L * e];
            }
        }
        __syncthreads();
    }
    if (!row) return;
#pragma unroll
    for (int e = 0; e < E; ++e) dq[at_q + lane + L * e] = (T)(acc[e] * scale);
}

// One key row j of kv head hk, over the G query heads h of its group and their rows i:
// dv_j = sum p_ij dO_i, dk_j = scale * sum p_ij (dO_i . v_j - delta_i) q_i.
template<typename T, typename A, int D, int L, int BM, int NT>
__global__ void __launch_bounds__(NT, 1) flash_bwd_dkdv(
        const T* q, const T* k, const T* v, const T* dout, const A* lse, const A* delta, T* dk,
        T* dv, int Sq, int Sk, int Hq, int Hkv, long long q_off, long long k_off, int causal,
        long long window, A scale, const long long* lo, const long long* hi,
        const long long* starts, int nb) {
    constexpr int E = D / L, R = NT / L;
    __shared__ T qs[BM][D];
    __shared__ T dos[BM][D];
    __shared__ A ls[BM];
    __shared__ A dls[BM];
    const int lane = threadIdx.x % L, b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv, G = Hq / Hkv;
    long long first_k, stop_k;
    block_rows(starts, nb, b, blockIdx.x, R, Sk, &first_k, &stop_k);
    if (first_k >= stop_k) return;
    const long long j = first_k + threadIdx.x / L;
    const bool row = j < stop_k;
    const long long at_k = (((long long)b * Sk + (row ? j : 0)) * Hkv + hk) * D;
    A kr[E], vr[E], dka[E], dva[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        kr[e] = row ? (A)k[at_k + lane + L * e] : (A)0;
        vr[e] = row ? (A)v[at_k + lane + L * e] : (A)0;
        dka[e] = 0;
        dva[e] = 0;
    }
    // Queries before the block's first key see none of its keys; with a window, neither do the
    // queries from the block's last key + window on.
    const long long last_k = stop_k - 1;
    long long qbeg = causal ? max(0LL, k_off + first_k - q_off) : 0LL;
    long long qend = causal && window ? min((long long)Sq, k_off + last_k + window - q_off)
                                      : (long long)Sq;
    long long qlo, qhi;     // packed documents: the queries of key j's document
    doc_keys(lo, hi, (long long)b * Sk, first_k, stop_k, j, row, Sq, &qbeg, &qend, &qlo, &qhi);
    long long w0, w1, wbeg, wend;
    warp_rows<L>(first_k, stop_k, &w0, &w1);
    warp_span(w0, w1, true, Sq, q_off, k_off, causal, window, lo, hi, (long long)b * Sk, &wbeg,
              &wend);
    for (int g = 0; g < G; ++g) {
        const int h = hk * G + g;
        const long long q_base = ((long long)b * Sq * Hq + h) * D, st = (long long)b * Hq + h;
        for (long long i0 = qbeg - qbeg % BM; i0 < qend; i0 += BM) {
            load_rows<T, D, BM>(q, qs, q_base, (long long)Hq * D, i0, Sq);
            load_rows<T, D, BM>(dout, dos, q_base, (long long)Hq * D, i0, Sq);
            for (int e = threadIdx.x; e < BM; e += blockDim.x) {
                ls[e] = i0 + e < Sq ? lse[st * Sq + i0 + e] : (A)-INFINITY;
                dls[e] = i0 + e < Sq ? delta[st * Sq + i0 + e] : (A)0;
            }
            __syncthreads();
            const int n = (int)min(min((long long)BM, qend - i0), wend - i0);
            for (int ii = (int)max(0LL, wbeg - i0); ii < n; ++ii) {
                A s = 0, dp = 0;
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    s += (A)qs[ii][lane + L * e] * kr[e];
                    dp += (A)dos[ii][lane + L * e] * vr[e];
                }
                s = lanes_sum<L>(s);
                dp = lanes_sum<L>(dp);
                if (row && isfinite(ls[ii]) && visible(i0 + ii, j, q_off, k_off, causal, window)
                        && i0 + ii >= qlo && i0 + ii < qhi) {
                    A p = exp(s * scale - ls[ii]), dsv = p * (dp - dls[ii]);
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        dva[e] += p * (A)dos[ii][lane + L * e];
                        dka[e] += dsv * (A)qs[ii][lane + L * e];
                    }
                }
            }
            __syncthreads();
        }
    }
    if (!row) return;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        dk[at_k + lane + L * e] = (T)(dka[e] * scale);
        dv[at_k + lane + L * e] = (T)dva[e];
    }
}
"""

_FLASH_KERNELS = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv")
_MAX_PER_LANE = {4: 16, 8: 8}
"""Elements of a row vector one lane keeps in registers, float32 and float64: the flash_bwd_dkdv
kernel keeps four such arrays (k, v, dk, dv), 64 registers of values at most."""
_TILE_BYTES = 16384
"""Bytes of one shared-memory tile (K or V; Q or dO): two tiles stay within 32 KiB."""


def flash_config(head_dim: int, itemsize: int) -> tuple[int, int]:
    """(lanes per row, rows per shared-memory tile) of the flash kernels for a head width and an
    element size (4 or 8): the fewest lanes (a power of two <= 32 dividing head_dim) that keep
    at most `_MAX_PER_LANE` elements each, and as many tile rows (<= 64) as fit `_TILE_BYTES`.
    Pure: no CuPy."""
    require(head_dim in HEAD_DIMS, f"head_dim={head_dim} must be one of {HEAD_DIMS} on the GPU")
    lanes = 1
    while (head_dim // lanes > _MAX_PER_LANE[itemsize] and head_dim % (2 * lanes) == 0
           and lanes < 32):
        lanes *= 2
    return lanes, min(64, _TILE_BYTES // (head_dim * itemsize))


def _flash_names(ctype: str, head_dim: int) -> tuple[str, ...]:
    """Name expressions of one flash module: forward, dq and dk/dv for one (C type, head_dim)."""
    lanes, tile = flash_config(head_dim, 8 if ctype == "double" else 4)
    return tuple(f"{k}<{ctype},{ctype},{head_dim},{lanes},{tile},{_THREADS}>"
                 for k in _FLASH_KERNELS)


@functools.cache
def _flash_module(ctype: str, head_dim: int) -> Any:
    """The flash RawModule of one (C type, head_dim), compiled on first use (a second or less;
    every instantiation in one module took 36.5 s)."""
    return array_module().RawModule(code=_FLASH, options=_OPTIONS,
                                    name_expressions=_flash_names(ctype, head_dim))


def _flash(name: str, dtype: Any, head_dim: int) -> tuple[Any, int]:
    """(the kernel `name` for this dtype and head width, rows per block)."""
    require(head_dim in HEAD_DIMS, f"{name}: head_dim={head_dim} must be one of {HEAD_DIMS} "
                                   f"on the GPU")
    ctype = _ctype(dtype)
    names = _flash_names(ctype, head_dim)
    lanes = flash_config(head_dim, 8 if ctype == "double" else 4)[0]
    return _flash_module(ctype, head_dim).get_function(names[_FLASH_KERNELS.index(name)]), \
        _THREADS // lanes


def _flash_args(q: Array, k: Array, q_offset: int, k_offset: int, causal: bool,
                scale: float | None, acc: Any, window: int = 0) -> tuple:
    cupy = array_module()
    b, sq, hq, d = q.shape
    return (cupy.int32(sq), cupy.int32(k.shape[1]), cupy.int32(hq), cupy.int32(k.shape[2]),
            cupy.int64(q_offset), cupy.int64(k_offset), cupy.int32(bool(causal)),
            cupy.int64(window), acc.type(ref.attention_scale(d, scale)))


def _documents(mine: Array | None, other: Array | None, b: int, n: int, n_other: int,
               rows: int) -> tuple[tuple, int]:
    """The packed-document arguments of a flash kernel whose blocks cut this side's n positions
    (document ids ``mine`` `[B, n]`, the other side's ``other`` `[B, n_other]`; host or device
    arrays, non-decreasing along each row): ((lo, hi, starts, nb), blocks per sequence). lo, hi
    `[B, n]`: the other side's positions [lo, hi) of each position's document; starts: blocks of
    at most ``rows`` positions aligned to document starts (`attention_cpu.document_blocks`, the
    CPU kernels' own cut), so that a short document is one small tile and a block reads only its
    documents' keys. Without documents: null pointers and the fixed grid of ``rows``-row blocks."""
    cupy = array_module()
    if mine is None and other is None:
        return (cupy.uint64(0), cupy.uint64(0), cupy.uint64(0), cupy.int32(0)), -(-n // rows)
    from .attention_cpu import document_blocks, document_bounds

    host = [None if a is None else (cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a)
            for a in (mine, other)]
    lo, hi, end = document_bounds(host[0], host[1], b, n, n_other)
    starts, nblocks = document_blocks(end, rows)
    return ((cupy.asarray(lo), cupy.asarray(hi), cupy.asarray(starts), cupy.int32(starts.shape[1])),
            max(1, int(nblocks.max(initial=0))))


def attention_fwd(q: Array, k: Array, v: Array, q_offset: int = 0, k_offset: int = 0,
                  causal: bool = True, scale: float | None = None, window: int = 0,
                  q_docs: Array | None = None, k_docs: Array | None = None) -> tuple[Array, Array]:
    """Flash attention forward (`numpy_ref.attention_fwd`'s contract, sliding `window` and
    packed documents included: ids `q_docs` `[B, Sq]`, `k_docs` `[B, Sk]`, non-decreasing along
    each row): q `[B, Sq, Hq, D]`, k, v `[B, Sk, Hkv, D]` -> out like q, lse `[B, Hq, Sq]`
    (float32; float64 for float64). Key tiles wholly outside a block's keys are not loaded; with
    documents the query blocks follow them (`_documents`), so a row of short documents costs
    about its documents' own causal squares, in one launch."""
    ref.check_attention_shapes(q, k, v, "attention_fwd")
    ref.check_window(window, causal, "attention_fwd")
    _device_float(q, "attention_fwd")
    cupy = array_module()
    q, k, v = (cupy.ascontiguousarray(a, q.dtype) for a in (q, k, v))
    b, sq, hq, d = q.shape
    acc = cupy.dtype(ref.stat_dtype(q.dtype))
    out, lse = cupy.empty_like(q), cupy.empty((b, hq, sq), acc)
    if sq and b * hq:
        kernel, rows = _flash("flash_fwd", q.dtype, d)
        docs, blocks = _documents(q_docs, k_docs, b, sq, k.shape[1], rows)
        kernel((blocks, b * hq), (_THREADS,), (
            q, k, v, out, lse, *_flash_args(q, k, q_offset, k_offset, causal, scale, acc, window),
            *docs))
    return out, lse


def attention_bwd(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                  q_offset: int = 0, k_offset: int = 0, causal: bool = True,
                  scale: float | None = None, window: int = 0, q_docs: Array | None = None,
                  k_docs: Array | None = None) -> tuple[Array, Array, Array]:
    """Flash attention backward for one key block given the (possibly ring-merged) out and lse
    (`numpy_ref.attention_bwd`'s contract, packed documents included): q, out, dout
    `[B, Sq, Hq, D]`, k, v `[B, Sk, Hkv, D]`, lse `[B, Hq, Sq]` -> dq like q, dk, dv like k; dq
    by query rows, dk and dv by key rows (summed over each kv head's query heads), without
    atomics; with documents, blocks of query rows and of key rows that follow them."""
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
    delta = cupy.ascontiguousarray((dout.astype(acc) * cupy.asarray(out).astype(acc)).sum(axis=-1)
                                   .transpose(0, 2, 1))  # [B, Hq, Sq]
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    args = _flash_args(q, k, q_offset, k_offset, causal, scale, acc, window)
    if sq and b * hq:
        kernel, rows = _flash("flash_bwd_dq", q.dtype, d)
        docs, blocks = _documents(q_docs, k_docs, b, sq, k.shape[1], rows)
        kernel((blocks, b * hq), (_THREADS,), (q, k, v, dout, lse, delta, dq, *args, *docs))
    if k.shape[1] and b * k.shape[2]:
        kernel, rows = _flash("flash_bwd_dkdv", q.dtype, d)
        docs, blocks = _documents(k_docs, q_docs, b, k.shape[1], sq, rows)
        kernel((blocks, b * k.shape[2]), (_THREADS,),
               (q, k, v, dout, lse, delta, dk, dv, *args, *docs))
    return dq, dk, dv


attention_fwd.block_sparse_documents = attention_bwd.block_sparse_documents = True


# ----------------------------------------------------------------------------- compile gate
def cuda_sources() -> list[dict]:
    """Every CUDA source of this module with every instantiation it launches, for
    `mpipar.kernels.cuda_gate`: the rows module and one flash module per (dtype, head_dim),
    each {"name", "code", "names", "options", "dynamic_smem"} (bytes launched with). Pure."""
    rows = {"name": "cupy_gpu.rows", "code": _ROWS, "names": _rows_names(), "options": _OPTIONS,
            "dynamic_smem": {n: (_THREADS * (8 if "double" in n else 4)
                                 if n.split("<")[0] in ("rmsnorm_fwd", "rmsnorm_bwd", "ce_stats")
                                 else 0) for n in _rows_names()}}
    flash = [{"name": f"cupy_gpu.flash<{t},{d}>", "code": _FLASH, "names": _flash_names(t, d),
              "options": _OPTIONS, "dynamic_smem": {n: 0 for n in _flash_names(t, d)}}
             for t in ("float", "double") for d in HEAD_DIMS]
    return [rows, *flash]
