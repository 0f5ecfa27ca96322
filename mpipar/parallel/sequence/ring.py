"""Ring attention (``--sp-mode ring``): K and V travel along the SP ring.

:class:`RingAttention` passes K/V along relays (``Sendrecv``, or with ``overlap`` an
``Isend``/``Irecv`` of the next block posted before the current block is computed, in forward
and backward); partial results merge by log-sum-exp; blocks the causal mask or the sliding
window empties are skipped, not computed. The hops are those that can still reach a query
(:func:`ring_hops`): the whole ring for full causal attention, ``ceil((W-1)/S_loc)`` for a
window W over a contiguous split, and both ways for zigzag. In backward the dK/dV of each
block travel with it and go straight home after its relay's last hop. :data:`RING` is the mode.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar.model.attention import (DocumentPositions, accumulator, as_activations, attend_bwd,
                                    attend_fwd, documents_of, runs_visible)
from mpipar.parallel.calls import Call
from mpipar.parallel.sequence.common import Array, Message, local_slices, needs_block
from mpipar.parallel.sequence.mode import SequenceMode, SequenceTraffic
from mpipar.parallel.sequence_split import SeqLayout
from mpipar.runtime.comm import Group


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

    @property
    def blocks(self) -> int:
        """Key blocks beyond its own a rank attends to: one a hop, either way."""
        return self.right + self.left


def ring_messages(hops: RingHops, kv: int, dkv: int, overlap: bool
                  ) -> tuple[list[Message], list[Message]]:
    """(forward, backward) messages of one block of ring attention on one rank; ``kv``: bytes of
    this rank's block as it travels (its K and V, or its latent), ``dkv``: of that block's
    gradient (float32 under bf16). Per relay of h hops in direction d: forward h block
    Sendrecvs (with overlap Isend + Irecv); backward the block at hop 1, the block with its
    gradient at hops 2..h (with overlap: h block Isend/Irecv and h - 1 gradient Sendrecvs) and
    the gradient home, d h ranks back."""
    fwd: list[Message] = []
    bwd: list[Message] = []
    for d, h in hops.relays():
        home = ("sendrecv", dkv, 1, -d * h)
        if overlap:
            fwd += [("send", kv, h, d), ("recv", 0, h, 0)]
            bwd += [("send", kv, h, d), ("recv", 0, h, 0), ("sendrecv", dkv, h - 1, d), home]
        else:
            fwd += [("sendrecv", kv, h, d)]
            bwd += [("sendrecv", kv, 1, d), ("sendrecv", kv + dkv, h - 1, d), home]
    return fwd, bwd


class ExpandedBlocks:
    """The blocks a ring passes as they are attended: K and V ``[2, B, S, hkv, D]`` (the
    interface of :class:`mpipar.model.latent_attention.LatentBlocks`, which passes latents)."""

    def __init__(self, xp, k: Array, v: Array) -> None:
        self.xp, self.message = xp, xp.ascontiguousarray(xp.stack([k, v]))

    def open(self, buf: Array) -> tuple[Array, Array]:
        """(k, v) of a block's message."""
        return buf[0], buf[1]

    def accumulate(self, buf: Array, dbuf: Array, block_grads, kv=None) -> None:
        """Add to ``dbuf`` (the message's gradient) what ``block_grads(k, v, dk, dv)`` adds to
        the block's dk, dv (here in place: they are ``dbuf``'s halves)."""
        block_grads(*(kv or self.open(buf)), dbuf[0], dbuf[1])

    def result(self, dq: Array, dbuf: Array, like: Array) -> tuple[Array, Array, Array]:
        """The core's (dq, dk, dv) from this rank's block's gradient."""
        return as_activations((dq, dbuf[0], dbuf[1]), like)


