"""How a sequence is split over the sp ranks, and the attention work each rank then does.

- :class:`SeqLayout`: the positions each rank holds under a split
  (:class:`mpipar.parallel.sequence.split.SequenceSplit`: ``contiguous``, ``zigzag`` or
  ``balanced``, whose deal of each microbatch's documents is :func:`balanced_layout`). RoPE and
  the causal mask use the global positions.
- :func:`token_work`, :func:`rank_work`: attention work (causal pairs inside documents) of each
  position and of each sp rank, per sp mode (Ulysses groups share their work): what the
  balanced split evens out, the bench's balance table and the step's ``attention_imbalance``.

Host metadata only (NumPy on positions and document ids): no MPI, no device arrays. The
attention cores that use these layouts are in :mod:`mpipar.parallel.sequence`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipar.model.attention import document_offsets
from mpipar.parallel.sequence.split import BALANCED, SequenceSplit

CHUNKS_PER_RANK = 32   # balanced: the most chunks a rank's share is cut into
MIN_CHUNK = 64         # balanced: the fewest tokens in a chunk (--sp-min-chunk; a kernel tile)
BALANCE_SLACK = 0.01   # balanced: the max/mean work fewer chunks may add to the finest deal's


def split_parts(sp: int, split: str) -> int:
    """Equal parts the sequence is cut into: ``sp`` (contiguous) or ``2 * sp`` (zigzag)."""
    return SequenceSplit.named(split).parts(sp)


@dataclass(frozen=True)
class SeqLayout:
    """Which global token positions each SP rank holds. ``balanced``: ``runs[r]``, the
    (start, length) runs of rank r, chosen per microbatch from its documents
    (:func:`balanced_layout`); without runs (no documents known) it holds what contiguous
    does. ``min_chunk``: the fewest tokens in a balanced chunk (``--sp-min-chunk``)."""

    seq_len: int
    sp: int
    split: str = "contiguous"
    runs: tuple = ()
    min_chunk: int = MIN_CHUNK

    def __post_init__(self) -> None:
        parts = self.mode.parts(self.sp)
        if self.seq_len % parts:
            raise ValueError(f"seq_len={self.seq_len}: must be divisible by {parts} for "
                             f"sp={self.sp} with the {self.split} split")

    @property
    def mode(self) -> SequenceSplit:
        """The split's object (ValueError naming the value and the choices for an unknown one)."""
        return SequenceSplit.named(self.split)

    def segments(self, rank: int) -> list[tuple[int, int]]:
        """(start, length) of each contiguous run of global positions held by ``rank``, in order."""
        if self.runs:
            return list(self.runs[rank])
        return self.mode.segments(self.seq_len, self.sp, rank)

    def positions(self, rank: int) -> np.ndarray:
        """Global positions ``[S_loc]`` of ``rank``'s tokens, in local order (host metadata)."""
        return np.concatenate([np.arange(s, s + n) for s, n in self.segments(rank)])

    def for_microbatch(self, docs: np.ndarray) -> "SeqLayout":
        """The split of a microbatch of document ids ``docs`` ``[B, S]``: balanced deals each
        its own (:func:`balanced_layout`, chunks of at least ``min_chunk``); the others are
        this one."""
        if not self.mode.deals_documents:
            return self
        return balanced_layout(self.seq_len, self.sp, docs, self.min_chunk)


