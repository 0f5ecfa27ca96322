"""What the sequence axis builds for a rank (:class:`mpipar.parallel.axis.RankHooks`): its
mode's sp sub-groups, the sequence split and the attention core of each chunk."""
from __future__ import annotations

from typing import Any

from mpipar.layout import Layout
from mpipar.model.attention import LocalAttention
from mpipar.parallel.axis import Parts
from mpipar.parallel.placement import PlacementTable
from mpipar.parallel.sequence.registry import sequence_mode
from mpipar.parallel.sequence_split import SeqLayout
from mpipar.runtime.topology import ProcessGrid


def sequence_grid(layout: Layout, grid: ProcessGrid, device: Any, parts: Parts) -> Parts:
    """The SP mode's sub-groups of ``sp`` (hybrid's ``sp_ulysses``, ``sp_ring``)."""
    par = layout.config.parallel
    sequence_mode(par).split_grid(grid, par)
    return {}


def sequence_seams(layout: Layout, comms: Any, compute: Any, table: PlacementTable,
                   parts: Parts) -> Parts:
    """``seq``: how a sequence is cut over sp; ``positions``: this sp rank's; ``attention``:
    a factory of a chunk's attention core (local, or this sp mode's over the sp group(s));
    ``ulysses``: the size of its Ulysses group (1 without one)."""
    par, tr = layout.config.parallel, layout.config.train
    seq = SeqLayout(tr.seq_len, par.sp, par.sp_split, min_chunk=par.sp_min_chunk)
    groups, kernels = comms.groups, compute.kernels

    def attention():
        if groups["sp"].size == 1:
            return LocalAttention(kernels)
        return sequence_mode(par).core(kernels, dict(groups), seq, par)

    return {"seq": seq, "positions": seq.positions(comms.grid.coord.sp), "attention": attention,
            "ulysses": sequence_mode(par).work_group(seq.sp, par.ulysses_size)}
