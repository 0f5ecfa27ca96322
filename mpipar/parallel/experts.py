"""The sparse blocks' exchange over the grid (:class:`mpipar.model.moe.ExpertExchange`), the
experts' weights sharded over ep, and the mixture of experts' configuration rules.

Expert parallelism (``--ep N``): groups of N consecutive ranks of dp x sp split the experts,
E/N each (:class:`ExpertParallel`); tokens travel to their experts' ranks and back by
all-to-all(v) over the ``ep`` group. As Megatron and DeepSpeed do, a rank *holds* only the E/N
experts it computes (:func:`expert_shards`, :meth:`mpipar.parallel.placement.PlacementTable.holds`):
their weights, gradients and AdamW moments; the dense weights as without ep. The ranks holding
the same experts are those at the same position of their ep group, ``dp_sp.rank % N`` equal:
the ``ep_dp`` group (Megatron's expert data parallel group, dp x sp / N ranks). The experts'
gradients are reduced over ``ep_dp`` only, by a store of their own beside the dense one
(:class:`ExpertSplitReducer`), each ZeRO stage over its own replica group:

- ZeRO-0/1: a flat, uncompressed reducer over ``ep_dp`` (ZeRO-1 reduce-scatters them and the
  optimizer keeps ``1/|ep_dp|`` of their moments);
- ZeRO-2/3 (:class:`ExpertSplitUnits`): the experts of each sparse block are a unit of their
  own (:func:`expert_units`) sharded over ``ep_dp`` as :mod:`mpipar.parallel.fsdp` shards the
  dense units over dp x sp: gradients reduce-scattered over ``ep_dp``, ``1/|ep_dp|`` of their
  masters and moments a rank, and at ZeRO-3 ``1/|ep_dp|`` of their weights, the unit gathered
  over ``ep_dp`` around its block's forward and backward (beside the dense unit's gather over
  dp x sp; in node shared memory the dense units only, the experts' still gathered).

Under ``--grad-compression`` (ZeRO-0/1) the dense gradients are compressed over dp x sp as
without ep, the experts' reduced exactly over ``ep_dp`` beside them (their residuals zero in
checkpoints; a checkpoint's expert residuals from a run that compressed them are not carried).

The sum over the replicas is the sum over every token of the global batch routed to the
expert, so the update equals the one-process run. The global gradient norm adds the experts'
share summed over ep (each expert on one ep position). Checkpoints stay global tensors: an
expert is reported by the rank 0 of its ``ep_dp`` group (sharded stages: the owners of its
slices), and every rank reads only its own experts, whatever ep and ZeRO stage wrote them.

A sequence split over sp has its balance-loss statistics summed over the sp group (the ranks
holding the other tokens of the same rows), so the loss and its gradient do not depend on the
split. Experts are unsplit by tp: each tp rank holds its experts whole (role ``replicated`` in
the placement table) and computes the sparse FFN on the whole stream it holds, as the tp ranks
do for the norms; its gradients are the same on every tp rank and counted once (tp rank 0).
"""
from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from mpipar.config import ConfigError
from mpipar.kernels import expert_routing
from mpipar.layout import Layout
from mpipar.model.moe import Done, LocalExperts, Plan, Transfer
from mpipar.parallel.sequence_split import SeqLayout, balanced_chunks, split_parts
from mpipar.parallel.data_parallel.reducer import padded_size, plan_buckets
from mpipar.parallel.fsdp.cost import sharded_calls
from mpipar.parallel.fsdp.sharded import Units
from mpipar.parallel.placement import PlacementTable, expert_of
from mpipar.parallel.axis import AxisUnit, StepRank
from mpipar.parallel.calls import Call, element_bytes
from mpipar.runtime.comm import Group, Request
from mpipar.runtime.precision import Precision

Array = Any


def block_length(seq: SeqLayout) -> int:
    """The length ``L`` of the position blocks ``[j L, (j+1) L)`` that every sp rank's share of
    a sequence is a union of, whatever the microbatch: ``S / sp`` (contiguous; Ulysses and
    hybrid split as it or zigzag), ``S / (2 sp)`` (zigzag), the finest chunk of ``--sp-split
    balanced`` (its deals' chunks are unions of it). The capacity's per-sequence counts are
    summed over sp per block."""
    if seq.split == "balanced":
        per = seq.seq_len // seq.sp
        return per // balanced_chunks(per, seq.min_chunk)
    return seq.seq_len // split_parts(seq.sp, seq.split)


