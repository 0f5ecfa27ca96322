"""Blockwise (flash-style) attention for the CPU: every inner product is a BLAS call on a tile.

Same contract as `numpy_ref.attention_fwd` / `attention_bwd` (grouped-query heads, causal
visibility with the global offsets of ring and zigzag blocks, the log-sum-exp that merges
blocks), float32 and float64, and bfloat16 by numpy_ref's mixed-precision recipe (upcast to
float32 once; out rounded to bf16 once, lse and the gradients float32). Outputs are new
C-contiguous arrays: out and dq `[B, Sq, Hq, D]`, dk and dv `[B, Sk, Hkv, D]`.

Tiles. A tile is `positions x keys` of one query head; the G = Hq / Hkv query heads that share a
kv head follow one another on the same key tile. Products read q, dout and write dq in place
(leading dimension Hq * D), the softmax scale in alpha: nothing is packed. Tiles are sized so
that each product (positions * keys * D multiply-adds) stays under OpenBLAS's small-matrix limit
(about 1e6): it then runs without packing its operands, in the L1/L2 caches, near a large
GEMM's speed (`python -m mpipar.bench kernels`). The score products Q K^T and dO V^T are
plain (NN) products on a transposed K (and V): the forward transposes K once per call (each key
block is read by many query blocks' tasks; rows padded to an odd number of cache lines, so that
a key block's rows do not all fall in one cache set), or each task the key blocks it reads: with
packed documents the blocks of documents of up to OWN_KEYS keys, without them every task when
they read each key only a few times (`key_plan`); the backward transposes each key block of K
and V when its task reaches it, into a buffer that stays in cache, and accumulates dK and dV
straight into the outputs (no O(S) passes: with short documents they cost as much as the tiles).

Causality and sliding windows. Key blocks past the last visible key, and with a sliding window
W key blocks before the first key the window reaches, are never computed; a tile that crosses
the diagonal or the window's edge is cut into row segments of SEGMENT positions, each
multiplied only with the range of keys its rows can see, so that at most about SEGMENT / 2 keys
per row and edge are computed in vain. `tile_work` counts the tiles and segments computed.

Packed documents (`q_docs`, `k_docs`: document ids, non-decreasing along each row). Each query
sees only the keys [klo, khi) of its own document (`document_spans.document_bounds`, once a call), a
third bound beside causality and the window that also grows with the position: the key range of
a query block, the query range of a key block (backward) and the row segments (which also end
at each document's end) shrink to the same-document pairs, so a tile with none is never computed
and a row of short documents costs about its documents' own causal squares, in one call. Blocks
are aligned to documents (`document_spans.document_blocks`): a document longer than a block gets nearly equal
blocks of its own, shorter ones are packed whole into a block, so that a short document is one
small causal tile (as if called alone) rather than pieces of a fixed grid's tiles.

Forward softmax. Each row keeps a reference value m (one of its own scores, taken in its first
visible tile) and accumulates l = sum exp(s - m) and acc = sum exp(s - m) v. There is no
per-tile maximum pass: a tile whose row sum exceeds SUM_LIMIT (a score far above m) is redone
for that row with its exact maximum, rescaling l and acc. Since m is a score of the row and
exp(s - m) stays below SUM_LIMIT, nothing overflows and no weight underflows that exact online
softmax would keep. out = acc / l, lse = m + log l.

Backward (flash-attention 2): one task per kv head and span of whole query documents (at most
SPAN positions, or one longer document; no other span's query sees its keys) walks the key blocks; for
each tile P = exp(s - lse), dP = dO V^T, dS = P (dP - delta) with delta = rowsum(dO * out),
then dV += P^T dO, dK += scale dS^T Q and dQ += scale dS K (five products per tile). A task's
dQ, delta rows and its owned keys' dK, dV rows are zeroed and filled just before its tiles
(`_own_rows`; no whole-array passes), by the first task of the span in a thread's run for all the
span's kv heads in that run, position by position: one run of memory, not one head's 256 bytes
every 1 KiB (backward 4-5 % faster on short documents). Rows and tiles are reached by address
(`_at`, `numba_simd.address`), not through views, which take a reference each.

Threads: tasks run in parallel (Numba prange); the tile products are too small for OpenBLAS to
thread, so each task's products run on its own thread. With short documents (forward) and in the
backward, the kv heads of a block (span) are consecutive tasks, which read the same rows of q, k,
v (measured: 15-20 % faster than each head's tasks in turn), and each thread takes one run of
consecutive tasks of equal work (`work_shares`), not an equal count: documents differ in length.
The forward's tasks that read one K^T (long documents, full causal) take a kv head's blocks one
after the other, also in runs of equal work.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import get_num_threads, njit, prange

from . import numpy_ref as ref
from .numba_simd import REORDER, address, row_at, tile_lanes, transpose_tile, vexp
from .numba_gemm import gemm
from .document_spans import document_blocks, document_bounds, visible_keys
from .numpy_ref import Array, require

POSITIONS = 64  # query positions per tile
SMALL_GEMM = 1 << 19  # positions * keys * head_dim of one tile product: under OpenBLAS's small-matrix limit
SEGMENT = 32  # query positions per row segment on the causal diagonal
OWN_KEYS = 2048  # forward, packed documents: a task reading at most this many keys transposes its own key blocks
SPAN = 256  # backward: the query documents packed whole into runs of at most this many positions
SUM_LIMIT = 1e12  # a tile row sum above this redoes the row with its exact maximum


def tile_sizes(head_dim: int) -> tuple[int, int]:
    """(query positions, keys) per tile for `head_dim`: keys a multiple of 16 in [16, 512]."""
    keys = SMALL_GEMM // (POSITIONS * head_dim) // 16 * 16
    return POSITIONS, min(512, max(16, keys))


# ----------------------------------------------------------------------------------------------
# Tile helpers (compiled)
# ----------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=False)
def _visible(causal, q_offset, k_offset, pos, j0, nk):  # pragma: no cover (njit)
    """End (exclusive, relative to j0) of the keys [j0, j0 + nk) the query at local position `pos`
    sees: the causal bound."""
    if not causal:
        return nk
    return max(0, min(nk, q_offset + pos - k_offset - j0 + 1))


@njit(cache=True, nogil=True, fastmath=False)
def _first(window, q_offset, k_offset, pos, j0, nk):  # pragma: no cover (njit)
    """Start (relative to j0) of the keys the query at local position `pos` sees: the window's
    bound (0 without a window)."""
    if window <= 0:
        return 0
    return max(0, min(nk, q_offset + pos - window + 1 - k_offset - j0))


@njit(cache=True, nogil=True, fastmath=False)
def _row_keys(causal, window, q_offset, k_offset, pos, j0, nk, klo, khi):  # pragma: no cover (njit)
    """[start, end) (relative to j0, within [0, nk]) of the keys [j0, j0 + nk) that the query at
    local position `pos` sees: causal, window and its document's keys [klo[pos], khi[pos])."""
    hi = max(0, min(_visible(causal, q_offset, k_offset, pos, j0, nk), khi[pos] - j0))
    lo = min(nk, max(_first(window, q_offset, k_offset, pos, j0, nk), klo[pos] - j0))
    return lo, hi


