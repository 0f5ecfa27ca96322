"""The training engine: process grid, model shards, data and optimizer, one step at a time.

``Engine(cfg, comm)`` builds everything for this rank from a *resolved* config;
``engine.train_step(k)`` runs optimizer step ``k`` (0-based) and returns its
:class:`StepResult`, identical on every rank.

One step, as data flows (DESIGN.md): this DP rank takes its rows of the global batch, cuts
them into microbatches and this SP rank's sequence chunk; each microbatch runs forward and
backward through the stage; gradients are summed over dp x sp; the global norm is summed over
tp x pp counting each parameter once; clipping and AdamW update the local shards. The loss is
the mean over every token of the global batch, whatever the layout.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpipar.comm import Group, Ledger
from mpipar.config import Config
from mpipar.data import Sampler, load_tokens
from mpipar.kernels import get_backend
from mpipar.model.llama import LlamaStage, LocalAttention
from mpipar.model.params import ParamSpec, init_params, param_specs, unshard
from mpipar.optim import AdamW, AdamWConfig, LRSchedule, clip_grads, grad_norm_sq
from mpipar.topology import ProcessGrid


@dataclass
class StepResult:
    """What one optimizer step produced (the same on every rank)."""

    step: int          # 1-based number of the step just completed
    loss: float        # mean token loss of this step's forward pass, before the update
    grad_norm: float   # global L2 norm before clipping
    lr: float
    step_time_s: float
    tokens: int        # tokens in the global batch


class Engine:
    """Everything one rank needs to train: grid, groups, stage, shards, optimizer, sampler."""

    def __init__(self, cfg: Config, comm: MPI.Comm = MPI.COMM_WORLD) -> None:
        self.cfg = cfg
        par, tr = cfg.parallel, cfg.train
        # Data first: a bad path or token id fails on every rank before any collective.
        self.source = load_tokens(tr.data or None, cfg.model.vocab_size, tr.seq_len)
        self.grid = ProcessGrid(comm, par.dp, par.tp, par.pp, par.sp)
        self.ledger = Ledger()
        self.groups = {name: Group(c, name, self.ledger) for name, c in self.grid.comms.items()}
        self.kernels = get_backend(tr.backend)
        self.dtype = np.dtype(tr.dtype)
        self.specs: dict[str, ParamSpec] = {s.name: s for s in param_specs(cfg.model)}

        tp = self.groups["tp"]
        self.stage = LlamaStage(cfg.model, self.kernels, range(cfg.model.layers), True, True, tp,
                                LocalAttention(self.kernels))
        names = self.stage.param_names()
        self.params = init_params(cfg.model, tr.seed, self.dtype, set(names), tp.rank, tp.size)
        self.grads = {n: np.zeros_like(p) for n, p in self.params.items()}
        decay = {n: len(self.specs[n].shape) >= 2 for n in self.params}
        self.optimizer = AdamW(self.params, AdamWConfig(tr.lr, tr.beta1, tr.beta2, tr.eps,
                                                        tr.weight_decay), decay)
        self.schedule = LRSchedule(tr.lr_schedule, tr.lr, tr.min_lr, tr.warmup_steps, tr.steps)
        self.sampler = Sampler(self.source, tr.global_batch_size, tr.seed, tr.shuffle)

    # ------------------------------------------------------------------- step
    def _norm_counted(self, name: str) -> bool:
        """Count each parameter once in the global norm: replicated ones on TP rank 0 only."""
        return self.specs[name].tp_axis is not None or self.grid.coord.tp == 0

    def train_step(self, step: int) -> StepResult:
        """Run optimizer step ``step`` (0-based) and return its result."""
        t0 = time.perf_counter()
        cfg, par, tr = self.cfg, self.cfg.parallel, self.cfg.train
        rows_per_dp = tr.global_batch_size // par.dp
        d = self.grid.coord.dp
        inputs, targets = self.sampler.batch(step, slice(d * rows_per_dp, (d + 1) * rows_per_dp))
        tokens = tr.global_batch_size * tr.seq_len
        positions = np.arange(tr.seq_len)
        weight = np.full((tr.micro_batch_size, tr.seq_len), 1.0 / tokens)

        for g in self.grads.values():
            g.fill(0)
        loss_sum = np.zeros(1)
        for mb in range(rows_per_dp // tr.micro_batch_size):
            rows = slice(mb * tr.micro_batch_size, (mb + 1) * tr.micro_batch_size)
            tok_loss, cache = self.stage.forward(self.params, inputs[rows], positions,
                                                 targets[rows])
            loss_sum += tok_loss.sum()
            self.stage.backward(self.params, self.grads, weight, cache)

        for name in sorted(self.grads):
            self.groups["dp_sp"].allreduce_(self.grads[name])
        self.groups["dp_sp"].allreduce_(loss_sum)

        norm_sq = np.array([grad_norm_sq(self.grads, self._norm_counted)])
        self.groups["tp_pp"].allreduce_(norm_sq)
        grad_norm = float(np.sqrt(norm_sq[0]))
        clip_grads(self.grads, tr.clip_grad, grad_norm)
        lr = self.schedule(step)
        self.optimizer.step(self.params, self.grads, lr)
        return StepResult(step + 1, float(loss_sum[0]) / tokens, grad_norm, lr,
                          time.perf_counter() - t0, tokens)

    # ---------------------------------------------------------------- gather
    def gather_params(self) -> dict[str, np.ndarray]:
        """Every global parameter, assembled from all shards, on every rank (for tests/export)."""
        tp = self.groups["tp"]
        out = {}
        for name in sorted(self.params):
            local = self.params[name]
            pieces = np.empty((tp.size,) + local.shape, local.dtype)
            tp.allgather(local, pieces)
            out[name] = unshard(self.specs[name], list(pieces))
        return out
