"""The memory model: what one rank holds, in training and in generation.

:func:`predict_memory` gives a rank's bytes of weights, gradients and optimizer state (exact: the
engine's flat buffers and moments, or ZeRO-2/3's units) and of saved activations (an estimate
from what each recompute mode keeps, at the peak number of microbatches the schedule holds in
flight). :func:`predict_peak_memory` adds initialisation and the token batch: what training
compares with the node's memory before it allocates anything; :func:`memory_lower_bound` is a
cheap bound for models too large to list. A generation's rank: :func:`predict_generation_memory`
(its shards, the KV cache, the prompt's pass) and :func:`generation_lower_bound`. What the node
gives them is :mod:`mpipar.plan.admission`'s business.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from mpipar.config import ModelConfig, TrainConfig
from mpipar.data.preference import preference_pairs
from mpipar.data.sources import DataError
from mpipar.layout import Layout, resolve_model
from mpipar.model.latent_attention import latent_param_shapes
from mpipar.model.lora import Lora
from mpipar.model.params import param_specs
from mpipar.model.recompute import NONE, Recompute
from mpipar.parallel.pipeline.cost import saved_peak
from mpipar.parallel.placement import padded_vocab
from mpipar.parallel.registry import AXES
from mpipar.plan import state_copies
from mpipar.plan.optimizer import optimizer_buffer_bytes, optimizer_elements
from mpipar.plan.rank import (expert_buckets, expert_unit_lengths, frozen_unit_lengths,
                              local_param_shapes, node_copy, placement_table, rank_ops,
                              unit_lengths)
from mpipar.plan.traffic import PlannedStep
from mpipar.runtime.precision import Precision
from mpipar.runtime.topology import Coord, rank_coord


@dataclass
class MemoryEstimate:
    """Bytes one rank holds: exact for the state, an estimate for activations. Each in its
    precision (:class:`mpipar.runtime.precision.Precision`): weights and activations in the
    compute dtype; masters, gradients and moments in the masters' (float32 under bf16)."""

    weights: int       # flat parameter buckets (padded to a multiple of dp*sp; ZeRO-3: a slice):
                       # the compute copies
    grads: int         # flat gradient buckets, same size (ZeRO-2/3: this rank's slices only)
    optimizer: int     # AdamW moments m and v (ZeRO-1/2/3: this rank's slices only)
    activations: int   # saved for backward at the schedule's peak, plus one block's working set
    buffers: int = 0   # ZeRO-2/3: the pool of whole units (gathered, gradients), at most;
                       # ZeRO-0/1 with --reduce-dtype bfloat16: the buckets' bf16 copies
    residuals: int = 0  # error-feedback residuals of compressed reduction
    masters: int = 0   # bf16 compute: the float32 master weights (ZeRO-0: whole; ZeRO-1/2/3:
                       # the owned slices); 0 when the weights are the masters
    copies: int = 0    # --state-copies: the state copies kept (mpipar.plan.state_copies)

    @property
    def state(self) -> int:
        """Weights, master weights, gradients and optimizer state: what ZeRO shards."""
        return self.weights + self.masters + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.activations + self.buffers + self.residuals + self.copies


def _precision(layout: Layout) -> Precision:
    return Precision.of(layout.train, layout.parallel)


def _block_activation_bytes(layout: Layout, mode: Recompute, sparse: bool = False) -> int:
    """Bytes one block keeps for backward for one microbatch on one rank under ``mode``: the
    fields of :class:`mpipar.model.llama.BlockSaved` it keeps (:func:`_block_field_bytes`);
    ``sparse``: a mixture-of-experts block."""
    return mode.resident_bytes(_block_field_bytes(layout, sparse, mode))


