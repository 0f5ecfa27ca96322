"""How long one optimizer step of a layout takes: the model that ranks layouts.

::

    op time    = FLOPs of one microbatch through one chunk / peak  +  kernel calls x op overhead
                 +  its TP and SP traffic
    pipeline   = dry run of the schedule with those op times (backward = 2 x forward, plus
                 the forward work recompute repeats) and
                 point-to-point messages of  activation bytes / bandwidth + latency: the makespan,
                 which includes the bubble
    step time  = pipeline + DP x SP gradient traffic (+ compression's encode/decode work)
                 + gradient-norm all-reduce + the tied embedding's gradient sum
                 + optimizer passes over the rank's parameters / elementwise rate
                 + Muon's Newton-Schulz FLOPs on its busiest owner / peak

(the last stage's head work includes the multi-token prediction modules': a projection, a
block and the shared head each)

with traffic ``wire bytes / bandwidth + messages x latency`` (ring all-reduce moves ``2 (n-1)/n``
of the buffer, an all-to-all ``(n-1)/n``, point-to-point all of it; an all-reduce under
``--allreduce-algorithm`` (or the one ``auto`` picks from ``--allreduce-hardware`` for its size)
the rank's share of that algorithm's schedule, and a tree's ``2 ceil(log2 n)`` payloads in
sequence, reduce then broadcast; the calls are
:func:`mpipar.plan.traffic.step_calls`), over the link inside a node or, for a group that spans
nodes, across them. :class:`Hardware` holds the peak, the links, the per-call overhead and
compression's work per element: nominal, measured by ``python -m mpipar.bench comm``, or probed
by ``python -m mpipar.plan`` (:mod:`mpipar.plan.probe`: there ``peak_flops`` is the rate the
model's own forward and backward runs its FLOPs at, the non-GEMM passes included; on a CPU, a
kernel call's Python and NumPy dispatch and the cores that ranks share dominate small models: the
rates are a rank's share of the node). The nodes are ``parallel.ranks_per_node``
consecutive ranks each, else those of the hardware file, else one (:func:`with_nodes`).
With ``--document-masking`` the model reads a step's documents (:class:`StepDocuments`, the
run's first global batch): attention's keys per query on the busiest sp rank and the ring's hops
are those of its microbatches, not of a full causal square.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import json
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from mpipar.config import Config
from mpipar.layout import Layout, vary
from mpipar.model.attention import DocumentPositions
from mpipar.model.mtp import mtp_layers
from mpipar.parallel.sequence.cost import attention_context, document_attention, extra_key_blocks
from mpipar.parallel.sequence.mode import SequenceMode
from mpipar.parallel.sequence.registry import sequence_mode
from mpipar.parallel.sequence_split import MIN_CHUNK
from mpipar.parallel.pipeline.cost import message_bytes
from mpipar.parallel.pipeline.schedule import dry_run
from mpipar.parallel.registry import AXES
from mpipar.parallel.tensor.cost import block_flops, head_flops, mtp_flops, qkv_flops
from mpipar.plan.rank import (bucket_lengths, grid_shape, group_members, nodes_of,
                              schedule_ops)
from mpipar.plan.optimizer import newton_schulz_flops
from mpipar.plan.traffic import PlannedStep, call_algorithm, call_wire
from mpipar.runtime import allreduce
from mpipar.runtime.topology import GROUP_AXES, Coord
from mpipar.training.optimizers import optimizer_mode


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
    allreduce_seconds: dict = dataclasses.field(default_factory=dict, hash=False)
    """algorithm (ring, tree, rabenseifner, auto: the library's own) -> {bytes: seconds} of one
    non-blocking all-reduce over the world (``bench comm --algorithms``), what
    ``--allreduce-algorithm auto --allreduce-hardware`` picks from."""

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
        data = allreduce.read_hardware_file(path)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{path}: unknown hardware fields {unknown}; expected {sorted(names)}")
        for name, value in data.items():
            if name == "allreduce_seconds":
                data[name] = allreduce.parse_table(value, f"{path}: allreduce_seconds")
            elif (isinstance(value, bool) or not isinstance(value, (int, float))
                  or not math.isfinite(value) or value < 0
                  or (name == "ranks_per_node" and value != int(value))):
                raise ValueError(f"{path}: {name}={str(value)[:40]!r} is not a "
                                 f"{'whole ' if name == 'ranks_per_node' else ''}number >= 0")
        if "ranks_per_node" in data:
            data["ranks_per_node"] = int(data["ranks_per_node"])
        return cls(**data)


def with_nodes(cfg: Config | Layout, hw: Hardware, world: int) -> Config | Layout:
    """``cfg`` (a configuration, or a resolved Layout) on the nodes the planner assumes: its own
    ``ranks_per_node`` when given, else the hardware's measured one (when it divides ``world``),
    else one node."""
    k, par = hw.ranks_per_node, cfg.parallel
    if par.ranks_per_node or not k or world % k:
        return cfg
    if isinstance(cfg, Layout):
        return vary(cfg, parallel={"ranks_per_node": k})
    return dataclasses.replace(cfg, parallel=dataclasses.replace(par, ranks_per_node=k))


# Kernel and NumPy calls one microbatch makes through one block (counted in
# mpipar/model/llama.py: norm, q/k/v, RoPE, attention, o, residual, norm, gate, up, SwiGLU, down,
# residual forward; twice as many calls backward, whose linear ops each make two GEMMs), and
# through the embedding and LM head together.
OPS_BLOCK_FWD, OPS_BLOCK_BWD, OPS_ENDS = 16, 32, 12
# A multi-token prediction module's own calls forward besides its block and head
# (mpipar/model/mtp.py: the embedding, two norms, the concatenation, the projection).
OPS_MTP = 5
# Ring attention adds per hop beyond the first: a block attention and a merge forward (twice as
# many calls backward).
OPS_RING_HOP = 2
# In-place NumPy passes of an optimizer step over this rank's parameters
# (mpipar/training/optim.py: AdamW's 15 on the owned elements; gradient norm, clipping and
# zeroing 4 on all of them).
ADAMW_PASSES, GRAD_PASSES = 15, 4


@dataclass
class StepTime:
    """Predicted seconds of one step on the slowest rank."""

    compute: float                  # FLOPs / peak of every op of the busiest pipeline rank
    comm: dict[str, float]          # exposed seconds per group
    bubble: float                   # idle fraction of the pipeline (dry run)
    total: float


INNER_GROUPS = ("tp", "sp", "sp_ulysses", "sp_ring", "ep")  # inside forward and backward ops
STEP_GROUPS = ("dp_sp", "dp_sp_intra", "dp_sp_inter", "tp_pp", "pp_ends")  # after the pipeline


def _group_seconds(rank: PlannedStep, hw: Hardware) -> dict[str, float]:
    """Seconds per group of the planned training step ``rank``: its wire bytes over the
    group's link plus its calls times the link's latency. A group whose instance spans nodes
    runs at the pace of the link across them (a ring or a pipeline waits for its slowest
    hop)."""
    layout, coord = rank.layout, rank.coord
    sizes, nodes, shape = rank.group_sizes, nodes_of(layout), grid_shape(layout)
    me = shape.rank_of(coord)
    links: dict[str, tuple[float, float]] = {}
    out: dict[str, float] = defaultdict(float)
    for call in rank.calls:
        if call.group not in links:
            members = group_members(layout, call.group, me)
            links[call.group] = hw.link("inter" if len({nodes.nodes[r] for r in members}) > 1
                                        else "intra")
        bw, lat = links[call.group]
        wire = call_wire(layout, coord, call, sizes)
        if call_algorithm(layout, call) == "tree":   # reduce then broadcast, level by level
            wire = 2 * math.ceil(math.log2(sizes[call.group])) * call.nbytes
        out[call.group] += (wire / bw + lat) * call.count
    for axis in AXES:            # what the axes spend besides transfers (a codec's work)
        for group, seconds in axis.seconds(rank, hw).items():
            out[group] += seconds
    return dict(out)


@dataclass(frozen=True, eq=False)
class StepDocuments:
    """A step's packed documents: the ids ``[global batch, seq_len]`` of the run's first global
    batch (:func:`mpipar.data.packing.step_documents`). One per plan, compared by identity, so
    what is derived from it per layout is found once (:func:`_document_sp`)."""

    ids: np.ndarray

    @functools.lru_cache(maxsize=64)
    def microbatches(self, dp: int, mbs: int) -> tuple[DocumentPositions, ...]:
        """dp replica 0's microbatches (the engine's cut of the global batch), each's
        documents as the traffic reads them
        (:func:`mpipar.parallel.sequence.cost.sequence_calls`)."""
        rows = self.ids[:self.ids.shape[0] // dp]
        return tuple(DocumentPositions.of(np.arange(0), rows[i:i + mbs])
                     for i in range(0, rows.shape[0], mbs))


@functools.lru_cache(maxsize=4096)
def _document_sp(docs: StepDocuments, seq_len: int, sp: int, split: str, mode: SequenceMode,
                 u: int, dp: int, mbs: int, window: int, min_chunk: int = MIN_CHUNK
                 ) -> tuple[float, float]:
    """:func:`mpipar.parallel.sequence.cost.document_attention` over dp replica 0's
    microbatches of ``docs`` (cached: the layout search asks for the same ones many times)."""
    return document_attention(docs.microbatches(dp, mbs), seq_len, sp, split, mode, u, mbs,
                              window, min_chunk)


def step_microbatches(layout: Layout, documents: StepDocuments | None
                      ) -> tuple[DocumentPositions, ...] | None:
    """The documents of each microbatch of dp replica 0 (what :func:`mpipar.plan.traffic.
    step_calls` reads), or None without ``documents``."""
    if documents is None:
        return None
    return documents.microbatches(layout.parallel.dp, layout.train.micro_batch_size)


def planned_ranks(layout: Layout, documents: StepDocuments | None = None
                  ) -> list[PlannedStep]:
    """The training step of each pipeline rank of ``layout`` (its first rank on every other
    axis), with ``documents``' microbatches: what the time, traffic and memory terms of one
    layout read, each rank's calls listed once (:attr:`mpipar.plan.traffic.PlannedStep.calls`)."""
    micro = step_microbatches(layout, documents)
    return [PlannedStep(layout, Coord(dp=0, tp=0, pp=r, sp=0), True, documents=micro)
            for r in range(layout.pp)]


