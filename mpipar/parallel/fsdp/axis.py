"""The ZeRO-2/3 axis (:class:`mpipar.parallel.axis.Axis`): its rule and its units' gathers and
reduce-scatters over dp x sp (the experts' units over ``ep_dp`` are the expert axis's), and
the pool of their whole buffers."""
from __future__ import annotations

from mpipar.parallel.axis import AxisUnit, RankHooks, StepRank
from mpipar.parallel.calls import Call
from mpipar.parallel.fsdp.build import sharded_grid, sharded_weights
from mpipar.parallel.fsdp.cost import sharded_calls, sharded_held
from mpipar.parallel.fsdp.rule import check_config


def _sharded_traffic(rank: StepRank) -> list[Call]:
    """The trained units' calls, then (LoRA at ZeRO-3) the frozen base's gathers; a pass
    enters only the units a store holds."""
    if rank.layout.parallel.zero < 2:
        return []
    calls = []
    for lengths, kept, frozen in ((rank.unit_lengths, rank.kept_units, False),
                                  (rank.frozen_unit_lengths, rank.frozen_kept_units, True)):
        entered = [(u, k) for u, k in rank.entered if u in lengths]
        if entered:
            calls += sharded_calls(rank.layout, lengths=lengths, entered=entered, kept=kept,
                                   copy=None if frozen else rank.node_copy, tied=rank.tied,
                                   passes=rank.passes, backward=rank.train, frozen=frozen)
    return calls


FSDP = AxisUnit("fsdp", check_config, _sharded_traffic, holds=sharded_held,
                build=RankHooks(grid=sharded_grid, weights=sharded_weights))
"""ZeRO-2/3 groups, prefetch, node shared memory; the units sharded over dp x sp."""
