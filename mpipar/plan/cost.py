"""Cost model of a layout: bytes, messages, memory and time of one optimizer step, per rank.

``predict_step_bytes(cfg, coord)`` derives, from the layer shapes alone, the bytes this rank hands
to MPI in one training step for every group of the grid, under the ledger's counting convention
(:mod:`mpipar.runtime.comm`: the payload of each call, sender side); ``predict_step_messages`` counts the
calls, and ``predict_link_bytes`` the wire bytes per group inside and across nodes (nodes of
``ranks_per_node`` consecutive ranks; :mod:`mpipar.runtime.comm` for the wire factors and links). All
three come from one list of the step's MPI calls (:func:`_calls`: tensor, sequence, pipeline,
and the gradient reduction, flat or hierarchical, dense or compressed). The tests hold the
engine's ledger to these numbers exactly, so the model and the implementation cannot drift
apart.

``predict_memory`` gives a rank's bytes of weights, gradients and optimizer state (exact: the
engine's flat buffers and moments) and of saved activations (an estimate from what each recompute
mode keeps, at the peak number of microbatches the schedule holds in flight).

``predict_step_time`` is the model that ranks layouts::

    op time    = FLOPs of one microbatch through one chunk / peak  +  kernel calls x op overhead
                 +  its TP and SP traffic
    pipeline   = dry run of the schedule with those op times (backward = 2 x forward, plus
                 the forward work recompute repeats) and
                 point-to-point messages of  activation bytes / bandwidth + latency: the makespan,
                 which includes the bubble
    step time  = pipeline + DP x SP gradient traffic (+ compression's encode/decode work)
                 + gradient-norm all-reduce + the tied embedding's gradient sum
                 + optimizer passes over the rank's parameters / elementwise rate

with traffic ``wire bytes / bandwidth + messages x latency`` (ring all-reduce moves ``2 (n-1)/n``
of the buffer, an all-to-all ``(n-1)/n``, point-to-point all of it), over the link inside a node
or, for a group that spans nodes, across them. :class:`Hardware` holds the peak, the links, the
per-call overhead and compression's work per element: nominal, or measured by ``python -m
mpipar.bench comm`` (on a CPU, a kernel call's Python and NumPy dispatch and the cores that ranks
share dominate small models: the peak is a rank's share of the node). The nodes are
``parallel.ranks_per_node`` consecutive ranks each, else those of the hardware file, else one.
``plan_layouts`` enumerates the layouts of a world and ranks the ones that fit;
``auto_layout`` is what ``python -m mpipar.train`` does when no parallel size is given.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from mpipar.config import Config, ConfigError, ModelConfig
from mpipar.runtime.comm import LINKS, wire_bytes
from mpipar.model.params import EMBED
from mpipar.parallel.compression import Int8Codec, TopKCodec, alignment
from mpipar.parallel.context import (SeqLayout, halo_messages, halo_plan, ring_hops,
                                     ring_messages)
from mpipar.parallel.data import padded_size, plan_buckets
from mpipar.parallel.fsdp import MAX_IN_FLIGHT, kept_after_forward, node_copy_layout
from mpipar.parallel.pipeline.schedule import Op, build_schedule, dry_run
from mpipar.parallel.placement import PlacementTable, padded_vocab
from mpipar.runtime.topology import GROUP_AXES, Coord, GridShape, NodeMap
from mpipar.rules import validate
from mpipar.layout import Layout, resolve_model, vary

SIZE_FIELDS = ("dp", "tp", "pp", "sp")


@functools.lru_cache(maxsize=64)
def _table(model: tuple, pp: int, v: int) -> PlacementTable:
    """The placement table of the resolved model whose field values are ``model`` (cached)."""
    return PlacementTable(ModelConfig(*model), pp, v)


def placement_table(cfg: Config) -> PlacementTable:
    par = cfg.parallel
    return _table(dataclasses.astuple(cfg.model), par.pp, par.virtual_stages)


@functools.lru_cache(maxsize=256)
def _schedule(name: str, p: int, m: int, v: int) -> list[list[Op]]:
    """:func:`build_schedule`, cached (the op lists are only read)."""
    return build_schedule(name, p, m, v)


def _microbatches(cfg: Config) -> int:
    """Microbatches per step on each data-parallel rank."""
    return cfg.train.global_batch_size // (cfg.parallel.dp * cfg.train.micro_batch_size)


def _rank_ops(cfg: Config, coord: Coord) -> list[Op]:
    """The pipeline schedule's op list of the rank at ``coord`` (:func:`_schedule`)."""
    par = cfg.parallel
    return _schedule(par.schedule, par.pp, _microbatches(cfg), par.virtual_stages)[coord.pp]


def local_param_shapes(cfg: Config, coord: Coord) -> dict[str, tuple[int, ...]]:
    """Shapes of the parameter shards held by the rank at ``coord``, in the order the engine
    lays them out (chunk by chunk, forward order)."""
    return placement_table(cfg).local_shapes(coord.pp, cfg.parallel.tp)


def _compressed_size(cfg: Config) -> int:
    """Ranks of the group the gradient reduction compresses over (and the residual slots):
    across nodes when hierarchical, else dp x sp; 1 when nothing is compressed."""
    par = cfg.parallel
    if par.grad_compression == "none":
        return 1
    return group_sizes(cfg)["dp_sp_inter" if par.dp_reduce == "hierarchical" else "dp_sp"]


def bucket_lengths(cfg: Config, coord: Coord) -> list[int]:
    """Elements of each flat gradient bucket of this rank (padded to a multiple of dp*sp, of
    whole int8 scale blocks when int8 compression runs)."""
    return [length for length, _ in _buckets(cfg, coord)]


def _buckets(cfg: Config, coord: Coord) -> list[tuple[int, bool]]:
    """(elements, whether it holds a tied embedding summed over pp_ends) of each flat gradient
    bucket of this rank, as :class:`mpipar.parallel.data.GradReducer` lays them out."""
    par, e = cfg.parallel, np.dtype(cfg.train.dtype).itemsize
    table = placement_table(cfg)
    shapes = local_param_shapes(cfg, coord)
    order = list(reversed(list(shapes)))
    sizes = [math.prod(shapes[n]) for n in order]
    tied = {i for i, n in enumerate(order) if table[n].tied_across_pipeline}
    limit = max(1, int(par.bucket_mb * 2**20))
    align = alignment(par.grad_compression) if _compressed_size(cfg) > 1 else 1
    return [(padded_size(sum(sizes[i] for i in idx), par.dp * par.sp, align), set(idx) <= tied)
            for idx in plan_buckets([s * e for s in sizes], limit, tied)]


def unit_lengths(cfg: Config, coord: Coord) -> dict[str, int]:
    """ZeRO-2/3: elements of each unit of this rank (padded to a multiple of dp*sp), each once,
    as :class:`mpipar.parallel.fsdp.ShardedParams` lays them out."""
    shapes = local_param_shapes(cfg, coord)
    out: dict[str, int] = {}
    for units in placement_table(cfg).units(coord.pp):
        for unit, names in units:
            out.setdefault(unit, padded_size(sum(math.prod(shapes[n]) for n in names),
                                             cfg.parallel.dp * cfg.parallel.sp))
    return out


def node_copy(cfg: Config, coord: Coord) -> tuple[int, int] | None:
    """ZeRO-3 in node shared memory (:func:`mpipar.parallel.fsdp.node_shared`), on the nodes
    the planner assumes, as the engine decides: (ranks of this rank's dp x sp group on its
    node, nodes the group spans), or None where the units are gathered (not asked for, CUDA,
    or a group across nodes that hold unequal numbers of its ranks, or one rank each)."""
    par = cfg.parallel
    shape = GridShape(par.dp, par.tp, par.pp, par.sp)
    return node_copy_layout(par, cfg.train.device == "cuda", shape, nodes_of(cfg),
                            shape.rank_of(coord))



