"""Fused bf16 GPU kernels: bf16 in and out, float32 math and statistics (the bf16 contract).

One CUDA module (`_SOURCE`, a CuPy `RawModule` compiled on first use), 16-byte loads of 8 bf16
where the row length and pointers allow (else 8, 4 or 2 bytes; every kernel is instantiated for
each width):
- (add +) RMSNorm forward and backward: a block loops over whole rows; thread t owns the vectors
  t, t + T, ... of each row, the first `_MAXV` kept in registers (a row is read once). dw: per
  block partials `[blocks, H]` summed in registers, reduced by a second kernel in a fixed order;
  no float atomics and a block count fixed by the shape, so dw is bit-identical run to run;
- RoPE (float32 cos/sin `[S, D/2]` as `numpy_ref.rope_cos_sin` makes them); SwiGLU;
- vocabulary-parallel cross-entropy: per-row max, sum of exp and target logit in one pass over
  the bf16 logits (online max/sum); bf16 dlogits = (softmax - onehot) * dloss from the global lse;
- embedding backward into float32 dw by row ownership: sorting the unique keys id * tokens +
  token makes each id a run in token order, whose first token owns row id and adds the run's rows
  in token order (numpy_ref's float32 `add.at` order, bit for bit); no atomics.
Arguments mirror numpy_ref's, validated with its messages; arrays are CuPy arrays of the
contract's dtypes (bf16: `ml_dtypes.bfloat16`; statistics float32). Importing this module never
imports CuPy. `cuda_sources()` lists the source and every instantiation for the compile gate.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import numpy_ref as ref
from .numpy_ref import Array, require

IMPLEMENTED: tuple[str, ...] = ("rmsnorm_fwd", "rmsnorm_bwd", "add_rmsnorm_fwd", "add_rmsnorm_bwd",
                                "rope_fwd", "rope_bwd", "swiglu_fwd", "swiglu_bwd", "embedding_bwd",
                                "cross_entropy_stats", "cross_entropy_bwd")

_WIDTHS = (8, 4, 2, 1)  # bf16 a thread loads at once (16 ... 2 bytes): the widest the shape allows
_MAXV = 4  # vectors of a row a thread keeps in registers in the RMSNorm kernels (CUDA's MAXV)
_ROW_THREADS = 512  # most threads of a RMSNorm block (the kernels' __launch_bounds__)
_FWD_BLOCKS = 2048  # most blocks of the RMSNorm forward (each loops over rows)
_DW_PARTS = 512  # blocks (= dw partials) of the RMSNorm backward: min(rows, this), a constant so
#                  that dw's summation order, hence its bits, depend only on the shape
_CE_THREADS = _EW_THREADS = 256
_EMB_THREADS = 128
_OPTIONS = ("--std=c++17",)

# Device helpers: what needs the GPU's own instructions is here, so that a host emulation of the
# kernels can put its own definitions in place of this part.
_DEVICE_PRELUDE = r"""
#define MPIPAR_INF __int_as_float(0x7f800000)
typedef unsigned short bf16;  // raw bfloat16 bits
// Two floats to two bf16 (round to nearest even) in one word, lo in the low half.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ unsigned short to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float warp_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
"""

_KERNELS = r"""
constexpr int MAXV = 4;  // vectors of a row a thread keeps in registers (RMSNorm)

// V bf16 as raw words: element j is the low (j even) or high half of word j / 2.
template<int V> struct Raw {
    unsigned w[V > 1 ? V / 2 : 1];
    __device__ __forceinline__ float get(int j) const {
        const unsigned u = w[j >> 1];
        return __uint_as_float((j & 1) ? (u & 0xffff0000u) : (u << 16));
    }
};

template<int V> __device__ __forceinline__ Raw<V> load_bf(const bf16* p) {  // p: 2V-byte aligned
    Raw<V> r;
    if constexpr (V == 8) {
        const uint4 t = *reinterpret_cast<const uint4*>(p);
        r.w[0] = t.x; r.w[1] = t.y; r.w[2] = t.z; r.w[3] = t.w;
    } else if constexpr (V == 4) {
        const uint2 t = *reinterpret_cast<const uint2*>(p);
        r.w[0] = t.x; r.w[1] = t.y;
    } else {
        r.w[0] = V == 2 ? *reinterpret_cast<const unsigned*>(p) : *p;
    }
    return r;
}

template<int V> __device__ __forceinline__ void store_bf(bf16* p, const Raw<V>& r) {
    if constexpr (V == 8) *reinterpret_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
    else if constexpr (V == 4) *reinterpret_cast<uint2*>(p) = make_uint2(r.w[0], r.w[1]);
    else if constexpr (V == 2) *reinterpret_cast<unsigned*>(p) = r.w[0];
    else *p = (bf16)r.w[0];
}

template<int V> __device__ __forceinline__ Raw<V> pack_bf(const float* f) {
    Raw<V> r;
    if constexpr (V == 1) r.w[0] = to_bf16(f[0]);
#pragma unroll
    for (int j = 0; j < V / 2; ++j) r.w[j] = pack_bf16x2(f[2 * j], f[2 * j + 1]);
    return r;
}

