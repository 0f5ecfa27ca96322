"""Sequence (context) parallelism: how a sequence is split over SP, and attention across it.

Both attention cores implement :class:`mpipar.model.attention.AttentionCore` for a block that
holds only this rank's chunk of the sequence.

- :class:`SeqLayout`: ``contiguous`` (rank i holds tokens ``[i*S/sp, (i+1)*S/sp)``) or ``zigzag``
  (the sequence cut into ``2*sp`` chunks; rank i holds chunks i and ``2*sp-1-i``, which balances the
  causal work). RoPE and the causal mask use the global positions.
- :class:`RingAttention`: K and V travel around the SP ring (``Sendrecv``, or with ``overlap`` an
  ``Isend``/``Irecv`` of the next block posted before the current block is computed, in forward
  and backward); partial
  results merge by log-sum-exp; blocks the causal mask empties are skipped, not computed. In
  backward the dK/dV of each block travel with it and arrive back at their owner after ``sp`` hops.
- :class:`UlyssesAttention`: an all-to-all re-shards from sequence chunks to head groups, each rank
  attends over the whole sequence for ``heads/sp`` heads, and a second all-to-all returns.
- :class:`HybridAttention` (``--sp-mode hybrid``, USP's and Megatron's hierarchical context
  parallelism): Ulysses' all-to-all among the ``U = --ulysses-size`` consecutive sp ranks (one
  node's, when they fit in one), then ring attention over the ``sp / U`` such groups, so only
  the ring crosses nodes. A Ulysses group's chunks together are the chunks of one ring rank of
  the same split over ``sp / U`` ranks (contiguous stays contiguous; zigzag stays zigzag, with
  ``U``-times larger chunks), so the ring keeps its causal skipping, zigzag balance and overlap.

Shapes: q ``[B, S_loc, hq, D]``, k/v ``[B, S_loc, hkv, D]``, lse ``[B, hq, S_loc]``.
Every buffer is allocated from the kernel backend's array module (``kernels.xp``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar.comm import Group
from mpipar.config import Config, require, rules

SPLITS = ("contiguous", "zigzag")
Array = Any


def split_parts(sp: int, split: str) -> int:
    """Equal parts the sequence is cut into: ``sp`` (contiguous) or ``2 * sp`` (zigzag)."""
    return sp * (2 if split == "zigzag" else 1)


@dataclass(frozen=True)
class SeqLayout:
    """Which global token positions each SP rank holds."""

    seq_len: int
    sp: int
    split: str = "contiguous"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"sp_split={self.split!r}: must be one of {', '.join(SPLITS)}")
        parts = split_parts(self.sp, self.split)
        if self.seq_len % parts:
            raise ValueError(f"seq_len={self.seq_len}: must be divisible by {parts} for "
                             f"sp={self.sp} with the {self.split} split")

    def segments(self, rank: int) -> list[tuple[int, int]]:
        """(start, length) of each contiguous run of global positions held by ``rank``, in order."""
        if self.split == "contiguous":
            n = self.seq_len // self.sp
            return [(rank * n, n)]
        n = self.seq_len // (2 * self.sp)
        return [(rank * n, n), ((2 * self.sp - 1 - rank) * n, n)]

    def positions(self, rank: int) -> np.ndarray:
        """Global positions ``[S_loc]`` of ``rank``'s tokens, in local order (host metadata)."""
        return np.concatenate([np.arange(s, s + n) for s, n in self.segments(rank)])


def _local_slices(segments: list[tuple[int, int]]) -> list[slice]:
    out, at = [], 0
    for _, n in segments:
        out.append(slice(at, at + n))
        at += n
    return out


