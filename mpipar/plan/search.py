"""Which layouts of a world fit, and which should be fastest.

:func:`plan_layouts` enumerates every factorisation ``dp x tp x pp x sp`` of the world with every
free choice (:func:`_variants`: pipeline schedule, SP mode and split, microbatch size, ZeRO
stage; with nodes, the reduction and compression), keeps those the configuration rules accept,
takes for each the first recompute mode whose memory fits, and ranks them by the predicted step
time (:mod:`mpipar.plan.step_time`). Times within :data:`TIE` of each other are a tie (the time
model cannot tell them apart): the simplest layout of a tie (:func:`simplicity`) ranks first,
and each member is marked as tied. :func:`auto_layout` is what ``python -m mpipar.train`` does
when no parallel size is given.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from mpipar.config import Config, ConfigError
from mpipar.layout import Layout, vary
from mpipar.parallel.data_parallel.modes import COMPRESSIONS, NODE_SPLITS, reduction_of
from mpipar.parallel.fsdp.modes import PLACES, in_node_memory
from mpipar.parallel.sequence.registry import SP_MODES, sequence_mode
from mpipar.model.recompute import BY_MEMORY
from mpipar.plan.memory import MemoryEstimate, rank_memory
from mpipar.plan.step_time import (Hardware, StepDocuments, StepTime, planned_ranks,
                                   predict_step_time, with_nodes)
from mpipar.plan.traffic import rank_link_bytes, rank_step_bytes
from mpipar.rules import validate
from mpipar.runtime.ledger import LINKS
from mpipar.runtime.device import device_of

SIZE_FIELDS = ("dp", "tp", "pp", "sp")
RECOMPUTE_ORDER = tuple(m.name for m in BY_MEMORY)
TIE = 0.10
"""Predicted step times within this fraction of a tie's fastest are a tie: the time model is
not that exact (the probed peak alone varies more than that between calls on a busy machine)."""


@dataclass
class Candidate:
    """A layout that validates, with its predictions (worst pipeline rank); one whose memory
    exceeds the search's limit is not timed (``time`` None, no bytes)."""

    cfg: Layout
    memory: MemoryEstimate
    step_bytes: dict[str, int]
    time: StepTime | None
    link_bytes: dict[str, dict[str, int]] = field(default_factory=dict)   # wire, worst rank
    tie: int = 0     # the rank (1-based) of the tie this layout belongs to; 0: no tie

    def describe(self) -> str:
        par, tr = self.cfg.parallel, self.cfg.train
        text = f"dp={par.dp} tp={par.tp} pp={par.pp} sp={par.sp}"
        if par.pp > 1:
            text += f" {par.schedule}" + (f"(v={par.virtual_stages})" if par.virtual_stages > 1
                                          else "")
        if par.sp > 1:
            text += sequence_mode(par).describe(par)
        if par.dp * par.sp > 1:
            text += reduction_of(par).label(par.topk_ratio)
        if self.cfg.model.moe_experts:
            text += f" ep={par.ep}"
        zero = f"{par.zero}" + ("(node shared)" if in_node_memory(par) else "")
        return text + f" mbs={tr.micro_batch_size} zero={zero} recompute={tr.recompute}"


@dataclass
class Rejection:
    """A factorisation of the world no variant of which is ranked, and why."""

    layout: str
    reason: str


@dataclass
class Plan:
    ranked: list[Candidate] = field(default_factory=list)     # fastest first
    rejected: list[Rejection] = field(default_factory=list)


def _factorisations(world: int) -> list[tuple[int, int, int, int]]:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [c for c in itertools.product(divisors, repeat=4) if math.prod(c) == world]


def _schedule_choices(base: Config, pp: int, fixed: set[str]) -> list[tuple[str, int]]:
    """(schedule, virtual stages) to try with ``pp`` pipeline ranks."""
    par = base.parallel
    if {"schedule", "virtual_stages"} & fixed:
        return [(par.schedule, par.virtual_stages)]
    if pp == 1:
        return [("1f1b", 1)]
    return [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1)] + [
        ("interleaved", v) for v in (2, 4) if base.model.layers % (pp * v) == 0]


