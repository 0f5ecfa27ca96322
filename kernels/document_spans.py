"""Where packed documents lie, for the attention kernels of every backend (the Numba tiles,
cupy_gpu's flash kernels, flash_mma's slabs): each query's keys, blocks cut at document starts,
and the keys each query sees.

Document ids `[B, S]` are non-decreasing along each row (packed documents: each one run of
positions, in order). `document_bounds` gives each query the keys [klo, khi) of its document in
the key block and the end of its document in the query block (one merge pass per row);
`document_blocks` cuts positions into blocks that start at documents (a long document in nearly
equal blocks of its own, short ones packed whole), so that a short document is one small causal
tile rather than pieces of a fixed grid's; `visible_keys` counts what each query sees within
causality and a sliding window, the work the kernels share among threads.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .numpy_ref import Array, require


def document_bounds(q_docs: Array | None, k_docs: Array | None, b: int, sq: int, sk: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per query `[B, Sq]` (int64): klo, khi, the keys [klo, khi) of its document in the key
    block, and qend, the end of its document in the query block (no documents: all keys, and
    the block's end). Document ids `[B, Sq]`, `[B, Sk]` must not decrease along a row (packed
    documents: each document one run of positions, in order)."""
    if q_docs is None and k_docs is None:
        return np.zeros((b, sq), np.int64), np.full((b, sq), sk, np.int64), np.full((b, sq), sq, np.int64)
    require(q_docs is not None and k_docs is not None, "attention: q_docs and k_docs go together")
    qd, kd = np.asarray(q_docs), np.asarray(k_docs)
    require(qd.shape == (b, sq) and kd.shape == (b, sk),
            f"attention: q_docs {qd.shape} and k_docs {kd.shape} must be {(b, sq)} and {(b, sk)}")
    klo, khi, qend = (np.empty((b, sq), np.int64) for _ in range(3))
    require(_bounds(qd.astype(np.int64, copy=False), kd.astype(np.int64, copy=False), klo, khi, qend),
            "attention: document ids must not decrease along a row (packed documents)")
    return klo, khi, qend


@njit(cache=True, nogil=True, fastmath=False)
def _bounds(qd, kd, klo, khi, qend):  # pragma: no cover (njit)
    """`document_bounds` of ids qd `[B, Sq]`, kd `[B, Sk]` in one merge pass per row (ids sorted
    along rows: klo/khi = the first key whose id is >= / > the query's, qend = the first query
    whose id is >); False (nothing else promised) if some row's ids decrease."""
    sq, sk = qd.shape[1], kd.shape[1]
    for r in range(qd.shape[0]):
        for i in range(1, sq):
            if qd[r, i] < qd[r, i - 1]:
                return False
        for j in range(1, sk):
            if kd[r, j] < kd[r, j - 1]:
                return False
        lo = hi = 0
        for i in range(sq):
            x = qd[r, i]
            while lo < sk and kd[r, lo] < x:
                lo += 1
            hi = max(hi, lo)
            while hi < sk and kd[r, hi] <= x:
                hi += 1
            klo[r, i], khi[r, i] = lo, hi
        e = sq
        for i in range(sq - 1, -1, -1):
            if i < sq - 1 and qd[r, i] != qd[r, i + 1]:
                e = i + 1
            qend[r, i] = e
    return True


@njit(cache=True, nogil=True, fastmath=False)
def _cut_blocks(ends, size, starts, whole):  # pragma: no cover (njit)
    """Cut positions [0, n) into blocks of at most `size` that start at document starts: a
    document longer than `size` gets ceil(length / size) nearly equal blocks of its own, shorter
    ones are packed whole, in order, into blocks of at most `size` (ends[i]: the end of position
    i's document; no documents: one document, nearly equal blocks). starts[:nb + 1] = the block
    starts then n; returns nb."""
    n, nb, i = ends.size, 0, 0
    while i < n:
        e = ends[i]
        if e - i > size and not whole:
            parts = (e - i + size - 1) // size
            step = (e - i + parts - 1) // parts
            for j in range(i, e, step):
                starts[nb] = j
                nb += 1
        else:
            starts[nb] = i
            nb += 1
            while e < n and ends[e] - i <= size:
                e = ends[e]
        i = e
    starts[nb] = n
    return nb


def document_blocks(ends: np.ndarray, size: int, whole: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of at most `size` positions aligned to document starts (`_cut_blocks`) of every row
    of ends `[B, S]` (each position's document end, as `document_bounds`' qend): starts
    `[B, nmax + 1]` (row b's nb[b] block starts, then S repeated) and nb `[B]`, so that a short
    document is one small causal tile and no tile straddles two documents it could keep apart."""
    b, n = ends.shape
    starts = np.full((b, n + 2), n, np.int64)
    nb = np.array([_cut_blocks(ends[r], size, starts[r], whole) for r in range(b)], np.int64)
    return np.ascontiguousarray(starts[:, :int(nb.max(initial=0)) + 1]), nb


def visible_keys(klo: np.ndarray, khi: np.ndarray, q_offset: int, k_offset: int, causal: bool,
                 window: int) -> np.ndarray:
    """Keys each query sees `[B, Sq]` (int64): its document's keys [klo, khi) `[B, Sq]` within
    causality and the window."""
    diag = np.arange(klo.shape[1]) + (q_offset - k_offset)
    hi = np.minimum(khi, diag + 1) if causal else khi
    lo = np.maximum(klo, diag - window + 1) if window > 0 else klo
    return np.maximum(hi - lo, 0)
