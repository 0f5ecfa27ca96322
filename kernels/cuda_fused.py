"""Fused bf16 GPU kernels: bf16 in and out, float32 math and statistics (the bf16 contract).

One CUDA module (`_SOURCE`, compiled through CuPy's `RawModule` on first use) holds:

- RMSNorm and residual-add + RMSNorm, forward and backward: a block owns whole rows (a
  grid-stride loop over rows); thread t owns the vectors t, t + T, ... of every row, keeps the
  first `_MAXV` of them (and of the weight) in registers, so each row is read from memory once;
  the backward's weight gradient is summed per block in registers (partials `[blocks, H]`, float32)
  and the partials are reduced by a second small kernel in a fixed order: no float atomics, and the
  block count depends only on the shape, so dw is bit-identical run to run;
- RoPE (rotate-half, float32 cos/sin tables `[S, D/2]` as `numpy_ref.rope_cos_sin` makes them),
  forward and backward;
- SwiGLU forward and backward (sigmoid and 1 - sigmoid from exp(-|g|) only: no cancellation);
- vocabulary-parallel cross-entropy: per-row statistics (max, sum of exp, target logit) in one
  pass over the bf16 logits (online max/sum), and the backward writing bf16 dlogits
  (softmax - onehot) * dloss from the global lse; the logits are never copied to float32;
- the embedding backward into a float32 weight gradient: ids sorted by the unique key
  id * tokens + token (so equal ids are runs in token order), and the first token of each run
  owns that weight row: dw[id] += dx[token] for its tokens in token order, exactly numpy_ref's
  float32 `add.at` order (bit-identical to it), with no atomics.

Loads and stores are vectorised: 8 bf16 (16 bytes) a thread where the row length and the
pointers allow, else 4, 2 or 1 (every kernel is instantiated for each width). Arguments mirror
`numpy_ref`'s, are validated with its messages, and must be CuPy arrays of the contract's
dtypes (bf16 as `ml_dtypes.bfloat16`, statistics float32). Importing this module never imports
CuPy. `cuda_sources()` lists the source and every instantiation for the NVRTC compile gate.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import numpy_ref as ref
from .numpy_ref import Array, require

IMPLEMENTED: tuple[str, ...] = (
    "rmsnorm_fwd", "rmsnorm_bwd", "add_rmsnorm_fwd", "add_rmsnorm_bwd", "rope_fwd", "rope_bwd",
    "swiglu_fwd", "swiglu_bwd", "cross_entropy_stats", "cross_entropy_fwd", "cross_entropy_bwd",
    "embedding_bwd")

_WIDTHS = (8, 4, 2, 1)
"""bf16 elements a thread loads at once (16, 8, 4, 2 bytes); the largest the shape allows."""
_MAXV = 4
"""Vectors of a row each thread keeps in registers in the RMSNorm kernels (the CUDA MAXV)."""
_ROW_THREADS = 512
"""Most threads of a row block (the kernels' __launch_bounds__)."""
_FWD_BLOCKS = 2048
"""Most blocks of the RMSNorm forward (each loops over rows, the weight kept in registers)."""
_DW_PARTS = 512
"""Blocks, hence dw partial rows, of the RMSNorm backward: min(rows, this). A constant, so the
summation order (and the bits of dw) depend only on the shape."""
_CE_THREADS = 256
_EW_THREADS = 256
_EMB_THREADS = 128
_OPTIONS = ("--std=c++17",)

# Device helpers. Everything that needs the GPU's own instructions is here, so that a host
# emulation of the kernels can put its own definitions in place of this part.
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
__device__ __forceinline__ float warp_xor(float v, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
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

// p: aligned to 2V bytes.
template<int V> __device__ __forceinline__ Raw<V> load_bf(const bf16* p) {
    Raw<V> r;
    if constexpr (V == 8) {
        const uint4 t = *reinterpret_cast<const uint4*>(p);
        r.w[0] = t.x; r.w[1] = t.y; r.w[2] = t.z; r.w[3] = t.w;
    } else if constexpr (V == 4) {
        const uint2 t = *reinterpret_cast<const uint2*>(p);
        r.w[0] = t.x; r.w[1] = t.y;
    } else if constexpr (V == 2) {
        r.w[0] = *reinterpret_cast<const unsigned*>(p);
    } else {
        r.w[0] = *p;
    }
    return r;
}

template<int V> __device__ __forceinline__ void store_bf(bf16* p, const Raw<V>& r) {
    if constexpr (V == 8) {
        *reinterpret_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
    } else if constexpr (V == 4) {
        *reinterpret_cast<uint2*>(p) = make_uint2(r.w[0], r.w[1]);
    } else if constexpr (V == 2) {
        *reinterpret_cast<unsigned*>(p) = r.w[0];
    } else {
        *p = (bf16)r.w[0];
    }
}

template<int V> __device__ __forceinline__ Raw<V> pack_bf(const float* f) {
    Raw<V> r;
    if constexpr (V == 1) {
        r.w[0] = to_bf16(f[0]);
    } else {
#pragma unroll
        for (int j = 0; j < V / 2; ++j) r.w[j] = pack_bf16x2(f[2 * j], f[2 * j + 1]);
    }
    return r;
}

// V floats; p aligned to min(16, 4V) bytes.
template<int V> __device__ __forceinline__ void load_f32(const float* p, float* f) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int q = 0; q < V / 4; ++q) {
            const float4 t = reinterpret_cast<const float4*>(p)[q];
            f[4 * q] = t.x; f[4 * q + 1] = t.y; f[4 * q + 2] = t.z; f[4 * q + 3] = t.w;
        }
    } else if constexpr (V == 2) {
        const float2 t = *reinterpret_cast<const float2*>(p);
        f[0] = t.x; f[1] = t.y;
    } else {
        f[0] = *p;
    }
}

