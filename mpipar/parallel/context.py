"""Sequence (context) parallelism: how a sequence is split over SP, and attention across it.

The attention cores implement :class:`mpipar.model.attention.AttentionCore` for a block that
holds only this rank's chunk of the sequence.

- How the sequence is cut (:class:`mpipar.parallel.sequence_split.SeqLayout`: contiguous, zigzag,
  balanced) and the attention work each rank gets live in :mod:`mpipar.parallel.sequence_split`.
- :class:`RingAttention`: K and V travel along the SP ring (``Sendrecv``, or with ``overlap`` an
  ``Isend``/``Irecv`` of the next block posted before the current block is computed, in forward
  and backward); partial results merge by log-sum-exp; blocks the causal mask or the sliding
  window empties are skipped, not computed. The hops are those that can still reach a query
  (:func:`ring_hops`): the whole ring for full causal attention, ``ceil((W-1)/S_loc)`` for a
  window W over a contiguous split, and both ways for zigzag. In backward the dK/dV of each
  block travel with it and go straight home after its relay's last hop.
- :class:`HaloAttention` (``--sp-mode halo``): with a sliding window, each rank receives just the
  K/V of the ``W - 1`` positions before its runs from the ranks holding them (non-blocking
  point-to-point, overlapped with the local block): O(W) bytes per rank instead of O(S).
- :class:`UlyssesAttention`: an all-to-all re-shards from sequence chunks to head groups, each rank
  attends over the whole sequence for ``heads/sp`` heads, and a second all-to-all returns.
- :class:`HybridAttention` (``--sp-mode hybrid``, USP's and Megatron's hierarchical context
  parallelism): Ulysses' all-to-all among the ``U = --ulysses-size`` consecutive sp ranks (one
  node's, when they fit in one), then ring attention over the ``sp / U`` such groups, so only
  the ring crosses nodes. A Ulysses group's chunks together are the chunks of one ring rank of
  the same split over ``sp / U`` ranks (contiguous stays contiguous; zigzag stays zigzag, with
  ``U``-times larger chunks), so the ring keeps its causal skipping, zigzag balance and overlap.

Precision: K/V travel in the activations' dtype (bf16 under mixed precision); a core sums
partial results in :func:`mpipar.model.attention.accumulator` dtype (float32 for bf16): the
output merged over blocks, dQ over blocks, dK/dV over the ring's hops (they travel as float32
with their K/V, one byte message a hop) and halos (sent home as float32), and rounds each once at
the end. Ulysses' all-to-alls carry the rounded gradients.

Shapes: q ``[B, S_loc, hq, D]``, k/v ``[B, S_loc, hkv, D]``, lse ``[B, hq, S_loc]``.
Every buffer is allocated from the kernel backend's array module (``kernels.xp``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar.model.attention import (DocumentPositions, accumulator, as_activations, attend_bwd,
                                    attend_fwd, documents_of, grads_as_activations, runs_visible,
                                    shared_runs)
from mpipar.runtime.comm import Group
from mpipar.config import require
from mpipar.layout import Layout
from mpipar.parallel.traffic import Call
from mpipar.runtime.precision import Precision
from mpipar.runtime.topology import Coord, GridShape
from mpipar.parallel.sequence_split import SeqLayout, split_parts

Array = Any


def _local_slices(segments: list[tuple[int, int]]) -> list[slice]:
    out, at = [], 0
    for _, n in segments:
        out.append(slice(at, at + n))
        at += n
    return out


def needs_block(layout: SeqLayout, rank: int, src: int, window: int,
                docs: DocumentPositions | None = None) -> bool:
    """Whether ``rank``'s queries see any key that SP rank ``src`` holds (with ``docs``: any
    key of their own document)."""
    return any(shared_runs(docs, qs, qn, ks, kn, window) if docs is not None
               else runs_visible(qs, qn, ks, kn, window)
               for qs, qn in layout.segments(rank) for ks, kn in layout.segments(src))


@dataclass(frozen=True)
class RingHops:
    """The hops ring attention makes for one window: ``right`` hops of a relay that passes K/V
    to the right (at hop t a rank computes the block of rank ``r - t``) and ``left`` hops of one
    that passes them to the left (rank ``r + t``). Full causal attention is the whole ring to the
    right; a window stops after the hops that can still reach a query, and zigzag (whose late
    chunk reads the ranks to its right) takes hops both ways."""

    right: int
    left: int

    def relays(self) -> list[tuple[int, int]]:
        """(direction, hops) of each relay with hops: +1 right, -1 left."""
        return [(d, h) for d, h in ((1, self.right), (-1, self.left)) if h]


Message = tuple[str, int, int, int]
"""``(operation, bytes, count, offset)``: ``count`` calls of the ledger operation ``op``, each
handing MPI ``bytes``, to the SP rank ``offset`` places on (0: a receive, which names none)."""


def ring_messages(hops: RingHops, kv: int, dkv: int, overlap: bool
                  ) -> tuple[list[Message], list[Message]]:
    """(forward, backward) messages of one block of ring attention on one rank; ``kv``: bytes of
    this rank's K (= of its V), ``dkv``: of its dK (= dV; float32 under bf16). Per relay of h
    hops in direction d: forward h K/V Sendrecvs (with overlap Isend + Irecv); backward the K/V
    at hop 1, K/V with their dK/dV at hops 2..h (with overlap: h K/V Isend/Irecv and h - 1
    dK/dV Sendrecvs) and the dK/dV home, d h ranks back."""
    fwd: list[Message] = []
    bwd: list[Message] = []
    for d, h in hops.relays():
        home = ("sendrecv", 2 * dkv, 1, -d * h)
        if overlap:
            fwd += [("send", 2 * kv, h, d), ("recv", 0, h, 0)]
            bwd += [("send", 2 * kv, h, d), ("recv", 0, h, 0),
                    ("sendrecv", 2 * dkv, h - 1, d), home]
        else:
            fwd += [("sendrecv", 2 * kv, h, d)]
            bwd += [("sendrecv", 2 * kv, 1, d), ("sendrecv", 2 * kv + 2 * dkv, h - 1, d), home]
    return fwd, bwd


def _with_grads(xp, kv: Array) -> Array:
    """One backward relay message: the bytes of the K/V ``[2, B, S, hkv, D]`` of a block, then
    room for the dK/dV gathered for them so far (zeros, in the accumulator dtype)."""
    grads = kv.size * accumulator(kv.dtype).itemsize
    buf = xp.zeros(kv.nbytes + grads, xp.uint8)
    buf[:kv.nbytes] = kv.reshape(-1).view(xp.uint8)
    return buf


def _unpack(buf: Array, shape: tuple[int, ...], dtype: Any) -> tuple[Array, Array]:
    """(K/V, dK/dV) ``[2, B, S, hkv, D]`` each, views of a message of :func:`_with_grads`."""
    n = math.prod(shape) * np.dtype(dtype).itemsize
    return (buf[:n].view(dtype).reshape(shape),
            buf[n:].view(accumulator(dtype)).reshape(shape))


@functools.lru_cache(maxsize=256)
def ring_hops(layout: SeqLayout, window: int) -> RingHops:
    """The cheapest (right, left) relay pair such that every rank reaches every block its
    queries see: a rank needs src iff :func:`needs_block`; a relay pair (a, b) reaches the
    ranks ``r - 1 .. r - a`` and ``r + 1 .. r + b``. Cost: the bytes a rank sends, 6 units a hop
    (forward 2, backward 4), with ties going to fewer hops and then to the right relay."""
    return _cheapest_hops(layout, window, None)


def document_hops(layout: SeqLayout, window: int, docs: DocumentPositions | None) -> RingHops:
    """:func:`ring_hops` for a microbatch of packed documents: a rank needs the blocks that hold
    keys of its queries' documents, so the relays stop once no rank further on shares a
    document (packed short documents: the neighbours only). The same on every rank of the ring
    (its ranks hold the same rows); remembered on ``docs`` per (layout, window)."""
    if docs is None:
        return ring_hops(layout, window)
    return docs.remember(("hops", layout, window), lambda: _cheapest_hops(layout, window, docs))


def _cheapest_hops(layout: SeqLayout, window: int, docs: DocumentPositions | None) -> RingHops:
    n = layout.sp
    need = [[(src - r) % n for src in range(n)
             if src != r and needs_block(layout, r, src, window, docs)] for r in range(n)]
    best = None
    for a in range(n):
        for b in range(n - a):
            if all(all(off >= n - a or off <= b for off in offs) for offs in need):
                key = (6 * (a + b), a + b, -a)
                if best is None or key < best[0]:
                    best = (key, RingHops(a, b))
    return best[1]


class RingAttention:
    """Causal (optionally sliding-window) attention of this rank's queries over the SP ranks'
    keys, by passing K/V along relays (:class:`RingHops`). Its backward reads the block's q, k,
    v and output as given; it saves only the lse.

    Forward: this rank's own block, then each relay's hops; at hop t the K/V received are those
    of rank ``r - d t`` (d = +1 right, -1 left). Backward, per relay: hop 1 passes the K/V, hops
    2..h pass the K/V with the dK/dV accumulated for them so far, and after the last hop the
    dK/dV go straight home to their owner; the own block's gradients never travel. With
    ``overlap`` the next K/V leave (``Isend``/``Irecv``) before the current block is computed and
    the dK/dV follow as their own message."""

    needs_inputs = True

    def __init__(self, kernels, sp: Group, seq_layout: SeqLayout, overlap: bool = False) -> None:
        self.kernels, self.xp, self.sp, self.overlap = kernels, kernels.xp, sp, overlap
        self.seq_layout = seq_layout
        self.rank = sp.rank
        self.q_segs = seq_layout.segments(sp.rank)
        self.q_slices = _local_slices(self.q_segs)

    def _layout(self, docs: DocumentPositions | None) -> SeqLayout:
        """The split of this microbatch: its own under ``--sp-split balanced``, else the run's."""
        return self.seq_layout if docs is None or docs.layout is None else docs.layout

    def _pairs(self, src: int, window: int, docs: DocumentPositions | None = None):
        """(q slice, q start, k slice, k start) of every (query run, key run) pair of block ``src``
        that the causal mask and the window do not empty entirely."""
        layout = self._layout(docs)
        k_segs, q_segs = layout.segments(src), layout.segments(self.rank)
        for qsl, (qs, qn) in zip(_local_slices(q_segs), q_segs):
            for ksl, (ks, kn) in zip(_local_slices(k_segs), k_segs):
                if runs_visible(qs, qn, ks, kn, window):
                    yield qsl, qs, ksl, ks

    def _peer(self, offset: int) -> int:
        return (self.rank + offset) % self.sp.size

    def _shift(self, buf: Array, d: int, tag: int) -> Array:
        """Blocking relay step: send ``buf`` to rank r + d, receive rank r - d's."""
        recv = self.xp.empty(buf.shape, buf.dtype)
        return self.sp.sendrecv(buf, self._peer(d), recv, self._peer(-d), tag)

    def _start_shift(self, buf: Array, d: int, tag: int):
        recv = self.xp.empty(buf.shape, buf.dtype)
        reqs = [self.sp.irecv(recv, self._peer(-d), tag), self.sp.isend(buf, self._peer(d), tag)]
        return recv, reqs

    def _blocks(self, kv: Array, hops: RingHops, tag: int):
        """Yield (src, K/V block of src) in compute order: this rank's, then each relay's hops.
        With overlap the next block's transfer is in flight while the caller computes."""
        steps = [(0, 0, kv)] + [(d, t, None) for d, h in hops.relays() for t in range(1, h + 1)]
        pending = None
        for i, (d, t, buf) in enumerate(steps):
            if pending is not None:
                buf, reqs = pending
                for r in reqs:
                    r.wait()
            elif t:
                buf = self._shift(steps[i - 1][2] if steps[i - 1][0] == d else kv, d, tag + i)
            steps[i] = (d, t, buf)
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            pending = (self._start_shift(buf if nxt[0] == d else kv, nxt[0], tag + i + 1)
                       if self.overlap and nxt else None)
            yield (self.rank - d * t) % self.sp.size, buf

    def forward(self, q: Array, k: Array, v: Array, positions: np.ndarray,
                window: int = 0) -> tuple[Array, Array]:
        """(out ``[B, S, hq, D]``, lse ``[B, hq, S]``: what backward needs beyond q, k, v, out)."""
        xp = self.xp
        B, S, hq, D = q.shape
        out = xp.zeros(q.shape, accumulator(q.dtype))     # merged in float32 under bf16
        lse = xp.full((B, hq, S), -np.inf, dtype=xp.float64 if q.dtype == xp.float64
                      else xp.float32)
        kv = xp.ascontiguousarray(xp.stack([k, v]))  # one message per hop: [2, B, S, hkv, D]
        docs = documents_of(positions)
        for src, blk in self._blocks(kv, document_hops(self._layout(docs), window, docs), tag=0):
            for qsl, qs, ksl, ks in self._pairs(src, window, docs):
                res = attend_fwd(self.kernels, q[:, qsl], blk[0][:, ksl], blk[1][:, ksl], qs, ks,
                                 window, docs)
                if res is not None:    # None: no pair of one document (packed documents)
                    out[:, qsl], lse[:, :, qsl] = self.kernels.attention_merge(
                        out[:, qsl], lse[:, :, qsl], *res)
        return out.astype(q.dtype, copy=False), (lse, docs)

    def backward(self, dout: Array, q: Array, k: Array, v: Array, out: Array,
                 saved: tuple, window: int = 0) -> tuple[Array, Array, Array]:
        """``saved``: forward's (lse ``[B, hq, S]``, documents or None)."""
        xp = self.xp
        lse, docs = saved
        acc = accumulator(q.dtype)
        dq = xp.zeros(q.shape, acc)
        dk, dv = xp.zeros(k.shape, acc), xp.zeros(v.shape, acc)
        self._block_grads(q, out, lse, dout, dq, k, v, dk, dv, self.rank, window, docs)
        hops = document_hops(self._layout(docs), window, docs)
        for i, (d, h) in enumerate(hops.relays()):
            relay = self._relay_overlapped if self.overlap else self._relay
            home = relay(q, k, v, out, lse, dout, dq, d, h, window,
                         tag=4 * self.sp.size * (i + 1), docs=docs)
            dk += home[0]
            dv += home[1]
        return as_activations((dq, dk, dv), q)

    def _relay(self, q, k, v, out, lse, dout, dq, d: int, hops: int, window: int, tag: int,
               docs=None):
        """One relay of backward: -> this rank's dK/dV from the ranks it visited ``[2, B, S, hkv, D]``."""
        xp = self.xp
        kv = self._shift(xp.ascontiguousarray(xp.stack([k, v])), d, tag)
        buf = _with_grads(xp, kv)             # K, V, and the dK, dV gathered for them
        for t in range(1, hops + 1):
            if t > 1:
                buf = self._shift(buf, d, tag + t)
            kv, dkv = _unpack(buf, kv.shape, kv.dtype)
            self._block_grads(q, out, lse, dout, dq, kv[0], kv[1], dkv[0], dkv[1],
                              (self.rank - d * t) % self.sp.size, window, docs)
        return self._home(xp.ascontiguousarray(dkv), d, hops, tag + hops + 1)

    def _relay_overlapped(self, q, k, v, out, lse, dout, dq, d: int, hops: int, window: int,
                          tag: int, docs=None):
        """As :meth:`_relay`, but the next K/V travel while this block is computed; the dK/dV
        of a block can only leave once computed, so they follow as a second message."""
        xp = self.xp
        kv = xp.ascontiguousarray(xp.stack([k, v]))
        dkv = None
        nxt, reqs = self._start_shift(kv, d, tag)
        for t in range(1, hops + 1):
            for r in reqs:
                r.wait()
            kv = nxt
            if t < hops:
                nxt, reqs = self._start_shift(kv, d, tag + t)
            dkv = (xp.zeros(kv.shape, accumulator(kv.dtype)) if dkv is None
                   else self._shift(dkv, d, tag + self.sp.size + t))
            self._block_grads(q, out, lse, dout, dq, kv[0], kv[1], dkv[0], dkv[1],
                              (self.rank - d * t) % self.sp.size, window, docs)
        return self._home(dkv, d, hops, tag + 3 * self.sp.size)

    def _home(self, dkv: Array, d: int, hops: int, tag: int) -> Array:
        """Send the dK/dV of the block last computed (rank r - d hops') to their owner; receive
        this rank's from rank r + d hops."""
        recv = self.xp.empty(dkv.shape, dkv.dtype)
        return self.sp.sendrecv(dkv, self._peer(-d * hops), recv, self._peer(d * hops), tag)

    def _block_grads(self, q, out, lse, dout, dq, k, v, dk, dv, src: int, window: int,
                     docs=None) -> None:
        """Add block ``src``'s contributions to dq (this rank's) and dk, dv (the block's)."""
        for qsl, qs, ksl, ks in self._pairs(src, window, docs):
            res = attend_bwd(self.kernels, q[:, qsl], k[:, ksl], v[:, ksl], out[:, qsl],
                             lse[:, :, qsl], dout[:, qsl], qs, ks, window, docs)
            if res is None:
                continue
            dqp, dkp, dvp = res
            dq[:, qsl] += dqp
            dk[:, ksl] += dkp
            dv[:, ksl] += dvp


