"""One rank's share of a run, built once from the resolved layout and a communicator.

``build_rank(layout, comm)`` returns a frozen :class:`Rank`: the process grid and its groups
(:class:`Comms`), the device and its kernels (:class:`Compute`), the data this rank reads
(:class:`RankData`), the model chunks with their seams (:class:`RankModel`), the weights with
their reducer and optimizer (:class:`Weights`) and the pipeline executors. It reads nothing but
its arguments, so it can be called again on another communicator (a smaller world). The step
that runs over a rank is :mod:`mpipar.training.step`; its batches, :mod:`mpipar.training.batches`.

The parts hold live objects (chunks, buffers, ledgers) that a step mutates; what is frozen is
which objects they are.
"""
from __future__ import annotations

from collections import ChainMap, Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from mpipar.checkpoint.activations import OffloadStore, offload_path
from mpipar.data.packing import packed_data
from mpipar.data.sft import loss_mask_source
from mpipar.data.sources import EvalSet, Sampler, TokenSource, load_tokens, training_batches
from mpipar.layout import Layout
from mpipar.model.attention import LocalAttention
from mpipar.model.llama import RESIDENT, LlamaStage
from mpipar.model.lora import (Adapters, FrozenGrads, FrozenParams, Lora, init_adapter,
                               is_adapter)
from mpipar.model.moe import RoutingBias
from mpipar.model.mtp import mtp_weights
from mpipar.model.params import init_param
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.parallel.sequence.registry import sequence_mode
from mpipar.parallel.data_parallel.buckets import ReduceGroups
from mpipar.parallel.data_parallel.reducer import GradReducer, warmup_steps
from mpipar.parallel.experts.exchange import ExpertParallel, SequenceExperts
from mpipar.parallel.experts.split import (ExpertSplitReducer, ExpertSplitUnits, expert_shards,
                                           expert_units)
from mpipar.parallel.fsdp.sharded import FrozenBaseScope, ShardedParams, node_copy_layout
from mpipar.parallel.pipeline.executor import PipelineExecutor
from mpipar.parallel.pipeline.schedule import build_schedule, forward_only, virtual_stage
from mpipar.parallel.placement import PlacementTable, expert_of
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
    par = layout.config.parallel
    ops = build_schedule(par.schedule, par.pp, layout.microbatches, par.virtual_stages)
    pp, chunks = comms.grid.coord.pp, list(model.chunks)
    executor = PipelineExecutor(ops=ops[pp], chunks=chunks, pp=comms.groups["pp"],
                                xp=compute.xp, scope=weights.sharded or RESIDENT)
    evaluator = PipelineExecutor(ops=forward_only(ops)[pp], chunks=chunks,
                                 pp=comms.groups["pp"], xp=compute.xp)
    return Rank(layout, comms, compute, data, model, weights, executor, evaluator)


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
    """The grid and its groups; the device (before any array: parameters, gradients, optimizer
    state and activations are allocated by the kernels' array module, CuPy's on cuda, on it)."""
    cfg = layout.config
    par, tr = cfg.parallel, cfg.train
    grid = ProcessGrid(comm, par.dp, par.tp, par.pp, par.sp, par.ranks_per_node)
    sequence_mode(par).split_grid(grid, par)
    device = select_device(tr.device, comm)
    kernels, attention = attention_kernels(
        cpu_gemm_kernels(training_backend(tr.backend, device.kind), tr),
        tr.attention_backend, cfg.model)
    mpi_path = choose_path(tr.cuda_aware_mpi, device.gpu)
    # dp x sp split by node: the hierarchical reduction, and ZeRO-3's copies on each node
    node_copy = node_copy_layout(par, device.gpu, grid.shape, grid.nodes, grid.rank)
    if reduction_of(par).hierarchical or (node_copy and node_copy[1] > 1):
        grid.split_dp_sp_by_node()
    ledger = Ledger()
    groups = {name: Group(c, name, ledger, grid.group_nodes(name), mpi_path,
                          par.allreduce_algorithm)
              for name, c in grid.comms.items()}
    _add_ep_groups(layout, groups, ledger, mpi_path)
    pool_freed_memory()  # host activations reuse freed memory, microbatch after microbatch
    precision = Precision.of(tr, par)
    comms = Comms(grid=grid, groups=groups, ledger=ledger, eval_ledger=Ledger(),
                  mpi_path=mpi_path, ep_rank=groups["ep"].rank if "ep_dp" in groups else 0,
                  node_copy=node_copy)
    compute = Compute(device=device, kernels=kernels, attention=attention, xp=kernels.xp,
                      precision=precision, dtype=numpy_dtype(precision.compute),
                      master_dtype=numpy_dtype(precision.master))
    return comms, compute