class RingAttention:
    """Causal attention of this rank's queries over all SP ranks' keys, by passing K/V around.
    Its backward reads the block's q, k, v and output as given; it saves only the lse."""

    needs_inputs = True

    def __init__(self, kernels, sp: Group, seq_layout: SeqLayout, overlap: bool = False) -> None:
        self.kernels, self.xp, self.sp, self.overlap = kernels, kernels.xp, sp, overlap
        self.seq_layout = seq_layout
        self.rank = sp.rank
        self.left, self.right = (sp.rank - 1) % sp.size, (sp.rank + 1) % sp.size
        self.q_segs = seq_layout.segments(sp.rank)
        self.q_slices = _local_slices(self.q_segs)

    def _pairs(self, src: int):
        """(q slice, q start, k slice, k start) of every (query run, key run) pair of block ``src``
        that the causal mask does not empty entirely."""
        k_segs = self.seq_layout.segments(src)
        for qsl, (qs, qn) in zip(self.q_slices, self.q_segs):
            for ksl, (ks, _) in zip(_local_slices(k_segs), k_segs):
                if ks <= qs + qn - 1:
                    yield qsl, qs, ksl, ks

    def _shift(self, buf: Array, tag: int) -> Array:
        """Blocking ring step: send ``buf`` right, receive the left neighbour's."""
        recv = self.xp.empty(buf.shape, buf.dtype)
        return self.sp.sendrecv(buf, self.right, recv, self.left, tag)

    def _start_shift(self, buf: Array, tag: int):
        recv = self.xp.empty(buf.shape, buf.dtype)
        reqs = [self.sp.irecv(recv, self.left, tag), self.sp.isend(buf, self.right, tag)]
        return recv, reqs

    def forward(self, q: Array, k: Array, v: Array, positions: np.ndarray) -> tuple[Array, Array]:
        """(out ``[B, S, hq, D]``, lse ``[B, hq, S]``: what backward needs beyond q, k, v, out)."""
        xp = self.xp
        B, S, hq, D = q.shape
        out = xp.zeros_like(q)
        lse = xp.full((B, hq, S), -np.inf, dtype=xp.float64 if q.dtype == xp.float64
                      else xp.float32)
        kv = xp.ascontiguousarray(xp.stack([k, v]))  # one message per hop: [2, B, S, hkv, D]
        for t in range(self.sp.size):
            src = (self.rank - t) % self.sp.size
            last = t == self.sp.size - 1
            if self.overlap and not last:
                nxt, reqs = self._start_shift(kv, tag=t)
            for qsl, qs, ksl, ks in self._pairs(src):
                o, l = self.kernels.attention_fwd(q[:, qsl], kv[0][:, ksl], kv[1][:, ksl], qs, ks, True)
                out[:, qsl], lse[:, :, qsl] = self.kernels.attention_merge(out[:, qsl], lse[:, :, qsl],
                                                                     o, l)
            if not last:
                if self.overlap:
                    for r in reqs:
                        r.wait()
                    kv = nxt
                else:
                    kv = self._shift(kv, tag=t)
        return out, lse

    def backward(self, dout: Array, q: Array, k: Array, v: Array, out: Array,
                 lse: Array) -> tuple[Array, Array, Array]:
        xp = self.xp
        dq = xp.zeros_like(q)
        n = self.sp.size
        if self.overlap:
            return self._backward_overlapped(q, k, v, out, lse, dout, dq)
        # Travelling buffer: this block's K, V and the dK, dV accumulated for it so far.
        buf = xp.ascontiguousarray(xp.concatenate([xp.stack([k, v]),
                                                   xp.zeros((2,) + k.shape, k.dtype)]))
        for t in range(n):
            self._block_grads(q, out, lse, dout, dq, buf[0], buf[1], buf[2], buf[3],
                              (self.rank - t) % n)
            if t < n - 1:
                buf = self._shift(buf, tag=100 + t)
            else:  # last hop: only the gradients still need to travel home
                buf = self._shift(xp.ascontiguousarray(buf[2:]), tag=100 + t)
        return dq, buf[-2], buf[-1]

    def _backward_overlapped(self, q, k, v, out, lse, dout, dq):
        """As backward, but the next K/V block travels while this one is computed; the dK/dV
        of a block can only leave once computed, so they follow as a second message."""
        xp = self.xp
        n = self.sp.size
        kv = xp.ascontiguousarray(xp.stack([k, v]))
        dkv = xp.zeros((2,) + k.shape, k.dtype)
        for t in range(n):
            if t < n - 1:
                nxt, reqs = self._start_shift(kv, tag=200 + t)
            self._block_grads(q, out, lse, dout, dq, kv[0], kv[1], dkv[0], dkv[1],
                              (self.rank - t) % n)
            dkv = self._shift(dkv, tag=100 + t)
            if t < n - 1:
                for r in reqs:
                    r.wait()
                kv = nxt
        return dq, dkv[0], dkv[1]

    def _block_grads(self, q, out, lse, dout, dq, k, v, dk, dv, src: int) -> None:
        """Add block ``src``'s contributions to dq (this rank's) and dk, dv (the block's)."""
        for qsl, qs, ksl, ks in self._pairs(src):
            dqp, dkp, dvp = self.kernels.attention_bwd(q[:, qsl], k[:, ksl], v[:, ksl], out[:, qsl],
                                                 lse[:, :, qsl], dout[:, qsl], qs, ks, True)
            dq[:, qsl] += dqp
            dk[:, ksl] += dkp
            dv[:, ksl] += dvp


