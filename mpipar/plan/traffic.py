"""What one rank hands to MPI in a step: bytes, calls and wire bytes per group.

``predict_step_bytes(layout, coord)`` derives, from the layer shapes alone, the bytes the rank
at ``coord`` hands to MPI in one training step for every group of the grid, under the ledger's
counting convention (:mod:`mpipar.runtime.comm`: the payload of each call, sender side);
``predict_step_messages`` counts the calls, and ``predict_link_bytes`` the wire bytes per group
inside and across nodes (the planner's nodes, :func:`mpipar.plan.rank.nodes_of`;
:mod:`mpipar.runtime.comm` for the wire factors and links). All three come from one list of the
step's calls (:func:`step_calls`), which concatenates what each parallel axis predicts for
itself (:mod:`mpipar.parallel.calls`): tensor (:func:`mpipar.parallel.tensor.cost.tensor_calls`),
sequence (:func:`mpipar.parallel.sequence.cost.sequence_calls`), pipeline
(:func:`mpipar.parallel.pipeline.cost.pipeline_calls`), and the gradient reduction over
dp x sp (:func:`mpipar.parallel.data_parallel.cost.reduction_calls`, or at ZeRO-2/3
:func:`mpipar.parallel.fsdp.cost.sharded_calls`; the experts' over ``ep_dp``:
:mod:`mpipar.parallel.experts`), plus the engine's scalar reductions. The tests
hold the engine's ledger to these numbers exactly, so the model and the implementation cannot
drift apart; a mismatch in one group points at the axis that owns it.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

from mpipar.layout import Layout
from mpipar.model.mtp import all_blocks, mtp_layers
from mpipar.model.params import EMBED
from mpipar.parallel.calls import Call
from mpipar.parallel.fsdp.cost import unit_passes
from mpipar.parallel.registry import AXES
from mpipar.plan import state_copies
from mpipar.plan.optimizer import optimizer_calls
from mpipar.plan.rank import (expert_unit_lengths, frozen_kept_units, frozen_unit_lengths,
                              gradient_buckets, grid_shape,
                              group_members, group_sizes, kept_units, node_copy, nodes_of,
                              placement_table, rank_ops, rank_stages, unit_lengths)
from mpipar.runtime import allreduce
from mpipar.runtime.ledger import ALLREDUCE_OPS, LINKS, wire_bytes
from mpipar.runtime.topology import Coord, GridShape


@dataclass
class PlannedStep:
    """The rank at ``coord`` of ``layout`` in one training step (``train``) or validation pass,
    as the axes read it (:class:`mpipar.parallel.axis.StepRank`), from the layout alone."""

    layout: Layout
    coord: Coord
    train: bool
    eval_batches: int = 0
    documents: list | None = None

    @functools.cached_property
    def shape(self) -> GridShape:
        return grid_shape(self.layout)

    @functools.cached_property
    def passes(self) -> int:
        return self.layout.microbatches * (1 if self.train else self.eval_batches)

    @functools.cached_property
    def stages(self) -> list[int]:
        return rank_stages(self.layout, self.coord)

    @functools.cached_property
    def chunk_layers(self) -> list[list[int]]:
        """The blocks each chunk runs: a training step's last stage also runs the multi-token
        prediction modules' (:func:`mpipar.model.mtp.mtp_layers`; validation does not)."""
        table, last = placement_table(self.layout), self.layout.stages - 1
        mtp = list(mtp_layers(self.layout.model)) if self.train else []
        return [list(table.stage_layers(stage)) + (mtp if stage == last else [])
                for stage in self.stages]

    @functools.cached_property
    def ops(self) -> list:
        return rank_ops(self.layout, self.coord)

    @functools.cached_property
    def entered(self) -> list[tuple[str, int]]:
        if self.layout.parallel.zero < 2:
            return []
        # The last stage's head scope holds the modules' units in validation too (unrun there).
        table, last = placement_table(self.layout), self.layout.stages - 1
        layers = [list(table.stage_layers(s)) + (list(mtp_layers(self.layout.model))
                                                 if s == last else []) for s in self.stages]
        return unit_passes(self.layout, self.coord.pp, self.ops, layers)

    @functools.cached_property
    def group_sizes(self) -> dict[str, int]:
        return group_sizes(self.layout)

    @functools.cached_property
    def gradient_buckets(self) -> list[tuple[int, bool]]:
        return gradient_buckets(self.layout, self.coord)

    @functools.cached_property
    def unit_lengths(self) -> dict[str, int]:
        return unit_lengths(self.layout, self.coord)

    @functools.cached_property
    def expert_unit_lengths(self) -> dict[str, int]:
        return expert_unit_lengths(self.layout, self.coord)

    @functools.cached_property
    def kept_units(self) -> set[str]:
        return kept_units(self.layout, self.coord)

    @functools.cached_property
    def expert_kept_units(self) -> set[str]:
        return kept_units(self.layout, self.coord, True)

    @functools.cached_property
    def frozen_unit_lengths(self) -> dict[str, int]:
        return frozen_unit_lengths(self.layout, self.coord)

    @functools.cached_property
    def frozen_kept_units(self) -> set[str]:
        return frozen_kept_units(self.layout, self.coord)

    @functools.cached_property
    def node_copy(self) -> tuple[int, int] | None:
        return node_copy(self.layout, self.coord)

    @functools.cached_property
    def tied(self) -> bool:
        return placement_table(self.layout)[EMBED].tied_across_pipeline

    @functools.cached_property
    def calls(self) -> list[Call]:
        """Every MPI call this rank makes (:func:`step_calls`), listed once: the bytes, calls,
        wire bytes and seconds per group of the planner all read this list."""
        layout, coord, train = self.layout, self.coord, self.train
        calls = [call for axis in AXES for call in axis.calls(self)]
        calls += optimizer_calls(layout, coord) if train else []
        # --state-copies: the step's copy of the rank's state to its holder
        calls += state_copies.copy_calls(layout, coord) if train else []
        return [c for c in calls + _scalar_calls(layout, coord, train) if c.count]


