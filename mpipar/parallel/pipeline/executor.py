"""The pipeline executor: walks this rank's op list of a schedule (:mod:`.schedule`) with MPI
point-to-point on the pp communicator.

:meth:`PipelineExecutor.run` walks a training schedule (forward and backward of every
microbatch); :meth:`PipelineExecutor.run_forward` walks a forward-only one (evaluation,
generation: :func:`.schedule.forward_only`). Sends are non-blocking (their buffers are kept
until completion at the end of the walk); receives block. The schedule's dry run proves that
this cannot deadlock. Messages are matched by a tag derived from (direction, microbatch, virtual
stage), so matching never depends on order.

Chunk ``c`` of pipeline rank ``r`` is virtual stage ``s = c * p + r`` (the schedule's rule), which
holds the blocks the placement table gives it
(:meth:`mpipar.parallel.placement.PlacementTable.stage_layers`); stage 0 embeds, stage
``p*v - 1`` computes the loss. With ``p == 1`` consecutive chunks hand activations and gradients
over locally.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mpipar.runtime.comm import Group
from mpipar.model.llama import RESIDENT, LlamaStage, ParamScope
from mpipar.parallel.pipeline.schedule import MESSAGE_KINDS, Op, message_tag

StageForward = Callable[[LlamaStage, Any, "Microbatch"], Any]
"""``(chunk, input, microbatch) -> output`` of one chunk in a forward-only walk."""


@dataclass
class OpRecord:
    """When an op of the last step ran (seconds since the step began), for the timeline."""

    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


@dataclass
class Microbatch:
    tokens: Any    # [B, S_loc] token ids (an array of the backend's module)
    targets: Any   # [B, S_loc]
    positions: Any = None   # packed documents: this microbatch's DocumentPositions
    counted: Any = None     # [B, S_loc] 1/0: which targets carry loss (None: all)
    loss: Any = None        # the microbatch's own loss of its per-token losses (None: their
    #                         sum over the counted targets): forward(token_loss) -> float and
    #                         dout(loss_weight) -> their gradient (training.objective.PairLoss)
    rows: Any = None        # [B] its rows' indices in the step's global batch
    ahead: Any = None       # [D, B, S_loc] multi-token prediction's tokens t_{i+1+k}, k = 1..D
    #                         (-1 past the row; mpipar.model.mtp); None without it


@dataclass(kw_only=True)
class PipelineExecutor:
    """Runs one step's forward and backward of every microbatch through this rank's chunks:
    ``ops``, this rank's op list; ``chunks``, its model chunks in order (``v`` of them: the
    virtual stages per rank); ``pp``, the pipeline group (``p`` ranks)."""

    ops: list[Op]
    chunks: list[LlamaStage]
    pp: Group
    xp: ModuleType   # the array module receive buffers come from
    scope: ParamScope = RESIDENT   # holds each unit the chunks run (ZeRO-3 gathers there)
    timeline: list[OpRecord] = field(default_factory=list)
    started: float = 0.0   # time.perf_counter() at the start of the last step's op records

    @property
    def p(self) -> int:
        """Pipeline ranks."""
        return self.pp.size

    @property
    def v(self) -> int:
        """Model chunks (virtual stages) on each pipeline rank."""
        return len(self.chunks)

    def run(self, params: dict, grads: dict, microbatches: list[Microbatch],
            positions: Any, act_shape: tuple[int, ...], dtype, loss_weight: Any,
            on_ready=None, on_microbatch=None) -> float:
        """Execute the schedule; return this rank's summed token loss (0 off the last stage).

        act_shape: the stream's shape (what travels between stages); on_ready(names): called
        once the gradients of ``names`` are final for the step; on_microbatch(mb): called with
        the microbatch before each of its forwards and backwards, and with None at the end.
        """
        rank, p, v, m = self.pp.rank, self.p, self.v, len(microbatches)
        last_stage = p * v - 1
        wire = _Wire(self, act_shape, dtype)
        caches: dict[tuple[int, int], Any] = {}
        deferred: dict[tuple[int, int], list] = {}
        done_bwd = [0] * v
        loss = 0.0
        self.timeline = []
        t0 = self.started = time.perf_counter()

        for op in self.ops:
            key = (op.microbatch, op.chunk)
            stage = op.chunk * p + rank
            chunk = self.chunks[op.chunk]
            start = time.perf_counter() - t0
            if op.kind not in MESSAGE_KINDS and on_microbatch is not None:
                on_microbatch(microbatches[op.microbatch])
            if op.kind in MESSAGE_KINDS:
                wire.message(op)
            elif op.kind == "fwd":
                mb = microbatches[op.microbatch]
                at = positions if mb.positions is None else mb.positions
                out, caches[key] = chunk.forward(params, wire.stage_input(op, stage, mb), at,
                                                 mb.targets if stage == last_stage else None,
                                                 self.scope,
                                                 ahead=mb.ahead if stage == last_stage else None)
                if stage == last_stage and mb.loss is not None:
                    loss += mb.loss.forward(out)
                elif stage == last_stage:
                    loss += float((out if mb.counted is None else out * mb.counted).sum())
                else:
                    wire.acts_out[key] = out
            else:  # "bwd", "bwd_input" or "bwd_weight"
                final = done_bwd[op.chunk] == m - 1
                if op.kind == "bwd_weight":
                    chunk.weight_backward(grads, deferred.pop(key), self.scope)
                else:
                    if stage == last_stage:
                        mb = microbatches[op.microbatch]
                        dout = (mb.loss.dout(loss_weight) if mb.loss is not None
                                else loss_weight if mb.counted is None
                                else loss_weight * mb.counted)
                    elif key in wire.grad_in:
                        dout = wire.grad_in.pop(key)
                    else:  # p == 1: the next chunk is on this rank
                        dout = wire.grad_out.pop((op.microbatch, op.chunk + 1))
                    split = op.kind == "bwd_input"
                    if split:
                        deferred[key] = []
                    dx = chunk.backward(params, grads, dout, caches.pop(key),
                                        deferred=deferred.get(key),
                                        on_ready=on_ready if final else None,
                                        scope=self.scope)
                    if stage > 0:
                        wire.grad_out[key] = dx
                if op.kind != "bwd_input":
                    done_bwd[op.chunk] += 1
                    if final and op.kind == "bwd_weight" and on_ready is not None:
                        on_ready(chunk.param_names())
            self.timeline.append(OpRecord(op.kind, op.microbatch, op.chunk, start,
                                          time.perf_counter() - t0))
        wire.finish(caches=caches)
        if on_microbatch is not None:
            on_microbatch(None)
        return loss

    def run_forward(self, microbatches: list[Microbatch], act_shape: tuple[int, ...], dtype,
                    stage_forward: StageForward) -> dict[int, Any]:
        """Walk a forward-only op list (:func:`.schedule.forward_only`: evaluation, generation):
        ``stage_forward(chunk, input, microbatch)`` runs one chunk keeping nothing for a
        backward. Returns the last stage's outputs by microbatch (empty off the last stage).
        The step's :attr:`timeline` is left as it was."""
        rank, p = self.pp.rank, self.p
        last_stage = p * self.v - 1
        wire = _Wire(self, act_shape, dtype)
        outputs: dict[int, Any] = {}
        for op in self.ops:
            if op.kind in MESSAGE_KINDS:
                wire.message(op)
                continue
            if op.kind != "fwd":
                raise ValueError(f"run_forward: {op} is not a forward-only op")
            stage = op.chunk * p + rank
            mb = microbatches[op.microbatch]
            out = stage_forward(self.chunks[op.chunk], wire.stage_input(op, stage, mb), mb)
            if stage == last_stage:
                outputs[op.microbatch] = out
            else:
                wire.acts_out[(op.microbatch, op.chunk)] = out
        wire.finish()
        return outputs