// V floats at p (8-byte aligned if V > 1) to f, and back.
template<int V> __device__ __forceinline__ void load_f32(const float* p, float* f) {
    if constexpr (V == 1) f[0] = *p;
#pragma unroll
    for (int q = 0; q < V / 2; ++q) {
        const float2 t = reinterpret_cast<const float2*>(p)[q];
        f[2 * q] = t.x; f[2 * q + 1] = t.y;
    }
}

template<int V> __device__ __forceinline__ void store_f32(float* p, const float* f) {
    if constexpr (V == 1) *p = f[0];
#pragma unroll
    for (int q = 0; q < V / 2; ++q)
        reinterpret_cast<float2*>(p)[q] = make_float2(f[2 * q], f[2 * q + 1]);
}

// Sum over the block (blockDim.x a multiple of 32), the same bits in every thread; sh: 32 floats.
__device__ __forceinline__ float block_sum(float v, float* sh) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += warp_xor(v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) t += sh[i];
    return t;
}

// (m, s) <- max and sum of exp(. - max) of two sets' union (an empty set: -inf, 0); symmetric.
__device__ __forceinline__ void ms_merge(float& m, float& s, float m2, float s2) {
    const float mx = fmaxf(m, m2);
    s = mx == -MPIPAR_INF ? 0.f : s * __expf(m - mx) + s2 * __expf(m2 - mx);
    m = mx;
}

__device__ __forceinline__ void block_ms(float& m, float& s, float* shm, float* shs) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = warp_xor(m, o), s2 = warp_xor(s, o);
        ms_merge(m, s, m2, s2);
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) { shm[threadIdx.x >> 5] = m; shs[threadIdx.x >> 5] = s; }
    __syncthreads();
    m = shm[0]; s = shs[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); ++i) ms_merge(m, s, shm[i], shs[i]);
}

// ------------------------------------------------------------------------------- RMSNorm
// The row input at off: x, or with ADD s = bf16(x + r), also written to s_out.
template<int V, bool ADD>
__device__ __forceinline__ Raw<V> row_input(const bf16* x, const bf16* r, bf16* s_out, long long off) {
    Raw<V> a = load_bf<V>(x + off);
    if constexpr (ADD) {
        const Raw<V> b = load_bf<V>(r + off);
        float f[V];
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = a.get(j) + b.get(j);
        a = pack_bf<V>(f);
        store_bf<V>(s_out + off, a);
    }
    return a;
}

template<int V> __device__ __forceinline__ float sum_sq(const Raw<V>& a) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) t += a.get(j) * a.get(j);
    return t;
}

template<int V> __device__ __forceinline__ Raw<V> scale_w(const Raw<V>& a, const Raw<V>& w, float rs) {
    float f[V];
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = a.get(j) * rs * w.get(j);
    return pack_bf<V>(f);
}

// y = bf16(s * rstd * w), rstd = 1 / sqrt(mean(s^2) + eps) per row of H = nvec * V, with s = x,
// or s = bf16(x + r) written to s_out (ADD). A block does rows blockIdx.x + k * gridDim.x;
// thread t the vectors t + k * blockDim.x of each (the first MAXV cached in registers).
template<int V, bool ADD>
__global__ void __launch_bounds__(512, 1)
mpipar_rms_fwd(const bf16* __restrict__ x, const bf16* __restrict__ r, const bf16* __restrict__ w,
               bf16* __restrict__ y, bf16* __restrict__ s_out, float* __restrict__ rstd,
               long long rows, int H, float eps) {
    __shared__ float sh[32];
    const int nvec = H / V, T = blockDim.x, tid = threadIdx.x;
    Raw<V> wc[MAXV], xc[MAXV];
#pragma unroll
    for (int k = 0; k < MAXV; ++k)
        if (tid + k * T < nvec) wc[k] = load_bf<V>(w + (long long)(tid + k * T) * V);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = row * H;
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < MAXV; ++k)  // every load issued before any is used
            if (const int i = tid + k * T; i < nvec)
                xc[k] = row_input<V, ADD>(x, r, s_out, base + (long long)i * V);
#pragma unroll
        for (int k = 0; k < MAXV; ++k) ss += tid + k * T < nvec ? sum_sq<V>(xc[k]) : 0.f;
        for (int i = tid + MAXV * T; i < nvec; i += T)
            ss += sum_sq<V>(row_input<V, ADD>(x, r, s_out, base + (long long)i * V));
        const float rs = 1.f / sqrtf(block_sum(ss, sh) / (float)H + eps);
        if (tid == 0) rstd[row] = rs;
#pragma unroll
        for (int k = 0; k < MAXV; ++k)
            if (const int i = tid + k * T; i < nvec)
                store_bf<V>(y + base + (long long)i * V, scale_w<V>(xc[k], wc[k], rs));
        for (int i = tid + MAXV * T; i < nvec; i += T) {
            const long long off = base + (long long)i * V;
            const Raw<V> s = load_bf<V>((ADD ? s_out : x) + off);
            store_bf<V>(y + off, scale_w<V>(s, load_bf<V>(w + (long long)i * V), rs));
        }
    }
}

