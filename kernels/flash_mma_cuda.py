"""The CUDA source of mpipar's bf16 flash attention (`flash_mma` compiles and launches it).
Header-free (NVRTC 13 has no `<mma.h>`): first the tensor-core building blocks (`cp.async`
16-byte copies into shared memory with `load_tile`, `ldmatrix` fragment loads,
`mma.sync.m16n8k16` bf16 -> float32, bf16x2 packing, `ex2.approx`; `gemm_abt`: S = A B^T from
shared memory; `gemm_ab`: O += P B with P as A fragments in registers and B through
`ldmatrix.trans`; `to_a`: C fragments into A fragments), then the masks and the kernels.
Compute capability >= 8.0 (bf16 mma.sync, cp.async).

The kernels:
- `flash_fwd<D, WARPS, MT, BK>`: a block owns 16 * MT * WARPS query rows of one head (each warp
  16 * MT rows); key/value tiles of BK rows stream through shared memory with `cp.async`, double
  buffered (tile t + 1 loads while tile t computes, one barrier per tile); S = Q K^T and
  O += P V are `mma.sync.m16n8k16` bf16 -> float32 with operands from `ldmatrix` (V through
  `ldmatrix.trans`); online softmax in the exp2 domain; P rounded to bf16 for the second GEMM (as
  FA2). Rows are padded by 16 bytes in shared memory, so every `ldmatrix` is bank-conflict free
  for every head dim. Key tiles wholly masked (after the causal diagonal, before the window) are
  never loaded; masks are evaluated only on tiles that cross a mask edge or the ragged end of Sk.
- backward, FA2's two passes, deterministic (no atomics): `flash_bwd_dq` (query-row blocks,
  dQ = scale * dS K) and `flash_bwd_dkdv` (key-row blocks, dV = P^T dO, dK = scale * dS^T Q,
  looping over the query tiles of every query head of its kv group, so the GQA sum stays in
  registers). The price is recomputing S and dP once more (7 GEMM passes instead of 5); the gains
  are bit-reproducible gradients, no zero-fill of dq, no float32 atomic traffic, and dq written
  once. Both write their gradients as `GradT`: float32 (the contract's default, for callers that sum
  them over ring steps) or bf16 (`grad_dtype`: rounded once in the kernel, the same bits as the
  caller's cast of the float32 result, and half the bytes, with no cast pass after). `attn_delta` computes D = rowsum(dout * out) in float32
  from the given (merged) out.
- Packed documents (optional; null pointers without): per query row the keys [klo, khi) of its
  document, per key row the queries [qlo, qhi) of its document (int32 `[B, S]`, non-decreasing
  along a row). A block's key (dk/dv: query) range narrows to its rows' documents; tiles that
  hold keys outside some row's document are masked per row; and each warp skips, without
  computing, the tiles its 16 rows cannot see (`slab_span`; skipping equals masking every
  entry, so results do not change, and plain causal tiles past a warp's diagonal are skipped
  the same way). A block's first key (dk/dv: query) tile starts at a multiple of the tile
  (`MPIPAR_DOC_TILES_ALIGNED` 1, the macro's default) or, with 0, at the first position its
  rows' documents hold (what `flash_mma.DOC_TILES_ALIGNED`, False by default, builds): fewer
  entries where a document starts mid-tile; loads and masks take any start (whole 16-byte rows;
  masks relative to the tile).
"""

from __future__ import annotations

