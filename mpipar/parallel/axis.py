"""The parallel axis as a unit: one object per axis behind one protocol.

An :class:`Axis` says, for its own axis, the configuration rule (``check``, asked by
:mod:`mpipar.rules` in :data:`mpipar.parallel.registry.AXES` order) and the MPI calls it
predicts for one rank in a step or a validation pass (``calls``, concatenated by
:func:`mpipar.plan.traffic.step_calls`; the ledger tests hold the engine to them). What an axis
reads of the rank it predicts for is a :class:`StepRank`: the planner computes it (from the
layout alone, :mod:`mpipar.plan.rank`), so an axis needs nothing above ``parallel/``.
:class:`AxisUnit` is the one implementation: a name and two functions of the axis's modules.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mpipar.layout import Layout
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
    def node_copy(self) -> tuple[int, int] | None: ...     # ZeRO-3 in node shared memory
    @property
    def tied(self) -> bool: ...                            # the embedding tied across pp


class Axis(Protocol):
    """One parallel axis: its rule and the calls it predicts."""

    name: str

    def check(self, layout: Layout) -> None:
        """Raise :class:`mpipar.config.ConfigError` naming the field, value and rule."""

    def calls(self, rank: StepRank) -> list[Call]:
        """The MPI calls this axis makes on ``rank`` (none when the axis is not in use)."""


@dataclass(frozen=True)
class AxisUnit:
    """An :class:`Axis` made of its modules' rule and traffic functions."""

    name: str
    rule: Callable[[Layout], None]
    traffic: Callable[[StepRank], list[Call]]

    def check(self, layout: Layout) -> None:
        self.rule(layout)

    def calls(self, rank: StepRank) -> list[Call]:
        return self.traffic(rank)
