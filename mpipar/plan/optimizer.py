"""What the optimizer costs a rank: its state's bytes and, under Muon, its exchanges.

AdamW keeps two moments of every trained element a rank updates (its tp shards; at ZeRO-1/2/3
its owned slices of the flat buckets or units, padding included). Muon
(:mod:`mpipar.training.optimizers`) keeps one momentum buffer for each of its matrices and
AdamW's two moments for the rest: at ZeRO-0 a buffer of the matrix's local shard, at
ZeRO-1/2/3 the first moment of the owned slice (the second moment is kept for the rest's
elements only). Each matrix is assembled whole on one owner (:func:`mpipar.training.
optimizers.assign_owners`): the owned slices over the shard group, then the tp shards over tp,
each way one all-to-all-v there and one back, booked as the bytes sent to the other ranks; the
owner holds its matrices whole and their orthogonalised copies while it runs Newton-Schulz,
whose FLOPs (:func:`newton_schulz_flops`) the step time model counts.

A rank's stores (:class:`Store`) are what it lays its trained parameters out in: ZeRO-0/1 the
reducer's flat buckets, ZeRO-2/3 the units, as the engine builds them
(:func:`mpipar.parallel.data_parallel.reducer.plan_buckets`,
:meth:`mpipar.parallel.placement.PlacementTable.units`); the experts sharded over ep have
stores of their own over ``ep_dp``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpipar.layout import Layout
from mpipar.parallel.calls import Call
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.parallel.data_parallel.buckets import padded_size, plan_buckets
from mpipar.parallel.experts.split import expert_shards, expert_units
from mpipar.parallel.placement import expert_of
from mpipar.plan.rank import (compressed_size, grid_shape, group_members, owned_slice,
                              placement_table, table_shapes, table_units)
from mpipar.runtime.precision import Precision
from mpipar.runtime.topology import Coord
from mpipar.training import muon
from mpipar.training.optimizers import assign_owners, muon_config, optimizer_mode


@dataclass(frozen=True)
class Store:
    """One flat buffer (a bucket or a unit) of ``length`` elements (padded) holding the
    parameters ``offsets`` (name -> ``[start, stop)``), sharded over ``shards`` ranks."""

    length: int
    offsets: dict[str, tuple[int, int]]
    shards: int

    def owned(self, slot: int) -> dict[str, int]:
        """Elements of each parameter inside the slice of shard ``slot``."""
        k = self.length // self.shards
        lo, hi = slot * k, (slot + 1) * k
        return {n: min(e, hi) - max(s, lo) for n, (s, e) in self.offsets.items()
                if min(e, hi) > max(s, lo)}


@dataclass(frozen=True)
class Part:
    """The trained parameters of one reducer of a rank: their local elements, the stores
    they lie in (none at ZeRO-0), the group they are sharded over and this rank's slot of it."""

    elements: dict[str, int]
    stores: list[Store]
    group: str
    slot: int
    shards: int


def _store(names: list[str], elements: dict[str, int], shards: int, align: int = 1) -> Store:
    offsets, at = {}, 0
    for n in names:
        offsets[n] = (at, at + elements[n])
        at += elements[n]
    return Store(padded_size(at, shards, align), offsets, shards)


def _index(layout: Layout, coord: Coord, group: str) -> int:
    me = grid_shape(layout).rank_of(coord)
    return group_members(layout, group, me).index(me)


def parts(layout: Layout, coord: Coord) -> list[Part]:
    """The rank's reducers: the dense one over dp x sp and, with the experts sharded over ep,
    theirs over ``ep_dp`` (:mod:`mpipar.training.rank`)."""
    par, table = layout.parallel, placement_table(layout)
    ep_rank = _index(layout, coord, "ep") if layout.model.moe_experts else 0
    shapes = table_shapes(table, coord.pp, layout.tp, ep_rank)
    elements = {n: math.prod(s) for n, s in shapes.items() if table[n].trainable}
    split = expert_shards(layout) > 1
    groups = [("dp_sp", lambda n: not split or expert_of(n) is None)]
    if split:
        groups.append(("ep_dp", lambda n: expert_of(n) is not None))
    out = []
    for group, mine in groups:
        own = {n: k for n, k in elements.items() if mine(n)}
        shards = layout.dp * par.sp // (expert_shards(layout) if group == "ep_dp" else 1)
        stores = _stores(layout, coord, own, shards, group, ep_rank) if par.zero else []
        out.append(Part(own, stores, group, _slot(layout, coord, group), shards))
    return out


def _slot(layout: Layout, coord: Coord, group: str) -> int:
    """The slice of each flat store this rank owns: its rank in the shard group, or the dense
    buckets' slice under ZeRO-1 (:func:`mpipar.plan.rank.owned_slice`)."""
    if group == "dp_sp" and layout.parallel.zero == 1:
        return owned_slice(layout, coord)
    return _index(layout, coord, group)


