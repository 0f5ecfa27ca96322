"""What a checkpoint and an activation dump record about the run, besides the tensors.

The training step builds these small frozen records (``training.step.rank_place``,
``training.step.run_position``); the checkpoint layer reads nothing else of a rank but its
state (:class:`~.shards.RankState`). The
fields of :class:`LRScheduleState` and :class:`DataCursor` are, in order, the attributes of the
index's ``lr_schedule`` and ``data`` groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpipar.config import Config
from mpipar.runtime.topology import Coord

AXES = ("dp", "tp", "pp", "sp")
"""The order of :attr:`RankPlace.coord` and :attr:`RankPlace.sizes`."""


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in the process grid: what its shard file and its activation dump
    record."""

    rank: int
    world_size: int
    coord: Coord                         # this rank's (dp, tp, pp, sp) coordinates
    sizes: tuple[int, int, int, int]     # the grid's (dp, tp, pp, sp) sizes


@dataclass(frozen=True)
class LRScheduleState:
    """The learning-rate schedule, a function of the step: its settings and where it stands."""

    kind: str             # "constant", "cosine" or "wsd"
    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    decay_fraction: float  # wsd: the fraction of total_steps that decays (0 otherwise)
    decay_shape: str      # wsd: linear, cosine or sqrt
    decay_start: int      # the first 0-based step below the peak after warm-up (wsd: the
                          # decay's first; constant: total_steps, never)
    next_step: int        # the 0-based optimizer step a resumed run takes next
    next_lr: float        # its learning rate


@dataclass(frozen=True)
class DataCursor:
    """Where the data stands: the sampler is a pure function of (seed, step), so its settings,
    the source's description and the step are its whole state."""

    path: str                  # the token source
    seed: int
    shuffle: bool
    global_batch_size: int
    seq_len: int
    num_samples: int           # samples the source holds
    next_step: int             # the 0-based step a resumed run draws next
    samples_consumed: int      # next_step * global_batch_size
    eval_fraction: float       # samples [train_samples, num_samples) are held out
    train_samples: int         # the samples training draws from


@dataclass(frozen=True)
class RunPosition:
    """Where a run stands after ``step`` training steps, as seen from one rank: its resolved
    configuration, this rank's place, the LR schedule's state, the data cursor, the routing
    biases of auxiliary-loss-free balancing (``{sparse block: [E] float64}``, the same on every
    rank; empty when off: :class:`mpipar.model.moe.RoutingBias`) and, under ``--objective dpo``,
    the reference log-probabilities of every row of the training pairs (``[2 * pairs]``
    float64, the same on every rank: :class:`mpipar.training.objective.Preference`; None
    otherwise)."""

    step: int
    config: Config
    place: RankPlace
    lr_schedule: LRScheduleState
    data: DataCursor
    moe_bias: dict[int, Any] = field(default_factory=dict)
    dpo_reference: Any = None
