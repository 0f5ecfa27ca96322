"""Where every parameter lives on the grid: one placement per parameter, for every axis.

The model (:mod:`mpipar.model.params`) declares parameters as dense global tensors: a name, a
shape and the block that owns it. This module is the *placement table* that parallelises them
from outside (as torchtitan's plan does): for each parameter, how the tensor-parallel axis
splits it, which pipeline stage holds it, and what the data-parallel axes do with it.

===============================  =============================  ================  ==============
parameter                        tp (:data:`TP_ROLES`)           pp                dp x sp
===============================  =============================  ================  ==============
``embed_tokens.weight``          ``vocab``: rows, padded         first stage (and  unit ``embed``
                                                                 last: tied, MTP)
``q/k/v_proj``, ``gate/up_proj``  ``column``: rows               its block's       unit ``layers.i``
``q/k/v_proj.bias``              ``column``: with their weight   its block's       unit ``layers.i``
``o_proj``, ``down_proj``         ``row``: columns                its block's       unit ``layers.i``
``mlp.shared_expert.*_proj``     as gate/up/down above           its block's       unit ``layers.i``
``mlp.shared_expert_gate``       ``replicated``                  its block's       unit ``layers.i``
``*layernorm.weight``            ``replicated``                  its block's       unit ``layers.i``
``self_attn.q_norm/k_norm``      ``heads_replicated``            its block's       unit ``layers.i``
``q_b_proj``, ``kv_b_proj``      ``column``: rows                its block's       unit ``layers.i``
``q_a_*``, ``kv_a_*`` (latent)   ``heads_replicated``            its block's       unit ``layers.i``
``norm.weight``                  ``replicated``                  last stage        unit ``head``
``lm_head.weight`` (untied)      ``vocab``: rows, padded         last stage        unit ``head``
MTP's norms and ``eh_proj``      ``replicated``                  last stage        unit ``layers.j``
===============================  =============================  ================  ==============

The tp column is the only statement of each linear's tensor-parallel role: the split of the
weight here (sharding, checkpoints) and the communication of its activations
(:class:`mpipar.parallel.tensor.ops.TensorParallel`, which the model calls by weight name) both
read it.

The pp column: virtual stage ``s`` of ``pp * virtual_stages`` holds the blocks
``[s * L / stages, (s + 1) * L / stages)`` (:meth:`PlacementTable.stage_layers`, the one home
of that rule); which pipeline rank holds a virtual stage is the schedule's
(:func:`mpipar.parallel.pipeline.schedule.stage_owner`: Megatron's interleaving).

The dp x sp column: every parameter is replicated over dp x sp, except under ``--zero 3``, where
it is *sharded over dp x sp* as part of its unit (:attr:`Placement.dp_sp`): a unit is one flat
buffer of which each rank of dp x sp holds 1/(dp*sp), all-gathered around the unit's forward and
backward (:mod:`mpipar.parallel.fsdp`, :meth:`PlacementTable.units`). ZeRO-1 and ZeRO-2 shard
the optimizer state (and ZeRO-2 the gradients) the same way, but not the parameters: that is
the optimizer's and the reducer's business (:mod:`mpipar.training.optim`, :mod:`mpipar.parallel.fsdp`). With ``--tp-sequence-parallel`` the norm weights stay replicated,
but each tp rank sees only its token shard, so their gradients are partial sums over tp
(:attr:`Placement.grad_partial_over_tp`). The per-head query and key norms (``qk_norm``) are
``heads_replicated``: every tp rank holds them whole and applies them to its own heads, so their
gradients are partial sums over tp with or without sequence parallelism. So are latent
attention's down-projections and latent norms (:mod:`mpipar.model.latent_attention`): each tp
rank computes the latents of every token it holds whole and feeds them to its own heads.

Experts under ``--ep N`` (:func:`mpipar.parallel.experts.split.expert_shards`): a sparse block's E
experts are *sharded over the ep group* (``PlacementTable(ep=N)``): the rank at position ``r``
of its ep group (``dp_sp.rank % N``) holds experts ``[r E/N, (r+1) E/N)`` only, their weights,
gradients and optimizer moments (:meth:`PlacementTable.holds`, :func:`expert_of`), replicated
over the ``ep_dp`` group (the ranks of dp x sp at the same ep position) and reduced there. The
router, a sparse block's shared expert (``mlp.shared_expert.*``: a dense FFN, not an expert)
and every dense weight keep the dp x sp column above. Under ZeRO-2/3 a block's held experts are a
unit of their own sharded over ``ep_dp`` (:func:`mpipar.parallel.experts.split.expert_units`).
``ep=1`` (no ep): every rank holds every expert.

Tied embeddings (``tie_embeddings``) are one parameter used by the first stage (embedding) and
the last (LM head); so is the embedding with multi-token prediction (``mtp_depth``, whose
modules on the last stage embed the tokens ahead). With pp > 1 both pipeline ranks hold a copy (Megatron's embedding group):
each accumulates its own gradient, the two are summed over the ``pp_ends`` group
(:mod:`mpipar.runtime.topology`) before the update, and identical updates keep the copies identical.
The copy on the first stage's rank is the one counted in the gradient norm and written to
checkpoints (:meth:`Placement.owned_by`), so the tensor is once on disk.

Everything that asks "how is this parameter split" asks a :class:`Placement`: sharding and
unsharding (initialisation, HF import/export, gathering), the global region a shard covers
(checkpoints), which rank counts a replicated tensor in the global norm and writes it to a
checkpoint, and the planner's shard shapes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar.config import ModelConfig
from mpipar.model.lora import Lora, factor_of
from mpipar.model.mtp import embedding_at_last
from mpipar.model.params import (EMBED, ParamSpec, param_specs, require_resolved, stage_param_names,
                                 stage_units)
from mpipar.parallel.pipeline.schedule import stage_owner

Slices = tuple[slice, ...]

TP_ROLES: dict[str, int | None] = {
    "column": 0,         # rows of [out, in] (and of a bias [out]): whole heads / FFN columns
    "row": 1,            # columns of [out, in]: the input features per rank
    "vocab": 0,          # rows of the vocabulary, padded with zero rows to a multiple of tp
    "replicated": None,  # every tp rank holds all of it
    "heads_replicated": None,  # all of it on every tp rank, applied to that rank's heads only
}
"""The tensor-parallel roles, each with the dimension its split divides into tp equal parts."""

TENSOR_PARALLEL_PLAN: dict[str, str] = {
    "embed_tokens.weight": "vocab",
    "input_layernorm.weight": "replicated",
    "self_attn.q_proj.weight": "column",
    "self_attn.k_proj.weight": "column",
    "self_attn.v_proj.weight": "column",
    "self_attn.q_proj.bias": "column",
    "self_attn.k_proj.bias": "column",
    "self_attn.v_proj.bias": "column",
    "self_attn.q_norm.weight": "heads_replicated",
    "self_attn.k_norm.weight": "heads_replicated",
    "self_attn.o_proj.weight": "row",
    "self_attn.q_a_proj.weight": "heads_replicated",          # latent attention's down-
    "self_attn.q_a_layernorm.weight": "heads_replicated",     # projections and latent norms:
    "self_attn.kv_a_proj_with_mqa.weight": "heads_replicated",  # whole, feeding this rank's
    "self_attn.kv_a_layernorm.weight": "heads_replicated",    # heads
    "self_attn.q_b_proj.weight": "column",
    "self_attn.kv_b_proj.weight": "column",
    "post_attention_layernorm.weight": "replicated",
    "pre_feedforward_layernorm.weight": "replicated",
    "post_feedforward_layernorm.weight": "replicated",
    "mlp.gate_proj.weight": "column",
    "mlp.up_proj.weight": "column",
    "mlp.down_proj.weight": "row",
    "norm.weight": "replicated",
    "lm_head.weight": "vocab",
    "enorm.weight": "replicated",              # the MTP modules' (mpipar.model.mtp): whole
    "hnorm.weight": "replicated",              # on every tp rank, computed on the stream it
    "eh_proj.weight": "replicated",            # holds
    "shared_head.norm.weight": "replicated",
    "block_sparse_moe.gate.weight": "replicated",
    "block_sparse_moe.experts.*.w1.weight": "replicated",
    "block_sparse_moe.experts.*.w3.weight": "replicated",
    "block_sparse_moe.experts.*.w2.weight": "replicated",
    "mlp.shared_expert.gate_proj.weight": "column",     # a dense FFN: split as gate/up/down
    "mlp.shared_expert.up_proj.weight": "column",
    "mlp.shared_expert.down_proj.weight": "row",
    "mlp.shared_expert_gate.weight": "replicated",     # [1, H]: computed whole on each tp rank
}
"""The tensor-parallel column of the table (a role of :data:`TP_ROLES`), by parameter name
without its ``layers.{i}.`` (an expert's index written ``*``: experts are unsplit by tp)."""


def adapter_roles(base_role: str) -> dict[str, str]:
    """The tp roles of the LoRA factors of a linear of role ``base_role``
    (:mod:`mpipar.model.lora`), chosen so that the adapted linear keeps the base's one collective:
    a column-parallel linear's ``B`` ``[out, r]`` is split by its output rows as the weight is
    and ``A`` ``[r, in]`` is whole on every rank (it reads the whole input); a row-parallel
    linear's ``A`` is split by its input columns as the weight is and ``B`` is whole (the
    adapter's partial output joins the base's in the one sum over tp). The whole factor's
    gradient is a partial sum over tp (:attr:`Placement.grad_partial_over_tp`). A
    ``heads_replicated`` linear (latent attention's ``q_a_proj``, ``kv_a_proj_with_mqa``) is
    whole on every rank and so are both its factors, their gradients partial over tp as the
    weight's (each rank's heads' share). A routed expert's (``replicated``: experts are unsplit
    by tp, each tp rank computes them on the whole stream) are whole as the expert is, their
    gradients whole as the expert's."""
    if base_role in ("heads_replicated", "replicated"):
        return {"lora_A": base_role, "lora_B": base_role}
    if base_role == "column":
        return {"lora_A": "replicated", "lora_B": "column"}
    if base_role == "row":
        return {"lora_A": "row", "lora_B": "replicated"}
    raise ValueError(f"LoRA on a {base_role!r} linear: only column- and row-parallel linears "
                     f"carry adapters")


def adapter_grad_partial(base_role: str, factor: str) -> bool:
    """Whether the gradient of LoRA factor ``factor`` (``lora_A``/``lora_B``) of a linear of
    role ``base_role`` is a partial sum over tp (:func:`adapter_roles`): a factor held whole
    beside a split or ``heads_replicated`` linear; not a routed expert's (``replicated``: its
    gradient is whole, as the expert's)."""
    return base_role != "replicated" and adapter_roles(base_role)[factor] in (
        "replicated", "heads_replicated")


def plan_key(name: str) -> str:
    """The key of parameter ``name`` in :data:`TENSOR_PARALLEL_PLAN`: without its
    ``layers.{i}.`` and with an expert's index as ``*``."""
    parts = name.split(".")
    if parts[0] == "layers":
        parts = parts[2:]
    if len(parts) > 2 and parts[1] == "experts":
        parts[2] = "*"
    return ".".join(parts)


def expert_of(name: str) -> int | None:
    """The expert index of an expert weight ``layers.{i}.block_sparse_moe.experts.{e}.*``,
    else None (dense weights, the router)."""
    parts = name.split(".")
    if len(parts) > 4 and parts[3] == "experts":
        return int(parts[4])
    return None


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp (padding rows are zero and never used)."""
    return -(-vocab_size // tp) * tp


@dataclass(frozen=True)
class Placement:
    """One row of the placement table: the parameter and where each axis puts it."""

    spec: ParamSpec
    tp: str                          # its tensor-parallel role (:data:`TP_ROLES`)
    stages: tuple[int, ...]          # global virtual pipeline stages that use it
    pipeline_ranks: tuple[int, ...]  # pipeline ranks holding a copy (the first's is the owner)
    tp_sequence_parallel: bool = False
    dp_sp: str = "replicated"        # or "sharded" (--zero 3: 1/(dp*sp) of its unit per rank)
    trainable: bool = True           # False: a frozen LoRA base (no gradient, no optimizer state)
    tp_partial: bool = False         # a whole LoRA factor of a split linear: gradient partial

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def split_dim(self) -> int | None:
        """The dimension tp splits into equal parts (None: every tp rank holds all of it)."""
        return TP_ROLES[self.tp]

    @property
    def padded(self) -> bool:
        """Whether the split dimension (the vocabulary) is first padded with zero rows up to a
        multiple of tp."""
        return self.tp == "vocab"

    @property
    def tied_across_pipeline(self) -> bool:
        """Whether several pipeline ranks hold a copy (the tied embedding with pp > 1): their
        gradients are summed over the ``pp_ends`` group before the update."""
        return len(self.pipeline_ranks) > 1

    @property
    def grad_partial_over_tp(self) -> bool:
        """Whether each tp rank's gradient is a partial sum to be all-reduced over tp (a
        replicated weight applied to token shards under --tp-sequence-parallel, or to the
        rank's own heads: ``heads_replicated``; the whole factor of a LoRA adapter,
        :func:`adapter_roles`)."""
        return self.split_dim is None and (self.tp_sequence_parallel or self.tp_partial
                                           or self.tp == "heads_replicated")

    def owned_by(self, tp_rank: int, pp_rank: int) -> bool:
        """Whether the copy of the rank at (``tp_rank``, ``pp_rank``), which holds it, is the one
        counted in the global gradient norm and written to checkpoints: every shard of a split
        tensor, tp rank 0's of a replicated one; of a tied one, the first pipeline rank's."""
        return (self.split_dim is not None or tp_rank == 0) and pp_rank == self.pipeline_ranks[0]

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """Shape of one tp rank's shard (vocabulary padding included)."""
        shape = list(self.spec.shape)
        d = self.split_dim
        if d is not None:
            if self.padded:
                shape[d] = padded_vocab(shape[d], tp_size)
            shape[d] //= tp_size
        return tuple(shape)

    def shard(self, value: np.ndarray, tp_rank: int, tp_size: int) -> np.ndarray:
        """This tp rank's slice of the global tensor ``value`` (a new C-contiguous array)."""
        d = self.split_dim
        if d is None or tp_size == 1:
            return np.array(value, copy=True, order="C")
        if self.padded:
            pad = padded_vocab(value.shape[d], tp_size) - value.shape[d]
            if pad:
                widths = [(0, 0)] * value.ndim
                widths[d] = (0, pad)
                value = np.pad(value, widths)
        n = value.shape[d] // tp_size
        index = [slice(None)] * value.ndim
        index[d] = slice(tp_rank * n, (tp_rank + 1) * n)
        return np.ascontiguousarray(value[tuple(index)])

    def unshard(self, pieces: list[Any]) -> np.ndarray:
        """Inverse of :meth:`shard`: join the tp slices (in tp-rank order), drop the padding."""
        d = self.split_dim
        if d is None:
            return np.asarray(pieces[0])
        full = np.concatenate(pieces, axis=d)
        if self.padded:
            index = [slice(None)] * full.ndim
            index[d] = slice(0, self.spec.shape[d])
            full = full[tuple(index)]
        return full

    def region(self, tp_rank: int, tp_size: int) -> tuple[Slices, Slices]:
        """(region of the global tensor that tp rank ``tp_rank``'s shard covers, the part of the
        shard holding it): they differ only by vocabulary padding, which no global tensor has."""
        glob = [slice(0, n) for n in self.spec.shape]
        local_shape = self.local_shape(tp_size)
        loc = [slice(0, n) for n in local_shape]
        d = self.split_dim
        if d is not None:
            start = tp_rank * local_shape[d]
            stop = max(start, min(start + local_shape[d], self.spec.shape[d]))
            glob[d], loc[d] = slice(start, stop), slice(0, stop - start)
        return tuple(glob), tuple(loc)


