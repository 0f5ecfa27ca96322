"""The resolved layout of a run: what a configuration means on a world of N ranks, computed once.

torchtitan calls this ParallelDims. A :class:`Config` as the user wrote it carries defaults that
mean "derive it" (``dp = 0`` fills the world, ``micro_batch_size = 0`` is one microbatch,
``head_dim = 0`` is ``hidden // heads``, ``ffn_hidden = 0`` is 8/3 of the width); :func:`resolve`
checks the rules that decide those numbers (the grid's sizes multiply to the world, the global
batch splits over dp and into microbatches, the schedule's size) and returns a frozen
:class:`Layout` holding them and a copy of the configuration with every default filled in. Every
component rule (:mod:`mpipar.rules`) and every constructor takes the Layout; nobody derives a
default again. This module is the only one that resolves: the model configuration of a
checkpoint or a Hugging Face directory is resolved where it is loaded, by :func:`resolve_model`.

    layout = rules.validate(cfg, world)      # every rule, in order; ConfigError on the first
    layout.dp, layout.microbatches, layout.stages, layout.model.head_dim
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from mpipar.config import (CHECKPOINT_OVERRIDABLE, Config, ConfigError, ModelConfig,
                           ParallelConfig, TrainConfig, check_fields, require)
from mpipar.runtime.allreduce_modes import algorithm_named

MAX_SCHEDULE_SLOTS = 2**16
"""At most this many microbatches x pipeline chunks per step: the schedule is built as op lists
and checked by a dry run, which takes about 3 s at this size."""


@dataclass(frozen=True)
class Layout:
    """One run's configuration resolved against its world size (see the module docstring).

    ``config`` is a private copy with every derived default filled in (its ``parallel.dp`` and
    ``train.micro_batch_size`` are the numbers below); ``model``, ``parallel`` and ``train`` are
    its sections, so code that reads a configuration reads a Layout the same way."""

    config: Config
    world: int
    dp: int
    tp: int
    pp: int
    sp: int
    virtual_stages: int
    micro_batch_size: int      # sequences per microbatch on one dp rank
    microbatches: int          # microbatches per step on one dp rank
    ranks_per_node: int        # 0: the nodes MPI reports

    @property
    def model(self) -> ModelConfig:
        return self.config.model

    @property
    def parallel(self) -> ParallelConfig:
        return self.config.parallel

    @property
    def train(self) -> TrainConfig:
        return self.config.train

    @property
    def dump_steps(self) -> set[int]:
        return self.config.dump_steps

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The resolved configuration as TOML tables (what a run writes as config.toml)."""
        return self.config.to_dict()

    def to_toml(self) -> str:
        return self.config.to_toml()

    @property
    def stages(self) -> int:
        """Model chunks of the pipeline: pp x virtual stages."""
        return self.pp * self.virtual_stages

    @property
    def micro_rows(self) -> int:
        """Sequences the model runs per microbatch on one dp rank: ``micro_batch_size``
        samples of ``train.rows_per_sample`` rows each (a DPO pair: its chosen and rejected
        sequences)."""
        return self.micro_batch_size * self.train.rows_per_sample

    @property
    def rows_per_dp(self) -> int:
        """Sequences of the global batch one dp rank (with its sp ranks) trains per step."""
        return self.train.global_batch_size // self.dp

    @property
    def dp_sp(self) -> int:
        """Ranks that hold the same parameter shard: gradients are summed over dp x sp."""
        return self.dp * self.sp

    @property
    def model_parallel(self) -> int:
        """Ranks of one model replica's sequence chunk: tp x pp x sp."""
        return self.tp * self.pp * self.sp


DERIVED = {"parallel": ("dp", "tp", "pp", "sp", "virtual_stages"),
           "train": ("global_batch_size", "micro_batch_size")}
"""The fields a Layout's numbers are derived from: :func:`vary` refuses to change them."""


def vary(layout: Layout, **sections: Mapping[str, Any]) -> Layout:
    """``layout`` with fields changed that none of its numbers depend on, e.g.
    ``vary(layout, train={"recompute": "full"})`` (the planner's variants); the component rules
    are not asked again. Changing a field of :data:`DERIVED` or the model is a ValueError:
    resolve such a variant with :func:`mpipar.rules.validate`."""
    cfg = layout.config
    parts = {"model": cfg.model, "parallel": cfg.parallel, "train": cfg.train}
    for name, changes in sections.items():
        frozen = set(changes) & set(DERIVED.get(name, ())) if name != "model" else set(changes)
        if name not in parts or frozen:
            raise ValueError(f"vary: {name}.{sorted(frozen) or ''} decides the layout's numbers; "
                             f"validate the changed configuration instead")
        parts[name] = dataclasses.replace(parts[name], **changes)
    return dataclasses.replace(layout, config=Config(**parts),
                               ranks_per_node=parts["parallel"].ranks_per_node)


def resolve_model(m: ModelConfig) -> ModelConfig:
    """A copy of ``m`` with its derived defaults filled in: ``head_dim`` (hidden // heads) and
    ``ffn_hidden`` (8/3 x hidden rounded up to a multiple of 32)."""
    out = dataclasses.replace(m)
    if out.head_dim == 0 and out.heads > 0:
        out.head_dim = out.hidden // out.heads
    if out.ffn_hidden == 0:
        out.ffn_hidden = 32 * math.ceil(8 * out.hidden / 3 / 32)
    if out.moe_experts and out.moe_ffn_hidden == 0:
        out.moe_ffn_hidden = out.ffn_hidden
    return out