def _block_field_bytes(layout: Layout, sparse: bool = False, mode: Recompute = NONE
                       ) -> dict[str, int]:
    """Bytes of each field of a block's :class:`mpipar.model.llama.BlockSaved` for one
    microbatch on one rank, as forward fills it under ``mode``: each field summed over what
    every axis's split makes it (:meth:`mpipar.parallel.axis.Axis.activations`: the stream and
    the heads' and FFN's shares of the tensor axis, q/k/v and the core's context of the
    sequence axis, and in a ``sparse`` block the expert record of the expert axis, which keeps
    the router's input h2 when ``mode`` drops h2 itself)."""
    fields: dict[str, int] = defaultdict(int)
    for axis in AXES:
        footprint = axis.activations(layout, mode)
        for name, nbytes in (footprint.sparse if sparse else footprint.block).items():
            fields[name] += nbytes
    return dict(fields)


def _sparse_ffn_bytes(layout: Layout, mode: Recompute) -> int:
    """Bytes a sparse block's FFN keeps under ``mode`` for one microbatch on one rank beside
    the block's stream: the expert record (:class:`mpipar.model.moe.MoeSaved`, without its
    input h2), the shared expert's g, u, m and its gate's record, those the mode keeps."""
    sizes = _block_field_bytes(layout, sparse=True)
    return mode.resident_bytes({k: sizes.get(k, 0) for k in ("moe", "g", "u", "m",
                                                              "shared_gate")})


def _head_activation_bytes(layout: Layout) -> int:
    """Bytes the LM head keeps for one microbatch on one rank (the axes' ``head`` terms)."""
    return sum(axis.activations(layout, NONE).head for axis in AXES)