template<int V>
__device__ __forceinline__ float dot_gwx(const Raw<V>& g, const Raw<V>& w, const Raw<V>& x) {
    float t = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) t += g.get(j) * w.get(j) * x.get(j);
    return t;
}

// dx = bf16(rs * g*w - c * x [+ ds]) for one vector; acc += g * x * rs (this thread's dw part).
template<int V, bool ADD>
__device__ __forceinline__ void rms_grad(const Raw<V>& g, const Raw<V>& w, const Raw<V>& x,
                                         const bf16* ds, bf16* dx, long long off, float rs,
                                         float c, float* acc) {
    float f[V];
    Raw<V> d;
    if constexpr (ADD) d = load_bf<V>(ds + off);
#pragma unroll
    for (int j = 0; j < V; ++j) {
        f[j] = rs * (g.get(j) * w.get(j)) - c * x.get(j);
        if constexpr (ADD) f[j] += d.get(j);
        acc[j] += g.get(j) * x.get(j) * rs;
    }
    store_bf<V>(dx + off, pack_bf<V>(f));
}

// Backward of mpipar_rms_fwd for rows blockIdx.x + k * gridDim.x: dx = bf16(rstd * dy*w -
// rstd^3 * x * mean(dy*w*x) [+ ds]); part[blockIdx.x][c] = sum over the block's rows, in row
// order, of dy*x*rstd (every column written).
template<int V, bool ADD>
__global__ void __launch_bounds__(512, 1)
mpipar_rms_bwd(const bf16* __restrict__ dy, const bf16* __restrict__ ds, const bf16* __restrict__ x,
               const bf16* __restrict__ w, const float* __restrict__ rstd, bf16* __restrict__ dx,
               float* __restrict__ part, long long rows, int H) {
    __shared__ float sh[32];
    const int nvec = H / V, T = blockDim.x, tid = threadIdx.x;
    float* pr = part + (long long)blockIdx.x * H;
    Raw<V> xc[MAXV], gc[MAXV];  // w is read per row (from L1): caching it too would spill
    float acc[MAXV][V] = {};
    const float zero[V] = {};
    for (int i = tid + MAXV * T; i < nvec; i += T) store_f32<V>(pr + (long long)i * V, zero);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = row * H;
        const float rs = rstd[row];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < MAXV; ++k)  // every load issued before any is used
            if (const int i = tid + k * T; i < nvec)
                xc[k] = load_bf<V>(x + base + (long long)i * V),
                gc[k] = load_bf<V>(dy + base + (long long)i * V);
#pragma unroll
        for (int k = 0; k < MAXV; ++k)
            if (const int i = tid + k * T; i < nvec)
                dot += dot_gwx<V>(gc[k], load_bf<V>(w + (long long)i * V), xc[k]);
        for (int i = tid + MAXV * T; i < nvec; i += T) {
            const long long off = base + (long long)i * V;
            dot += dot_gwx<V>(load_bf<V>(dy + off), load_bf<V>(w + (long long)i * V),
                              load_bf<V>(x + off));
        }
        const float c = rs * rs * rs * (block_sum(dot, sh) / (float)H);
#pragma unroll
        for (int k = 0; k < MAXV; ++k)
            if (const int i = tid + k * T; i < nvec)
                rms_grad<V, ADD>(gc[k], load_bf<V>(w + (long long)i * V), xc[k], ds, dx,
                                 base + (long long)i * V, rs, c, acc[k]);
        for (int i = tid + MAXV * T; i < nvec; i += T) {
            const long long off = base + (long long)i * V;
            float p[V];
            load_f32<V>(pr + (long long)i * V, p);
            rms_grad<V, ADD>(load_bf<V>(dy + off), load_bf<V>(w + (long long)i * V),
                             load_bf<V>(x + off), ds, dx, off, rs, c, p);
            store_f32<V>(pr + (long long)i * V, p);
        }
    }
#pragma unroll
    for (int k = 0; k < MAXV; ++k)
        if (tid + k * T < nvec) store_f32<V>(pr + (long long)(tid + k * T) * V, acc[k]);
}

// dw[c] = sum over p < parts of part[p][c]: 32 columns a block of 32 * G threads; group g sums
// parts g, g + G, ... in order, then the groups are summed in order.
template<int G>
__global__ void __launch_bounds__(32 * G)
mpipar_dw_reduce(const float* __restrict__ part, float* __restrict__ dw, int parts, int H) {
    __shared__ float sh[G][33];
    const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    const long long col = (long long)blockIdx.x * 32 + lane;
    float a = 0.f;
    for (int p = grp; p < parts && col < H; p += G) a += part[(long long)p * H + col];
    sh[grp][lane] = a;
    __syncthreads();
    if (grp == 0 && col < H) {
        float t = 0.f;
#pragma unroll
        for (int g = 0; g < G; ++g) t += sh[g][lane];
        dw[col] = t;
    }
}