def _kept_units(cfg: Config, coord: Coord) -> set[str]:
    """ZeRO-3: the units of this rank gathered from their forward to their backward
    (:func:`mpipar.parallel.fsdp.kept_after_forward`)."""
    return kept_after_forward([[u for u, _ in units]
                               for units in placement_table(cfg).units(coord.pp)],
                              cfg.parallel.zero_prefetch)


def _kept_meets_forward(cfg: Config, coord: Coord) -> bool:
    """Whether this rank's schedule runs a forward while a chunk's kept units wait for that
    chunk's next backward (a forward of a chunk after its last backward: pipeline warm-up,
    interleaving), so that they are gathered beside the forward's units."""
    waiting: set[int] = set()
    for op in _rank_ops(cfg, coord):
        if op.kind == "fwd":
            if waiting:
                return True
            waiting.add(op.chunk)
        elif op.kind in ("bwd", "bwd_input"):
            waiting.discard(op.chunk)
    return False


def _unit_passes(cfg: Config, coord: Coord) -> list[tuple[str, int]]:
    """ZeRO-2/3: ``(unit, reduce-scatters in a step)`` of each unit a pass of a chunk of this
    rank enters, in order (:class:`mpipar.model.llama.LlamaStage`): the embedding on the first
    stage, the blocks, the head on the last (and the tied embedding the head reads). A unit's
    gradients leave once per microbatch, except under zb-h1's deferred weight gradients: then
    once each time no backward of its chunk is left waiting for its weight op."""
    par, table = cfg.parallel, placement_table(cfg)
    micro = _microbatches(cfg)
    last = par.pp * par.virtual_stages - 1
    ops = _rank_ops(cfg, coord)
    out = []
    for chunk in range(par.virtual_stages):
        stage = chunk * par.pp + coord.pp
        waiting, settled = 0, 0
        for op in ops:
            if op.chunk == chunk and op.kind in ("bwd", "bwd_input", "bwd_weight"):
                waiting += op.kind == "bwd_input"
                waiting -= op.kind == "bwd_weight"
                settled += waiting == 0 and op.kind != "bwd_input"
        blocks = [f"layers.{i}" for i in table.stage_layers(stage)]
        if stage == last:
            blocks += ["head"] + (["embed"] if table.model.tie_embeddings else [])
        out += [("embed", micro)] if stage == 0 else []
        out += [(u, settled) for u in blocks]
    return out


# ----------------------------------------------------------------------------------- traffic
@dataclass(frozen=True)
class Call:
    """``count`` MPI calls of ``op`` (the ledger's operation names) on group ``group``, each
    handing over ``nbytes``; point-to-point calls name their ``peer`` (a grid rank)."""

    group: str
    op: str
    nbytes: int
    count: int = 1
    peer: int | None = None


def nodes_of(cfg: Config) -> NodeMap:
    """The node map the planner assumes: ``ranks_per_node`` consecutive ranks a node (0: the
    whole world on one node, as when MPI finds one machine)."""
    par = cfg.parallel
    return NodeMap.blocks(par.dp * par.tp * par.pp * par.sp, par.ranks_per_node)


