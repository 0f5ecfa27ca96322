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
from mpipar.data import Sampler, TokenSource, load_tokens
from mpipar.kernels import get_backend
from mpipar.model.llama import LlamaStage, LocalAttention
from mpipar.model.params import ParamSpec, init_params, param_specs, shard, unshard
from mpipar.optim import AdamW, AdamWConfig, LRSchedule, clip_grads, grad_norm_sq
from mpipar.parallel.grads import GradReducer, ZeroAdamW
from mpipar.parallel.pipeline import Microbatch, PipelineExecutor
from mpipar.parallel.ring import RingAttention, SeqLayout, UlyssesAttention
from mpipar.parallel.schedule import build_schedule
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
    """Everything one rank needs to train: grid, groups, chunks, shards, optimizer, sampler."""

    def __init__(self, cfg: Config, comm: MPI.Comm = MPI.COMM_WORLD,
                 source: TokenSource | None = None) -> None:
        """``cfg`` must be resolved; ``source`` overrides ``cfg.train.data`` (tests, notebooks)."""
        self.cfg = cfg
        par, tr = cfg.parallel, cfg.train
        # Data first: a bad path or token id fails on every rank before any collective.
        self.source = source or load_tokens(tr.data or None, cfg.model.vocab_size, tr.seq_len)
        self.sampler = Sampler(self.source, tr.global_batch_size, tr.seed, tr.shuffle)
        self.grid = ProcessGrid(comm, par.dp, par.tp, par.pp, par.sp)
        self.ledger = Ledger()
        self.groups = {name: Group(c, name, self.ledger) for name, c in self.grid.comms.items()}
        self.kernels = get_backend(tr.backend)
        self.dtype = np.dtype(tr.dtype)
        self.specs: dict[str, ParamSpec] = {s.name: s for s in param_specs(cfg.model)}
        self.layout = SeqLayout(tr.seq_len, par.sp, par.sp_split)
        self.positions = self.layout.positions(self.grid.coord.sp)

        # Model chunks of this pipeline rank: virtual stage s = chunk * pp + pp_rank.
        p, v = par.pp, par.virtual_stages
        per = cfg.model.layers // (p * v)
        tp = self.groups["tp"]
        self.chunks = []
        for c in range(v):
            s = c * p + self.grid.coord.pp
            self.chunks.append(LlamaStage(cfg.model, self.kernels, range(s * per, (s + 1) * per),
                                          s == 0, s == p * v - 1, tp, self._attention()))
        names = [n for ch in self.chunks for n in ch.param_names()]
        params = init_params(cfg.model, tr.seed, self.dtype, set(names), tp.rank, tp.size)
        self.reducer = GradReducer(params, list(reversed(names)), self.groups["dp_sp"],
                                   par.bucket_mb, zero=par.zero == 1)
        self.params, self.grads = self.reducer.params, self.reducer.grads
        decay = {n: len(self.specs[n].shape) >= 2 for n in self.params}
        adamw = AdamWConfig(tr.lr, tr.beta1, tr.beta2, tr.eps, tr.weight_decay)
        self.optimizer = (ZeroAdamW(self.reducer, adamw, decay) if par.zero
                          else AdamW(self.params, adamw, decay))
        self.schedule = LRSchedule(tr.lr_schedule, tr.lr, tr.min_lr, tr.warmup_steps,
                                   max(1, tr.steps))
        self.rows_per_dp = tr.global_batch_size // par.dp
        self.microbatches = self.rows_per_dp // tr.micro_batch_size
        ops = build_schedule(par.schedule, p, self.microbatches, v)[self.grid.coord.pp]
        self.executor = PipelineExecutor(ops, self.chunks, self.groups["pp"], p, v)

    def _attention(self):
        par, sp = self.cfg.parallel, self.groups["sp"]
        if sp.size == 1:
            return LocalAttention(self.kernels)
        if par.sp_mode == "ulysses":
            return UlyssesAttention(self.kernels, sp, self.layout)
        return RingAttention(self.kernels, sp, self.layout, par.sp_overlap)

    # ------------------------------------------------------------------- step
    def _norm_counted(self, name: str) -> bool:
        """Count each parameter once in the global norm: replicated ones on TP rank 0 only."""
        return self.specs[name].tp_axis is not None or self.grid.coord.tp == 0

    def train_step(self, step: int) -> StepResult:
        """Run optimizer step ``step`` (0-based) and return its result (the same on every rank)."""
        t0 = time.perf_counter()
        par, tr = self.cfg.parallel, self.cfg.train
        d = self.grid.coord.dp
        inputs, targets = self.sampler.batch(step, slice(d * self.rows_per_dp,
                                                         (d + 1) * self.rows_per_dp))
        inputs, targets = inputs[:, self.positions], targets[:, self.positions]
        mbs = tr.micro_batch_size
        micro = [Microbatch(inputs[i * mbs:(i + 1) * mbs], targets[i * mbs:(i + 1) * mbs])
                 for i in range(self.microbatches)]
        tokens = tr.global_batch_size * tr.seq_len
        weight = np.full((mbs, len(self.positions)), 1.0 / tokens)

        self.reducer.start_step()
        loss = self.executor.run(self.params, self.grads, micro, self.positions,
                                 (mbs, len(self.positions), self.cfg.model.hidden), self.dtype,
                                 weight, on_ready=self.reducer.ready)
        self.reducer.finish()
        loss_buf = self.groups["dp_sp"].allreduce_(np.array([loss]))
        self.groups["pp"].bcast_(loss_buf, root=par.pp - 1)

        if par.zero:
            norm_sq = np.array([self.optimizer.norm_sq(self._norm_counted)])
            self.groups["dp_sp"].allreduce_(norm_sq)
        else:
            norm_sq = np.array([grad_norm_sq(self.grads, self._norm_counted)])
        self.groups["tp_pp"].allreduce_(norm_sq)
        grad_norm = float(np.sqrt(norm_sq[0]))
        lr = self.schedule(step)
        if par.zero:
            clip_grads(self.optimizer.owned_grads(), tr.clip_grad, grad_norm)
            self.optimizer.step(lr)
        else:
            clip_grads(self.grads, tr.clip_grad, grad_norm)
            self.optimizer.step(self.params, self.grads, lr)
        return StepResult(step + 1, float(loss_buf[0]) / tokens, grad_norm, lr,
                          time.perf_counter() - t0, tokens)

    # ---------------------------------------------------------------- gather
    def gather_params(self) -> dict[str, np.ndarray]:
        """Every global parameter, assembled from all shards, on every rank (tests, export)."""
        tp, pp = self.groups["tp"], self.groups["pp"]
        out = {}
        for spec in param_specs(self.cfg.model):
            owner = self._owner_stage(spec)
            if pp.rank == owner:
                local = self.params[spec.name]
                pieces = np.empty((tp.size,) + local.shape, local.dtype)
                tp.allgather(np.ascontiguousarray(local), pieces)
                full = np.ascontiguousarray(unshard(spec, list(pieces)))
            else:
                full = np.empty(spec.shape, self.dtype)
            out[spec.name] = pp.bcast_(full, root=owner)
        return out

    def load_params(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite this rank's shards from global tensors (every name the model has, global
        shapes as in :func:`param_specs`), cast to the training dtype. Collective-free."""
        missing = sorted(set(self.specs) - set(values))
        if missing:
            raise ValueError(f"load_params: missing parameters {missing[:5]}")
        tp = self.groups["tp"]
        for name, local in self.params.items():
            spec, value = self.specs[name], np.asarray(values[name])
            if value.shape != spec.shape:
                raise ValueError(f"load_params: {name} has shape {value.shape}, the model needs "
                                 f"{spec.shape}")
            local[...] = shard(spec, value.astype(self.dtype), tp.rank, tp.size)

    def _owner_stage(self, spec: ParamSpec) -> int:
        """pp rank that holds ``spec``."""
        p, v = self.cfg.parallel.pp, self.cfg.parallel.virtual_stages
        if spec.layer is None:
            return 0 if spec.name == "embed_tokens.weight" else p - 1
        per = self.cfg.model.layers // (p * v)
        return (spec.layer // per) % p