def _with_grads(xp, kv: Array) -> Array:
    """One backward relay message: the bytes of a block's message (its K/V ``[2, B, S, hkv,
    D]`` or latent), then room for the gradient gathered for it so far (zeros, in the
    accumulator dtype)."""
    grads = kv.size * accumulator(kv.dtype).itemsize
    buf = xp.zeros(kv.nbytes + grads, xp.uint8)
    buf[:kv.nbytes] = kv.reshape(-1).view(xp.uint8)
    return buf


def _unpack(buf: Array, shape: tuple[int, ...], dtype: Any) -> tuple[Array, Array]:
    """(block, its gradient) of ``shape`` each, views of a message of :func:`_with_grads`."""
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
    passes_latent = True

    def __init__(self, kernels, sp: Group, seq_layout: SeqLayout, overlap: bool = False) -> None:
        self.kernels, self.xp, self.sp, self.overlap = kernels, kernels.xp, sp, overlap
        self.seq_layout = seq_layout
        self.rank = sp.rank
        self.q_segs = seq_layout.segments(sp.rank)
        self.q_slices = local_slices(self.q_segs)

    def _layout(self, docs: DocumentPositions | None) -> SeqLayout:
        """The split of this microbatch: its own under ``--sp-split balanced``, else the run's."""
        return self.seq_layout if docs is None or docs.layout is None else docs.layout

    def _pairs(self, src: int, window: int, docs: DocumentPositions | None = None):
        """(q slice, q start, k slice, k start) of every (query run, key run) pair of block ``src``
        that the causal mask and the window do not empty entirely."""
        layout = self._layout(docs)
        k_segs, q_segs = layout.segments(src), layout.segments(self.rank)
        for qsl, (qs, qn) in zip(local_slices(q_segs), q_segs):
            for ksl, (ks, kn) in zip(local_slices(k_segs), k_segs):
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

    def _payload(self, k: Array, v: Array, latent: Any):
        """How this rank's block travels: ``latent`` (a :class:`~mpipar.model.latent_attention.
        LatentBlocks`) when the block passes one, else K and V (:class:`ExpandedBlocks`)."""
        return ExpandedBlocks(self.xp, k, v) if latent is None else latent

    def forward(self, q: Array, k: Array, v: Array, positions: np.ndarray,
                window: int = 0, latent: Any = None) -> tuple[Array, Array]:
        """(out ``[B, S, hq, D]``, lse ``[B, hq, S]``: what backward needs beyond q, k, v, out).
        ``latent``: the blocks travel as latents (:class:`~mpipar.model.latent_attention.
        LatentBlocks`), each expanded where it is attended."""
        xp = self.xp
        B, S, hq, D = q.shape
        out = xp.zeros(q.shape, accumulator(q.dtype))     # merged in float32 under bf16
        lse = xp.full((B, hq, S), -np.inf, dtype=xp.float64 if q.dtype == xp.float64
                      else xp.float32)
        payload = self._payload(k, v, latent)     # one message per hop
        docs = documents_of(positions)
        hops = document_hops(self._layout(docs), window, docs)
        for src, blk in self._blocks(payload.message, hops, tag=0):
            kb, vb = (k, v) if src == self.rank else payload.open(blk)
            for qsl, qs, ksl, ks in self._pairs(src, window, docs):
                res = attend_fwd(self.kernels, q[:, qsl], kb[:, ksl], vb[:, ksl], qs, ks,
                                 window, docs)
                if res is not None:    # None: no pair of one document (packed documents)
                    out[:, qsl], lse[:, :, qsl] = self.kernels.attention_merge(
                        out[:, qsl], lse[:, :, qsl], *res)
        return out.astype(q.dtype, copy=False), (lse, docs)

    def backward(self, dout: Array, q: Array, k: Array, v: Array, out: Array,
                 saved: tuple, window: int = 0, latent: Any = None
                 ) -> tuple[Array, Array, Array]:
        """``saved``: forward's (lse ``[B, hq, S]``, documents or None). With ``latent`` (as
        forward's): (dq, the gradient of this rank's latent ``[B, S, r_kv + d_r]``, None)."""
        xp = self.xp
        lse, docs = saved
        payload = self._payload(k, v, latent)
        grad = xp.zeros(payload.message.shape, accumulator(q.dtype))
        dq = xp.zeros(q.shape, grad.dtype)
        payload.accumulate(payload.message, grad, self._grads_of(
            q, out, lse, dout, dq, self.rank, window, docs), kv=(k, v))
        hops = document_hops(self._layout(docs), window, docs)
        for i, (d, h) in enumerate(hops.relays()):
            relay = self._relay_overlapped if self.overlap else self._relay
            grad += relay(q, payload, out, lse, dout, dq, d, h, window,
                          tag=4 * self.sp.size * (i + 1), docs=docs)
        return payload.result(dq, grad, q)

    def _grads_of(self, q, out, lse, dout, dq, src: int, window: int, docs):
        """``block_grads(k, v, dk, dv)``: :meth:`_block_grads` of block ``src``."""
        return lambda k, v, dk, dv: self._block_grads(q, out, lse, dout, dq, k, v, dk, dv, src,
                                                      window, docs)

    def _relay(self, q, payload, out, lse, dout, dq, d: int, hops: int, window: int, tag: int,
               docs=None):
        """One relay of backward: -> the gradient of this rank's block's message from the
        ranks it visited."""
        kv = self._shift(payload.message, d, tag)
        buf = _with_grads(self.xp, kv)        # the block, and the gradient gathered for it
        for t in range(1, hops + 1):
            if t > 1:
                buf = self._shift(buf, d, tag + t)
            kv, dkv = _unpack(buf, kv.shape, kv.dtype)
            payload.accumulate(kv, dkv, self._grads_of(
                q, out, lse, dout, dq, (self.rank - d * t) % self.sp.size, window, docs))
        return self._home(self.xp.ascontiguousarray(dkv), d, hops, tag + hops + 1)

    def _relay_overlapped(self, q, payload, out, lse, dout, dq, d: int, hops: int, window: int,
                          tag: int, docs=None):
        """As :meth:`_relay`, but the next block travels while this one is computed; a block's
        gradient can only leave once computed, so it follows as a second message."""
        xp = self.xp
        kv, dkv = payload.message, None
        nxt, reqs = self._start_shift(kv, d, tag)
        for t in range(1, hops + 1):
            for r in reqs:
                r.wait()
            kv = nxt
            if t < hops:
                nxt, reqs = self._start_shift(kv, d, tag + t)
            dkv = (xp.zeros(kv.shape, accumulator(kv.dtype)) if dkv is None
                   else self._shift(dkv, d, tag + self.sp.size + t))
            payload.accumulate(kv, dkv, self._grads_of(
                q, out, lse, dout, dq, (self.rank - d * t) % self.sp.size, window, docs))
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


class RingMode(SequenceMode):
    """``--sp-mode ring``: the only mode that may deal documents (``--sp-split balanced``)."""

    name = "ring"
    balanced_split = True
    balance_hint = ""

    def core(self, kernels, groups, seq_layout, par):
        return RingAttention(kernels, groups["sp"], seq_layout, par.sp_overlap)

    def calls(self, t: SequenceTraffic) -> list[Call]:
        seq = t.split()
        return t.relay("sp", 1, t.packs(seq), lambda s, w, d: ring_messages(
            document_hops(s, w, d), t.ring_row * t.s_loc, t.ring_grad_row * t.s_loc,
            t.layout.parallel.sp_overlap))

    def key_blocks(self, seq: SeqLayout, window: int) -> int:
        return ring_hops(seq, window).blocks

    def document_blocks(self, split: SeqLayout, ring: SeqLayout, window: int,
                        docs: DocumentPositions) -> int:
        return document_hops(split, window, docs).blocks

    def search_choices(self, base, sp: int, node_sp: int) -> list[tuple[str, int]]:
        return [("zigzag", 0), ("contiguous", 0)]


RING = RingMode()
