"""What every sequence-parallel mode shares: the local slices of a rank's runs, which blocks
its queries see, a predicted message, a microbatch's documents as the traffic reads them."""
from __future__ import annotations

from typing import Any

import numpy as np

from mpipar.model.attention import DocumentPositions, runs_visible, shared_runs
from mpipar.parallel.sequence_split import SeqLayout

Array = Any


def local_slices(segments: list[tuple[int, int]]) -> list[slice]:
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


Message = tuple[str, int, int, int]
"""``(operation, bytes, count, offset)``: ``count`` calls of the ledger operation ``op``, each
handing MPI ``bytes``, to the SP rank ``offset`` places on (0: a receive, which names none)."""


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