def predict_step_time(layout: Layout, hw: Hardware = Hardware(),
                      documents: StepDocuments | None = None,
                      ranks: list[PlannedStep] | None = None) -> StepTime:
    """The step time model of this module's docstring for ``layout`` (on :func:`with_nodes`),
    with ``documents`` for ``--document-masking``; ``ranks``: its :func:`planned_ranks` when
    the caller has them already (on :func:`with_nodes`' layout)."""
    layout = with_nodes(layout, hw, layout.world)
    ranks = ranks or planned_ranks(layout, documents)
    m, par, tr = layout.model, layout.parallel, layout.train
    p, v, micro = par.pp, par.virtual_stages, layout.microbatches
    per = m.layers // (p * v)
    windows = m.windows()
    mode = sequence_mode(par)
    seq = mode.ring_split(tr.seq_len, par.sp, par.sp_split, par.ulysses_size, par.sp_min_chunk)
    # Mean over the layers: attention context and the extra blocks ring / halo attention compute.
    if documents is None:
        context = sum(attention_context(layout, w) for w in windows) / len(windows)
        hops = sum(extra_key_blocks(mode, seq, w) for w in windows) / len(windows)
    else:
        each = [_document_sp(documents, tr.seq_len, par.sp, par.sp_split, mode,
                             par.ulysses_size, par.dp, tr.micro_batch_size, w,
                             par.sp_min_chunk) for w in windows]
        context, hops = (sum(x[i] for x in each) / len(each) for i in (0, 1))
    block_fwd = (block_flops(layout, context) / hw.peak_flops
                 + (OPS_BLOCK_FWD + OPS_RING_HOP * hops) * hw.op_overhead) * per
    head_fwd = head_flops(layout) / hw.peak_flops + OPS_ENDS / 3 * hw.op_overhead
    # Forward work backward repeats: the whole blocks (full) or the q/k/v projections (selective).
    redo = tr.recompute_mode.redo_seconds(block_fwd, qkv_flops(layout, per) / hw.peak_flops)
    # The multi-token prediction modules run with the head: a projection, a block, the head each.
    depth = m.mtp_depth
    mtp_fwd = (mtp_flops(layout, [attention_context(layout, m.layer_window(j))
                                  for j in mtp_layers(m)]) / hw.peak_flops
               + depth * (OPS_BLOCK_FWD + OPS_MTP + OPS_ENDS / 3) * hw.op_overhead)
    head_fwd += mtp_fwd + tr.recompute_mode.redo_seconds(
        mtp_fwd, qkv_flops(layout, depth) / hw.peak_flops) / 3

    comm: dict[str, float] = {}
    unit, compute = 0.0, 0.0
    for r in range(p):
        seconds = _group_seconds(ranks[r], hw)
        for g, t in seconds.items():
            comm[g] = max(comm.get(g, 0.0), t)
        inner = sum(seconds.get(g, 0.0) for g in INNER_GROUPS) / (micro * v)  # per fwd + bwd
        head = head_fwd if r == (p * v - 1) % p else 0.0    # on the rank's worst chunk
        unit = max(unit, block_fwd + head + inner / 3)
        compute = max(compute, micro * (v * (3 * block_fwd + redo) + 3 * head))
    hop = 0.0
    if p > 1:
        bw, lat = hw.link("inter" if "pp" in _crossing(layout) else "intra")
        hop = message_bytes(layout) / bw + lat
    run = dry_run(schedule_ops(layout), p, micro, v, cost_fwd=unit,
                  cost_bwd_input=unit + redo, cost_bwd_weight=unit, cost_comm=hop)
    total = (run.makespan + sum(comm.get(g, 0.0) for g in STEP_GROUPS)
             + _optimizer_time(layout, hw))
    return StepTime(compute, comm, run.bubble_fraction, total)


