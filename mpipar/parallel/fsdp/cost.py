"""What ZeRO-2/3 costs a rank: its units' lengths, the passes that enter them, the calls
:class:`mpipar.parallel.fsdp.sharded.ShardedParams` makes in a step, and its pool of whole-unit
buffers."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

from mpipar.layout import Layout
from mpipar.model.mtp import embedding_at_last
from mpipar.parallel.axis import Held, StepRank
from mpipar.parallel.calls import Call
from mpipar.parallel.data_parallel.buckets import padded_size
from mpipar.parallel.fsdp.scatter import MAX_IN_FLIGHT
from mpipar.parallel.pipeline.schedule import Op, schedule_of
from mpipar.runtime.precision import Precision


def unit_lengths(layout: Layout, chunks: list[list[tuple[str, list[str]]]],
                 elements: dict[str, int], shards: int = 0) -> dict[str, int]:
    """Elements of each unit of a rank, each once, padded to a multiple of dp x sp (or of
    ``shards``, the size of the group they are sharded over) as :class:`ShardedParams` lays
    them out; ``chunks``: per chunk its ``(unit, parameter names)`` in forward order
    (:meth:`mpipar.parallel.placement.PlacementTable.units`), ``elements``: of each parameter
    shard the rank holds."""
    out: dict[str, int] = {}
    for units in chunks:
        for unit, names in units:
            out.setdefault(unit, padded_size(sum(elements[n] for n in names),
                                             shards or layout.dp * layout.parallel.sp))
    return out


def unit_passes(layout: Layout, pp_rank: int, ops: list[Op],
                chunk_layers: list[range]) -> list[tuple[str, int]]:
    """``(unit, reduce-scatters in a step)`` of each unit a pass of a chunk of pipeline rank
    ``pp_rank`` (whose schedule is ``ops``, whose chunks hold the decoder blocks
    ``chunk_layers``, the multi-token prediction modules' on the last) enters, in order
    (:class:`mpipar.model.llama.LlamaStage`): the embedding on the first stage, the blocks, the
    head on the last (and the embedding the tied head or the modules read). A unit's gradients leave once per microbatch, except under zb-h1's deferred weight
    gradients: then once each time no backward of its chunk is left waiting for its weight
    op."""
    m, p = layout.model, layout.pp
    out = []
    for chunk, layers in enumerate(chunk_layers):
        stage = chunk * p + pp_rank
        waiting, settled = 0, 0
        for op in ops:
            if op.chunk == chunk and op.kind in ("bwd", "bwd_input", "bwd_weight"):
                waiting += op.kind == "bwd_input"
                waiting -= op.kind == "bwd_weight"
                settled += waiting == 0 and op.kind != "bwd_input"
        blocks = [f"layers.{i}" for i in layers]
        if stage == layout.stages - 1:
            blocks += ["head"] + (["embed"] if embedding_at_last(m) else [])
        out += [("embed", layout.microbatches)] if stage == 0 else []
        out += [(u, settled) for u in blocks]
    return out


def sharded_calls(layout: Layout, *, lengths: dict[str, int], entered: list[tuple[str, int]],
                  kept: Collection[str], copy: tuple[int, int] | None, tied: bool,
                  passes: int, backward: bool, group: str = "dp_sp",
                  shards: int = 0, frozen: bool = False) -> list[Call]:
    """ZeRO-2/3's calls of a rank whose units have ``lengths`` elements (:func:`unit_lengths`)
    and whose passes enter ``entered`` (:func:`unit_passes`); ``kept``: the units it keeps
    gathered from forward to backward (:func:`kept_after_forward`), ``copy``: where ZeRO-3
    holds them in node shared memory (:func:`node_copy_layout`), ``tied``: whether the
    embedding has copies on several pipeline ranks.

    A training step (``backward``): a reduce-scatter over dp x sp of a unit's gradients each
    time they leave; at ZeRO-3 an all-gather of its slice per forward and per backward pass of
    each microbatch (once for a kept unit), at ZeRO-2 one of every unit after the update; at
    ZeRO-3 in node shared memory the barrier that publishes the update, and across nodes before
    it an all-gather of each unit's slice over dp_sp_inter; the tied embedding's owned slice
    summed over pp_ends. A validation pass of ``passes`` forwards per chunk: at ZeRO-3
    gathering, an all-gather of each unit a forward enters. Parameters travel as compute
    copies, gradients in the reduce dtype, the tied slice in the masters'. ``group`` (of
    ``shards`` ranks): what the units are sharded over (default dp x sp; the experts' units:
    ``ep_dp``, :func:`mpipar.parallel.experts.cost.expert_unit_calls`). ``frozen``: LoRA's
    frozen base at ZeRO-3, gathered as the trained units are and never reduced."""
    prec = Precision.of(layout.train, layout.parallel)
    n, g = shards or layout.dp * layout.parallel.sp, group
    e = prec.compute_bytes
    gathering = layout.parallel.zero == 3 and copy is None
    if not backward:
        return [Call(g, "iallgather", lengths[u] // n * e, passes)
                for u, _ in entered] if gathering else []
    micro = layout.microbatches
    calls = [] if frozen else [Call(g, "ireduce_scatter", lengths[u] * prec.reduce_bytes, k)
                               for u, k in entered]
    calls += [Call("pp_ends", "allreduce", lengths["embed"] // n * prec.master_bytes)] \
        if tied and "embed" in lengths and not frozen else []
    if copy is not None:  # no gathers: the update's slices published with one barrier
        if copy[1] == 1:
            return calls + [Call("dp_sp", "barrier", 0)]
        return calls + [Call("dp_sp_inter", "allgather", L // n * e)       # into each copy
                        for L in lengths.values()] + [Call("dp_sp_intra", "barrier", 0)]
    if gathering:        # a kept unit: once per microbatch (its backward reuses the forward's)
        return calls + [Call(g, "iallgather", lengths[u] // n * e,
                             micro if u in kept else 2 * micro) for u, _ in entered]
    return calls + [Call(g, "allgather", L // n * e) for L in lengths.values()]


def _kept_meets_forward(ops: list[Op]) -> bool:
    """Whether a rank whose schedule is ``ops`` runs a forward while a chunk's kept units wait
    for that chunk's next backward (a forward of a chunk after its last backward: pipeline
    warm-up, interleaving), so that they are gathered beside the forward's units."""
    waiting: set[int] = set()
    for op in ops:
        if op.kind == "fwd":
            if waiting:
                return True
            waiting.add(op.chunk)
        elif op.kind in ("bwd", "bwd_input"):
            waiting.discard(op.chunk)
    return False


