"""One rank's share of a run, built once from the resolved layout and a communicator.

``build_rank(layout, comm)`` returns a frozen :class:`Rank`: the process grid and its groups
(:class:`Comms`), the device and its kernels (:class:`Compute`), the data this rank reads
(:class:`RankData`), the model chunks with their seams (:class:`RankModel`), the weights with
their reducer and optimizer (:class:`Weights`) and the pipeline executors. It reads nothing but
its arguments, so it can be called again on another communicator (a smaller world). The step
that runs over a rank is :mod:`mpipar.training.step`; its batches, :mod:`mpipar.training.batches`.

What each parallel axis contributes, it builds itself: ``build_rank`` calls each phase's hooks
(:class:`mpipar.parallel.axis.RankHooks`: grid, groups, seams, weights, executors) over
:data:`mpipar.parallel.registry.AXES` and puts the parts they return where they belong; this
module names no axis.

The parts hold live objects (chunks, buffers, ledgers) that a step mutates; what is frozen is
which objects they are.
"""
from __future__ import annotations

from collections import ChainMap, Counter
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from mpipar.checkpoint.activations import OffloadStore, offload_path
from mpipar.data.packing import packed_data
from mpipar.data.sft import loss_mask_source
from mpipar.data.sources import EvalSet, Sampler, TokenSource, load_tokens, training_batches
from mpipar.layout import Layout
from mpipar.model.llama import LlamaStage
from mpipar.model.lora import FrozenGrads, FrozenParams, Lora, init_adapter, is_adapter
from mpipar.model.moe import RoutingBias
from mpipar.model.mtp import mtp_weights
from mpipar.model.params import init_param
from mpipar.parallel.axis import Parts
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.parallel.experts.split import ExpertSplitUnits, expert_shards
from mpipar.parallel.fsdp.sharded import FrozenBaseScope, ShardedParams
from mpipar.parallel.pipeline.executor import PipelineExecutor
from mpipar.parallel.pipeline.schedule import virtual_stage
from mpipar.parallel.placement import PlacementTable
from mpipar.parallel.registry import AXES
from mpipar.parallel.sequence_split import SeqLayout
from mpipar.parallel.tensor.ops import TensorParallel
from mpipar.runtime.comm import Group, Ledger
from mpipar.runtime.device import (attention_kernels, cpu_gemm_kernels, select_device,
                                   training_backend)
from mpipar.runtime.host_memory import pool_freed_memory
from mpipar.runtime.mpi_init import MPI
from mpipar.runtime.precision import Precision, numpy_dtype
from mpipar.runtime.staging import choose_path
from mpipar.runtime.topology import ProcessGrid
from mpipar.training.objective import Preference, preference
from mpipar.training.optim import AdamWConfig, LRSchedule
from mpipar.training.optimizers import optimizer_mode
from mpipar.training.state import TrainState


@dataclass(frozen=True)
class Comms:
    """This rank's place in the process grid, its groups (``tp``, ``pp``, ``dp_sp``, ... and,
    with a mixture of experts, ``ep`` / ``ep_dp``), the ledgers their calls are booked in (a
    training step's, the evaluation's), the MPI buffers' path, its position in its ep group (0
    without one), and ZeRO-3's copies on each node (:func:`mpipar.parallel.fsdp.node_copy_layout`,
    or None)."""
    grid: ProcessGrid
    groups: Mapping[str, Group]
    ledger: Ledger
    eval_ledger: Ledger
    mpi_path: Any
    ep_rank: int
    node_copy: tuple | None


@dataclass(frozen=True)
class Compute:
    """Where and in what this rank computes: the device, the kernels and their array module,
    the attention line of the start-up message, the precision (``dtype`` for compute copies,
    activations and messages; ``master_dtype`` for master weights and optimizer state)."""
    device: Any
    kernels: Any
    attention: str
    xp: Any
    precision: Precision
    dtype: np.dtype
    master_dtype: np.dtype


@dataclass(frozen=True)
class RankData:
    """What this rank reads: the token source, the training sampler, the validation set (or
    None), the EOS id of packed documents (or None), the ``--loss-mask`` masks (or None), and
    how a global batch falls to it (rows per dp rank, microbatches a step)."""
    source: TokenSource
    sampler: Sampler
    eval_set: EvalSet | None
    eos: int | None
    masks: Any
    rows_per_dp: int
    microbatches: int
    preference: Preference | None = None   # --objective dpo: its pairs; rows and microbatches
    #                                        above then count pairs, each two rows