template<int V> __device__ __forceinline__ void store_f32(float* p, const float* f) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int q = 0; q < V / 4; ++q)
            reinterpret_cast<float4*>(p)[q] = make_float4(f[4 * q], f[4 * q + 1], f[4 * q + 2],
                                                          f[4 * q + 3]);
    } else if constexpr (V == 2) {
        *reinterpret_cast<float2*>(p) = make_float2(f[0], f[1]);
    } else {
        *p = f[0];
    }
}

// Sum over the block (blockDim.x a multiple of 32), the same bits in every thread. sh: 32 floats
// of shared scratch; the leading barrier lets the caller reuse it at once.
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

// (m, s) <- the max and sum of exp(. - max) of the union of two sets (s = 0 for an empty set,
// whose m is -inf). Symmetric in its two arguments, so butterfly partners agree bit for bit.
__device__ __forceinline__ void ms_merge(float& m, float& s, float m2, float s2) {
    const float mx = fmaxf(m, m2);
    if (mx == -MPIPAR_INF) { m = mx; s = 0.f; return; }
    s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
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
__device__ __forceinline__ Raw<V> row_input(const bf16* x, const bf16* r, bf16* s_out,
                                            long long off) {
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

template<int V> __device__ __forceinline__ Raw<V> scale_w(const Raw<V>& a, const Raw<V>& w,
                                                          float rs) {
    float f[V];
#pragma unroll
    for (int j = 0; j < V; ++j) f[j] = a.get(j) * rs * w.get(j);
    return pack_bf<V>(f);
}

// y = bf16(s * rstd * w), rstd = 1 / sqrt(mean(s^2) + eps) per row of H = nvec * V, with s = x,
// or s = bf16(x + r) written to s_out (ADD). A block does rows blockIdx.x + k * gridDim.x;
// thread t the vectors t + k * blockDim.x of each (the first MAXV cached in registers).
template<int V, bool ADD>
__global__ void __launch_bounds__(512)
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
        for (int k = 0; k < MAXV; ++k) {
            const int i = tid + k * T;
            if (i < nvec) {
                xc[k] = row_input<V, ADD>(x, r, s_out, base + (long long)i * V);
                ss += sum_sq<V>(xc[k]);
            }
        }
        for (int i = tid + MAXV * T; i < nvec; i += T)
            ss += sum_sq<V>(row_input<V, ADD>(x, r, s_out, base + (long long)i * V));
        const float rs = 1.f / sqrtf(block_sum(ss, sh) / (float)H + eps);
        if (tid == 0) rstd[row] = rs;
#pragma unroll
        for (int k = 0; k < MAXV; ++k) {
            const int i = tid + k * T;
            if (i < nvec) store_bf<V>(y + base + (long long)i * V, scale_w<V>(xc[k], wc[k], rs));
        }
        for (int i = tid + MAXV * T; i < nvec; i += T) {
            const long long off = base + (long long)i * V;
            const Raw<V> s = load_bf<V>((ADD ? s_out : x) + off);
            store_bf<V>(y + off, scale_w<V>(s, load_bf<V>(w + (long long)i * V), rs));
        }
    }
}