def _sp_choices(base: Config, tp: int, sp: int, fixed: set[str]) -> list[tuple[str, str, int]]:
    """(mode, split, Ulysses size) to try with ``sp`` sequence ranks (hybrid: Ulysses inside a
    node, ring across, when the nodes are given; the balanced split for packed documents)."""
    par = base.parallel
    if sp == 1 or {"sp_mode", "sp_split", "ulysses_size"} & fixed:
        return [(par.sp_mode, par.sp_split, par.ulysses_size)]
    node_sp = par.ranks_per_node // tp if par.ranks_per_node % tp == 0 else 0
    modes = [(mode.name, split, u) for mode in SP_MODES.values()
             for split, u in mode.search_choices(base, sp, node_sp)]
    if base.train.document_masking:
        modes += [(mode.name, "balanced", 0) for mode in SP_MODES.values() if mode.balanced_split]
    return modes


def _variants(base: Config, sizes: tuple[int, int, int, int], fixed: set[str]
              ) -> Iterator[Config]:
    """Configs with ``sizes`` = (dp, tp, pp, sp) and every free schedule / SP / batch / ZeRO /
    reduction / compression choice (hierarchical reduction and hybrid SP when nodes are given),
    and for a mixture of experts every expert-parallel size (dividing dp x sp and the experts)."""
    par, tr = base.parallel, base.train
    dp, tp, pp, sp = sizes
    rows = tr.global_batch_size // dp if tr.global_batch_size % dp == 0 else 0
    if "micro_batch_size" in fixed or rows == 0:
        micro = [tr.micro_batch_size]
    else:
        micro = [b for b in range(1, rows + 1) if rows % b == 0]
    zeros = [par.zero] if "zero" in fixed or dp * sp == 1 else [0, 1, 2, 3]
    across = par.ranks_per_node and par.ranks_per_node < dp * tp * pp * sp   # several nodes
    reduces = ([par.dp_reduce] if "dp_reduce" in fixed or dp * sp == 1 or not across
               else list(NODE_SPLITS))
    codecs = ([par.grad_compression] if "grad_compression" in fixed or dp * sp == 1
              or not across else list(COMPRESSIONS))

    experts = base.model.moe_experts
    eps = ([par.ep] if "ep" in fixed or not experts else
           [e for e in range(1, dp * sp + 1) if (dp * sp) % e == 0 and experts % e == 0])

    def shared_choices(zero: int) -> list[str]:
        """ZeRO-3 on the CPU: gathered, or in node shared memory."""
        if zero != 3:
            return ["off"]
        if "zero_shared" in fixed or device_of(tr).gpu:
            return [par.zero_shared]
        return list(PLACES)
    for (schedule, v), (mode, split, u), mbs, zero, reduce, codec, ep in itertools.product(
            _schedule_choices(base, pp, fixed), _sp_choices(base, tp, sp, fixed), micro, zeros,
            reduces, codecs, eps):
        # ZeRO-2/3 reduce-scatter dense and flat (fsdp's rule): a variant that clashes only
        # because a free field was varied is no layout; fixed fields that clash are rejected.
        hier, compressed = NODE_SPLITS[reduce], COMPRESSIONS[codec].compresses
        if zero >= 2 and not ("zero" in fixed and (
                hier and "dp_reduce" in fixed or compressed and "grad_compression" in fixed)) \
                and (hier or compressed):
            continue
        for shared in shared_choices(zero):
            yield Config(base.model, dataclasses.replace(
                par, dp=dp, tp=tp, pp=pp, sp=sp, schedule=schedule, virtual_stages=v,
                sp_mode=mode, sp_split=split, ulysses_size=u, zero=zero, zero_shared=shared,
                dp_reduce=reduce, grad_compression=codec, ep=ep),
                dataclasses.replace(tr, micro_batch_size=mbs))