def resolve(cfg: Config, world: int) -> Layout:
    """Check the fields' own rules and the rules that decide the layout's numbers, and return the
    Layout of ``cfg`` on ``world`` ranks; ConfigError names the field, the value and the rule."""
    check_fields(cfg, resolve_model(cfg.model))
    require(world >= 1, f"world size {world}: must be >= 1")
    dp = _grid(cfg.parallel, world)
    micro, count = _batch_split(cfg.parallel, cfg.train, dp)
    # --allreduce-algorithm hierarchical is mpipar's own hierarchical reduction.
    own = algorithm_named(cfg.parallel.allreduce_algorithm).own_reduction
    reduce = "hierarchical" if own else None
    resolved = Config(resolve_model(cfg.model),
                      dataclasses.replace(cfg.parallel, dp=dp,
                                          dp_reduce=reduce or cfg.parallel.dp_reduce),
                      dataclasses.replace(cfg.train, micro_batch_size=micro))
    p = resolved.parallel
    return Layout(config=resolved, world=world, dp=dp, tp=p.tp, pp=p.pp, sp=p.sp,
                  virtual_stages=p.virtual_stages, micro_batch_size=micro, microbatches=count,
                  ranks_per_node=p.ranks_per_node)


def _grid(p: ParallelConfig, world: int) -> int:
    """The grid's sizes multiply to the world (dp = 0 fills it); given nodes divide it. Returns dp."""
    mp = p.tp * p.pp * p.sp
    if p.dp == 0:
        require(world % mp == 0, f"parallel: tp*pp*sp = {p.tp}*{p.pp}*{p.sp} = {mp} must divide "
                                 f"the world size {world}")
    else:
        require(p.dp * mp == world, f"parallel: dp*tp*pp*sp = {p.dp}*{p.tp}*{p.pp}*{p.sp} = "
                                    f"{p.dp * mp} must equal the world size {world}")
    require(p.ranks_per_node >= 0, f"parallel.ranks_per_node={p.ranks_per_node}: must be >= 0 "
                                   f"(0 detects the nodes)")
    require(p.ranks_per_node == 0 or world % p.ranks_per_node == 0,
            f"parallel.ranks_per_node={p.ranks_per_node}: must divide the world size {world}")
    return p.dp or world // mp


def _batch_split(p: ParallelConfig, t: TrainConfig, dp: int) -> tuple[int, int]:
    """The global batch splits evenly over dp and into microbatches, and the step's schedule has
    at most :data:`MAX_SCHEDULE_SLOTS` slots. Returns (micro_batch_size, microbatches)."""
    require(t.global_batch_size % dp == 0,
            f"train.global_batch_size={t.global_batch_size}: must be divisible by dp={dp}")
    if t.micro_batch_size:
        require(t.global_batch_size % (dp * t.micro_batch_size) == 0,
                f"train.global_batch_size={t.global_batch_size}: must be divisible by "
                f"dp*micro_batch_size = {dp}*{t.micro_batch_size}")
    micro = t.micro_batch_size or t.global_batch_size // dp
    count = t.global_batch_size // (dp * micro)
    slots = count * p.pp * p.virtual_stages
    require(slots <= MAX_SCHEDULE_SLOTS,
            f"train.global_batch_size={t.global_batch_size}: {count} microbatches per step x "
            f"pp*virtual_stages = {p.pp}*{p.virtual_stages} makes {slots} schedule slots; at most "
            f"{MAX_SCHEDULE_SLOTS} (a larger train.micro_batch_size gives fewer microbatches)")
    return micro, count


def model_from_checkpoint(saved: ModelConfig, given: Mapping[str, Any], source: str,
                          names: Mapping[str, str] | None = None) -> ModelConfig:
    """The resolved model config of a run that starts from a checkpoint.

    Model settings come from the checkpoint (``saved``); ``given`` holds the model fields the user
    set (flags or ``[model]``; None = not given). A given value must agree with the checkpoint
    after derived defaults are resolved (``head_dim=0`` means hidden // heads), except the fields
    in CHECKPOINT_OVERRIDABLE; otherwise ConfigError names the field, both values and ``source``
    (``names`` maps field names to the checkpoint's own names for the message).
    """
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    given = {k: v for k, v in given.items() if v is not None}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"model fields {unknown} do not exist; known: {sorted(known)}")
    base = resolve_model(saved)
    candidate = resolve_model(dataclasses.replace(base, **given))
    for name in given:
        mine, theirs = getattr(candidate, name), getattr(base, name)
        if name not in CHECKPOINT_OVERRIDABLE and mine != theirs:
            raise ConfigError(
                f"model.{name}={given[name]!r} (flag --{name.replace('_', '-')} or [model] "
                f"{name}) contradicts {source} ({(names or {}).get(name, name)}={theirs!r}); "
                f"model settings come from the checkpoint: drop the setting or give its value")
    return candidate
