"""Flash attention forward and backward on CUDA cores for float32 and float64 (`cupy_gpu`'s
attention, the exactness kernels: float64 layouts on a GPU equal the CPU's to 1e-10), written to
`numpy_ref.attention_fwd` / `attention_bwd`'s contract. One CuPy ``RawModule`` per (dtype,
head_dim), compiled on first use: K/V tiles in shared memory, online softmax, the log-sum-exp
returned for the ring merge, causal masks at global query/key offsets (ring and zigzag blocks),
sliding windows, packed documents (document ids: blocks aligned to the documents,
`document_tables`), grouped-query heads, accumulation in float32 (float64 for float64), no S x S
matrix. A few lanes of a warp share one row and sum dot products with warp shuffles, so no
thread holds a D-long vector and nothing spills (:func:`flash_config`); each warp loops only
over the keys (queries) its own rows see, so a causal square's upper half and other documents'
keys cost nothing. Pure Python until a kernel is launched: CuPy is imported on first use
(`cupy_arrays.array_module`), and the CUDA source is checked by the compile gate
(:func:`cuda_sources`) and on the CPU under HIP-CPU (tests/unit/test_flash_hip_cpu.py).
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from . import numpy_ref as ref
from .cupy_arrays import array_module, ctype, device_float, device_views, host_array
from .numpy_ref import Array, require

_THREADS = 256
"""Threads per block of the flash kernels (their NT template argument)."""
_DOC_THREADS = 128
"""Threads per block when the kernels take packed documents (`document_tables`): the rows of a
block are ``_DOC_THREADS / lanes``. A block steps through the key tiles of all its rows' documents
together, so on rows of short documents its time follows rows x the block's key span (counted on
the host for `bench documents`' batch, 8 x 8192 tokens, median 200, D 64 float32: 64-row blocks
hold 1.151 times full causal's share of that capacity, 32-row blocks 1.083, 16-row 1.043). Timed
on an H100 (that batch, float32, forward + backward over full causal's, per work):
256 threads 1.292, 128 threads 1.237, 128 threads with 32-row tiles 1.193, with 16-row 1.212,
64 threads 2.41 (all bit-equal). Other head dims take the same launch untimed."""
_DOC_TILE = 32
"""Key (dk/dv: query) tile rows of the document kernels, at most `flash_config`'s (float64 at
D 96/128 has shared memory for 21 and 16 only); 0: `flash_config`'s."""
_OPTIONS: tuple[str, ...] = ("--std=c++17",)
"""NVRTC options of the flash modules (CuPy adds its own; see `cuda_gate`)."""

HEAD_DIMS: tuple[int, ...] = (8, 16, 32, 64, 80, 96, 128)
"""Head widths the flash kernels support (a template argument; each one passes the compile gate
with no spills for float32 and float64)."""


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
// starts, `document_spans.document_blocks`; columns past a sequence's blocks hold S).
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

// This thread's query row in block x = blockIdx.x of head (b, h) (blockIdx.y = b * Hq + h): the
// block's rows [first, stop), row i (live if i < stop), at: its offset in [B, Sq, Hq, D], kv:
// the first element of its kv head in [B, Sk, Hkv, D], lane: its lane of the row's L.
struct QueryRow { long long first, stop, i, at, kv; int lane, b, h; bool row; };
template<int L, int D> __device__ inline QueryRow query_row(const long long* starts, int nb, int R,
                                                            int Sq, int Sk, int Hq, int Hkv) {
    QueryRow r;
    r.lane = threadIdx.x % L;
    r.b = blockIdx.y / Hq;
    r.h = blockIdx.y % Hq;
    block_rows(starts, nb, r.b, blockIdx.x, R, Sq, &r.first, &r.stop);
    r.i = r.first + threadIdx.x / L;
    r.row = r.i < r.stop;
    r.at = (((long long)r.b * Sq + (r.row ? r.i : 0)) * Hq + r.h) * D;
    r.kv = ((long long)r.b * Sk * Hkv + r.h / (Hq / Hkv)) * D;
    return r;
}