class _Wire:
    """What one walk of an op list holds between its ops: activations and gradients received
    or to send, keyed ``(microbatch, chunk)``, and the sends in flight."""

    def __init__(self, executor: PipelineExecutor, act_shape: tuple[int, ...], dtype) -> None:
        self.executor, self.act_shape, self.dtype = executor, act_shape, dtype
        self.acts_in: dict[tuple[int, int], Any] = {}    # input activation received
        self.acts_out: dict[tuple[int, int], Any] = {}   # output to send (or hand over)
        self.grad_in: dict[tuple[int, int], Any] = {}    # d(output) received
        self.grad_out: dict[tuple[int, int], Any] = {}   # d(input) to send (or hand over)
        self.pending: list = []

    def message(self, op: Op) -> None:
        """Post a send (non-blocking; the buffer is kept until :meth:`finish`) or receive one
        (blocking) on the pp group, tagged by the message's identity."""
        ex = self.executor
        key, rank = (op.microbatch, op.chunk), ex.pp.rank
        tag = message_tag(op, rank, ex.p, ex.v)
        if op.kind.startswith("recv"):
            into = self.acts_in if op.kind == "recv_fwd" else self.grad_in
            into[key] = ex.pp.recv(ex.xp.empty(self.act_shape, self.dtype), op.peer, tag)
        else:
            buf = (self.acts_out if op.kind == "send_fwd" else self.grad_out).pop(key)
            self.pending.append((ex.pp.isend(buf, op.peer, tag), buf))

    def stage_input(self, op: Op, stage: int, mb: Microbatch) -> Any:
        """The input of a forward: the tokens on stage 0, else the received activation, or (one
        pipeline rank) the previous chunk's output on this rank."""
        if stage == 0:
            return mb.tokens
        key = (op.microbatch, op.chunk)
        if key in self.acts_in:
            return self.acts_in.pop(key)
        return self.acts_out.pop((op.microbatch, op.chunk - 1))

    def finish(self, **more: dict) -> None:
        """Complete the sends; every received or produced tensor must have been consumed."""
        for req, _ in self.pending:
            req.wait()
        held = {"acts_in": self.acts_in, "acts_out": self.acts_out, "grad_in": self.grad_in,
                "grad_out": self.grad_out, **more}
        leftovers = [name for name, d in held.items() if d]
        if leftovers:
            raise RuntimeError(f"pipeline schedule left unconsumed state: {leftovers}")
