"""The pipeline executor: walks this rank's op list of a schedule (:mod:`.schedule`) with MPI
point-to-point on the pp communicator.

Sends are non-blocking (their buffers are kept until completion at the end of the step);
receives block. The schedule's dry run proves that this cannot deadlock. Messages are matched by
a tag derived from (direction, microbatch, virtual stage), so matching never depends on order.

Virtual stage ``s = chunk * p + rank`` holds the layers ``[s*L/(p*v), (s+1)*L/(p*v))``; stage 0
embeds, stage ``p*v - 1`` computes the loss. With ``p == 1`` consecutive chunks hand activations
and gradients over locally.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mpipar.comm import Group
from mpipar.model.llama import LlamaStage
from mpipar.parallel.pipeline.schedule import Op, message_tag


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


@dataclass
class PipelineExecutor:
    """Runs one step's forward and backward of every microbatch through this rank's chunks."""

    ops: list[Op]
    chunks: list[LlamaStage]
    pp: Group
    p: int
    v: int
    xp: ModuleType   # the array module receive buffers come from
    timeline: list[OpRecord] = field(default_factory=list)

    def run(self, params: dict, grads: dict, microbatches: list[Microbatch],
            positions: Any, act_shape: tuple[int, ...], dtype, loss_weight: Any,
            on_ready=None) -> float:
        """Execute the schedule; return this rank's summed token loss (0 off the last stage).

        act_shape: the stream's shape (what travels between stages); on_ready(names): called
        once the gradients of ``names`` are final for the step.
        """
        rank, p, v, m = self.pp.rank, self.p, self.v, len(microbatches)
        last_stage = p * v - 1
        acts_in: dict[tuple[int, int], Any] = {}    # (mb, chunk) -> input activation
        acts_out: dict[tuple[int, int], Any] = {}   # (mb, chunk) -> output to send
        grad_in: dict[tuple[int, int], Any] = {}    # (mb, chunk) -> d(output)
        grad_out: dict[tuple[int, int], Any] = {}   # (mb, chunk) -> d(input) to send
        caches: dict[tuple[int, int], Any] = {}
        deferred: dict[tuple[int, int], list] = {}
        done_bwd = [0] * v
        pending = []
        loss = 0.0
        self.timeline = []
        t0 = time.perf_counter()

        for op in self.ops:
            key = (op.microbatch, op.chunk)
            stage = op.chunk * p + rank
            chunk = self.chunks[op.chunk]
            start = time.perf_counter() - t0
            if op.kind == "recv_fwd":
                buf = self.xp.empty(act_shape, dtype)
                acts_in[key] = self.pp.recv(buf, op.peer, message_tag(op, rank, p, v))
            elif op.kind == "recv_bwd":
                buf = self.xp.empty(act_shape, dtype)
                grad_in[key] = self.pp.recv(buf, op.peer, message_tag(op, rank, p, v))
            elif op.kind == "send_fwd":
                buf = acts_out.pop(key)
                pending.append((self.pp.isend(buf, op.peer, message_tag(op, rank, p, v)), buf))
            elif op.kind == "send_bwd":
                buf = grad_out.pop(key)
                pending.append((self.pp.isend(buf, op.peer, message_tag(op, rank, p, v)), buf))
            elif op.kind == "fwd":
                mb = microbatches[op.microbatch]
                if stage == 0:
                    inp = mb.tokens
                elif key in acts_in:
                    inp = acts_in.pop(key)
                else:  # p == 1: the previous chunk is on this rank
                    inp = acts_out.pop((op.microbatch, op.chunk - 1))
                out, caches[key] = chunk.forward(params, inp, positions,
                                                 mb.targets if stage == last_stage else None)
                if stage == last_stage:
                    loss += float(out.sum())
                else:
                    acts_out[key] = out
            else:  # "bwd", "bwd_input" or "bwd_weight"
                final = done_bwd[op.chunk] == m - 1
                if op.kind == "bwd_weight":
                    chunk.weight_backward(grads, deferred.pop(key))
                else:
                    if stage == last_stage:
                        dout = loss_weight
                    elif key in grad_in:
                        dout = grad_in.pop(key)
                    else:  # p == 1: the next chunk is on this rank
                        dout = grad_out.pop((op.microbatch, op.chunk + 1))
                    split = op.kind == "bwd_input"
                    if split:
                        deferred[key] = []
                    dx = chunk.backward(params, grads, dout, caches.pop(key),
                                        deferred=deferred.get(key),
                                        on_ready=on_ready if final else None)
                    if stage > 0:
                        grad_out[key] = dx
                if op.kind != "bwd_input":
                    done_bwd[op.chunk] += 1
                    if final and op.kind == "bwd_weight" and on_ready is not None:
                        on_ready(chunk.param_names())
            self.timeline.append(OpRecord(op.kind, op.microbatch, op.chunk, start,
                                          time.perf_counter() - t0))
        for req, _ in pending:
            req.wait()
        leftovers = [k for k, d in (("acts_in", acts_in), ("acts_out", acts_out),
                                    ("grad_in", grad_in), ("grad_out", grad_out),
                                    ("caches", caches)) if d]
        if leftovers:
            raise RuntimeError(f"pipeline schedule left unconsumed state: {leftovers}")
        return loss