def _add_ep_groups(layout: Layout, groups: dict[str, Group], ledger: Ledger, mpi_path) -> None:
    """A mixture of experts: the ``ep`` group, --ep N consecutive ranks of dp x sp, and where
    the experts are sharded over it the ``ep_dp`` group, the ranks of dp x sp at the same
    position of their ep group, which hold the same experts (mpipar.parallel.experts)."""
    cfg = layout.config
    ep, dp_sp = cfg.parallel.ep, groups["dp_sp"]
    if cfg.model.moe_experts:
        comm = dp_sp.comm.Split(dp_sp.rank // ep, dp_sp.rank)
        first = dp_sp.rank // ep * ep
        groups["ep"] = Group(comm, "ep", ledger, dp_sp.nodes[first:first + ep], mpi_path)
    if expert_shards(layout) > 1:
        comm = dp_sp.comm.Split(dp_sp.rank % ep, dp_sp.rank)
        groups["ep_dp"] = Group(comm, "ep_dp", ledger, dp_sp.nodes[dp_sp.rank % ep::ep],
                                mpi_path)


def _model(layout: Layout, comms: Comms, compute: Compute) -> RankModel:
    """The placement table, the seams and this rank's chunks (one per virtual stage)."""
    cfg = layout.config
    par, tr, m = cfg.parallel, cfg.train, cfg.model
    groups, coord = comms.groups, comms.grid.coord
    lora = Lora.of(tr)
    table = PlacementTable(model=m, pp=par.pp, virtual_stages=par.virtual_stages,
                           zero=par.zero, tp_sequence_parallel=par.tp_sequence_parallel,
                           ep=expert_shards(layout), lora=lora)
    adapters = None if lora is None else Adapters(compute.kernels, lora, tr.seed, tr.seq_len)
    tensor = TensorParallel(kernels=compute.kernels, table=table, group=groups["tp"],
                            adapters=adapters)
    seq = SeqLayout(tr.seq_len, par.sp, par.sp_split, min_chunk=par.sp_min_chunk)
    routing = RoutingBias.of(m, compute.xp)   # every sparse block's, every rank
    # --recompute offload: one scratch file per rank for the saved activations.
    offload = (OffloadStore(offload_path(tr.run_dir, comms.grid.rank))
               if tr.recompute_mode.offloads else None)
    last = par.pp * par.virtual_stages - 1
    chunks = []
    for c in range(par.virtual_stages):
        stage = virtual_stage(coord.pp, c, par.pp)
        chunk = LlamaStage(cfg=m, kernels=compute.kernels, layers=table.stage_layers(stage),
                           first=stage == 0, last=stage == last, tp=tensor,
                           attention=_attention(layout, groups, compute.kernels, seq),
                           recompute=tr.recompute_mode, store=offload, seq_len=tr.seq_len,
                           experts=_experts(layout, groups, compute.xp, seq))
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
    ulysses = sequence_mode(par).work_group(seq.sp, par.ulysses_size)
    return RankModel(table=table, tensor=tensor, seq=seq, positions=seq.positions(coord.sp),
                     routing=routing, offload=offload, chunks=tuple(chunks), holders=holders,
                     ulysses=ulysses)


def _attention(layout: Layout, groups: Mapping[str, Group], kernels, seq: SeqLayout):
    """The attention core of a chunk: local, or this sp mode's over the sp group(s)."""
    par, sp = layout.config.parallel, groups["sp"]
    if sp.size == 1:
        return LocalAttention(kernels)
    return sequence_mode(par).core(kernels, dict(groups), seq, par)


def _experts(layout: Layout, groups: Mapping[str, Group], xp, seq: SeqLayout):
    """The sparse blocks' exchange: sequences over sp, experts over ep."""
    m, ep = layout.config.model, groups.get("ep")
    if ep is not None and ep.size > 1:
        return ExpertParallel(num_experts=m.moe_experts, sp=groups["sp"], ep=ep, xp=xp,
                              seq=seq, overlap=layout.config.parallel.ep_overlap)
    return SequenceExperts(num_experts=m.moe_experts, sp=groups["sp"], seq=seq)


def _weights(layout: Layout, comms: Comms, compute: Compute, model: RankModel) -> Weights:
    """The reducer (or the sharded units), the optimizer over it and the rank's state."""
    cfg = layout.config
    par, tr = cfg.parallel, cfg.train
    table, tensor = model.table, model.tensor
    names = [n for n in model.holders if table[n].trainable]
    tied = [n for n in names if table[n].tied_across_pipeline]
    initial = partial(_initial_shards, layout, table, tensor, compute.master_dtype)
    sharded = (_sharded(layout, comms, compute, model, tied, initial) if par.zero >= 2
               else None)
    reducer = sharded or _reducer(layout, comms.groups, compute, names, tied, initial)
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


def _sharded(layout: Layout, comms: Comms, compute: Compute, model: RankModel,
             tied: list[str], initial: Callable[[list[str]], dict[str, np.ndarray]]
             ) -> ShardedParams | ExpertSplitUnits:
    """ZeRO-2/3: the parameters as units sharded over dp x sp (:mod:`mpipar.parallel.fsdp`);
    tp-partial gradients are summed over tp before each unit's reduce-scatter, the ``tied``
    embedding's over the pipeline's ends after it. With the experts sharded over ep, this
    rank's experts are units of their own over ``ep_dp`` beside them
    (:class:`ExpertSplitUnits`)."""
    par, g, table, tensor = layout.config.parallel, comms.groups, model.table, model.tensor
    built: list = []              # the units, once built: their gradients are summed over tp

    def before_reduce(unit_names: list[str]) -> None:
        grads = built[0].grads
        tensor.reduce_partial_grads([grads[n] for n in unit_names
                                     if table[n].grad_partial_over_tp])

    group, node_groups = g["dp_sp"], None
    if comms.node_copy is not None:
        node_groups = ((group, None) if comms.node_copy[1] == 1 else
                       (g["dp_sp_intra"], g["dp_sp_inter"]))
        if not node_groups[0].on_one_node():   # as MPI sees them
            node_groups = None
    dense, experts = expert_units(table.units(comms.grid.coord.pp), table, comms.ep_rank)
    common = dict(gather=par.zero == 3, prefetch=par.zero_prefetch, xp=compute.xp,
                  before_reduce=before_reduce, compute_dtype=compute.dtype,
                  reduce_dtype=numpy_dtype(compute.precision.reduce))
    store = ShardedParams(lambda n: initial([n])[n], dense, group, tied=tied,
                          tied_group=g["pp_ends"], node_groups=node_groups, **common)
    if any(experts):
        store = ExpertSplitUnits(dense=store, experts=ShardedParams(
            lambda n: initial([n])[n], experts, g["ep_dp"], pool=store.pool, **common),
            ep=g["ep"])
    built.append(store)
    return store


def _reducer(layout: Layout, g: Mapping[str, Group], compute: Compute, names: list[str],
             tied: list[str], initial: Callable[[list[str]], dict[str, np.ndarray]]
             ) -> GradReducer | ExpertSplitReducer:
    """ZeRO-0/1: the gradient reducer over dp x sp: flat or hierarchical, dense or compressed;
    the ``tied`` embedding's copies then summed over ``pp_ends``. With the experts sharded over
    ep, this rank's experts have a flat reducer of their own over ``ep_dp`` beside it
    (:class:`ExpertSplitReducer`)."""
    par, xp, dtype = layout.config.parallel, compute.xp, compute.dtype
    reduce_dtype = numpy_dtype(compute.precision.reduce)
    experts = [n for n in names if expert_of(n) is not None]
    if "ep_dp" in g and experts:
        dense = _reducer(layout, g, compute, [n for n in names if expert_of(n) is None], tied,
                         initial)
        return ExpertSplitReducer(dense=dense, experts=GradReducer(
            initial(experts), list(reversed(experts)), ReduceGroups(g["ep_dp"], g["ep_dp"]),
            bucket_mb=par.bucket_mb, sharded=par.zero == 1, xp=xp, compute_dtype=dtype,
            reduce_dtype=reduce_dtype), ep=g["ep"])
    reduction = reduction_of(par)
    groups = (ReduceGroups(g["dp_sp"], g["dp_sp_inter"], g["dp_sp_intra"])
              if reduction.hierarchical else ReduceGroups(g["dp_sp"], g["dp_sp"]))
    return GradReducer(initial(names), list(reversed(names)), groups, bucket_mb=par.bucket_mb,
                       sharded=par.zero == 1, xp=xp,
                       codec=reduction.compression.codec(par.topk_ratio, xp),
                       feedback=reduction.feedback, tied=tied,
                       tied_group=g["pp_ends"], dense_steps=warmup_steps(layout),
                       compute_dtype=dtype, reduce_dtype=reduce_dtype)
