"""What sequence parallelism costs a rank: the MPI calls its mode predicts for a step, what its
attention core keeps for backward, and its terms of the time model (the keys a query attends
to on the busiest sp rank, the key blocks beyond its own a rank attends to)."""
from __future__ import annotations

import numpy as np

from mpipar.layout import Layout
from mpipar.model.attention import DocumentPositions
from mpipar.model.recompute import Recompute
from mpipar.parallel.axis import Footprint
from mpipar.parallel.calls import Call
from mpipar.parallel.sequence.common import microbatch_split
from mpipar.parallel.sequence.mode import SequenceMode, SequenceTraffic
from mpipar.parallel.sequence.registry import sequence_mode
from mpipar.parallel.sequence.split import split_of
from mpipar.parallel.sequence_split import SeqLayout, rank_work
from mpipar.runtime.precision import Precision
from mpipar.runtime.topology import Coord, GridShape


def sequence_calls(layout: Layout, coord: Coord, shape: GridShape, layers: list[int],
                   passes: int, backward: bool, documents: list | None = None) -> list[Call]:
    """SP attention of ``layers`` (global indices, each with its own sliding window) on the
    rank at ``coord`` of the grid ``shape``, in ``passes`` forwards of a microbatch through
    each, each with its backward (``backward``: a training step, whose ``recompute="full"``
    runs each forward twice) or without: the mode's calls (:meth:`mpipar.parallel.sequence.
    mode.SequenceMode.calls`). ``documents``: packed documents (``--document-masking``), the
    document ids ``[B, S]`` of each of the ``passes`` microbatches: the ring's hops are then
    each microbatch's (:func:`mpipar.parallel.sequence.ring.document_hops`)."""
    reps = layout.train.recompute_mode.forward_runs(backward) * passes
    bwds = passes if backward else 0
    traffic = SequenceTraffic(layout, coord, shape, tuple(layers), reps, bwds, documents)
    return sequence_mode(layout.parallel).calls(traffic)


def sequence_footprint(layout: Layout, mode: Recompute) -> Footprint:
    """The sequence axis's :class:`mpipar.parallel.axis.Footprint`, the same for a dense and a
    sparse block: q, k, v as the attention core reads them on this rank's heads (none apart
    where the SP mode's core keeps its own copies: Ulysses), and what the mode's core keeps
    beside the output and lse (Ulysses' all-to-all'ed copies, the halo's K/V rows; the mode's
    :meth:`~mpipar.parallel.sequence.mode.SequenceMode.saved_bytes`)."""
    m, par, tr = layout.model, layout.parallel, layout.train
    e = Precision.of(tr, par).compute_bytes
    n = layout.micro_rows * (tr.seq_len // par.sp)
    q, kv = m.heads // par.tp * m.head_dim, m.kv_heads // par.tp * m.head_dim
    sp_mode = sequence_mode(par)
    inputs = n * e if par.sp == 1 or sp_mode.keeps_inputs else 0
    fields = {"q": q * inputs, "k": kv * inputs, "v": kv * inputs,
              "attention_saved": sp_mode.saved_bytes(layout) if par.sp > 1 else 0}
    return Footprint(fields, fields)


def attention_context(layout: Layout, window: int = 0) -> float:
    """Mean keys a query attends to on the SP rank with the most causal work, in a layer with
    sliding ``window`` (0: full causal)."""
    tr, par = layout.train, layout.parallel
    # hybrid: the ring's ranks are the Ulysses groups, whose members share a group's work
    S, n = tr.seq_len, sequence_mode(par).ring_ranks(par)
    if window:
        return min(window, attention_context(layout))
    if n == 1 or split_of(par).evens_causal_work:
        return (S + 1) / 2
    return (S - S / n) + (S / n + 1) / 2               # the last rank: its chunk sees all before it


def extra_key_blocks(mode: SequenceMode, seq: SeqLayout, window: int) -> int:
    """Key blocks beyond its own that a rank attends to in a layer with ``window`` (the mode's
    :meth:`~mpipar.parallel.sequence.mode.SequenceMode.key_blocks`); 0 without SP."""
    return 0 if seq.sp == 1 else mode.key_blocks(seq, window)


def document_attention(micro: tuple[DocumentPositions, ...], seq_len: int, sp: int, split: str,
                       mode: SequenceMode, u: int, mbs: int, window: int, min_chunk: int
                       ) -> tuple[float, float]:
    """(mean keys a query attends to on the sp rank with the most work, key blocks beyond its
    own a rank attends to) over the microbatches ``micro`` of packed documents, in a layer with
    ``window``: the ranks' intra-document pairs (:func:`~mpipar.parallel.sequence_split.
    rank_work`; a Ulysses group shares its work) and the key blocks per microbatch (the mode's
    :meth:`~mpipar.parallel.sequence.mode.SequenceMode.document_blocks`)."""
    ulysses = mode.work_group(sp, u)
    ring = mode.ring_split(seq_len, sp, split, u, min_chunk)
    work, hops = 0.0, 0
    for d in micro:
        seq = microbatch_split(SeqLayout(seq_len, sp, split, min_chunk=min_chunk), d)
        work = work + rank_work(seq, d.docs, window, ulysses)
        if ring.sp > 1:
            hops += mode.document_blocks(seq, ring, window, d)
    return float(np.max(work)) / (len(micro) * mbs * seq_len / sp), hops / len(micro)
