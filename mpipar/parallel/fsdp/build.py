"""What the ZeRO-2/3 axis builds for a rank (:class:`mpipar.parallel.axis.RankHooks`): where
ZeRO-3's units sit in node shared memory, and the trained parameters as sharded units."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpipar.layout import Layout
from mpipar.parallel.axis import Parts
from mpipar.parallel.experts.split import ExpertSplitUnits, expert_units
from mpipar.parallel.fsdp.sharded import ShardedParams, node_copy_layout
from mpipar.runtime.precision import numpy_dtype
from mpipar.runtime.topology import ProcessGrid


def sharded_grid(layout: Layout, grid: ProcessGrid, device: Any, parts: Parts) -> Parts:
    """``node_copy``: ZeRO-3's copies on each node (:func:`node_copy_layout`, or None); with
    a group spanning nodes, dp x sp split by node (``dp_sp_intra``, ``dp_sp_inter``)."""
    node_copy = node_copy_layout(layout.config.parallel, device.gpu, grid.shape, grid.nodes,
                                 grid.rank)
    if node_copy and node_copy[1] > 1:
        grid.split_dp_sp_by_node()
    return {"node_copy": node_copy}


def sharded_weights(layout: Layout, comms: Any, compute: Any, model: Any, names: list[str],
                    tied: list[str], initial: Callable[[list[str]], dict[str, np.ndarray]],
                    parts: Parts) -> Parts:
    """``sharded``: from ZeRO-2, the trained parameters as units (:func:`sharded_units`)."""
    if layout.config.parallel.zero < 2:
        return {}
    return {"sharded": sharded_units(layout, comms, compute, model, tied, initial)}


def sharded_units(layout: Layout, comms: Any, compute: Any, model: Any, tied: list[str],
                  initial: Callable[[list[str]], dict[str, np.ndarray]]
                  ) -> ShardedParams | ExpertSplitUnits:
    """ZeRO-2/3: the parameters as units sharded over dp x sp (:mod:`mpipar.parallel.fsdp`);
    tp-partial gradients are summed over tp before each unit's reduce-scatter, the ``tied``
    embedding's over the pipeline's ends after it. With the experts sharded over ep, this
    rank's experts are units of their own over ``ep_dp`` beside them
    (:class:`ExpertSplitUnits`)."""
    par, g, table, tensor = layout.config.parallel, comms.groups, model.table, model.tensor
    built: list = []              # the units, once built: their gradients are summed over tp

    def before_reduce(unit_names: list[str]) -> None:
        grads = built[0].grads
        tensor.reduce_partial_grads([grads[n] for n in unit_names
                                     if table[n].grad_partial_over_tp])

    group, node_groups = g["dp_sp"], None
    if comms.node_copy is not None:
        node_groups = ((group, None) if comms.node_copy[1] == 1 else
                       (g["dp_sp_intra"], g["dp_sp_inter"]))
        if not node_groups[0].on_one_node():   # as MPI sees them
            node_groups = None
    dense, experts = expert_units(table.units(comms.grid.coord.pp), table, comms.ep_rank)
    common = dict(gather=par.zero == 3, prefetch=par.zero_prefetch, xp=compute.xp,
                  before_reduce=before_reduce, compute_dtype=compute.dtype,
                  reduce_dtype=numpy_dtype(compute.precision.reduce))
    store = ShardedParams(lambda n: initial([n])[n], dense, group, tied=tied,
                          tied_group=g["pp_ends"], node_groups=node_groups, **common)
    if any(experts):
        store = ExpertSplitUnits(dense=store, experts=ShardedParams(
            lambda n: initial([n])[n], experts, g["ep_dp"], pool=store.pool, **common),
            ep=g["ep"])
    built.append(store)
    return store