def evaluate(layout: Layout, hw: Hardware = Hardware(),
             documents: StepDocuments | None = None,
             memory_bytes: float | None = None) -> Candidate:
    """Predictions for ``layout``: memory, bytes and wire bytes per link of its worst pipeline
    rank (its first rank on every other axis), on :func:`mpipar.plan.step_time.with_nodes`;
    ``documents``: a step's packed documents (``--document-masking``). When its memory exceeds
    ``memory_bytes`` per rank, the memory alone (the search rejects it on that)."""
    layout = with_nodes(layout, hw, layout.world)
    ranks = planned_ranks(layout, documents)     # each rank's calls listed once, read by all
    memory = max((rank_memory(rank) for rank in ranks), key=lambda x: x.total)
    if memory_bytes is not None and memory.total > memory_bytes:
        return Candidate(layout, memory, {}, None)
    step_bytes: dict[str, int] = {}
    link_bytes: dict[str, dict[str, int]] = {}
    for rank in ranks:
        for g, b in rank_step_bytes(rank).items():
            step_bytes[g] = max(step_bytes.get(g, 0), b)
        for g, links in rank_link_bytes(rank).items():
            worst = link_bytes.setdefault(g, dict.fromkeys(LINKS, 0))
            for link, b in links.items():
                worst[link] = max(worst[link], b)
    return Candidate(layout, memory, step_bytes,
                     predict_step_time(layout, hw, documents, ranks), link_bytes)


def plan_layouts(base: Config, world: int, fixed: set[str] = frozenset(),
                 memory_bytes: float | None = None, hw: Hardware = Hardware(),
                 documents: StepDocuments | None = None) -> Plan:
    """Every layout of ``world`` ranks for ``base``'s model and batch, ranked by predicted step
    time; ``fixed`` names the fields (of [parallel] and [train]) to keep as ``base`` has them.
    For each layout the first recompute mode (none, selective, full) whose memory fits
    ``memory_bytes`` per rank is taken (a fixed ``recompute`` is kept). Layouts that break a
    configuration rule, or whose every variant exceeds the memory, are returned as rejections
    with the reason (the rule's message, or the least memory any variant needs). With
    ``documents`` (``--document-masking``) attention and the ring's traffic are a step's."""
    plan = Plan()
    base = with_nodes(base, hw, world)
    given = {f: getattr(base.parallel, f) for f in SIZE_FIELDS if f in fixed}
    for sizes in _factorisations(world):
        if any(dict(zip(SIZE_FIELDS, sizes))[f] != v for f, v in given.items() if v):
            continue
        errors: list[str] = []
        too_big: list[Candidate] = []
        accepted = 0
        for cfg in _variants(base, sizes, fixed):
            try:
                layout = validate(cfg, world)
            except ConfigError as exc:
                errors.append(str(exc))
                continue
            modes = [layout.train.recompute] if "recompute" in fixed else RECOMPUTE_ORDER
            for mode in modes:
                trial = evaluate(vary(layout, train={"recompute": mode}), hw, documents,
                                 memory_bytes)
                if trial.time is not None:
                    plan.ranked.append(trial)
                    accepted += 1
                    break
            else:
                too_big.append(trial)
        if not accepted:
            plan.rejected += _rejection(sizes, too_big, errors, memory_bytes)
    plan.ranked = rank_ties(plan.ranked)
    return plan