template<int V> __device__ __forceinline__ float dot_gwx(const Raw<V>& g, const Raw<V>& w,
                                                         const Raw<V>& x) {
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
__global__ void __launch_bounds__(512)
mpipar_rms_bwd(const bf16* __restrict__ dy, const bf16* __restrict__ ds, const bf16* __restrict__ x,
               const bf16* __restrict__ w, const float* __restrict__ rstd, bf16* __restrict__ dx,
               float* __restrict__ part, long long rows, int H) {
    __shared__ float sh[32];
    const int nvec = H / V, T = blockDim.x, tid = threadIdx.x;
    float* pr = part + (long long)blockIdx.x * H;
    Raw<V> xc[MAXV], gc[MAXV];  // w is read per row (from L1): caching it too would spill
    float acc[MAXV][V];
    const float zero[V] = {};
#pragma unroll
    for (int k = 0; k < MAXV; ++k)
#pragma unroll
        for (int j = 0; j < V; ++j) acc[k][j] = 0.f;
    for (int i = tid + MAXV * T; i < nvec; i += T) store_f32<V>(pr + (long long)i * V, zero);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = row * H;
        const float rs = rstd[row];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < MAXV; ++k) {
            const int i = tid + k * T;
            if (i < nvec) {
                xc[k] = load_bf<V>(x + base + (long long)i * V);
                gc[k] = load_bf<V>(dy + base + (long long)i * V);
                dot += dot_gwx<V>(gc[k], load_bf<V>(w + (long long)i * V), xc[k]);
            }
        }
        for (int i = tid + MAXV * T; i < nvec; i += T) {
            const long long off = base + (long long)i * V;
            dot += dot_gwx<V>(load_bf<V>(dy + off), load_bf<V>(w + (long long)i * V),
                              load_bf<V>(x + off));
        }
        const float c = rs * rs * rs * (block_sum(dot, sh) / (float)H);
#pragma unroll
        for (int k = 0; k < MAXV; ++k) {
            const int i = tid + k * T;
            if (i < nvec)
                rms_grad<V, ADD>(gc[k], load_bf<V>(w + (long long)i * V), xc[k], ds, dx, base + (long long)i * V, rs, c,
                                 acc[k]);
        }
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

// dw[c] = sum over p < parts of part[p][c]: 32 columns a block, G groups of parts (group g sums
// the parts g, g + G, ... in order), then the groups in order. Block: 32 * G threads.
template<int G>
__global__ void __launch_bounds__(32 * G)
mpipar_dw_reduce(const float* __restrict__ part, float* __restrict__ dw, int parts, int H) {
    __shared__ float sh[G][33];
    const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
    const long long col = (long long)blockIdx.x * 32 + lane;
    float a = 0.f;
    if (col < H)
        for (int p = grp; p < parts; p += G) a += part[(long long)p * H + col];
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
// Pairs (x[..., p], x[..., p + half]) of rows [B*S*heads, 2*half]: y1 = x1*c - x2*sgn*s,
// y2 = x2*c + x1*sgn*s (sgn = -1: the backward's inverse rotation); cos, sin [S, half]. One
// thread per V pairs.
template<int V>
__global__ void __launch_bounds__(256)
mpipar_rope(const bf16* __restrict__ x, const float* __restrict__ cosv,
            const float* __restrict__ sinv, bf16* __restrict__ y, long long nthreads, long long S,
            long long heads, int half, float sgn) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nthreads) return;
    const int hv = half / V;
    const long long row = t / hv;
    const int p = (int)(t - row * hv) * V;
    const long long s = (row / heads) % S;
    const long long a = row * 2 * half + p;
    const Raw<V> x1 = load_bf<V>(x + a), x2 = load_bf<V>(x + a + half);
    float c[V], n[V], y1[V], y2[V];
    load_f32<V>(cosv + s * half + p, c);
    load_f32<V>(sinv + s * half + p, n);
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const float u = x1.get(j), v = x2.get(j), sn = sgn * n[j];
        y1[j] = u * c[j] - v * sn;
        y2[j] = v * c[j] + u * sn;
    }
    store_bf<V>(y + a, pack_bf<V>(y1));
    store_bf<V>(y + a + half, pack_bf<V>(y2));
}

// -------------------------------------------------------------------------------- SwiGLU
// sigmoid(g) and 1 - sigmoid(g), exp taken of -|g| only (no overflow, no cancellation).
__device__ __forceinline__ void sigmoid2(float g, float& sig, float& rest) {
    const float e = expf(-fabsf(g)), a = 1.f / (1.f + e), b = e * a;
    sig = g >= 0.f ? a : b;
    rest = g >= 0.f ? b : a;
}

