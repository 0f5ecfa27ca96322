"""GPU kernels on CuPy arrays for float32 and float64, written to mirror `numpy_ref`'s signatures.

These are the exactness kernels (float64 layouts on a GPU equal the CPU's to 1e-10 and better);
the bf16 tensor-core kernels live beside them. Every CUDA source here is a CuPy ``RawModule``
(:func:`cuda_sources` hands them to the compile gate, `mpipar.kernels.cuda_gate`):

- the rows module: RMSNorm forward/backward and the vocabulary-parallel cross-entropy
  statistics (one block per row), SwiGLU forward/backward and RoPE (grid-stride elementwise);
- flash attention forward and backward (`flash_exact`, this backend's attention, as
  `attention_cpu` is `numba_cpu`'s): ring offsets, windows, packed documents, grouped-query
  heads.

matmuls (linear layers) are `numpy_ref`'s generic code on CuPy arrays (cuBLAS through
``cupy.matmul``; `mpipar.kernels.cublas` is the explicit wrapper). Importing this module never
imports CuPy: that happens on first use, so the package imports cleanly without CuPy or a GPU
(`unavailable_reason` says why).
"""
from __future__ import annotations

import functools
from typing import Any


from . import flash_exact
from . import numpy_ref as ref
from .cupy_arrays import array_module, ctype as _ctype, device_float as _device_float
from .cupy_arrays import unavailable_reason  # noqa: F401  (the backend's probe)
from .flash_exact import HEAD_DIMS, attention_bwd, attention_fwd  # noqa: F401  (this backend's attention)
from .numpy_ref import Array, require

# Ops implemented in this module (the dispatcher uses numpy_ref's generic code for the others).
IMPLEMENTED: tuple[str, ...] = ("rope_cos_sin", "rope_fwd", "rope_bwd", "swiglu_fwd", "swiglu_bwd",
                                 "rmsnorm_fwd", "rmsnorm_bwd", "attention_fwd", "attention_bwd",
                                 "cross_entropy_stats")

_OPTIONS: tuple[str, ...] = ("--std=c++17",)
"""NVRTC options of every RawModule here (CuPy adds its own; see `cuda_gate`)."""
_THREADS = 256
"""Threads per block of every kernel here (the flash kernels' NT template argument)."""


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


# ----------------------------------------------------------------------------- compile gate
def cuda_sources() -> list[dict]:
    """Every CUDA source of this module with every instantiation it launches, for
    `mpipar.kernels.cuda_gate`: the rows module and `flash_exact`'s flash modules, each
    {"name", "code", "names", "options", "dynamic_smem"} (bytes launched with). Pure."""
    rows = {"name": "cupy_gpu.rows", "code": _ROWS, "names": _rows_names(), "options": _OPTIONS,
            "dynamic_smem": {n: (_THREADS * (8 if "double" in n else 4)
                                 if n.split("<")[0] in ("rmsnorm_fwd", "rmsnorm_bwd", "ce_stats")
                                 else 0) for n in _rows_names()}}
    return [rows, *flash_exact.cuda_sources()]