def step_calls(layout: Layout, coord: Coord, eval_batches: int = 0,
               documents: list | None = None) -> list[Call]:
    """Every MPI call the rank at ``coord`` makes in one training step, or with
    ``eval_batches`` > 0 in one validation pass over that many batches (forward only, the loss
    reduced once: :func:`mpipar.training.step.evaluate`): each axis's prediction
    (:data:`mpipar.parallel.registry.AXES`), then the step's scalar reductions.
    ``documents``: with ``--document-masking``, the document ids ``[B, S]`` of each of the
    step's microbatches on this rank (the ring skips hops no document crosses)."""
    return PlannedStep(layout, coord, eval_batches == 0, eval_batches, documents).calls


def _scalar_calls(layout: Layout, coord: Coord, train: bool) -> list[Call]:
    """The engine's reductions of a number: the loss over dp x sp (and in a training step the
    multi-token prediction loss, then broadcast from the last stage), in a training step the
    gradient norm's sum of squares over dp x sp (ZeRO: over the slices) and over tp x pp; a
    DPO step's rewards and accuracy over dp x sp, then sent from the last pipeline stage (with
    sp, each microbatch's rows' log-probabilities summed over sp on the last stage)."""
    par = layout.parallel
    calls = []
    if layout.dp * par.sp > 1:
        calls.append(Call("dp_sp", "allreduce", 8))                       # the loss
        if train and par.zero:
            calls.append(Call("dp_sp", "allreduce", 8))                   # the gradient norm
    if train and layout.model.mtp_depth:   # the modules' loss: over dp x sp, then from the last
        calls += [Call("dp_sp", "allreduce", 8)] if layout.dp * par.sp > 1 else []   # stage
        calls += [Call("pp", "bcast", 8 if coord.pp == par.pp - 1 else 0)] if par.pp > 1 else []
    if train and par.tp * par.pp > 1:
        calls.append(Call("tp_pp", "allreduce", 8))                       # the squared norm
    if train and layout.train.sequences_per_sample > 1:   # DPO's rewards and accuracy (3 floats)
        calls += [Call("dp_sp", "allreduce", 24)] if layout.dp * par.sp > 1 else []
        calls += [Call("pp", "bcast", 24 if coord.pp == par.pp - 1 else 0)] \
            if par.pp > 1 else []
        if par.sp > 1 and coord.pp == par.pp - 1:   # each microbatch's sequences' log-probs
            seqs = layout.micro_batch_size * layout.train.sequences_per_sample
            calls.append(Call("sp", "allreduce", 8 * seqs, layout.microbatches))
    m = layout.config.model
    if train and m.moe_experts:  # balance loss, loads, drops (training.step._moe_stats), float64
        n = 8 * (1 + sum(map(m.is_sparse, all_blocks(m))) * (m.moe_experts + 1))
        calls += [Call(g, "allreduce", n) for g, size in (("dp_sp", layout.dp * par.sp),
                                                           ("tp_pp", par.tp * par.pp)) if size > 1]
    return calls


def _per_group(calls: list[Call], count_bytes: bool) -> dict[str, int]:
    """Bytes (``count_bytes``) or calls of ``calls``, summed per group."""
    out: dict[str, int] = defaultdict(int)
    for call in calls:
        out[call.group] += call.count * (call.nbytes if count_bytes else 1)
    return dict(out)


def predict_step_bytes(layout: Layout, coord: Coord, documents: list | None = None
                       ) -> dict[str, int]:
    """Bytes per group that the rank at ``coord`` hands to MPI in one step (the ledger's
    :meth:`mpipar.runtime.ledger.Ledger.bytes_by_group`); ``documents`` as :func:`step_calls`."""
    return rank_step_bytes(PlannedStep(layout, coord, True, documents=documents))


