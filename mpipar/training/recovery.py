"""What a run does when one of its ranks dies: ``--on-rank-failure abort|shrink``.

The mode is an object (:func:`on_rank_failure`):

- :class:`Abort` (the default): nothing is caught; the launcher ends the job, the watchdog and
  the failure report (:mod:`mpipar.training.failure`) make that clean.
- :class:`Shrink`: under an MPI with ULFM (:func:`mpipar.runtime.ulfm.unsupported` says why
  not, and start-up refuses the mode then, exit 2) the training loop hands an MPI error of a
  dead or revoked process (any collective or point-to-point of a step, its telemetry or a
  periodic checkpoint; any MPI error, as a dead peer may surface under another class) to
  :meth:`Shrink.recover`, which

  1. revokes the world and every communicator of the rank, so no survivor stays blocked;
  2. shrinks the world to the survivors (:func:`mpipar.runtime.ulfm.shrink`: they agree on who
     is gone; nobody gone: the error was another, and is raised);
  3. agrees on the state to go on from: the start of the earliest step any survivor had in
     flight, from memory when every survivor holds a copy of it, else the last committed
     checkpoint of ``--save-dir``; with neither, the run ends with the failure report;
  4. resolves the layout of the smaller world (the program's ``relayout``: dp shrunk, tp, pp,
     sp and ep kept, else the planner's best valid layout; the global batch is kept, so each
     replica runs more microbatches) and builds the rank on it with
     :func:`mpipar.training.rank.build_rank`, the call of start-up (the peak-FLOP/s probe of
     start-up is kept: :class:`mpipar.training.loop.RunContext`'s ``peak_rate``);
  5. loads that state into it; the loop then redoes the steps after it, so every number equals
     an uninterrupted run's up to the order of the reductions.

A rank declared failed by the heartbeat detector (silent, not dead: :mod:`mpipar.runtime.ulfm`)
is killed after the shrink by the first survivor on its node (:meth:`Shrink.start` notes where
every rank runs). The ``recovered`` record names the failed ranks, the step in flight, the
state's step and source, the steps redone, the worlds and layouts before and after and the flags
of the new one; the loop adds the seconds, and the summary, the report and the trace show it.
What the loop recovers from (its steps, evaluations and saves, and the commit and last save
after it) and what ends the job instead (start-up, after the last save, a failure during a
recovery) is :func:`mpipar.training.loop.run`'s.

The copy in memory (:class:`StateCopy`) is taken at the start of each step where every rank
holds the whole training state (dp replicas: tp = pp = 1, ZeRO-0, experts not sharded, no
error-feedback residuals): the master weights and AdamW's moments, as global tensors, the
routing biases; the last two steps' copies are kept (a survivor may be one step ahead of
another when the failure reaches them). It costs three copies of the parameters per copy kept,
and a copy of them a step. With ``--state-copies 1`` every layout keeps its shares on partner
ranks instead (:mod:`mpipar.training.state_copies`): the survivors pool the last step every one
of them holds, when every lost rank's partner survived. Otherwise the last checkpoint.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mpipar.config import ConfigError
from mpipar.layout import Layout
from mpipar.model.lora import Lora
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.parallel.data_parallel.reducer import GradReducer
from mpipar.runtime import ulfm
from mpipar.runtime.comm import Group, Ledger
from mpipar.runtime.device import to_host
from mpipar.training.optim import IDLE, AdamW
from mpipar.training.optimizers import optimizer_mode
from mpipar.training.rank import Rank, build_rank
from mpipar.training.state_copies import GROUP as COPY_GROUP
from mpipar.training.state_copies import StateCopies, assemble, recoverable
from mpipar.training.step import close

MODES = ("abort", "shrink")
COPIES_KEPT = 2


class Unrecoverable(RuntimeError):
    """The survivors cannot go on (no layout of the smaller world, no consistent state)."""


@dataclass(frozen=True)
class Recovered:
    """A rank rebuilt on the smaller world: the rank, the world's control group, the step its
    state holds (the loop trains from there), the ``recovered`` record of the next step
    (``seconds`` filled in when it starts) and the survivors' node names by new rank (empty
    when unknown)."""
    rank: Rank
    control: Group
    start: int
    record: dict[str, Any]
    detected: float          # time.perf_counter() when the failure was seen
    nodes: tuple[str, ...] = ()


class Abort:
    """``--on-rank-failure abort``: a dead rank ends the job (module docstring)."""

    name = "abort"
    survivable: tuple[type[BaseException], ...] = ()

    def refusal(self) -> str | None:
        return None

    def start(self, control: Group) -> None:
        pass

    def before_step(self, rank: Rank, step: int) -> None:
        pass


class StateCopy:
    """The whole training state of a rank that holds all of it, as global tensors on the host
    (a :data:`mpipar.checkpoint.shards.Reader` reads regions of it), with the routing biases
    and a DPO run's reference log-probabilities (None before step 0 computes them)."""

    def __init__(self, rank: Rank) -> None:
        state, reducer, opt = rank.state, rank.weights.reducer, rank.weights.optimizer
        masters = reducer.master_tensors()
        kinds = [("param", masters), ("exp_avg", opt.m), ("exp_avg_sq", opt.v)]
        if opt.idle:
            kinds.append((IDLE, opt.idle))
        self.tensors: dict[tuple[str, str], np.ndarray] = {}
        for kind, arrays in kinds:
            for name, local in arrays.items():
                glob, loc = state.region(name)
                self.tensors[kind, name] = np.array(to_host(local)[loc])
        self.kinds = {kind for kind, _ in kinds[3:]}
        self.step = state.step
        self.moe_bias = {k: np.array(v) for k, v in rank.model.routing.host().items()}
        pref = rank.data.preference
        self.dpo_reference = (None if pref is None or pref.reference is None
                              else np.array(pref.reference))

    @staticmethod
    def holds_everything(rank: Rank) -> bool:
        """Whether this rank holds the whole training state (module docstring)."""
        lay, w = rank.layout, rank.weights
        return (lay.tp == 1 and lay.pp == 1 and lay.parallel.ep == 1
                and isinstance(w.optimizer, AdamW) and isinstance(w.reducer, GradReducer)
                and not w.reducer.feedback)

    @classmethod
    def pooled(cls, tensors: dict, kinds: set[str], step: int, moe_bias: dict,
               dpo_reference) -> "StateCopy":
        """The state the survivors pooled from their shares and the copies of the lost ones
        (:func:`mpipar.training.state_copies.assemble`)."""
        copy = cls.__new__(cls)
        copy.tensors, copy.kinds, copy.step = tensors, kinds, step
        copy.moe_bias, copy.dpo_reference = moe_bias, dpo_reference
        return copy

    def read(self, kind: str, name: str, region) -> np.ndarray:
        return self.tensors[kind, name][region]

    def load(self, rank: Rank) -> None:
        """Set ``rank`` (any layout) from this copy (collective-free)."""
        rank.state.load(self.read, self.step, self.kinds)
        rank.model.routing.load(self.moe_bias)
        if rank.data.preference is not None:
            rank.data.preference.load(self.dpo_reference, self.step)


