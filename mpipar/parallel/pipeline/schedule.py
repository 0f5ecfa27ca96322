"""Pipeline-parallel schedules as data, and a serial dry run that proves them deadlock-free.

Model of the pipeline: ``p`` pipeline ranks, ``m`` microbatches, ``v`` model chunks (virtual stages)
per rank. Placement is Megatron's interleaved one: virtual stage ``s = chunk * p + rank``, so rank
``r`` holds chunks ``r, r + p, r + 2p, ...`` of the ``S = v * p`` stages. Stage 0 embeds, stage
``S - 1`` computes the loss. Forward of ``(mb, s)`` needs the activation of ``(mb, s - 1)``; the
backward of ``(mb, s)`` needs the gradient from ``(mb, s + 1)`` and its own forward; at ``s = S - 1``
the backward follows its own forward directly.

A schedule is ``list[list[Op]]``: one op list per pipeline rank, executed in order. For ``p > 1``
consecutive stages always sit on different ranks, so every stage boundary is an explicit message: a
``recv_*`` op comes right before the compute op that consumes it and a ``send_*`` op right after the
compute op that produced it. For ``p == 1`` nothing moves between ranks and there are no messages
(chunk ``c``'s output feeds chunk ``c + 1`` in place). The executor posts sends non-blocking and
receives blocking; :func:`dry_run` replays exactly those semantics in virtual time, so a schedule is
deadlock-free for the executor iff its dry run completes.

Messages are matched by identity, not by order: :func:`message_key` names a message by
``(channel, microbatch, sending virtual stage)`` and :func:`message_tag` turns it into an MPI tag
that is unique between any pair of ranks.

A *forward-only* schedule (:func:`forward_only`: evaluation, generation) keeps a training
schedule's forwards and their messages, in the same order; nothing is kept for a backward.
``dry_run(..., forward_only=True)`` proves it deadlock-free and complete (one forward of every
``(microbatch, virtual stage)``, no backward).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

COMPUTE_KINDS = ("fwd", "bwd", "bwd_input", "bwd_weight")
MESSAGE_KINDS = ("send_fwd", "recv_fwd", "send_bwd", "recv_bwd")
OP_KINDS = COMPUTE_KINDS + MESSAGE_KINDS
FORWARD_KINDS = ("fwd", "send_fwd", "recv_fwd")  # the ops of a forward-only schedule
_GRAD_PRODUCERS = ("bwd", "bwd_input")  # compute ops that produce the input gradient of a stage


class ScheduleError(ValueError):
    """A schedule breaks a rule of the data format, or cannot finish (deadlock)."""


@dataclass(frozen=True)
class Op:
    """One step of one pipeline rank.

    ``kind``: ``fwd``; ``bwd`` (input and weight gradients); ``bwd_input`` (input gradient only, on
    the critical path); ``bwd_weight`` (weight gradient only, after the ``bwd_input`` of the same
    ``(microbatch, chunk)``); ``send_fwd`` / ``recv_fwd`` (activation to the next stage / from the
    previous one); ``send_bwd`` / ``recv_bwd`` (input gradient to the previous stage / from the
    next one). ``chunk`` is the local model chunk ``0..v-1`` on this rank: the producing chunk for a
    send, the consuming chunk for a receive. ``peer`` is the pipeline rank on the other side of a
    send or receive and ``None`` for compute ops.
    """

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"Op kind {self.kind!r} is unknown; it must be one of {OP_KINDS}")

    def __str__(self) -> str:
        peer = "" if self.peer is None else f", peer={self.peer}"
        return f"{self.kind}(mb={self.microbatch}, chunk={self.chunk}{peer})"


@dataclass
class DryRunResult:
    """Outcome of :func:`dry_run`.

    ``makespan``: virtual time at which the last rank finishes (all ranks start at 0).
    ``bubble_fraction``: idle compute time / (p * makespan); time spent waiting in a receive or
    communicating counts as idle. ``timeline[rank]``: ``(start, end, op)`` for every op of the rank in
    execution order; a send is posted at an instant (``start == end``), a receive spans from the
    moment the rank reaches it to the arrival of its message. ``peak_activations[rank]``: the largest
    number of ``(microbatch, chunk)`` pairs whose forward has run and whose ``bwd`` (or
    ``bwd_weight``) has not, i.e. activation memory in flight, in units of one microbatch-chunk.
    """

    makespan: float
    bubble_fraction: float
    timeline: list[list[tuple[float, float, Op]]]
    peak_activations: list[int]


def virtual_stage(rank: int, chunk: int, p: int) -> int:
    """Global virtual stage of local ``chunk`` on pipeline ``rank``: ``chunk * p + rank``."""
    return chunk * p + rank


def stage_owner(stage: int, p: int) -> tuple[int, int]:
    """``(rank, chunk)`` holding global virtual stage ``stage``."""
    return stage % p, stage // p


def message_key(op: Op, rank: int, p: int) -> tuple[str, int, int]:
    """Identity ``(channel, microbatch, sending virtual stage)`` of the message ``op`` sends or receives.

    ``channel`` is ``"fwd"`` (activation, stage s -> s + 1) or ``"bwd"`` (gradient, s -> s - 1). A send
    and the receive that matches it have the same key.
    """
    s = virtual_stage(rank, op.chunk, p)
    if op.kind == "send_fwd":
        return "fwd", op.microbatch, s
    if op.kind == "recv_fwd":
        return "fwd", op.microbatch, s - 1
    if op.kind == "send_bwd":
        return "bwd", op.microbatch, s
    if op.kind == "recv_bwd":
        return "bwd", op.microbatch, s + 1
    raise ValueError(f"op {op} is a compute op; only send_*/recv_* ops carry a message")


def message_tag(op: Op, rank: int, p: int, v: int) -> int:
    """MPI tag of the message of ``op``: ``(microbatch * v + sending chunk) * 2 + (channel == "bwd")``.

    Unique among the messages between any ordered pair of ranks, and below ``2 * m * v``.
    """
    channel, microbatch, sender = message_key(op, rank, p)
    return (microbatch * v + sender // p) * 2 + int(channel == "bwd")


def _check_sizes(p: int, m: int, v: int) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1")


def _with_messages(rank: int, p: int, v: int, steps: list[tuple[str, int, int]]) -> list[Op]:
    """Turn a rank's compute order ``[(kind, microbatch, chunk)]`` into ops with their messages."""
    last = v * p - 1
    nxt, prev = (rank + 1) % p, (rank - 1) % p
    ops: list[Op] = []
    for kind, mb, chunk in steps:
        s = virtual_stage(rank, chunk, p)
        if p > 1 and kind == "fwd" and s > 0:
            ops.append(Op("recv_fwd", mb, chunk, prev))
        if p > 1 and kind in _GRAD_PRODUCERS and s < last:
            ops.append(Op("recv_bwd", mb, chunk, nxt))
        ops.append(Op(kind, mb, chunk))
        if p > 1 and kind == "fwd" and s < last:
            ops.append(Op("send_fwd", mb, chunk, nxt))
        if p > 1 and kind in _GRAD_PRODUCERS and s > 0:
            ops.append(Op("send_bwd", mb, chunk, prev))
    return ops