@dataclass
class UlyssesSaved:
    """What Ulysses (and hybrid) attention keeps for backward: its all-to-all'ed copies
    (``heads/U`` heads of the group's tokens, in the order the attention over them takes) of q,
    k, v and of the output, and the lse."""

    q: Array     # [B, S_group, hq/U, D]
    k: Array     # [B, S_group, hkv/U, D]
    v: Array
    out: Array   # [B, S_group, hq/U, D]
    lse: Array   # [B, hq/U, S_group]


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

    def forward(self, q, k, v, positions):
        ex = self.exchange
        qf, kf, vf = ex.to_heads(q), ex.to_heads(k), ex.to_heads(v)
        o, lse = self.kernels.attention_fwd(qf, kf, vf, 0, 0, True)
        return ex.to_seq(o), UlyssesSaved(qf, kf, vf, o, lse)

    def backward(self, dout, q, k, v, out, saved: UlyssesSaved):
        ex = self.exchange
        dq, dk, dv = self.kernels.attention_bwd(saved.q, saved.k, saved.v, saved.out, saved.lse,
                                                ex.to_heads(dout), 0, 0, True)
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

    def forward(self, q, k, v, positions):
        ex = self.exchange
        qf, kf, vf = ex.to_heads(q), ex.to_heads(k), ex.to_heads(v)
        o, lse = self.ring.forward(qf, kf, vf, self.positions)
        return ex.to_seq(o), UlyssesSaved(qf, kf, vf, o, lse)

    def backward(self, dout, q, k, v, out, saved: UlyssesSaved):
        ex = self.exchange
        dq, dk, dv = self.ring.backward(ex.to_heads(dout), saved.q, saved.k, saved.v, saved.out,
                                        saved.lse)
        return ex.to_seq(dq), ex.to_seq(dk), ex.to_seq(dv)


@rules("context")
def check_config(cfg: Config, world: int) -> None:
    """The sequence must cut into the split's equal parts; Ulysses needs each rank's heads to
    divide into sp groups; hybrid a Ulysses group size that divides sp and the heads."""
    m, p, t = cfg.model.resolved(), cfg.parallel, cfg.train
    parts = split_parts(p.sp, p.sp_split)
    require(t.seq_len % parts == 0,
            f"train.seq_len={t.seq_len}: must be divisible by "
            + (f"2*sp = {parts} for the zigzag split" if p.sp_split == "zigzag"
               else f"parallel.sp={p.sp}"))
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
