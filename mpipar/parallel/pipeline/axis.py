"""The pipeline axis (:class:`mpipar.parallel.axis.Axis`): the schedule's rule and its sends."""
from __future__ import annotations

from mpipar.parallel.axis import AxisUnit, RankHooks, StepRank
from mpipar.parallel.calls import Call
from mpipar.parallel.pipeline.build import pipeline_executors
from mpipar.parallel.pipeline.cost import pipeline_calls
from mpipar.parallel.pipeline.rule import check_config


def _pipeline_traffic(rank: StepRank) -> list[Call]:
    if rank.layout.parallel.pp == 1:
        return []
    return pipeline_calls(rank.layout, rank.coord, rank.shape, rank.stages, rank.passes,
                          rank.train)


PIPELINE = AxisUnit("pipeline", check_config, _pipeline_traffic,
                    build=RankHooks(executors=pipeline_executors))
"""Layers per stage, virtual stages, the schedule; activations and gradients between stages."""