@dataclass(frozen=True)
class RankModel:
    """This rank's model: the placement table, the tensor-parallel seam, the sequence split and
    this sp rank's positions, the routing biases, the offload store (--recompute offload), its
    chunks, the parameters it holds with the number of its chunks using each, and the size of
    its Ulysses group (1 without one)."""
    table: PlacementTable
    tensor: TensorParallel
    seq: SeqLayout
    positions: np.ndarray
    routing: RoutingBias
    offload: OffloadStore | None
    chunks: tuple[LlamaStage, ...]
    holders: Counter
    ulysses: int


@dataclass(frozen=True)
class Weights:
    """The parameters as this rank holds them: the gradient reducer (ZeRO-0/1) or the sharded
    units (ZeRO-2/3, ``sharded``, else None), the optimizer (``catch_up``: AdamW catching up
    what top-k held back), the rank seen as pieces of global tensors (checkpoints) and the LR
    schedule. ``frozen``: under LoRA the base weights this rank holds (its tp shards, in the
    compute dtype: no master copy, no gradient, no optimizer state; whole, or ZeRO-3's units),
    else None; ``sharded`` is then the scope over both (:class:`FrozenBaseScope`)."""
    reducer: Any
    sharded: ShardedParams | ExpertSplitUnits | FrozenBaseScope | None
    optimizer: Any
    catch_up: bool
    state: TrainState
    schedule: LRSchedule
    frozen: FrozenParams | ShardedParams | None


@dataclass(frozen=True)
class Rank:
    """Everything one rank needs to train (module docstring)."""
    layout: Layout
    comms: Comms
    compute: Compute
    data: RankData
    model: RankModel
    weights: Weights
    executor: PipelineExecutor       # the training schedule's ops of this pipeline rank
    evaluator: PipelineExecutor      # its forward-only ops

    @property
    def cfg(self):
        return self.layout.config

    @property
    def coord(self):
        """This rank's (dp, tp, pp, sp) coordinates."""
        return self.comms.grid.coord

    @property
    def ledger(self) -> Ledger:
        return self.comms.ledger

    @property
    def eval_ledger(self) -> Ledger:
        return self.comms.eval_ledger

    @property
    def state(self) -> TrainState:
        return self.weights.state

    @property
    def params(self) -> Mapping[str, Any]:
        """The parameters the chunks read: the trained ones, and the frozen base under LoRA."""
        w = self.weights
        return w.reducer.params if w.frozen is None else ChainMap(w.reducer.params,
                                                                   w.frozen.params)

    @property
    def grads(self) -> Mapping[str, Any]:
        """The gradients the chunks write (a frozen weight's go nowhere:
        :class:`mpipar.model.lora.FrozenGrads`)."""
        w = self.weights
        return w.reducer.grads if w.frozen is None else FrozenGrads(
            w.reducer.grads, frozenset(w.frozen.local_shapes()))


def build_rank(layout: Layout, comm: MPI.Comm, source: TokenSource | None = None) -> Rank:
    """This rank of ``layout`` (resolved: ``rules.validate``) over ``comm``; ``source``
    overrides ``train.data`` (tests, notebooks). The data is read first: a bad path or token id
    fails on every rank before any collective."""
    data = _data(layout, source)
    comms, compute = _comms_and_compute(layout, comm)
    model = _model(layout, comms, compute)
    weights = _weights(layout, comms, compute, model)
    run = _built("executors", layout, comms, compute, model, weights)
    return Rank(layout, comms, compute, data, model, weights, run["executor"], run["evaluator"])


def _built(phase: str, layout: Layout, *args: Any) -> Parts:
    """The parts every axis builds in ``phase`` (a :class:`mpipar.parallel.axis.RankHooks`
    field), asked in registry order; each hook sees what the axes before it built."""
    parts: Parts = {}
    for axis in AXES:
        hook = getattr(axis.build, phase)
        if hook is None:
            continue
        made = hook(layout, *args, dict(parts))
        twice = sorted(set(made) & set(parts))
        assert not twice, f"{phase}: {axis.name} builds {twice} again"
        parts.update(made)
    return parts