def group_sizes(cfg: Config) -> dict[str, int]:
    """Ranks in each group of the grid (the node split of dp x sp on :func:`nodes_of`;
    ``pp_ends`` as on the first and last pipeline ranks, the only ones that call it)."""
    par = cfg.parallel
    shape = GridShape(par.dp, par.tp, par.pp, par.sp)
    intra = len(shape.node_split(0, nodes_of(cfg))[0])
    u = par.ulysses_size or 1
    return {"tp": par.tp, "pp": par.pp, "dp": par.dp, "sp": par.sp, "dp_sp": par.dp * par.sp,
            "tp_pp": par.tp * par.pp, "pp_ends": min(par.pp, 2), "dp_sp_intra": intra,
            "dp_sp_inter": par.dp * par.sp // intra, "sp_ulysses": u, "sp_ring": par.sp // u}


def _calls(cfg: Config, coord: Coord, eval_batches: int = 0) -> list[Call]:
    """Every MPI call the rank at ``coord`` makes in one training step, or with
    ``eval_batches`` > 0 in one validation pass over that many batches (forward only, the loss
    reduced once: :meth:`mpipar.training.engine.Engine.evaluate`). ``cfg`` is resolved."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    train = eval_batches == 0
    e = np.dtype(tr.dtype).itemsize
    b, s_loc = tr.micro_batch_size, tr.seq_len // par.sp
    n_tok, H = b * s_loc, m.hidden
    micro = _microbatches(cfg)
    passes = micro if train else micro * eval_batches   # forwards of a microbatch per chunk
    p, v = par.pp, par.virtual_stages
    per = m.layers // (p * v)
    stages = [c * p + coord.pp for c in range(v)]
    blocks = per * len(stages)
    shape = GridShape(par.dp, par.tp, par.pp, par.sp)
    calls: list[Call] = []
    if par.tp > 1:
        calls += _tp_calls(cfg, n_tok, blocks, 0 in stages, (p * v - 1) in stages, passes, stages,
                           train)
    if par.sp > 1:
        reruns = 2 if train and tr.recompute == "full" else 1   # backward re-runs forwards
        layers = [i for st in stages for i in placement_table(cfg).stage_layers(st)]
        calls += _sp_calls(cfg, coord, shape, layers, reruns * passes, passes if train else 0)
    if p > 1:
        calls += _pp_calls(cfg, coord, n_tok * H * e, stages, passes, shape, train)
    if par.dp * par.sp > 1:
        if par.zero >= 2:
            calls += _sharded_calls(cfg, coord, train, passes)
        elif train:
            calls += _reduction_calls(cfg, coord)
        calls.append(Call("dp_sp", "allreduce", 8))                       # the loss
        if train and par.zero:
            calls.append(Call("dp_sp", "allreduce", 8))                   # the gradient norm
    if train and par.tp * p > 1:
        calls.append(Call("tp_pp", "allreduce", 8))                       # the squared norm
    if train and par.zero >= 2:     # the tied embedding's owned slice, summed over the ends
        n = par.dp * par.sp
        calls += [Call("pp_ends", "allreduce", L // n * e)
                  for u, L in unit_lengths(cfg, coord).items()
                  if u == "embed" and placement_table(cfg)[EMBED].tied_across_pipeline]
    elif train:           # tied embedding copies: all-reduce after dp x sp (ZeRO-1: its slice)
        calls += [Call("pp_ends", "allreduce", L // (par.dp * par.sp if par.zero else 1) * e)
                  for L, tied in _buckets(cfg, coord) if tied]
    return [c for c in calls if c.count]


def _sharded_calls(cfg: Config, coord: Coord, train: bool, passes: int) -> list[Call]:
    """ZeRO-2/3 over dp x sp (:mod:`mpipar.parallel.fsdp`). A training step: a reduce-scatter
    of a unit's gradients each time they leave (:func:`_unit_passes`); at ZeRO-3 an all-gather
    of its slice per forward and per backward pass of each microbatch, at ZeRO-2 one of every
    unit after the update; at ZeRO-3 in node shared memory (:func:`node_copy`) the barrier
    that publishes the update, and across nodes before it an all-gather of each unit's slice
    over dp_sp_inter. A validation pass of ``passes`` forwards per chunk: at ZeRO-3 gathering,
    an all-gather of each unit a forward enters."""
    par, tr = cfg.parallel, cfg.train
    e, n = np.dtype(tr.dtype).itemsize, par.dp * par.sp
    lengths, entered = unit_lengths(cfg, coord), _unit_passes(cfg, coord)
    copy = node_copy(cfg, coord)
    if not train:
        return [Call("dp_sp", "iallgather", lengths[u] // n * e, passes)
                for u, _ in entered] if par.zero == 3 and copy is None else []
    micro = _microbatches(cfg)
    calls = [Call("dp_sp", "ireduce_scatter", lengths[u] * e, k) for u, k in entered]
    if copy is not None:  # no gathers: the update's slices published with one barrier
        if copy[1] == 1:
            return calls + [Call("dp_sp", "barrier", 0)]
        return calls + [Call("dp_sp_inter", "allgather", L // n * e)       # into each copy
                        for L in lengths.values()] + [Call("dp_sp_intra", "barrier", 0)]
    if par.zero == 3:     # a kept unit: once per microbatch (its backward reuses the forward's)
        kept = _kept_units(cfg, coord)
        return calls + [Call("dp_sp", "iallgather", lengths[u] // n * e,
                             micro if u in kept else 2 * micro) for u, _ in entered]
    return calls + [Call("dp_sp", "allgather", L // n * e) for L in lengths.values()]


def _sp_calls(cfg: Config, coord: Coord, shape: GridShape, layers: list[int], reps: int,
              bwds: int) -> list[Call]:
    """SP attention of ``layers`` on the rank at ``coord``: ``reps`` forwards and ``bwds``
    backwards of each layer in a step, each layer with its own sliding window. Ring and halo
    messages come from :mod:`mpipar.parallel.context`'s hop and halo plans (hybrid: the ring
    over the Ulysses groups, ``ulysses_size`` sp ranks apart)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    e = np.dtype(tr.dtype).itemsize
    s_loc = tr.seq_len // par.sp
    row = tr.micro_batch_size * (m.kv_heads // par.tp) * m.head_dim * e   # one position's K
    q = tr.micro_batch_size * s_loc * (m.heads // par.tp) * m.head_dim * e
    n = len(layers)
    if par.sp_mode == "ulysses":
        return _ulysses_calls("sp", q, row * s_loc, reps * n, bwds * n)
    calls, group, stride = [], "sp", 1
    layout = SeqLayout(tr.seq_len, par.sp, par.sp_split)
    if par.sp_mode == "hybrid":
        stride = par.ulysses_size
        calls += _ulysses_calls("sp_ulysses", q, row * s_loc, reps * n, bwds * n) if stride > 1 \
            else []
        group, layout = "sp_ring", SeqLayout(tr.seq_len, par.sp // stride, par.sp_split)
    for layer in layers:
        window = m.layer_window(layer)
        fwd, bwd = (halo_messages(halo_plan(layout, coord.sp, window), coord.sp, par.sp, row)
                    if par.sp_mode == "halo" else
                    ring_messages(ring_hops(layout, window), row * s_loc, par.sp_overlap))
        for (op, nbytes, count, off), times in [(x, reps) for x in fwd] + [(x, bwds) for x in bwd]:
            peer = (shape.rank_of(coord._replace(sp=(coord.sp + off * stride) % par.sp))
                    if off else None)
            calls.append(Call(group, op, nbytes, count * times, peer))
    return calls


def _ulysses_calls(group: str, q: int, kv: int, reps: int, bwds: int) -> list[Call]:
    """All-to-alls of q, k, v and the output forward, of dout, dq, dk, dv backward."""
    return [Call(group, "alltoall", q, 2 * (reps + bwds)),
            Call(group, "alltoall", kv, 2 * (reps + bwds))]


def _pp_calls(cfg: Config, coord: Coord, act_full: int, stages: list[int], passes: int,
              shape: GridShape, train: bool = True) -> list[Call]:
    """Activations to the next stage, their gradients to the previous one (``train``; each
    with its receive on the other side), and the loss broadcast from the last stage."""
    par = cfg.parallel
    p, last = par.pp, par.pp * par.virtual_stages - 1
    act = act_full // (par.tp if par.tp_sequence_parallel else 1)        # the stream
    fwd = sum(s < last for s in stages) * passes
    bwd = sum(s > 0 for s in stages) * passes
    if not train:                  # forward only: activations out, activations in
        return [Call("pp", "send", act, fwd, shape.rank_of(coord._replace(pp=(coord.pp + 1) % p))),
                Call("pp", "recv", 0, bwd), Call("pp", "bcast", 8 if coord.pp == p - 1 else 0)]
    nxt = shape.rank_of(coord._replace(pp=(coord.pp + 1) % p))
    prv = shape.rank_of(coord._replace(pp=(coord.pp - 1) % p))
    return [Call("pp", "send", act, fwd, nxt), Call("pp", "send", act, bwd, prv),
            Call("pp", "recv", 0, fwd + bwd),
            Call("pp", "bcast", 8 if coord.pp == p - 1 else 0)]


def _reduction_calls(cfg: Config, coord: Coord) -> list[Call]:
    """The gradient reduction of every bucket (:mod:`mpipar.parallel.data`) and, with ZeRO-1,
    the parameters' all-gather."""
    par, e = cfg.parallel, np.dtype(cfg.train.dtype).itemsize
    sizes = group_sizes(cfg)
    hier = par.dp_reduce == "hierarchical" and sizes["dp_sp_intra"] > 1
    L = sizes["dp_sp_intra"] if hier else 1
    inter = "dp_sp_inter" if par.dp_reduce == "hierarchical" else "dp_sp"
    c = sizes[inter]
    calls = []
    for length in bucket_lengths(cfg, coord):
        x = length // L                                  # what crosses the nodes
        if hier:
            calls.append(Call("dp_sp_intra", "ireduce_scatter", length * e))
        if c > 1:
            calls += _across_calls(cfg, inter, x, c, e)
        if hier and not par.zero:
            calls.append(Call("dp_sp_intra", "iallgather", x * e))
        if par.zero:
            if c > 1:
                calls.append(Call(inter, "allgather", x // c * e))
            if hier:
                calls.append(Call("dp_sp_intra", "allgather", x * e))
    return calls


def _across_calls(cfg: Config, group: str, x: int, c: int, e: int) -> list[Call]:
    """Reducing ``x`` elements over ``group`` of ``c`` ranks: dense, int8 or top-k."""
    par = cfg.parallel
    kind = par.grad_compression
    if kind == "none":
        return [Call(group, "ireduce_scatter" if par.zero else "iallreduce", x * e)]
    if kind == "int8":
        piece = Int8Codec(np).packed_bytes(x // c)
        return [Call(group, "ialltoall", c * piece)] + \
            ([] if par.zero else [Call(group, "iallgather", piece)])
    return [Call(group, "iallgather", TopKCodec(np, par.topk_ratio).packed_bytes(x, e))]


def _tp_calls(cfg: Config, n_tok: int, blocks: int, first: bool, last: bool, passes: int,
              stages: list[int], backward: bool = True) -> list[Call]:
    """The tp group's calls in ``passes`` forwards of a microbatch through this rank's chunks,
    each with its backward (``backward``: a training step) or without (a validation pass); see
    :mod:`mpipar.parallel.tensor`.

    Without sequence parallelism each block all-reduces the stream twice forward (after o and
    down) and twice backward (the inputs of q/k/v and gate/up). With it, forward all-gathers the
    two normed inputs and reduce-scatters the two outputs; backward all-gathers the two output
    gradients and, again, the two normed inputs (kept as shards), and reduce-scatters the two
    input gradients; once a step the norm weights' partial gradients are all-reduced, packed per
    gradient-ready call (a block, the head; a whole chunk under zb-h1's deferred weights), or at
    ZeRO-2/3 once a microbatch, per unit before its reduce-scatter. The first stage reduces the
    embedding (forward); the last all-reduces the cross-entropy's max and then its (sum-exp,
    target logit) per token, and the head's input gradient."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    e = np.dtype(tr.dtype).itemsize
    se = 8 if tr.dtype == "float64" else 4           # softmax statistics dtype
    full = n_tok * m.hidden * e
    bw = int(backward)
    reruns = 2 if backward and tr.recompute == "full" else 1   # backward re-runs each forward
    stats = [Call("tp", "allreduce_max", n_tok * se, passes),
             Call("tp", "allreduce", 2 * n_tok * se, passes)]
    if not par.tp_sequence_parallel:     # per block: leave o, down | enter q/k/v, gate/up
        calls = [Call("tp", "allreduce", full, passes * ((2 * reruns + 2 * bw) * blocks
                                                         + int(first) + bw * int(last)))]
        return calls + (stats if last else [])
    shard = full // par.tp
    calls = [Call("tp", "allgather", shard, passes * ((2 * reruns + 4 * bw) * blocks
                                                      + bw * int(first) + (1 + bw) * int(last))),
             Call("tp", "reduce_scatter", full, passes * ((2 * reruns + 2 * bw) * blocks
                                                          + int(first) + bw * int(last)))]
    if last:
        calls += stats
    if not backward:
        return calls
    H = m.hidden
    per = m.layers // (par.pp * par.virtual_stages)
    if par.zero >= 2:                                # one call per unit reduce-scattered
        sizes = [(2 if u.startswith("layers.") else 1) * H * e
                 for u, k in _unit_passes(cfg, Coord(dp=0, tp=0, pp=stages[0], sp=0))
                 if u != "embed" for _ in range(k)]
    elif par.schedule == "zb-h1":                    # one call per chunk with all its norms
        sizes = [(2 * per + int(s == par.pp * par.virtual_stages - 1)) * H * e for s in stages]
    else:                                            # one call per block, one for the head
        sizes = [2 * H * e] * blocks + ([H * e] if last else [])
    return calls + [Call("tp", "allreduce", size) for size in sizes]


def predict_step_bytes(cfg: Config, coord: Coord) -> dict[str, int]:
    """Bytes per group that the rank at ``coord`` hands to MPI in one step (resolved ``cfg``)."""
    out: dict[str, int] = defaultdict(int)
    for call in _calls(cfg, coord):
        out[call.group] += call.nbytes * call.count
    return dict(out)


def predict_step_messages(cfg: Config, coord: Coord) -> dict[str, int]:
    """MPI calls per group (the ledger's ``messages``) of the rank at ``coord`` in one step."""
    out: dict[str, int] = defaultdict(int)
    for call in _calls(cfg, coord):
        out[call.group] += call.count
    return dict(out)


def _link(cfg: Config, coord: Coord, call: Call) -> str:
    """"intra" or "inter": a collective by whether its group's instance spans nodes, a
    point-to-point call by its peer's node (:mod:`mpipar.runtime.comm`)."""
    par, nodes = cfg.parallel, nodes_of(cfg)
    shape = GridShape(par.dp, par.tp, par.pp, par.sp)
    me = shape.rank_of(coord)
    if call.peer is not None:
        return "intra" if nodes.nodes[call.peer] == nodes.nodes[me] else "inter"
    members = shape.members(call.group, me, nodes, par.ulysses_size or 1)
    return "inter" if len({nodes.nodes[r] for r in members}) > 1 else "intra"


def predict_link_bytes(cfg: Config, coord: Coord) -> dict[str, dict[str, int]]:
    """``{group: {"intra": wire bytes, "inter": wire bytes}}`` the rank at ``coord`` sends in
    one step (the ledger's :meth:`mpipar.runtime.comm.Ledger.bytes_by_link`)."""
    sizes = group_sizes(cfg)
    out: dict[str, dict[str, int]] = {}
    for call in _calls(cfg, coord):
        wire = wire_bytes(call.op, call.nbytes, sizes[call.group]) * call.count
        if wire:
            links = out.setdefault(call.group, dict.fromkeys(LINKS, 0))
            links[_link(cfg, coord, call)] += wire
    return out


def predict_eval_bytes(cfg: Config, coord: Coord) -> dict[str, int]:
    """Bytes per group that the rank at ``coord`` hands to MPI in one validation pass of
    ``cfg.train.eval_batches`` batches (booked in the engine's ``eval_ledger``)."""
    out: dict[str, int] = defaultdict(int)
    for call in _calls(cfg, coord, cfg.train.eval_batches):
        out[call.group] += call.nbytes * call.count
    return dict(out)


def predict_eval_messages(cfg: Config, coord: Coord) -> dict[str, int]:
    """MPI calls per group of the rank at ``coord`` in one validation pass."""
    out: dict[str, int] = defaultdict(int)
    for call in _calls(cfg, coord, cfg.train.eval_batches):
        out[call.group] += call.count
    return dict(out)


# ------------------------------------------------------------------------------------ memory
@dataclass
class MemoryEstimate:
    """Bytes one rank holds: exact for the state, an estimate for activations."""

    weights: int       # flat parameter buckets (padded to a multiple of dp*sp; ZeRO-3: a slice)
    grads: int         # flat gradient buckets, same size (ZeRO-2/3: this rank's slices only)
    optimizer: int     # AdamW moments m and v (ZeRO-1/2/3: this rank's slices only)
    activations: int   # saved for backward at the schedule's peak, plus one block's working set
    buffers: int = 0   # ZeRO-2/3: the pool of whole units (gathered, gradients), at most
    residuals: int = 0  # error-feedback residuals of compressed reduction

    @property
    def state(self) -> int:
        """Weights, gradients and optimizer state: what ZeRO shards."""
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.activations + self.buffers + self.residuals


def residual_bytes(cfg: Config, lengths: list[int]) -> int:
    """Bytes of a rank's error-feedback residuals over buckets of ``lengths`` elements: what it
    compresses (its node shard, or the bucket) and, int8 without ZeRO, its owned sum."""
    par = cfg.parallel
    c = _compressed_size(cfg)
    if c == 1 or par.error_feedback == "off":
        return 0
    per_node = group_sizes(cfg)["dp_sp_intra"] if par.dp_reduce == "hierarchical" else 1
    second = par.grad_compression == "int8" and not par.zero
    x = sum(length // per_node for length in lengths)
    return (x + (x // c if second else 0)) * np.dtype(cfg.train.dtype).itemsize


def _block_activation_bytes(cfg: Config, mode: str) -> int:
    """Bytes one block keeps for backward for one microbatch on one rank under ``mode`` (the
    fields of :class:`mpipar.model.llama.BlockSaved` it fills)."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    e, se = np.dtype(tr.dtype).itemsize, (8 if tr.dtype == "float64" else 4)
    n = tr.micro_batch_size * (tr.seq_len // par.sp)
    ns = n // (par.tp if par.tp_sequence_parallel else 1)    # the stream's tokens
    H, q, kv, F = m.hidden, m.heads // par.tp * m.head_dim, m.kv_heads // par.tp * m.head_dim, \
        m.ffn_hidden // par.tp
    lse = n * (m.heads // par.tp) * se
    ulysses = par.sp > 1 and par.sp_mode == "ulysses"
    # The core's output, and its context: the lse (local, ring) or Ulysses' all-to-all'ed copies
    # of q, k, v and of the output, and the lse.
    core = q * n * e + lse + ((2 * q + 2 * kv) * n * e if ulysses else 0) + _halo_bytes(cfg)
    inputs = 0 if ulysses else (q + 2 * kv) * n * e          # q, k, v as the core reads them
    if mode == "none":
        return (4 * H + 2) * ns * e + 3 * F * n * e + inputs + core  # x, h1, x2, h2, rstds, g, u, m
    if mode == "selective":
        return 2 * H * ns * e + 2 * F * n * e + core               # x, x2, g, u, the core's
    if mode == "full":
        return H * ns * e                                           # the block input only
    return 0                                                        # offload: on disk


def _halo_bytes(cfg: Config) -> int:
    """Bytes of the K/V rows halo attention keeps for backward in one block (the most of any
    SP rank and layer); 0 in the other modes."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    if par.sp == 1 or par.sp_mode != "halo":
        return 0
    layout = SeqLayout(tr.seq_len, par.sp, par.sp_split)
    rows = max(sum(len(p) for p in halo_plan(layout, r, w).recv.values())
               for r in range(par.sp) for w in set(m.windows()))
    return 2 * rows * tr.micro_batch_size * (m.kv_heads // par.tp) * m.head_dim \
        * np.dtype(tr.dtype).itemsize


def _head_activation_bytes(cfg: Config) -> int:
    """Bytes the LM head keeps for one microbatch: x, normed x, rstd (stream), logits, targets,
    lse."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    e, se = np.dtype(tr.dtype).itemsize, (8 if tr.dtype == "float64" else 4)
    n = tr.micro_batch_size * (tr.seq_len // par.sp)
    ns = n // (par.tp if par.tp_sequence_parallel else 1)
    vl = padded_vocab(m.vocab_size, par.tp) // par.tp
    return (2 * m.hidden + 1) * ns * e + vl * n * e + n * (8 + se)


def predict_memory(cfg: Config, coord: Coord) -> MemoryEstimate:
    """Memory of the rank at ``coord`` (resolved ``cfg``); see :class:`MemoryEstimate`."""
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    e = np.dtype(tr.dtype).itemsize
    lengths = list(unit_lengths(cfg, coord).values()) if par.zero >= 2 else \
        bucket_lengths(cfg, coord)
    flat = sum(lengths) * e
    owned = sum(L // (par.dp * par.sp) for L in lengths) * e
    if par.zero:
        optimizer = 2 * owned
    else:
        optimizer = 2 * sum(math.prod(s) for s in local_param_shapes(cfg, coord).values()) * e

    p, v = par.pp, par.virtual_stages
    per = m.layers // (p * v)
    last = p * v - 1
    mode = tr.recompute
    block = _block_activation_bytes(cfg, mode)
    head = 0 if mode == "offload" else _head_activation_bytes(cfg)
    n = tr.micro_batch_size * (tr.seq_len // par.sp)
    weight = {c: per * block + (head if c * p + coord.pp == last else 0)
              + (9 * n if c * p + coord.pp == 0 else 0)              # token ids and mask
              for c in range(v)}
    ops = _rank_ops(cfg, coord)
    live, peak = 0, 0
    for op in ops:                                      # what is saved between fwd and bwd
        if op.kind == "fwd":
            live += weight[op.chunk]
            peak = max(peak, live)
        elif op.kind in ("bwd", "bwd_weight"):
            live -= weight[op.chunk]
    working = _block_activation_bytes(cfg, "none") + (_head_activation_bytes(cfg)
                                                      if last % p == coord.pp else 0)
    if par.zero < 2:
        return MemoryEstimate(flat, flat, optimizer, peak + working,
                              residuals=residual_bytes(cfg, lengths))
    copy = node_copy(cfg, coord)
    weights = (flat if par.zero == 2 else owned if copy is None
               else sum(L // copy[0] for L in lengths) * e)        # its part of the node's copy
    return MemoryEstimate(weights, owned, optimizer, peak + working, _unit_buffers(cfg, coord))


def _unit_buffers(cfg: Config, coord: Coord) -> int:
    """ZeRO-2/3: a bound on the pool of whole-unit buffers (:class:`mpipar.parallel.fsdp.
    BufferPool` keeps what a step needed at once, by length): per unit length, the gathered
    units (the one computing, ``zero_prefetch`` ahead, the tied embedding beside the head, the
    units kept from their forward: ZeRO-3) and the gradient buffers (the unit in backward and
    ``MAX_IN_FLIGHT`` reduce-scatters; under zb-h1 a chunk's every unit, waiting for its weight
    op, beside them), and the received slices."""
    par, e = cfg.parallel, np.dtype(cfg.train.dtype).itemsize
    by_length: dict[int, int] = defaultdict(int)
    kept: dict[int, int] = defaultdict(int)
    lengths, shared = unit_lengths(cfg, coord), node_copy(cfg, coord) is not None
    for L in lengths.values():
        by_length[L] += 1
    for u in _kept_units(cfg, coord) if par.zero == 3 and _kept_meets_forward(cfg, coord) else ():
        kept[lengths[u]] += 1
    total = 0
    for L, k in by_length.items():
        gathered = (min(k, 2 + par.zero_prefetch + kept[L])
                    if par.zero == 3 and not shared else 0)
        grads = k + MAX_IN_FLIGHT if par.schedule == "zb-h1" else min(k, 1 + MAX_IN_FLIGHT)
        total += (gathered + grads) * L * e + min(k, 1 + MAX_IN_FLIGHT) * L // (par.dp * par.sp) * e
    return total


def parameter_count(model: ModelConfig) -> int:
    """Parameters of ``model`` from its sizes alone (no per-layer list: a model of 10^8 layers
    is counted at once): embedding and LM head ``V x H`` each, the final norm ``H``, and per
    block two norms, q/k/v/o and the three SwiGLU matrices."""
    m = resolve_model(model)
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    block = 2 * m.hidden + (2 * q + 2 * kv) * m.hidden + 3 * m.ffn_hidden * m.hidden
    return 2 * m.vocab_size * m.hidden + m.hidden + m.layers * block


def memory_lower_bound(cfg: Config) -> int:
    """Bytes the busiest rank of a resolved ``cfg`` needs at least: its share of the weights and
    gradients, ``2 x dtype bytes x parameters / (tp x pp)``. Cheap for any size, so absurd
    models are refused before :func:`predict_peak_memory` lists their parameters."""
    par = cfg.parallel
    e = np.dtype(cfg.train.dtype).itemsize
    return 2 * e * parameter_count(cfg.model) // (par.tp * par.pp)


def predict_peak_memory(cfg: Config, coord: Coord) -> int:
    """The most bytes the rank at ``coord`` holds at once (resolved ``cfg``), not counting the
    interpreter and its libraries: the largest of

    - initialisation: its initial parameter shards, plus the largest parameter it holds as a
      float64 global tensor, cast to the training dtype and copied (or padded) into its shard:
      a parameter is initialised whole, then sliced (:func:`mpipar.model.params.init_param`,
      ``Engine._initial_shards``);
    - building the engine: those shards while the flat weight and gradient buffers and the
      AdamW moments are allocated;
    - a step: :func:`predict_memory`, plus the step's tokens (this DP rank's int64 rows of
      ``seq_len + 1``, its inputs and targets, and their sequence chunks).
    """
    par, tr = cfg.parallel, cfg.train
    e = np.dtype(tr.dtype).itemsize
    mem = predict_memory(cfg, coord)
    shapes = local_param_shapes(cfg, coord)
    shards = e * sum(math.prod(shape) for shape in shapes.values())
    table = placement_table(cfg)
    largest = max(math.prod(table[name].spec.shape) for name in shapes)
    if par.zero >= 2:        # ZeRO-2/3 initialise one unit at a time
        shards = max(unit_lengths(cfg, coord).values()) * e
    initialising = shards + largest * (8 + 2 * e)
    building = shards + mem.weights + mem.grads + mem.optimizer + mem.residuals
    rows = tr.global_batch_size // par.dp
    tokens = 8 * rows * (3 * (tr.seq_len + 1) + 2 * (tr.seq_len // par.sp))
    return max(initialising, building, mem.total + tokens)


# -------------------------------------------------------------------------------------- FLOPs
def _block_flops_per_token(m: ModelConfig, tp: int, context: float) -> float:
    """Forward FLOPs of one block for one token of a TP rank (of ``tp``) attending to
    ``context`` keys."""
    H, D = m.hidden, m.head_dim
    hq, hkv, F = m.heads // tp, m.kv_heads // tp, m.ffn_hidden // tp
    matmul = 2 * H * (2 * hq * D + 2 * hkv * D) + 2 * 3 * H * F   # q, o, k, v; gate, up, down
    return matmul + 4 * hq * D * context                           # q k^T and p v


def window_context(seq_len: int, window: int) -> float:
    """Mean keys a query sees over a sequence: (S + 1) / 2 causal; with a sliding window W the
    query at position i sees min(i + 1, W)."""
    if window == 0 or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def model_flops_per_step(cfg: Config) -> float:
    """Model FLOPs of one optimizer step (forward + backward = 3 x forward, causal attention:
    a query at position i sees i + 1 keys, or min(i + 1, W) in a layer with a sliding window W),
    whatever the layout and recompute mode."""
    m, tr = cfg.model, cfg.train
    per_token = (sum(_block_flops_per_token(m, 1, window_context(tr.seq_len, w))
                     for w in m.windows())
                 + 2 * m.hidden * m.vocab_size)                    # LM head
    return 3.0 * per_token * tr.global_batch_size * tr.seq_len


def _sp_context(cfg: Config, window: int = 0) -> float:
    """Mean keys a query attends to on the SP rank with the most causal work, in a layer with
    sliding ``window`` (0: full causal)."""
    tr, par = cfg.train, cfg.parallel
    S, n = tr.seq_len, par.sp
    if window:
        return min(window, _sp_context(cfg))
    if n == 1 or par.sp_mode == "ulysses" or par.sp_split == "zigzag":
        return (S + 1) / 2
    return (S - S / n) + (S / n + 1) / 2               # the last rank: its chunk sees all before it


# --------------------------------------------------------------------------------------- time
@dataclass(frozen=True)
class Hardware:
    """What the time model assumes about one rank and its links: nominal numbers by default, or
    those ``python -m mpipar.bench comm`` measured (:meth:`load`). ``bandwidth`` and ``latency``
    are the link across nodes, ``intra_bandwidth`` and ``intra_latency`` the one inside a node
    (0: as across)."""

    peak_flops: float = 1e11       # FLOP/s of one rank (with its share of the node's cores)
    bandwidth: float = 1e10        # bytes/s of one rank's link to other nodes
    latency: float = 1e-5          # seconds per MPI call to other nodes
    intra_bandwidth: float = 0.0   # bytes/s inside a node (0: as across nodes)
    intra_latency: float = 0.0     # seconds per MPI call inside a node (0: as across nodes)
    ranks_per_node: int = 0        # ranks on one node measured (0: one node)
    op_overhead: float = 0.0       # seconds every kernel call costs besides its FLOPs
    elementwise_rate: float = 0.0  # elements/s of one in-place NumPy pass (0: optimizer not timed)
    int8_seconds: float = 0.0      # a rank's int8 encode/decode work per element compressed
    topk_seconds: float = 0.0      # a rank's top-k selection and decode work per element

    def link(self, kind: str) -> tuple[float, float]:
        """(bytes/s, seconds per call) of the link ``kind`` ("intra" or "inter")."""
        if kind == "intra":
            return self.intra_bandwidth or self.bandwidth, self.intra_latency or self.latency
        return self.bandwidth, self.latency

    @classmethod
    def from_links(cls, peak_flops: float, op_overhead: float, elementwise_rate: float,
                   links: dict[str, dict[str, float]], ranks_per_node: int, nodes: int,
                   codec_seconds: tuple[float, float] = (0.0, 0.0)) -> "Hardware":
        """From measured links (``{"intra"|"inter": {"allreduce_bandwidth": ..., ...}}``): a
        link's bandwidth and latency are those of its all-reduce (what most of a step's calls
        are); the other link stands in for a missing one. ``codec_seconds``: int8's and top-k's
        work per element."""
        def pick(scope: str) -> tuple[float, float]:
            v = links.get(scope) or next(iter(links.values()), None)
            return (v["allreduce_bandwidth"], v["allreduce_latency"]) if v else (1e10, 1e-5)
        (bw, lat), (ibw, ilat) = pick("inter"), pick("intra")
        return cls(peak_flops, bw, lat, ibw, ilat, ranks_per_node if nodes > 1 else 0,
                   op_overhead, elementwise_rate, *codec_seconds)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1)
            fh.write("\n")

    @classmethod
    def load(cls, path: str) -> "Hardware":
        """The hardware file ``path`` (from ``python -m mpipar.bench comm``)."""
        with open(path) as fh:
            data = json.load(fh)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{path}: unknown hardware fields {unknown}; expected {sorted(names)}")
        return cls(**data)


# Kernel and NumPy calls one microbatch makes through one block (counted in
# mpipar/model/llama.py: norm, q/k/v, RoPE, attention, o, residual, norm, gate, up, SwiGLU, down,
# residual forward; twice as many calls backward, whose linear ops each make two GEMMs), and
# through the embedding and LM head together.
OPS_BLOCK_FWD, OPS_BLOCK_BWD, OPS_ENDS = 16, 32, 12
# Ring attention adds per hop beyond the first: a block attention and a merge forward (twice as
# many calls backward).
OPS_RING_HOP = 2
# In-place NumPy passes of an optimizer step over this rank's parameters (mpipar/optim.py:
# AdamW's 15 on the owned elements; gradient norm, clipping and zeroing 4 on all of them).
ADAMW_PASSES, GRAD_PASSES = 15, 4


@dataclass
class StepTime:
    """Predicted seconds of one step on the slowest rank."""

    compute: float                  # FLOPs / peak of every op of the busiest pipeline rank
    comm: dict[str, float]          # exposed seconds per group
    bubble: float                   # idle fraction of the pipeline (dry run)
    total: float


INNER_GROUPS = ("tp", "sp", "sp_ulysses", "sp_ring")        # inside forward and backward ops
STEP_GROUPS = ("dp_sp", "dp_sp_intra", "dp_sp_inter", "tp_pp", "pp_ends")  # after the pipeline


def _group_seconds(cfg: Config, coord: Coord, hw: Hardware) -> dict[str, float]:
    """Seconds per group of the rank at ``coord``: its wire bytes over the group's link plus
    its calls times the link's latency. A group whose instance spans nodes runs at the pace of
    the link across them (a ring or a pipeline waits for its slowest hop)."""
    par = cfg.parallel
    sizes, nodes = group_sizes(cfg), nodes_of(cfg)
    shape = GridShape(par.dp, par.tp, par.pp, par.sp)
    me = shape.rank_of(coord)
    links: dict[str, tuple[float, float]] = {}
    out: dict[str, float] = defaultdict(float)
    for call in _calls(cfg, coord):
        if call.group not in links:
            members = shape.members(call.group, me, nodes, par.ulysses_size or 1)
            links[call.group] = hw.link("inter" if len({nodes.nodes[r] for r in members}) > 1
                                        else "intra")
        bw, lat = links[call.group]
        out[call.group] += (wire_bytes(call.op, call.nbytes, sizes[call.group]) / bw
                            + lat) * call.count
    if _compressed_size(cfg) > 1:          # encoding and decoding sit on the reduction's path
        group = "dp_sp_inter" if par.dp_reduce == "hierarchical" else "dp_sp"
        per_node = sizes["dp_sp_intra"] if par.dp_reduce == "hierarchical" else 1
        rate = hw.int8_seconds if par.grad_compression == "int8" else hw.topk_seconds
        out[group] += rate * sum(bucket_lengths(cfg, coord)) / per_node
    return dict(out)


def with_nodes(cfg: Config, hw: Hardware, world: int) -> Config:
    """``cfg`` (a configuration, or a resolved Layout) on the nodes the planner assumes: its own
    ``ranks_per_node`` when given, else the hardware's measured one (when it divides ``world``),
    else one node."""
    k, par = hw.ranks_per_node, cfg.parallel
    if par.ranks_per_node or not k or world % k:
        return cfg
    if isinstance(cfg, Layout):
        return vary(cfg, parallel={"ranks_per_node": k})
    return dataclasses.replace(cfg, parallel=dataclasses.replace(par, ranks_per_node=k))


def _sp_blocks(mode: str, layout: SeqLayout, window: int) -> int:
    """Key blocks beyond its own that a rank attends to in a layer with ``window``: the ring's
    hops, or the halo's source ranks (the most of any rank); 0 for Ulysses and without SP."""
    if layout.sp == 1 or mode == "ulysses":
        return 0
    if mode == "halo":
        return max(len(halo_plan(layout, r, window).recv) for r in range(layout.sp))
    hops = ring_hops(layout, window)
    return hops.right + hops.left


def predict_step_time(cfg: Config, hw: Hardware = Hardware()) -> StepTime:
    """The step time model of this module's docstring for a resolved ``cfg`` (on
    :func:`with_nodes`)."""
    par = cfg.parallel
    cfg = with_nodes(cfg, hw, par.dp * par.tp * par.pp * par.sp)
    m, par, tr = cfg.model, cfg.parallel, cfg.train
    p, v = par.pp, par.virtual_stages
    per = m.layers // (p * v)
    micro = _microbatches(cfg)
    n = tr.micro_batch_size * (tr.seq_len // par.sp)
    vl = padded_vocab(m.vocab_size, par.tp) // par.tp
    windows = m.windows()
    layout = (SeqLayout(tr.seq_len, par.sp // par.ulysses_size, par.sp_split)
              if par.sp_mode == "hybrid" else SeqLayout(tr.seq_len, par.sp, par.sp_split))
    # Mean over the layers: attention context and the extra blocks ring / halo attention compute.
    context = sum(_sp_context(cfg, w) for w in windows) / len(windows)
    hops = sum(_sp_blocks(par.sp_mode, layout, w) for w in windows) / len(windows)
    block_fwd = (_block_flops_per_token(cfg.model, cfg.parallel.tp, context) * n / hw.peak_flops
                 + (OPS_BLOCK_FWD + OPS_RING_HOP * hops) * hw.op_overhead) * per
    head_fwd = 2 * m.hidden * vl * n / hw.peak_flops + OPS_ENDS / 3 * hw.op_overhead
    # Forward work backward repeats: the whole blocks (full) or the q/k/v projections (selective).
    qkv = 2 * m.hidden * (m.heads + 2 * m.kv_heads) // par.tp * m.head_dim * n * per
    redo = {"full": block_fwd, "selective": qkv / hw.peak_flops}.get(tr.recompute, 0.0)

    comm: dict[str, float] = {}
    unit, compute = 0.0, 0.0
    for r in range(p):
        seconds = _group_seconds(cfg, Coord(dp=0, tp=0, pp=r, sp=0), hw)
        for g, t in seconds.items():
            comm[g] = max(comm.get(g, 0.0), t)
        inner = sum(seconds.get(g, 0.0) for g in INNER_GROUPS) / (micro * v)  # per fwd + bwd
        head = head_fwd if r == (p * v - 1) % p else 0.0    # on the rank's worst chunk
        unit = max(unit, block_fwd + head + inner / 3)
        compute = max(compute, micro * (v * (3 * block_fwd + redo) + 3 * head))
    hop = 0.0
    if p > 1:
        bw, lat = hw.link("inter" if "pp" in _crossing(cfg) else "intra")
        hop = n * m.hidden * np.dtype(tr.dtype).itemsize / bw + lat
    run = dry_run(_schedule(par.schedule, p, micro, v), p, micro, v, cost_fwd=unit,
                  cost_bwd_input=unit + redo, cost_bwd_weight=unit, cost_comm=hop)
    total = (run.makespan + sum(comm.get(g, 0.0) for g in STEP_GROUPS)
             + _optimizer_time(cfg, hw))
    return StepTime(compute, comm, run.bubble_fraction, total)


def _optimizer_time(cfg: Config, hw: Hardware) -> float:
    """Seconds of the optimizer step on the rank with the most parameters: memory-bound passes
    at the measured elementwise rate (0 with nominal hardware)."""
    if not hw.elementwise_rate:
        return 0.0
    par = cfg.parallel
    local = max(sum(bucket_lengths(cfg, Coord(dp=0, tp=0, pp=r, sp=0))) for r in range(par.pp))
    owned = local // (par.dp * par.sp) if par.zero else local
    return (ADAMW_PASSES * owned + GRAD_PASSES * local) / hw.elementwise_rate


def _crossing(cfg: Config) -> set[str]:
    """The groups some instance of which spans nodes on :func:`nodes_of`."""
    par = cfg.parallel
    shape, nodes = GridShape(par.dp, par.tp, par.pp, par.sp), nodes_of(cfg)
    if nodes.count == 1:
        return set()
    return {g for g in GROUP_AXES if shape.crosses(g, nodes)}


# ------------------------------------------------------------------------------ enumeration
@dataclass
class Candidate:
    """A layout that validates, with its predictions (worst pipeline rank)."""

    cfg: Config
    memory: MemoryEstimate
    step_bytes: dict[str, int]
    time: StepTime
    link_bytes: dict[str, dict[str, int]] = field(default_factory=dict)   # wire, worst rank

    def describe(self) -> str:
        par, tr = self.cfg.parallel, self.cfg.train
        text = f"dp={par.dp} tp={par.tp} pp={par.pp} sp={par.sp}"
        if par.pp > 1:
            text += f" {par.schedule}" + (f"(v={par.virtual_stages})" if par.virtual_stages > 1
                                          else "")
        if par.sp > 1:
            text += f" {par.sp_mode}" + ("" if par.sp_mode == "ulysses" else f"/{par.sp_split}")
            text += f"(U={par.ulysses_size})" if par.sp_mode == "hybrid" else ""
        if par.dp * par.sp > 1 and par.dp_reduce == "hierarchical":
            text += " hierarchical"
        if par.dp * par.sp > 1 and par.grad_compression != "none":
            text += " " + {"int8": "int8", "topk": f"top-{par.topk_ratio:g}"}[
                par.grad_compression] + ("" if par.error_feedback == "on" else " no-EF")
        zero = f"{par.zero}" + ("(node shared)" if par.zero_shared == "node" else "")
        return text + f" mbs={tr.micro_batch_size} zero={zero} recompute={tr.recompute}"


@dataclass
class Rejection:
    layout: str
    reason: str


@dataclass
class Plan:
    ranked: list[Candidate] = field(default_factory=list)     # fastest first
    rejected: list[Rejection] = field(default_factory=list)


RECOMPUTE_ORDER = ("none", "selective", "full")


def _factorisations(world: int) -> list[tuple[int, int, int, int]]:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [c for c in itertools.product(divisors, repeat=4) if math.prod(c) == world]


def _variants(base: Config, sizes: tuple[int, int, int, int], fixed: set[str]
              ) -> Iterator[Config]:
    """Configs with ``sizes`` = (dp, tp, pp, sp) and every free schedule / SP / batch / ZeRO /
    reduction / compression choice (hierarchical reduction and hybrid SP when nodes are given)."""
    par, tr, m = base.parallel, base.train, base.model
    dp, tp, pp, sp = sizes
    if {"schedule", "virtual_stages"} & fixed or pp == 1:
        schedules = [(par.schedule, par.virtual_stages)] if pp > 1 or {"schedule",
                                                                        "virtual_stages"} & fixed \
            else [("1f1b", 1)]
    else:
        schedules = [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1)] + [
            ("interleaved", v) for v in (2, 4) if m.layers % (pp * v) == 0]
    if sp == 1 or {"sp_mode", "sp_split", "ulysses_size"} & fixed:
        sp_modes = [(par.sp_mode, par.sp_split, par.ulysses_size)]
    else:
        sp_modes = [("ring", "zigzag", 0), ("ring", "contiguous", 0), ("ulysses", "contiguous", 0)]
        node_sp = par.ranks_per_node // tp if par.ranks_per_node % tp == 0 else 0
        if 1 < node_sp < sp and sp % node_sp == 0:      # Ulysses inside a node, ring across
            sp_modes.append(("hybrid", "zigzag", node_sp))
    rows = tr.global_batch_size // dp if tr.global_batch_size % dp == 0 else 0
    if "micro_batch_size" in fixed or rows == 0:
        micro = [tr.micro_batch_size]
    else:
        micro = [b for b in range(1, rows + 1) if rows % b == 0]
    zeros = [par.zero] if "zero" in fixed or dp * sp == 1 else [0, 1, 2, 3]
    across = par.ranks_per_node and par.ranks_per_node < dp * tp * pp * sp   # several nodes
    reduces = ([par.dp_reduce] if "dp_reduce" in fixed or dp * sp == 1 or not across
               else ["flat", "hierarchical"])
    codecs = ([par.grad_compression] if "grad_compression" in fixed or dp * sp == 1
              or not across else ["none", "int8", "topk"])
    def shared_choices(zero: int) -> list[str]:
        """ZeRO-3 on the CPU: gathered, or in node shared memory."""
        if zero != 3:
            return ["off"]
        if "zero_shared" in fixed or tr.device == "cuda":
            return [par.zero_shared]
        return ["off", "node"]
    for (schedule, v), (mode, split, u), mbs, zero, reduce, codec in itertools.product(
            schedules, sp_modes, micro, zeros, reduces, codecs):
        # ZeRO-2/3 reduce-scatter dense and flat (fsdp's rule): a variant that clashes only
        # because a free field was varied is no layout; fixed fields that clash are rejected.
        if zero >= 2 and not ("zero" in fixed and (
                reduce != "flat" and "dp_reduce" in fixed
                or codec != "none" and "grad_compression" in fixed)) \
                and (reduce, codec) != ("flat", "none"):
            continue
        for shared in shared_choices(zero):
            yield Config(base.model, dataclasses.replace(
                par, dp=dp, tp=tp, pp=pp, sp=sp, schedule=schedule, virtual_stages=v,
                sp_mode=mode, sp_split=split, ulysses_size=u, zero=zero, zero_shared=shared,
                dp_reduce=reduce, grad_compression=codec),
                dataclasses.replace(tr, micro_batch_size=mbs))


def evaluate(cfg: Config, hw: Hardware = Hardware()) -> Candidate:
    """Predictions for a resolved ``cfg``: memory, bytes and wire bytes per link of its worst
    pipeline rank (its first rank on every other axis), on :func:`with_nodes`."""
    par = cfg.parallel
    cfg = with_nodes(cfg, hw, par.dp * par.tp * par.pp * par.sp)
    coords = [Coord(dp=0, tp=0, pp=r, sp=0) for r in range(cfg.parallel.pp)]
    memory = max((predict_memory(cfg, c) for c in coords), key=lambda x: x.total)
    step_bytes: dict[str, int] = {}
    link_bytes: dict[str, dict[str, int]] = {}
    for c in coords:
        for g, b in predict_step_bytes(cfg, c).items():
            step_bytes[g] = max(step_bytes.get(g, 0), b)
        for g, links in predict_link_bytes(cfg, c).items():
            worst = link_bytes.setdefault(g, dict.fromkeys(LINKS, 0))
            for link, b in links.items():
                worst[link] = max(worst[link], b)
    return Candidate(cfg, memory, step_bytes, predict_step_time(cfg, hw), link_bytes)


def plan_layouts(base: Config, world: int, fixed: set[str] = frozenset(),
                 memory_bytes: float | None = None, hw: Hardware = Hardware()) -> Plan:
    """Every layout of ``world`` ranks for ``base``'s model and batch, ranked by predicted step
    time; ``fixed`` names the fields (of [parallel] and [train]) to keep as ``base`` has them.
    For each layout the first recompute mode (none, selective, full) whose memory fits
    ``memory_bytes`` per rank is taken (a fixed ``recompute`` is kept). Layouts that break a
    configuration rule, or whose every variant exceeds the memory, are returned as rejections
    with the reason (the rule's message, or the least memory any variant needs)."""
    plan = Plan()
    base = with_nodes(base, hw, world)
    given = {f: getattr(base.parallel, f) for f in SIZE_FIELDS if f in fixed}
    for sizes in _factorisations(world):
        if any(dict(zip(SIZE_FIELDS, sizes))[f] != v for f, v in given.items() if v):
            continue
        errors: list[str] = []
        too_big: list[Candidate] = []
        accepted = 0
        for cfg in _variants(base, sizes, fixed):
            try:
                cfg = validate(cfg, world)
            except ConfigError as exc:
                errors.append(str(exc))
                continue
            modes = [cfg.train.recompute] if "recompute" in fixed else RECOMPUTE_ORDER
            for mode in modes:
                trial = evaluate(vary(cfg, train={"recompute": mode}), hw)
                if memory_bytes is None or trial.memory.total <= memory_bytes:
                    plan.ranked.append(trial)
                    accepted += 1
                    break
            else:
                too_big.append(trial)
        if accepted:
            continue
        label = "dp={} tp={} pp={} sp={}".format(*sizes)
        if too_big:
            least = min(too_big, key=lambda c: c.memory.total)
            plan.rejected.append(Rejection(label, (
                f"needs at least {least.memory.total / 2**30:.3g} GiB per rank "
                f"({least.describe()}), more than --memory-gb {memory_bytes / 2**30:g}")))
        elif errors:
            plan.rejected.append(Rejection(label, errors[0]))
    plan.ranked.sort(key=lambda c: (c.time.total, c.memory.total))
    return plan


def auto_layout(cfg: Config, world: int, given: set[str]) -> tuple[Config, str | None]:
    """The layout ``python -m mpipar.train`` uses when no parallel size is ``given``: pure data
    parallelism when ``dp = world`` divides the batch; otherwise the fastest layout of
    :func:`plan_layouts` (nominal :class:`Hardware`, so every rank decides the same); otherwise,
    unless the global batch size was given, the batch rounded up to a multiple of the world.
    Returns the config (unresolved) and a note saying what was chosen, or None if nothing
    changed."""
    if set(SIZE_FIELDS) & given:
        return cfg, None
    try:
        validate(cfg, world)
        return cfg, None
    except ConfigError as exc:
        first_error = str(exc)
    fixed = {f.name for sec in (cfg.parallel, cfg.train) for f in dataclasses.fields(sec)}
    fixed -= set(SIZE_FIELDS)
    plan = plan_layouts(cfg, world, fixed)
    if plan.ranked:
        best = plan.ranked[0].cfg.parallel
        out = Config(cfg.model, dataclasses.replace(cfg.parallel, dp=best.dp, tp=best.tp,
                                                    pp=best.pp, sp=best.sp), cfg.train)
        return out, (f"{first_error}; chose dp={best.dp} tp={best.tp} pp={best.pp} sp={best.sp} "
                     f"(the planner's fastest layout; set --dp/--tp/--pp/--sp to choose)")
    if "global_batch_size" in given:
        return cfg, None
    tr = cfg.train
    unit = world * (tr.micro_batch_size or 1)
    batch = -(-tr.global_batch_size // unit) * unit
    out = Config(cfg.model, dataclasses.replace(cfg.parallel, dp=world),
                 dataclasses.replace(tr, global_batch_size=batch))
    return out, (f"{first_error}; no layout of {world} ranks fits global_batch_size="
                 f"{tr.global_batch_size}, so it is {batch} (dp={world}); set "
                 f"--global-batch-size to choose")