class SequenceExperts(LocalExperts):
    """Every expert on this rank; a sequence's statistics summed over the ``sp`` group, whose
    ranks hold the sequence as ``seq`` says (None: whole sequences). The rows stay on the rank
    (:class:`~mpipar.model.moe.LocalExperts`' plan and transfers)."""

    def __init__(self, *, num_experts: int, sp: Group, seq: SeqLayout | None = None) -> None:
        super().__init__(num_experts)
        self.sp, self.seq = sp, seq

    def sequence_sum(self, a: Array) -> Array:
        """``a`` ``[..., B, E]`` summed over sp (a new contiguous array)."""
        return self.sp.allreduce_(a.copy())

    def blocks(self, positions: np.ndarray) -> tuple[int, int]:
        """(``L``, ``G``): the sequences cut into ``G`` blocks of ``L`` positions, each held
        whole by one sp rank (:func:`block_length`)."""
        if self.seq is None:
            return int(np.max(positions)) + 1, 1
        L = block_length(self.seq)
        return L, self.seq.seq_len // L


class ExpertParallel(SequenceExperts):
    """Experts split over the ``ep`` group (consecutive ranks of dp x sp): this rank computes
    experts ``[r E/ep, (r+1) E/ep)`` for the tokens of every rank of its group. The plan: the
    counts per (rank, local expert) (all-to-all); the rows then travel by all-to-all-v, regrouped
    by local expert (this rank's own rows first, then the other source ranks' in order, each
    source's rows in its order); the way back and the gradients' retrace the same plan.
    ``overlap`` (``parallel.ep_overlap``, the default): the all-to-all-v are non-blocking
    (``Ialltoallv``), the sparse block computing what needs no message while they travel
    (:func:`mpipar.model.moe.experts_fwd`); else blocking. The same bytes either way."""

    def __init__(self, *, num_experts: int, sp: Group, ep: Group, xp,
                 seq: SeqLayout | None = None, overlap: bool = True) -> None:
        super().__init__(num_experts=num_experts, sp=sp, seq=seq)
        self.ep, self.xp, self.per_rank, self.overlap = ep, xp, num_experts // ep.size, overlap
        self.local_experts = range(ep.rank * self.per_rank, (ep.rank + 1) * self.per_rank)

    def plan(self, counts: Array) -> Plan:
        n, el, r = self.ep.size, self.per_rank, self.ep.rank
        mine = np.ascontiguousarray(expert_routing.host(counts).reshape(n, el))    # [dest, local e]
        theirs = self.ep.alltoall(mine, np.empty_like(mine))              # [source, local e]
        send_rows, recv_rows = mine.sum(axis=1).tolist(), theirs.sum(axis=1).tolist()
        starts = np.cumsum(np.r_[0, theirs.reshape(-1)[:-1]]).reshape(n, el)
        sources = [r] + [i for i in range(n) if i != r]                   # own rows first
        regroup = np.concatenate([np.arange(starts[i, e], starts[i, e] + theirs[i, e])
                                  for e in range(el) for i in sources]).astype(np.int64)
        handle = (send_rows, recv_rows, self.xp.asarray(regroup))
        bounds = [0] + np.cumsum(theirs.sum(axis=0)).tolist()
        return Plan(bounds, theirs[r].tolist(), sum(send_rows[:r]), handle)

    def send(self, xs: Array, plan: Plan) -> Transfer:
        send_rows, recv_rows, regroup = plan.handle
        recv = self.xp.empty((sum(recv_rows),) + xs.shape[1:], xs.dtype)
        return self._start(self.xp.ascontiguousarray(xs), send_rows, recv, recv_rows,
                           lambda rows: rows[regroup])

    def send_back(self, ys: Array, plan: Plan) -> Transfer:
        send_rows, recv_rows, regroup = plan.handle
        back = self.xp.empty_like(ys)
        back[regroup] = ys
        out = self.xp.empty((sum(send_rows),) + ys.shape[1:], ys.dtype)
        return self._start(back, recv_rows, out, send_rows, lambda rows: rows)

    def _start(self, send: Array, send_rows: list[int], recv: Array, recv_rows: list[int],
               then) -> Transfer:
        """The all-to-all-v of rows ``send`` -> ``recv``, non-blocking under ``overlap``; the
        transfer's rows are ``then(recv)``."""
        if not self.overlap:
            return Done(then(self.ep.alltoallv(send, send_rows, recv, recv_rows)))
        return Arriving(self.ep.ialltoallv(send, send_rows, recv, recv_rows), recv, then)