// ---------------------------------------------------------------------------------- RoPE
// Pairs (x[.., p], x[.., p + half]) of x [B*S, heads, 2*half], a block per position (b, s) and a
// thread per V pairs: y1 = x1*c - x2*sgn*sn, y2 = x2*c + x1*sgn*sn (sgn = -1: the inverse
// rotation), c, sn = cos, sin [s, p .. p + V) of the tables [S, half].
template<int V>
__global__ void __launch_bounds__(256)
mpipar_rope(const bf16* __restrict__ x, const float* __restrict__ cosv,
            const float* __restrict__ sinv, bf16* __restrict__ y, long long S, int heads, int half,
            float sgn) {
    const long long bs = blockIdx.x, s = bs % S;
    const int hv = half / V;
    for (int t = threadIdx.x; t < heads * hv; t += blockDim.x) {
        const int h = t / hv, p = (t - h * hv) * V;
        const long long a = (bs * heads + h) * 2 * half + p;
        const Raw<V> x1 = load_bf<V>(x + a), x2 = load_bf<V>(x + a + half);
        float c[V], n[V], y1[V], y2[V];
        load_f32<V>(cosv + s * half + p, c), load_f32<V>(sinv + s * half + p, n);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const float u = x1.get(j), v = x2.get(j), sn = sgn * n[j];
            y1[j] = u * c[j] - v * sn;
            y2[j] = v * c[j] + u * sn;
        }
        store_bf<V>(y + a, pack_bf<V>(y1)), store_bf<V>(y + a + half, pack_bf<V>(y2));
    }
}

// -------------------------------------------------------------------------------- SwiGLU
// sigmoid(g) and 1 - sigmoid(g), exp taken of -|g| only (no overflow, no cancellation).
__device__ __forceinline__ void sigmoid2(float g, float& sig, float& rest) {
    const float e = expf(-fabsf(g)), a = 1.f / (1.f + e), b = e * a;
    sig = g >= 0.f ? a : b;
    rest = g >= 0.f ? b : a;
}

// Forward: o1 = bf16(g * sig * u) (dh, o2 unused); backward (BWD): o1 = dgate = bf16(dh * u * sig *
// (1 + g * (1 - sig))), o2 = dup = bf16(dh * g * sig). nvec vectors of V.
template<int V, bool BWD>
__global__ void __launch_bounds__(256)
mpipar_swiglu(const bf16* __restrict__ dh, const bf16* __restrict__ g, const bf16* __restrict__ u,
              bf16* __restrict__ o1, bf16* __restrict__ o2, long long nvec) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nvec) return;
    const Raw<V> gv = load_bf<V>(g + i * V), uv = load_bf<V>(u + i * V);
    Raw<V> hv;
    if constexpr (BWD) hv = load_bf<V>(dh + i * V);
    float f1[V], f2[V], sig, rest;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const float gj = gv.get(j);
        sigmoid2(gj, sig, rest);
        if constexpr (BWD) {
            f1[j] = hv.get(j) * uv.get(j) * sig * (1.f + gj * rest);
            f2[j] = hv.get(j) * (gj * sig);
        } else {
            f1[j] = gj * sig * uv.get(j);
        }
    }
    store_bf<V>(o1 + i * V, pack_bf<V>(f1));
    if constexpr (BWD) store_bf<V>(o2 + i * V, pack_bf<V>(f2));
}

// --------------------------------------------------------------------------- cross-entropy
constexpr int CE_UNROLL = 4;
// Element j of the vector at column c0 of a row, or -inf past the nvalid real columns.
template<int V>
__device__ __forceinline__ float masked(const Raw<V>& r, int c0, int j, int nvalid) {
    return c0 + j < nvalid ? r.get(j) : -MPIPAR_INF;
}

// One block per row of logits [N, cols] (the first nvalid columns real): m = max, s = sum exp(l - m)
// (online, one rescale per CE_UNROLL vectors), t = the logit of targets[row] - vocab_start if in
// [0, nvalid) else 0.
template<int V>
__global__ void __launch_bounds__(256)
mpipar_ce_stats(const bf16* __restrict__ logits, const long long* __restrict__ targets,
                float* __restrict__ m_out, float* __restrict__ s_out, float* __restrict__ t_out,
                int cols, int nvalid, long long vocab_start) {
    __shared__ float shm[32], shs[32];
    const long long row = blockIdx.x;
    const bf16* lr = logits + row * cols;
    const int nv = (nvalid + V - 1) / V, T = blockDim.x;
    float m = -MPIPAR_INF, s = 0.f;
    for (int i0 = threadIdx.x; i0 < nv; i0 += T * CE_UNROLL) {  // CE_UNROLL loads in flight
        Raw<V> r[CE_UNROLL];
        float vmax = -MPIPAR_INF, e = 0.f;
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u)
            if (i0 + u * T < nv) r[u] = load_bf<V>(lr + (i0 + u * T) * V);
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u)
#pragma unroll
            for (int j = 0; j < V && i0 + u * T < nv; ++j)
                vmax = fmaxf(vmax, masked<V>(r[u], (i0 + u * T) * V, j, nvalid));
        if (vmax == -MPIPAR_INF) continue;
        const float mn = fmaxf(m, vmax);
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u)
#pragma unroll
            for (int j = 0; j < V && i0 + u * T < nv; ++j)
                e += __expf(masked<V>(r[u], (i0 + u * T) * V, j, nvalid) - mn);
        s = s * __expf(m - mn) + e;
        m = mn;
    }
    block_ms(m, s, shm, shs);
    if (threadIdx.x == 0) {
        const long long local = targets[row] - vocab_start;
        m_out[row] = m, s_out[row] = s;
        t_out[row] = local >= 0 && local < nvalid ? __uint_as_float((unsigned)lr[local] << 16) : 0.f;
    }
}