SOURCE = r"""
#ifndef MPIPAR_DOC_TILES_ALIGNED
#define MPIPAR_DOC_TILES_ALIGNED 1
#endif
// mpipar's bf16 tensor-core tiles: mma.sync m16n8k16 (bf16 -> f32), ldmatrix, cp.async.
// Header-free (NVRTC 13 has no <mma.h>). Fragment conventions (PTX ISA, m16n8k16): lane = 4 * g + c;
// A rows g, g + 8 and columns 2c, 2c + 1 (+ 8); B (k x n, "col") rows 2c, 2c + 1 (+ 8) of column
// g; C rows g, g + 8, columns 2c, 2c + 1. Shared-memory rows hold D + 8 bf16 (16 bytes of
// padding: conflict-free ldmatrix).
typedef unsigned int u32;
typedef unsigned short bf16_t;

__device__ __forceinline__ u32 sptr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, asynchronously; zero-filled when !valid (src must still be mapped).
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}
__device__ __forceinline__ void ldsm4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm2(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldsm4t(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// c += a (16 x 16, row) * b (16 x 8, col), bf16 in, float32 accumulate.
__device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats -> bf16x2 (round to nearest even), lo in the low half.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// Two adjacent gradient elements: float32 (a ring hop's part, summed by the caller) or bf16
// (rounded once, as the caller's cast would: a gradient kept as it is).
__device__ __forceinline__ void store2(float* p, float a, float b) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ __forceinline__ void store2(bf16_t* p, float a, float b) {
    *reinterpret_cast<u32*>(p) = pack2(a, b);
}
__device__ __forceinline__ float exp2a(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float lo_f(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float hi_f(u32 x) { return __uint_as_float(x & 0xffff0000u); }

// ROWS x D bf16 rows (row r at src + r * stride) -> shared (row stride D + 8); rows >= nvalid
// zero-filled. All NT threads of the block take part.
template <int ROWS, int D, int NT>
__device__ __forceinline__ void load_tile(u32 dst, const bf16_t* src, long long stride, int nvalid) {
    constexpr int C = D / 8, TOTAL = ROWS * C, ITERS = (TOTAL + NT - 1) / NT;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        int e = it * NT + (int)threadIdx.x;
        if (TOTAL % NT == 0 || e < TOTAL) {
            int r = e / C, cc = e % C;
            bool ok = r < nvalid;
            cp16(dst + (u32)((r * (D + 8) + cc * 8) * 2), src + (ok ? r : 0) * stride + cc * 8, ok);
        }
    }
}

// acc[n] (16 x 8 each, NS of them) += A (16 x D: fragments `a`, or with a == 0 rows of `abuf`)
// * B^T (rows of `bbuf`, D + 8 bf16 apart), i.e. S = Q K^T for a 16-row slab. NARROW: k steps of
// 16 (B through ldmatrix.x2), not 32: the same bytes read, 6 fewer fragment registers live.
template <int D, int NS, bool NARROW = false>
__device__ __forceinline__ void gemm_abt(float (*acc)[4], const u32 (*a)[4], u32 abuf, u32 bbuf,
                                         int lane) {
    constexpr int SROW = D + 8;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += NARROW ? 1 : 2) {
        u32 a0[4], a1[4];
        if (a == 0) {
            ldsm4(a0, abuf + (u32)(((lane & 15) * SROW + kk * 16 + (lane >> 4) * 8) * 2));
            if (!NARROW)
                ldsm4(a1, abuf + (u32)(((lane & 15) * SROW + kk * 16 + 16 + (lane >> 4) * 8) * 2));
        }
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            u32 b[4];
            if (NARROW)
                ldsm2(b, bbuf + (u32)(((n * 8 + (lane & 7)) * SROW + kk * 16) * 2)
                             + (u32)(((lane >> 3) & 1) * 16));
            else
                ldsm4(b, bbuf + (u32)(((n * 8 + (lane & 7)) * SROW + kk * 16 + (lane >> 3) * 8) * 2));
            mma(acc[n], a == 0 ? a0 : a[kk], b[0], b[1]);
            if (!NARROW) mma(acc[n], a == 0 ? a1 : a[kk + 1], b[2], b[3]);
        }
    }
}

// acc[dn] (16 x D as D/8 column tiles) += P (16 x K, K/16 packed bf16 A fragments) * B, B rows
// k (K of them) x D columns from shared through ldmatrix.trans — i.e. O += P V.
template <int D, int K>
__device__ __forceinline__ void gemm_ab(float (*acc)[4], const u32 (*p)[4], u32 bbuf, int lane) {
    constexpr int SROW = D + 8;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
#pragma unroll
        for (int dn = 0; dn < D / 8; dn += 2) {
            u32 b[4];
            ldsm4t(b, bbuf + (u32)(((kk * 16 + (lane & 15)) * SROW + dn * 8 + (lane >> 4) * 8) * 2));
            mma(acc[dn], p[kk], b[0], b[1]);
            mma(acc[dn + 1], p[kk], b[2], b[3]);
        }
    }
}

// The C fragments of a 16 x K slab (K/8 tiles) as K/16 bf16 A fragments.
template <int K>
__device__ __forceinline__ void to_a(u32 (*p)[4], const float (*s)[4]) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        p[kk][0] = pack2(s[2 * kk][0], s[2 * kk][1]);
        p[kk][1] = pack2(s[2 * kk][2], s[2 * kk][3]);
        p[kk][2] = pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        p[kk][3] = pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// mpipar bf16 flash attention, on the building blocks above.
// Layouts: q [B, Sq, Hq, D], k, v [B, Sk, Hkv, D] (bf16 bits, contiguous), lse [B, Hq, Sq];
// packed documents (optional, null without): klo, khi [B, Sq] the keys [klo, khi) of each
// query's document, qlo, qhi [B, Sk] the queries [qlo, qhi) of each key's document (int32,
// non-decreasing along a row).
#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)
#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

// The keys a query row i can see, as columns [*lo, *hi) of the tile starting at key k0, clamped
// to [0, n] (shift = q_off - k_off): causal keys j <= shift + i, windowed j > shift + i - W.
__device__ __forceinline__ void keys_seen(long long shift, int i, int k0, int Sk, int causal,
                                          long long window, int n, int* lo, int* hi) {
    long long e = causal ? min((long long)Sk, shift + i + 1) : (long long)Sk;
    long long s = causal && window > 0 ? shift + i - window + 1 : 0LL;
    *lo = (int)max(0LL, min((long long)n, s - k0));
    *hi = (int)max(0LL, min((long long)n, e - k0));
}

// The queries a key row j can see, as columns [*lo, *hi) of the tile starting at query i0,
// clamped to [0, n]: causal queries i >= j - shift, windowed i < j - shift + W.
__device__ __forceinline__ void queries_seen(long long shift, int j, int i0, int causal,
                                             long long window, int n, int* lo, int* hi) {
    long long s = causal ? j - shift : -(1LL << 40);
    long long e = causal && window > 0 ? j - shift + window : (1LL << 40);
    *lo = (int)max(0LL, min((long long)n, s - i0));
    *hi = (int)max(0LL, min((long long)n, e - i0));
}

// A 1-D grid of (query tile, batch, head) with the tile slowest and in reverse: every head's
// last (longest causal) tiles start first, and the heads sharing a kv head run side by side.
__device__ __forceinline__ void block_rows(int Sq, int Hq, int BQ, int* q0, int* h, int* b) {
    const int nqt = (Sq + BQ - 1) / BQ, bhc = gridDim.x / nqt, bh = blockIdx.x % bhc;
    *q0 = (nqt - 1 - (int)blockIdx.x / bhc) * BQ;
    *h = bh % Hq;
    *b = bh / Hq;
}

// Key range [kbeg, kend) a block of query rows [q0, qlast] can see; kbeg a multiple of BK.
__device__ __forceinline__ void key_range(int q0, int qlast, int Sk, long long shift, int causal,
                                          long long window, int BK, int* kbeg, int* kend) {
    long long e = causal ? min((long long)Sk, shift + qlast + 1) : (long long)Sk;
    long long s = 0;
    if (causal && window > 0) {
        s = max(0LL, shift + q0 - window + 1);
        s -= s % BK;
    }
    *kbeg = (int)min(s, (long long)Sk);
    *kend = (int)max(e, 0LL);
}

// Whether a [q0, q0 + BQ) x [k0, k0 + BK) tile crosses a mask edge (causal, window, end of Sk).
__device__ __forceinline__ bool tile_edge(int q0, int BQ, int k0, int BK, int Sk, long long shift,
                                          int causal, long long window) {
    return k0 + BK > Sk || (causal && (shift + q0 < k0 + BK - 1
                                      || (window > 0 && shift + q0 + BQ - 1 - k0 >= window)));
}

// Packed documents: the other side's positions [lo[r0], hi[r1]) that rows r0..r1 (< S) of
// sequence b see, narrowing [*beg, *end); no documents (lo null): unchanged. Rows' bounds do
// not decrease along a row, so the first row's lo and the last row's hi bound them all.
__device__ __forceinline__ void doc_span(const int* lo, const int* hi, int b, int S, int r0, int r1,
                                         int* beg, int* end) {
    if (lo == nullptr) return;
    const long long at = (long long)b * S;
    *beg = max(*beg, lo[at + r0]);
    *end = min(*end, hi[at + r1]);
}

// The other side's positions [*beg, *end) (clamped to [0, n]) that row r (< S) of this side
// sees. Keys (!queries): causal j <= shift + r, windowed j > shift + r - W. Queries: causal
// i >= r - shift, windowed i < r - shift + W. Then the row's document (lo, hi not null). Both
// bounds are non-decreasing in r, so rows r0..r1 see [beg(r0), end(r1)) at most (a warp's tile
// skipping) and every one of them sees [beg(r1), end(r0)) (tiles that need no mask).
__device__ __forceinline__ void row_span(bool queries, int r, int S, int n, long long shift,
                                         int causal, long long window, const int* lo,
                                         const int* hi, int b, int* beg, int* end) {
    long long s = 0, e = n;
    if (causal) {
        if (queries) {
            s = max(s, r - shift);
            if (window > 0) e = min(e, r - shift + window);
        } else {
            e = min(e, shift + r + 1);
            if (window > 0) s = max(s, shift + r - window + 1);
        }
    }
    if (lo != nullptr) {
        s = max(s, (long long)lo[(long long)b * S + r]);
        e = min(e, (long long)hi[(long long)b * S + r]);
    }
    *beg = (int)min(s, (long long)n);
    *end = (int)max(e, 0LL);
}

// The positions rows r0..r1 (r0 < S) see at most: [beg(r0), end(r1)) of `row_span`.
__device__ __forceinline__ void slab_span(bool queries, int r0, int r1, int S, int n,
                                          long long shift, int causal, long long window,
                                          const int* lo, const int* hi, int b, int* beg,
                                          int* end) {
    int unused;
    row_span(queries, r0, S, n, shift, causal, window, lo, hi, b, beg, &unused);
    row_span(queries, r1, S, n, shift, causal, window, lo, hi, b, &unused, end);
}

// Whether [beg, end) misses [o0, o0 + n).
__device__ __forceinline__ bool misses(int beg, int end, int o0, int n) {
    return end <= max(beg, o0) || beg >= o0 + n;
}

// Narrow a row's visible columns [*clo, *chi) of a tile starting at o0 to its document's.
__device__ __forceinline__ void doc_clip(const int* lo, const int* hi, long long at, int o0,
                                         int* clo, int* chi) {
    if (lo == nullptr) return;
    *clo = max(*clo, lo[at] - o0);
    *chi = min(*chi, hi[at] - o0);
}

template <int D, int WARPS, int MT, int BK, int MINB, bool QREG, bool DOCS>
__global__ void __launch_bounds__(WARPS * 32, MINB)
flash_fwd(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
          bf16_t* __restrict__ out, float* __restrict__ lse, int Sq, int Sk, int Hq, int Hkv,
          long long q_off, long long k_off, int causal, long long window, float scale_log2,
          const int* __restrict__ klo, const int* __restrict__ khi) {
    constexpr int BQ = 16 * MT * WARPS, NT = 32 * WARPS, SROW = D + 8, NS = BK / 8, ND = D / 8;
    static_assert(!QREG || MT == 1, "Q fragments stay in registers for one m-tile per warp only");
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* qs = reinterpret_cast<bf16_t*>(smem);  // [BQ][SROW]
    bf16_t* ks = qs + BQ * SROW;                    // [2][BK][SROW]
    bf16_t* vs = ks + 2 * BK * SROW;                // [2][BK][SROW]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int q0, h, b;
    block_rows(Sq, Hq, BQ, &q0, &h, &b);
    const int hk = h / (Hq / Hkv);
    const long long qstride = (long long)Hq * D, kstride = (long long)Hkv * D;
    const bf16_t* kg = k + (long long)b * Sk * kstride + (long long)hk * D;
    const bf16_t* vg = v + (long long)b * Sk * kstride + (long long)hk * D;
    const long long shift = q_off - k_off;
    const int qlast = min(Sq, q0 + BQ) - 1;
    int kbeg, kend, dlo = 0, dhi = Sk;   // [dlo, dhi): keys every row's document holds
    key_range(q0, qlast, Sk, shift, causal, window, BK, &kbeg, &kend);
    if (DOCS) {
        doc_span(klo, khi, b, Sq, q0, qlast, &kbeg, &kend);
        if (MPIPAR_DOC_TILES_ALIGNED) kbeg -= kbeg % BK;
        doc_span(klo, khi, b, Sq, qlast, q0, &dlo, &dhi);
    }
    const int ntiles = kend > kbeg ? (kend - kbeg + BK - 1) / BK : 0;

    load_tile<BQ, D, NT>(sptr(qs), q + ((long long)b * Sq + q0) * qstride + (long long)h * D,
                         qstride, Sq - q0);
    cp_commit();
    if (ntiles > 0) {
        load_tile<BK, D, NT>(sptr(ks), kg + kbeg * kstride, kstride, Sk - kbeg);
        load_tile<BK, D, NT>(sptr(vs), vg + kbeg * kstride, kstride, Sk - kbeg);
    }
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    u32 qf[QREG ? D / 16 : 1][4];
    if (QREG) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            ldsm4(qf[kk], sptr(qs) + (u32)(((warp * 16 + (lane & 15)) * SROW + kk * 16
                                            + (lane >> 4) * 8) * 2));
    }
    float o[MT][ND][4] = {}, m[MT][2], l[MT][2] = {};
    int sb[MT], se[MT];   // documents: keys each 16-row slab can see (empty past Sq)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = NEG_INF;
        const int r0 = q0 + (warp * MT + mt) * 16;
        sb[mt] = se[mt] = 0;
        if (DOCS && r0 < Sq)
            slab_span(false, r0, min(Sq, r0 + 16) - 1, Sq, Sk, shift, causal, window, klo, khi,
                      b, &sb[mt], &se[mt]);
    }
    for (int t = 0; t < ntiles; ++t) {
        const int k0 = kbeg + t * BK;
        cp_wait<0>();
        __syncthreads();  // tile t landed; every warp is done with tile t - 1's buffers
        if (t + 1 < ntiles) {
            const int nb = (t + 1) & 1;
            load_tile<BK, D, NT>(sptr(ks + nb * BK * SROW), kg + (k0 + BK) * kstride, kstride,
                                 Sk - k0 - BK);
            load_tile<BK, D, NT>(sptr(vs + nb * BK * SROW), vg + (k0 + BK) * kstride, kstride,
                                 Sk - k0 - BK);
        }
        cp_commit();
        const u32 kb = sptr(ks + (t & 1) * BK * SROW), vb = sptr(vs + (t & 1) * BK * SROW);
        const bool edge = tile_edge(q0, BQ, k0, BK, Sk, shift, causal, window)
                          || (DOCS && (k0 < dlo || k0 + BK > dhi));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const int rbase = (warp * MT + mt) * 16;
            if (DOCS && misses(sb[mt], se[mt], k0, BK)) continue;
            float s[NS][4] = {};
            gemm_abt<D, NS>(s, QREG ? qf : 0, sptr(qs + rbase * SROW), kb, lane);
            if (edge) {
#pragma unroll
                for (int rh = 0; rh < 2; ++rh) {
                    const int row = q0 + rbase + (lane >> 2) + rh * 8;
                    int lo, hi;
                    keys_seen(shift, row, k0, Sk, causal, window, BK, &lo, &hi);
                    if (DOCS && row < Sq) doc_clip(klo, khi, (long long)b * Sq + row, k0, &lo, &hi);
#pragma unroll
                    for (int n = 0; n < NS; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int c = n * 8 + (lane & 3) * 2 + e;
                            if (c < lo || c >= hi) s[n][2 * rh + e] = NEG_INF;
                        }
                }
            }
#pragma unroll
            for (int rh = 0; rh < 2; ++rh) {  // rows g and g + 8
                float mx = m[mt][rh];
#pragma unroll
                for (int n = 0; n < NS; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * rh], s[n][2 * rh + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mc = mx == NEG_INF ? 0.f : mx * scale_log2;
                const float corr = exp2a(m[mt][rh] * scale_log2 - mc);
                m[mt][rh] = mx;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < NS; ++n) {
                    s[n][2 * rh] = exp2a(fmaf(s[n][2 * rh], scale_log2, -mc));
                    s[n][2 * rh + 1] = exp2a(fmaf(s[n][2 * rh + 1], scale_log2, -mc));
                    sum += s[n][2 * rh] + s[n][2 * rh + 1];
                }
                l[mt][rh] = l[mt][rh] * corr + sum;
#pragma unroll
                for (int dn = 0; dn < ND; ++dn) {
                    o[mt][dn][2 * rh] *= corr;
                    o[mt][dn][2 * rh + 1] *= corr;
                }
            }
            u32 p[BK / 16][4];
            to_a<BK>(p, s);
            gemm_ab<D, BK>(o[mt], p, vb, lane);
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
            float sum = l[mt][rh];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const int row = q0 + (warp * MT + mt) * 16 + (lane >> 2) + rh * 8;
            if (row >= Sq) continue;
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            bf16_t* op = out + ((long long)b * Sq + row) * qstride + (long long)h * D + (lane & 3) * 2;
#pragma unroll
            for (int dn = 0; dn < ND; ++dn)
                *reinterpret_cast<u32*>(op + dn * 8) = pack2(o[mt][dn][2 * rh] * inv,
                                                             o[mt][dn][2 * rh + 1] * inv);
            if ((lane & 3) == 0)
                lse[((long long)b * Hq + h) * Sq + row] =
                    sum > 0.f ? m[mt][rh] * scale_log2 * LN2_F + logf(sum) : NEG_INF;
        }
}

// delta[b, h, i] = sum_d dout * out (float32), one warp per row of [B, Sq, Hq] rows.
template <int D>
__global__ void attn_delta(const bf16_t* __restrict__ out, const bf16_t* __restrict__ dout,
                           float* __restrict__ delta, int Sq, int Hq, long long rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const u32* o = reinterpret_cast<const u32*>(out + row * D);
    const u32* d = reinterpret_cast<const u32*>(dout + row * D);
    float acc = 0.f;
#pragma unroll
    for (int e = lane; e < D / 2; e += 32) {
        const u32 x = o[e], y = d[e];
        acc = fmaf(lo_f(x), lo_f(y), acc);
        acc = fmaf(hi_f(x), hi_f(y), acc);
    }
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, w);
    if (lane == 0) {
        const long long b = row / ((long long)Sq * Hq), rem = row % ((long long)Sq * Hq);
        delta[(b * Hq + rem % Hq) * Sq + rem / Hq] = acc;
    }
}

// log2-domain lse of a row for the backward: +inf where the row saw no key (P = 0 there).
__device__ __forceinline__ float lse2_of(float x) { return x == NEG_INF ? POS_INF : x * LOG2E_F; }

// dq = scale * dS K for 16 * WARPS query rows of one head, over the visible key tiles (BK rows).
template <int D, int WARPS, int BK, int MINB, bool QREG, bool DOCS, typename GradT>
__global__ void __launch_bounds__(WARPS * 32, MINB)
flash_bwd_dq(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
             const bf16_t* __restrict__ v, const bf16_t* __restrict__ dout,
             const float* __restrict__ lse, const float* __restrict__ delta, GradT* __restrict__ dq,
             int Sq, int Sk, int Hq, int Hkv, long long q_off, long long k_off, int causal,
             long long window, float scale_log2, float scale, const int* __restrict__ klo,
             const int* __restrict__ khi) {
    constexpr int BQ = 16 * WARPS, NT = 32 * WARPS, SROW = D + 8, NS = BK / 8, ND = D / 8, KD = D / 16;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* qs = reinterpret_cast<bf16_t*>(smem);  // [BQ][SROW]
    bf16_t* ds = qs + BQ * SROW;                    // [BQ][SROW] (dout)
    bf16_t* ks = ds + BQ * SROW;                    // [2][BK][SROW]
    bf16_t* vs = ks + 2 * BK * SROW;                // [2][BK][SROW]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int q0, h, b;
    block_rows(Sq, Hq, BQ, &q0, &h, &b);
    const int hk = h / (Hq / Hkv);
    const long long qstride = (long long)Hq * D, kstride = (long long)Hkv * D;
    const bf16_t* kg = k + (long long)b * Sk * kstride + (long long)hk * D;
    const bf16_t* vg = v + (long long)b * Sk * kstride + (long long)hk * D;
    const long long shift = q_off - k_off, qbase = ((long long)b * Sq + q0) * qstride + (long long)h * D;
    const int qlast = min(Sq, q0 + BQ) - 1;
    int kbeg, kend;
    key_range(q0, qlast, Sk, shift, causal, window, BK, &kbeg, &kend);
    if (DOCS) {
        doc_span(klo, khi, b, Sq, q0, qlast, &kbeg, &kend);
        if (MPIPAR_DOC_TILES_ALIGNED) kbeg -= kbeg % BK;
    }
    const int ntiles = kend > kbeg ? (kend - kbeg + BK - 1) / BK : 0;
    // Documents: the keys each row sees ([span[r][0], span[r][1]), none past Sq; in shared
    // memory, as registers are short), those this warp's rows see at most ([sb, se): other
    // tiles are skipped) and those all of them see ([eb, ee): tiles inside need no mask).
    __shared__ int span[DOCS ? BQ : 1][2];
    const int w0 = q0 + warp * 16, w1 = min(Sq, w0 + 16) - 1;
    int sb = 0, se = 0, eb = 0, ee = 0;
    if (DOCS) {
        if (lane < 16) {
            span[warp * 16 + lane][0] = span[warp * 16 + lane][1] = 0;
            if (w0 + lane < Sq)
                row_span(false, w0 + lane, Sq, Sk, shift, causal, window, klo, khi, b,
                         &span[warp * 16 + lane][0], &span[warp * 16 + lane][1]);
        }
        __syncwarp();
        if (w0 < Sq) {
            sb = span[warp * 16][0];
            ee = span[warp * 16][1];
            eb = span[warp * 16 + w1 - w0][0];
            se = span[warp * 16 + w1 - w0][1];
        }
    }

    load_tile<BQ, D, NT>(sptr(qs), q + qbase, qstride, Sq - q0);
    load_tile<BQ, D, NT>(sptr(ds), dout + qbase, qstride, Sq - q0);
    cp_commit();
    if (ntiles > 0) {
        load_tile<BK, D, NT>(sptr(ks), kg + kbeg * kstride, kstride, Sk - kbeg);
        load_tile<BK, D, NT>(sptr(vs), vg + kbeg * kstride, kstride, Sk - kbeg);
    }
    cp_commit();
    cp_wait<1>();
    __syncthreads();
    u32 qf[QREG ? KD : 1][4], df[QREG ? KD : 1][4];
    if (QREG) {
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            const u32 at = (u32)(((warp * 16 + (lane & 15)) * SROW + kk * 16 + (lane >> 4) * 8) * 2);
            ldsm4(qf[kk], sptr(qs) + at);
            ldsm4(df[kk], sptr(ds) + at);
        }
    }
    const int r0 = q0 + warp * 16 + (lane >> 2);
    float l2[2], dl[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        const int row = r0 + rh * 8;
        l2[rh] = row < Sq ? lse2_of(lse[((long long)b * Hq + h) * Sq + row]) : POS_INF;
        dl[rh] = row < Sq ? delta[((long long)b * Hq + h) * Sq + row] : 0.f;
    }
    float acc[ND][4] = {};
    for (int t = 0; t < ntiles; ++t) {
        const int k0 = kbeg + t * BK;
        cp_wait<0>();
        __syncthreads();
        if (t + 1 < ntiles) {
            const int nb = (t + 1) & 1;
            load_tile<BK, D, NT>(sptr(ks + nb * BK * SROW), kg + (k0 + BK) * kstride, kstride,
                                 Sk - k0 - BK);
            load_tile<BK, D, NT>(sptr(vs + nb * BK * SROW), vg + (k0 + BK) * kstride, kstride,
                                 Sk - k0 - BK);
        }
        cp_commit();
        if (DOCS && misses(sb, se, k0, BK)) continue;
        const u32 kb = sptr(ks + (t & 1) * BK * SROW), vb = sptr(vs + (t & 1) * BK * SROW);
        float s[NS][4] = {}, dp[NS][4] = {};
        gemm_abt<D, NS>(s, QREG ? qf : 0, sptr(qs + warp * 16 * SROW), kb, lane);
        gemm_abt<D, NS>(dp, QREG ? df : 0, sptr(ds + warp * 16 * SROW), vb, lane);
        int lo[2] = {0, 0}, hi[2] = {BK, BK};
        if (!DOCS) {
            if (tile_edge(q0, BQ, k0, BK, Sk, shift, causal, window)) {
                keys_seen(shift, r0, k0, Sk, causal, window, BK, &lo[0], &hi[0]);
                keys_seen(shift, r0 + 8, k0, Sk, causal, window, BK, &lo[1], &hi[1]);
            }
        } else if (k0 < eb || k0 + BK > ee) {
#pragma unroll
            for (int rh = 0; rh < 2; ++rh) {
                const int* sp = span[warp * 16 + (lane >> 2) + rh * 8];
                lo[rh] = max(0, sp[0] - k0);
                hi[rh] = max(0, min(BK, sp[1] - k0));
            }
        }
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = n * 8 + (lane & 3) * 2 + (e & 1);
                float p = exp2a(fmaf(s[n][e], scale_log2, -l2[e >> 1]));
                if (c < lo[e >> 1] || c >= hi[e >> 1]) p = 0.f;
                s[n][e] = p * (dp[n][e] - dl[e >> 1]);  // dS
            }
        u32 dsf[BK / 16][4];
        to_a<BK>(dsf, s);
        gemm_ab<D, BK>(acc, dsf, kb, lane);
    }
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        const int row = r0 + rh * 8;
        if (row >= Sq) continue;
        GradT* dp_ = dq + ((long long)b * Sq + row) * qstride + (long long)h * D + (lane & 3) * 2;
#pragma unroll
        for (int dn = 0; dn < ND; ++dn)
            store2(dp_ + dn * 8, acc[dn][2 * rh] * scale, acc[dn][2 * rh + 1] * scale);
    }
}

// Query tile t of a dk/dv block (Q, dO rows, their log2 lse and delta) into buffer `buf`.
template <int D, int BQ, int NT>
__device__ __forceinline__ void load_q_tile(bf16_t* qs, bf16_t* ds, float* ls, float* dls,
                                            const bf16_t* q, const bf16_t* dout, const float* lse,
                                            const float* delta, int b, int h, int i0, int Sq,
                                            int Hq) {
    const long long qstride = (long long)Hq * D, base = ((long long)b * Sq + i0) * qstride + (long long)h * D;
    load_tile<BQ, D, NT>(sptr(qs), q + base, qstride, Sq - i0);
    load_tile<BQ, D, NT>(sptr(ds), dout + base, qstride, Sq - i0);
    for (int e = threadIdx.x; e < BQ; e += NT) {
        const int i = i0 + e;
        const long long at = ((long long)b * Hq + h) * Sq + i;
        ls[e] = i < Sq ? lse2_of(lse[at]) : POS_INF;
        dls[e] = i < Sq ? delta[at] : 0.f;
    }
}

// dv = P^T dO, dk = scale * dS^T Q for 16 * WARPS key rows of one kv head, over the query tiles
// (BQ rows) of every query head of its group that can see them. Per query tile S^T, P, dV, then
// dP^T, dS, dK: P's bf16 fragments die before dP^T is made (fewer live registers: _TILES).
template <int D, int WARPS, int BQ, int MINB, bool NARROW, bool DOCS, typename GradT>
__global__ void __launch_bounds__(WARPS * 32, MINB)
flash_bwd_dkdv(const bf16_t* __restrict__ q, const bf16_t* __restrict__ k,
               const bf16_t* __restrict__ v, const bf16_t* __restrict__ dout,
               const float* __restrict__ lse, const float* __restrict__ delta,
               GradT* __restrict__ dk, GradT* __restrict__ dv, int Sq, int Sk, int Hq, int Hkv,
               long long q_off, long long k_off, int causal, long long window, float scale_log2,
               float scale, const int* __restrict__ qlo, const int* __restrict__ qhi) {
    constexpr int BKV = 16 * WARPS, NT = 32 * WARPS, SROW = D + 8, NQ = BQ / 8, ND = D / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    bf16_t* ks = reinterpret_cast<bf16_t*>(smem);  // [BKV][SROW]
    bf16_t* vs = ks + BKV * SROW;                   // [BKV][SROW]
    bf16_t* qs = vs + BKV * SROW;                   // [2][BQ][SROW]
    bf16_t* ds = qs + 2 * BQ * SROW;                // [2][BQ][SROW] (dout)
    float* ls = reinterpret_cast<float*>(ds + 2 * BQ * SROW);  // [2][BQ] log2 lse
    float* dls = ls + 2 * BQ;                                   // [2][BQ] delta
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nkt = (Sk + BKV - 1) / BKV, bh = blockIdx.x % (gridDim.x / nkt), G = Hq / Hkv;
    const int k0 = blockIdx.x / (gridDim.x / nkt) * BKV, hk = bh % Hkv, b = bh / Hkv;
    const long long kstride = (long long)Hkv * D, shift = q_off - k_off;
    const long long kbase = ((long long)b * Sk + k0) * kstride + (long long)hk * D;
    // Queries that can see a key of [k0, klast]: causal from shift + i >= k0, window until
    // shift + i - klast < W; with documents, within [qlo[k0], qhi[klast]).
    const int klast = min(Sk, k0 + BKV) - 1;
    long long qb = causal ? max(0LL, (long long)k0 - shift) : 0LL;
    long long qe = causal && window > 0 ? min((long long)Sq, klast - shift + window) : (long long)Sq;
    int dlo = 0, dhi = Sq;   // [dlo, dhi): queries every key's document holds
    if (DOCS) {
        qb = max(qb, (long long)qlo[(long long)b * Sk + k0]);
        qe = min(qe, (long long)qhi[(long long)b * Sk + klast]);
        doc_span(qlo, qhi, b, Sk, klast, k0, &dlo, &dhi);
    }
    if (!DOCS || MPIPAR_DOC_TILES_ALIGNED) qb -= qb % BQ;
    qb = min(qb, (long long)Sq);
    const int qbeg = (int)qb, ntq = qe > qb ? (int)((qe - qb + BQ - 1) / BQ) : 0, total = G * ntq;

    load_tile<BKV, D, NT>(sptr(ks), k + kbase, kstride, Sk - k0);
    load_tile<BKV, D, NT>(sptr(vs), v + kbase, kstride, Sk - k0);
    cp_commit();
    if (total > 0)
        load_q_tile<D, BQ, NT>(qs, ds, ls, dls, q, dout, lse, delta, b, hk * G, qbeg, Sq, Hq);
    cp_commit();
    float dka[ND][4] = {}, dva[ND][4] = {};
    const u32 kw = sptr(ks + warp * 16 * SROW), vw = sptr(vs + warp * 16 * SROW);
    const int kr0 = k0 + warp * 16 + (lane >> 2), w0 = k0 + warp * 16;
    int sb = 0, se = 0;   // documents: queries this warp's keys can see (none past Sk)
    if (DOCS && w0 < Sk)
        slab_span(true, w0, min(Sk, w0 + 16) - 1, Sk, Sq, shift, causal, window, qlo, qhi, b,
                  &sb, &se);
    for (int t = 0; t < total; ++t) {
        const int i0 = qbeg + (t % ntq) * BQ, buf = t & 1;
        cp_wait<0>();
        __syncthreads();
        if (t + 1 < total) {
            const int nb = (t + 1) & 1;
            load_q_tile<D, BQ, NT>(qs + nb * BQ * SROW, ds + nb * BQ * SROW, ls + nb * BQ,
                                   dls + nb * BQ, q, dout, lse, delta, b, hk * G + (t + 1) / ntq,
                                   qbeg + ((t + 1) % ntq) * BQ, Sq, Hq);
        }
        cp_commit();
        if (DOCS && misses(sb, se, i0, BQ)) continue;
        const u32 qb_ = sptr(qs + buf * BQ * SROW), db = sptr(ds + buf * BQ * SROW);
        float s[NQ][4] = {};
        gemm_abt<D, NQ, NARROW>(s, 0, kw, qb_, lane);  // S^T = K Q^T (keys x queries)
        int lo[2] = {0, 0}, hi[2] = {BQ, BQ};
        if (!DOCS) {
            if (causal && (shift + i0 < k0 + BKV - 1 || (window > 0 && shift + i0 + BQ - 1 - k0 >= window))) {
                queries_seen(shift, kr0, i0, causal, window, BQ, &lo[0], &hi[0]);
                queries_seen(shift, kr0 + 8, i0, causal, window, BQ, &lo[1], &hi[1]);
            }
        } else if ((causal && (shift + i0 < k0 + BKV - 1
                               || (window > 0 && shift + i0 + BQ - 1 - k0 >= window)))
                   || i0 < dlo || i0 + BQ > dhi) {
#pragma unroll
            for (int rh = 0; rh < 2; ++rh) {
                queries_seen(shift, kr0 + rh * 8, i0, causal, window, BQ, &lo[rh], &hi[rh]);
                if (kr0 + rh * 8 < Sk)
                    doc_clip(qlo, qhi, (long long)b * Sk + kr0 + rh * 8, i0, &lo[rh], &hi[rh]);
            }
        }
        const float *lt = ls + buf * BQ, *dt = dls + buf * BQ;
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
            const int c = n * 8 + (lane & 3) * 2;
            const float2 lq = *reinterpret_cast<const float2*>(lt + c);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float p = exp2a(fmaf(s[n][e], scale_log2, -((e & 1) ? lq.y : lq.x)));
                if (c + (e & 1) < lo[e >> 1] || c + (e & 1) >= hi[e >> 1]) p = 0.f;
                s[n][e] = p;  // P^T
            }
        }
        u32 pf[BQ / 16][4];
        to_a<BQ>(pf, s);
        gemm_ab<D, BQ>(dva, pf, db, lane);  // dV += P^T dO
        float dp[NQ][4] = {};
        gemm_abt<D, NQ, NARROW>(dp, 0, vw, db, lane);  // dP^T = V dO^T
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
            const float2 dq_ = *reinterpret_cast<const float2*>(dt + n * 8 + (lane & 3) * 2);
#pragma unroll
            for (int e = 0; e < 4; ++e)  // dS^T = P^T (dP^T - delta), P in float32
                dp[n][e] = s[n][e] * (dp[n][e] - ((e & 1) ? dq_.y : dq_.x));
        }
        to_a<BQ>(pf, dp);
        gemm_ab<D, BQ>(dka, pf, qb_, lane);  // dK += dS^T Q
    }
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        const int row = kr0 + rh * 8;
        if (row >= Sk) continue;
        const long long at = ((long long)b * Sk + row) * kstride + (long long)hk * D + (lane & 3) * 2;
#pragma unroll
        for (int dn = 0; dn < ND; ++dn) {
            store2(dk + at + dn * 8, dka[dn][2 * rh] * scale, dka[dn][2 * rh + 1] * scale);
            store2(dv + at + dn * 8, dva[dn][2 * rh], dva[dn][2 * rh + 1]);
        }
    }
}
"""