def unit_buffer_bytes(layout: Layout, ops: list[Op], lengths: dict[str, int],
                      kept_names: Collection[str], n: int, shared: bool) -> int:
    """A bound on the pool of whole-unit buffers (:class:`mpipar.parallel.fsdp.sharded.
    BufferPool` keeps what a step needed at once, by length) of one store of a rank whose
    schedule is ``ops``: units of ``lengths`` sharded over ``n`` ranks, ``kept_names`` kept
    from forward to backward, ``shared``: in node shared memory. Per unit length, the gathered
    units (the one computing, ``zero_prefetch`` ahead, the tied embedding beside the head, the
    units kept from their forward: ZeRO-3) and the gradient buffers (the unit in backward and
    ``MAX_IN_FLIGHT`` reduce-scatters; under zb-h1 a chunk's every unit, waiting for its weight
    op, beside them), and the received slices."""
    par, prec = layout.parallel, Precision.of(layout.train, layout.parallel)
    by_length: dict[int, int] = defaultdict(int)
    kept: dict[int, int] = defaultdict(int)
    for L in lengths.values():
        by_length[L] += 1
    if par.zero == 3 and _kept_meets_forward(ops):
        for u in kept_names:
            kept[lengths[u]] += 1
    total = 0
    sends = prec.reduce != prec.master          # the gradients' copies in the reduce dtype
    for L, k in by_length.items():
        gathered = (min(k, 2 + par.zero_prefetch + kept[L])
                    if par.zero == 3 and not shared else 0)
        # a unit's gradients leave once a microbatch: its next backward may take a buffer
        # while its last reduce-scatters are in flight (few units of a length: interleaving)
        reduces = k * layout.microbatches
        grads = (k + MAX_IN_FLIGHT if schedule_of(par).defers_weights
                 else min(reduces, 1 + MAX_IN_FLIGHT))
        in_flight = min(reduces, 1 + MAX_IN_FLIGHT)
        total += (gathered * prec.compute_bytes + grads * prec.master_bytes
                  + sends * in_flight * prec.reduce_bytes) * L \
            + in_flight * L // n * prec.reduce_bytes
    return total


def sharded_held(rank: StepRank) -> Held:
    """ZeRO-2/3: a bound on the pool of the dense units' whole buffers over dp x sp
    (:func:`unit_buffer_bytes`; the experts' units beside them are the expert axis's)."""
    layout = rank.layout
    if layout.parallel.zero < 2:
        return Held()
    return Held(buffers=unit_buffer_bytes(layout, rank.ops, rank.unit_lengths, rank.kept_units,
                                          layout.dp * layout.parallel.sp,
                                          rank.node_copy is not None))