def _data(layout: Layout, source: TokenSource | None) -> RankData:
    cfg = layout.config
    tr = cfg.train
    source = source or load_tokens(tr.data or None, cfg.model.vocab_size, tr.seq_len)
    pref = preference(tr)
    sampler, eval_set = training_batches(source, tr, cfg.model.vocab_size)
    if pref is not None:   # the sampler draws pairs
        sampler = Sampler(source, tr.global_batch_size, tr.seed, tr.shuffle, pref.pairs)
    eos, masks = packed_data(tr, source, sampler.num_samples)  # end-of-text, --loss-mask
    if pref is not None:   # a preference file's loss_mask marks its responses
        masks = loss_mask_source(tr.data, tr.seq_len)
    return RankData(source=source, sampler=sampler, eval_set=eval_set, eos=eos, masks=masks,
                    rows_per_dp=layout.rows_per_dp, microbatches=layout.microbatches,
                    preference=pref)


def _comms_and_compute(layout: Layout, comm: MPI.Comm) -> tuple[Comms, Compute]:
    """The grid and its groups, the axes' first (:class:`RankHooks` ``grid``, ``groups``); the
    device (before any array: parameters, gradients, optimizer state and activations are
    allocated by the kernels' array module, CuPy's on cuda, on it)."""
    cfg = layout.config
    par, tr = cfg.parallel, cfg.train
    grid = ProcessGrid(comm, par.dp, par.tp, par.pp, par.sp, par.ranks_per_node)
    device = select_device(tr.device, comm)
    kernels, attention = attention_kernels(
        cpu_gemm_kernels(training_backend(tr.backend, device.kind), tr),
        tr.attention_backend, cfg.model)
    mpi_path = choose_path(tr.cuda_aware_mpi, device.gpu)
    on_grid = _built("grid", layout, grid, device)    # sp sub-groups, dp x sp by node
    ledger = Ledger()
    groups = {name: Group(c, name, ledger, grid.group_nodes(name), mpi_path,
                          par.allreduce_algorithm)
              for name, c in grid.comms.items()}
    groups.update(_built("groups", layout, groups, ledger, mpi_path))   # ep, ep_dp
    pool_freed_memory()  # host activations reuse freed memory, microbatch after microbatch
    precision = Precision.of(tr, par)
    comms = Comms(grid=grid, groups=groups, ledger=ledger, eval_ledger=Ledger(),
                  mpi_path=mpi_path, ep_rank=groups["ep"].rank if "ep_dp" in groups else 0,
                  node_copy=on_grid["node_copy"])
    compute = Compute(device=device, kernels=kernels, attention=attention, xp=kernels.xp,
                      precision=precision, dtype=numpy_dtype(precision.compute),
                      master_dtype=numpy_dtype(precision.master))
    return comms, compute


def _model(layout: Layout, comms: Comms, compute: Compute) -> RankModel:
    """The placement table, the axes' seams (:class:`RankHooks` ``seams``) and this rank's
    chunks (one per virtual stage)."""
    cfg = layout.config
    par, tr, m = cfg.parallel, cfg.train, cfg.model
    coord = comms.grid.coord
    table = PlacementTable(model=m, pp=par.pp, virtual_stages=par.virtual_stages,
                           zero=par.zero, tp_sequence_parallel=par.tp_sequence_parallel,
                           ep=expert_shards(layout), lora=Lora.of(tr))
    seams = _built("seams", layout, comms, compute, table)
    routing = RoutingBias.of(m, compute.xp)   # every sparse block's, every rank
    # --recompute offload: one scratch file per rank for the saved activations.
    offload = (OffloadStore(offload_path(tr.run_dir, comms.grid.rank))
               if tr.recompute_mode.offloads else None)
    last = par.pp * par.virtual_stages - 1
    chunks = []
    for c in range(par.virtual_stages):
        stage = virtual_stage(coord.pp, c, par.pp)
        chunk = LlamaStage(cfg=m, kernels=compute.kernels, layers=table.stage_layers(stage),
                           first=stage == 0, last=stage == last, tp=seams["tensor"],
                           attention=seams["attention"](),
                           recompute=tr.recompute_mode, store=offload, seq_len=tr.seq_len,
                           experts=seams["experts"]())
        # Each row's balance loss weighs alpha / rows of the global batch (mpipar.model.moe).
        chunk.moe_aux_weight = m.moe_aux_loss_coef / tr.global_batch_size
        chunk.moe_bias = routing.biases      # shared: the update reaches every chunk
        if chunk.mtp is not None:            # each module's token weight (mpipar.model.mtp)
            chunk.mtp.weights = mtp_weights(m, tr.global_batch_size, tr.seq_len)
        chunks.append(chunk)
    # The parameters this rank holds, each with the number of its chunks that use it (a
    # parameter two chunks use, the tied embedding with pp = 1, is held once); under --ep only
    # its ep position's experts (mpipar.parallel.experts).
    holders = Counter(n for c in range(par.virtual_stages)
                      for n in table.stage_names(virtual_stage(coord.pp, c, par.pp))
                      if table.holds(n, comms.ep_rank))
    return RankModel(table=table, tensor=seams["tensor"], seq=seams["seq"],
                     positions=seams["positions"], routing=routing, offload=offload,
                     chunks=tuple(chunks), holders=holders, ulysses=seams["ulysses"])


