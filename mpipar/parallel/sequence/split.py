"""The ``--sp-split`` modes: how a sequence is cut over the sp ranks. A mode is a
:class:`SequenceSplit`; :class:`mpipar.parallel.sequence_split.SeqLayout`, the rules and the
planner ask it instead of comparing its name.

- ``contiguous``: rank i holds tokens ``[i*S/sp, (i+1)*S/sp)``.
- ``zigzag``: the sequence cut into ``2*sp`` chunks; rank i holds chunks i and ``2*sp-1-i``,
  which evens out the causal work over the ranks.
- ``balanced``: packed documents; each microbatch's chunks are dealt by their intra-document
  work; without documents known a rank holds what contiguous gives it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SequenceSplit:
    """One sp split. ``chunks``: the equal chunks each rank holds (zigzag: 2, one from each end
    of the sequence); ``deals_documents``: each microbatch's documents are dealt over the ranks
    by their work."""

    name: str
    chunks: int = 1
    deals_documents: bool = False

    @staticmethod
    def named(name: str) -> SequenceSplit:
        """The split called ``name``; ValueError naming the value and the choices otherwise."""
        if name not in SP_SPLITS:
            raise ValueError(f"sp_split={name!r}: must be one of {', '.join(SP_SPLITS)}")
        return SP_SPLITS[name]

    def __str__(self) -> str:
        return self.name

    def parts(self, sp: int) -> int:
        """Equal parts the sequence is cut into over ``sp`` ranks."""
        return sp * self.chunks

    @property
    def evens_causal_work(self) -> bool:
        """Every rank does the same causal attention work (one chunk from each end)."""
        return self.chunks == 2

    def parts_named(self, sp: int) -> str:
        """The divisor :meth:`parts` asks of the sequence length, in the words of a rule."""
        if self.chunks == 1:
            return f"parallel.sp={sp}"
        return f"{self.chunks}*sp = {self.parts(sp)} for the {self.name} split"

    def segments(self, seq_len: int, sp: int, rank: int) -> list[tuple[int, int]]:
        """(start, length) of each run of global positions ``rank`` holds when no documents
        decide the deal."""
        if self.chunks == 1:
            n = seq_len // sp
            return [(rank * n, n)]
        n = seq_len // (2 * sp)
        return [(rank * n, n), ((2 * sp - 1 - rank) * n, n)]


CONTIGUOUS = SequenceSplit("contiguous")
ZIGZAG = SequenceSplit("zigzag", chunks=2)
BALANCED = SequenceSplit("balanced", deals_documents=True)

SP_SPLITS: dict[str, SequenceSplit] = {s.name: s for s in (CONTIGUOUS, ZIGZAG, BALANCED)}
"""Every ``--sp-split``, by name."""


def split_of(par: Any) -> SequenceSplit:
    """The split object of a parallel configuration's ``sp_split``."""
    return SequenceSplit.named(par.sp_split)