class Shrink:
    """``--on-rank-failure shrink`` (module docstring). ``relayout(layout, world)``: the layout
    of the smaller world, or ConfigError when none fits."""

    name = "shrink"

    def __init__(self, relayout: Callable[[Layout, int], Layout], save_dir: str,
                 state_copies: int = 0) -> None:
        self.relayout, self.save_dir, self.state_copies = relayout, save_dir, state_copies
        self.in_flight = 0
        self.copies: dict[int, StateCopy] = {}
        self.peers: list[tuple[str, int]] = []   # every rank's (node, process id)
        self.control: Group | None = None
        self.shares: StateCopies | None = None   # --state-copies 1

    def start(self, control: Group) -> None:
        """Before the first step (a collective): note where every rank runs, to fence the
        ranks declared failed (:func:`mpipar.runtime.ulfm.fence`) and to place the state
        copies."""
        self.peers = ulfm.peers(control.comm)
        self.control = control

    @property
    def survivable(self) -> tuple[type[BaseException], ...]:
        return (ulfm.error_type(),)

    def refusal(self) -> str | None:
        """Why this MPI cannot run the mode (None: it can)."""
        reason = ulfm.unsupported()
        if reason is None:
            return None
        return (f"--on-rank-failure shrink needs an MPI with ULFM: {reason}; or run with "
                f"--on-rank-failure abort")

    def before_step(self, rank: Rank, step: int) -> None:
        """Step ``step`` (0-based) begins: copy the state it starts from, when this rank holds
        all of it; with ``--state-copies 1``, swap this rank's share with its partners (booked
        in the rank's ledger, group ``copy``)."""
        self.in_flight = step
        if self.state_copies:
            if self.shares is None or self.shares.group.ledger is not rank.ledger:
                names = [node for node, _ in self.peers]
                nodes = [names.index(n) for n in names]
                self.shares = StateCopies(Group(self.control.comm, COPY_GROUP, rank.ledger,
                                                nodes), nodes, COPIES_KEPT)
            self.shares.refresh(rank, step)
        elif StateCopy.holds_everything(rank) and step not in self.copies:
            self.copies[step] = StateCopy(rank)
            for old in sorted(self.copies)[:-COPIES_KEPT]:
                del self.copies[old]

    def recover(self, rank: Rank, control: Group, exc: BaseException) -> Recovered:
        """The rank rebuilt on the survivors (module docstring). Any MPI error starts it (a
        dead peer may surface as another class, e.g. through a non-blocking collective's
        schedule); ``exc`` is re-raised when the shrink finds nobody gone. Raises
        :class:`Unrecoverable` when the survivors cannot go on."""
        detected = time.perf_counter()
        old = [control.comm, *(g.comm for g in rank.comms.groups.values()),
               *rank.comms.grid.comms.values()]
        ulfm.revoke(old)
        comm, failed = ulfm.shrink(control.comm)
        if not failed:
            raise exc
        if self.peers:
            ulfm.fence(failed, self.peers, control.rank)
            self.peers = [p for r, p in enumerate(self.peers) if r not in failed]
        world = Group(comm, "world", Ledger())
        start, failed_step, copy, path = self._restore_point(world, failed, control.size,
                                                              rank.state.shapes)
        if copy is not None and copy.dpo_reference is None and rank.data.preference is not None:
            ref = rank.data.preference.reference
            copy.dpo_reference = None if ref is None else np.array(ref)
        try:
            layout = self.relayout(rank.layout, world.size)
        except ConfigError as err:
            raise Unrecoverable(f"no layout of the {world.size} surviving ranks fits: "
                                f"{err}") from None
        old_layout = layout_text(rank.layout)
        try:
            close(rank)  # revoked communicators may be freed (ULFM)
        except ulfm.error_type():
            pass
        new = build_rank(layout, comm, rank.data.source)
        if copy is not None:
            copy.load(new)
        else:
            from mpipar.checkpoint import reader
            reader.load(new.state, path)
            new.model.routing.load(reader.read_moe_bias(path))
            if new.data.preference is not None:
                new.data.preference.load(reader.read_dpo_reference(path), start)
        self.copies, self.shares, self.control = {}, None, world
        record = {"failed_ranks": failed, "failed_step": failed_step,
                  "from": "memory" if copy is not None else "checkpoint",
                  "resumed_step": start, "steps_redone": failed_step - start,
                  "old_world": control.size, "world": world.size,
                  "old_layout": old_layout, "layout": layout_text(layout),
                  "layout_flags": layout_flags(layout)}
        return Recovered(new, world, start, record, detected,
                         tuple(node for node, _ in self.peers))

    def _restore_point(self, world: Group, failed: list[int], old_world: int,
                       shapes: dict[str, tuple[int, ...]]
                       ) -> tuple[int, int, StateCopy | None, str | None]:
        """(the step to go on from, the step (1-based) in flight when the failure struck, the
        state in memory or None, else the checkpoint holding it), the same on every survivor.
        A failure in a step's checkpoint save or evaluation is one of that step."""
        shares = self.shares
        steps = shares.steps() if shares is not None else sorted(self.copies)
        holder = shares.holder if shares is not None else []
        held = world.allgather_object((self.in_flight, steps, holder))
        start = min(step for step, _, _ in held)
        failed_step = max(step for step, _, _ in held) + 1
        in_memory = all(start in copies for _, copies, _ in held)
        common = set.intersection(*(set(copies) for _, copies, _ in held))
        if self.state_copies and common and all(
                recoverable(old_world, h, failed) for _, _, h in held):
            start = max(common)   # a failure in the step's exchange: the step before it
            pool: dict = {}
            for part in world.allgather_object(shares.contribution(start, failed)):
                pool.update(part)
            tensors, kinds, bias = assemble(pool, shapes)
            return start, failed_step, StateCopy.pooled(tensors, kinds, start, bias, None), None
        if not self.state_copies and in_memory:
            return start, failed_step, self.copies[start], None
        from mpipar.checkpoint import directory
        path = None
        if world.rank == 0:
            found = directory.latest(self.save_dir)
            path = None if found is None else str(found)
        path = world.bcast_object(path)
        if path is None:
            raise Unrecoverable(
                f"the state of step {start} is not held by every survivor (dp replicas of "
                f"the whole state, or --state-copies 1 with every lost rank's holder alive) "
                f"and {self.save_dir} holds no checkpoint (--save-every)")
        from mpipar.checkpoint import reader
        return reader.require_sound(reader.resolve_path(path)).step, failed_step, None, path