def _mtp_activation_bytes(layout: Layout, block: int) -> int:
    """Bytes the multi-token prediction modules keep for one microbatch on the last stage
    (:class:`mpipar.model.mtp.ModuleSaved`): per module its block's record (``block``), five
    streams (the embedding, the concatenation of two, the block's output and its norm) and
    three rstds, its logits over the rank's vocabulary slice, and per token its input ids,
    targets, lse and loss weights. Its input stream is kept already (the head's, or the
    previous module's output)."""
    depth = layout.model.mtp_depth
    if not depth:
        return 0
    m, par, tr = layout.model, layout.parallel, layout.train
    se = Precision.of(tr, par).stat_bytes
    fields = _block_field_bytes(layout)
    n = layout.micro_rows * (tr.seq_len // par.sp)
    logits = padded_vocab(m.vocab_size, par.tp) // par.tp * n * Precision.of(tr, par).compute_bytes
    return depth * (block + 5 * fields["x"] + 3 * fields["rstd1"] + logits + n * (24 + se))


def _sparse_in(layout: Layout, stage: int, per: int) -> int:
    """How many of virtual ``stage``'s ``per`` blocks ``[stage per, (stage + 1) per)`` are
    sparse (:meth:`mpipar.parallel.placement.PlacementTable.stage_layers`), without a per-layer
    walk (a plan of 10^8 layers stays instant)."""
    m = layout.model
    return m.sparse_set().count(stage * per, (stage + 1) * per) if m.moe_experts else 0


def _activation_bytes(layout: Layout, coord: Coord) -> int:
    """Activations of the rank at ``coord`` at the schedule's peak: what each chunk saves per
    microbatch between its forward and its backward, plus one block's (and on the last stage
    the head's) working set."""
    par, tr = layout.parallel, layout.train
    p, last = par.pp, layout.stages - 1
    per = layout.model.layers // layout.stages
    mode = tr.recompute_mode
    blocks = {sparse: _block_activation_bytes(layout, mode, sparse) for sparse in (False, True)}
    head = 0 if mode.offloads else _head_activation_bytes(layout)
    head += _mtp_activation_bytes(layout, blocks[False])
    n = layout.micro_rows * (tr.seq_len // par.sp)
    weight = {c: per * blocks[False] + _sparse_in(layout, c * p + coord.pp, per)
              * (blocks[True] - blocks[False]) + (head if c * p + coord.pp == last else 0)
              + (9 * n if c * p + coord.pp == 0 else 0)              # token ids and mask
              for c in range(par.virtual_stages)}
    peak = saved_peak(rank_ops(layout, coord), weight)   # saved between fwd and bwd
    kinds = {False, layout.model.sparse_layers() > 0}          # dense and/or sparse blocks
    working = max(_block_activation_bytes(layout, NONE, sparse) for sparse in kinds) + (
        _head_activation_bytes(layout) if last % p == coord.pp else 0)
    return peak + working


def predict_memory(layout: Layout, coord: Coord) -> MemoryEstimate:
    """Memory of the rank at ``coord``; see :class:`MemoryEstimate`."""
    return rank_memory(PlannedStep(layout, coord, True))   # what the axes' buffers are asked of


def rank_memory(rank: PlannedStep) -> MemoryEstimate:
    """:func:`predict_memory` of the planned training step ``rank`` (the planner's search
    reads one per pipeline rank, beside its calls)."""
    layout, coord = rank.layout, rank.coord
    par, prec = layout.parallel, _precision(layout)
    e, g = prec.compute_bytes, prec.master_bytes
    lengths = list(rank.unit_lengths.values()) if par.zero >= 2 else \
        [length for length, _ in rank.gradient_buckets]
    experts = (list(rank.expert_unit_lengths.values()) if par.zero >= 2 else
               expert_buckets(layout, coord))      # sharded over ep, over ep_dp
    flat = sum(lengths) + sum(experts)
    expert_owned = sum(L * par.ep // (layout.dp * par.sp) for L in experts)
    owned = sum(L // (layout.dp * par.sp) for L in lengths) + expert_owned
    optimizer = optimizer_elements(layout, coord) * g
    masters = ((owned if par.zero else flat) * g) if prec.mixed else 0
    activations = _activation_bytes(layout, coord)
    held = [axis.held(rank) for axis in AXES]                    # every axis's buffers
    buffers = sum(h.buffers for h in held) + optimizer_buffer_bytes(layout, coord)
    residuals = sum(h.residuals for h in held)
    frozen = _frozen_bytes(layout, coord)
    copies = state_copies.copy_memory(layout, coord)   # --state-copies
    if par.zero < 2:
        return MemoryEstimate(flat * e + frozen, flat * g, optimizer, activations, buffers,
                              residuals, masters, copies)
    copy = node_copy(layout, coord)
    weights = (flat if par.zero == 2 else owned if copy is None     # its part of the node's
               else sum(L // copy[0] for L in lengths) + expert_owned) * e   # copy; experts
    return MemoryEstimate(weights + frozen, owned * g, optimizer, activations, buffers,
                          residuals, masters, copies)


def _frozen_bytes(layout: Layout, coord: Coord) -> int:
    """LoRA's frozen base on the rank at ``coord``, in the compute dtype and with no master,
    gradient or optimizer state: its tp shards whole, or at ZeRO-3 its slices of the base's
    units (:func:`mpipar.plan.rank.frozen_unit_lengths`); 0 without LoRA."""
    table = placement_table(layout)
    if table.lora is None:
        return 0
    e = _precision(layout).compute_bytes
    if layout.parallel.zero == 3:
        n = layout.dp * layout.parallel.sp
        return e * sum(L // n for L in frozen_unit_lengths(layout, coord).values())
    return e * sum(math.prod(s) for n, s in local_param_shapes(layout, coord).items()
                   if not table[n].trainable)


def parameter_count(model: ModelConfig) -> int:
    """Parameters of ``model`` from its sizes alone (no per-layer list: a model of 10^8 layers
    is counted at once): embedding and LM head ``V x H`` each, the final norm ``H``, and per
    block its norms (two, four with sandwich norms; with ``qk_norm`` two of ``head_dim``),
    q/k/v (their biases) and o, or latent attention's projections and latent norms and o, and
    the three SwiGLU matrices; a sparse block's router ``E x H``, ``E`` experts and the shared
    expert (three matrices each; its gate ``H``) in place of the latter; each multi-token
    prediction module's three norms, projection ``H x 2H`` and block."""
    m = resolve_model(model)
    q, kv, H = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden
    if m.latent:
        attention = sum(math.prod(s) for _, s in latent_param_shapes(m)) + H * m.heads * m.value_dim
    else:
        attention = (2 * q + 2 * kv) * H + (q + 2 * kv) * m.attention_bias
    block = (m.norms.per_block * H + 2 * m.head_dim * m.qk_norm + attention
             + 3 * m.ffn_hidden * H)
    sparse = H * m.moe_experts * (1 + 3 * m.moe_ffn_hidden) + 3 * m.moe_shared_ffn_hidden * H \
        + m.moe_shared_gate * H - 3 * m.ffn_hidden * H
    mtp = m.mtp_depth * (block + 3 * H + 2 * H * H)   # MTP modules: norms, projection, block
    return 2 * m.vocab_size * H + H + m.layers * block + m.sparse_layers() * sparse + mtp


def trained_parameter_count(model: ModelConfig, train: TrainConfig) -> int:
    """Parameters a run of ``model`` under ``train`` trains: every one, or under LoRA the
    adapters' factors alone (the base frozen)."""
    lora = Lora.of(train)
    if lora is None:
        return parameter_count(model)
    return sum(math.prod(a.shape) for spec in param_specs(resolve_model(model))
               for a in lora.specs(spec))


def memory_lower_bound(layout: Layout) -> int:
    """Bytes the busiest rank of ``layout`` needs at least: its share of the weights and
    gradients, ``(weight + gradient bytes) x parameters / (tp x pp)`` (of the experts, 1/ep;
    under LoRA the weights' bytes alone).
    Cheap for any size, so absurd models are refused before :func:`predict_peak_memory` lists their parameters."""
    prec, m = _precision(layout), layout.model
    # LoRA: the frozen base, most of the weights, has no gradient or master
    e = prec.compute_bytes + (prec.master_bytes if layout.train.lora_rank == 0 else 0)
    experts = m.sparse_layers() * m.moe_experts * 3 * m.moe_ffn_hidden * m.hidden
    held = parameter_count(m) - experts + experts // layout.parallel.ep   # at most 1/ep of them
    return e * held // (layout.tp * layout.pp)


def predict_peak_memory(layout: Layout, coord: Coord) -> int:
    """The most bytes the rank at ``coord`` holds at once, not counting the interpreter and its
    libraries: the largest of

    - initialisation: its initial parameter shards, plus the largest parameter it holds as a
      float64 global tensor, cast to the masters' dtype and copied (or padded) into its shard:
      a parameter is initialised whole, then sliced (:func:`mpipar.model.params.init_param`,
      ``training.rank._initial_shards``);
    - building the rank: those shards while the flat weight and gradient buffers and the
      AdamW moments are allocated;
    - a step: :func:`predict_memory`, plus the step's tokens (this DP rank's int64 rows of
      ``seq_len + 1``, its inputs and targets, and their sequence chunks).
    """
    par, tr = layout.parallel, layout.train
    e = _precision(layout).master_bytes           # initial shards are master values
    mem = predict_memory(layout, coord)
    shapes = local_param_shapes(layout, coord)
    shards = e * sum(math.prod(shape) for shape in shapes.values())
    table = placement_table(layout)
    largest = max(math.prod(table[name].spec.shape) for name in shapes)
    if par.zero >= 2:        # ZeRO-2/3 initialise one unit at a time
        shards = max([*unit_lengths(layout, coord).values(),
                      *expert_unit_lengths(layout, coord).values()]) * e
    initialising = shards + largest * (8 + 2 * e)
    building = shards + mem.state + mem.residuals
    rows = tr.global_batch_size // layout.dp * tr.rows_per_sample
    tokens = 8 * rows * (3 * (tr.seq_len + 1) + 2 * (tr.seq_len // par.sp))
    return max(initialising, building, mem.total + tokens + _reference_bytes(layout))


def _reference_bytes(layout: Layout) -> int:
    """DPO: the reference log-probabilities every rank keeps, float64 for each sequence of the
    training pairs (:class:`mpipar.training.objective.Preference`); 0 otherwise, or where the
    pairs' file cannot be read (the run's rules refuse it before it starts)."""
    tr = layout.train
    if tr.sequences_per_sample == 1:
        return 0
    try:
        return 8 * tr.sequences_per_sample * preference_pairs(tr.data, tr.seq_len)
    except (DataError, OSError):
        return 0


def kv_cache_width(model: ModelConfig, tp: int) -> int:
    """Values one position of one block holds in a tp rank's KV cache: the keys and values of
    its kv heads, ``2 x kv_heads / tp x head_dim``; under latent attention the compressed
    latent and the RoPE key, ``latent_kv_rank + rope_head_dim``, whole on every tp rank
    (:class:`mpipar.model.latent_attention.LatentKVCache`)."""
    m = model
    if m.latent:
        return m.latent_kv_rank + m.rope_head_dim
    return 2 * (m.kv_heads // tp) * m.head_dim


def generation_lower_bound(layout: Layout, positions: int) -> int:
    """Bytes the busiest rank of a generation under ``layout`` needs at least, from the sizes
    alone (any number of layers at once): its share of the weights and of the KV cache of
    ``positions`` positions, ``e * (parameters + layers * positions * tp *`` :func:`kv_cache_width`
    ``) / (tp * pp)``."""
    m, par = layout.model, layout.parallel
    e = np.dtype(layout.train.dtype).itemsize
    cache = m.layers * positions * par.tp * kv_cache_width(m, par.tp)
    return e * (parameter_count(m) + cache) // (par.tp * par.pp)


def predict_generation_memory(layout: Layout, rank: int, positions: int, prompt: int,
                              read_whole: int = 0) -> int:
    """Bytes rank ``rank`` of a generation under ``layout`` holds at its peak (the interpreter
    and its libraries not counted): the larger of

    - loading: its parameter shards, the largest global tensor cast to the dtype, and either
      ``read_whole`` bytes (a Hugging Face directory: every rank reads every tensor) or its
      largest shard read from a checkpoint;
    - decoding: its shards, the KV cache of its stage's blocks for ``positions`` positions
      (:func:`kv_cache_width` values a position and block; under latent attention also the
      keys and values ``[1, positions, heads / tp, head_dim]`` of the one block expanding them),
      and the prompt's pass: ``prompt`` rows hidden-, head- and FFN-wide in a block, the
      block's attention scores and probabilities ``[heads / tp, prompt, prompt]``, and on the
      last stage the prompt's logits ``[prompt, V / tp]``.
    """
    m, par = layout.model, layout.parallel
    tp, e = par.tp, np.dtype(layout.train.dtype).itemsize
    coord = rank_coord(rank, 1, tp, par.pp, 1)
    shapes = local_param_shapes(layout, coord)
    shards = e * sum(math.prod(s) for s in shapes.values())
    largest_global = e * m.hidden * max(m.vocab_size, m.ffn_hidden, m.heads * m.head_dim)
    loading = shards + largest_global + (read_whole or e * max(math.prod(s)
                                                                for s in shapes.values()))
    blocks = m.layers // par.pp  # one chunk a pipeline rank when generating
    cache = blocks * positions * kv_cache_width(m, tp) * e
    if m.latent:
        cache += 2 * positions * (m.heads // tp) * m.head_dim * e
    width = 4 * m.hidden + (3 * m.ffn_hidden + 2 * (m.heads + m.kv_heads) * m.head_dim) // tp
    passing = e * prompt * (width + 2 * (m.heads // tp) * prompt)
    if coord.pp == par.pp - 1:
        passing += e * prompt * -(-m.vocab_size // tp)
    return max(loading, shards + cache + passing)