// The forward's and dq's walk over the keys, for the query rows [first, stop) of a block of
// sequence b and this thread's row i: the block's key tiles [beg, end), row i's document keys
// [rlo, rhi), this warp's keys [wbeg, wend).
struct KeyWalk { long long beg, end, rlo, rhi, wbeg, wend; };
template<int L> __device__ inline KeyWalk key_walk(
        long long first, long long stop, long long i, bool row, int b, int Sq, int Sk,
        long long q_off, long long k_off, int causal, long long window, int tile,
        const long long* lo, const long long* hi) {
    KeyWalk w;
    long long w0, w1;
    key_range(first, stop - 1, Sk, q_off, k_off, causal, window, tile, &w.beg, &w.end);
    doc_keys(lo, hi, (long long)b * Sq, first, stop, i, row, Sk, &w.beg, &w.end, &w.rlo, &w.rhi);
    warp_rows<L>(first, stop, &w0, &w1);
    warp_span(w0, w1, false, Sk, q_off, k_off, causal, window, lo, hi, (long long)b * Sq,
              &w.wbeg, &w.wend);
    return w;
}

// out_i = sum_j p_ij v_j / sum_j p_ij, p_ij = exp(scale q_i.k_j - m_i) (online softmax),
// lse_i = m_i + log sum_j p_ij (-inf and out 0 where no key is visible).
template<typename T, typename A, int D, int L, int BN, int NT>
__global__ void __launch_bounds__(NT, 1) flash_fwd(
        const T* q, const T* k, const T* v, T* out, A* lse, int Sq, int Sk, int Hq, int Hkv,
        long long q_off, long long k_off, int causal, long long window, A scale,
        const long long* lo, const long long* hi, const long long* starts, int nb) {
    constexpr int E = D / L;
    __shared__ T ks[BN][D];
    __shared__ T vs[BN][D];
    const QueryRow r = query_row<L, D>(starts, nb, NT / L, Sq, Sk, Hq, Hkv);
    if (r.first >= r.stop) return;
    const long long first = r.first, stop = r.stop, i = r.i, at_q = r.at, kv_base = r.kv;
    const int lane = r.lane, b = r.b, h = r.h;
    const bool row = r.row;
    A qr[E], o[E];
#pragma unroll
    for (int e = 0; e < E; ++e) { qr[e] = row ? (A)q[at_q + lane + L * e] * scale : (A)0; o[e] = 0; }
    A m = -INFINITY, l = 0;
    const KeyWalk w = key_walk<L>(first, stop, i, row, b, Sq, Sk, q_off, k_off, causal, window, BN,
                                  lo, hi);
    for (long long k0 = w.beg; k0 < w.end; k0 += BN) {
        load_rows<T, D, BN>(k, ks, kv_base, (long long)Hkv * D, k0, Sk);
        load_rows<T, D, BN>(v, vs, kv_base, (long long)Hkv * D, k0, Sk);
        __syncthreads();
        const int n = (int)min(min((long long)BN, w.end - k0), w.wend - k0);
        for (int jj = (int)max(0LL, w.wbeg - k0); jj < n; ++jj) {
            A s = 0;
#pragma unroll
            for (int e = 0; e < E; ++e) s += qr[e] * (A)ks[jj][lane + L * e];
            s = lanes_sum<L>(s);
            if (row && visible(i, k0 + jj, q_off, k_off, causal, window) && k0 + jj >= w.rlo
                    && k0 + jj < w.rhi) {
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

// dq_i = scale * sum_j p_ij (dO_i . v_j - delta_i) k_j, p_ij = exp(scale q_i.k_j - lse_i), with
// delta_i = dO_i . out_i found here (in A) and written to delta for flash_bwd_dkdv.
template<typename T, typename A, int D, int L, int BN, int NT>
__global__ void __launch_bounds__(NT, 1) flash_bwd_dq(
        const T* q, const T* k, const T* v, const T* dout, const T* out, const A* lse, A* delta,
        T* dq,
        int Sq, int Sk, int Hq, int Hkv, long long q_off, long long k_off, int causal,
        long long window, A scale, const long long* lo, const long long* hi,
        const long long* starts, int nb) {
    constexpr int E = D / L;
    __shared__ T ks[BN][D];
    __shared__ T vs[BN][D];
    const QueryRow r = query_row<L, D>(starts, nb, NT / L, Sq, Sk, Hq, Hkv);
    if (r.first >= r.stop) return;
    const long long first = r.first, stop = r.stop, i = r.i, at_q = r.at, kv_base = r.kv;
    const int lane = r.lane, b = r.b, h = r.h;
    const bool row = r.row;
    const A lse_i = row ? lse[((long long)b * Hq + h) * Sq + i] : (A)-INFINITY;
    const bool live = row && isfinite(lse_i);
    A qr[E], dor[E], acc[E], delta_i = 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        qr[e] = row ? (A)q[at_q + lane + L * e] * scale : (A)0;
        dor[e] = row ? (A)dout[at_q + lane + L * e] : (A)0;
        delta_i += row ? dor[e] * (A)out[at_q + lane + L * e] : (A)0;
        acc[e] = 0;
    }
    delta_i = lanes_sum<L>(delta_i);
    if (row && lane == 0) delta[((long long)b * Hq + h) * Sq + i] = delta_i;
    const KeyWalk w = key_walk<L>(first, stop, i, row, b, Sq, Sk, q_off, k_off, causal, window, BN,
                                  lo, hi);
    for (long long k0 = w.beg; k0 < w.end; k0 += BN) {
        load_rows<T, D, BN>(k, ks, kv_base, (long long)Hkv * D, k0, Sk);
        load_rows<T, D, BN>(v, vs, kv_base, (long long)Hkv * D, k0, Sk);
        __syncthreads();
        const int n = (int)min(min((long long)BN, w.end - k0), w.wend - k0);
        for (int jj = (int)max(0LL, w.wbeg - k0); jj < n; ++jj) {
            A s = 0, dp = 0;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                s += qr[e] * (A)ks[jj][lane + L * e];
                dp += dor[e] * (A)vs[jj][lane + L * e];
            }
            s = lanes_sum<L>(s);
            dp = lanes_sum<L>(dp);
            if (live && visible(i, k0 + jj, q_off, k_off, causal, window) && k0 + jj >= w.rlo
                    && k0 + jj < w.rhi) {
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


def launch_config(head_dim: int, itemsize: int, documents: bool = False) -> tuple[int, int, int]:
    """(lanes per row, tile rows, threads per block) of the kernels the attention calls launch:
    `flash_config` with `_THREADS`, or with packed documents `_DOC_THREADS` and `_DOC_TILE`.
    Pure."""
    lanes, tile = flash_config(head_dim, itemsize)
    if not documents:
        return lanes, tile, _THREADS
    return lanes, min(_DOC_TILE or tile, tile), _DOC_THREADS


def block_rows(head_dim: int, itemsize: int, documents: bool = False) -> int:
    """Rows (queries; dk/dv: keys) a block of the launched kernels owns: threads / lanes. Pure."""
    lanes, _, threads = launch_config(head_dim, itemsize, documents)
    return threads // lanes


def _kernel_names(ctype: str, head_dim: int, documents: bool) -> tuple[str, ...]:
    """Name expressions of forward, dq and dk/dv for one (C type, head_dim), plain or documents."""
    lanes, tile, threads = launch_config(head_dim, 8 if ctype == "double" else 4, documents)
    return tuple(f"{k}<{ctype},{ctype},{head_dim},{lanes},{tile},{threads}>"
                 for k in _FLASH_KERNELS)


def _flash_names(ctype: str, head_dim: int) -> tuple[str, ...]:
    """Name expressions of one flash module: the plain kernels, then the document kernels where
    their configuration differs."""
    names = _kernel_names(ctype, head_dim, False)
    return names + tuple(n for n in _kernel_names(ctype, head_dim, True) if n not in names)


@functools.cache
def _flash_module(ctype: str, head_dim: int) -> Any:
    """The flash RawModule of one (C type, head_dim), compiled on first use (a second or less;
    every instantiation in one module took 36.5 s)."""
    return array_module().RawModule(code=_FLASH, options=_OPTIONS,
                                    name_expressions=_flash_names(ctype, head_dim))


def _flash(name: str, dtype: Any, head_dim: int, documents: bool = False
           ) -> tuple[Any, int, int]:
    """(the kernel `name` for this dtype and head width, plain or with packed documents, rows
    per block, threads per block)."""
    require(head_dim in HEAD_DIMS, f"{name}: head_dim={head_dim} must be one of {HEAD_DIMS} "
                                   f"on the GPU")
    c = ctype(dtype)
    itemsize = 8 if c == "double" else 4
    kernel = _kernel_names(c, head_dim, documents)[_FLASH_KERNELS.index(name)]
    return (_flash_module(c, head_dim).get_function(kernel),
            block_rows(head_dim, itemsize, documents), launch_config(head_dim, itemsize, documents)[2])


def _flash_args(q: Array, k: Array, q_offset: int, k_offset: int, causal: bool,
                scale: float | None, acc: Any, window: int = 0) -> tuple:
    cupy = array_module()
    b, sq, hq, d = q.shape
    return (cupy.int32(sq), cupy.int32(k.shape[1]), cupy.int32(hq), cupy.int32(k.shape[2]),
            cupy.int64(q_offset), cupy.int64(k_offset), cupy.int32(bool(causal)),
            cupy.int64(window), acc.type(ref.attention_scale(d, scale)))


def _blocks(mine: np.ndarray, other: np.ndarray, rows: int) -> tuple[np.ndarray, ...]:
    """(lo, hi, starts) of one side's blocks: lo, hi `[B, n]` the other side's positions [lo, hi)
    of each position's document, starts the blocks of at most ``rows`` positions aligned to the
    document starts (`document_spans.document_blocks`, the CPU kernels' own cut), so that a short
    document is one small tile and a block reads only its documents' keys."""
    from .document_spans import document_blocks, document_bounds

    b, n = mine.shape
    lo, hi, end = document_bounds(mine, other, b, n, other.shape[1])
    return lo, hi, document_blocks(end, rows)[0]


def score_entries(sq: int, sk: int, head_dim: int, itemsize: int, q_offset: int = 0,
                  k_offset: int = 0, causal: bool = True, window: int = 0,
                  q_docs: Array | None = None, k_docs: Array | None = None) -> int:
    """Query-key scores the forward kernel computes for one head of the rows of `q_docs`
    `[B, Sq]` / `k_docs` `[B, Sk]` (one sequence without documents), summed: each warp's rows
    times the keys its loop walks (`warp_span`'s bounds within its block's key tiles). A
    host-side count of the kernel's own loops (the analogue of `attention_cpu.tile_work`); the
    backward's two kernels walk the same spans from either side. Pure: no CuPy."""
    rows = block_rows(head_dim, itemsize, q_docs is not None)
    per_warp = 32 // flash_config(head_dim, itemsize)[0]
    if q_docs is None:          # the fixed grid, every key
        lo, hi = np.zeros((1, sq), np.int64), np.full((1, sq), sk, np.int64)
        starts = np.append(np.arange(0, sq, rows), sq)[None]
    else:
        lo, hi, starts = _blocks(np.asarray(q_docs), np.asarray(k_docs), rows)
    total = 0
    for b in range(lo.shape[0]):
        cut = np.unique(starts[b])
        for first, stop in zip(cut[:-1], cut[1:]):
            w0 = np.arange(first, stop, per_warp)
            w1 = np.minimum(stop, w0 + per_warp) - 1
            beg, end = np.zeros_like(w0), np.full_like(w0, sk)
            if causal:
                end = np.minimum(end, q_offset + w1 - k_offset + 1)
                if window:
                    beg = np.maximum(beg, q_offset + w0 - (window - 1) - k_offset)
            beg, end = np.maximum(beg, lo[b, w0]), np.minimum(end, hi[b, w1])
            total += int((per_warp * np.maximum(0, end - beg)).sum())
    return total


def document_tables(q_docs: Array, k_docs: Array, head_dim: int, dtype: Any) -> dict:
    """The flash kernels' packed-document arguments for document ids ``q_docs`` `[B, Sq]`,
    ``k_docs`` `[B, Sk]` (host or device, non-decreasing along each row) at one head width and
    dtype: {"q": the forward's and dq's (query blocks), "k": dk/dv's (key blocks)}, each
    ((lo, hi, starts, columns of starts), blocks per sequence), in device memory (one copy).
    Found on the host; the attention seam keeps them for a microbatch's layers
    (`mpipar.model.attention.kernel_documents`), so that each layer pays no host work for them."""
    cupy = array_module()
    host = [host_array(a) for a in (q_docs, k_docs)]
    require(host[0].ndim == 2 and host[1].ndim == 2 and host[0].shape[0] == host[1].shape[0],
            f"attention: q_docs {host[0].shape} and k_docs {host[1].shape} must be [B, Sq] and "
            f"[B, Sk]")
    rows = block_rows(head_dim, np.dtype(dtype).itemsize, documents=True)
    parts = [*_blocks(host[0], host[1], rows), *_blocks(host[1], host[0], rows)]
    views = device_views(parts)
    side = lambda v, starts: ((*v, cupy.int32(starts.shape[1])),  # noqa: E731
                              max(1, starts.shape[1] - 1))
    return {"q": side(views[:3], parts[2]), "k": side(views[3:], parts[5]), "rows": rows}


def _documents(tables: dict | None, side: str, n: int, rows: int) -> tuple[tuple, int]:
    """One kernel's packed-document arguments and blocks: ``tables[side]`` ("q" or "k"), whose
    blocks must have been cut for the kernel's ``rows`` (a table cut for larger blocks would
    leave rows unwritten), or without documents null pointers and the fixed grid of n rows."""
    if tables is not None:
        require(tables.get("rows") == rows,
                f"attention: document tables cut for {tables.get('rows')}-row blocks, the "
                f"kernel's blocks hold {rows} rows (tables found before _DOC_THREADS changed?)")
        return tables[side]
    cupy = array_module()
    return (cupy.uint64(0), cupy.uint64(0), cupy.uint64(0), cupy.int32(0)), -(-n // rows)


def _tables(q_docs: Array | None, k_docs: Array | None, tables: dict | None, head_dim: int,
            dtype: Any) -> dict | None:
    """``tables`` as given, else found for the ids (None without documents)."""
    if tables is not None:
        return tables
    if q_docs is None and k_docs is None:
        return None
    require(q_docs is not None and k_docs is not None, "attention: q_docs and k_docs go together")
    return document_tables(q_docs, k_docs, head_dim, dtype)


def attention_fwd(q: Array, k: Array, v: Array, q_offset: int = 0, k_offset: int = 0,
                  causal: bool = True, scale: float | None = None, window: int = 0,
                  q_docs: Array | None = None, k_docs: Array | None = None,
                  tables: dict | None = None) -> tuple[Array, Array]:
    """Flash attention forward (`numpy_ref.attention_fwd`'s contract, sliding `window` and
    packed documents included: ids `q_docs` `[B, Sq]`, `k_docs` `[B, Sk]`, non-decreasing along
    each row; ``tables``: their `document_tables`, if already found): q `[B, Sq, Hq, D]`, k, v
    `[B, Sk, Hkv, D]` -> out like q, lse `[B, Hq, Sq]` (float32; float64 for float64). Key tiles
    wholly outside a block's keys are not loaded and each warp skips the keys its rows do not
    see; with documents the query blocks follow them, so a row of short documents costs about
    its documents' own causal squares, in one launch."""
    ref.check_attention_shapes(q, k, v, "attention_fwd")
    ref.check_window(window, causal, "attention_fwd")
    device_float(q, "attention_fwd")
    cupy = array_module()
    q, k, v = (cupy.ascontiguousarray(a, q.dtype) for a in (q, k, v))
    b, sq, hq, d = q.shape
    acc = cupy.dtype(ref.stat_dtype(q.dtype))
    out, lse = cupy.empty_like(q), cupy.empty((b, hq, sq), acc)
    if sq and b * hq:
        tables = _tables(q_docs, k_docs, tables, d, q.dtype)
        kernel, rows, threads = _flash("flash_fwd", q.dtype, d, tables is not None)
        docs, blocks = _documents(tables, "q", sq, rows)
        kernel((blocks, b * hq), (threads,), (
            q, k, v, out, lse, *_flash_args(q, k, q_offset, k_offset, causal, scale, acc, window),
            *docs))
    return out, lse


def attention_bwd(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                  q_offset: int = 0, k_offset: int = 0, causal: bool = True,
                  scale: float | None = None, window: int = 0, q_docs: Array | None = None,
                  k_docs: Array | None = None, tables: dict | None = None, grad_dtype: Any = None
                  ) -> tuple[Array, Array, Array]:
    """Flash attention backward for one key block given the (possibly ring-merged) out and lse
    (`numpy_ref.attention_bwd`'s contract, packed documents and ``grad_dtype`` included): q, out,
    dout `[B, Sq, Hq, D]`, k, v `[B, Sk, Hkv, D]`, lse `[B, Hq, Sq]` -> dq like q, dk, dv like k; dq
    by query rows, dk and dv by key rows (summed over each kv head's query heads), without
    atomics; with documents, blocks of query rows and of key rows that follow them. The dq
    kernel finds delta = rowsum(dout * out) for its rows and leaves it to the dk/dv kernel: two
    launches in all, no separate reductions (each a launch and a host round trip, which weigh
    on short calls such as a row of short documents)."""
    ref.check_attention_shapes(q, k, v, "attention_bwd")
    ref.check_window(window, causal, "attention_bwd")
    b, sq, hq, d = q.shape
    require(out.shape == q.shape and dout.shape == q.shape and lse.shape == (b, hq, sq),
            f"attention_bwd: out {out.shape}, dout {dout.shape} must be {q.shape} and lse "
            f"{lse.shape} must be {(b, hq, sq)}")
    device_float(q, "attention_bwd")
    grads = ref.grad_dtype_of(q.dtype, grad_dtype)
    cupy = array_module()
    acc = cupy.dtype(ref.stat_dtype(q.dtype))
    q, k, v, dout = (cupy.ascontiguousarray(a, q.dtype) for a in (q, k, v, dout))
    lse = cupy.ascontiguousarray(lse, acc)
    out = cupy.ascontiguousarray(out, q.dtype)
    delta = cupy.empty((b, hq, sq), acc)   # rowsum(dout * out), written by flash_bwd_dq
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    args = _flash_args(q, k, q_offset, k_offset, causal, scale, acc, window)
    tables = _tables(q_docs, k_docs, tables, d, q.dtype) if sq and k.shape[1] else None
    if sq and b * hq:
        kernel, rows, threads = _flash("flash_bwd_dq", q.dtype, d, tables is not None)
        docs, blocks = _documents(tables, "q", sq, rows)
        kernel((blocks, b * hq), (threads,), (q, k, v, dout, out, lse, delta, dq, *args, *docs))
    if k.shape[1] and b * k.shape[2]:
        kernel, rows, threads = _flash("flash_bwd_dkdv", q.dtype, d, tables is not None)
        docs, blocks = _documents(tables, "k", k.shape[1], rows)
        kernel((blocks, b * k.shape[2]), (threads,),
               (q, k, v, dout, lse, delta, dk, dv, *args, *docs))
    return dq.astype(grads, copy=False), dk.astype(grads, copy=False), dv.astype(grads, copy=False)


attention_fwd.block_sparse_documents = attention_bwd.block_sparse_documents = True
attention_fwd.document_tables = attention_bwd.document_tables = document_tables


def cuda_sources() -> list[dict]:
    """One flash module per (dtype, head_dim) with its three kernels, for
    `mpipar.kernels.cuda_gate` (through `cupy_gpu.cuda_sources`). Pure."""
    return [{"name": f"cupy_gpu.flash<{t},{d}>", "code": _FLASH, "names": _flash_names(t, d),
             "options": _OPTIONS, "dynamic_smem": {n: 0 for n in _flash_names(t, d)}}
            for t in ("float", "double") for d in HEAD_DIMS]