class Arriving:
    """Rows on their way: a request, its receive buffer, and what the rows are of it."""

    def __init__(self, request: Request, recv: Array, then) -> None:
        self.request, self.recv, self.then, self.rows = request, recv, then, None

    def test(self) -> bool:
        return self.request.test()

    def wait(self) -> Array:
        if self.rows is None:
            self.request.wait()
            self.rows = self.then(self.recv)
        return self.rows


def expert_calls(layout: Layout, layers: list[int], passes: int, train: bool) -> list[Call]:
    """The sparse blocks' MPI calls of a rank holding blocks ``layers`` in a step (``train``) or
    a validation pass of ``passes`` forwards per chunk, with *uniform routing* (each expert gets
    ``A / E`` of a rank's ``A`` assignments; the ledger's real loads differ): per sparse block
    and forward, the counts' sum over sp (all-reduce), and under ep the counts (all-to-all) and
    the rows there and back (two all-to-all-v, each the ``A (ep-1)/ep`` rows to other ranks;
    non-blocking under ``parallel.ep_overlap``, the default);
    backward sends the gradients' rows there and back again, and ``--recompute full`` repeats
    the forward's calls. A training step with the experts sharded over ep adds their gradient
    reduction over ``ep_dp`` (:func:`expert_reduction_calls`). With ``--moe-capacity-factor``
    the counts' sum over sp is per position block (:func:`block_length`); the rows the
    all-to-all-v carry stay the dropless prediction (drops only shrink them)."""
    m, p, t = layout.config.model, layout.config.parallel, layout.config.train
    sparse = sum(1 for i in layers if m.is_sparse(i))
    forwards = passes * t.recompute_mode.forward_runs(train)
    dt = element_bytes(Precision.of(t, p).compute)
    tokens = layout.micro_batch_size * (t.seq_len // p.sp)
    blocks = (t.seq_len // block_length(SeqLayout(t.seq_len, p.sp, p.sp_split,
                                                  min_chunk=p.sp_min_chunk))
              if m.moe_capacity_factor and p.sp > 1 else 1)
    stats = element_bytes(Precision.of(t, p).master)   # the router's dtype: float32 under bf16
    calls = [Call("sp", "allreduce", blocks * layout.micro_batch_size * m.moe_experts * stats,
                  sparse * forwards)] if p.sp > 1 else []
    if p.ep > 1:
        rows = tokens * m.moe_top_k * (p.ep - 1) // p.ep
        rows_op = "ialltoallv" if p.ep_overlap else "alltoallv"
        calls += [Call("ep", "alltoall", m.moe_experts * 8, sparse * forwards),
                  Call("ep", rows_op, rows * m.hidden * dt,
                       sparse * (2 * forwards + 2 * passes * train))]
    if train:
        calls += expert_reduction_calls(layout, layers)
    return calls


def expert_shards(layout: Layout) -> int:
    """The ep positions the experts' weights, gradients and moments are sharded over: ``ep``,
    at every ZeRO stage and under gradient compression (the dense gradients compressed over
    dp x sp, the experts' reduced exactly over ``ep_dp``). The one home of this rule."""
    return layout.config.parallel.ep


