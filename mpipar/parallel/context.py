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
    """What Ulysses attention keeps for backward: its all-to-all'ed copies (whole sequence,
    ``heads/sp`` heads, global order) of q, k, v and of the output, and the lse."""

    q: Array     # [B, S, hq/sp, D]
    k: Array     # [B, S, hkv/sp, D]
    v: Array
    out: Array   # [B, S, hq/sp, D]
    lse: Array   # [B, hq/sp, S]


class UlyssesAttention:
    """All-to-all sequence parallelism: trade sequence chunks for head groups and back. Its
    backward works on its own copies (:class:`UlyssesSaved`), not on the block's q, k, v."""

    needs_inputs = False

    def __init__(self, kernels, sp: Group, seq_layout: SeqLayout) -> None:
        self.kernels, self.xp, self.sp = kernels, kernels.xp, sp
        full = np.concatenate([seq_layout.positions(r) for r in range(sp.size)])
        order = np.argsort(full, kind="stable")         # gathered order -> global order
        self.order = self.xp.asarray(order)
        self.inverse = self.xp.asarray(np.argsort(order, kind="stable"))

    def _to_heads(self, x: Array) -> Array:
        """``[B, S_loc, h, D]`` (sequence chunk) -> ``[B, S, h/sp, D]`` (global order, head group)."""
        xp = self.xp
        B, S, h, D = x.shape
        n = self.sp.size
        send = xp.ascontiguousarray(x.reshape(B, S, n, h // n, D).transpose(2, 0, 1, 3, 4))
        recv = self.sp.alltoall(send, xp.empty(send.shape, send.dtype))  # block i: rank i's chunk
        full = recv.transpose(1, 0, 2, 3, 4).reshape(B, n * S, h // n, D)
        return full[:, self.order]

    def _to_seq(self, x: Array) -> Array:
        """Inverse of :meth:`_to_heads`."""
        xp = self.xp
        B, St, hg, D = x.shape
        n = self.sp.size
        S = St // n
        send = xp.ascontiguousarray(x[:, self.inverse].reshape(B, n, S, hg, D)
                                    .transpose(1, 0, 2, 3, 4))
        recv = self.sp.alltoall(send, xp.empty(send.shape, send.dtype))  # block i: head group i
        return recv.transpose(1, 2, 0, 3, 4).reshape(B, S, n * hg, D)

    def forward(self, q, k, v, positions):
        qf, kf, vf = self._to_heads(q), self._to_heads(k), self._to_heads(v)
        o, lse = self.kernels.attention_fwd(qf, kf, vf, 0, 0, True)
        return self._to_seq(o), UlyssesSaved(qf, kf, vf, o, lse)

    def backward(self, dout, q, k, v, out, saved: UlyssesSaved):
        dq, dk, dv = self.kernels.attention_bwd(saved.q, saved.k, saved.v, saved.out, saved.lse,
                                          self._to_heads(dout), 0, 0, True)
        return self._to_seq(dq), self._to_seq(dk), self._to_seq(dv)


@rules("context")
def check_config(cfg: Config, world: int) -> None:
    """The sequence must cut into the split's equal parts; Ulysses needs each rank's heads to
    divide into sp groups."""
    m, p, t = cfg.model.resolved(), cfg.parallel, cfg.train
    parts = split_parts(p.sp, p.sp_split)
    require(t.seq_len % parts == 0,
            f"train.seq_len={t.seq_len}: must be divisible by "
            + (f"2*sp = {parts} for the zigzag split" if p.sp_split == "zigzag"
               else f"parallel.sp={p.sp}"))
    if p.sp_mode == "ulysses":
        for name, heads in (("heads", m.heads), ("kv_heads", m.kv_heads)):
            require((heads // p.tp) % p.sp == 0,
                    f"parallel.sp={p.sp}: ulysses needs model.{name}/tp = {heads}/{p.tp} "
                    f"divisible by sp")