// h = g * sigmoid(g) * u over nvec vectors of V.
template<int V>
__global__ void __launch_bounds__(256)
mpipar_swiglu_fwd(const bf16* __restrict__ g, const bf16* __restrict__ u, bf16* __restrict__ h,
                  long long nvec) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nvec) return;
    const Raw<V> gv = load_bf<V>(g + i * V), uv = load_bf<V>(u + i * V);
    float f[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        float sig, rest;
        sigmoid2(gv.get(j), sig, rest);
        f[j] = gv.get(j) * sig * uv.get(j);
    }
    store_bf<V>(h + i * V, pack_bf<V>(f));
}

// dg = dh * u * sig * (1 + g * (1 - sig)), du = dh * g * sig.
template<int V>
__global__ void __launch_bounds__(256)
mpipar_swiglu_bwd(const bf16* __restrict__ dh, const bf16* __restrict__ g,
                  const bf16* __restrict__ u, bf16* __restrict__ dg, bf16* __restrict__ du,
                  long long nvec) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nvec) return;
    const Raw<V> hv = load_bf<V>(dh + i * V), gv = load_bf<V>(g + i * V), uv = load_bf<V>(u + i * V);
    float fg[V], fu[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
        float sig, rest;
        const float gj = gv.get(j);
        sigmoid2(gj, sig, rest);
        fg[j] = hv.get(j) * uv.get(j) * sig * (1.f + gj * rest);
        fu[j] = hv.get(j) * (gj * sig);
    }
    store_bf<V>(dg + i * V, pack_bf<V>(fg));
    store_bf<V>(du + i * V, pack_bf<V>(fu));
}

// --------------------------------------------------------------------------- cross-entropy
constexpr int CE_UNROLL = 4;  // vectors a thread has in flight

// One block per row of logits [N, cols] (the first nvalid columns real): m = max, s = sum
// exp(l - m) (online, one pass), t = the logit of targets[row] - vocab_start if in [0, nvalid)
// else 0.
template<int V>
__global__ void __launch_bounds__(256)
mpipar_ce_stats(const bf16* __restrict__ logits, const long long* __restrict__ targets,
                float* __restrict__ m_out, float* __restrict__ s_out, float* __restrict__ t_out,
                long long cols, long long nvalid, long long vocab_start) {
    __shared__ float shm[32], shs[32];
    const long long row = blockIdx.x;
    const bf16* lr = logits + row * cols;
    const long long nv = (nvalid + V - 1) / V, T = blockDim.x;
    float m = -MPIPAR_INF, s = 0.f;
    for (long long i0 = threadIdx.x; i0 < nv; i0 += T * CE_UNROLL) {
        Raw<V> r[CE_UNROLL];
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u)
            if (i0 + u * T < nv) r[u] = load_bf<V>(lr + (i0 + u * T) * V);
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u) {
            const long long c0 = (i0 + u * T) * V;
            if (c0 >= nvalid) continue;
            float v[V], vmax = -MPIPAR_INF;
#pragma unroll
            for (int j = 0; j < V; ++j) {
                v[j] = c0 + j < nvalid ? r[u].get(j) : -MPIPAR_INF;
                vmax = fmaxf(vmax, v[j]);
            }
            if (vmax == -MPIPAR_INF) continue;
            const float mn = fmaxf(m, vmax);
            float e = 0.f;
#pragma unroll
            for (int j = 0; j < V; ++j) e += __expf(v[j] - mn);
            s = s * __expf(m - mn) + e;
            m = mn;
        }
    }
    block_ms(m, s, shm, shs);
    if (threadIdx.x == 0) {
        const long long local = targets[row] - vocab_start;
        m_out[row] = m;
        s_out[row] = s;
        t_out[row] = local >= 0 && local < nvalid ? __uint_as_float((unsigned)lr[local] << 16) : 0.f;
    }
}