def layout_text(layout: Layout) -> str:
    """E.g. ``"dp=3 tp=1 pp=1 sp=1 ep=1 zero=0"``: the grid a recovery record names."""
    par = layout.parallel
    return (f"dp={layout.dp} tp={layout.tp} pp={layout.pp} sp={layout.sp} ep={par.ep} "
            f"zero={par.zero}")


def layout_flags(layout: Layout) -> str:
    """The train flags that reproduce ``layout``'s grid and batch split."""
    par = layout.parallel
    return (f"--dp {layout.dp} --tp {layout.tp} --pp {layout.pp} --sp {layout.sp} "
            f"--ep {par.ep} --zero {par.zero} --micro-batch-size {layout.micro_batch_size}")


def check_config(layout: Layout) -> None:
    """``--on-rank-failure shrink`` with LoRA only on a base the rebuilt rank makes itself: the
    recovery restores the trained state (the adapters and their moments), and a frozen base
    read from ``--init-from-hf`` is no part of it."""
    t = layout.train
    if t.state_copies not in (0, 1):
        raise ConfigError(
            f"train.state_copies={t.state_copies}: must be 0 or 1 (one copy on another node "
            f"survives a rank's or a node's loss; a second copy, for the loss of a rank and its "
            f"partner at once, is not kept)")
    if t.state_copies and t.on_rank_failure != "shrink":
        raise ConfigError(
            f"train.state_copies={t.state_copies} with train.on_rank_failure="
            f"{t.on_rank_failure!r}: the copies serve a shrink only; give --on-rank-failure "
            f"shrink, or --state-copies 0")
    if t.state_copies and optimizer_mode(t).muon:
        raise ConfigError(
            f"train.state_copies={t.state_copies} with train.optimizer={t.optimizer!r}: the "
            f"copies hold AdamW's state; give --optimizer adamw, or --state-copies 0 (the "
            f"shrink then restores from the last checkpoint)")
    if t.state_copies and reduction_of(layout.parallel).compresses:
        raise ConfigError(
            f"train.state_copies={t.state_copies} with parallel.grad_compression="
            f"{layout.parallel.grad_compression!r}: the copies hold the master weights and "
            f"AdamW's moments, not compression's residuals; give --grad-compression none, or "
            f"--state-copies 0")
    if t.on_rank_failure == "shrink" and Lora.of(t) is not None and t.init_from_hf:
        raise ConfigError(
            f"train.on_rank_failure='shrink' with train.lora_rank={t.lora_rank} and "
            f"train.init_from_hf={t.init_from_hf!r}: a shrink restores the adapters and their "
            f"optimizer state, not the frozen base read from --init-from-hf (the rebuilt ranks "
            f"would hold the seed's base); give --on-rank-failure abort and --resume the run "
            f"from its last checkpoint after a failure")


def on_rank_failure(mode: str, relayout: Callable[[Layout, int], Layout],
                    save_dir: str, state_copies: int = 0) -> Abort | Shrink:
    """The object of ``--on-rank-failure`` (one of :data:`MODES`), with ``--state-copies``."""
    if mode == "shrink":
        return Shrink(relayout, save_dir, state_copies)
    if mode == "abort":
        return Abort()
    raise ValueError(f"train.on_rank_failure={mode!r}: must be one of {MODES}")