def balanced_chunks(per: int, min_chunk: int = MIN_CHUNK) -> int:
    """The most chunks a rank's ``per`` tokens are cut into by ``--sp-split balanced``: the
    largest divisor of ``per`` up to :data:`CHUNKS_PER_RANK` that leaves chunks of at least
    ``min_chunk`` tokens, else 1 (:func:`balanced_layout` may use a divisor of it)."""
    return max([d for d in range(1, min(CHUNKS_PER_RANK, per) + 1)
                if per % d == 0 and per // d >= min_chunk] or [1])


def token_work(docs: np.ndarray, window: int = 0) -> np.ndarray:
    """Attention work of each position ``[S]`` of a microbatch of packed documents ``docs
    [B, S]`` (document ids), summed over its rows: the keys a query there sees, its position
    inside its document + 1 (causal pairs inside one document), at most ``window`` (a
    sliding window; 0: none)."""
    keys = document_offsets(docs) + 1
    return (keys if window == 0 else np.minimum(keys, window)).sum(axis=0)


def balanced_layout(seq_len: int, sp: int, docs: np.ndarray,
                    min_chunk: int = MIN_CHUNK) -> SeqLayout:
    """``--sp-split balanced`` for one microbatch: each rank holds ``seq_len / sp`` tokens (the
    linears' work, equal) in ``c`` chunks of ``seq_len / (sp c)``, the chunks dealt by attention
    work (:func:`token_work`, :func:`_deal`). ``c`` is the fewest of the divisors of the finest
    count (:func:`balanced_chunks`: chunks of ``min_chunk`` tokens or more) whose deal keeps
    max/mean rank work within :data:`BALANCE_SLACK` of the finest deal's: the ring computes a
    kernel call per pair of runs, so a share in dozens of runs costs more than it balances.
    Bound: the finest deal's max - min <= its heaviest chunk's work ``h``, so max/mean <= 1 +
    sp * h / total + :data:`BALANCE_SLACK`, whatever the document lengths."""
    per = seq_len // sp
    finest = balanced_chunks(per, min_chunk)
    work = token_work(docs)
    owner = _deal(work, sp, finest)
    allowed = _imbalance(work, owner, sp) + BALANCE_SLACK
    for c in (d for d in range(1, finest) if finest % d == 0):
        coarse = _deal(work, sp, c)
        if _imbalance(work, coarse, sp) <= allowed:
            owner = coarse
            break
    n = seq_len // owner.size
    runs = []
    for r in range(sp):
        out: list[tuple[int, int]] = []
        for chunk in np.flatnonzero(owner == r):
            if out and out[-1][0] + out[-1][1] == chunk * n:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((int(chunk * n), n))
        runs.append(tuple(out))
    return SeqLayout(seq_len, sp, BALANCED.name, tuple(runs), min_chunk)


def _deal(work: np.ndarray, sp: int, c: int) -> np.ndarray:
    """The owning rank of each of the ``sp * c`` equal chunks of a sequence whose positions
    carry attention ``work`` ``[S]``: the chunks dealt heaviest first in snake order (0..sp-1,
    sp-1..0, ...), then pairs swapped between the heaviest and the lightest rank while that
    lowers the heaviest (:func:`_swap_down`). Every rank gets ``c`` chunks; max - min rank work
    <= the heaviest chunk's work (the snake's; swaps only lower the maximum)."""
    chunk_work = work.reshape(sp * c, -1).sum(axis=1)
    owner = np.empty(sp * c, np.int64)
    for k, chunk in enumerate(np.argsort(-chunk_work, kind="stable")):
        rnd, j = divmod(k, sp)
        owner[chunk] = j if rnd % 2 == 0 else sp - 1 - j
    _swap_down(chunk_work, owner, sp)
    return owner


def _imbalance(work: np.ndarray, owner: np.ndarray, sp: int) -> float:
    """Max/mean attention work of the sp ranks when chunk i of ``work`` ``[S]`` is rank
    ``owner[i]``'s."""
    load = np.bincount(owner, weights=work.reshape(owner.size, -1).sum(axis=1), minlength=sp)
    return float(load.max() / load.mean())


def _swap_down(work: np.ndarray, owner: np.ndarray, sp: int, rounds: int = 64) -> None:
    """Swap one chunk of the heaviest rank with a lighter one of the lightest rank, the swap
    that brings them closest to equal, while it lowers the heaviest rank's work."""
    for _ in range(rounds):
        load = np.bincount(owner, weights=work, minlength=sp)
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        a, b = np.flatnonzero(owner == hi), np.flatnonzero(owner == lo)
        d = work[a][:, None] - work[b][None, :]          # work moved from hi to lo
        ok = (d > 0) & (d < gap)
        if not ok.any():
            return
        i, j = np.unravel_index(np.argmin(np.where(ok, np.abs(gap - 2 * d), np.inf)), d.shape)
        owner[a[i]], owner[b[j]] = lo, hi


def rank_work(layout: SeqLayout, docs: np.ndarray, window: int = 0,
              ulysses: int = 1) -> np.ndarray:
    """Attention work of each sp rank ``[sp]`` (float) in a layer with sliding ``window``
    (:func:`token_work` over the positions it attends for). ``ulysses``: sp ranks per Ulysses
    group (``sp`` for ``--sp-mode ulysses``, ``--ulysses-size`` for hybrid, 1 for ring and
    halo): a group's members attend together over the group's tokens, the positions of one
    rank of the same split over ``sp / ulysses`` ranks (hybrid's ring), each for
    ``1 / ulysses`` of the heads, so each does ``1 / ulysses`` of the group's work."""
    work = token_work(docs, window)
    groups = layout if ulysses == 1 else SeqLayout(layout.seq_len, layout.sp // ulysses,
                                                   layout.split)
    per = np.array([work[groups.positions(g)].sum() for g in range(groups.sp)], np.float64)
    return np.repeat(per / ulysses, ulysses)