def _gpipe_steps(m: int) -> list[tuple[str, int, int]]:
    """All forwards, then all backwards in reverse microbatch order."""
    return [("fwd", mb, 0) for mb in range(m)] + [("bwd", mb, 0) for mb in reversed(range(m))]


def _one_f_one_b_steps(rank: int, p: int, m: int) -> list[tuple[str, int, int]]:
    """Warm-up of ``min(p - rank - 1, m)`` forwards, then one forward / one backward, then cool-down."""
    warmup = min(p - rank - 1, m)
    steps = [("fwd", mb, 0) for mb in range(warmup)]
    for i in range(m):
        if i + warmup < m:
            steps.append(("fwd", i + warmup, 0))
        steps.append(("bwd", i, 0))
    return steps


def _zb_h1_steps(rank: int, p: int, m: int) -> list[tuple[str, int, int]]:
    """ZB-H1 (Qi et al. 2023): the 1F1B order of forwards and ``bwd_input``, ``bwd_weight`` deferred.

    Rank ``r`` runs the ``bwd_weight`` of microbatch ``i - r`` right after the ``bwd_input`` of
    microbatch ``i``, and the last ``r`` weight gradients at the end. The input-gradient wave then
    travels back at the speed of ``bwd_input`` alone and the deferred weight gradients fill the
    cool-down. Every rank holds ``min(m, p)`` microbatches in flight at its peak: the peak of 1F1B,
    which 1F1B reaches on rank 0 only (the paper's "same number of in-flight microbatches on every
    stage"; a ``bwd_weight`` keeps less activation memory alive than a full backward).
    """
    warmup = min(p - rank - 1, m)
    steps = [("fwd", mb, 0) for mb in range(warmup)]
    for i in range(m):
        if i + warmup < m:
            steps.append(("fwd", i + warmup, 0))
        steps.append(("bwd_input", i, 0))
        if i >= rank:
            steps.append(("bwd_weight", i - rank, 0))
    return steps + [("bwd_weight", mb, 0) for mb in range(max(0, m - rank), m)]