class PlacementTable:
    """The placement of every parameter of ``model`` on a grid with ``pp`` pipeline ranks of
    ``virtual_stages`` chunks each, in forward order; ``tp_sequence_parallel``: the stream
    between tp regions holds token shards (:mod:`mpipar.parallel.tensor`); ``zero``: the
    ZeRO stage (3 shards the parameters over dp x sp); ``ep``: the ep positions the experts
    are sharded over (1: every rank holds every expert; the module docstring); ``lora``: the
    adapters (:mod:`mpipar.model.lora`), each factor placed after its weight, every other
    parameter frozen (None: everything trains)."""

    def __init__(self, *, model: ModelConfig, pp: int = 1, virtual_stages: int = 1,
                 tp_sequence_parallel: bool = False, zero: int = 0, ep: int = 1,
                 lora: Lora | None = None) -> None:
        self.model = require_resolved(model)
        self.lora = lora
        self.ep = ep
        self.experts_per_rank = (self.model.moe_experts or 1) // ep
        self.pp, self.virtual_stages = pp, virtual_stages
        self.stages = pp * virtual_stages
        self.layers_per_stage = self.model.layers // self.stages
        self.tp_sequence_parallel = tp_sequence_parallel
        self.rows: dict[str, Placement] = {}
        dp_sp = "sharded" if zero == 3 else "replicated"
        for spec in param_specs(self.model):
            stages = self._stages(spec)
            ranks = tuple(dict.fromkeys(stage_owner(s, pp)[0] for s in stages))
            role = TENSOR_PARALLEL_PLAN[plan_key(spec.name)]
            self.rows[spec.name] = Placement(spec, role, stages, ranks, tp_sequence_parallel,
                                             dp_sp, trainable=lora is None)
            for adapter in lora.specs(spec) if lora is not None else ():
                factor = factor_of(adapter.name)
                self.rows[adapter.name] = Placement(
                    adapter, adapter_roles(role)[factor], stages, ranks, tp_sequence_parallel,
                    dp_sp, tp_partial=adapter_grad_partial(role, factor))

    def _stages(self, spec: ParamSpec) -> tuple[int, ...]:
        """The global virtual stages that use ``spec``: its block's; the embedding's first (and,
        tied, the last); the final norm's and LM head's last."""
        last = self.stages - 1
        if spec.layer is not None and spec.layer < self.model.layers:
            return (spec.layer // self.layers_per_stage,)
        if spec.name == EMBED:
            return (0, last) if embedding_at_last(self.model) and last > 0 else (0,)
        return (last,)   # the final norm, the LM head and the MTP modules

    def __getitem__(self, name: str) -> Placement:
        return self.rows[name]

    def __iter__(self):
        return iter(self.rows.values())

    def pipeline_rank(self, name: str) -> int:
        """The pipeline rank holding ``name`` (of a tied one, the owner of its copies)."""
        return self.rows[name].pipeline_ranks[0]

    def stage_names(self, stage: int) -> list[str]:
        """Parameters of global virtual ``stage``, in the forward order of its chunk
        (:func:`mpipar.model.params.stage_param_names`: the tied embedding last on the last)."""
        names = stage_param_names(self.model, self.stage_layers(stage), stage == 0,
                                  stage == self.stages - 1)
        return names if self.lora is None else self.lora.expand(names)

    def stage_layers(self, stage: int) -> range:
        """The decoder blocks of global virtual ``stage``: ``layers / stages`` consecutive
        ones (the stage of block ``i`` is ``i // layers_per_stage``)."""
        return range(stage * self.layers_per_stage, (stage + 1) * self.layers_per_stage)

    def holds(self, name: str, ep_rank: int = 0) -> bool:
        """Whether a rank at position ``ep_rank`` of its ep group holds ``name`` (of the
        parameters its pipeline rank holds): every dense weight; an expert of its ep share."""
        e = expert_of(name)
        return e is None or e // self.experts_per_rank == ep_rank

    def expert_owner(self, name: str) -> int:
        """The ep position holding expert weight ``name``."""
        return expert_of(name) // self.experts_per_rank

    def local_shapes(self, pp_rank: int, tp_size: int, ep_rank: int = 0
                     ) -> dict[str, tuple[int, ...]]:
        """Shapes of the shards held by pipeline rank ``pp_rank`` (any tp rank) at position
        ``ep_rank`` of its ep group, chunk by chunk in forward order (the order the engine
        lays out its flat buffers)."""
        out = {}  # a tied parameter used by two chunks of this rank is held once
        for chunk in range(self.virtual_stages):
            for name in self.stage_names(chunk * self.pp + pp_rank):
                if self.holds(name, ep_rank):
                    out.setdefault(name, self.rows[name].local_shape(tp_size))
        return out

    def units(self, pp_rank: int, trained: bool = True) -> list[list[tuple[str, list[str]]]]:
        """Per chunk of pipeline rank ``pp_rank``, its units in forward order as ``(unit,
        parameter names)`` (:func:`mpipar.model.params.stage_units`): what ZeRO-2/3 shard, the
        trained parameters (under LoRA the adapters; a unit without any is not one), or with
        ``trained`` False the frozen ones (LoRA's base, which ZeRO-3 shards apart)."""
        return [[(unit, kept) for unit, names in stage_units(self.stage_names(chunk * self.pp
                                                                              + pp_rank))
                 if (kept := [n for n in names if self.rows[n].trainable == trained])]
                for chunk in range(self.virtual_stages)]

    def local_elements(self, pp_rank: int, tp_size: int, ep_rank: int = 0) -> int:
        return sum(math.prod(s) for s in self.local_shapes(pp_rank, tp_size, ep_rank).values())
