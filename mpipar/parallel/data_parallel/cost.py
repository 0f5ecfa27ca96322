"""What the data-parallel reduction costs a rank: its flat gradient buckets and the calls
:class:`mpipar.parallel.data_parallel.reducer.GradReducer` makes over dp x sp in a step, the
buffers it holds (the buckets' copies in the reduce dtype, error-feedback residuals) and the
codec's work on the reduction's path."""
from __future__ import annotations

import numpy as np

from mpipar.layout import Layout
from mpipar.parallel.axis import Held, Rates, StepRank
from mpipar.parallel.calls import Call
from mpipar.parallel.compression import Int8Codec, TopKCodec
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.parallel.data_parallel.buckets import padded_size, plan_buckets
from mpipar.runtime.precision import Precision


def reduction_buckets(layout: Layout, elements: list[int], tied: set[int],
                      align: int) -> list[tuple[int, bool]]:
    """(elements, whether it holds a tied embedding) of each flat gradient bucket
    :class:`GradReducer` lays out for parameters of ``elements`` in backward order (``tied``:
    the indices of those summed over pp_ends, a bucket each), each padded to a multiple of
    dp x sp of whole ``align``-element blocks (int8 compression's scale blocks, else 1). A
    bucket's size counts its gradients' bytes (the masters' dtype)."""
    par, e = layout.parallel, Precision.of(layout.train, layout.parallel).master_bytes
    limit = max(1, int(par.bucket_mb * 2**20))
    return [(padded_size(sum(elements[i] for i in idx), layout.dp * par.sp, align),
             set(idx) <= tied) for idx in plan_buckets([s * e for s in elements], limit, tied)]


