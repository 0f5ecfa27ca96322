"""What the data axis builds for a rank (:class:`mpipar.parallel.axis.RankHooks`): the node
split of dp x sp a hierarchical reduction runs over, and below ZeRO-2 the gradient reducer."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mpipar.layout import Layout
from mpipar.parallel.axis import Parts
from mpipar.parallel.data_parallel.buckets import ReduceGroups
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.parallel.data_parallel.reducer import GradReducer, warmup_steps
from mpipar.parallel.experts.split import ExpertSplitReducer
from mpipar.parallel.placement import expert_of
from mpipar.runtime.comm import Group
from mpipar.runtime.precision import numpy_dtype
from mpipar.runtime.topology import ProcessGrid


def data_grid(layout: Layout, grid: ProcessGrid, device: Any, parts: Parts) -> Parts:
    """``--dp-reduce hierarchical``: dp x sp split by node (``dp_sp_intra``, ``dp_sp_inter``)."""
    if reduction_of(layout.config.parallel).hierarchical:
        grid.split_dp_sp_by_node()
    return {}


def data_weights(layout: Layout, comms: Any, compute: Any, model: Any, names: list[str],
                 tied: list[str], initial: Callable[[list[str]], dict[str, np.ndarray]],
                 parts: Parts) -> Parts:
    """``reducer``: below ZeRO-2, the trained parameters ``names`` in the gradient reducer."""
    if layout.config.parallel.zero >= 2:
        return {}
    return {"reducer": gradient_reducer(layout, comms.groups, compute, names, tied, initial)}


def gradient_reducer(layout: Layout, g: Mapping[str, Group], compute: Any, names: list[str],
                     tied: list[str], initial: Callable[[list[str]], dict[str, np.ndarray]]
                     ) -> GradReducer | ExpertSplitReducer:
    """ZeRO-0/1: the gradient reducer over dp x sp: flat or hierarchical, dense or compressed;
    the ``tied`` embedding's copies then summed over ``pp_ends``. With the experts sharded over
    ep, this rank's experts have a flat reducer of their own over ``ep_dp`` beside it
    (:class:`ExpertSplitReducer`)."""
    par, xp, dtype = layout.config.parallel, compute.xp, compute.dtype
    reduce_dtype = numpy_dtype(compute.precision.reduce)
    experts = [n for n in names if expert_of(n) is not None]
    if "ep_dp" in g and experts:
        dense = gradient_reducer(layout, g, compute, [n for n in names if expert_of(n) is None],
                                 tied, initial)
        return ExpertSplitReducer(dense=dense, experts=GradReducer(
            initial(experts), list(reversed(experts)), ReduceGroups(g["ep_dp"], g["ep_dp"]),
            bucket_mb=par.bucket_mb, sharded=par.zero == 1, xp=xp, compute_dtype=dtype,
            reduce_dtype=reduce_dtype), ep=g["ep"])
    reduction = reduction_of(par)
    groups = (ReduceGroups(g["dp_sp"], g["dp_sp_inter"], g["dp_sp_intra"])
              if reduction.hierarchical else ReduceGroups(g["dp_sp"], g["dp_sp"]))
    return GradReducer(initial(names), list(reversed(names)), groups, bucket_mb=par.bucket_mb,
                       sharded=par.zero == 1, xp=xp,
                       codec=reduction.compression.codec(par.topk_ratio, xp),
                       feedback=reduction.feedback, tied=tied,
                       tied_group=g["pp_ends"], dense_steps=warmup_steps(layout),
                       compute_dtype=dtype, reduce_dtype=reduce_dtype)
