"""Ulysses attention (``--sp-mode ulysses``): an all-to-all re-shards from sequence chunks to
head groups, each rank attends over the whole sequence for ``heads/sp`` heads, and a second
all-to-all returns. :class:`HeadExchange` is the re-sharding (hybrid's too); :data:`ULYSSES` is
the mode."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar.config import require
from mpipar.layout import Layout
from mpipar.model.attention import (DocumentPositions, as_activations, attend_bwd, attend_fwd,
                                    documents_of, grads_as_activations)
from mpipar.parallel.calls import Call
from mpipar.parallel.sequence.common import Array
from mpipar.parallel.sequence.mode import SequenceMode, SequenceTraffic
from mpipar.parallel.sequence_split import SeqLayout
from mpipar.runtime.comm import Group
from mpipar.runtime.precision import Precision


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
    passes_latent = False

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


def ulysses_calls(group: str, q: int, kv: int, reps: int, bwds: int) -> list[Call]:
    """All-to-alls of q, k, v and the output forward (``reps`` times), of dout, dq, dk, dv
    backward (``bwds`` times); ``q``, ``kv``: bytes of this rank's q and of its k (= v)."""
    return [Call(group, "alltoall", q, 2 * (reps + bwds)),
            Call(group, "alltoall", kv, 2 * (reps + bwds))]


def check_heads(layout: Layout, group: int, what: str, mode: str) -> None:
    """Each rank's heads (and KV heads) divide into the all-to-all's ``group`` ranks."""
    m, p = layout.model, layout.parallel
    for name, heads in (("heads", m.heads), ("kv_heads", m.kv_heads)):
        require((heads // p.tp) % group == 0,
                f"parallel.{what}={group}: {mode} needs model.{name}/tp = "
                f"{heads}/{p.tp} divisible by {what}")


class UlyssesMode(SequenceMode):
    """``--sp-mode ulysses``: the sp ranks share the whole sequence's work; no ring."""

    name = "ulysses"
    keeps_inputs = False
    balance_hint = ""

    def check(self, layout: Layout) -> None:
        super().check(layout)
        check_heads(layout, layout.parallel.sp, "sp", self.name)

    def core(self, kernels, groups, seq_layout, par):
        return UlyssesAttention(kernels, groups["sp"], seq_layout)

    def work_group(self, sp: int, ulysses_size: int) -> int:
        return sp

    def ring_ranks(self, par) -> int:
        return 1

    def calls(self, t: SequenceTraffic) -> list[Call]:
        n = len(t.layers)
        return ulysses_calls("sp", t.q, t.row * t.s_loc, t.reps * n, t.bwds * n)

    def saved_bytes(self, layout: Layout) -> int:
        """Its all-to-all'ed copies of q, k, v and of the output (the block's own q, k, v are
        not kept: :attr:`keeps_inputs`)."""
        m, par, tr = layout.model, layout.parallel, layout.train
        n = layout.micro_rows * (tr.seq_len // par.sp)
        q, kv = m.heads // par.tp * m.head_dim, m.kv_heads // par.tp * m.head_dim
        return (2 * q + 2 * kv) * n * Precision.of(tr, par).compute_bytes

    def key_blocks(self, seq: SeqLayout, window: int) -> int:
        return 0

    def describe(self, par) -> str:
        return f" {self.name}"

    def search_choices(self, base, sp: int, node_sp: int) -> list[tuple[str, int]]:
        return [("contiguous", 0)]


ULYSSES = UlyssesMode()