@dataclass(frozen=True)
class HaloPlan:
    """The K/V rows that cross between SP ranks for one window (:class:`HaloAttention`):
    ``recv[src]``, the global positions (ascending) this rank's queries see that rank ``src``
    holds; ``send[dst]``, the local indices of this rank's rows that rank ``dst`` needs."""

    recv: dict[int, np.ndarray]
    send: dict[int, np.ndarray]

    def runs(self, src: int) -> list[tuple[slice, int]]:
        """(slice of the received buffer, first global position) of each contiguous run of the
        positions received from ``src``."""
        pos = self.recv[src]
        cuts = [0] + [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1] + [len(pos)]
        return [(slice(a, b), int(pos[a])) for a, b in zip(cuts, cuts[1:])]


def halo_positions(layout: SeqLayout, rank: int, window: int) -> np.ndarray:
    """Global positions ``rank``'s queries see that it does not hold: the ``window - 1``
    positions before each of its runs (all of them before it with window 0), ascending."""
    wanted = [np.arange(max(0, qs - window + 1) if window else 0, qs)
              for qs, _ in layout.segments(rank)]
    return np.setdiff1d(np.concatenate(wanted), layout.positions(rank))


@functools.lru_cache(maxsize=256)
def halo_plan(layout: SeqLayout, rank: int, window: int) -> HaloPlan:
    """What ``rank`` receives from and sends to every other SP rank for ``window``."""
    owner = np.empty(layout.seq_len, np.int64)
    for r in range(layout.sp):
        owner[layout.positions(r)] = r
    mine = halo_positions(layout, rank, window)
    recv = {int(src): mine[owner[mine] == src] for src in np.unique(owner[mine])}
    own, send = layout.positions(rank), {}
    for dst in range(layout.sp):
        theirs = halo_positions(layout, dst, window) if dst != rank else mine[:0]
        theirs = theirs[owner[theirs] == rank]
        if len(theirs):
            send[dst] = np.searchsorted(own, theirs)
    return HaloPlan(recv, send)


