"""Sequence (context) parallelism: how a sequence is split over SP, and attention across it.

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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipar.comm import Group

SPLITS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class SeqLayout:
    """Which global token positions each SP rank holds."""

    seq_len: int
    sp: int
    split: str = "contiguous"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"sp_split={self.split!r}: must be one of {', '.join(SPLITS)}")
        parts = self.sp * (2 if self.split == "zigzag" else 1)
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
        """Global positions ``[S_loc]`` of ``rank``'s tokens, in local order."""
        return np.concatenate([np.arange(s, s + n) for s, n in self.segments(rank)])

    @property
    def local_len(self) -> int:
        return self.seq_len // self.sp


def _local_slices(segments: list[tuple[int, int]]) -> list[slice]:
    out, at = [], 0
    for _, n in segments:
        out.append(slice(at, at + n))
        at += n
    return out


class RingAttention:
    """Causal attention of this rank's queries over all SP ranks' keys, by passing K/V around."""

    def __init__(self, kernels, sp: Group, layout: SeqLayout, overlap: bool = False) -> None:
        self.k, self.sp, self.layout, self.overlap = kernels, sp, layout, overlap
        self.rank = sp.rank
        self.left, self.right = (sp.rank - 1) % sp.size, (sp.rank + 1) % sp.size
        self.q_segs = layout.segments(sp.rank)
        self.q_slices = _local_slices(self.q_segs)

    def _pairs(self, src: int):
        """(q slice, q start, k slice, k start) of every (query run, key run) pair of block ``src``
        that the causal mask does not empty entirely."""
        k_segs = self.layout.segments(src)
        for qsl, (qs, qn) in zip(self.q_slices, self.q_segs):
            for ksl, (ks, _) in zip(_local_slices(k_segs), k_segs):
                if ks <= qs + qn - 1:
                    yield qsl, qs, ksl, ks

    def _shift(self, buf: np.ndarray, tag: int) -> np.ndarray:
        """Blocking ring step: send ``buf`` right, receive the left neighbour's."""
        recv = np.empty(buf.shape, buf.dtype)
        return self.sp.sendrecv(buf, self.right, recv, self.left, tag)

    def _start_shift(self, buf: np.ndarray, tag: int):
        recv = np.empty(buf.shape, buf.dtype)
        reqs = [self.sp.irecv(recv, self.left, tag), self.sp.isend(buf, self.right, tag)]
        return recv, reqs

    def forward(self, q, k, v, positions):
        B, S, hq, D = q.shape
        out = np.zeros_like(q)
        lse = np.full((B, hq, S), -np.inf, dtype=np.float64 if q.dtype == np.float64
                      else np.float32)
        kv = np.ascontiguousarray(np.stack([k, v]))  # one message per hop: [2, B, S, hkv, D]
        for t in range(self.sp.size):
            src = (self.rank - t) % self.sp.size
            last = t == self.sp.size - 1
            if self.overlap and not last:
                nxt, reqs = self._start_shift(kv, tag=t)
            for qsl, qs, ksl, ks in self._pairs(src):
                o, l = self.k.attention_fwd(q[:, qsl], kv[0][:, ksl], kv[1][:, ksl], qs, ks, True)
                out[:, qsl], lse[:, :, qsl] = self.k.attention_merge(out[:, qsl], lse[:, :, qsl],
                                                                     o, l)
            if not last:
                if self.overlap:
                    for r in reqs:
                        r.wait()
                    kv = nxt
                else:
                    kv = self._shift(kv, tag=t)
        return out, (q, k, v, out, lse)

    def backward(self, dout, ctx):
        q, k, v, out, lse = ctx
        dq = np.zeros_like(q)
        n = self.sp.size
        if self.overlap:
            return self._backward_overlapped(q, k, v, out, lse, dout, dq)
        # Travelling buffer: this block's K, V and the dK, dV accumulated for it so far.
        buf = np.ascontiguousarray(np.concatenate([np.stack([k, v]),
                                                   np.zeros((2,) + k.shape, k.dtype)]))
        for t in range(n):
            self._block_grads(q, out, lse, dout, dq, buf[0], buf[1], buf[2], buf[3],
                              (self.rank - t) % n)
            if t < n - 1:
                buf = self._shift(buf, tag=100 + t)
            else:  # last hop: only the gradients still need to travel home
                buf = self._shift(np.ascontiguousarray(buf[2:]), tag=100 + t)
        return dq, buf[-2], buf[-1]

    def _backward_overlapped(self, q, k, v, out, lse, dout, dq):
        """As backward, but the next K/V block travels while this one is computed; the dK/dV
        of a block can only leave once computed, so they follow as a second message."""
        n = self.sp.size
        kv = np.ascontiguousarray(np.stack([k, v]))
        dkv = np.zeros((2,) + k.shape, k.dtype)
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
            dqp, dkp, dvp = self.k.attention_bwd(q[:, qsl], k[:, ksl], v[:, ksl], out[:, qsl],
                                                 lse[:, :, qsl], dout[:, qsl], qs, ks, True)
            dq[:, qsl] += dqp
            dk[:, ksl] += dkp
            dv[:, ksl] += dvp


class UlyssesAttention:
    """All-to-all sequence parallelism: trade sequence chunks for head groups and back."""

    def __init__(self, kernels, sp: Group, layout: SeqLayout) -> None:
        self.k, self.sp, self.layout = kernels, sp, layout
        full = np.concatenate([layout.positions(r) for r in range(sp.size)])
        self.order = np.argsort(full, kind="stable")     # gathered order -> global order
        self.inverse = np.argsort(self.order, kind="stable")

    def _to_heads(self, x: np.ndarray) -> np.ndarray:
        """``[B, S_loc, h, D]`` (sequence chunk) -> ``[B, S, h/sp, D]`` (global order, head group)."""
        B, S, h, D = x.shape
        n = self.sp.size
        send = np.ascontiguousarray(x.reshape(B, S, n, h // n, D).transpose(2, 0, 1, 3, 4))
        recv = self.sp.alltoall(send, np.empty(send.shape, send.dtype))  # block i: rank i's chunk
        full = recv.transpose(1, 0, 2, 3, 4).reshape(B, n * S, h // n, D)
        return full[:, self.order]

    def _to_seq(self, x: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`_to_heads`."""
        B, St, hg, D = x.shape
        n = self.sp.size
        S = St // n
        send = np.ascontiguousarray(x[:, self.inverse].reshape(B, n, S, hg, D).transpose(1, 0, 2, 3, 4))
        recv = self.sp.alltoall(send, np.empty(send.shape, send.dtype))  # block i: head group i
        return recv.transpose(1, 2, 0, 3, 4).reshape(B, S, n * hg, D)

    def forward(self, q, k, v, positions):
        qf, kf, vf = self._to_heads(q), self._to_heads(k), self._to_heads(v)
        o, lse = self.k.attention_fwd(qf, kf, vf, 0, 0, True)
        return self._to_seq(o), (qf, kf, vf, o, lse)

    def backward(self, dout, ctx):
        qf, kf, vf, o, lse = ctx
        dq, dk, dv = self.k.attention_bwd(qf, kf, vf, o, lse, self._to_heads(dout), 0, 0, True)
        return self._to_seq(dq), self._to_seq(dk), self._to_seq(dv)