// dlogits = bf16((exp(l - lse) - [column is the target]) * dloss) on the first nvalid columns,
// 0 on the padding columns; one block per row.
template<int V>
__global__ void __launch_bounds__(256)
mpipar_ce_bwd(const bf16* __restrict__ logits, const long long* __restrict__ targets,
              const float* __restrict__ lse, const float* __restrict__ dloss,
              bf16* __restrict__ dlogits, long long cols, long long nvalid, long long vocab_start) {
    const long long row = blockIdx.x, T = blockDim.x, nv = cols / V;
    const bf16* lr = logits + row * cols;
    bf16* gr = dlogits + row * cols;
    const float L = lse[row], d = dloss[row];
    const long long local = targets[row] - vocab_start;
    const long long hit = local >= 0 && local < nvalid ? local : -1;
    for (long long i0 = threadIdx.x; i0 < nv; i0 += T * CE_UNROLL) {
        Raw<V> r[CE_UNROLL];
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u)
            if (i0 + u * T < nv && (i0 + u * T) * V < nvalid) r[u] = load_bf<V>(lr + (i0 + u * T) * V);
#pragma unroll
        for (int u = 0; u < CE_UNROLL; ++u) {
            const long long c0 = (i0 + u * T) * V;
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
// keys [ntok] ascending, key = id * ntok + token (id = vrows for tokens another shard holds).
// Block (b, y): if b starts a run of one id, dw[id][cols] += dx[token][cols] for the run's
// tokens in order, cols the V-vectors y * blockDim.x + threadIdx.x; other blocks return.
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
    args = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in targs)
    return f"{kernel}<{args}>"


def _names() -> tuple[str, ...]:
    """Every instantiation this module launches."""
    names = [_name(k, v, add) for k in ("mpipar_rms_fwd", "mpipar_rms_bwd") for v in _WIDTHS
             for add in (False, True)]
    names += [_name(k, v) for k in ("mpipar_rope", "mpipar_swiglu_fwd", "mpipar_swiglu_bwd",
                                    "mpipar_ce_stats", "mpipar_ce_bwd", "mpipar_embed_bwd")
              for v in _WIDTHS]
    return tuple(names + [_name("mpipar_dw_reduce", 8)])


def cuda_sources() -> list[dict]:
    """The CUDA sources of this module for the NVRTC compile gate: name, code, every name
    expression launched, the NVRTC options (RawModule adds its own), dynamic shared memory per
    name expression (none: all shared memory is static)."""
    return [{"name": "cuda_fused", "code": _SOURCE, "names": _names(), "options": _OPTIONS,
             "dynamic_smem": {}}]


# ------------------------------------------------------------------------------ launching
def _cupy() -> Any:
    import cupy

    return cupy


@functools.cache
def _module() -> Any:
    """The RawModule, compiled on first use (CuPy caches the binary on disk)."""
    return _cupy().RawModule(code=_SOURCE, options=_OPTIONS, name_expressions=_names())


def _launch(name: str, grid: tuple, block: tuple, args: tuple) -> None:
    """Launch one instantiation on the current stream."""
    _module().get_function(name)(grid, block, args)


def _ptr(a: Array) -> int:
    return a.data.ptr


def _bf16_dtype() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _is_device_array(a: Any) -> bool:
    return isinstance(a, _cupy().ndarray)


def _check(name: str, dtype: str, **arrays: Array) -> None:
    """Each array a CuPy array of `dtype` ("bfloat16" or "float32")."""
    want = _bf16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
    for arg, a in arrays.items():
        require(_is_device_array(a) and a.dtype == want,
                f"{name}: {arg} must be a {dtype} CuPy array, got {type(a).__name__}"
                f"{'' if getattr(a, 'dtype', None) is None else ' of dtype ' + str(a.dtype)}")


def _contiguous(*arrays: Array | None) -> list[Array | None]:
    cp = _cupy()
    return [None if a is None else cp.ascontiguousarray(a) for a in arrays]


def _width(n: int, bf16: tuple, f32: tuple = ()) -> int:
    """The widest V in _WIDTHS dividing n with every bf16 array aligned to 2V bytes and every
    float32 array to min(16, 4V) bytes."""
    for v in _WIDTHS:
        if n % v == 0 and all(_ptr(a) % (2 * v) == 0 for a in bf16 if a is not None) \
                and all(_ptr(a) % min(16, 4 * v) == 0 for a in f32):
            return v
    return 1


def _row_threads(h: int, v: int) -> int:
    """Threads of a row block: enough for _MAXV vectors each, a multiple of 32, <= _ROW_THREADS."""
    per = -(-(h // v) // _MAXV)
    return min(_ROW_THREADS, max(32, -(-per // 32) * 32))


def _i64(n: int) -> np.int64:
    return np.int64(n)


def _i32(n: int, what: str) -> np.int32:
    require(0 <= n < 2**31, f"{what}={n} must be < 2**31")
    return np.int32(n)


# -------------------------------------------------------------------------------- RMSNorm
def _check_rms(name: str, x: Array, w: Array) -> None:
    require(w.ndim == 1 and x.shape[-1] == w.shape[0],
            f"{name}: w.shape={w.shape} must be [H] with H = x.shape[-1] = {x.shape[-1]}")
    require(x.shape[-1] > 0, f"{name}: the hidden size must be > 0, got x.shape={x.shape}")


def _norm_fwd(x: Array, r: Array | None, w: Array, eps: float) -> tuple[Array | None, Array, Array]:
    """(s or None, y, rstd) of the (add-)RMSNorm forward kernel; x, r `[..., H]`, w `[H]`."""
    cp = _cupy()
    x, r, w = _contiguous(x, r, w)
    h = x.shape[-1]
    rows = x.size // h
    y = cp.empty_like(x)
    s = None if r is None else cp.empty_like(x)
    rstd = cp.empty(x.shape[:-1], cp.float32)
    if rows:
        v = _width(h, (x, r, w, y, s))
        _launch(_name("mpipar_rms_fwd", v, r is not None), (min(rows, _FWD_BLOCKS),),
                (_row_threads(h, v),),
                (x, x if r is None else r, w, y, y if s is None else s, rstd, _i64(rows),
                 _i32(h, "hidden"), np.float32(eps)))
    return s, y, rstd


def rmsnorm_fwd(x: Array, w: Array, eps: float) -> tuple[Array, Array]:
    """y = bf16(x / sqrt(mean(x**2) + eps) * w) over the last axis, float32 math.

    x: bf16 `[..., H]`, w: bf16 `[H]` -> y: bf16 `[..., H]`, rstd: float32 `[...]`.
    """
    _check_rms("rmsnorm_fwd", x, w)
    require(eps >= 0, f"rmsnorm_fwd: eps={eps} must be >= 0")
    _check("rmsnorm_fwd", "bfloat16", x=x, w=w)
    _, y, rstd = _norm_fwd(x, None, w, eps)
    return y, rstd


def add_rmsnorm_fwd(x: Array, r: Array, w: Array, eps: float) -> tuple[Array, Array, Array]:
    """Residual add then RMSNorm: s = bf16(x + r), y = bf16(rmsnorm(s) * w) (the norm of the
    rounded s, as the backward sees it).

    x, r: bf16 `[..., H]`, w: bf16 `[H]` -> s, y: bf16 `[..., H]`, rstd: float32 `[...]`
    (numpy_ref's order: s first).
    """
    require(x.shape == r.shape, f"add_rmsnorm_fwd: x.shape={x.shape} must equal r.shape={r.shape}")
    _check_rms("add_rmsnorm_fwd", x, w)
    require(eps >= 0, f"add_rmsnorm_fwd: eps={eps} must be >= 0")
    _check("add_rmsnorm_fwd", "bfloat16", x=x, r=r, w=w)
    s, y, rstd = _norm_fwd(x, r, w, eps)
    return s, y, rstd


def _norm_bwd(dy: Array, ds: Array | None, x: Array, w: Array,
              rstd: Array) -> tuple[Array, Array]:
    """(dx, dw) of the (add-)RMSNorm backward kernels; dw from min(rows, _DW_PARTS) partials."""
    cp = _cupy()
    dy, ds, x, w, rstd = _contiguous(dy, ds, x, w, rstd)
    h = x.shape[-1]
    rows = x.size // h
    dx = cp.empty_like(x)
    if not rows:
        return dx, cp.zeros(h, cp.float32)
    v = _width(h, (dy, ds, x, w, dx))
    parts = min(rows, _DW_PARTS)
    part = cp.empty((parts, h), cp.float32)
    _launch(_name("mpipar_rms_bwd", v, ds is not None), (parts,), (_row_threads(h, v),),
            (dy, dy if ds is None else ds, x, w, rstd, dx, part, _i64(rows), _i32(h, "hidden")))
    dw = cp.empty(h, cp.float32)
    _launch(_name("mpipar_dw_reduce", 8), (-(-h // 32),), (256,), (part, dw, np.int32(parts),
                                                                  np.int32(h)))
    return dx, dw


def _check_rms_bwd(name: str, dy: Array, x: Array, w: Array, rstd: Array) -> None:
    require(dy.shape == x.shape and rstd.shape == x.shape[:-1] and w.shape == x.shape[-1:],
            f"{name}: shapes dy {dy.shape}, x {x.shape}, w {w.shape}, rstd {rstd.shape} "
            "must be [..., H], [..., H], [H], [...]")
    require(x.shape[-1] > 0, f"{name}: the hidden size must be > 0, got x.shape={x.shape}")


def rmsnorm_bwd(dy: Array, x: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """Gradients of `rmsnorm_fwd`: dx = rstd * dy*w - rstd**3 * x * mean(dy*w*x) (bf16) and
    dw = sum over rows of dy * x * rstd (float32, a fixed summation order).

    dy, x: bf16 `[..., H]`, w: bf16 `[H]`, rstd: float32 `[...]` -> dx bf16 `[..., H]`, dw f32 `[H]`.
    """
    _check_rms_bwd("rmsnorm_bwd", dy, x, w, rstd)
    _check("rmsnorm_bwd", "bfloat16", dy=dy, x=x, w=w)
    _check("rmsnorm_bwd", "float32", rstd=rstd)
    return _norm_bwd(dy, None, x, w, rstd)


def add_rmsnorm_bwd(dy: Array, ds: Array, s: Array, w: Array, rstd: Array) -> tuple[Array, Array]:
    """Gradients of `add_rmsnorm_fwd` given dy on y and ds on s: dsum = bf16(rmsnorm_bwd(dy)
    + ds) (the gradient of both x and r, rounded once), dw float32.

    dy, ds, s: bf16 `[..., H]`, w: bf16 `[H]`, rstd: float32 `[...]`.
    """
    require(ds.shape == s.shape, f"add_rmsnorm_bwd: ds.shape={ds.shape} must equal s.shape={s.shape}")
    _check_rms_bwd("add_rmsnorm_bwd", dy, s, w, rstd)
    _check("add_rmsnorm_bwd", "bfloat16", dy=dy, ds=ds, s=s, w=w)
    _check("add_rmsnorm_bwd", "float32", rstd=rstd)
    return _norm_bwd(dy, ds, s, w, rstd)


# ----------------------------------------------------------------------------------- RoPE
def _rope(x: Array, cos: Array, sin: Array, sgn: float, name: str) -> Array:
    ref.check_rope_shapes(x, cos, sin, name)
    _check(name, "bfloat16", x=x)
    _check(name, "float32", cos=cos, sin=sin)
    cp = _cupy()
    x, cos, sin = _contiguous(x, cos, sin)
    b, s, h, d = x.shape
    y = cp.empty_like(x)
    if x.size:
        half = d // 2
        v = _width(half, (x, y), (cos, sin))
        n = x.size // 2 // v
        _launch(_name("mpipar_rope", v), (-(-n // _EW_THREADS),), (_EW_THREADS,),
                (x, cos, sin, y, _i64(n), _i64(s), _i64(h), _i32(half, "head_dim // 2"),
                 np.float32(sgn)))
    return y


def rope_fwd(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate pairs (x[..., i], x[..., i + D/2]): y1 = x1*cos - x2*sin, y2 = x2*cos + x1*sin.

    x: bf16 `[B, S, H, D]`, cos, sin: float32 `[S, D // 2]` -> y: bf16 like x.
    """
    return _rope(x, cos, sin, 1.0, "rope_fwd")


def rope_bwd(dy: Array, cos: Array, sin: Array) -> Array:
    """Gradient of `rope_fwd` (the inverse rotation); dy bf16 `[B, S, H, D]` -> dx bf16."""
    return _rope(dy, cos, sin, -1.0, "rope_bwd")


# --------------------------------------------------------------------------------- SwiGLU
def _elementwise(kernel: str, ins: list, n_out: int) -> list:
    """Launch a SwiGLU kernel over same-shape bf16 inputs; returns n_out new bf16 outputs."""
    cp = _cupy()
    ins = _contiguous(*ins)
    outs = [cp.empty_like(ins[0]) for _ in range(n_out)]
    n = ins[0].size
    if n:
        v = _width(n, tuple(ins + outs))
        nvec = n // v
        _launch(_name(kernel, v), (-(-nvec // _EW_THREADS),), (_EW_THREADS,),
                (*ins, *outs, _i64(nvec)))
    return outs


def swiglu_fwd(gate: Array, up: Array) -> Array:
    """h = bf16(silu(gate) * up). gate, up: bf16 `[..., ffn]` -> h: bf16 `[..., ffn]`."""
    require(gate.shape == up.shape, f"swiglu_fwd: gate.shape={gate.shape} must equal up.shape={up.shape}")
    _check("swiglu_fwd", "bfloat16", gate=gate, up=up)
    return _elementwise("mpipar_swiglu_fwd", [gate, up], 1)[0]


def swiglu_bwd(dh: Array, gate: Array, up: Array) -> tuple[Array, Array]:
    """Gradients of `swiglu_fwd`: dgate = dh*up*sig*(1 + gate*(1 - sig)), dup = dh*silu(gate).

    dh, gate, up: bf16 `[..., ffn]` -> (dgate, dup) bf16.
    """
    require(dh.shape == gate.shape == up.shape,
            f"swiglu_bwd: shapes dh {dh.shape}, gate {gate.shape}, up {up.shape} must be equal")
    _check("swiglu_bwd", "bfloat16", dh=dh, gate=gate, up=up)
    dg, du = _elementwise("mpipar_swiglu_bwd", [dh, gate, up], 2)
    return dg, du


# -------------------------------------------------------------------------- cross-entropy
def cross_entropy_stats(logits: Array, targets: Array, vocab_start: int = 0,
                        vocab_size: int | None = None) -> tuple[Array, Array, Array]:
    """Per-row softmax statistics of one vocab shard in one pass over the bf16 logits.

    logits: bf16 `[N, Vloc]` (columns = ids [vocab_start, vocab_start + Vloc); ids >= vocab_size
    are padding, ignored), targets: integer `[N]` global ids -> m, s, t: float32 `[N]` as
    `numpy_ref.cross_entropy_stats` (m = -inf, s = t = 0 for an all-padding shard).
    """
    ref.check_ce_inputs(logits, targets, vocab_size, "cross_entropy_stats")
    _check("cross_entropy_stats", "bfloat16", logits=logits)
    cp = _cupy()
    n, cols = logits.shape
    nvalid = ref.valid_columns(cols, vocab_start, vocab_size)
    if nvalid == 0 or n == 0:
        return cp.full(n, -np.inf, cp.float32), cp.zeros(n, cp.float32), cp.zeros(n, cp.float32)
    (logits,) = _contiguous(logits)
    tg = cp.ascontiguousarray(targets, cp.int64)
    m, s, t = (cp.empty(n, cp.float32) for _ in range(3))
    _launch(_name("mpipar_ce_stats", _width(cols, (logits,))), (n,), (_CE_THREADS,),
            (logits, tg, m, s, t, _i64(cols), _i64(nvalid), _i64(vocab_start)))
    return m, s, t


def cross_entropy_fwd(logits: Array, targets: Array,
                      vocab_size: int | None = None) -> tuple[Array, Array]:
    """Cross-entropy of unsharded bf16 logits `[N, V]`: loss, lse float32 `[N]` (numpy_ref's)."""
    nvalid = ref.valid_columns(logits.shape[1] if logits.ndim == 2 else 0, 0, vocab_size)
    require(nvalid > 0, f"cross_entropy_fwd: vocab_size={vocab_size} must leave at least one column")
    m, s, t = cross_entropy_stats(logits, targets, 0, nvalid)
    lse = m + _cupy().log(s)
    return lse - t, lse


def cross_entropy_bwd(logits: Array, targets: Array, lse: Array, dloss: Array,
                      vocab_start: int = 0, vocab_size: int | None = None) -> Array:
    """Gradient of the per-row loss w.r.t. one vocab shard of bf16 logits, written as bf16.

    logits: bf16 `[N, Vloc]`, targets: integer `[N]`, lse (global, over all shards), dloss:
    float32 `[N]` -> dlogits bf16 `[N, Vloc]` = (softmax - onehot(target in shard)) * dloss;
    padding columns 0.
    """
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
            (logits, cp.ascontiguousarray(targets, cp.int64), lse, dloss, grad, _i64(cols),
             _i64(nvalid), _i64(vocab_start)))
    return grad


# ------------------------------------------------------------------------------ embedding
def embedding_bwd(dw: Array, dx: Array, ids: Array, row_start: int = 0) -> Array:
    """Accumulate into dw float32 `[V_shard, H]` (in place; returned) the gradient of the
    embedding: dw[id - row_start] += dx[token] for the ids the shard holds, in token order.

    dx: bf16 `ids.shape + [H]`, ids: integer. Deterministic without atomics: the unique keys
    (id - row_start) * tokens + token (tokens of other shards keyed past the shard) are sorted,
    and the first token of each id's run adds the run's rows to its weight row.
    """
    require(dw.ndim == 2, f"embedding_bwd: dw must be 2-D [rows, hidden], got shape {dw.shape}")
    require(dx.shape == ids.shape + (dw.shape[1],),
            f"embedding_bwd: dx {dx.shape} must be ids {ids.shape} + [hidden={dw.shape[1]}]")
    require(ids.dtype.kind in "iu", f"embedding_bwd: ids dtype {ids.dtype} must be an integer type")
    _check("embedding_bwd", "float32", dw=dw)
    _check("embedding_bwd", "bfloat16", dx=dx)
    require(dw.flags.c_contiguous, "embedding_bwd: dw must be C-contiguous (it is updated in place)")
    cp = _cupy()
    vrows, h = dw.shape
    ntok = ids.size
    if not ntok or not h:
        return dw
    (dx,) = _contiguous(dx)
    local = ids.reshape(-1).astype(cp.int64) - row_start
    held = (local >= 0) & (local < vrows)
    keys = cp.sort(cp.where(held, local, vrows) * ntok + cp.arange(ntok, dtype=cp.int64))
    v = _width(h, (dx,), (dw,))
    _launch(_name("mpipar_embed_bwd", v), (ntok, -(-(h // v) // _EMB_THREADS)), (_EMB_THREADS,),
            (keys, dx, dw, _i64(ntok), _i64(vrows), _i32(h, "hidden")))
    return dw