def halo_messages(plan: HaloPlan, rank: int, sp: int, row: int,
                  grad_row: int) -> tuple[list[Message], list[Message]]:
    """(forward, backward) messages of one block of halo attention on SP rank ``rank`` of
    ``sp``; ``row``: bytes of one position's K (= of its V), ``grad_row``: of its dK (float32
    under bf16). Forward sends the K/V rows each other rank needs, backward returns the dK/dV
    of the rows received; each by Isend, with an Irecv per message the rank receives."""
    fwd = [("send", 2 * row * len(i), 1, (dst - rank) % sp) for dst, i in plan.send.items()]
    fwd.append(("recv", 0, len(plan.recv), 0))
    bwd = [("send", 2 * grad_row * len(p), 1, (src - rank) % sp)
           for src, p in plan.recv.items()]
    bwd.append(("recv", 0, len(plan.send), 0))
    return fwd, bwd


@dataclass
class HaloSaved:
    """What halo attention keeps for backward: the lse and the K/V received from each rank."""

    lse: Array                 # [B, hq, S_loc]
    halo: dict[int, Array]     # src -> [2, B, rows from src, hkv, D]
    docs: DocumentPositions | None = None


class HaloAttention:
    """Sliding-window attention over SP by halo exchange (``--sp-mode halo``): each rank receives
    from the ranks that hold them just the K/V of the ``W - 1`` positions before each of its
    runs (:func:`halo_plan`), by ``Isend``/``Irecv`` posted before the local block is computed,
    so the exchange overlaps it; the halo blocks are merged by log-sum-exp. Backward computes the
    halo blocks first and sends their dK/dV home while the local block is computed. Bytes per
    rank grow with W, not with the sequence. Its backward reads q, k, v and out as given."""

    needs_inputs = True
    TAG = 300

    def __init__(self, kernels, sp: Group, seq_layout: SeqLayout) -> None:
        self.kernels, self.xp, self.sp, self.seq_layout = kernels, kernels.xp, sp, seq_layout
        self.rank = sp.rank
        self.q_segs = seq_layout.segments(sp.rank)
        self.q_slices = _local_slices(self.q_segs)

    def _local_pairs(self, window: int):
        """(q slice, q start, k slice, k start) of this rank's own (query run, key run) pairs."""
        for qsl, (qs, qn) in zip(self.q_slices, self.q_segs):
            for ksl, (ks, kn) in zip(self.q_slices, self.q_segs):
                if runs_visible(qs, qn, ks, kn, window):
                    yield qsl, qs, ksl, ks

    def _halo_pairs(self, plan: HaloPlan, src: int, window: int):
        """As :meth:`_local_pairs`, for the runs received from ``src``."""
        for qsl, (qs, qn) in zip(self.q_slices, self.q_segs):
            for ksl, ks in plan.runs(src):
                if runs_visible(qs, qn, ks, ksl.stop - ksl.start, window):
                    yield qsl, qs, ksl, ks

    def _attend(self, q, out, lse, kv, pairs, window: int, docs=None) -> None:
        for qsl, qs, ksl, ks in pairs:
            res = attend_fwd(self.kernels, q[:, qsl], kv[0][:, ksl], kv[1][:, ksl], qs, ks,
                             window, docs)
            if res is not None:
                out[:, qsl], lse[:, :, qsl] = self.kernels.attention_merge(
                    out[:, qsl], lse[:, :, qsl], *res)

    def forward(self, q: Array, k: Array, v: Array, positions: np.ndarray,
                window: int = 0) -> tuple[Array, HaloSaved]:
        """(out ``[B, S, hq, D]``, :class:`HaloSaved`)."""
        xp = self.xp
        plan = halo_plan(self.seq_layout, self.rank, window)
        B, S, hq, D = q.shape
        kv = xp.ascontiguousarray(xp.stack([k, v]))                 # [2, B, S, hkv, D]
        halo = {src: xp.empty((2, B, len(pos)) + k.shape[2:], k.dtype)
                for src, pos in plan.recv.items()}
        sends = {dst: xp.ascontiguousarray(kv[:, :, xp.asarray(idx)])
                 for dst, idx in plan.send.items()}
        reqs = ([self.sp.irecv(buf, src, self.TAG) for src, buf in halo.items()]
                + [self.sp.isend(buf, dst, self.TAG) for dst, buf in sends.items()])
        out = xp.zeros(q.shape, accumulator(q.dtype))
        lse = xp.full((B, hq, S), -np.inf, dtype=xp.float64 if q.dtype == xp.float64
                      else xp.float32)
        docs = documents_of(positions)
        self._attend(q, out, lse, kv, self._local_pairs(window), window, docs)
        for r in reqs:
            r.wait()
        for src, buf in halo.items():
            self._attend(q, out, lse, buf, self._halo_pairs(plan, src, window), window, docs)
        return out.astype(q.dtype, copy=False), HaloSaved(lse, halo, docs)

    def _grads(self, q, out, lse, dout, dq, kv, dkv, pairs, window: int, docs=None) -> None:
        for qsl, qs, ksl, ks in pairs:
            res = attend_bwd(self.kernels, q[:, qsl], kv[0][:, ksl], kv[1][:, ksl], out[:, qsl],
                             lse[:, :, qsl], dout[:, qsl], qs, ks, window, docs)
            if res is None:
                continue
            dqp, dkp, dvp = res
            dq[:, qsl] += dqp
            dkv[0][:, ksl] += dkp
            dkv[1][:, ksl] += dvp

    def backward(self, dout: Array, q: Array, k: Array, v: Array, out: Array,
                 saved: HaloSaved, window: int = 0) -> tuple[Array, Array, Array]:
        xp = self.xp
        plan = halo_plan(self.seq_layout, self.rank, window)
        B, acc = q.shape[0], accumulator(q.dtype)
        back = {dst: xp.empty((2, B, len(idx)) + k.shape[2:], acc)
                for dst, idx in plan.send.items()}
        reqs = [self.sp.irecv(buf, dst, self.TAG + 1) for dst, buf in back.items()]
        dq = xp.zeros(q.shape, acc)
        dhalo = {}
        for src, buf in saved.halo.items():
            dhalo[src] = xp.zeros(buf.shape, acc)
            self._grads(q, out, saved.lse, dout, dq, buf, dhalo[src],
                        self._halo_pairs(plan, src, window), window, saved.docs)
            reqs.append(self.sp.isend(dhalo[src], src, self.TAG + 1))
        dkv = xp.zeros((2,) + k.shape, acc)
        self._grads(q, out, saved.lse, dout, dq, xp.stack([k, v]), dkv,
                    self._local_pairs(window), window, saved.docs)
        for r in reqs:
            r.wait()
        for dst, buf in back.items():
            idx = xp.asarray(plan.send[dst])
            dkv[:, :, idx] += buf
        return as_activations((dq, dkv[0], dkv[1]), q)


