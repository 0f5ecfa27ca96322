"""The training engine: builds one rank's share of everything and runs one step at a time.

``Engine(layout, comm)`` builds, from a resolved :class:`~mpipar.layout.Layout`, the process
grid and its groups, the
kernels, the placement of every parameter (:mod:`mpipar.parallel.placement`), this rank's model chunks
with their tensor-parallel and attention seams, the flat gradient buckets, the optimizer and the
pipeline executor; ``engine.train_step(k)`` runs optimizer step ``k`` (0-based) and returns its
:class:`StepResult`, identical on every rank. ``engine.evaluate()`` computes the validation loss
(:class:`EvalResult`) under the same layout, forward only: the schedule's forward-only op list
(:func:`mpipar.parallel.pipeline.schedule.forward_only`), no gradient buffers touched, nothing
kept for a backward, its traffic booked in ``engine.eval_ledger`` (reset at each pass, so
``engine.ledger`` holds exactly a training step's traffic, and each ledger what the planner
predicts for its phase). ``engine.state`` is the same rank seen as pieces
of global tensors, for checkpoints (:mod:`mpipar.training.state`); ``engine.run_position(step)``
is the rest a checkpoint records (:mod:`mpipar.checkpoint.records`): checkpoints and activation
dumps see the engine only through these.

One step, as data flows (docs/architecture.md): this DP rank takes its rows of the global batch,
cuts them into microbatches and this SP rank's sequence chunk; each microbatch runs forward and
backward through the stage; gradients are summed over dp x sp (experts sharded over ep: over
ep_dp, :mod:`mpipar.parallel.experts`); the global norm is summed over
tp x pp counting each parameter once; clipping and the optimizer update the local shards. The
loss is the mean over every token of the global batch, whatever the layout. A tied embedding's
copies on the first and last pipeline stage have their gradients summed over ``pp_ends`` by the
reducer, count once in the norm, and stay identical.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
from mpipar.runtime.mpi_init import MPI

from mpipar.checkpoint.activations import (ActivationRecorder, ActivationRegion, OffloadStore,
                                           dump_step, offload_path)
from mpipar.checkpoint.records import DataCursor, LRScheduleState, RankPlace, RunPosition
from mpipar.checkpoint.shards import require_finite
from mpipar.runtime.device import attention_kernels, select_device, to_host, training_backend
from mpipar.runtime.host_memory import pool_freed_memory
from mpipar.runtime.comm import Group, Ledger, booked_to
from mpipar.layout import Layout
from mpipar.observe.metrics import EvalResult, StepResult
from mpipar.data.sources import TokenSource, load_tokens, training_batches
from mpipar.data.packing import counted_targets, eos_id, sample_indices, uses_eos
from mpipar.data.sft import loss_mask_source
from mpipar.model.attention import DocumentPositions, LocalAttention, document_ids
from mpipar.model.llama import RESIDENT, LlamaStage
from mpipar.model.moe import RoutingBias
from mpipar.model.flops import model_flops_per_step
from mpipar.model.params import init_param
from mpipar.training.optim import AdamWConfig, LRSchedule, build_optimizer
from mpipar.parallel.compression import make_codec
from mpipar.parallel.context import (HaloAttention, HybridAttention, RingAttention,
                                     UlyssesAttention)
from mpipar.parallel.sequence_split import SeqLayout, rank_work
from mpipar.parallel.data_parallel import GradReducer, ReduceGroups, warmup_steps
from mpipar.parallel.experts import (ExpertParallel, ExpertSplitReducer, ExpertSplitUnits,
                                     SequenceExperts, expert_shards, expert_units)
from mpipar.parallel.fsdp import ShardedParams, node_copy_layout
from mpipar.parallel.pipeline.executor import Microbatch, PipelineExecutor
from mpipar.parallel.pipeline.schedule import build_schedule, forward_only, virtual_stage
from mpipar.parallel.tensor import TensorParallel
from mpipar.parallel.placement import PlacementTable, expert_of
from mpipar.runtime.precision import Precision, numpy_dtype
from mpipar.runtime.staging import choose_path
from mpipar.training.state import TrainState
from mpipar.runtime.topology import ProcessGrid


class Engine:
    """Everything one rank needs to train: grid, groups, chunks, shards, optimizer, sampler."""

    def __init__(self, layout: Layout, comm: MPI.Comm | None = None,
                 source: TokenSource | None = None) -> None:
        """``layout``: the run's resolved :class:`~mpipar.layout.Layout` (``rules.validate``);
        ``source`` overrides ``train.data`` (tests, notebooks)."""
        comm = MPI.COMM_WORLD if comm is None else comm
        self.layout = layout
        self.cfg = cfg = layout.config
        par, tr = cfg.parallel, cfg.train
        # Data first: a bad path or token id fails on every rank before any collective.
        self.source = source or load_tokens(tr.data or None, cfg.model.vocab_size, tr.seq_len)
        self.sampler, self.eval_set = training_batches(self.source, tr, cfg.model.vocab_size)
        self.eos = eos_id(tr) if uses_eos(tr) else None   # packed documents' end-of-text
        self.masks = loss_mask_source(tr.data, tr.seq_len) if tr.loss_mask else None  # SFT
        self.grid = ProcessGrid(comm, par.dp, par.tp, par.pp, par.sp, par.ranks_per_node)
        if par.sp_mode == "hybrid":
            self.grid.split_sp(par.ulysses_size)
        # The device before any array: parameters, gradients, optimizer state and activations
        # are allocated by the kernels' array module (CuPy's on cuda) on it.
        self.device = select_device(tr.device, comm)
        self.kernels, self.attention = attention_kernels(
            training_backend(tr.backend, self.device.kind), tr.attention_backend, cfg.model)
        self.xp = self.kernels.xp
        self.mpi_path = choose_path(tr.cuda_aware_mpi, self.device.kind == "cuda")
        # dp x sp split by node: the hierarchical reduction, and ZeRO-3's copies on each node
        self.node_copy = node_copy_layout(par, self.device.kind == "cuda", self.grid.shape,
                                          self.grid.nodes, self.grid.rank)
        if par.dp_reduce == "hierarchical" or (self.node_copy and self.node_copy[1] > 1):
            self.grid.split_dp_sp_by_node()
        self.ledger, self.eval_ledger = Ledger(), Ledger()
        self.groups = {name: Group(c, name, self.ledger, self.grid.group_nodes(name),
                                   self.mpi_path, par.allreduce_algorithm)
                       for name, c in self.grid.comms.items()}
        self._add_ep_group()
        pool_freed_memory()  # host activations reuse freed memory, microbatch after microbatch
        # Compute copies, activations and messages in ``dtype``; master weights, gradients and
        # optimizer state in ``master_dtype`` (float32 under bf16: mpipar.runtime.precision).
        self.precision = Precision.of(tr, par)
        self.dtype = numpy_dtype(self.precision.compute)
        self.master_dtype = numpy_dtype(self.precision.master)
        self.table = PlacementTable(
            model=cfg.model, pp=par.pp, virtual_stages=par.virtual_stages, zero=par.zero,
            tp_sequence_parallel=par.tp_sequence_parallel, ep=expert_shards(layout))
        self.tensor = TensorParallel(kernels=self.kernels, table=self.table,
                                     group=self.groups["tp"])
        self.seq_layout = SeqLayout(tr.seq_len, par.sp, par.sp_split,
                                    min_chunk=par.sp_min_chunk)
        self.positions = self.seq_layout.positions(self.grid.coord.sp)
        self.routing = RoutingBias.of(cfg.model, self.xp)   # every sparse block's, every rank
        # --recompute offload: one scratch file per rank for the saved activations.
        self.offload = (OffloadStore(offload_path(tr.run_dir, self.grid.rank))
                        if tr.recompute == "offload" else None)
        self.chunks = [self._chunk(virtual_stage(self.grid.coord.pp, c, par.pp))
                       for c in range(par.virtual_stages)]
        self.holders = self._holders()
        names = list(self.holders)
        self._unfinished: Counter[str] = Counter()  # chunks yet to finish each gradient (a step)
        tied = [n for n in names if self.table[n].tied_across_pipeline]
        self.sharded = self._sharded(tied) if par.zero >= 2 else None
        self.reducer = self.sharded or self._reducer(names, tied)
        self.params, self.grads = self.reducer.params, self.reducer.grads
        decay = {n: len(self.table[n].spec.shape) >= 2 for n in names}
        # Top-k sums with error feedback: AdamW moves a coordinate by the steps it waited.
        self.catch_up = (par.topk_catch_up == "on" and self.sharded is None
                         and self.reducer.sends_sparse)
        self.optimizer = build_optimizer(par.zero, self.reducer,
                                         AdamWConfig(tr.lr, tr.beta1, tr.beta2, tr.eps,
                                                     tr.weight_decay), decay, self.catch_up)
        self.state = TrainState(self.reducer, self.optimizer, self.table,
                                tp_rank=self.tensor.rank, tp_size=self.tensor.size,
                                pp_rank=self.grid.coord.pp, dtype=self.master_dtype)
        self.schedule = LRSchedule.of(tr)
        self.rows_per_dp = layout.rows_per_dp
        self.microbatches = layout.microbatches
        ops = build_schedule(par.schedule, par.pp, self.microbatches, par.virtual_stages)
        self.executor = PipelineExecutor(ops=ops[self.grid.coord.pp], chunks=self.chunks,
                                         pp=self.groups["pp"], xp=self.xp,
                                         scope=self.sharded or RESIDENT)
        self.evaluator = PipelineExecutor(ops=forward_only(ops)[self.grid.coord.pp],
                                          chunks=self.chunks, pp=self.groups["pp"], xp=self.xp)

    def _chunk(self, stage: int) -> LlamaStage:
        """The model chunk of global virtual ``stage``, with this rank's seams."""
        last = self.cfg.parallel.pp * self.cfg.parallel.virtual_stages - 1
        m = self.cfg.model
        chunk = LlamaStage(cfg=m, kernels=self.kernels,
                           layers=self.table.stage_layers(stage), first=stage == 0,
                           last=stage == last, tp=self.tensor, attention=self._attention(),
                           recompute=self.cfg.train.recompute, store=self.offload,
                           seq_len=self.cfg.train.seq_len,
                           experts=self._experts())
        # Each row's balance loss weighs alpha / rows of the global batch (mpipar.model.moe).
        chunk.moe_aux_weight = m.moe_aux_loss_coef / self.cfg.train.global_batch_size
        chunk.moe_bias = self.routing.biases      # shared: the update reaches every chunk
        return chunk

    def _holders(self) -> Counter[str]:
        """The parameters this rank holds, each with the number of its chunks that use it (a
        parameter two chunks use, the tied embedding with pp = 1, is held once); under --ep
        only its ep position's experts (mpipar.parallel.experts)."""
        self.ep_rank = self.groups["ep"].rank if "ep_dp" in self.groups else 0
        return Counter(n for ch in self.chunks for n in ch.param_names()
                       if self.table.holds(n, self.ep_rank))

    def _add_ep_group(self) -> None:
        """--ep N: the ``ep`` group, N consecutive ranks of dp x sp, and where the experts are
        sharded over it the ``ep_dp`` group, the ranks of dp x sp at the same position of
        their ep group, which hold the same experts (mpipar.parallel.experts)."""
        ep, dp_sp = self.cfg.parallel.ep, self.groups["dp_sp"]
        if self.cfg.model.moe_experts:
            comm = dp_sp.comm.Split(dp_sp.rank // ep, dp_sp.rank)
            first = dp_sp.rank // ep * ep
            self.groups["ep"] = Group(comm, "ep", self.ledger, dp_sp.nodes[first:first + ep],
                                      self.mpi_path)
        if expert_shards(self.layout) > 1:
            comm = dp_sp.comm.Split(dp_sp.rank % ep, dp_sp.rank)
            self.groups["ep_dp"] = Group(comm, "ep_dp", self.ledger,
                                         dp_sp.nodes[dp_sp.rank % ep::ep], self.mpi_path)

    def _experts(self):
        """The sparse blocks' exchange: sequences over sp, experts over ep."""
        m, ep = self.cfg.model, self.groups.get("ep")
        if ep is not None and ep.size > 1:
            return ExpertParallel(num_experts=m.moe_experts, sp=self.groups["sp"], ep=ep,
                                  xp=self.xp, seq=self.seq_layout,
                                  overlap=self.cfg.parallel.ep_overlap)
        return SequenceExperts(num_experts=m.moe_experts, sp=self.groups["sp"],
                               seq=self.seq_layout)

    def _attention(self):
        par, sp = self.cfg.parallel, self.groups["sp"]
        if sp.size == 1:
            return LocalAttention(self.kernels)
        if par.sp_mode == "ulysses":
            return UlyssesAttention(self.kernels, sp, self.seq_layout)
        if par.sp_mode == "halo":
            return HaloAttention(self.kernels, sp, self.seq_layout)
        if par.sp_mode == "hybrid":
            return HybridAttention(self.kernels, self.groups["sp_ulysses"], self.groups["sp_ring"],
                                   self.seq_layout, par.sp_overlap)
        return RingAttention(self.kernels, sp, self.seq_layout, par.sp_overlap)

    def _sharded(self, tied: list[str]) -> ShardedParams | ExpertSplitUnits:
        """ZeRO-2/3: the parameters as units sharded over dp x sp (:mod:`mpipar.parallel.fsdp`);
        tp-partial gradients are summed over tp before each unit's reduce-scatter, the ``tied``
        embedding's over the pipeline's ends after it. With the experts sharded over ep, this
        rank's experts are units of their own over ``ep_dp`` beside them
        (:class:`ExpertSplitUnits`)."""
        par, g = self.cfg.parallel, self.groups

        def before_reduce(unit_names: list[str]) -> None:
            self.tensor.reduce_partial_grads([self.grads[n] for n in unit_names
                                              if self.table[n].grad_partial_over_tp])

        group, node_groups = g["dp_sp"], None
        if self.node_copy is not None:
            node_groups = ((group, None) if self.node_copy[1] == 1 else
                           (g["dp_sp_intra"], g["dp_sp_inter"]))
            if not node_groups[0].on_one_node():   # as MPI sees them
                node_groups = None
        dense, experts = expert_units(self.table.units(self.grid.coord.pp), self.table,
                                      self.ep_rank)
        common = dict(gather=par.zero == 3, prefetch=par.zero_prefetch, xp=self.xp,
                      before_reduce=before_reduce, compute_dtype=self.dtype,
                      reduce_dtype=numpy_dtype(self.precision.reduce))
        store = ShardedParams(lambda n: self._initial_shards([n])[n], dense, group, tied=tied,
                              tied_group=g["pp_ends"], node_groups=node_groups, **common)
        if not any(experts):
            return store
        return ExpertSplitUnits(dense=store, experts=ShardedParams(
            lambda n: self._initial_shards([n])[n], experts, g["ep_dp"], pool=store.pool,
            **common), ep=g["ep"])

    def _reducer(self, names: list[str], tied: list[str]) -> GradReducer | ExpertSplitReducer:
        """ZeRO-0/1: the gradient reducer over dp x sp: flat or hierarchical, dense or
        compressed; the ``tied`` embedding's copies then summed over ``pp_ends``. With the
        experts sharded over ep, this rank's experts have a flat reducer of their own over
        ``ep_dp`` beside it (:class:`ExpertSplitReducer`)."""
        par, g = self.cfg.parallel, self.groups
        experts = [n for n in names if expert_of(n) is not None]
        if "ep_dp" in g and experts:
            dense = self._reducer([n for n in names if expert_of(n) is None], tied)
            return ExpertSplitReducer(dense=dense, experts=GradReducer(
                self._initial_shards(experts), list(reversed(experts)),
                ReduceGroups(g["ep_dp"], g["ep_dp"]), bucket_mb=par.bucket_mb,
                sharded=par.zero == 1, xp=self.xp, compute_dtype=self.dtype,
                reduce_dtype=numpy_dtype(self.precision.reduce)), ep=g["ep"])
        groups = (ReduceGroups(g["dp_sp"], g["dp_sp_inter"], g["dp_sp_intra"])
                  if par.dp_reduce == "hierarchical" else ReduceGroups(g["dp_sp"], g["dp_sp"]))
        return GradReducer(self._initial_shards(names), list(reversed(names)), groups,
                           bucket_mb=par.bucket_mb, sharded=par.zero == 1, xp=self.xp,
                           codec=make_codec(par.grad_compression, par.topk_ratio, self.xp),
                           feedback=par.error_feedback == "on", tied=tied,
                           tied_group=g["pp_ends"], dense_steps=warmup_steps(self.layout),
                           compute_dtype=self.dtype,
                           reduce_dtype=numpy_dtype(self.precision.reduce))

    def _initial_shards(self, names: list[str]) -> dict[str, np.ndarray]:
        """This rank's shards of the initial master parameters (every layout starts from the
        same global tensors, :func:`mpipar.model.params.init_param`)."""
        model, seed = self.cfg.model, self.cfg.train.seed
        return {n: self.table[n].shard(init_param(self.table[n].spec, model, seed)
                                       .astype(self.master_dtype), self.tensor.rank,
                                       self.tensor.size)
                for n in names}

    # ------------------------------------------------------------------- step
    def _norm_counted(self, name: str) -> bool:
        """Count each parameter once in the global norm: replicated ones on TP rank 0 only, a
        tied embedding on its first pipeline rank only."""
        return self.table[name].owned_by(self.tensor.rank, self.grid.coord.pp)

    def _grads_ready(self, names: list[str]) -> None:
        """A chunk has finished the gradients of ``names`` for the step; those every chunk of
        this rank that uses them has finished are final: sum the tp-partial ones over tp, then
        let the data-parallel reducer launch their buckets (and sum the tied ones over
        ``pp_ends`` when it finishes)."""
        final = []
        for n in names:
            self._unfinished[n] -= 1
            if not self._unfinished[n]:
                final.append(n)
        self.tensor.reduce_partial_grads([self.grads[n] for n in final
                                          if self.table[n].grad_partial_over_tp])
        self.reducer.ready(final)

    def _microbatches(self, batch: Callable[[int, slice], tuple], k: int) -> list[Microbatch]:
        """This rank's microbatches of global batch ``k`` of ``batch`` (the sampler's, or the
        validation set's): its DP rows, its SP positions, moved to the backend's array module
        once each."""
        d, rows, mbs = self.grid.coord.dp, self.rows_per_dp, self.cfg.train.micro_batch_size
        inputs, targets = batch(k, slice(d * rows, (d + 1) * rows))
        masks = self._masks(batch, k, slice(d * rows, (d + 1) * rows))
        out = []
        for i in range(self.microbatches):
            rows = slice(i * mbs, (i + 1) * mbs)
            positions, counted = self._packed(inputs[rows], None if masks is None
                                              else masks[rows])
            at = self.positions if positions is None else np.asarray(positions)
            out.append(Microbatch(self.xp.asarray(inputs[rows][:, at]),
                                  self.xp.asarray(targets[rows][:, at]), positions,
                                  None if counted is None else self.xp.asarray(counted[:, at])))
        return out

    def _masks(self, batch: Callable[[int, slice], tuple], k: int, rows: slice
               ) -> np.ndarray | None:
        """``--loss-mask``: the loss masks ``[rows, S + 1]`` of those rows' samples."""
        if self.masks is None:
            return None
        return self.masks.sample(sample_indices(batch.__self__, k, rows))

    def _packed(self, inputs: np.ndarray, masks: np.ndarray | None = None) -> tuple[Any, Any]:
        """(DocumentPositions or None, counted targets ``[mbs, S]`` or None) of a microbatch
        whose whole input rows ``[mbs, S]`` are ``inputs`` (:mod:`mpipar.data.packing`); under
        ``--sp-split balanced`` the positions are this microbatch's split's."""
        tr, positions = self.cfg.train, None
        if tr.document_masking:
            docs = document_ids(inputs, self.eos)
            split = self.seq_layout.for_microbatch(docs)
            if split is self.seq_layout:        # one split for every microbatch
                positions = DocumentPositions.of(self.positions, docs, None)
            else:
                positions = DocumentPositions.of(split.positions(self.grid.coord.sp), docs, split)
        return positions, counted_targets(inputs, tr, self.eos, masks)

    def _attention_imbalance(self, docs_all: np.ndarray | None) -> float | None:
        """Max/mean of the sp ranks' attention work (causal pairs inside documents, within
        each layer's sliding window; a Ulysses group's work shared by its members) in a step
        whose global batch has documents ``docs_all`` ``[rows, S]``, the worst dp replica's;
        every rank has the whole batch (no message)."""
        tr, seq, par = self.cfg.train, self.seq_layout, self.cfg.parallel
        if docs_all is None or seq.sp == 1:
            return None
        ulysses = {"ulysses": seq.sp, "hybrid": par.ulysses_size}.get(par.sp_mode, 1)
        windows = Counter(self.cfg.model.windows())
        mbs, worst = tr.micro_batch_size, 1.0
        for replica in range(self.layout.dp):
            work = 0
            for i in range(self.microbatches):
                first = replica * self.rows_per_dp + i * mbs
                docs = docs_all[first:first + mbs]
                split = seq.for_microbatch(docs)
                work = work + sum(n * rank_work(split, docs, w, ulysses)
                                  for w, n in windows.items())
            worst = max(worst, float(work.max() / work.mean()))
        return worst

    def _loss_divisor(self, batch: Callable[[int, slice], tuple], k: int) -> int:
        """The targets of global batch ``k`` of ``batch`` that carry loss (every rank reads the
        whole batch's inputs: the count is layout-invariant and needs no message)."""
        tr = self.cfg.train
        if not (tr.eod_mask_loss or tr.loss_mask):
            return tr.global_batch_size * tr.seq_len
        counted = counted_targets(batch(k, slice(None))[0], tr, self.eos,
                                  self._masks(batch, k, slice(None)))
        return max(1, int(counted.sum()))

    def train_step(self, step: int) -> StepResult:
        """Run optimizer step ``step`` (0-based) and return its result (the same on every rank)."""
        t0 = time.perf_counter()
        tr, xp = self.cfg.train, self.xp
        micro = self._microbatches(self.sampler.batch, step)
        tokens = tr.global_batch_size * tr.seq_len
        mbs, s_loc = tr.micro_batch_size, len(self.positions)
        counted = self._loss_divisor(self.sampler.batch, step)
        weight = xp.full((mbs, s_loc), 1.0 / counted)
        recorder = self._start_dump(step)
        self.reducer.start_step(step)
        self._unfinished = Counter(self.holders)
        for ch in self.chunks:
            ch.moe_aux, ch.moe_load, ch.moe_dropped = 0.0, {}, {}
        loss = self.executor.run(self.params, self.grads, micro, self.positions,
                                 self.tensor.stream_shape(mbs, s_loc, self.cfg.model.hidden),
                                 self.dtype, weight,
                                 on_ready=None if self.sharded else self._grads_ready)
        self.reducer.finish()
        if recorder is not None:
            for ch in self.chunks:
                ch.recorder = None
            dump_step(recorder, self.rank_place, self._activation_region(step + 1), self.cfg)
        loss = self._global_sum(loss) / counted
        moe, loads = self._moe_stats() if self.cfg.model.moe_experts else (None, None)
        norm_sq = xp.array([self.optimizer.grad_norm_sq(self._norm_counted)])
        self.groups["tp_pp"].allreduce_(norm_sq)
        grad_norm = math.sqrt(float(norm_sq[0]))
        lr = self.schedule(step)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.clip(tr.clip_grad, grad_norm)
            self.optimizer.step(lr)
            if self.routing.rate:
                self.routing.update(loads)
                moe["moe_bias_max_abs"] = self.routing.max_abs()
        # Otherwise (the same on every rank, after the reductions) no update is applied; the
        # caller skips the step or stops (--on-nan).
        docs = (document_ids(self.sampler.batch(step)[0], self.eos) if tr.document_masking
                else None)                          # the global batch's, read once for both
        return StepResult(step + 1, loss, grad_norm, lr, time.perf_counter() - t0, tokens,
                          self._attention_imbalance(docs), moe,
                          None if docs is None else model_flops_per_step(self.cfg, docs))

    def _moe_stats(self) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
        """The step's balance loss (alpha x the mean over rows of the sum over sparse layers)
        and each sparse layer's expert load, max over mean; and the loads themselves
        (``{layer: [E]}``, tokens of the global batch routed to each expert: the routing
        biases' update), and the assignments each sparse layer's capacity dropped: the chunks'
        shares summed over the world, each counted on tp rank 0 only (tp ranks compute the
        same), on every rank."""
        m = self.cfg.model
        sparse = [i for i in range(m.layers) if m.is_sparse(i)]
        n, E = len(sparse), m.moe_experts
        buf = self.xp.zeros(1 + n * (E + 1))
        if self.tensor.rank == 0:
            for ch in self.chunks:
                buf[0] += ch.moe_aux
                for i, load in ch.moe_load.items():
                    j = 1 + sparse.index(i) * E
                    buf[j:j + E] += load
                    buf[1 + n * E + sparse.index(i)] += ch.moe_dropped.get(i, 0)
        self.groups["dp_sp"].allreduce_(buf)
        self.groups["tp_pp"].allreduce_(buf)
        buf = to_host(buf)
        loads = buf[1:1 + n * E].reshape(n, E)
        rows = self.cfg.train.global_batch_size
        return ({"moe_aux_loss": m.moe_aux_loss_coef * float(buf[0]) / rows,
                 "moe_load_max_over_mean": {str(i): float(ld.max() / ld.mean())
                                            for i, ld in zip(sparse, loads)},
                 "moe_dropped": {str(i): int(d) for i, d in zip(sparse, buf[1 + n * E:])}},
                dict(zip(sparse, loads)))

    def _global_sum(self, loss: float) -> float:
        """The sum over the world of the last stage's summed token losses (over dp x sp, then
        broadcast from the last pipeline stage), on every rank."""
        buf = self.groups["dp_sp"].allreduce_(self.xp.array([loss]))
        return float(self.groups["pp"].bcast_(buf, root=self.cfg.parallel.pp - 1)[0])

    def evaluate(self) -> EvalResult:
        """The mean token loss over the validation batches (``--eval-batches``), computed under
        this layout forward only (module docstring); the same on every rank."""
        if self.eval_set is None:
            raise ValueError("evaluate: no validation set (--eval-data or --eval-fraction)")
        t0 = time.perf_counter()
        tr = self.cfg.train
        shape = self.tensor.stream_shape(tr.micro_batch_size, len(self.positions),
                                         self.cfg.model.hidden)

        def stage_forward(chunk: LlamaStage, inp: Any, mb: Microbatch) -> Any:
            return chunk.forward_only(self.params, inp,
                                      self.positions if mb.positions is None else mb.positions,
                                      mb.targets, scope=self.sharded or RESIDENT)

        total = 0.0
        self.eval_ledger.reset()
        with booked_to(self.groups.values(), self.eval_ledger), \
                (self.sharded.forward_only() if self.sharded else nullcontext()):
            for k in range(self.eval_set.batches):
                micro = self._microbatches(self.eval_set.batch, k)
                losses = self.evaluator.run_forward(micro, shape, self.dtype, stage_forward)
                total += sum(float((losses[i] if micro[i].counted is None
                                    else losses[i] * micro[i].counted).sum())
                             for i in sorted(losses))
            tokens = sum(self._loss_divisor(self.eval_set.batch, k)
                         for k in range(self.eval_set.batches))
            loss = self._global_sum(total) / tokens
        try:
            perplexity = math.exp(loss)
        except OverflowError:
            perplexity = math.inf
        return EvalResult(loss, perplexity, tokens, time.perf_counter() - t0)

    def _start_dump(self, step: int) -> ActivationRecorder | None:
        """--dump-activations: a recorder installed on every chunk for this step, or None. With
        tp sequence parallelism the stream tensors are all-gathered over tp for the dump."""
        if step + 1 not in self.cfg.dump_steps:
            return None
        recorder = ActivationRecorder.for_schedule(self.executor.ops, self.chunks)
        shape = (self.cfg.train.micro_batch_size, len(self.positions), -1)

        def record(layer: int, name: str, value: Any) -> None:
            if self.tensor.sequence_parallel and name != "attention":
                value = self.tensor.enter(value).reshape(shape)
            recorder(layer, name, value)

        for ch in self.chunks:
            ch.recorder = record
        return recorder

    # ------------------------------------------------------------- what checkpoints see
    @property
    def rank_place(self) -> RankPlace:
        """This rank's place in the process grid."""
        g = self.grid
        return RankPlace(rank=g.rank, world_size=g.comm.Get_size(), coord=g.coord,
                         sizes=(g.dp, g.tp, g.pp, g.sp))

    def run_position(self, step: int) -> RunPosition:
        """Where the run stands after ``step`` training steps: the configuration, this rank's
        place, the LR schedule's state, the data cursor and the routing biases (what a
        checkpoint records besides ``self.state``)."""
        s, tr = self.schedule, self.cfg.train
        lr = LRScheduleState(kind=s.kind, lr=s.lr, min_lr=s.min_lr, warmup_steps=s.warmup_steps,
                             total_steps=s.total_steps, decay_fraction=s.decay_fraction,
                             decay_shape=s.decay_shape, decay_start=s.decay_start,
                             next_step=step, next_lr=s(step))
        data = DataCursor(path=str(self.source.path), seed=tr.seed, shuffle=tr.shuffle,
                          global_batch_size=tr.global_batch_size, seq_len=tr.seq_len,
                          num_samples=self.source.num_samples, next_step=step,
                          samples_consumed=step * tr.global_batch_size,
                          eval_fraction=tr.eval_fraction,
                          train_samples=self.sampler.num_samples)
        return RunPosition(step=step, config=self.cfg, place=self.rank_place, lr_schedule=lr,
                           data=data, moe_bias=self.routing.host())

    def _activation_region(self, step: int) -> ActivationRegion:
        """The part of step ``step``'s (1-based) global activations this rank's dump holds: its
        dp rows and their samples, its sp positions, its tp heads."""
        c, rows_per_dp, tp = self.grid.coord, self.rows_per_dp, self.groups["tp"]
        rows = np.arange(c.dp * rows_per_dp, (c.dp + 1) * rows_per_dp)
        heads = self.cfg.model.heads // tp.size
        return ActivationRegion(step=step, rows=rows,
                                samples=self.sampler.indices(step - 1)[rows],
                                positions=np.asarray(self.positions, dtype=np.int64),
                                segments=np.asarray(self.seq_layout.segments(c.sp),
                                                    dtype=np.int64),
                                heads=(tp.rank * heads, (tp.rank + 1) * heads))

    def close(self) -> None:
        """Release what outlives steps: the offload scratch file (removed) and the grid's and
        the reducer's communicators (MPI has a few thousand per process). The engine makes no
        MPI call after it."""
        if self.offload is not None:
            self.offload.close()
        self.reducer.close()
        for name in ("ep", "ep_dp"):
            if name in self.groups:
                self.groups[name].comm.Free()
        self.grid.free()

    # ---------------------------------------------------------------- global tensors
    def gather_params(self) -> dict[str, np.ndarray]:
        """Every global parameter (the master weights), assembled from all shards, on every rank
        (tests, export)."""
        tp, pp = self.groups["tp"], self.groups["pp"]
        params = self.reducer.master_tensors()
        out = {}
        for placement in self.table:
            owner = self.table.pipeline_rank(placement.name)
            held = self.table.holds(placement.name, self.ep_rank)
            if held and pp.rank == owner:
                local = self.xp.ascontiguousarray(params[placement.name])
                pieces = self.xp.empty((tp.size,) + local.shape, local.dtype)
                tp.allgather(local, pieces)
                full = np.ascontiguousarray(placement.unshard(list(to_host(pieces))))
            else:
                full = np.empty(placement.spec.shape, self.master_dtype)
            if held:
                full = pp.bcast_(full, root=owner)
            if self.table.ep > 1 and expert_of(placement.name) is not None:
                # an expert held at one ep position (tp and pp ranks alike hold it or not)
                full = self.groups["ep"].bcast_(full, root=self.table.expert_owner(placement.name))
            out[placement.name] = full
        return out

    def load_params(self, values: dict[str, np.ndarray], source: str = "load_params") -> None:
        """Overwrite this rank's shards from global tensors (every name the model has, global
        shapes as in :func:`mpipar.model.params.param_specs`), cast to the master dtype (the
        compute copies follow). A tensor holding a NaN or an infinity (after the cast) raises
        :class:`~mpipar.checkpoint.shards.NonFiniteError` naming ``source`` and the tensor.
        Collective-free."""
        missing = sorted(p.name for p in self.table if p.name not in values)
        if missing:
            raise ValueError(f"load_params: missing parameters {missing[:5]}")
        for name in self.reducer.local_shapes():
            placement, value = self.table[name], np.asarray(values[name])
            if value.shape != placement.spec.shape:
                raise ValueError(f"load_params: {name} has shape {value.shape}, the model needs "
                                 f"{placement.spec.shape}")
            value = value.astype(self.master_dtype)
            require_finite(value, f"{source}: parameter {name}")
            self.reducer.load_local(name, placement.shard(value, self.tensor.rank,
                                                          self.tensor.size))
