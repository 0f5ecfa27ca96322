"""The tensor axis (:class:`mpipar.parallel.axis.Axis`): the split's rule, the tp group's
calls, and what a block and the head keep on a tp rank."""
from __future__ import annotations

from mpipar.parallel.axis import AxisUnit, RankHooks, StepRank
from mpipar.parallel.calls import Call
from mpipar.parallel.tensor.build import tensor_seams
from mpipar.parallel.tensor.cost import tensor_calls, tensor_footprint
from mpipar.parallel.tensor.rule import check_config


def _tensor_traffic(rank: StepRank) -> list[Call]:
    if rank.layout.parallel.tp == 1:
        return []
    return tensor_calls(rank.layout, rank.stages, rank.passes, rank.train, rank.entered)


TENSOR = AxisUnit("tensor", check_config, _tensor_traffic, footprint=tensor_footprint,
                  build=RankHooks(seams=tensor_seams))
"""The tensor axis: heads, FFN and tokens split over tp; its collectives."""