@dataclass
class UlyssesSaved:
    """What Ulysses (and hybrid) attention keeps for backward: its all-to-all'ed copies
    (``heads/U`` heads of the group's tokens, in the order the attention over them takes) of q,
    k, v and of the output, and the lse."""

    q: Array     # [B, S_group, hq/U, D]
    k: Array     # [B, S_group, hkv/U, D]
    v: Array
    out: Array   # [B, S_group, hq/U, D]
    lse: Any     # [B, hq/U, S_group] (hybrid: the ring's (lse, documents))
    docs: DocumentPositions | None = None


class HeadExchange:
    """Ulysses' re-sharding over ``group``: this rank's sequence chunk of every head
    <-> every group rank's chunks of this rank's ``h / U`` heads, the tokens in ``target``
    order (the group's positions as the attention over them wants them)."""

    def __init__(self, xp, group: Group, seq_layout: SeqLayout, members: list[int],
                 target: np.ndarray) -> None:
        """``members``: the sp ranks of ``group`` in group-rank order; ``target``: their
        positions in the order wanted after the exchange."""
        self.xp, self.group = xp, group
        gathered = np.concatenate([seq_layout.positions(r) for r in members])
        order = np.argsort(gathered, kind="stable")[np.searchsorted(np.sort(gathered), target)]
        self.order = xp.asarray(order)                              # gathered -> target
        self.inverse = xp.asarray(np.argsort(order, kind="stable"))  # target -> gathered

    def to_heads(self, x: Array) -> Array:
        """``[B, S_loc, h, D]`` (sequence chunk) -> ``[B, U * S_loc, h/U, D]`` (head group)."""
        xp = self.xp
        B, S, h, D = x.shape
        n = self.group.size
        send = xp.ascontiguousarray(x.reshape(B, S, n, h // n, D).transpose(2, 0, 1, 3, 4))
        recv = self.group.alltoall(send, xp.empty(send.shape, send.dtype))  # block i: rank i's
        full = recv.transpose(1, 0, 2, 3, 4).reshape(B, n * S, h // n, D)
        return full[:, self.order]

    def to_seq(self, x: Array) -> Array:
        """Inverse of :meth:`to_heads`."""
        xp = self.xp
        B, St, hg, D = x.shape
        n = self.group.size
        S = St // n
        send = xp.ascontiguousarray(x[:, self.inverse].reshape(B, n, S, hg, D)
                                    .transpose(1, 0, 2, 3, 4))
        recv = self.group.alltoall(send, xp.empty(send.shape, send.dtype))  # block i: group i
        return recv.transpose(1, 2, 0, 3, 4).reshape(B, S, n * hg, D)


class UlyssesAttention:
    """All-to-all sequence parallelism: trade sequence chunks for head groups and back. Its
    backward works on its own copies (:class:`UlyssesSaved`), not on the block's q, k, v."""

    needs_inputs = False

    def __init__(self, kernels, sp: Group, seq_layout: SeqLayout) -> None:
        self.kernels = kernels
        self.exchange = HeadExchange(kernels.xp, sp, seq_layout, list(range(sp.size)),
                                     np.arange(seq_layout.seq_len))

    def forward(self, q, k, v, positions, window: int = 0):
        ex = self.exchange
        qf, kf, vf = ex.to_heads(q), ex.to_heads(k), ex.to_heads(v)
        docs = documents_of(positions)
        o, lse = attend_fwd(self.kernels, qf, kf, vf, 0, 0, window, docs)
        return ex.to_seq(o), UlyssesSaved(qf, kf, vf, o, lse, docs)

    def backward(self, dout, q, k, v, out, saved: UlyssesSaved, window: int = 0):
        ex = self.exchange
        grads = attend_bwd(self.kernels, saved.q, saved.k, saved.v, saved.out, saved.lse,
                           ex.to_heads(dout), 0, 0, window, saved.docs,
                           grads_as_activations(saved.q))
        dq, dk, dv = as_activations(grads, saved.q)
        return ex.to_seq(dq), ex.to_seq(dk), ex.to_seq(dv)


class HybridAttention:
    """Ulysses inside groups of ``ulysses.size`` consecutive sp ranks, ring attention across
    the ``ring.size`` groups (``ring``: the sp ranks at this rank's place in every group). Its
    backward works on its own copies, as Ulysses'."""

    needs_inputs = False

    def __init__(self, kernels, ulysses: Group, ring: Group, seq_layout: SeqLayout,
                 overlap: bool = False) -> None:
        u, r = ulysses.size, ring.rank
        self.ring_layout = SeqLayout(seq_layout.seq_len, ring.size, seq_layout.split)
        members = [r * u + i for i in range(u)]
        self.positions = self.ring_layout.positions(r)   # of the tokens the ring attends with
        self.exchange = HeadExchange(kernels.xp, ulysses, seq_layout, members, self.positions)
        self.ring = RingAttention(kernels, ring, self.ring_layout, overlap)

    def forward(self, q, k, v, positions, window: int = 0):
        ex = self.exchange
        qf, kf, vf = ex.to_heads(q), ex.to_heads(k), ex.to_heads(v)
        docs = documents_of(positions)
        o, lse = self.ring.forward(qf, kf, vf, self.positions if docs is None
                                   else docs.with_positions(self.positions), window)
        return ex.to_seq(o), UlyssesSaved(qf, kf, vf, o, lse)

    def backward(self, dout, q, k, v, out, saved: UlyssesSaved, window: int = 0):
        ex = self.exchange
        dq, dk, dv = self.ring.backward(ex.to_heads(dout), saved.q, saved.k, saved.v, saved.out,
                                        saved.lse, window)
        return ex.to_seq(dq), ex.to_seq(dk), ex.to_seq(dv)


def check_config(layout: Layout) -> None:
    """The sequence must cut into the split's equal parts; Ulysses needs each rank's heads to
    divide into sp groups; hybrid a Ulysses group size that divides sp and the heads."""
    m, p, t = layout.model, layout.parallel, layout.train
    parts = split_parts(p.sp, p.sp_split)
    require(t.seq_len % parts == 0,
            f"train.seq_len={t.seq_len}: must be divisible by "
            + (f"2*sp = {parts} for the zigzag split" if p.sp_split == "zigzag"
               else f"parallel.sp={p.sp}"))
    require(p.sp_split != "balanced" or (t.document_masking and p.sp_mode == "ring"),
            f"parallel.sp_split='balanced': deals each microbatch's documents over ring "
            f"attention; needs --document-masking and --sp-mode ring (got "
            f"document_masking={t.document_masking}, sp_mode={p.sp_mode!r})")
    require(p.sp_min_chunk >= 1, f"parallel.sp_min_chunk={p.sp_min_chunk}: must be >= 1 "
                                 f"(tokens in a chunk of --sp-split balanced)")
    require(p.ulysses_size >= 0, f"parallel.ulysses_size={p.ulysses_size}: must be >= 0")
    require(p.sp_mode == "hybrid" or p.ulysses_size == 0,
            f"parallel.ulysses_size={p.ulysses_size}: needs --sp-mode hybrid")
    if p.sp_mode == "hybrid":
        u = p.ulysses_size
        require(u >= 1 and p.sp % u == 0,
                f"parallel.ulysses_size={u}: --sp-mode hybrid needs a Ulysses group size that "
                f"divides parallel.sp={p.sp}")
    if p.sp_mode in ("ulysses", "hybrid"):
        group, what = ((p.sp, "sp") if p.sp_mode == "ulysses" else (p.ulysses_size, "ulysses_size"))
        for name, heads in (("heads", m.heads), ("kv_heads", m.kv_heads)):
            require((heads // p.tp) % group == 0,
                    f"parallel.{what}={group}: {p.sp_mode} needs model.{name}/tp = "
                    f"{heads}/{p.tp} divisible by {what}")


# ------------------------------------------------------------------------------------ traffic
def sequence_calls(layout: Layout, coord: Coord, shape: GridShape, layers: list[int],
                   passes: int, backward: bool, documents: list | None = None) -> list[Call]:
    """SP attention of ``layers`` (global indices, each with its own sliding window) on the
    rank at ``coord`` of the grid ``shape``, in ``passes`` forwards of a microbatch through
    each, each with its backward (``backward``: a training step, whose ``recompute="full"``
    runs each forward twice) or without. Ring and halo messages come from :func:`ring_hops`
    and :func:`halo_plan` (hybrid: the ring over the Ulysses groups, ``ulysses_size`` sp ranks
    apart); Ulysses all-to-alls q ``[B, S/sp, hq/tp, D]`` and k/v ``[B, S/sp, hkv/tp, D]``.
    ``documents``: packed documents (``--document-masking``), the document ids ``[B, S]`` of
    each of the ``passes`` microbatches: the ring's hops are then each microbatch's
    (:func:`document_hops`)."""
    m, par, tr = layout.model, layout.parallel, layout.train
    reps = tr.recompute_mode.forward_runs(backward) * passes
    bwds = passes if backward else 0
    # K/V (and Ulysses' gradients, rounded) in the compute dtype; the ring's and halos' dK/dV
    # in the accumulator's (the masters' dtype: float32 under bf16)
    prec, s_loc = Precision.of(tr, par), tr.seq_len // par.sp
    e, g = prec.compute_bytes, prec.master_bytes
    elements = layout.micro_batch_size * (m.kv_heads // par.tp) * m.head_dim  # one position's K
    row, grad_row = elements * e, elements * g
    q = layout.micro_batch_size * s_loc * (m.heads // par.tp) * m.head_dim * e
    n = len(layers)
    if par.sp_mode == "ulysses":
        return _ulysses_calls("sp", q, row * s_loc, reps * n, bwds * n)
    calls, group, stride = [], "sp", 1
    seq = SeqLayout(tr.seq_len, par.sp, par.sp_split, min_chunk=par.sp_min_chunk)
    if par.sp_mode == "hybrid":
        stride = par.ulysses_size
        calls += _ulysses_calls("sp_ulysses", q, row * s_loc, reps * n, bwds * n) if stride > 1 \
            else []
        group, seq = "sp_ring", SeqLayout(tr.seq_len, par.sp // stride, par.sp_split)
    packs = ([(None, seq)] if documents is None or par.sp_mode == "halo" else
             [(d, microbatch_split(seq, d)) for d in map(as_documents, documents)])
    per = len(packs)                    # the passes share one prediction, or one each
    for layer in layers:
        window = m.layer_window(layer)
        for docs, seq in packs:
            fwd, bwd = (halo_messages(halo_plan(seq, coord.sp, window), coord.sp, par.sp, row,
                                      grad_row)
                        if par.sp_mode == "halo" else
                        ring_messages(document_hops(seq, window, docs), row * s_loc,
                                      grad_row * s_loc, par.sp_overlap))
            for (op, nbytes, count, off), times in ([(x, reps // per) for x in fwd]
                                                    + [(x, bwds // per) for x in bwd]):
                peer = (shape.rank_of(coord._replace(sp=(coord.sp + off * stride) % par.sp))
                        if off else None)
                calls.append(Call(group, op, nbytes, count * times, peer))
    return calls


def as_documents(docs: Any) -> DocumentPositions:
    """A microbatch's documents: ``docs`` itself if a :class:`DocumentPositions`, else made
    from document ids ``[B, S]`` (no positions: what the traffic and the hops read)."""
    return docs if isinstance(docs, DocumentPositions) else DocumentPositions.of(np.arange(0), docs)


def microbatch_split(seq: SeqLayout, docs: DocumentPositions) -> SeqLayout:
    """``seq``, or under the balanced split the microbatch's own (:meth:`~mpipar.parallel.
    sequence_split.SeqLayout.for_microbatch`, remembered on ``docs``)."""
    if seq.split != "balanced":
        return seq
    return docs.remember(("balanced", seq.seq_len, seq.sp, seq.min_chunk),
                         lambda: seq.for_microbatch(docs.docs))


def _ulysses_calls(group: str, q: int, kv: int, reps: int, bwds: int) -> list[Call]:
    """All-to-alls of q, k, v and the output forward (``reps`` times), of dout, dq, dk, dv
    backward (``bwds`` times); ``q``, ``kv``: bytes of this rank's q and of its k (= v)."""
    return [Call(group, "alltoall", q, 2 * (reps + bwds)),
            Call(group, "alltoall", kv, 2 * (reps + bwds))]