// dlogits = bf16((exp(l - lse) - [column is the target]) * dloss) on the first nvalid columns,
// 0 on the padding columns; one block per row.
template<int V>
__global__ void __launch_bounds__(256)
mpipar_ce_bwd(const bf16* __restrict__ logits, const long long* __restrict__ targets,
              const float* __restrict__ lse, const float* __restrict__ dloss,
              bf16* __restrict__ dlogits, int cols, int nvalid, long long vocab_start) {
    const long long row = blockIdx.x;
    const int T = blockDim.x, nv = cols / V;
    const bf16* lr = logits + row * cols;
    bf16* gr = dlogits + row * cols;
    const float L = lse[row], d = dloss[row];
    const long long local = targets[row] - vocab_start;
    const int hit = local >= 0 && local < nvalid ? (int)local : -1;
    for (int i0 = threadIdx.x; i0 < nv; i0 += T * CE_UNROLL) {
        Raw<V> r[CE_UNROLL];
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u)
            if (i0 + u * T < nv && (i0 + u * T) * V < nvalid) r[u] = load_bf<V>(lr + (i0 + u * T) * V);
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u) {
            const int c0 = (i0 + u * T) * V;
            if (i0 + u * T >= nv) continue;
            float f[V];
#pragma unroll
            for (int j = 0; j < V; ++j)
                f[j] = c0 + j < nvalid
                    ? (__expf(r[u].get(j) - L) - (c0 + j == hit ? 1.f : 0.f)) * d : 0.f;
            store_bf<V>(gr + c0, pack_bf<V>(f));
        }
    }
}