def rank_step_bytes(rank: PlannedStep) -> dict[str, int]:
    """:func:`predict_step_bytes` of ``rank``'s calls (:attr:`PlannedStep.calls`)."""
    return _per_group(rank.calls, True)


def predict_step_messages(layout: Layout, coord: Coord) -> dict[str, int]:
    """MPI calls per group (the ledger's ``messages``) of the rank at ``coord`` in one step."""
    return _per_group(step_calls(layout, coord), False)


def predict_optimizer_bytes(layout: Layout, coord: Coord) -> int:
    """Bytes the rank at ``coord`` hands to MPI in the optimizer step (clipping and the update:
    what :class:`mpipar.observe.metrics.OptimizerCost` measures): Muon's exchanges and the
    all-gathers of the updated parameters (ZeRO-1's slices, ZeRO-2's units, ZeRO-3's copies
    in node shared memory: the reductions' only blocking all-gathers)."""
    return sum(c.nbytes * c.count for c in step_calls(layout, coord)
               if c.op == "allgather" and c.group != "tp") + sum(
        c.nbytes * c.count for c in optimizer_calls(layout, coord))


def predict_eval_bytes(layout: Layout, coord: Coord) -> dict[str, int]:
    """Bytes per group that the rank at ``coord`` hands to MPI in one validation pass of
    ``train.eval_batches`` batches (booked in the engine's ``eval_ledger``)."""
    return _per_group(step_calls(layout, coord, layout.train.eval_batches), True)


def predict_eval_messages(layout: Layout, coord: Coord) -> dict[str, int]:
    """MPI calls per group of the rank at ``coord`` in one validation pass."""
    return _per_group(step_calls(layout, coord, layout.train.eval_batches), False)


def call_link(layout: Layout, coord: Coord, call: Call) -> str:
    """"intra" or "inter": a collective by whether its group's instance spans nodes, a
    point-to-point call by its peer's node (:mod:`mpipar.runtime.comm`)."""
    nodes, shape = nodes_of(layout), grid_shape(layout)
    me = shape.rank_of(coord)
    if call.peer is not None:
        return "intra" if nodes.nodes[call.peer] == nodes.nodes[me] else "inter"
    members = group_members(layout, call.group, me)
    return "inter" if len({nodes.nodes[r] for r in members}) > 1 else "intra"


def predict_link_bytes(layout: Layout, coord: Coord, documents: list | None = None
                       ) -> dict[str, dict[str, int]]:
    """``{group: {"intra": wire bytes, "inter": wire bytes}}`` the rank at ``coord`` sends in
    one step (the ledger's :meth:`mpipar.runtime.ledger.Ledger.bytes_by_link`); ``documents`` as
    :func:`step_calls`."""
    return rank_link_bytes(PlannedStep(layout, coord, True, documents=documents))


def rank_link_bytes(rank: PlannedStep) -> dict[str, dict[str, int]]:
    """:func:`predict_link_bytes` of ``rank``'s calls (:attr:`PlannedStep.calls`)."""
    layout, coord, sizes = rank.layout, rank.coord, rank.group_sizes
    out: dict[str, dict[str, int]] = {}
    for call in rank.calls:
        wire = call_wire(layout, coord, call, sizes) * call.count
        if wire:
            links = out.setdefault(call.group, dict.fromkeys(LINKS, 0))
            links[call_link(layout, coord, call)] += wire
    return out


@functools.lru_cache(maxsize=8)
def _size_choice(path: str) -> allreduce.SizeChoice | None:
    """The per-size choice of ``auto`` from hardware file ``path`` (None when it has no table)."""
    try:
        return allreduce.SizeChoice(allreduce.load_table(path), None)
    except (OSError, ValueError):
        return None


def call_algorithm(layout: Layout, call: Call) -> str | None:
    """The all-reduce algorithm the wire model books for ``call`` (None: not an all-reduce, or
    the library's own choice, booked as the ring): ``--allreduce-algorithm``, or under ``auto``
    the one ``--allreduce-hardware``'s table picks for the call's size
    (:func:`mpipar.runtime.allreduce.in_effect`)."""
    if call.op not in ALLREDUCE_OPS:
        return None
    par = layout.parallel
    choice = _size_choice(par.allreduce_hardware) if par.allreduce_hardware else None
    return allreduce.in_effect(par.allreduce_algorithm, call.nbytes, choice)


def call_wire(layout: Layout, coord: Coord, call: Call, sizes: dict[str, int]) -> int:
    """Bytes the rank at ``coord`` puts on the wire for one ``call`` (the ledger's
    :meth:`mpipar.runtime.comm.Group._wire`): an all-reduce under a named algorithm as its
    group rank's share of that algorithm's schedule."""
    algorithm = call_algorithm(layout, call)
    if algorithm is None:
        return wire_bytes(call.op, call.nbytes, sizes[call.group])
    me = grid_shape(layout).rank_of(coord)
    members = group_members(layout, call.group, me)
    return wire_bytes(call.op, call.nbytes, sizes[call.group], members.index(me), algorithm)
