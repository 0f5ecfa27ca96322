"""One rank of a layout as the planner sees it: what it holds and runs, on the planner's nodes.

A rank at grid coordinate ``coord`` of a resolved :class:`mpipar.layout.Layout` holds the
parameter shards of its pipeline chunks (:func:`local_param_shapes`, from the placement table),
in flat gradient buckets (:func:`bucket_lengths`, as :class:`mpipar.parallel.data_parallel.reducer.GradReducer`
lays them out) or, at ZeRO-2/3, in units (:func:`unit_lengths`, as
:class:`mpipar.parallel.fsdp.sharded.ShardedParams` does), and runs its pipeline rank's op list of the
schedule (:func:`rank_ops`). The nodes are ``parallel.ranks_per_node`` consecutive ranks each
(:func:`nodes_of`); :func:`group_sizes` gives the ranks of each group of the grid on them. The
placement tables and schedules are cached: the layout search asks for the same ones many times.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator

from mpipar.config import ModelConfig
from mpipar.layout import Layout
from mpipar.model.lora import Lora
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.parallel.data_parallel.cost import compressed_over, compresses, reduction_buckets
from mpipar.parallel.experts.cost import expert_bucket_lengths
from mpipar.parallel.experts.split import expert_shards, expert_units
from mpipar.parallel.fsdp import cost as fsdp_cost, sharded as fsdp
from mpipar.parallel.pipeline.schedule import Op, build_schedule
from mpipar.parallel.placement import PlacementTable, expert_of
from mpipar.runtime.device import device_of
from mpipar.runtime.topology import Coord, GridShape, NodeMap


_MODEL_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(ModelConfig)))
"""A model configuration's field values, in order (all hashable scalars): the tables' key."""


@functools.lru_cache(maxsize=64)
def _table(model: tuple, pp: int, v: int, ep: int, lora: Lora | None) -> PlacementTable:
    """The placement table of the resolved model whose field values are ``model`` (cached)."""
    return PlacementTable(model=ModelConfig(*model), pp=pp, virtual_stages=v, ep=ep, lora=lora)


def placement_table(layout: Layout) -> PlacementTable:
    """The placement of every parameter of ``layout``'s model on its pipeline, the experts
    sharded over ep where they are (:func:`mpipar.parallel.experts.split.expert_shards`; a rank
    holds as many as ep position 0's), with LoRA's adapters beside their frozen weights
    (cached)."""
    return _table(_MODEL_FIELDS(layout.model), layout.pp, layout.virtual_stages,
                  expert_shards(layout), Lora.of(layout.train))


@functools.lru_cache(maxsize=1024)
def table_shapes(table: PlacementTable, pp_rank: int, tp: int, ep_rank: int = 0
                 ) -> dict[str, tuple[int, ...]]:
    """:meth:`PlacementTable.local_shapes` of a table of :func:`placement_table` (cached: only
    read)."""
    return table.local_shapes(pp_rank, tp, ep_rank)


@functools.lru_cache(maxsize=1024)
def table_units(table: PlacementTable, pp_rank: int, trained: bool = True
                ) -> list[list[tuple[str, list[str]]]]:
    """:meth:`PlacementTable.units` of a table of :func:`placement_table` (cached: only
    read)."""
    return table.units(pp_rank, trained)


@functools.lru_cache(maxsize=256)
def _schedule(name: str, p: int, m: int, v: int) -> list[list[Op]]:
    """:func:`build_schedule`, cached (the op lists are only read)."""
    return build_schedule(name, p, m, v)


def schedule_ops(layout: Layout) -> list[list[Op]]:
    """The op list of every pipeline rank of ``layout``'s schedule for one step (cached)."""
    return _schedule(layout.parallel.schedule, layout.pp, layout.microbatches,
                     layout.virtual_stages)


def rank_ops(layout: Layout, coord: Coord) -> list[Op]:
    """The schedule's op list of the rank at ``coord``."""
    return schedule_ops(layout)[coord.pp]


def rank_stages(layout: Layout, coord: Coord) -> list[int]:
    """The global virtual stages of the rank at ``coord``'s chunks, in chunk order."""
    return [chunk * layout.pp + coord.pp for chunk in range(layout.virtual_stages)]


def grid_shape(layout: Layout) -> GridShape:
    """The sizes of ``layout``'s process grid (dp, tp, pp, sp)."""
    return GridShape(layout.dp, layout.tp, layout.pp, layout.sp)


def local_param_shapes(layout: Layout, coord: Coord) -> dict[str, tuple[int, ...]]:
    """Shapes of the parameter shards held by the rank at ``coord``, in the order the engine
    lays them out (chunk by chunk, forward order)."""
    return table_shapes(placement_table(layout), coord.pp, layout.tp)


def nodes_of(layout: Layout) -> NodeMap:
    """The node map the planner assumes: ``ranks_per_node`` consecutive ranks a node (0: the
    whole world on one node, as when MPI finds one machine)."""
    return _node_map(layout.world, layout.parallel.ranks_per_node)


@functools.lru_cache(maxsize=256)
def _node_map(world: int, ranks_per_node: int) -> NodeMap:
    return NodeMap.blocks(world, ranks_per_node)


def group_sizes(layout: Layout) -> dict[str, int]:
    """Ranks in each group of the grid (the node split of dp x sp on :func:`nodes_of`;
    ``pp_ends`` as on the first and last pipeline ranks, the only ones that call it)."""
    par, dp = layout.parallel, layout.dp
    intra = len(grid_shape(layout).node_split(0, nodes_of(layout))[0])
    u = par.ulysses_size or 1
    return {"tp": par.tp, "pp": par.pp, "dp": dp, "sp": par.sp, "dp_sp": dp * par.sp,
            "tp_pp": par.tp * par.pp, "pp_ends": min(par.pp, 2), "dp_sp_intra": intra,
            "dp_sp_inter": dp * par.sp // intra, "sp_ulysses": u, "sp_ring": par.sp // u,
            "ep": par.ep, "ep_dp": dp * par.sp // expert_shards(layout),
            "copy": layout.world}   # --state-copies: a rank and its holder over the world


def group_members(layout: Layout, name: str, rank: int) -> list[int]:
    """Grid ranks of ``rank``'s instance of group ``name``, in group-rank order: the grid's
    groups (:meth:`mpipar.runtime.topology.GridShape.members`), and ``ep``, the ``ep``
    consecutive ranks of dp x sp the engine splits off, and ``ep_dp``, the ranks of dp x sp at
    the same place of their ep group (:mod:`mpipar.parallel.experts`)."""
    par = layout.parallel
    return list(_members(grid_shape(layout), par.ranks_per_node, par.ulysses_size or 1, par.ep,
                         name, rank))


@functools.lru_cache(maxsize=65536)
def _members(shape: GridShape, ranks_per_node: int, ulysses: int, ep: int, name: str,
             rank: int) -> tuple[int, ...]:
    """:func:`group_members` of a grid (cached: the layout search asks for the same ones many
    times)."""
    nodes = _node_map(shape.dp * shape.tp * shape.pp * shape.sp, ranks_per_node)
    if name == "copy":   # --state-copies: the world the copies' exchange runs on
        return tuple(range(len(nodes.nodes)))
    if name in ("ep", "ep_dp"):
        dp_sp = shape.members("dp_sp", rank, nodes)
        at = dp_sp.index(rank)
        return tuple(dp_sp[at // ep * ep:at // ep * ep + ep] if name == "ep"
                     else dp_sp[at % ep::ep])
    return tuple(shape.members(name, rank, nodes, ulysses))


def compressed_size(layout: Layout) -> int:
    """Ranks of the group the gradient reduction compresses over (and the residual slots):
    across nodes when hierarchical, else dp x sp; 1 when nothing is compressed
    (:func:`mpipar.parallel.data_parallel.cost.compressed_over`)."""
    return compressed_over(layout, group_sizes(layout)) if compresses(layout) else 1


def gradient_buckets(layout: Layout, coord: Coord) -> list[tuple[int, bool]]:
    """(elements, whether it holds a tied embedding summed over pp_ends) of each flat gradient
    bucket of the rank at ``coord`` (:func:`mpipar.parallel.data_parallel.cost.reduction_buckets`)."""
    table = placement_table(layout)
    order = [(n, s) for n, s in reversed(list(local_param_shapes(layout, coord).items()))
             if (table.ep == 1 or expert_of(n) is None)     # sharded experts: their own buckets
             and table[n].trainable]                        # LoRA's frozen base: none
    tied = {i for i, (n, _) in enumerate(order) if table[n].tied_across_pipeline}
    align = (reduction_of(layout.parallel).compression.block if compressed_size(layout) > 1
             else 1)
    return reduction_buckets(layout, [math.prod(s) for _, s in order], tied, align)


def expert_buckets(layout: Layout, coord: Coord) -> list[int]:
    """Elements of each flat bucket of the experts' gradients of the rank at ``coord``, where
    they are sharded over ep (reduced over ``ep_dp``:
    :func:`mpipar.parallel.experts.cost.expert_bucket_lengths`); else none."""
    table = placement_table(layout)
    layers = [i for s in rank_stages(layout, coord) for i in table.stage_layers(s)]
    return expert_bucket_lengths(layout, layers)


def bucket_lengths(layout: Layout, coord: Coord) -> list[int]:
    """Elements of each flat gradient bucket of the rank at ``coord`` (padded to a multiple of
    dp*sp, of whole int8 scale blocks when int8 compression runs)."""
    return [length for length, _ in gradient_buckets(layout, coord)]


def rank_units(layout: Layout, coord: Coord) -> tuple[fsdp.Units, fsdp.Units]:
    """ZeRO-2/3: (the dense units, the experts' units) of the rank at ``coord`` per chunk, as
    the engine splits them (:func:`mpipar.parallel.experts.split.expert_units`; the experts' units
    only where they are sharded over ep, of ep position 0: every position holds as many)."""
    return _rank_units(placement_table(layout), coord.pp)


@functools.lru_cache(maxsize=1024)
def _rank_units(table: PlacementTable, pp_rank: int) -> tuple[fsdp.Units, fsdp.Units]:
    return expert_units(table_units(table, pp_rank), table, 0)


def _lengths(layout: Layout, coord: Coord, experts: bool) -> dict[str, int]:
    elements = {n: math.prod(s) for n, s in local_param_shapes(layout, coord).items()}
    shards = layout.dp * layout.parallel.sp // expert_shards(layout) if experts else 0
    return fsdp_cost.unit_lengths(layout, rank_units(layout, coord)[experts], elements, shards)


def unit_lengths(layout: Layout, coord: Coord) -> dict[str, int]:
    """ZeRO-2/3: elements of each dense unit of the rank at ``coord`` (padded to a multiple of
    dp*sp), each once (:func:`mpipar.parallel.fsdp.cost.unit_lengths`)."""
    return _lengths(layout, coord, False)


def expert_unit_lengths(layout: Layout, coord: Coord) -> dict[str, int]:
    """ZeRO-2/3 with the experts sharded over ep: elements of each experts' unit of the rank at
    ``coord`` (padded to a multiple of ``ep_dp``); else none."""
    return _lengths(layout, coord, True)


def frozen_unit_lengths(layout: Layout, coord: Coord) -> dict[str, int]:
    """ZeRO-3 under LoRA: elements of each unit of the frozen base of the rank at ``coord``
    (sharded over dp x sp apart from the adapters, :meth:`PlacementTable.units`); else none
    (below ZeRO-3 a rank holds its base whole)."""
    table = placement_table(layout)
    if layout.parallel.zero < 3 or table.lora is None:
        return {}
    elements = {n: math.prod(s) for n, s in local_param_shapes(layout, coord).items()}
    return fsdp_cost.unit_lengths(layout, table_units(table, coord.pp, False), elements)


def frozen_kept_units(layout: Layout, coord: Coord) -> set[str]:
    """ZeRO-3 under LoRA: the frozen base's units gathered from their forward to their
    backward (:func:`mpipar.parallel.fsdp.sharded.kept_after_forward`)."""
    units = table_units(placement_table(layout), coord.pp, False)
    return fsdp.kept_after_forward([[u for u, _ in chunk] for chunk in units],
                                   layout.parallel.zero_prefetch)


def kept_units(layout: Layout, coord: Coord, experts: bool = False) -> set[str]:
    """ZeRO-3: the dense (or ``experts``') units of the rank at ``coord`` gathered from their
    forward to their backward (:func:`mpipar.parallel.fsdp.sharded.kept_after_forward`)."""
    return fsdp.kept_after_forward([[u for u, _ in units]
                                    for units in rank_units(layout, coord)[experts]],
                                   layout.parallel.zero_prefetch)


def node_copy(layout: Layout, coord: Coord) -> tuple[int, int] | None:
    """ZeRO-3 in node shared memory (:func:`mpipar.parallel.fsdp.sharded.node_shared`), on the nodes
    the planner assumes, as the engine decides: (ranks of this rank's dp x sp group on its
    node, nodes the group spans), or None where the units are gathered (not asked for, CUDA,
    or a group across nodes that hold unequal numbers of its ranks, or one rank each)."""
    shape = grid_shape(layout)
    return fsdp.node_copy_layout(layout.parallel, device_of(layout.train).gpu, shape,
                                 nodes_of(layout), shape.rank_of(coord))


def owned_slice(layout: Layout, coord: Coord) -> int:
    """ZeRO-1: which of the dp x sp equal slices of each flat bucket the rank at ``coord``
    owns: its rank in dp x sp, or under the hierarchical reduction its node's place times the
    nodes plus its rank across them
    (:meth:`mpipar.parallel.data_parallel.reducer.GradReducer.owned_range`)."""
    me = grid_shape(layout).rank_of(coord)
    intra = group_members(layout, "dp_sp_intra", me)
    if reduction_of(layout.parallel).hierarchical and len(intra) > 1:
        inter = group_members(layout, "dp_sp_inter", me)
        return intra.index(me) * len(inter) + inter.index(me)
    return group_members(layout, "dp_sp", me).index(me)
