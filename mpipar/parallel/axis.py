"""The parallel axis as a unit: one object per axis behind one protocol.

An :class:`Axis` says, for its own axis, the configuration rule (``check``, asked by
:mod:`mpipar.rules` in :data:`mpipar.parallel.registry.AXES` order), the MPI calls it
predicts for one rank in a step or a validation pass (``calls``, concatenated by
:func:`mpipar.plan.traffic.step_calls`; the ledger tests hold the engine to them), and its
memory and time terms: what its split makes a block and the LM head keep for backward
(``activations``, a :class:`Footprint` summed field by field over the axes by
:mod:`mpipar.plan.memory`), the buffers it holds beside the parameters (``held``, a
:class:`Held`), and the seconds it spends on a group besides its calls' transfers
(``seconds``, added by :mod:`mpipar.plan.step_time`). What an axis reads of the rank it
predicts for is a :class:`StepRank`: the planner computes it (from the layout alone,
:mod:`mpipar.plan.rank`), so an axis needs nothing above ``parallel/``. What it builds for a
rank is its :class:`RankHooks` (``build``): one hook per phase of
:func:`mpipar.training.rank.build_rank`, which calls each phase's hooks over the axes in
registry order. :class:`AxisUnit` is the one implementation: a name and the functions of the
axis's modules, the terms and hooks an axis does not have left at none.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from mpipar.layout import Layout
from mpipar.model.recompute import Recompute
from mpipar.parallel.calls import Call
from mpipar.runtime.topology import Coord, GridShape


class StepRank(Protocol):
    """One rank of a layout in one step (``train``) or validation pass, as the axes' traffic
    reads it."""

    layout: Layout
    coord: Coord
    train: bool
    documents: list | None     # with --document-masking: each microbatch's document ids

    @property
    def shape(self) -> GridShape: ...
    @property
    def passes(self) -> int: ...                           # forwards of each chunk
    @property
    def stages(self) -> list[int]: ...                     # its global virtual stages
    @property
    def chunk_layers(self) -> list[list[int]]: ...         # the blocks of each chunk
    @property
    def ops(self) -> list: ...                             # its schedule's op list
    @property
    def entered(self) -> list[tuple[str, int]]: ...        # ZeRO-2/3: (unit, reduce-scatters)
    @property
    def group_sizes(self) -> dict[str, int]: ...
    @property
    def gradient_buckets(self) -> list[tuple[int, bool]]: ...   # ZeRO-0/1: (elements, tied)
    @property
    def unit_lengths(self) -> dict[str, int]: ...          # ZeRO-2/3: the dense units
    @property
    def expert_unit_lengths(self) -> dict[str, int]: ...   # ZeRO-2/3: the experts' units
    @property
    def kept_units(self) -> set[str]: ...                  # kept gathered to backward
    @property
    def expert_kept_units(self) -> set[str]: ...
    @property
    def frozen_unit_lengths(self) -> dict[str, int]: ...   # ZeRO-3 LoRA: the frozen base's
    @property
    def frozen_kept_units(self) -> set[str]: ...
    @property
    def node_copy(self) -> tuple[int, int] | None: ...     # ZeRO-3 in node shared memory
    @property
    def tied(self) -> bool: ...                            # the embedding tied across pp


@dataclass(frozen=True)
class Footprint:
    """Bytes an axis's split makes one rank keep for backward, one microbatch: per field of a
    dense block's record (:class:`mpipar.model.llama.BlockSaved`), of a sparse block's, and
    the LM head's. The planner sums each field over the axes, then asks the recompute mode
    which fields stay (:meth:`mpipar.model.recompute.Recompute.resident_bytes`)."""

    block: Mapping[str, int] = field(default_factory=dict)
    sparse: Mapping[str, int] = field(default_factory=dict)
    head: int = 0


@dataclass(frozen=True)
class Held:
    """Bytes an axis's runtime holds on a rank beside the parameters, their gradients and
    moments and the activations (the fields of :class:`mpipar.plan.memory.MemoryEstimate`
    of the same names)."""

    buffers: int = 0     # copies for the wire, gathered units, their pool
    residuals: int = 0   # error-feedback residuals


class Rates(Protocol):
    """What the time terms read of the hardware (:class:`mpipar.plan.step_time.Hardware`)."""

    int8_seconds: float    # a rank's int8 encode/decode work per element compressed
    topk_seconds: float    # a rank's top-k selection and decode work per element


Parts = dict[str, Any]
"""What the axes build in one phase of a rank, by name (each name given by one axis)."""


@dataclass(frozen=True)
class RankHooks:
    """What an axis builds for a rank, one hook per phase of
    :func:`mpipar.training.rank.build_rank` (none where it builds nothing then). Each hook
    takes the layout, the phase's arguments and ``parts``, what the axes before it in the
    registry built in the same phase, and returns the parts it adds by name; ``comms``,
    ``compute``, ``model`` and ``weights`` are the :class:`mpipar.training.rank.Rank`'s parts
    built before the phase.

    - ``grid(layout, grid, device, parts)``: sub-communicators of the process grid
      (:class:`mpipar.runtime.topology.ProcessGrid`), before its groups are made; parts such
      as ZeRO-3's copies on each node;
    - ``groups(layout, groups, ledger, mpi_path, parts)``: groups split from the grid's
      (:class:`mpipar.runtime.comm.Group`), returned by name;
    - ``seams(layout, comms, compute, table, parts)``: what the model's chunks are given:
      the tensor seam, the sequence split, a factory of attention cores or expert exchanges
      (one object a chunk);
    - ``weights(layout, comms, compute, model, names, tied, initial, parts)``: the trained
      parameters' holder (the gradient reducer, or the sharded units);
    - ``executors(layout, comms, compute, model, weights, parts)``: what walks the schedule.
    """

    grid: Callable[..., Parts] | None = None
    groups: Callable[..., Parts] | None = None
    seams: Callable[..., Parts] | None = None
    weights: Callable[..., Parts] | None = None
    executors: Callable[..., Parts] | None = None


class Axis(Protocol):
    """One parallel axis: its rule, the calls it predicts, its memory and time terms, and what
    it builds for a rank."""

    name: str
    build: RankHooks

    def check(self, layout: Layout) -> None:
        """Raise :class:`mpipar.config.ConfigError` naming the field, value and rule."""

    def calls(self, rank: StepRank) -> list[Call]:
        """The MPI calls this axis makes on ``rank`` (none when the axis is not in use)."""

    def activations(self, layout: Layout, mode: Recompute) -> Footprint:
        """What its split makes a rank of ``layout`` keep for backward under ``mode``."""

    def held(self, rank: StepRank) -> Held:
        """The buffers its runtime holds on ``rank`` in a training step."""

    def seconds(self, rank: StepRank, rates: Rates) -> dict[str, float]:
        """Seconds per group of a training step on ``rank`` besides its calls' transfers."""


NO_FOOTPRINT, NOTHING_HELD = Footprint(), Held()


@dataclass(frozen=True)
class AxisUnit:
    """An :class:`Axis` made of its modules' functions: the rule and the traffic, the terms it
    has (``footprint``, ``holds``, ``work``; none where absent) and its build hooks."""

    name: str
    rule: Callable[[Layout], None]
    traffic: Callable[[StepRank], list[Call]]
    footprint: Callable[[Layout, Recompute], Footprint] | None = None
    holds: Callable[[StepRank], Held] | None = None
    work: Callable[[StepRank, Any], dict[str, float]] | None = None
    build: RankHooks = RankHooks()

    def check(self, layout: Layout) -> None:
        self.rule(layout)

    def calls(self, rank: StepRank) -> list[Call]:
        return self.traffic(rank)

    def activations(self, layout: Layout, mode: Recompute) -> Footprint:
        return self.footprint(layout, mode) if self.footprint else NO_FOOTPRINT

    def held(self, rank: StepRank) -> Held:
        return self.holds(rank) if self.holds else NOTHING_HELD

    def seconds(self, rank: StepRank, rates: Rates) -> dict[str, float]:
        return self.work(rank, rates) if self.work else {}
