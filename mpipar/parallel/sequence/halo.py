"""Halo attention (``--sp-mode halo``): with a sliding window, each rank receives just the K/V
of the ``W - 1`` positions before its runs from the ranks holding them (non-blocking
point-to-point, overlapped with the local block): O(W) bytes per rank instead of O(S).
:data:`HALO` is the mode."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from mpipar.model.attention import (DocumentPositions, accumulator, as_activations, attend_bwd,
                                    attend_fwd, documents_of, runs_visible)
from mpipar.layout import Layout
from mpipar.parallel.calls import Call
from mpipar.parallel.sequence.common import Array, Message, local_slices
from mpipar.parallel.sequence.mode import SequenceMode, SequenceTraffic
from mpipar.parallel.sequence_split import SeqLayout
from mpipar.runtime.comm import Group
from mpipar.runtime.precision import Precision


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
    passes_latent = False
    TAG = 300

    def __init__(self, kernels, sp: Group, seq_layout: SeqLayout) -> None:
        self.kernels, self.xp, self.sp, self.seq_layout = kernels, kernels.xp, sp, seq_layout
        self.rank = sp.rank
        self.q_segs = seq_layout.segments(sp.rank)
        self.q_slices = local_slices(self.q_segs)

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


class HaloMode(SequenceMode):
    """``--sp-mode halo``: bytes grow with the window, not the sequence; the documents do not
    change which rows cross."""

    name = "halo"
    sends_window = True
    balance_hint = (" (the ring passes whole K/V blocks where the halo sends only the "
                    "window's)")

    def core(self, kernels, groups, seq_layout, par):
        return HaloAttention(kernels, groups["sp"], seq_layout)

    def calls(self, t: SequenceTraffic) -> list[Call]:
        sp, me = t.layout.parallel.sp, t.coord.sp
        return t.relay("sp", 1, [(None, t.split())], lambda s, w, d: halo_messages(
            halo_plan(s, me, w), me, sp, t.row, t.grad_row))

    def saved_bytes(self, layout: Layout) -> int:
        """The K/V rows halo attention keeps for backward in one block (the most of any SP
        rank and layer)."""
        m, par, tr = layout.model, layout.parallel, layout.train
        seq = SeqLayout(tr.seq_len, par.sp, par.sp_split)
        rows = max(sum(len(p) for p in halo_plan(seq, r, w).recv.values())
                   for r in range(par.sp) for w in set(m.windows()))
        return 2 * rows * layout.micro_rows * (m.kv_heads // par.tp) * m.head_dim \
            * Precision.of(tr, par).compute_bytes

    def key_blocks(self, seq: SeqLayout, window: int) -> int:
        """The halo's source ranks (the most of any rank)."""
        return max(len(halo_plan(seq, r, window).recv) for r in range(seq.sp))


HALO = HaloMode()