// ------------------------------------------------------------------------------- embedding
// keys [ntok] ascending, key = id * ntok + token (id = vrows: another shard's). Block (b, y), if b
// starts an id's run: dw[id][vector y * blockDim.x + tid] += dx[token][same] over the run in order.
template<int V>
__global__ void __launch_bounds__(128)
mpipar_embed_bwd(const long long* __restrict__ keys, const bf16* __restrict__ dx,
                 float* __restrict__ dw, long long ntok, long long vrows, int H) {
    const long long b = blockIdx.x, id = keys[b] / ntok;
    if (id >= vrows || (b > 0 && keys[b - 1] / ntok == id)) return;
    const long long i = (long long)blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= H / V) return;
    float* out = dw + id * H + i * V;
    float acc[V];
    load_f32<V>(out, acc);
    for (long long e = b; e < ntok; ++e) {
        const long long k = keys[e];
        if (k / ntok != id) break;
        const Raw<V> g = load_bf<V>(dx + (k % ntok) * H + i * V);
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += g.get(j);
    }
    store_f32<V>(out, acc);
}
"""

_SOURCE = _DEVICE_PRELUDE + _KERNELS


def _name(kernel: str, *targs: Any) -> str:
    """The name expression of one instantiation, e.g. `mpipar_rms_fwd<8, true>`."""
    return f"{kernel}<{', '.join(str(a).lower() if isinstance(a, bool) else str(a) for a in targs)}>"


def _names() -> tuple[str, ...]:
    """Every instantiation this module launches."""
    names = [_name(k, v, flag) for k in ("mpipar_rms_fwd", "mpipar_rms_bwd", "mpipar_swiglu")
             for v in _WIDTHS for flag in (False, True)]
    names += [_name(k, v) for k in ("mpipar_rope", "mpipar_ce_stats", "mpipar_ce_bwd",
                                    "mpipar_embed_bwd") for v in _WIDTHS]
    return tuple(names + [_name("mpipar_dw_reduce", 8)])


def cuda_sources() -> list[dict]:
    """This module's CUDA source for the NVRTC compile gate: name, code, every name expression
    launched, NVRTC options (RawModule adds its own), dynamic shared memory (none: all static)."""
    return [{"name": "cuda_fused", "code": _SOURCE, "names": _names(), "options": _OPTIONS,
             "dynamic_smem": {}}]


# ------------------------------------------------------------------------------- launching
def _cupy() -> Any:
    import cupy
    return cupy


@functools.cache
def _kernel(name: str) -> Any:
    """One instantiation; the module is compiled whole on first use (:func:`.cuda_gate.
    runtime_module`: what the compile gate checks)."""
    from . import cuda_gate
    return cuda_gate.runtime_module(__name__).get_function(name)


def _launch(name: str, grid: tuple, block: tuple, args: tuple) -> None:
    """Launch one instantiation on the current stream."""
    _kernel(name)(grid, block, args)


def _ptr(a: Array) -> int:
    return a.data.ptr


def _check(name: str, dtype: str, **arrays: Array) -> None:
    """Each array a CuPy array of `dtype` ("bfloat16" or "float32")."""
    import ml_dtypes

    want = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    for arg, a in arrays.items():
        got = getattr(a, "dtype", None)
        require(isinstance(a, _cupy().ndarray) and got == want,
                f"{name}: {arg} must be a {dtype} CuPy array, got {type(a).__name__}"
                f"{'' if got is None else f' of dtype {got}'}")


def _contiguous(*arrays: Array | None) -> list[Array | None]:
    return [None if a is None else _cupy().ascontiguousarray(a) for a in arrays]


def _width(n: int, bf16: tuple, f32: tuple = ()) -> int:
    """The widest V in _WIDTHS dividing n with the bf16 arrays (None skipped) aligned to 2V
    bytes and the float32 arrays to 8 (V > 1)."""
    return next(v for v in _WIDTHS if n % v == 0
                and all(_ptr(a) % (2 * v) == 0 for a in bf16 if a is not None)
                and all(_ptr(a) % min(8, 4 * v) == 0 for a in f32))


def _row_threads(h: int, v: int) -> int:
    """Threads of a row block: enough for _MAXV vectors each, a multiple of 32, <= _ROW_THREADS."""
    return min(_ROW_THREADS, max(32, -(-(h // v) // (32 * _MAXV)) * 32))


def _i32(n: int, what: str) -> np.int32:
    return require(0 <= n < 2**31, f"{what}={n} must be < 2**31") or np.int32(n)


# --------------------------------------------------------------------------------- RMSNorm
def _check_rms(name: str, x: Array, w: Array, eps: float | None = None) -> None:
    require(w.ndim == 1 and x.shape[-1] == w.shape[0] and x.shape[-1] > 0,
            f"{name}: w.shape={w.shape} must be [H] with H = x.shape[-1] = {x.shape[-1]} > 0")
    require(eps is None or eps >= 0, f"{name}: eps={eps} must be >= 0")


def _norm_fwd(x: Array, r: Array | None, w: Array, eps: float) -> tuple[Array | None, Array, Array]:
    """(s or None, y, rstd) of the (add-)RMSNorm forward kernel; x, r `[..., H]`, w `[H]`."""
    cp = _cupy()
    x, r, w = _contiguous(x, r, w)
    h, rows = x.shape[-1], x.size // x.shape[-1]
    y, s = cp.empty_like(x), None if r is None else cp.empty_like(x)
    rstd = cp.empty(x.shape[:-1], cp.float32)
    if rows:
        v = _width(h, (x, r, w, y, s))
        _launch(_name("mpipar_rms_fwd", v, r is not None), (min(rows, _FWD_BLOCKS),),
                (_row_threads(h, v),), (x, x if r is None else r, w, y, y if s is None else s,
                                        rstd, np.int64(rows), _i32(h, "hidden"), np.float32(eps)))
    return s, y, rstd


def rmsnorm_fwd(x: Array, w: Array, eps: float) -> tuple[Array, Array]:
    """y = bf16(x / sqrt(mean(x**2) + eps) * w) over the last axis, float32 math.

    x: bf16 `[..., H]`, w: bf16 `[H]` -> y: bf16 `[..., H]`, rstd: float32 `[...]`.
    """
    _check_rms("rmsnorm_fwd", x, w, eps)
    _check("rmsnorm_fwd", "bfloat16", x=x, w=w)
    return _norm_fwd(x, None, w, eps)[1:]


def add_rmsnorm_fwd(x: Array, r: Array, w: Array, eps: float) -> tuple[Array, Array, Array]:
    """Residual add then RMSNorm: s = bf16(x + r), y = bf16(rmsnorm(s) * w), the norm of the
    rounded s (as the backward sees it). x, r: bf16 `[..., H]`, w: bf16 `[H]` -> s, y: bf16
    `[..., H]`, rstd: float32 `[...]` (numpy_ref's order: s first).
    """
    require(x.shape == r.shape, f"add_rmsnorm_fwd: x.shape={x.shape} must equal r.shape={r.shape}")
    _check_rms("add_rmsnorm_fwd", x, w, eps)
    _check("add_rmsnorm_fwd", "bfloat16", x=x, r=r, w=w)
    s, y, rstd = _norm_fwd(x, r, w, eps)
    return s, y, rstd


def _norm_bwd(dy: Array, ds: Array | None, x: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """(dx, dw) of the (add-)RMSNorm backward kernel; dw from min(rows, _DW_PARTS) partials."""
    cp = _cupy()
    dy, ds, x, w, rstd = _contiguous(dy, ds, x, w, rstd)
    h, rows = x.shape[-1], x.size // x.shape[-1]
    dx = cp.empty_like(x)
    if not rows:
        return dx, cp.zeros(h, cp.float32)
    v, parts = _width(h, (dy, ds, x, w, dx)), min(rows, _DW_PARTS)
    part, dw = cp.empty((parts, h), cp.float32), cp.empty(h, cp.float32)
    _launch(_name("mpipar_rms_bwd", v, ds is not None), (parts,), (_row_threads(h, v),),
            (dy, dy if ds is None else ds, x, w, rstd, dx, part, np.int64(rows), _i32(h, "hidden")))
    _launch(_name("mpipar_dw_reduce", 8), (-(-h // 32),), (256,),
            (part, dw, np.int32(parts), np.int32(h)))
    return dx, dw


def _check_rms_bwd(name: str, dy: Array, x: Array, w: Array, rstd: Array, bf16: dict) -> None:
    require(dy.shape == x.shape and rstd.shape == x.shape[:-1] and w.shape == x.shape[-1:],
            f"{name}: shapes dy {dy.shape}, x {x.shape}, w {w.shape}, rstd {rstd.shape} "
            "must be [..., H], [..., H], [H], [...]")
    _check_rms(name, x, w)
    _check(name, "bfloat16", dy=dy, w=w, **bf16)
    _check(name, "float32", rstd=rstd)


def rmsnorm_bwd(dy: Array, x: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """Gradients of `rmsnorm_fwd`: dx = bf16(rstd * dy*w - rstd**3 * x * mean(dy*w*x)), dw =
    sum over rows of dy * x * rstd (float32, in a fixed order). dy, x: bf16 `[..., H]`, w: bf16
    `[H]`, rstd: float32 `[...]` -> dx bf16 `[..., H]`, dw float32 `[H]`.
    """
    _check_rms_bwd("rmsnorm_bwd", dy, x, w, rstd, {"x": x})
    return _norm_bwd(dy, None, x, w, rstd)


def add_rmsnorm_bwd(dy: Array, ds: Array, s: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """Gradients of `add_rmsnorm_fwd` given dy on y and ds on s: dsum = bf16(rmsnorm_bwd's dx
    + ds), the gradient of both x and r (rounded once), and dw float32. dy, ds, s: bf16
    `[..., H]`, w: bf16 `[H]`, rstd: float32 `[...]`.
    """
    require(ds.shape == s.shape, f"add_rmsnorm_bwd: ds.shape={ds.shape} must equal s.shape={s.shape}")
    _check_rms_bwd("add_rmsnorm_bwd", dy, s, w, rstd, {"ds": ds, "s": s})
    return _norm_bwd(dy, ds, s, w, rstd)


# ------------------------------------------------------------------------------------ RoPE
def _rope(x: Array, cos: Array, sin: Array, sgn: float, name: str) -> Array:
    """The rotation by sgn * angle of x `[B, S, H, D]` (numpy_ref's checks and layouts)."""
    ref.check_rope_shapes(x, cos, sin, name)
    _check(name, "bfloat16", x=x)
    _check(name, "float32", cos=cos, sin=sin)
    x, cos, sin = _contiguous(x, cos, sin)
    y = _cupy().empty_like(x)
    if x.size:
        b, s, h, d = x.shape
        v = _width(d // 2, (x, y), (cos, sin))
        threads = min(_EW_THREADS, -(-(h * d // 2 // v) // 32) * 32)  # a thread per V pairs
        _launch(_name("mpipar_rope", v), (b * s,), (threads,), (x, cos, sin, y, np.int64(s),
                _i32(h, "heads"), _i32(d // 2, "head_dim/2"), np.float32(sgn)))
    return y


def rope_fwd(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate pairs (x[..., i], x[..., i + D/2]): y1 = x1*cos - x2*sin, y2 = x2*cos + x1*sin.
    x: bf16 `[B, S, H, D]`, cos, sin: float32 `[S, D // 2]` -> y: bf16 like x."""
    return _rope(x, cos, sin, 1.0, "rope_fwd")


def rope_bwd(dy: Array, cos: Array, sin: Array) -> Array:
    """Gradient of `rope_fwd` (the inverse rotation); dy bf16 `[B, S, H, D]` -> dx bf16."""
    return _rope(dy, cos, sin, -1.0, "rope_bwd")


# ---------------------------------------------------------------------------------- SwiGLU
def _swiglu(dh: Array | None, gate: Array, up: Array) -> tuple[Array, Array | None]:
    """(h, None) forward (dh None), (dgate, dup) backward, from the SwiGLU kernel."""
    cp = _cupy()
    dh, gate, up = _contiguous(dh, gate, up)
    o1, o2 = cp.empty_like(gate), None if dh is None else cp.empty_like(gate)
    if gate.size:
        v = _width(gate.size, (dh, gate, up, o1, o2))
        nvec = gate.size // v
        _launch(_name("mpipar_swiglu", v, dh is not None), (-(-nvec // _EW_THREADS),),
                (_EW_THREADS,), (gate if dh is None else dh, gate, up, o1,
                                 o1 if o2 is None else o2, np.int64(nvec)))
    return o1, o2


def swiglu_fwd(gate: Array, up: Array) -> Array:
    """h = bf16(silu(gate) * up). gate, up: bf16 `[..., ffn]` -> h: bf16 `[..., ffn]`."""
    require(gate.shape == up.shape,
            f"swiglu_fwd: gate.shape={gate.shape} must equal up.shape={up.shape}")
    _check("swiglu_fwd", "bfloat16", gate=gate, up=up)
    return _swiglu(None, gate, up)[0]


def swiglu_bwd(dh: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """Gradients of `swiglu_fwd`: dgate = dh*up*sig*(1 + gate*(1 - sig)), dup = dh*silu(gate).
    dh, gate, up: bf16 `[..., ffn]` -> (dgate, dup) bf16."""
    require(dh.shape == gate.shape == up.shape,
            f"swiglu_bwd: shapes dh {dh.shape}, gate {gate.shape}, up {up.shape} must be equal")
    _check("swiglu_bwd", "bfloat16", dh=dh, gate=gate, up=up)
    return _swiglu(dh, gate, up)


# --------------------------------------------------------------------------- cross-entropy
def cross_entropy_stats(logits: Array, targets: Array, vocab_start: int = 0,
                        vocab_size: int | None = None) -> tuple[Array, Array, Array]:
    """Per-row softmax statistics of one vocab shard in one pass over the bf16 logits: logits
    bf16 `[N, Vloc]` (ids [vocab_start, vocab_start + Vloc); ids >= vocab_size are padding),
    targets integer `[N]` (global ids) -> m, s, t float32 `[N]` as numpy_ref's."""
    ref.check_ce_inputs(logits, targets, vocab_size, "cross_entropy_stats")
    _check("cross_entropy_stats", "bfloat16", logits=logits)
    cp = _cupy()
    n, cols = logits.shape
    nvalid = ref.valid_columns(cols, vocab_start, vocab_size)
    if nvalid == 0 or n == 0:
        return cp.full(n, -np.inf, cp.float32), cp.zeros(n, cp.float32), cp.zeros(n, cp.float32)
    (logits,) = _contiguous(logits)
    m, s, t = (cp.empty(n, cp.float32) for _ in range(3))
    _launch(_name("mpipar_ce_stats", _width(cols, (logits,))), (n,), (_CE_THREADS,),
            (logits, cp.ascontiguousarray(targets, cp.int64), m, s, t, _i32(cols, "columns"),
             np.int32(nvalid), np.int64(vocab_start)))
    return m, s, t


def cross_entropy_bwd(logits: Array, targets: Array, lse: Array, dloss: Array,
                      vocab_start: int = 0, vocab_size: int | None = None) -> Array:
    """Gradient of the per-row loss w.r.t. one vocab shard of bf16 logits `[N, Vloc]`: targets
    integer `[N]`, lse (global, over all shards) and dloss float32 `[N]` -> dlogits bf16 = (softmax
    - onehot(target in shard)) * dloss, padding columns 0."""
    ref.check_ce_inputs(logits, targets, vocab_size, "cross_entropy_bwd")
    n, cols = logits.shape
    require(lse.shape == (n,) and dloss.shape == (n,),
            f"cross_entropy_bwd: lse {lse.shape} and dloss {dloss.shape} must be [tokens] = ({n},)")
    _check("cross_entropy_bwd", "bfloat16", logits=logits)
    _check("cross_entropy_bwd", "float32", lse=lse, dloss=dloss)
    cp = _cupy()
    nvalid = ref.valid_columns(cols, vocab_start, vocab_size)
    if nvalid == 0 or logits.size == 0:
        return cp.zeros(logits.shape, logits.dtype)
    logits, lse, dloss = _contiguous(logits, lse, dloss)
    grad = cp.empty_like(logits)
    _launch(_name("mpipar_ce_bwd", _width(cols, (logits, grad))), (n,), (_CE_THREADS,),
            (logits, cp.ascontiguousarray(targets, cp.int64), lse, dloss, grad,
             _i32(cols, "columns"), np.int32(nvalid), np.int64(vocab_start)))
    return grad


# ------------------------------------------------------------------------------- embedding
def embedding_bwd(dw: Array, dx: Array, ids: Array, row_start: int = 0) -> Array:
    """dw float32 `[V_shard, H]` += (in place; returned) the embedding's gradient: dw[id -
    row_start] += dx[token] for the ids the shard holds, in token order (numpy_ref's float32 order;
    row ownership, see the module's docstring). dx: bf16 `ids.shape + [H]`, ids: integer."""
    require(dw.ndim == 2, f"embedding_bwd: dw must be 2-D [rows, hidden], got shape {dw.shape}")
    require(dx.shape == ids.shape + (dw.shape[1],),
            f"embedding_bwd: dx {dx.shape} must be ids {ids.shape} + [hidden={dw.shape[1]}]")
    require(ids.dtype.kind in "iu", f"embedding_bwd: ids dtype {ids.dtype} must be an integer type")
    _check("embedding_bwd", "float32", dw=dw)
    _check("embedding_bwd", "bfloat16", dx=dx)
    require(dw.flags.c_contiguous, "embedding_bwd: dw must be C-contiguous (updated in place)")
    cp = _cupy()
    (vrows, h), ntok = dw.shape, ids.size
    if not ntok or not h:
        return dw
    (dx,) = _contiguous(dx)
    local = ids.reshape(-1).astype(cp.int64) - row_start
    held = (local >= 0) & (local < vrows)
    keys = cp.sort(cp.where(held, local, vrows) * ntok + cp.arange(ntok, dtype=cp.int64))
    v = _width(h, (dx,), (dw,))
    _launch(_name("mpipar_embed_bwd", v), (ntok, -(-(h // v) // _EMB_THREADS)), (_EMB_THREADS,),
            (keys, dx, dw, np.int64(ntok), np.int64(vrows), _i32(h, "hidden")))
    return dw
