"""What the expert axis costs a rank: the sparse blocks' calls over sp and ep, the experts'
buckets and reduction over ``ep_dp``, and (for the memory model) the expert record a sparse
block keeps."""
from __future__ import annotations

import math

from mpipar.layout import Layout
from mpipar.model.lora import Lora
from mpipar.model.params import block_param_specs, expert_names
from mpipar.model.recompute import Recompute
from mpipar.parallel.axis import Footprint, Held, StepRank
from mpipar.parallel.calls import Call, element_bytes
from mpipar.parallel.data_parallel.buckets import padded_size, plan_buckets
from mpipar.parallel.experts.exchange import block_length
from mpipar.parallel.experts.split import expert_shards
from mpipar.parallel.fsdp.cost import sharded_calls, unit_buffer_bytes
from mpipar.parallel.sequence_split import SeqLayout
from mpipar.runtime.precision import Precision


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
    tokens = layout.micro_rows * (t.seq_len // p.sp)
    blocks = (t.seq_len // block_length(SeqLayout(t.seq_len, p.sp, p.sp_split,
                                                  min_chunk=p.sp_min_chunk))
              if m.moe_capacity_factor and p.sp > 1 else 1)
    stats = element_bytes(Precision.of(t, p).master)   # the router's dtype: float32 under bf16
    calls = [Call("sp", "allreduce", blocks * layout.micro_rows * m.moe_experts * stats,
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


def expert_bucket_lengths(layout: Layout, layers: list[int]) -> list[int]:
    """Elements of each flat bucket of expert gradients a rank holding blocks ``layers`` lays
    out (:class:`~mpipar.parallel.experts.split.ExpertSplitReducer`'s expert reducer: E/ep
    experts of each sparse block, their trained tensors each (:func:`_expert_trained_sizes`),
    in ``bucket_mb`` buckets padded to a multiple of ``ep_dp``); none when the experts are not
    sharded, or are units (ZeRO-2/3: :func:`expert_unit_calls`), or train nothing (LoRA
    without the experts' targets)."""
    m, p = layout.config.model, layout.config.parallel
    shards = expert_shards(layout)
    if shards == 1 or p.zero >= 2:
        return []
    sizes = _expert_trained_sizes(layout) * ((m.moe_experts // shards)
                                             * sum(1 for i in layers if m.is_sparse(i)))
    e = Precision.of(layout.config.train, p).master_bytes
    limit = max(1, int(p.bucket_mb * 2**20))
    return [padded_size(sum(sizes[j] for j in idx), layout.dp * layout.sp // shards)
            for idx in plan_buckets([size * e for size in sizes], limit)]


def _expert_trained_sizes(layout: Layout) -> list[int]:
    """Elements of one expert's trained tensors in the order its reducer lays them out
    (backward): its three ``F x H`` weights, or under LoRA its adapters' factors (none
    without the experts' targets)."""
    m = layout.config.model
    lora = Lora.of(layout.config.train)
    if lora is None:
        return [m.moe_ffn_hidden * m.hidden] * 3
    sparse = next(i for i in range(m.layers) if m.is_sparse(i))
    first = [s for s in block_param_specs(m, sparse) if s.name in expert_names(sparse, 0)]
    return [math.prod(a.shape) for s in first for a in lora.specs(s)][::-1]


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
    ``lengths`` elements (:func:`~mpipar.parallel.experts.split.expert_units`, padded to a
    multiple of ``ep_dp``), whose passes enter ``entered``
    (:func:`mpipar.parallel.fsdp.cost.unit_passes`: the units without experts are skipped) and
    which keeps ``kept`` of them gathered from forward to backward:
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


# ------------------------------------------------------------------------------------ memory
def expert_record_bytes(layout: Layout) -> int:
    """Bytes of a sparse block's expert record (:class:`mpipar.model.moe.MoeSaved`) for one
    microbatch on one rank, without its input. The routed part at the dropless count of
    assignments ``A = n K`` this rank's experts compute (exact with ep 1; under ep the mean of
    uniform routing; a capacity only drops rows): their tokens' hidden ``[A, H]``, each
    expert's g, u, m ``[A, F_e]``, the outputs per assignment ``[n, K, H]``, the permutation
    (and the ep regrouping) ``[A]`` int64; the router's probabilities ``[n, E]``, the weights
    and choices ``[n, K]``, the chosen sum ``[n, 1]`` (renormalised only), ``f / T`` ``[B, E]``
    and the loads ``[E]``."""
    m, par, tr = layout.model, layout.parallel, layout.train
    prec = Precision.of(tr, par)
    e, se = prec.compute_bytes, prec.stat_bytes
    B, n, H, K, E = layout.micro_rows, layout.micro_rows * (tr.seq_len // par.sp), \
        m.hidden, m.moe_top_k, m.moe_experts
    A = n * K
    routed = (A * H + 3 * A * m.moe_ffn_hidden + n * K * H) * e + A * 8 * (1 + (par.ep > 1))
    router = (n * E + n * K + n * m.moe_norm_topk + B * E) * se + (n * K + E) * 8
    return routed + router


def expert_footprint(layout: Layout, mode: Recompute) -> Footprint:
    """The expert axis's :class:`mpipar.parallel.axis.Footprint`: a sparse block's expert
    record (:func:`expert_record_bytes`; with the router's input h2 in it when ``mode`` drops
    h2 itself) and the shared expert's gate (its sigmoid and the ungated output)."""
    m, par, tr = layout.model, layout.parallel, layout.train
    prec = Precision.of(tr, par)
    e, se = prec.compute_bytes, prec.stat_bytes
    n = layout.micro_rows * (tr.seq_len // par.sp)
    record = expert_record_bytes(layout)
    if not mode.keeps_field("h2"):
        record += m.hidden * n * e
    gate = (n * se + n * m.hidden * e) if m.moe_shared_gate else 0
    return Footprint(sparse={"moe": record, "shared_gate": gate})


def expert_held(rank: StepRank) -> Held:
    """The experts' buffers where they are sharded over ep: below ZeRO-2 their buckets' copies
    in the reduce dtype (as the dense buckets', :func:`mpipar.parallel.data_parallel.cost.
    wire_bytes`); at ZeRO-2/3 the pool of their whole units, gathered and reduce-scattered
    over ``ep_dp`` (:func:`mpipar.parallel.fsdp.cost.unit_buffer_bytes`)."""
    layout = rank.layout
    par, prec = layout.parallel, Precision.of(layout.train, layout.parallel)
    if par.zero < 2:
        lengths = expert_bucket_lengths(layout, [i for c in rank.chunk_layers for i in c])
        reduced = prec.reduce != prec.master and layout.dp * par.sp > 1
        return Held(buffers=sum(lengths) * prec.reduce_bytes if reduced else 0)
    lengths = rank.expert_unit_lengths
    if not lengths:
        return Held()
    return Held(buffers=unit_buffer_bytes(layout, rank.ops, lengths, rank.expert_kept_units,
                                          layout.dp * par.sp // par.ep, False))