def simplicity(c: Candidate) -> tuple:
    """How much machinery a layout uses, least first: parallel axes beyond dp (tp, pp, sp,
    experts), then the ZeRO stage, node shared memory, recompute, a hierarchical reduction,
    gradient compression, microbatches, virtual stages."""
    par, tr = c.cfg.parallel, c.cfg.train
    reduction = reduction_of(par)
    return (sum(n > 1 for n in (par.tp, par.pp, par.sp, par.ep)), par.tp * par.pp * par.sp,
            par.zero, in_node_memory(par), RECOMPUTE_ORDER.index(tr.recompute),
            reduction.hierarchical, reduction.compression.compresses,
            -tr.micro_batch_size, par.virtual_stages)


def rank_ties(candidates: list[Candidate]) -> list[Candidate]:
    """``candidates`` fastest first, each tie (times within :data:`TIE` of its fastest) in
    order of :func:`simplicity` (then time, then memory), its members' ``tie`` set to the
    tie's rank."""
    by_time = sorted(candidates, key=lambda c: (c.time.total, c.memory.total))
    out: list[Candidate] = []
    while len(out) < len(by_time):
        first = len(out)
        limit = by_time[first].time.total * (1 + TIE)
        last = first
        while last < len(by_time) and by_time[last].time.total <= limit:
            last += 1
        tied = sorted(by_time[first:last],
                      key=lambda c: (simplicity(c), c.time.total, c.memory.total))
        for c in tied:
            c.tie = first + 1 if len(tied) > 1 else 0
        out += tied
    return out


def _rejection(sizes: tuple[int, int, int, int], too_big: list[Candidate], errors: list[str],
               memory_bytes: float | None) -> list[Rejection]:
    """Why no variant of the factorisation ``sizes`` is ranked: the least memory a variant
    needs, else the first rule broken (none when the factorisation had no variant)."""
    label = "dp={} tp={} pp={} sp={}".format(*sizes)
    if too_big:
        least = min(too_big, key=lambda c: c.memory.total)
        return [Rejection(label, (
            f"needs at least {least.memory.total / 2**30:.3g} GiB per rank "
            f"({least.describe()}), more than --memory-gb {memory_bytes / 2**30:g}"))]
    return [Rejection(label, errors[0])] if errors else []


def auto_layout(cfg: Config, world: int, given: set[str]) -> tuple[Config, str | None]:
    """The layout ``python -m mpipar.train`` uses when no parallel size is ``given``: pure data
    parallelism when ``dp = world`` divides the batch; otherwise the fastest layout of
    :func:`plan_layouts` (nominal :class:`Hardware`, so every rank decides the same); otherwise,
    unless the global batch size was given, the batch rounded up to a multiple of the world.
    Returns the config (unresolved) and a note saying what was chosen, or None if nothing
    changed."""
    if set(SIZE_FIELDS) & given:
        return cfg, None
    try:
        validate(cfg, world)
        return cfg, None
    except ConfigError as exc:
        first_error = str(exc)
    fixed = {f.name for sec in (cfg.parallel, cfg.train) for f in dataclasses.fields(sec)}
    fixed -= set(SIZE_FIELDS)
    plan = plan_layouts(cfg, world, fixed)
    if plan.ranked:
        best = plan.ranked[0].cfg.parallel
        out = Config(cfg.model, dataclasses.replace(cfg.parallel, dp=best.dp, tp=best.tp,
                                                    pp=best.pp, sp=best.sp), cfg.train)
        return out, (f"{first_error}; chose dp={best.dp} tp={best.tp} pp={best.pp} sp={best.sp} "
                     f"(the planner's fastest layout; set --dp/--tp/--pp/--sp to choose)")
    if "global_batch_size" in given:
        return cfg, None
    tr = cfg.train
    unit = world * (tr.micro_batch_size or 1)
    batch = -(-tr.global_batch_size // unit) * unit
    out = Config(cfg.model, dataclasses.replace(cfg.parallel, dp=world),
                 dataclasses.replace(tr, global_batch_size=batch))
    return out, (f"{first_error}; no layout of {world} ranks fits global_batch_size="
                 f"{tr.global_batch_size}, so it is {batch} (dp={world}); set "
                 f"--global-batch-size to choose")
