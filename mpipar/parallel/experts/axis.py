"""The expert axis (:class:`mpipar.parallel.axis.Axis`): the mixture of experts' rules and its
calls over sp, ep and ``ep_dp``, the expert record a sparse block keeps and the experts'
buffers."""
from __future__ import annotations

from mpipar.parallel.axis import AxisUnit, RankHooks, StepRank
from mpipar.parallel.calls import Call
from mpipar.parallel.experts.build import expert_groups, expert_seams
from mpipar.parallel.experts.cost import (expert_calls, expert_footprint, expert_held,
                                          expert_unit_calls)
from mpipar.parallel.experts.rule import check_config


def _expert_traffic(rank: StepRank) -> list[Call]:
    layout, calls = rank.layout, []
    if layout.parallel.zero >= 2:
        calls += expert_unit_calls(layout, lengths=rank.expert_unit_lengths,
                                   entered=rank.entered, kept=rank.expert_kept_units,
                                   passes=rank.passes, backward=rank.train)
    if layout.config.model.moe_experts:
        calls += expert_calls(layout, [i for c in rank.chunk_layers for i in c], rank.passes,
                              rank.train)
    return calls


EXPERTS = AxisUnit("experts", check_config, _expert_traffic, footprint=expert_footprint,
                   holds=expert_held,
                   build=RankHooks(groups=expert_groups, seams=expert_seams))
"""The expert axis: the sparse blocks' exchange over sp and ep, the experts sharded over ep."""