def interleaved_groups(p: int, m: int) -> list[int]:
    """Sizes of the microbatch groups of the interleaved schedule, in order.

    ``p`` divides ``m``: ``m / p`` groups of ``p`` (Megatron). Otherwise ``max(1, m // p)`` groups whose
    sizes differ by at most one, larger first, so every group has between ``p`` and ``2p - 1``
    microbatches when ``m >= p`` (a group shorter than ``p`` would leave rank 0 waiting for its own
    microbatches to come round the ring), and a single group of ``m`` when ``m < p``.
    """
    count = max(1, m // p)
    base, extra = divmod(m, count)
    return [base + 1] * extra + [base] * (count - extra)


def _interleaved_steps(rank: int, p: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Megatron interleaved 1F1B over ``v`` chunks.

    Within a group of microbatches (:func:`interleaved_groups`) the forwards run chunk 0 for every
    microbatch of the group, then chunk 1, ..., and the backwards run chunk ``v - 1`` first. Every rank
    uses the same forward and backward orders; rank ``r`` runs ``(v - 1) * g + 2 * (p - r - 1)`` warm-up
    forwards (``g`` the first group's size; all forwards if fewer), then alternates one forward and one
    backward, then drains the backwards. The doubled ``p - r - 1`` term is Megatron's: with free
    messages ``p - r - 1`` would give the same bubble, but the extra forwards hide message latency.
    """
    forwards: list[tuple[int, int]] = []
    backwards: list[tuple[int, int]] = []
    first = 0
    groups = interleaved_groups(p, m)
    for size in groups:
        group = range(first, first + size)
        forwards += [(mb, c) for c in range(v) for mb in group]
        backwards += [(mb, c) for c in reversed(range(v)) for mb in group]
        first += size
    total = m * v
    warmup = min(total, (v - 1) * groups[0] + 2 * (p - rank - 1))
    steps = [("fwd", mb, c) for mb, c in forwards[:warmup]]
    for k in range(total - warmup):
        steps += [("fwd", *forwards[warmup + k]), ("bwd", *backwards[k])]
    return steps + [("bwd", mb, c) for mb, c in backwards[total - warmup:]]


@dataclass(frozen=True)
class Schedule:
    """One ``--schedule``: its name (what configuration files say), the compute steps of each
    rank (``steps(rank, p, m, v)``: ``(kind, microbatch, chunk)`` in order), whether it runs
    ``v >= 2`` virtual stages a rank (``interleaved``; the others take ``v == 1``), and whether
    it defers the weight gradients to ``bwd_weight`` ops (``defers_weights``: a gradient is final
    once a chunk's deferred weights have run, not after each block)."""

    name: str
    steps: Callable[[int, int, int, int], list[tuple[str, int, int]]]
    interleaved: bool = False
    defers_weights: bool = False

    def __repr__(self) -> str:
        return f"<schedule {self.name}>"


GPIPE = Schedule("gpipe", lambda rank, p, m, v: _gpipe_steps(m))
ONE_F_ONE_B = Schedule("1f1b", lambda rank, p, m, v: _one_f_one_b_steps(rank, p, m))
INTERLEAVED = Schedule("interleaved", _interleaved_steps, interleaved=True)
ZB_H1 = Schedule("zb-h1", lambda rank, p, m, v: _zb_h1_steps(rank, p, m), defers_weights=True)

SCHEDULE_MODES: dict[str, Schedule] = {s.name: s for s in (GPIPE, ONE_F_ONE_B, INTERLEAVED,
                                                              ZB_H1)}
"""Every ``--schedule``, by name: adding one is its steps and one line here."""
SCHEDULES = tuple(SCHEDULE_MODES)


def schedule_of(par: Any) -> Schedule:
    """The schedule object of a parallel configuration's ``schedule``."""
    return SCHEDULE_MODES[par.schedule]


def forward_only(schedule: list[list[Op]]) -> list[list[Op]]:
    """The forward ops of ``schedule`` and their messages (``fwd``, ``send_fwd``, ``recv_fwd``),
    in each rank's order: the walk of evaluation and generation, which keep nothing for a
    backward. A rank's forwards keep their relative order, so every receive still follows the
    send it waits for; :func:`dry_run` with ``forward_only=True`` proves it."""
    return [[op for op in ops if op.kind in FORWARD_KINDS] for ops in schedule]


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Op]]:
    """Op lists, one per pipeline rank, of schedule ``name`` for ``p`` ranks, ``m`` microbatches and ``v``
    model chunks per rank.

    ``gpipe``, ``1f1b`` and ``zb-h1`` take ``v == 1``; ``interleaved`` takes ``v >= 2``. Every ``p, m >= 1``
    is supported, including ``m`` not divisible by ``p`` (see :func:`interleaved_groups`).

    Bubble fractions under :func:`dry_run` with ``cost_fwd = cost_bwd_input = cost_bwd_weight = 1`` and
    free messages (a full backward costs 2), each asserted by the tests:

    - ``gpipe``, ``1f1b``: ``(p-1) / (m+p-1)`` (makespan ``3 (m+p-1)``);
    - ``interleaved``: ``(p-1) / (v m + p-1)`` for ``m >= p`` (makespan ``3 (v m + p-1)``); for ``m < p``
      a chunk's forwards wait for the microbatches to come round the ring, makespan ``3 (v p + m-1)``
      and bubble ``(v (p-m) + m-1) / (v p + m-1)``;
    - ``zb-h1``: ``(p-1) / (3m + p-1)`` for ``m >= p``, a third of the 1F1B bubble time: every rank
      idles ``p-1`` before its first ``bwd_input`` (``r`` before its first forward, ``p-1-r`` waiting
      for the gradient wave, which moves one ``bwd_input`` per hop) and is busy from then on. For
      ``m < p`` the last stage alternates forward and ``bwd_input``, gradients reach rank 0 two units
      apart from ``2p - 1`` on, and rank 0 ends with one ``bwd_weight``: makespan ``2m + 2p - 1``,
      bubble ``(2p-1-m) / (2m+2p-1)``.
    """
    schedule = SCHEDULE_MODES.get(name)
    if schedule is None:
        raise ValueError(f"schedule name {name!r} is unknown; it must be one of {SCHEDULES}")
    _check_sizes(p, m, v)
    if schedule.interleaved and v < 2:
        raise ValueError(f"v={v} is invalid for {name!r}: it needs v >= 2 model chunks per rank")
    if not schedule.interleaved and v != 1:
        raise ValueError(f"v={v} is invalid for {name!r}: only 'interleaved' takes v > 1")
    return [_with_messages(rank, p, v, schedule.steps(rank, p, m, v)) for rank in range(p)]


class _RankState:
    """What one rank has done so far in a dry run; ``keeps``: whether a forward keeps its
    activations until its backward (False for a forward-only schedule)."""

    def __init__(self, keeps: bool = True) -> None:
        self.done: set[tuple[str, int, int]] = set()  # (kind, microbatch, stage) of compute ops run
        self.received: set[tuple[str, int, int]] = set()  # (channel, microbatch, receiving stage)
        self.keeps = keeps
        self.in_flight = 0
        self.peak = 0


def _has_grad(state: _RankState, mb: int, s: int) -> bool:
    return any((kind, mb, s) in state.done for kind in _GRAD_PRODUCERS)


def _check_op(op: Op, rank: int, index: int, ops: list[Op], p: int, m: int, v: int) -> None:
    """Static rules of one op: ranges, peers, and the recv-before / send-after placement."""
    where = f"rank {rank} op #{index} {op}"
    if isinstance(op.microbatch, bool) or not isinstance(op.microbatch, int) or not 0 <= op.microbatch < m:
        raise ScheduleError(f"{where}: microbatch must be an integer in 0..{m - 1}")
    if isinstance(op.chunk, bool) or not isinstance(op.chunk, int) or not 0 <= op.chunk < v:
        raise ScheduleError(f"{where}: chunk must be an integer in 0..{v - 1}")
    if op.kind in COMPUTE_KINDS:
        if op.peer is not None:
            raise ScheduleError(f"{where}: a compute op must have peer=None")
        return
    if p == 1:
        raise ScheduleError(f"{where}: with p=1 every stage is on rank 0 and no message may be sent")
    s = virtual_stage(rank, op.chunk, p)
    other = s + 1 if op.kind in ("send_fwd", "recv_bwd") else s - 1
    if not 0 <= other < v * p:
        raise ScheduleError(f"{where}: virtual stage {s} has no neighbour stage {other} to exchange with")
    expected_peer = stage_owner(other, p)[0]
    if op.peer != expected_peer:
        raise ScheduleError(f"{where}: peer must be rank {expected_peer}, which holds virtual stage {other}")
    if op.kind.startswith("recv"):
        consumers = ("fwd",) if op.kind == "recv_fwd" else _GRAD_PRODUCERS
        follow = ops[index + 1] if index + 1 < len(ops) else None
        if follow is None or follow.kind not in consumers or (follow.microbatch, follow.chunk) != (
            op.microbatch,
            op.chunk,
        ):
            raise ScheduleError(f"{where}: a receive must come right before the {'/'.join(consumers)} of "
                                f"microbatch {op.microbatch}, chunk {op.chunk} that consumes it")
    else:
        producers = ("fwd",) if op.kind == "send_fwd" else _GRAD_PRODUCERS
        before = ops[index - 1] if index > 0 else None
        if before is None or before.kind not in producers or (before.microbatch, before.chunk) != (
            op.microbatch,
            op.chunk,
        ):
            raise ScheduleError(f"{where}: a send must come right after the {'/'.join(producers)} of "
                                f"microbatch {op.microbatch}, chunk {op.chunk} that produced it")


def _check_messages(schedule: list[list[Op]], p: int) -> None:
    """Every send has exactly one matching receive and vice versa."""
    sends: dict[tuple[str, int, int], str] = {}
    recvs: dict[tuple[str, int, int], str] = {}
    for rank, ops in enumerate(schedule):
        for index, op in enumerate(ops):
            if op.kind in COMPUTE_KINDS:
                continue
            table = sends if op.kind.startswith("send") else recvs
            key = message_key(op, rank, p)
            where = f"rank {rank} op #{index} {op}"
            if key in table:
                raise ScheduleError(f"{where}: duplicates {table[key]} (message {key})")
            table[key] = where
    for key in sends.keys() - recvs.keys():
        raise ScheduleError(f"{sends[key]}: no receive matches this send (message {key})")
    for key in recvs.keys() - sends.keys():
        raise ScheduleError(f"{recvs[key]}: no send matches this receive (message {key})")


def _run_compute(op: Op, state: _RankState, s: int, last: int, p: int, where: str) -> None:
    """Check the inputs of a compute op and record it; raise ScheduleError on a broken dependency."""
    mb = op.microbatch
    done = state.done
    if op.kind == "fwd":
        if ("fwd", mb, s) in done:
            raise ScheduleError(f"{where}: second forward of microbatch {mb}, virtual stage {s}")
        if s > 0:
            ready = ("fwd", mb, s - 1) in done if p == 1 else ("fwd", mb, s) in state.received
            if not ready:
                raise ScheduleError(f"{where}: the activation from virtual stage {s - 1} is not available")
        state.in_flight += int(state.keeps)
        state.peak = max(state.peak, state.in_flight)
    elif op.kind in _GRAD_PRODUCERS:
        if any((kind, mb, s) in done for kind in _GRAD_PRODUCERS):
            raise ScheduleError(f"{where}: second backward of microbatch {mb}, virtual stage {s}")
        if ("fwd", mb, s) not in done:
            raise ScheduleError(f"{where}: runs before the forward of microbatch {mb}, virtual stage {s}")
        if s < last:
            ready = _has_grad(state, mb, s + 1) if p == 1 else ("bwd", mb, s) in state.received
            if not ready:
                raise ScheduleError(f"{where}: the gradient from virtual stage {s + 1} is not available")
        if op.kind == "bwd":
            state.in_flight -= 1
    else:  # bwd_weight
        if ("bwd_weight", mb, s) in done:
            raise ScheduleError(f"{where}: second bwd_weight of microbatch {mb}, virtual stage {s}")
        if ("bwd_input", mb, s) not in done:
            raise ScheduleError(f"{where}: needs the bwd_input of microbatch {mb}, virtual stage {s} first")
        state.in_flight -= 1
    done.add((op.kind, mb, s))


def _check_complete(states: list[_RankState], p: int, m: int, v: int,
                    forward_only: bool = False) -> None:
    """Every (microbatch, stage) ran one forward and one backward (or one bwd_input + one
    bwd_weight); with ``forward_only``, one forward and nothing else."""
    for s in range(v * p):
        rank, chunk = stage_owner(s, p)
        done = states[rank].done
        for mb in range(m):
            where = f"rank {rank}, microbatch {mb}, chunk {chunk} (virtual stage {s})"
            if ("fwd", mb, s) not in done:
                raise ScheduleError(f"{where}: the forward is missing")
            if forward_only:
                continue
            if ("bwd_input", mb, s) in done and ("bwd_weight", mb, s) not in done:
                raise ScheduleError(f"{where}: bwd_input ran but its bwd_weight is missing")
            if not _has_grad(states[rank], mb, s):
                raise ScheduleError(f"{where}: the backward is missing")


def dry_run(
    schedule: list[list[Op]],
    p: int,
    m: int,
    v: int = 1,
    cost_fwd: float = 1.0,
    cost_bwd_input: float = 1.0,
    cost_bwd_weight: float = 1.0,
    cost_comm: float = 0.0,
    forward_only: bool = False,
) -> DryRunResult:
    """Run every rank's op list serially in virtual time and verify the schedule.

    Event-driven: each rank runs its next op as soon as its inputs are available. Compute ops take
    ``cost_fwd``, ``cost_bwd_input``, ``cost_bwd_weight`` or (``bwd``) their sum on the rank's clock. A
    send is posted without blocking; its message arrives ``cost_comm`` later; a receive blocks and
    completes at ``max(rank clock, send time + cost_comm)``. Verifies the format (ranges, peers,
    placement of messages), that every send has exactly one matching receive, every dependency,
    and that each ``(microbatch, virtual stage)`` has exactly one forward and one backward (or one
    ``bwd_input`` and one ``bwd_weight``); with ``forward_only`` (:func:`forward_only`), exactly one
    forward, no backward op, and nothing kept in flight. Raises ScheduleError naming the stuck op
    of every rank on a deadlock, or the offending op on a broken rule.
    """
    _check_sizes(p, m, v)
    for name, cost in (("cost_fwd", cost_fwd), ("cost_bwd_input", cost_bwd_input),
                       ("cost_bwd_weight", cost_bwd_weight), ("cost_comm", cost_comm)):
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(f"{name}={cost!r} is invalid: it must be finite and >= 0")
    _check_format(schedule, p, m, v, forward_only)
    cost = {"fwd": cost_fwd, "bwd": cost_bwd_input + cost_bwd_weight, "bwd_input": cost_bwd_input,
            "bwd_weight": cost_bwd_weight}
    replay = _Replay(schedule, p, v, forward_only)
    replay.run(cost, cost_comm)
    _check_complete(replay.states, p, m, v, forward_only)

    makespan = max(replay.clock)
    busy = sum(end - start for ops in replay.timeline for start, end, op in ops
               if op.kind in COMPUTE_KINDS)
    bubble = (p * makespan - busy) / (p * makespan) if makespan > 0 else 0.0
    return DryRunResult(makespan, bubble, replay.timeline, [state.peak for state in replay.states])


def _check_format(schedule: list[list[Op]], p: int, m: int, v: int, forward_only: bool) -> None:
    """The static rules of a schedule: one op list per rank, each op's (:func:`_check_op`),
    only forward ops in a forward-only one, and every message matched (:func:`_check_messages`)."""
    if len(schedule) != p:
        raise ScheduleError(f"the schedule has {len(schedule)} op lists; it must have one per rank, p={p}")
    for rank, ops in enumerate(schedule):
        for index, op in enumerate(ops):
            if forward_only and op.kind not in FORWARD_KINDS:
                raise ScheduleError(f"rank {rank} op #{index} {op}: a forward-only schedule holds "
                                    f"only {', '.join(FORWARD_KINDS)} ops")
            _check_op(op, rank, index, ops, p, m, v)
    _check_messages(schedule, p)


class _Replay:
    """The virtual-time walk of :func:`dry_run`: each rank's clock, position in its op list,
    :class:`_RankState` and timeline, and when each message was sent."""

    def __init__(self, schedule: list[list[Op]], p: int, v: int, forward_only: bool) -> None:
        self.schedule, self.p, self.last = schedule, p, v * p - 1
        self.states = [_RankState(keeps=not forward_only) for _ in range(p)]
        self.clock = [0.0] * p
        self.position = [0] * p
        self.sent_at: dict[tuple[str, int, int], float] = {}
        self.timeline: list[list[tuple[float, float, Op]]] = [[] for _ in range(p)]

    def run(self, cost: dict[str, float], cost_comm: float) -> None:
        """Advance every rank as far as its inputs allow, until none can; ScheduleError on a
        deadlock (:meth:`_deadlock`) or a broken dependency."""
        progress = True
        while progress:
            progress = False
            for rank, ops in enumerate(self.schedule):
                while self.position[rank] < len(ops) and self._step(rank, cost, cost_comm):
                    progress = True
        if any(self.position[rank] < len(ops) for rank, ops in enumerate(self.schedule)):
            raise self._deadlock()

    def _step(self, rank: int, cost: dict[str, float], cost_comm: float) -> bool:
        """Run ``rank``'s next op; False if it is a receive whose message was not sent yet."""
        p, state = self.p, self.states[rank]
        op = self.schedule[rank][self.position[rank]]
        where = f"rank {rank} op #{self.position[rank]} {op}"
        s = virtual_stage(rank, op.chunk, p)
        start = self.clock[rank]
        if op.kind in COMPUTE_KINDS:
            _run_compute(op, state, s, self.last, p, where)
            end = start + cost[op.kind]
        elif op.kind.startswith("send"):
            produced = ("fwd", op.microbatch, s) in state.done if op.kind == "send_fwd" \
                else _has_grad(state, op.microbatch, s)
            if not produced:
                raise ScheduleError(f"{where}: sends data its rank has not computed yet")
            self.sent_at[message_key(op, rank, p)] = start
            end = start
        else:
            key = message_key(op, rank, p)
            if key not in self.sent_at:
                return False
            end = max(start, self.sent_at[key] + cost_comm)
            state.received.add((key[0], op.microbatch, s))
        self.timeline[rank].append((start, end, op))
        self.clock[rank] = end
        self.position[rank] += 1
        return True

    def _deadlock(self) -> ScheduleError:
        """The error naming what every rank waits for, when none can proceed."""
        stuck = []
        for rank, ops in enumerate(self.schedule):
            if self.position[rank] == len(ops):
                stuck.append(f"rank {rank}: finished")
                continue
            op = ops[self.position[rank]]
            channel, mb, sender = message_key(op, rank, self.p)
            stuck.append(f"rank {rank}: op #{self.position[rank]} {op} waits for send_{channel} of "
                         f"microbatch {mb} from rank {stage_owner(sender, self.p)[0]} (virtual "
                         f"stage {sender})")
        return ScheduleError("deadlock: no rank can proceed; " + "; ".join(stuck))
