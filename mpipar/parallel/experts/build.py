"""What the expert axis builds for a rank (:class:`mpipar.parallel.axis.RankHooks`): the
``ep`` and ``ep_dp`` groups and the sparse blocks' exchange of each chunk."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpipar.layout import Layout
from mpipar.parallel.axis import Parts
from mpipar.parallel.experts.exchange import ExpertParallel, SequenceExperts
from mpipar.parallel.experts.split import expert_shards
from mpipar.parallel.placement import PlacementTable
from mpipar.runtime.comm import Group, Ledger


def expert_groups(layout: Layout, groups: Mapping[str, Group], ledger: Ledger, mpi_path,
                  parts: Parts) -> Parts:
    """A mixture of experts: the ``ep`` group, --ep N consecutive ranks of dp x sp, and where
    the experts are sharded over it the ``ep_dp`` group, the ranks of dp x sp at the same
    position of their ep group, which hold the same experts (mpipar.parallel.experts)."""
    cfg = layout.config
    ep, dp_sp = cfg.parallel.ep, groups["dp_sp"]
    added = {}
    if cfg.model.moe_experts:
        comm = dp_sp.comm.Split(dp_sp.rank // ep, dp_sp.rank)
        first = dp_sp.rank // ep * ep
        added["ep"] = Group(comm, "ep", ledger, dp_sp.nodes[first:first + ep], mpi_path)
    if expert_shards(layout) > 1:
        comm = dp_sp.comm.Split(dp_sp.rank % ep, dp_sp.rank)
        added["ep_dp"] = Group(comm, "ep_dp", ledger, dp_sp.nodes[dp_sp.rank % ep::ep],
                               mpi_path)
    return added


def expert_seams(layout: Layout, comms: Any, compute: Any, table: PlacementTable,
                 parts: Parts) -> Parts:
    """``experts``: a factory of a chunk's sparse-block exchange (sequences over sp, experts
    over ep), over the sequence axis's split ``parts["seq"]``."""
    m, groups, seq = layout.config.model, comms.groups, parts["seq"]

    def experts():
        ep = groups.get("ep")
        if ep is not None and ep.size > 1:
            return ExpertParallel(num_experts=m.moe_experts, sp=groups["sp"], ep=ep,
                                  xp=compute.xp, seq=seq,
                                  overlap=layout.config.parallel.ep_overlap)
        return SequenceExperts(num_experts=m.moe_experts, sp=groups["sp"], seq=seq)

    return {"experts": experts}