def expert_units(chunks: Units, table: PlacementTable, ep_rank: int) -> tuple[Units, Units]:
    """ZeRO-2/3 with the experts sharded over ep (``table.ep`` > 1): ``chunks`` (a rank's
    units, :meth:`~mpipar.parallel.placement.PlacementTable.units`) split into the dense units
    (every unit without its experts: sharded over dp x sp) and the experts' units (of each
    sparse block, the experts of ep position ``ep_rank``, under the block's unit name: sharded
    over ``ep_dp``). Unsharded experts: (``chunks``, no expert units)."""
    if table.ep == 1:
        return chunks, [[] for _ in chunks]
    dense = [[(u, [n for n in names if expert_of(n) is None]) for u, names in units]
             for units in chunks]
    experts = [[(u, mine) for u, names in units
                if (mine := [n for n in names if expert_of(n) is not None
                             and table.holds(n, ep_rank)])]
               for units in chunks]
    return dense, experts


def expert_bucket_lengths(layout: Layout, layers: list[int]) -> list[int]:
    """Elements of each flat bucket of expert gradients a rank holding blocks ``layers`` lays
    out (:class:`ExpertSplitReducer`'s expert reducer: E/ep experts of each sparse block, three
    ``F x H`` tensors each, in ``bucket_mb`` buckets padded to a multiple of ``ep_dp``); none
    when the experts are not sharded, or are units (ZeRO-2/3: :func:`expert_unit_calls`)."""
    m, p = layout.config.model, layout.config.parallel
    shards = expert_shards(layout)
    if shards == 1 or p.zero >= 2:
        return []
    n = 3 * (m.moe_experts // shards) * sum(1 for i in layers if m.is_sparse(i))
    size, e = m.moe_ffn_hidden * m.hidden, Precision.of(layout.config.train, p).master_bytes
    limit = max(1, int(p.bucket_mb * 2**20))
    return [padded_size(size * len(idx), layout.dp * layout.sp // shards)
            for idx in plan_buckets([size * e] * n, limit)] if n else []


def expert_reduction_calls(layout: Layout, layers: list[int]) -> list[Call]:
    """A training step's calls for the experts' gradients of a rank holding blocks ``layers``
    when they are sharded over ep: per bucket an all-reduce over ``ep_dp`` (ZeRO-1: a
    reduce-scatter, then the parameters' all-gather in the compute dtype), in the reduce dtype;
    and the experts' share of the squared gradient norm summed over ``ep_dp`` (ZeRO-1) and
    over ``ep``."""
    lengths = expert_bucket_lengths(layout, layers)
    if not lengths:
        return []
    p, prec = layout.config.parallel, Precision.of(layout.config.train, layout.config.parallel)
    r = layout.dp * layout.sp // expert_shards(layout)
    calls = [Call("ep", "allreduce", 8)]
    if r == 1:
        return calls
    for length in lengths:
        calls.append(Call("ep_dp", "ireduce_scatter" if p.zero else "iallreduce",
                          length * prec.reduce_bytes))
        if p.zero:
            calls.append(Call("ep_dp", "allgather", length // r * prec.compute_bytes))
    return calls + ([Call("ep_dp", "allreduce", 8)] if p.zero else [])


def expert_unit_calls(layout: Layout, *, lengths: dict[str, int],
                      entered: list[tuple[str, int]], kept: set[str], passes: int,
                      backward: bool) -> list[Call]:
    """ZeRO-2/3 with the experts sharded over ep: the calls of a rank whose experts' units have
    ``lengths`` elements (:func:`expert_units`, padded to a multiple of ``ep_dp``), whose
    passes enter ``entered`` (:func:`mpipar.parallel.fsdp.cost.unit_passes`: the units without
    experts are skipped) and which keeps ``kept`` of them gathered from forward to backward:
    :func:`mpipar.parallel.fsdp.cost.sharded_calls` over ``ep_dp`` (never in node shared memory);
    a training step adds the experts' share of the squared gradient norm summed over ``ep_dp``
    and over ``ep``. Nothing over an ``ep_dp`` of one rank."""
    if not lengths:
        return []
    r = layout.dp * layout.sp // expert_shards(layout)
    calls = [Call("ep", "allreduce", 8)] if backward else []
    if r == 1:
        return calls
    calls += sharded_calls(layout, lengths=lengths, entered=[(u, k) for u, k in entered
                                                               if u in lengths],
                           kept=kept, copy=None, tied=False, passes=passes,
                           backward=backward, group="ep_dp", shards=r)
    return calls + ([Call("ep_dp", "allreduce", 8)] if backward else [])


class ExpertSplitReducer:
    """The experts sharded over ep: the ``dense`` store over dp x sp (every dense weight, as
    without ep) beside the ``experts`` store over ``ep_dp`` (this rank's experts; ``ep``: the
    group the experts are split over), seen as one store (what the engine, the optimizer's
    publish and :class:`mpipar.training.state.TrainState` ask of a :class:`GradReducer`).
    ZeRO-0/1: two :class:`GradReducer` (under ``--grad-compression`` the dense one compresses,
    the experts' is exact); ZeRO-2/3: :class:`ExpertSplitUnits`. ``params`` and ``grads`` are
    live views of both (ZeRO-3 binds a unit's while it is entered). Residuals (compression)
    are the dense reducer's only."""

    def __init__(self, *, dense: Any, experts: Any, ep: Group) -> None:
        self.dense, self.experts, self.ep = dense, experts, ep
        self.xp, self.group = dense.xp, dense.group
        self.params = ChainMap(dense.params, experts.params)
        self.grads = ChainMap(dense.grads, experts.grads)
        self._of = {n: experts for n in experts.local_shapes()}

    @property
    def sends_sparse(self) -> bool:
        return self.dense.sends_sparse

    @property
    def sparse_sums(self) -> bool:
        return self.dense.sparse_sums

    def start_step(self, step: int = 0) -> None:
        self.dense.start_step(step)
        self.experts.start_step(step)

    def ready(self, names: list[str]) -> None:
        self.dense.ready([n for n in names if n not in self._of])
        self.experts.ready([n for n in names if n in self._of])

    def finish(self) -> None:
        self.dense.finish()
        self.experts.finish()

    def gather_params(self) -> None:
        self.dense.gather_params()
        self.experts.gather_params()

    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**self.dense.local_shapes(), **self.experts.local_shapes()}

    def master_tensors(self) -> dict[str, Any]:
        return {**self.dense.master_tensors(), **self.experts.master_tensors()}

    def param_pieces(self):
        yield from self.dense.param_pieces()
        yield from self.experts.param_pieces()

    def load_local(self, name: str, value: Any) -> None:
        self._of.get(name, self.dense).load_local(name, value)

    def residual_pieces(self):
        """The dense reducer's residuals, and zeros for the experts (reduced exactly: nothing
        owed) in every residual kind, where the experts' parameters are reported, so that each
        kind tiles every parameter in a checkpoint."""
        yield from self.dense.residual_pieces()
        kinds = self.dense.residual_kinds()
        for name, lo, hi, values in (self.experts.param_pieces() if kinds else ()):
            zeros = self.xp.zeros(hi - lo, values.dtype)
            for kind in kinds:
                yield kind, name, lo, hi, zeros

    def load_residuals(self, local, kinds: set[str]) -> None:
        """The dense reducer's (a checkpoint's residuals of the experts, written by a run that
        compressed them, are not carried: these experts are reduced exactly)."""
        self.dense.load_residuals(local, kinds)

    def close(self) -> None:
        self.dense.close()
        self.experts.close()

    def describe(self) -> str:
        return (f"{self.dense.describe()}; experts sharded over ep, reduced over ep_dp "
                f"({self.experts.group.size} ranks)")


class ExpertSplitUnits(ExpertSplitReducer):
    """ZeRO-2/3 with the experts sharded over ep: the dense units over dp x sp and the
    experts' units over ``ep_dp`` (two :class:`mpipar.parallel.fsdp.sharded.ShardedParams` sharing one
    buffer pool), and the model's scope over both: entering a block's unit enters its dense
    unit, then its experts' (each store gathers and prefetches along its own units); leaving
    it leaves both in that order, so every rank of dp x sp posts the dense collectives, and
    every rank of ``ep_dp`` the experts', in one order. No residuals (no compression)."""

    @property
    def pool(self):
        return self.dense.pool

    @property
    def shared_bytes(self) -> int:
        return self.dense.shared_bytes

    def _experts_of(self, units: Sequence[str]) -> list[str]:
        return [u for u in units if u in self.experts.units]

    @contextmanager
    def using(self, units: Sequence[str], backward: bool,
              grads_final: bool = True) -> Iterator[None]:
        with self.dense.using(units, backward, grads_final), \
                self.experts.using(self._experts_of(units), backward, grads_final):
            yield

    def weights_done(self, units: list[str]) -> None:
        self.dense.weights_done(units)
        self.experts.weights_done(self._experts_of(units))

    def progress(self) -> None:
        self.dense.progress()
        self.experts.progress()

    @contextmanager
    def forward_only(self) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(self.dense.forward_only())
            stack.enter_context(self.experts.forward_only())
            yield

    def release(self) -> None:
        self.dense.release()
        self.experts.release()

    def residual_pieces(self):
        return ()

    def load_residuals(self, local, kinds: set[str]) -> None:
        return None

    def describe(self) -> str:
        return (f"{self.dense.describe()}; experts sharded over ep, {len(self.experts.units)} "
                f"units of them sharded over ep_dp ({self.experts.group.size} ranks)")


def check_config(layout: Layout) -> None:
    """The mixture of experts' rules with the layout: the bias update rate and the capacity
    factor are >= 0 and need experts when > 0 (their finiteness:
    :func:`mpipar.config.check_fields`); the sparse FFN runs on whole
    token rows, so not on tp sequence parallelism's token shards; its record is not offloaded."""
    m, p, t = layout.config.model, layout.config.parallel, layout.config.train
    if p.ep < 1:
        raise ConfigError(f"parallel.ep={p.ep}: must be >= 1")
    if m.moe_bias_update_rate < 0:
        raise ConfigError(f"model.moe_bias_update_rate={m.moe_bias_update_rate}: must be >= 0 "
                          "(0: no auxiliary-loss-free balancing)")
    if m.moe_bias_update_rate > 0 and not m.moe_experts:
        raise ConfigError(f"model.moe_bias_update_rate={m.moe_bias_update_rate}: needs a "
                          "mixture of experts (--moe-experts > 0)")
    if not m.moe_capacity_factor >= 0:
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor}: must be >= 0 "
                          "(0: dropless)")
    if m.moe_capacity_factor > 0 and not m.moe_experts:
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor}: needs a "
                          "mixture of experts (--moe-experts > 0)")
    if p.ep > 1 and not m.moe_experts:
        raise ConfigError(f"parallel.ep={p.ep}: needs a mixture of experts (--moe-experts)")
    if not m.moe_experts:
        return
    if m.moe_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep}: must divide model.moe_experts={m.moe_experts}")
    if (layout.dp * layout.sp) % p.ep:
        raise ConfigError(f"parallel.ep={p.ep}: must divide dp x sp = {layout.dp} x "
                          f"{layout.sp} (the expert-parallel group is carved out of dp x sp)")
    if p.tp_sequence_parallel and p.tp > 1:
        raise ConfigError("model.moe_experts with parallel.tp_sequence_parallel: not supported "
                          "(the sparse FFN needs whole token rows; experts are unsplit by tp)")
    if t.recompute_mode.offloads:
        raise ConfigError(f"model.moe_experts with train.recompute={t.recompute!r}: not "
                          f"supported (use none, selective or full)")
    if m.moe_shared_ffn_hidden % p.tp:   # the shared expert is split as the dense FFN
        raise ConfigError(f"parallel.tp={p.tp}: must divide model.moe_shared_ffn_hidden="
                          f"{m.moe_shared_ffn_hidden}")


def _expert_traffic(rank: StepRank) -> list[Call]:
    layout, calls = rank.layout, []
    if layout.parallel.zero >= 2:
        calls += expert_unit_calls(layout, lengths=rank.expert_unit_lengths,
                                   entered=rank.entered, kept=rank.expert_kept_units,
                                   passes=rank.passes, backward=rank.train)
    if layout.config.model.moe_experts:
        calls += expert_calls(layout, [i for c in rank.chunk_layers for i in c], rank.passes,
                              rank.train)
    return calls


EXPERTS = AxisUnit("experts", check_config, _expert_traffic)
"""The expert axis: the sparse blocks' exchange over sp and ep, the experts sharded over ep."""
