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

import math
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpipar.activations import ActivationRecorder, OffloadStore, dump_engine_step, offload_path
from mpipar.comm import Group, Ledger
from mpipar.config import Config
from mpipar.data import Sampler, TokenSource, load_tokens
from mpipar.kernels import available_backends, get_backend
from mpipar.model.llama import LlamaStage, LocalAttention
from mpipar.model.params import (ParamSpec, init_params, param_specs, param_stage, shard,
                                 unshard)
from mpipar.optim import AdamW, AdamWConfig, LRSchedule, clip_grads, grad_norm_sq
from mpipar.parallel.grads import GradReducer, ZeroAdamW
from mpipar.parallel.pipeline import Microbatch, PipelineExecutor
from mpipar.parallel.ring import RingAttention, SeqLayout, UlyssesAttention
from mpipar.parallel.schedule import build_schedule, stage_layers, stage_owner, virtual_stage
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


HOST_BACKENDS = ("numba", "numpy")


def host_backend(name: str):
    """The kernels of the engine, which keeps every array in host memory: ``auto`` is the
    fastest CPU backend available (Numba, else NumPy)."""
    if name == "auto":
        free = available_backends()
        name = next(n for n in HOST_BACKENDS if free[n] is None)
    return get_backend(name)


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
        self.kernels = host_backend(tr.backend)
        self.dtype = np.dtype(tr.dtype)
        self.specs: dict[str, ParamSpec] = {s.name: s for s in param_specs(cfg.model)}
        self.layout = SeqLayout(tr.seq_len, par.sp, par.sp_split)
        self.positions = self.layout.positions(self.grid.coord.sp)

        # Model chunks of this pipeline rank: virtual stage s = chunk * pp + pp_rank.
        p, v = par.pp, par.virtual_stages
        tp = self.groups["tp"]
        # --recompute offload: one scratch file per rank for the saved activations.
        self.offload = (OffloadStore(offload_path(tr.run_dir, self.grid.rank))
                        if tr.recompute == "offload" else None)
        self.chunks = []
        for c in range(v):
            s = virtual_stage(self.grid.coord.pp, c, p)
            self.chunks.append(LlamaStage(cfg.model, self.kernels,
                                          stage_layers(s, cfg.model.layers, p, v), s == 0, s == p * v - 1, tp, self._attention(),
                                          tr.recompute, self.offload))
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

        recorder = None
        if step + 1 in self.cfg.dump_steps:  # --dump-activations: record this step's blocks
            recorder = ActivationRecorder.for_schedule(self.executor.ops, self.chunks)
            for ch in self.chunks:
                ch.recorder = recorder
        self.reducer.start_step()
        loss = self.executor.run(self.params, self.grads, micro, self.positions,
                                 (mbs, len(self.positions), self.cfg.model.hidden), self.dtype,
                                 weight, on_ready=self.reducer.ready)
        self.reducer.finish()
        if recorder is not None:
            for ch in self.chunks:
                ch.recorder = None
            dump_engine_step(self, step + 1, recorder)
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
        loss = float(loss_buf[0]) / tokens
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            # Non-finite (the same on every rank, after the reductions): no update is applied;
            # the caller skips the step or stops (--on-nan).
            return StepResult(step + 1, loss, grad_norm, lr, time.perf_counter() - t0, tokens)
        if par.zero:
            clip_grads(self.optimizer.owned_grads(), tr.clip_grad, grad_norm)
            self.optimizer.step(lr)
        else:
            clip_grads(self.grads, tr.clip_grad, grad_norm)
            self.optimizer.step(self.params, self.grads, lr)
        return StepResult(step + 1, loss, grad_norm, lr, time.perf_counter() - t0, tokens)

    def close(self) -> None:
        """Release what outlives steps on disk: the offload scratch file (removed)."""
        if self.offload is not None:
            self.offload.close()

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

    # ------------------------------------------------------------ state (checkpoints)
    @property
    def writes_params(self) -> bool:
        """Whether this rank writes the parameters of its (tp, pp) position (dp = sp = 0)."""
        return self.groups["dp_sp"].rank == 0

    def local_region(self, name: str) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """(region of the global tensor ``name`` that this rank's shard covers, the part of the
        local shard that holds it) — they differ only by vocabulary padding rows, which no
        global tensor contains."""
        spec, local = self.specs[name], self.params[name].shape
        glob = [slice(0, d) for d in spec.shape]
        loc = [slice(0, d) for d in local]
        if spec.tp_axis is not None:
            ax = spec.tp_axis
            start = self.groups["tp"].rank * local[ax]
            stop = max(start, min(start + local[ax], spec.shape[ax]))
            glob[ax] = slice(start, stop)
            loc[ax] = slice(0, stop - start)
        return tuple(glob), tuple(loc)

    def optimizer_pieces(self):
        """This rank's unique optimizer state: ``(kind, name, lo, hi, values)`` with ``kind`` in
        ("exp_avg", "exp_avg_sq"), ``[lo, hi)`` a range of the flattened local shard of ``name``
        and ``values`` a 1-D view. Without ZeRO the dp=sp=0 rank holds whole tensors; with ZeRO-1
        every rank of dp x sp holds the pieces of its owned slices."""
        opt = self.optimizer
        if not self.cfg.parallel.zero:
            if self.writes_params:
                for name in self.params:
                    size = self.params[name].size
                    yield "exp_avg", name, 0, size, opt.m[name].reshape(-1)
                    yield "exp_avg_sq", name, 0, size, opt.v[name].reshape(-1)
            return
        for i, name, lo, hi, start in self._zero_pieces():
            yield "exp_avg", name, start, start + hi - lo, opt.m[i][lo:hi]
            yield "exp_avg_sq", name, start, start + hi - lo, opt.v[i][lo:hi]

    def _zero_pieces(self):
        """(bucket index, name, lo, hi, start in the flattened shard) of the owned slices."""
        red = self.reducer
        n, r = red.group.size, red.group.rank
        index = {id(b): i for i, b in enumerate(red.buckets)}
        for b, name, lo, hi in red.owned_pieces():
            L = b.grads.size // n
            yield index[id(b)], name, lo, hi, r * L + lo - b.offsets[name][0]

    @property
    def optimizer_step(self) -> int:
        return self.optimizer.step_count

    def load_state(self, read, step: int) -> None:
        """Set parameters and AdamW moments from global tensors: ``read(kind, name, region)``
        returns ``region`` of the global tensor (kind "param", "exp_avg" or "exp_avg_sq"), so a
        checkpoint of any layout loads into this one. ``step`` is the optimizer step count."""
        opt, zero = self.optimizer, self.cfg.parallel.zero
        pieces: dict[str, list] = {}
        for i, name, lo, hi, start in (self._zero_pieces() if zero else ()):
            pieces.setdefault(name, []).append((i, lo, hi, start))

        def shard(kind: str, name: str) -> np.ndarray:
            region, valid = self.local_region(name)
            full = np.zeros(self.params[name].shape, self.dtype)  # padding rows stay zero
            full[valid] = read(kind, name, region)
            return full

        for name, local in self.params.items():
            local[...] = shard("param", name)
            if not zero:
                opt.m[name][...] = shard("exp_avg", name)
                opt.v[name][...] = shard("exp_avg_sq", name)
            elif name in pieces:
                m, v = shard("exp_avg", name).reshape(-1), shard("exp_avg_sq", name).reshape(-1)
                for i, lo, hi, start in pieces[name]:
                    opt.m[i][lo:hi] = m[start:start + hi - lo]
                    opt.v[i][lo:hi] = v[start:start + hi - lo]
        opt.step_count = step

    def _owner_stage(self, spec: ParamSpec) -> int:
        """pp rank that holds ``spec``."""
        p, v = self.cfg.parallel.pp, self.cfg.parallel.virtual_stages
        return stage_owner(param_stage(spec, self.cfg.model.layers, p, v), p)[0]
