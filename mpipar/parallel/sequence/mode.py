"""The sequence-parallel mode: one object per ``--sp-mode``, asked instead of its name.

A :class:`SequenceMode` says everything that differs by mode: its rule, the attention core it
builds for a rank, the MPI calls it predicts (:class:`SequenceTraffic` holds what every mode's
prediction reads), what its core keeps for backward, the key blocks beyond its own a rank
attends to (the planner's time), how many ranks share one sequence's attention work, and how
the planner describes and varies it. The defaults are those of a mode whose ranks each attend
with their own queries over the whole sp group (ring, halo); each mode's module overrides what
differs. :data:`mpipar.parallel.sequence.registry.SP_MODES` lists them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpipar.config import require
from mpipar.layout import Layout
from mpipar.model.attention import DocumentPositions
from mpipar.model.latent_attention import ring_passes_latent
from mpipar.model.lora import Lora
from mpipar.parallel.calls import Call
from mpipar.parallel.sequence.common import Message, as_documents, microbatch_split
from mpipar.parallel.sequence_split import SeqLayout
from mpipar.runtime.precision import Precision
from mpipar.runtime.topology import Coord, GridShape

Messages = Callable[[SeqLayout, int, "DocumentPositions | None"],
                    tuple[list[Message], list[Message]]]


@dataclass(frozen=True)
class SequenceTraffic:
    """The SP attention of ``layers`` (global indices, each with its own sliding window) on the
    rank at ``coord`` of the grid ``shape``: ``reps`` forwards of a microbatch through each
    (a training step's ``recompute="full"`` runs each twice), ``bwds`` backwards; ``documents``:
    with ``--document-masking`` the document ids ``[B, S]`` of each microbatch. K/V (and
    Ulysses' gradients, rounded) travel in the compute dtype; the ring's and halos' dK/dV in
    the accumulator's (the masters' dtype: float32 under bf16)."""

    layout: Layout
    coord: Coord
    shape: GridShape
    layers: tuple[int, ...]
    reps: int
    bwds: int
    documents: list | None = None

    @property
    def s_loc(self) -> int:
        """Positions a rank holds."""
        return self.layout.train.seq_len // self.layout.parallel.sp

    def _elements(self) -> int:
        m, par = self.layout.model, self.layout.parallel
        return self.layout.micro_rows * (m.kv_heads // par.tp) * m.head_dim

    @property
    def row(self) -> int:
        """Bytes of one position's K (= V) in the compute dtype."""
        return self._elements() * Precision.of(self.layout.train, self.layout.parallel).compute_bytes

    @property
    def grad_row(self) -> int:
        """Bytes of one position's dK (= dV) in the accumulator's dtype."""
        return self._elements() * Precision.of(self.layout.train, self.layout.parallel).master_bytes

    def _ring_elements(self) -> int:
        """Values of one position of a ring's block message: its K and V, or under latent
        attention when fewer (:func:`~mpipar.model.latent_attention.ring_passes_latent`) its
        latent and RoPE key."""
        m, par = self.layout.model, self.layout.parallel
        if ring_passes_latent(m, m.heads // par.tp, Lora.of(self.layout.train)):
            return self.layout.micro_rows * (m.latent_kv_rank + m.rope_head_dim)
        return 2 * self._elements()

    @property
    def ring_row(self) -> int:
        """Bytes of one position of a ring's block message in the compute dtype."""
        return self._ring_elements() * Precision.of(self.layout.train,
                                                    self.layout.parallel).compute_bytes

    @property
    def ring_grad_row(self) -> int:
        """Bytes of one position of a ring's block gradient in the accumulator's dtype."""
        return self._ring_elements() * Precision.of(self.layout.train,
                                                    self.layout.parallel).master_bytes

    @property
    def q(self) -> int:
        """Bytes of this rank's q ``[B, S/sp, hq/tp, D]``."""
        m, par = self.layout.model, self.layout.parallel
        return (self.layout.micro_rows * self.s_loc * (m.heads // par.tp) * m.head_dim
                * Precision.of(self.layout.train, par).compute_bytes)

    def split(self) -> SeqLayout:
        """The run's split of the sequence over sp."""
        tr, par = self.layout.train, self.layout.parallel
        return SeqLayout(tr.seq_len, par.sp, par.sp_split, min_chunk=par.sp_min_chunk)

    def packs(self, seq: SeqLayout) -> list[tuple[DocumentPositions | None, SeqLayout]]:
        """(documents, split) of each microbatch, or one pair shared by all without documents."""
        if self.documents is None:
            return [(None, seq)]
        return [(d, microbatch_split(seq, d)) for d in map(as_documents, self.documents)]

    def relay(self, group: str, stride: int, packs: list, messages: Messages) -> list[Call]:
        """The point-to-point calls on ``group`` of ``messages(split, window, documents)`` per
        layer and pack (the passes share one prediction, or one each); a message's offset
        counts ring ranks, ``stride`` sp ranks apart."""
        m, sp, calls, per = self.layout.model, self.layout.parallel.sp, [], len(packs)
        for layer in self.layers:
            window = m.layer_window(layer)
            for docs, seq in packs:
                fwd, bwd = messages(seq, window, docs)
                for (op, nbytes, count, off), times in ([(x, self.reps // per) for x in fwd]
                                                        + [(x, self.bwds // per) for x in bwd]):
                    peer = (self.shape.rank_of(self.coord._replace(
                        sp=(self.coord.sp + off * stride) % sp)) if off else None)
                    calls.append(Call(group, op, nbytes, count * times, peer))
        return calls


class SequenceMode(ABC):
    """One ``--sp-mode``: its name (what configuration files and metrics say) and everything that
    differs by mode. Subclasses override :meth:`core`, :meth:`calls` and :meth:`key_blocks`."""

    name: str = ""
    balanced_split: bool = False   # may deal documents (--sp-split balanced)
    sends_window: bool = False     # its bytes grow with the sliding window, not the sequence
    keeps_inputs: bool = True      # the block keeps q, k, v as the core reads them
    balance_hint: str = ""         # the summary's advice beside "--sp-split balanced"

    def __repr__(self) -> str:
        return f"<sp mode {self.name}>"

    def check(self, layout: Layout) -> None:
        """The mode's own rule (beyond the split's, :mod:`mpipar.parallel.sequence.rule`)."""
        u = layout.parallel.ulysses_size
        require(u == 0, f"parallel.ulysses_size={u}: needs --sp-mode hybrid")

    def split_grid(self, grid: Any, par: Any) -> None:
        """The sp groups beyond ``sp`` this mode needs of the process grid (none)."""

    @abstractmethod
    def core(self, kernels: Any, groups: dict, seq_layout: SeqLayout, par: Any) -> Any:
        """The attention core (:class:`mpipar.model.attention.AttentionCore`) of a rank with
        ``groups`` (the grid's, by name) and the run's split ``seq_layout``."""

    def work_group(self, sp: int, ulysses_size: int) -> int:
        """How many sp ranks share one group's attention work (an all-to-all's group)."""
        return 1

    def ring_ranks(self, par: Any) -> int:
        """The ranks a sequence's K/V blocks lie on (1: every rank attends the whole sequence)."""
        return par.sp

    def ring_split(self, seq_len: int, sp: int, split: str, ulysses_size: int,
                   min_chunk: int) -> SeqLayout:
        """The split whose blocks the key blocks of :meth:`key_blocks` are."""
        return SeqLayout(seq_len, sp, split, min_chunk=min_chunk)

    @abstractmethod
    def calls(self, t: SequenceTraffic) -> list[Call]:
        """The MPI calls of :class:`SequenceTraffic` ``t``."""

    def saved_bytes(self, layout: Layout) -> int:
        """Bytes one block's core keeps for backward beyond its output and lse, one microbatch
        on one rank (the most of any sp rank and layer)."""
        return 0

    @abstractmethod
    def key_blocks(self, seq: SeqLayout, window: int) -> int:
        """Key blocks beyond its own a rank attends to in a layer with ``window`` (``seq``:
        :meth:`ring_split`, of more than one rank)."""

    def document_blocks(self, split: SeqLayout, ring: SeqLayout, window: int,
                        docs: DocumentPositions) -> int:
        """:meth:`key_blocks` for one microbatch of packed documents ``docs`` (``split``: its
        split, ``ring``: :meth:`ring_split`)."""
        return self.key_blocks(ring, window)

    def describe(self, par: Any) -> str:
        """How the planner's table names the mode."""
        return f" {self.name}/{par.sp_split}"

    def search_choices(self, base: Any, sp: int, node_sp: int) -> list[tuple[str, int]]:
        """(split, Ulysses size) the layout search tries with ``sp`` ranks (``node_sp``: sp
        ranks a node holds, 0 unknown)."""
        return []
