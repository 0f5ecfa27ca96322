"""What sequence parallelism costs a rank: the MPI calls its mode predicts for a step."""
from __future__ import annotations

from mpipar.layout import Layout
from mpipar.parallel.calls import Call
from mpipar.parallel.sequence.mode import SequenceTraffic
from mpipar.parallel.sequence.registry import sequence_mode
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