def reduction_calls(layout: Layout, buckets: list[tuple[int, bool]],
                    sizes: dict[str, int]) -> list[Call]:
    """A training step's calls of :class:`GradReducer` on a rank whose flat gradient buckets
    are ``buckets`` (elements, whether it holds a tied embedding), on a grid whose groups have
    ``sizes`` ranks (``dp_sp``, ``dp_sp_intra``, ``dp_sp_inter``): over dp x sp each bucket's
    reduction, flat or hierarchical, dense or compressed, and with ZeRO-1 the parameters'
    all-gather; then the tied embedding's gradient summed over ``pp_ends`` (ZeRO-1: its owned
    slice; in the masters' dtype)."""
    par, e = layout.parallel, Precision.of(layout.train, layout.parallel).master_bytes
    n = layout.dp * par.sp
    calls = [c for length, _ in buckets for c in _bucket_calls(layout, length, sizes)] \
        if n > 1 else []
    return calls + [Call("pp_ends", "allreduce", length // (n if par.zero else 1) * e)
                    for length, tied in buckets if tied]


def _bucket_calls(layout: Layout, length: int, sizes: dict[str, int]) -> list[Call]:
    """The reduction of one bucket of ``length`` elements over dp x sp: inside the node,
    across nodes (or over the whole group when flat), and back (the module docstring): the
    gradients in the reduce dtype, ZeRO-1's all-gathers of parameters in the compute dtype."""
    par, prec = layout.parallel, Precision.of(layout.train, layout.parallel)
    e, pe = prec.reduce_bytes, prec.compute_bytes
    reduction = reduction_of(par)
    hier = reduction.hierarchical and sizes["dp_sp_intra"] > 1
    inter = reduction.across
    c = sizes[inter]
    x = length // (sizes["dp_sp_intra"] if hier else 1)       # what crosses the nodes
    calls = [Call("dp_sp_intra", "ireduce_scatter", length * e)] if hier else []
    if c > 1:
        calls += _across_calls(layout, inter, x, c)
    if hier and not par.zero:
        calls.append(Call("dp_sp_intra", "iallgather", x * e))
    if par.zero:
        if c > 1:
            calls.append(Call(inter, "allgather", x // c * pe))
        if hier:
            calls.append(Call("dp_sp_intra", "allgather", x * pe))
    return calls


def _across_calls(layout: Layout, group: str, x: int, c: int) -> list[Call]:
    """Reducing ``x`` elements over ``group`` of ``c`` ranks: dense (in the reduce dtype),
    int8 or top-k (of the gradients in the masters' dtype)."""
    par, prec = layout.parallel, Precision.of(layout.train, layout.parallel)
    e = prec.reduce_bytes
    compression = reduction_of(par).compression
    if not compression.compresses:
        return [Call(group, "ireduce_scatter" if par.zero else "iallreduce", x * e)]
    if not compression.sparse:
        piece = Int8Codec(np).packed_bytes(x // c)
        return [Call(group, "ialltoall", c * piece)] + \
            ([] if par.zero else [Call(group, "iallgather", piece)])
    return [Call(group, "iallgather", TopKCodec(np, par.topk_ratio).packed_bytes(x, e))]


def residual_bytes(layout: Layout, lengths: list[int], compressed: int, per_node: int) -> int:
    """Bytes of a rank's error-feedback residuals over buckets of ``lengths`` elements: what it
    compresses (its node shard, ``per_node`` ranks to a node under the hierarchical reduction,
    or the bucket) and, int8 without ZeRO, its owned sum; ``compressed``: ranks of the group
    the reduction compresses over (1: nothing compressed)."""
    par = layout.parallel
    reduction = reduction_of(par)
    if compressed == 1 or not reduction.keeps_residual:
        return 0
    second = reduction.compression.gathers_back and not par.zero
    x = sum(length // per_node for length in lengths)
    return (x + (x // compressed if second else 0)) \
        * Precision.of(layout.train, par).master_bytes


def compresses(layout: Layout) -> bool:
    """Whether the gradient reduction compresses (``--grad-compression`` other than none)."""
    return reduction_of(layout.parallel).compresses


def compressed_over(layout: Layout, sizes: dict[str, int]) -> int:
    """Ranks of the group the gradient reduction compresses over (and the residual slots), on
    a grid whose groups have ``sizes`` ranks: across nodes when hierarchical, else dp x sp; 1
    when nothing is compressed."""
    if not compresses(layout):
        return 1
    return sizes[reduction_of(layout.parallel).across]


def _per_node(layout: Layout, sizes: dict[str, int]) -> int:
    """Ranks of dp x sp a node holds under the hierarchical reduction (what each compresses
    is its node shard), else 1."""
    return sizes["dp_sp_intra"] if reduction_of(layout.parallel).hierarchical else 1


def data_held(rank: StepRank) -> Held:
    """Below ZeRO-2: the buckets' copies in the reduce dtype (``--reduce-dtype`` other than the
    masters', over more than one rank) and the error-feedback residuals
    (:func:`residual_bytes`)."""
    layout = rank.layout
    par, prec = layout.parallel, Precision.of(layout.train, layout.parallel)
    if par.zero >= 2:
        return Held()
    lengths = [length for length, _ in rank.gradient_buckets]
    sizes = rank.group_sizes
    reduced = prec.reduce != prec.master and layout.dp * par.sp > 1
    return Held(sum(lengths) * prec.reduce_bytes if reduced else 0,
                residual_bytes(layout, lengths, compressed_over(layout, sizes),
                               _per_node(layout, sizes)))


def data_seconds(rank: StepRank, rates: Rates) -> dict[str, float]:
    """The codec's encoding and decoding, which sit on the compressed reduction's path: its
    work per element (``rates``) over the rank's part of its buckets, on the group it
    compresses over."""
    layout = rank.layout
    if not compresses(layout) or compressed_over(layout, rank.group_sizes) == 1:
        return {}
    par, sizes = layout.parallel, rank.group_sizes
    reduction = reduction_of(par)
    group = reduction.across
    rate = reduction.compression.seconds_per_element(rates)
    return {group: rate * sum(length for length, _ in rank.gradient_buckets)
            / _per_node(layout, sizes)}