def _weights(layout: Layout, comms: Comms, compute: Compute, model: RankModel) -> Weights:
    """The trained parameters' holder (:class:`RankHooks` ``weights``: the reducer, or the
    sharded units), the optimizer over it and the rank's state."""
    cfg = layout.config
    par, tr = cfg.parallel, cfg.train
    table, tensor = model.table, model.tensor
    names = [n for n in model.holders if table[n].trainable]
    tied = [n for n in names if table[n].tied_across_pipeline]
    initial = partial(_initial_shards, layout, table, tensor, compute.master_dtype)
    held = _built("weights", layout, comms, compute, model, names, tied, initial)
    sharded = held.get("sharded")
    reducer = sharded or held["reducer"]
    frozen = _frozen(layout, comms, compute, model) if table.lora is not None else None
    if isinstance(frozen, ShardedParams):
        sharded = FrozenBaseScope(sharded, frozen)
    decay = {n: len(table[n].spec.shape) >= 2 for n in names}
    # Top-k sums with error feedback: AdamW moves a coordinate by the steps it waited.
    catch_up = reduction_of(par).catches_up and sharded is None and reducer.sends_sparse
    optimizer = optimizer_mode(tr).build(par.zero, reducer,
                                         AdamWConfig(tr.lr, tr.beta1, tr.beta2, tr.eps,
                                                     tr.weight_decay), decay, catch_up, tr,
                                         table, comms.groups["tp"])
    state = TrainState(reducer, optimizer, table, tp_rank=tensor.rank, tp_size=tensor.size,
                       pp_rank=comms.grid.coord.pp, dtype=compute.master_dtype)
    return Weights(reducer=reducer, sharded=sharded, optimizer=optimizer, catch_up=catch_up,
                   state=state, schedule=LRSchedule.of(tr), frozen=frozen)


def _frozen(layout: Layout, comms: Comms, compute: Compute, model: RankModel
            ) -> FrozenParams | ShardedParams:
    """LoRA's frozen base in the compute dtype (no master copy): whole on this rank, or under
    ZeRO-3 units sharded over dp x sp, gathered around their use and never reduced."""
    table, tensor, par = model.table, model.tensor, layout.config.parallel

    def initial(names: list[str]) -> dict[str, Any]:
        return {n: v.astype(compute.dtype) for n, v in
                _initial_shards(layout, table, tensor, compute.master_dtype, names).items()}

    if par.zero < 3:
        names = [n for n in model.holders if not table[n].trainable]
        return FrozenParams({n: compute.xp.asarray(v) for n, v in initial(names).items()},
                            compute.xp)
    g = comms.groups
    return ShardedParams(lambda n: initial([n])[n], table.units(comms.grid.coord.pp, False),
                         g["dp_sp"], gather=True, prefetch=par.zero_prefetch, xp=compute.xp,
                         before_reduce=lambda names: None,
                         tied=[n for n in model.holders if table[n].tied_across_pipeline],
                         tied_group=g["pp_ends"], compute_dtype=compute.dtype, frozen=True)


def _initial_shards(layout: Layout, table: PlacementTable, tensor: TensorParallel,
                    master_dtype: np.dtype, names: list[str]) -> dict[str, np.ndarray]:
    """This rank's shards of the initial master parameters (every layout starts from the same
    global tensors, :func:`mpipar.model.params.init_param`)."""
    model, seed = layout.config.model, layout.config.train.seed

    def value(n: str) -> np.ndarray:
        spec = table[n].spec
        return init_adapter(spec, seed) if is_adapter(n) else init_param(spec, model, seed)

    return {n: table[n].shard(value(n).astype(master_dtype), tensor.rank, tensor.size)
            for n in names}