def _stores(layout: Layout, coord: Coord, elements: dict[str, int], shards: int, group: str,
            ep_rank: int) -> list[Store]:
    """ZeRO-1: the buckets (backward order, ``bucket_mb`` each, the tied embedding alone);
    ZeRO-2/3: the units, each once."""
    par, table = layout.parallel, placement_table(layout)
    if par.zero == 1:
        order = [n for n in reversed(list(elements))]
        tied = {i for i, n in enumerate(order) if table[n].tied_across_pipeline}
        e = Precision.of(layout.train, par).master_bytes
        align = (reduction_of(par).compression.block
                 if group == "dp_sp" and compressed_size(layout) > 1 else 1)
        limit = max(1, int(par.bucket_mb * 2**20))
        return [_store([order[i] for i in idx], elements, shards, align)
                for idx in plan_buckets([elements[n] * e for n in order], limit, tied)]
    dense, experts = expert_units(table_units(table, coord.pp), table, ep_rank)
    seen: dict[str, Store] = {}
    for units in (experts if group == "ep_dp" else dense):
        for unit, names in units:
            kept = [n for n in names if n in elements]
            if kept and unit not in seen:
                seen[unit] = _store(kept, elements, shards)
    return list(seen.values())


def _matrices(layout: Layout, part: Part) -> dict[str, tuple[int, int]]:
    table = placement_table(layout)
    return {n: table[n].spec.shape for n in part.elements
            if muon.is_muon_matrix(n, table[n].spec.shape)}


def _owned(part: Part) -> dict[str, int]:
    """Elements of each parameter in this rank's owned slices (ZeRO-1/2/3)."""
    out: dict[str, int] = {}
    for store in part.stores:
        for n, k in store.owned(part.slot).items():
            out[n] = out.get(n, 0) + k
    return out


def optimizer_elements(layout: Layout, coord: Coord) -> int:
    """Elements of optimizer state the rank at ``coord`` holds (module docstring)."""
    zero, is_muon = layout.parallel.zero, optimizer_mode(layout.train).muon
    total = 0
    for part in parts(layout, coord):
        matrices = _matrices(layout, part) if is_muon else {}
        if not zero:
            total += sum((1 if n in matrices else 2) * k for n, k in part.elements.items())
            continue
        owned = sum(s.length // s.shards for s in part.stores)
        rest = sum(k for n, k in _owned(part).items() if n not in matrices)
        total += owned + (rest if matrices else owned)
    return total


def _exchange(layout: Layout, coord: Coord, part: Part
              ) -> tuple[list[Call], dict[str, tuple[int, int]]]:
    """Muon's all-to-all-v's of one part of the rank and the matrices it orthogonalises (name
    -> global shape: each whole)."""
    table, tp, t = placement_table(layout), layout.tp, coord.tp
    matrices = _matrices(layout, part)
    if not matrices:
        return [], {}
    sharded = layout.parallel.zero > 0 and part.shards > 1
    # Owners are named by group rank (the slices a rank owns may lie elsewhere: _slot).
    slots, slot = (part.shards, _index(layout, coord, part.group)) if sharded else (1, 0)
    split = {n for n in matrices if table[n].split_dim is not None and tp > 1}
    owners = assign_owners(matrices, split, slots, tp, muon_config(layout.train).ns_steps)
    e = Precision.of(layout.train, layout.parallel).master_bytes
    local = {n: part.elements[n] for n in matrices}
    calls = []
    if sharded:
        mine = _owned(part)
        gather = sum(mine.get(n, 0) for n in matrices if owners[n][0] != slot)
        scatter = sum(local[n] - mine.get(n, 0) for n in matrices if owners[n][0] == slot)
        calls += [Call(part.group, "alltoallv", gather * e),
                  Call(part.group, "alltoallv", scatter * e)]
    if split:
        here = [n for n in split if owners[n][0] == slot]
        gather = sum(local[n] for n in here if owners[n][1] != t)
        scatter = sum((tp - 1) * local[n] for n in here if owners[n][1] == t)
        calls += [Call("tp", "alltoallv", gather * e), Call("tp", "alltoallv", scatter * e)]
    mine = [n for n in matrices
            if owners[n] == (slot, t) or (n not in split and owners[n][0] == slot)]
    return calls, {n: matrices[n] for n in mine}


def optimizer_calls(layout: Layout, coord: Coord) -> list[Call]:
    """The optimizer's calls of the rank at ``coord`` in a training step beside the gradient
    reduction: Muon's exchanges (none under AdamW)."""
    if not optimizer_mode(layout.train).muon:
        return []
    return [c for part in parts(layout, coord) for c in _exchange(layout, coord, part)[0]]


def optimizer_buffer_bytes(layout: Layout, coord: Coord) -> int:
    """Bytes the optimizer's step holds beside its state: under Muon the matrices this rank
    assembles, whole, and their orthogonalised copies (masters' dtype)."""
    if not optimizer_mode(layout.train).muon:
        return 0
    e = Precision.of(layout.train, layout.parallel).master_bytes
    return 2 * e * sum(math.prod(shape) for part in parts(layout, coord)
                       for shape in _exchange(layout, coord, part)[1].values())


def newton_schulz_flops(layout: Layout, coord: Coord) -> int:
    """FLOPs of the Newton-Schulz iterations the rank at ``coord`` runs in a step under Muon
    (0 under AdamW): :func:`mpipar.training.muon.ns_flops` of each matrix it orthogonalises,
    as the owners' assignment distributes them (a matrix every tp rank holds whole, at ZeRO-0
    or on its owner's slot: on each of those tp ranks)."""
    if not optimizer_mode(layout.train).muon:
        return 0
    steps = muon_config(layout.train).ns_steps
    return sum(muon.ns_flops(*shape, steps) for part in parts(layout, coord)
               for shape in _exchange(layout, coord, part)[1].values())