def _optimizer_time(layout: Layout, hw: Hardware) -> float:
    """Seconds of the optimizer step: memory-bound passes on the rank with the most parameters
    at the measured elementwise rate (none with nominal hardware), plus under Muon the
    Newton-Schulz FLOPs of the rank that runs the most (:func:`newton_schulz_seconds`)."""
    ns = newton_schulz_seconds(layout, hw)
    if not hw.elementwise_rate:
        return ns
    par = layout.parallel
    local = max(sum(bucket_lengths(layout, Coord(dp=0, tp=0, pp=r, sp=0)))
                for r in range(par.pp))
    owned = local // (layout.dp * par.sp) if par.zero else local
    return (ADAMW_PASSES * owned + GRAD_PASSES * local) / hw.elementwise_rate + ns


def newton_schulz_seconds(layout: Layout, hw: Hardware) -> float:
    """Seconds of Muon's Newton-Schulz iterations in a step at ``hw.peak_flops`` on the rank
    that runs the most (:func:`mpipar.plan.optimizer.newton_schulz_flops`; 0 under AdamW).
    At ZeRO-0 every dp x sp replica runs the same; with ZeRO the owners spread over dp x sp."""
    if not optimizer_mode(layout.train).muon:
        return 0.0
    par = layout.parallel
    spread = range(layout.dp) if par.zero else range(1)
    return max(newton_schulz_flops(layout, Coord(dp=d, tp=t, pp=r, sp=s))
               for d in spread for s in (range(par.sp) if par.zero else range(1))
               for t in range(par.tp) for r in range(par.pp)) / hw.peak_flops


def _crossing(layout: Layout) -> set[str]:
    """The groups some instance of which spans nodes on :func:`mpipar.plan.rank.nodes_of`."""
    shape, nodes = grid_shape(layout), nodes_of(layout)
    if nodes.count == 1:
        return set()
    return {g for g in GROUP_AXES if shape.crosses(g, nodes)}
