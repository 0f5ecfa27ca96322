"""The sequence axis (:class:`mpipar.parallel.axis.Axis`): the split's and the SP mode's rule,
the mode's calls, and what its attention core keeps."""
from __future__ import annotations

from mpipar.parallel.axis import AxisUnit, RankHooks, StepRank
from mpipar.parallel.calls import Call
from mpipar.parallel.sequence.build import sequence_grid, sequence_seams
from mpipar.parallel.sequence.cost import sequence_calls, sequence_footprint
from mpipar.parallel.sequence.rule import check_config


def _sequence_traffic(rank: StepRank) -> list[Call]:
    if rank.layout.parallel.sp == 1:
        return []
    layers = [i for chunk in rank.chunk_layers for i in chunk]
    return sequence_calls(rank.layout, rank.coord, rank.shape, layers, rank.passes, rank.train,
                          rank.documents)


SEQUENCE = AxisUnit("sequence", check_config, _sequence_traffic,
                    footprint=sequence_footprint,
                    build=RankHooks(grid=sequence_grid, seams=sequence_seams))
"""The sequence split over sp and the SP mode's attention across it."""
