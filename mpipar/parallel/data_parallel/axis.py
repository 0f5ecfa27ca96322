"""The data axis (:class:`mpipar.parallel.axis.Axis`): the reduction's rule and, below ZeRO-2,
its calls over dp x sp in a training step, its buffers and its codec's work."""
from __future__ import annotations

from mpipar.parallel.axis import AxisUnit, RankHooks, StepRank
from mpipar.parallel.calls import Call
from mpipar.parallel.data_parallel.build import data_grid, data_weights
from mpipar.parallel.data_parallel.cost import (data_held, data_seconds,
                                               reduction_calls)
from mpipar.parallel.data_parallel.rule import check_config


def _data_traffic(rank: StepRank) -> list[Call]:
    if rank.layout.parallel.zero >= 2 or not rank.train:
        return []
    return reduction_calls(rank.layout, rank.gradient_buckets, rank.group_sizes)


DATA = AxisUnit("data parallel", check_config, _data_traffic, holds=data_held,
                work=data_seconds, build=RankHooks(grid=data_grid, weights=data_weights))
"""Buckets, hierarchical nodes, compression; the gradients' reduction over dp x sp."""
