"""Hybrid attention (``--sp-mode hybrid``, USP's and Megatron's hierarchical context
parallelism): Ulysses' all-to-all among the ``U = --ulysses-size`` consecutive sp ranks (one
node's, when they fit in one), then ring attention over the ``sp / U`` such groups, so only the
ring crosses nodes. A Ulysses group's chunks together are the chunks of one ring rank of the
same split over ``sp / U`` ranks (contiguous stays contiguous; zigzag stays zigzag, with
``U``-times larger chunks), so the ring keeps its causal skipping, zigzag balance and overlap.
:data:`HYBRID` is the mode."""
from __future__ import annotations

from mpipar.config import require
from mpipar.layout import Layout
from mpipar.model.attention import DocumentPositions, documents_of
from mpipar.parallel.calls import Call
from mpipar.parallel.sequence.mode import SequenceMode, SequenceTraffic
from mpipar.parallel.sequence.ring import RingAttention, RingMode, document_hops, ring_messages
from mpipar.parallel.sequence.ulysses import (HeadExchange, UlyssesSaved, check_heads,
                                              ulysses_calls)
from mpipar.parallel.sequence_split import SeqLayout
from mpipar.runtime.comm import Group


class HybridAttention:
    """Ulysses inside groups of ``ulysses.size`` consecutive sp ranks, ring attention across
    the ``ring.size`` groups (``ring``: the sp ranks at this rank's place in every group). Its
    backward works on its own copies, as Ulysses'."""

    needs_inputs = False
    passes_latent = False

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


class HybridMode(SequenceMode):
    """``--sp-mode hybrid``: a Ulysses group of ``--ulysses-size`` ranks shares its work; the
    ring runs over ``sp / U`` groups (the grid's ``sp_ulysses`` and ``sp_ring``)."""

    name = "hybrid"
    keeps_inputs = True
    balance_hint = ", or --sp-mode ulysses shares the work of the whole sequence"

    def check(self, layout: Layout) -> None:
        p = layout.parallel
        u = p.ulysses_size
        require(u >= 1 and p.sp % u == 0,
                f"parallel.ulysses_size={u}: --sp-mode hybrid needs a Ulysses group size that "
                f"divides parallel.sp={p.sp}")
        check_heads(layout, u, "ulysses_size", self.name)

    def split_grid(self, grid, par) -> None:
        grid.split_sp(par.ulysses_size)

    def core(self, kernels, groups, seq_layout, par):
        return HybridAttention(kernels, groups["sp_ulysses"], groups["sp_ring"], seq_layout,
                               par.sp_overlap)

    def work_group(self, sp: int, ulysses_size: int) -> int:
        return ulysses_size

    def ring_ranks(self, par) -> int:
        return par.sp // par.ulysses_size

    def ring_split(self, seq_len: int, sp: int, split: str, ulysses_size: int,
                   min_chunk: int) -> SeqLayout:
        return SeqLayout(seq_len, sp // ulysses_size, split)

    def calls(self, t: SequenceTraffic) -> list[Call]:
        par, n = t.layout.parallel, len(t.layers)
        stride = par.ulysses_size
        calls = (ulysses_calls("sp_ulysses", t.q, t.row * t.s_loc, t.reps * n, t.bwds * n)
                 if stride > 1 else [])
        seq = SeqLayout(t.layout.train.seq_len, par.sp // stride, par.sp_split)
        return calls + t.relay("sp_ring", stride, t.packs(seq), lambda s, w, d: ring_messages(
            document_hops(s, w, d), 2 * t.row * t.s_loc, 2 * t.grad_row * t.s_loc,
            par.sp_overlap))

    key_blocks = RingMode.key_blocks        # its ring's, over ring_split's sp / U ranks

    def document_blocks(self, split: SeqLayout, ring: SeqLayout, window: int,
                        docs: DocumentPositions) -> int:
        return document_hops(ring, window, docs).blocks   # the ring's split, not the run's

    def describe(self, par) -> str:
        return f" {self.name}/{par.sp_split}(U={par.ulysses_size})"

    def search_choices(self, base, sp: int, node_sp: int) -> list[tuple[str, int]]:
        return [("zigzag", node_sp)] if 1 < node_sp < sp and sp % node_sp == 0 else []


HYBRID = HybridMode()