@njit(cache=True, nogil=True, fastmath=False)
def _even_step(n, most):  # pragma: no cover (njit)
    """Block size <= most (a multiple of 16) that cuts n into ceil(n / most) nearly equal blocks
    (rounded up to a multiple of 16), instead of full blocks and a short last one."""
    if n <= most:
        return most
    blocks = (n + most - 1) // most
    return min(most, ((n + blocks - 1) // blocks + 15) // 16 * 16)


@njit(cache=True, nogil=True, fastmath=False)
def _segments(causal, window, q_offset, k_offset, i0, nq, j0, nk, klo, khi, qend,
              seg):  # pragma: no cover (njit)
    """Cut the tile (queries [i0, i0 + nq), keys [j0, j0 + nk)) into row segments of at most
    SEGMENT positions that never cross a document end (qend): seg[s] = (first position, end
    position, first key, end key) for the positions that see any key, the keys being the union
    of what the segment's rows see (both bounds grow with the position); segments that see all
    nk keys are merged. Returns the number of segments (seg needs nq + 1 rows)."""
    n = 0
    t0 = 0
    while t0 < nq:
        t1 = min(nq, t0 + SEGMENT, qend[i0 + t0] - i0)
        c0 = _row_keys(causal, window, q_offset, k_offset, i0 + t0, j0, nk, klo, khi)[0]
        c1 = _row_keys(causal, window, q_offset, k_offset, i0 + t1 - 1, j0, nk, klo, khi)[1]
        if c1 > c0:
            if n > 0 and c0 == 0 and c1 == nk and seg[n - 1, 2] == 0 and seg[n - 1, 3] == nk \
                    and seg[n - 1, 1] == t0:
                seg[n - 1, 1] = t1
            else:
                seg[n, 0], seg[n, 1], seg[n, 2], seg[n, 3] = t0, t1, c0, c1
                n += 1
        t0 = t1
    return n


@njit(cache=True, nogil=True, fastmath=False)
def _key_range(causal, window, q_offset, k_offset, i0, nq, sk, klo, khi):  # pragma: no cover (njit)
    """[start, end) of the keys that the query positions [i0, i0 + nq) can see."""
    end = _row_keys(causal, window, q_offset, k_offset, i0 + nq - 1, 0, sk, klo, khi)[1]
    start = _row_keys(causal, window, q_offset, k_offset, i0, 0, sk, klo, khi)[0]
    return min(start, end), end


def tile_work(sq: int, sk: int, head_dim: int, q_offset: int = 0, k_offset: int = 0,
              causal: bool = True, window: int = 0, q_docs: Array | None = None,
              k_docs: Array | None = None) -> tuple[int, int]:
    """(tiles, score entries) the forward computes for one query head of the sequences of a
    `[Sq]` x `[Sk]` block (one sequence, or the rows of `q_docs` `[B, Sq]` and `k_docs`
    `[B, Sk]`, summed): what causal, window and document skipping leave of the Sq * Sk scores
    (a host-side count of the kernel's own loops)."""
    bq, bk = tile_sizes(head_dim)
    rows = 1 if q_docs is None else np.asarray(q_docs).shape[0]
    klo, khi, qend = document_bounds(q_docs, k_docs, rows, sq, sk)
    starts, nb = document_blocks(qend, bq)
    seg = np.empty((bq + 1, 4), np.int64)
    tiles = entries = 0
    for r in range(rows):
        for i0, i1 in zip(starts[r, :nb[r]], starts[r, 1:nb[r] + 1]):
            nq = int(i1 - i0)
            start, end = _key_range(causal, window, q_offset, k_offset, i0, nq, sk, klo[r], khi[r])
            step = _even_step(end - start, bk)
            for j0 in range(start, end, step):
                n = _segments(causal, window, q_offset, k_offset, i0, nq, j0, min(step, end - j0),
                              klo[r], khi[r], qend[r], seg)
                tiles += n > 0
                entries += int(((seg[:n, 1] - seg[:n, 0]) * (seg[:n, 3] - seg[:n, 2])).sum())
    return tiles, entries


@njit(cache=True, nogil=True, fastmath=REORDER)
def _exp_seg(p, shift):  # pragma: no cover (njit)
    """p = exp(p - shift) in place; returns the sum (p's dtype). The loop starts at 0: LLVM
    vectorised the same loop starting at a run-time index badly (the forward took 1.8x as
    long)."""
    total = p.dtype.type(0)
    sh = p.dtype.type(shift)
    for j in range(p.size):
        e = vexp(p[j] - sh)
        p[j] = e
        total += e
    return total


@njit(cache=True, nogil=True, fastmath=REORDER)
def _exp_row(p, t, start, lo, hi, end, shift):  # pragma: no cover (njit)
    """p[t, lo:hi] = exp(p[t, lo:hi] - shift) in place, p[t, start:lo] = p[t, hi:end] = 0; returns
    the sum (p's dtype)."""
    for j in range(start, lo):
        p[t, j] = 0
    for j in range(hi, end):
        p[t, j] = 0
    return _exp_seg(row_at(_at2(p, t, lo), hi - lo, p), shift)


@njit(cache=True, nogil=True, fastmath=REORDER)
def _row_max(p, t, lo, hi):  # pragma: no cover (njit)
    mx = p[t, lo]
    for j in range(lo + 1, hi):
        mx = max(mx, p[t, j])
    return mx


def _row_stride(n: int, itemsize: int) -> int:
    """Elements per row for rows of n elements: an odd number of whole 64-byte lines. A stride
    that is a multiple of 4 KiB (S = 1024, 2048...) puts a key block's 64 K^T rows in one L1
    cache set; odd counts spread them (full causal forward 0-10 % faster, `docs/benchmarks.md`)."""
    line = 64 // itemsize
    lines = -(-n // line)
    return (lines + 1 - lines % 2) * line


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _heads_major(x, ld, need):  # pragma: no cover (njit)
    """x `[B, S, H, D]` -> `[B, H, D, ld]` (C-contiguous, ld >= S: rows padded to `_row_stride`;
    of the S first columns those of the keys `need` `[B, S]` hold x, with the rest of their 16-key
    group; the others are not written), 16 keys at a time by `_key_block`."""
    nb, s, nh, d = x.shape
    y = np.empty((nb, nh, d, ld), x.dtype)
    for bh in prange(nb * nh):
        b, h = bh // nh, bh % nh
        for s0 in range(0, s, 16):
            if need[b, s0:s0 + 16].any():
                _key_block(x, b, h, s0, min(16, s - s0), y[b, h, :, s0:])
    return y


@njit(cache=True, nogil=True, fastmath=False)
def _at(x, b, i, h):  # pragma: no cover (njit)
    """The address of x[b, i, h(, 0)] in an array of 3 or 4 dims, by its strides (no reference)."""
    return address(x) + b * x.strides[0] + i * x.strides[1] + h * x.strides[2]


@njit(cache=True, nogil=True, fastmath=False)
def _at2(x, r, c):  # pragma: no cover (njit)
    """The address of x[r, c] in a 2-D array (a tile buffer), by its strides (no reference)."""
    return address(x) + r * x.strides[0] + c * x.strides[1]


@njit(cache=True, nogil=True, fastmath=False)
def _key_block(x, b, kh, j0, nk, xt):  # pragma: no cover (njit)
    """xt[:, :nk] = the keys [j0, j0 + nk) of kv head kh in sequence b of x `[B, Sk, Hkv, D]`,
    transposed `[D, nk]`, in cache for the products next: n x n tiles in vector registers
    (`transpose_tile`, n = 8 float32, 4 float64; 2.2x faster than element copies), the rest
    element by element."""
    d, isz = x.shape[3], x.itemsize
    single = isz == 4
    n = tile_lanes(single)
    sld, dld = x.strides[1] // isz, xt.strides[0] // isz
    full = d - d % n
    j = 0
    while j + n <= nk:
        src = _at(x, b, j0 + j, kh)
        for c in range(0, full, n):
            transpose_tile(src + c * isz, sld, _at2(xt, c, j), dld, single)
        for c in range(full, d):
            for u in range(n):
                xt[c, j + u] = x[b, j0 + j + u, kh, c]
        j += n
    for r in range(j, nk):
        for c in range(d):
            xt[c, r] = x[b, j0 + r, kh, c]


def _local_keys(klo: np.ndarray, khi: np.ndarray, bq: int) -> bool:
    """Without documents: whether the forward's tasks should transpose their own key blocks rather
    than read one K^T: when together they read each key at most 8 times (short sequences, narrow
    windows; full causal reads each Sq / (2 bq) times), which costs less than one pass over K."""
    sq, sk = klo.shape[1], max(1, int(khi.max(initial=1)))
    ends = np.minimum(np.arange(bq, sq + bq, bq), sq) - 1
    return int((khi[:, ends] - klo[:, ends - ends % bq]).sum()) <= 8 * sk * klo.shape[0]


def key_plan(klo: np.ndarray, khi: np.ndarray, starts: np.ndarray, bq: int, documents: bool,
             window: int) -> np.ndarray:
    """Which forward tasks transpose the key blocks they read themselves (`_key_block`, into a
    buffer that stays in cache) rather than read one K^T of the call (`_heads_major`):
    `[B, blocks]`, True for a query block of starts `[B, blocks + 1]` whose tasks do.

    With documents, a block whose documents hold at most OWN_KEYS keys (within the window's
    reach): each key is then transposed about length / 128 times, which costs less than one pass
    over the keys in K^T order (1024-token documents 4-6 % faster, 2048 the same; 8 rows of
    median-200 documents, forward 1.2x, `docs/benchmarks.md`). Longer documents' blocks read
    K^T. Without documents, every block or none (`_local_keys`). The two kinds run in their own
    orders (`_attention_fwd`)."""
    nb = starts.shape[1] - 1
    if not documents:
        return np.full((starts.shape[0], nb), _local_keys(klo, khi, bq))
    first, end = starts[:, :-1], starts[:, 1:]
    filled = end > first
    last = np.maximum(end - 1, 0)
    reach = np.take_along_axis(khi, last, 1) - np.take_along_axis(klo, np.minimum(first, last), 1)
    if window > 0:
        reach = np.minimum(reach, window + end - first)
    return ~filled | (reach <= OWN_KEYS)


def kt_keys(klo: np.ndarray, khi: np.ndarray, starts: np.ndarray, owned: np.ndarray, sk: int) -> np.ndarray:
    """The keys `[B, Sk]` that the blocks not `owned` (`key_plan`) read: their documents' keys,
    which hold every key their tasks read (within the causal bound and the window)."""
    b, qb = np.nonzero(~owned & (starts[:, 1:] > starts[:, :-1]))
    edges = np.zeros((klo.shape[0], sk + 1), np.int64)
    np.add.at(edges, (b, klo[b, starts[b, qb]]), 1)
    np.add.at(edges, (b, khi[b, starts[b, qb + 1] - 1]), -1)
    return np.cumsum(edges[:, :sk], axis=1) > 0


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=REORDER)
def _fwd_rows(p, t0, t1, i0, j0, c0, c1, causal, window, q_offset, k_offset, klo, khi, m, has_m, l, acc, g,
              qa, ldq, kta, ldk, scale):  # pragma: no cover (njit)
    """Softmax weights of tile rows [t0, t1) of one head over the tile's keys [c0, c1), in place
    in p[:, c0:c1] (scores in, weights out); updates its m[g], l[g], acc[g] `[group, positions(,
    D)]`. qa, ldq: its query row 0 and row stride, kta, ldk: K^T at key c0 (to redo a row)."""
    single = p.itemsize == 4
    d = acc.shape[2]
    width = c1 - c0
    for t in range(t0, t1):
        lo, hi = _row_keys(causal, window, q_offset, k_offset, i0 + t, j0, c1, klo, khi)
        lo, hi = max(c0, lo), max(c0, hi)
        if hi <= lo:
            for j in range(c0, c1):
                p[t, j] = 0
            continue
        if not has_m[g, t]:
            m[g, t] = _row_max(p, t, lo, min(hi, lo + 8))
            has_m[g, t] = True
        total = _exp_row(p, t, c0, lo, hi, c1, m[g, t])
        if not total <= SUM_LIMIT:  # a score far above m: redo the row with its exact maximum
            gemm(False, False, 1, width, d, scale, qa + t * ldq * p.itemsize, ldq, kta, ldk,
                 0.0, _at2(p, t, c0), width, single)
            mx = _row_max(p, t, lo, hi)
            corr = math.exp(m[g, t] - mx)
            l[g, t] *= corr
            for c in range(d):
                acc[g, t, c] *= corr
            m[g, t] = mx
            total = _exp_row(p, t, c0, lo, hi, c1, mx)
        l[g, t] += total


@njit(cache=True, nogil=True, fastmath=False)
def _fwd_task(q, kt, k, local, v, b, kh, i0, nq, q_offset, k_offset, causal, window, klo, khi, qend, scale,
              bk, out, lse):  # pragma: no cover (njit)
    """Queries [i0, i0 + nq) of the query heads of kv head kh in sequence b, over the keys they
    can see (klo, khi, qend: sequence b's `document_bounds`); K^T from kt `[B, Hkv, D, >= Sk]`
    (`_heads_major`), or with `local` each key block of k transposed here (`key_plan`)."""
    hq, d = q.shape[2], q.shape[3]
    hkv, sk = k.shape[2], k.shape[1]
    group = hq // hkv
    single, isz = q.itemsize == 4, q.itemsize
    acc = np.zeros((group, nq, d), q.dtype)
    m = np.zeros((group, nq))
    has_m = np.zeros((group, nq), np.bool_)
    l = np.zeros((group, nq))
    p = np.empty((nq, bk), q.dtype)
    seg = np.empty((nq + 1, 4), np.int64)
    kbuf = np.empty((d, bk), q.dtype)
    kstart, kend = _key_range(causal, window, q_offset, k_offset, i0, nq, sk, klo, khi)
    step = _even_step(kend - kstart, bk)
    for j0 in range(kstart, kend, step):
        nk = min(step, kend - j0)
        nseg = _segments(causal, window, q_offset, k_offset, i0, nq, j0, nk, klo, khi, qend, seg)
        if local and nseg > 0:
            _key_block(k, b, kh, j0, nk, kbuf)
        for g in range(group):
            qa = _at(q, b, i0, kh * group + g)
            for s in range(nseg):
                t0, t1, c0, c1 = seg[s, 0], seg[s, 1], seg[s, 2], seg[s, 3]
                kta, ldk = (_at2(kbuf, 0, c0), bk) if local else (_at(kt, b, kh, 0) + (j0 + c0) * isz, kt.shape[3])
                pa = _at2(p, t0, c0)
                gemm(False, False, t1 - t0, c1 - c0, d, scale, qa + t0 * hq * d * isz, hq * d, kta, ldk, 0.0,
                     pa, bk, single)
                _fwd_rows(p, t0, t1, i0, j0, c0, c1, causal, window, q_offset, k_offset, klo, khi, m, has_m, l,
                          acc, g, qa, hq * d, kta, ldk, scale)
                gemm(False, False, t1 - t0, d, c1 - c0, 1.0, pa, bk, _at(v, b, j0 + c0, kh), hkv * d, 1.0,
                     _at(acc, g, t0, 0), d, single)
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


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _attention_fwd(q, kt, k, owned, v, q_offset, k_offset, causal, window, klo, khi, qend, scale, starts,
                   shares, kt_shares, bk, out, lse):  # pragma: no cover (njit)
    """One task per (sequence, query block of `document_blocks`' starts `[B, nmax + 1]`, kv head),
    in two phases, each thread taking one run of consecutive tasks of equal work (`work_shares`,
    counting the phase's blocks only). First the blocks that transpose their own key blocks
    (`owned` `[B, nmax]`, `key_plan`), in order, the kv heads of a block one after the other
    (they read the same rows of q, k, v): thread w takes the tasks [shares[w], shares[w + 1]).
    Then those that read K^T (kt), in the order (sequence, kv head, block): a head's blocks one
    after the other, which read the same K^T rows; thread w takes [kt_shares[w],
    kt_shares[w + 1])."""
    hkv = k.shape[2]
    nqb = starts.shape[1] - 1
    for w in prange(shares.size - 1):
        for task in range(shares[w], shares[w + 1]):
            b, qb, kh = task // (nqb * hkv), (task // hkv) % nqb, task % hkv
            if owned[b, qb]:
                _fwd_block(q, kt, k, True, v, b, kh, qb, q_offset, k_offset, causal, window, klo, khi, qend,
                           scale, starts, bk, out, lse)
    for w in prange(kt_shares.size - 1):
        for task in range(kt_shares[w], kt_shares[w + 1]):
            b, kh, qb = task // (hkv * nqb), (task // nqb) % hkv, task % nqb
            if not owned[b, qb]:
                _fwd_block(q, kt, k, False, v, b, kh, qb, q_offset, k_offset, causal, window, klo, khi, qend,
                           scale, starts, bk, out, lse)


@njit(cache=True, nogil=True, fastmath=False)
def _fwd_block(q, kt, k, local, v, b, kh, qb, q_offset, k_offset, causal, window, klo, khi, qend, scale, starts,
               bk, out, lse):  # pragma: no cover (njit)
    """`_fwd_task` for query block qb of sequence b (none if the row has fewer blocks)."""
    i0 = starts[b, qb]
    if starts[b, qb + 1] > i0:
        _fwd_task(q, kt, k, local, v, b, kh, i0, starts[b, qb + 1] - i0, q_offset, k_offset, causal, window,
                  klo[b], khi[b], qend[b], scale, bk, out, lse)


def work_shares(rows: np.ndarray, starts: np.ndarray, heads: int, counted: np.ndarray | None = None,
                heads_outer: bool = False) -> np.ndarray:
    """Cut the tasks (sequence b, block i of starts `[B, n + 1]`, head; or with `heads_outer`
    sequence, head, block) into one run of consecutive tasks per thread, of nearly equal work:
    the keys seen by the block's rows `rows [B, S]` (`visible_keys`) plus 16 a row; with
    `counted` `[B, n]`, the blocks not counted weigh nothing (`_attention_fwd`'s two phases).
    Returns the runs' bounds `[threads + 1]`: consecutive tasks share rows in cache, equal work
    keeps the threads busy where equal counts do not (documents, and rows, differ in length)."""
    row = np.zeros((rows.shape[0], rows.shape[1] + 1), np.int64)
    np.cumsum(rows + 16, axis=1, out=row[:, 1:])
    block = np.diff(np.take_along_axis(row, np.asarray(starts, np.int64), axis=1), axis=1)
    if counted is not None:
        block = np.where(counted, block, 0)
    cost = np.tile(block, (1, heads)) if heads_outer else np.repeat(block, heads, axis=1)
    cum = np.zeros(cost.size + 1, np.int64)
    np.cumsum(cost, out=cum[1:])
    threads = get_num_threads()
    target = cum[-1] * np.arange(threads + 1) / threads
    bounds = np.minimum(np.searchsorted(cum, target), cum.size - 1)     # cum[bounds] >= target:
    lower = np.maximum(bounds - 1, 0)                                   # or the bound just below
    bounds = np.where(target - cum[lower] < cum[bounds] - target, lower, bounds)
    bounds[0], bounds[-1] = 0, cum.size - 1
    return bounds.astype(np.int64)


def _inputs(q: Array, k: Array, v: Array, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.dtype]:
    """Validate; q, k, v as C-contiguous arrays of q's dtype (float32 or float64)."""
    require(isinstance(q, np.ndarray) and q.dtype in (np.float32, np.float64),
            f"{name}: expected a float32 or float64 numpy array, got {type(q).__name__} "
            f"of dtype {getattr(q, 'dtype', None)}")
    ref.check_attention_shapes(q, k, v, name)
    dt = q.dtype
    return np.ascontiguousarray(q), np.ascontiguousarray(k, dt), np.ascontiguousarray(v, dt), dt


@ref.mixed_precision(0)
def attention_fwd(q: Array, k: Array, v: Array, q_offset: int = 0, k_offset: int = 0,
                  causal: bool = True, scale: float | None = None, window: int = 0,
                  q_docs: Array | None = None, k_docs: Array | None = None) -> tuple[Array, Array]:
    """Blockwise attention; same contract as `numpy_ref.attention_fwd` (sliding `window` and
    packed documents included: ids `q_docs` `[B, Sq]`, `k_docs` `[B, Sk]`, non-decreasing along
    each row; tiles with no same-document pair are skipped).

    q `[B, Sq, Hq, D]`, k, v `[B, Sk, Hkv, D]` -> out `[B, Sq, Hq, D]` (C-contiguous), lse `[B, Hq, Sq]`.
    """
    q, k, v, dt = _inputs(q, k, v, "attention_fwd")
    ref.check_window(window, causal, "attention_fwd")
    b, sq, hq, d = q.shape
    out = np.empty(q.shape, dt)
    lse = np.empty((b, hq, sq), ref.stat_dtype(dt))
    bq, bk = tile_sizes(d)
    klo, khi, qend = document_bounds(q_docs, k_docs, b, sq, k.shape[1])
    starts = document_blocks(qend, bq)[0]
    owned = key_plan(klo, khi, starts, bq, q_docs is not None, window)
    rows = visible_keys(klo, khi, q_offset, k_offset, causal, window)
    shares = work_shares(rows, starts, k.shape[2], owned)
    kt_shares = work_shares(rows, starts, k.shape[2], ~owned, heads_outer=True)
    kt = k if owned.all() else _heads_major(k, _row_stride(k.shape[1], k.itemsize),
                                            kt_keys(klo, khi, starts, owned, k.shape[1]))
    _attention_fwd(q, kt, k, owned, v, int(q_offset), int(k_offset), bool(causal), int(window),
                   klo, khi, qend, dt.type(ref.attention_scale(d, scale)), starts, shares, kt_shares, bk, out,
                   lse)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, fastmath=REORDER)
def _bwd_rows(p, dp, t0, t1, i0, j0, c0, c1, causal, window, q_offset, k_offset, klo, khi, lse, delta,
              b, h):  # pragma: no cover (njit)
    """Tile rows [t0, t1) of head h over the keys [c0, c1): p = exp(s - lse) in place of the
    scores s and dp = p * (dp - delta) in place of dP; both 0 outside each row's visible keys."""
    for t in range(t0, t1):
        lo, hi = _row_keys(causal, window, q_offset, k_offset, i0 + t, j0, c1, klo, khi)
        lo = max(c0, lo)
        hi = max(lo, hi)
        if lse[b, h, i0 + t] == -np.inf:
            hi = lo
        for j in range(c0, lo):
            p[t, j] = 0
            dp[t, j] = 0
        _grad_seg(row_at(_at2(p, t, lo), hi - lo, p), row_at(_at2(dp, t, lo), hi - lo, dp), lse[b, h, i0 + t],
                  delta[b, h, i0 + t])
        for j in range(hi, c1):
            p[t, j] = 0
            dp[t, j] = 0


@njit(cache=True, nogil=True, fastmath=REORDER)
def _grad_seg(p, dp, lse, delta):  # pragma: no cover (njit)
    """p = exp(p - lse), dp = p * (dp - delta) in place, from index 0 (see `_exp_seg`)."""
    sh, dl = p.dtype.type(lse), p.dtype.type(delta)
    for j in range(p.size):
        e = vexp(p[j] - sh)
        p[j] = e
        dp[j] = e * (dp[j] - dl)


@njit(cache=True, nogil=True, fastmath=REORDER)
def _own_rows(dout, out, b, kh0, kh1, q_lo, q_hi, k_lo, k_hi, delta, dq, dk, dv):  # pragma: no cover (njit)
    """Backward tasks' own rows, before their tiles: delta[b, h, t] = sum over D of dout * out
    (float64 sums), dq[b, t, h] = 0 for the query heads h of kv heads [kh0, kh1), queries [q_lo,
    q_hi); dk[b, j, kh] = dv[b, j, kh] = 0 for those kv heads' keys [k_lo, k_hi). A position's
    heads together (one run of memory); the rows are then in cache for the tasks' products."""
    d = dout.shape[3]
    group = dout.shape[2] // dk.shape[2]
    for t in range(q_lo, q_hi):
        for h in range(kh0 * group, kh1 * group):
            ar, br, qr = dout[b, t, h], out[b, t, h], dq[b, t, h]
            acc = 0.0
            for c in range(d):
                acc += ar[c] * br[c]
                qr[c] = 0
            delta[b, h, t] = acc
    for j in range(k_lo, k_hi):
        for kh in range(kh0, kh1):
            kr, vr = dk[b, j, kh], dv[b, j, kh]
            for c in range(d):
                kr[c] = 0
                vr[c] = 0


@njit(cache=True, nogil=True, fastmath=False)
def _bwd_task(q, k, v, lse, delta, dout, b, kh, q_offset, k_offset, causal, window, klo, khi, qend,
              scale, q_lo, q_hi, qstarts, qnb, kstarts, knb, dq, dk, dv):  # pragma: no cover (njit)
    """The gradients of kv head kh of sequence b from its queries [q_lo, q_hi) (a run of whole
    documents: they see no key that other queries see), accumulated (+=) into the zeroed dk, dv
    rows of that head and dq of its query heads (zeroed, and delta `[B, Hq, Sq]` = rowsum(dout *
    out) filled for its rows, by `_own_rows` just before); klo, khi, qend: sequence b's
    `document_bounds`; qstarts[:qnb + 1], kstarts[:knb + 1]: its query and key blocks
    (`document_blocks`)."""
    hq, d = q.shape[2], q.shape[3]
    hkv = k.shape[2]
    group = hq // hkv
    single = q.itemsize == 4
    ldq, ldk = hq * d, hkv * d  # row strides of one head in q, dout, dq and in k, dk, dv
    bq, bk = np.diff(qstarts[:qnb + 1]).max(), np.diff(kstarts[:knb + 1]).max()
    p = np.empty((bq, bk), q.dtype)
    dp = np.empty((bq, bk), q.dtype)
    kt = np.empty((d, bk), q.dtype)  # the key block's K^T and V^T
    vt = np.empty((d, bk), q.dtype)
    seg = np.empty((bq + 1, 4), np.int64)
    for kb in range(np.searchsorted(kstarts[:knb + 1], klo[q_lo], side="right") - 1, knb):
        j0, nk = kstarts[kb], kstarts[kb + 1] - kstarts[kb]
        first = max(q_lo, k_offset + j0 - q_offset) if causal else q_lo  # first query that sees key j0
        # Documents: queries whose document ends after key j0 (khi grows with the position).
        first = max(first, np.searchsorted(khi, j0, side="right"))
        if first >= q_hi:
            break
        # The window: no query past the last one whose window reaches key j0 + nk - 1; documents:
        # none whose document starts after the block's last key.
        last = min(q_hi, k_offset + j0 + nk - 1 + window - q_offset) if window > 0 else q_hi
        last = min(last, np.searchsorted(klo, j0 + nk - 1, side="right"))
        if last <= first:
            continue
        _key_block(k, b, kh, j0, nk, kt)
        _key_block(v, b, kh, j0, nk, vt)
        for qb in range(np.searchsorted(qstarts[:qnb + 1], first, side="right") - 1, qnb):
            i0 = max(q_lo, qstarts[qb])  # the block's rows within the span
            nq = min(q_hi, qstarts[qb + 1]) - i0
            if i0 >= last:
                break
            nseg = _segments(causal, window, q_offset, k_offset, i0, nq, j0, nk, klo, khi, qend, seg)
            for g in range(group):
                h = kh * group + g
                for s in range(nseg):
                    t0, t1, c0, c1 = seg[s, 0], seg[s, 1], seg[s, 2], seg[s, 3]
                    nr, w = t1 - t0, c1 - c0
                    pa, dpa, kta, vta = _at2(p, t0, c0), _at2(dp, t0, c0), _at2(kt, 0, c0), _at2(vt, 0, c0)
                    qa, doa = _at(q, b, i0 + t0, h), _at(dout, b, i0 + t0, h)
                    gemm(False, False, nr, w, d, scale, qa, ldq, kta, bk, 0.0, pa, bk, single)
                    gemm(False, False, nr, w, d, 1.0, doa, ldq, vta, bk, 0.0, dpa, bk, single)
                    _bwd_rows(p, dp, t0, t1, i0, j0, c0, c1, causal, window, q_offset, k_offset, klo, khi,
                              lse, delta, b, h)
                    gemm(True, False, w, d, nr, 1.0, pa, bk, doa, ldq, 1.0, _at(dv, b, j0 + c0, kh), ldk, single)
                    gemm(True, False, w, d, nr, scale, dpa, bk, qa, ldq, 1.0, _at(dk, b, j0 + c0, kh), ldk, single)
                    gemm(False, False, nr, d, w, scale, dpa, bk, _at(k, b, j0 + c0, kh), ldk, 1.0,
                         _at(dq, b, i0 + t0, h), ldq, single)


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _attention_bwd(q, k, v, out, lse, delta, dout, q_offset, k_offset, causal, window, klo, khi, qend, scale,
                   qstarts, qnb, kstarts, knb, spans, nspan, shares, dq, dk, dv):  # pragma: no cover (njit)
    """One task per (sequence, span of whole query documents (`document_blocks(..., whole=True)`),
    kv head), in that order: the kv heads of a span one after the other (they read the same
    rows); thread w takes the tasks [shares[w], shares[w + 1]) (`work_shares`). A task first
    fills delta and zeroes dq for its queries and heads and dk, dv for the keys it owns
    (`_own_rows`): from its first query's first key (key 0 for the row's first span) to the next
    span's (Sk for the last), which hold every key its queries see (klo, khi grow with the
    position and spans start at documents) and, together, every key of the row."""
    hkv, sk = k.shape[2], k.shape[1]
    ns = spans.shape[1] - 1
    for w in prange(shares.size - 1):
        for task in range(shares[w], shares[w + 1]):
            b, sp, kh = task // (ns * hkv), (task // hkv) % ns, task % hkv
            if sp < nspan[b]:
                q_lo, q_hi = spans[b, sp], spans[b, sp + 1]
                k_lo = 0 if sp == 0 else klo[b, q_lo]
                k_hi = sk if sp == nspan[b] - 1 else klo[b, q_hi]
                if kh == 0 or task == shares[w]:  # the span's heads in this run: their rows at once
                    _own_rows(dout, out, b, kh, min(hkv, kh + shares[w + 1] - task), q_lo, q_hi, k_lo, k_hi,
                              delta, dq, dk, dv)
                _bwd_task(q, k, v, lse, delta, dout, b, kh, q_offset, k_offset, causal, window, klo[b],
                          khi[b], qend[b], scale, q_lo, q_hi, qstarts[b], qnb[b], kstarts[b], knb[b], dq, dk, dv)


def _bwd_outputs(q_shape: tuple, k_shape: tuple, dt: np.dtype) -> tuple[np.ndarray, ...]:
    """dq `[B, Sq, Hq, D]`, dk, dv `[B, Sk, Hkv, D]` and delta `[B, Hq, Sq]`, uninitialised: the
    backward's tasks zero and fill the rows they own (`_own_rows`; tests poison them here)."""
    b, sq, hq, _ = q_shape
    return np.empty(q_shape, dt), np.empty(k_shape, dt), np.empty(k_shape, dt), np.empty((b, hq, sq), dt)


@ref.mixed_precision()
def attention_bwd(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                  q_offset: int = 0, k_offset: int = 0, causal: bool = True,
                  scale: float | None = None, window: int = 0, q_docs: Array | None = None,
                  k_docs: Array | None = None, grad_dtype: Any = None
                  ) -> tuple[Array, Array, Array]:
    """Blockwise flash-attention backward from the given (possibly merged) out and lse (sliding
    `window` and packed documents included, as `attention_fwd`).

    Same contract as `numpy_ref.attention_bwd`: dq `[B, Sq, Hq, D]`, dk, dv `[B, Sk, Hkv, D]`
    (C-contiguous; in ``grad_dtype`` when asked, `numpy_ref.grad_dtype_of`).
    """
    q, k, v, dt = _inputs(q, k, v, "attention_bwd")
    grads = ref.grad_dtype_of(dt, grad_dtype)
    ref.check_window(window, causal, "attention_bwd")
    b, sq, hq, d = q.shape
    require(out.shape == q.shape and dout.shape == q.shape and lse.shape == (b, hq, sq),
            f"attention_bwd: out {out.shape}, dout {dout.shape} must be {q.shape} and lse {lse.shape} "
            f"must be {(b, hq, sq)}")
    dout = np.ascontiguousarray(dout, dt)
    dq, dk, dv, delta = _bwd_outputs(q.shape, k.shape, dt)  # filled by the tasks (`_own_rows`)
    bq, bk = tile_sizes(d)
    klo, khi, qend = document_bounds(q_docs, k_docs, b, sq, k.shape[1])
    kend = document_bounds(k_docs, k_docs, b, k.shape[1], k.shape[1])[2]
    spans, nspan = document_blocks(qend, SPAN, True)
    shares = work_shares(visible_keys(klo, khi, q_offset, k_offset, causal, window), spans, k.shape[2])
    if (nspan == 0).any():  # rows with no query (Sq = 0): no task zeroes their keys
        dk[:], dv[:] = 0, 0
    _attention_bwd(q, k, v, np.ascontiguousarray(out, dt), np.ascontiguousarray(lse, ref.stat_dtype(dt)),
                   delta, dout, int(q_offset), int(k_offset),
                   bool(causal), int(window), klo, khi, qend, dt.type(ref.attention_scale(d, scale)),
                   *document_blocks(qend, bq), *document_blocks(kend, bk), spans, nspan, shares, dq, dk, dv)
    return dq.astype(grads, copy=False), dk.astype(grads, copy=False), dv.astype(grads, copy=False)


# The seam (mpipar.model.attention.attend_fwd) hands these kernels a block's document ids in one
# call instead of one call per document's block.
attention_fwd.block_sparse_documents = attention_bwd.block_sparse_documents = True
