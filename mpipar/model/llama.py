"""The Llama decoder as a stage of layers with explicit forward and backward (no autograd).

A :class:`LlamaStage` holds a contiguous run of decoder blocks and, on the first pipeline stage,
the embedding, and on the last the final norm, LM head and cross-entropy. With one process a
single stage holds everything. The code is a dense Llama block; it holds no MPI group and makes
no collective. Parallelism enters through the seams it is given and the scope it is told:

- ``tp``: the tensor-parallel ops (:class:`mpipar.model.tensor_ops.TensorOps`). Every linear,
  the embedding and the cross-entropy go through it by the names of their weights; the block
  never says which linear is column- or row-parallel: the placement table does, once, and the
  seam follows it (with tp = 1 every op is local). The block reads its local head count and
  FFN width from the shapes of the weights it is given;
- ``attention``: the attention core (:class:`mpipar.model.attention.AttentionCore`), which sees
  this rank's query chunk and global positions (ring or Ulysses attention over SP);
- ``scope`` (:class:`ParamScope`): each *unit* (the embedding, a block, the head) runs inside
  ``scope.using(unit)``, in one place per unit and direction: one walk serves
  :meth:`LlamaStage.forward` and :meth:`LlamaStage.forward_only`, one
  :meth:`LlamaStage.backward`.

RoPE uses the global token positions of this rank's sequence chunk, with the model's frequency
scaling (``rope_type``: linear, dynamic NTK, llama3), whose dynamic rule depends on the length of
the whole sequence (``seq_len``), not of this rank's chunk.

Config facts the block follows: ``attention_bias`` adds q/k/v biases to the column-parallel
projections (the kernels' ``linear_fwd`` adds them, :class:`LinearGrads` accumulates their
gradients beside the weights'); ``tie_embeddings`` makes the LM head multiply by the embedding
matrix (:func:`mpipar.model.params.head_weight_name`), so a single stage accumulates both uses
into one gradient.
Gemma's settings: the norms' placement and form (:mod:`mpipar.model.norms`: the sandwich's
output norms, ``1 + w``), the FFN's activation (:mod:`mpipar.model.activation`), the embedding
scale (:mod:`mpipar.model.embedding_scale`), the attention scale folded into q
(:mod:`mpipar.model.attention_scale`) and a RoPE base of the sliding-window layers' own
(``rope_local_theta``).

Shapes: ``B`` microbatch, ``S`` local sequence length, ``H`` hidden, ``hq``/``hkv`` the query/kv
heads on this TP rank, ``D`` head_dim, ``F`` local FFN width, ``V`` local vocabulary rows. The
residual stream ``x`` is ``[B, S, H]``, or ``[B*S/tp, H]`` (this rank's token shard) with
``--tp-sequence-parallel``.

What forward keeps for backward is a :class:`BlockSaved` per block (llm.c's activation record);
the recompute mode (:class:`mpipar.model.recompute.Recompute`) says which fields it fills, and
backward rebuilds the rest with the same kernel calls on the same inputs, so every mode gives
bit-identical results:

- ``none``: every field: ``x``, ``h1 = RMSNorm(x)`` and its ``rstd1``, q, k, v after RoPE (when
  the attention core reads them), the core's output and its own saved context, ``x2`` (residual
  after attention), ``h2 = RMSNorm(x2)``, ``rstd2``, ``g``, ``u`` and ``m = SwiGLU(g, u)``; with
  ``qk_norm``, q and k before their per-head norms and the norms' rstds (``qk``).
- ``selective``: ``x``, ``x2``, the core's output and context, ``g`` and ``u``. Recomputed in
  backward, none of it needing communication beyond what backward does anyway: both RMSNorms,
  ``m``, and q, k, v (from the input that backward enters into the tp region for the q/k/v
  weight gradients; with ``qk_norm`` through the q/k norms again, rebuilding their record).
- ``full``: only ``x``; backward re-runs the whole block forward first, which repeats its tensor-
  and sequence-parallel traffic (the planner counts it).
- ``offload``: what ``none`` keeps, written to a :class:`CacheStore` (a per-rank HDF5 scratch
  file, :class:`mpipar.checkpoint.activations.OffloadStore`) block by block during forward and read back
  block by block in backward; the LM head's record too.

:meth:`LlamaStage.forward_only` runs the same blocks keeping nothing for a backward (evaluation
and generation, whatever ``recompute`` says). Given a :class:`KVCache` it is the incremental
forward of generation: each block appends its keys and values for the new tokens to the cache
and attends over every cached position (causal, local: generation holds whole sequences).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

import numpy as np

from mpipar.config import ModelConfig
from mpipar.model.attention import AttentionCore
from mpipar.model.attention_scale import query_factor, scale_queries
from mpipar.model.embedding_scale import scale_embedding
from mpipar.model.head import LmHead
from mpipar.model.latent_attention import (LatentBlocks, attended_values, input_names,
                                           latent_bwd, latent_fwd, ring_passes_latent,
                                           values_grad)
from mpipar.model.mtp import MultiTokenPrediction
from mpipar.model.moe import ExpertExchange, LocalExperts, moe_backward, moe_forward
from mpipar.model.norms import (INPUT, POST_ATTENTION, POST_FFN, PostNormSaved, norm_weight,
                                post_norm_bwd, post_norm_fwd)
from mpipar.model.qk_norm import qk_norm_bwd, qk_norm_fwd
from mpipar.model.recompute import Recompute
from mpipar.model.params import (EMBED, SHARED_DOWN, SHARED_GATE, SHARED_GATE_UP, bias_name,
                                 block_param_specs, require_resolved, stage_param_names,
                                 unit_of)
from mpipar.model.rotary import Rotary
from mpipar.model.tensor_ops import TensorOps, apply_linears, apply_linears_backward

Array = Any

ACTIVATION_NAMES = ("input", "attention", "attention_out", "mlp", "output")
"""What a recorder receives per block: ``input`` (block input), ``attention`` ``[B, S, hq*D]``
(attention output before o_proj: this TP rank's heads), ``attention_out`` (after o_proj and the
TP reduction), ``mlp`` (MLP output after down_proj and the TP reduction) and ``output`` (block
output); all but ``attention`` in the residual stream's shape."""


class ParamScope(Protocol):
    """The seam through which a stage announces the *units* it reads parameters in (the
    embedding ``embed``, each block ``layers.{i}``, the final norm and LM head ``head``): data
    parallelism may keep a unit's parameters and gradients only while it runs (ZeRO-3,
    :class:`mpipar.parallel.fsdp.sharded.ShardedParams`). The model makes no collective itself."""

    def using(self, units: Sequence[str], backward: bool,
              grads_final: bool = True) -> AbstractContextManager[None]:
        """A context in which ``params`` (and in ``backward`` the units' ``grads``) hold
        ``units``; leaving it, the parameters may go, and in backward with ``grads_final`` the
        gradients are final (else their weight gradients were deferred: :meth:`weights_done`
        follows). An exception inside leaves the units as they are."""

    def weights_done(self, units: list[str]) -> None:
        """The deferred weight gradients of ``units`` are accumulated."""

    def progress(self) -> None:
        """The model is between two operations of a unit: the transfers in flight may advance
        (an MPI on the CPU moves a non-blocking collective only while some call is in MPI)."""


class Resident:
    """The scope of parameters and gradients that stay in memory (ZeRO-0/1): nothing to do."""

    def using(self, units: Sequence[str], backward: bool,
              grads_final: bool = True) -> AbstractContextManager[None]:
        return nullcontext()

    def weights_done(self, units: list[str]) -> None:
        pass

    def progress(self) -> None:
        pass


RESIDENT = Resident()


class CacheStore(Protocol):
    """Somewhere off the working set to keep saved activations between forward and backward."""

    def put(self, tree: Any) -> Any:
        """Store a record (dataclass, dict, list or tuple of arrays and scalars); return its
        handle."""

    def take(self, handle: Any) -> Any:
        """Return the record stored under ``handle`` and forget it."""


@dataclass
class BlockSaved:
    """What one decoder block keeps for backward; None marks a field recomputed in backward
    (see the module docstring). Shapes as in the module docstring; ``attention_out`` is the
    core's ``[B, S, hq, D]`` output, which o_proj reads as ``[B, S, hq*D]``."""

    x: Array
    h1: Array | None = None
    rstd1: Array | None = None
    q: Array | None = None
    k: Array | None = None
    v: Array | None = None
    attention_out: Array | None = None
    attention_saved: Any = None
    x2: Array | None = None
    h2: Array | None = None
    rstd2: Array | None = None
    g: Array | None = None
    u: Array | None = None
    m: Array | None = None
    moe: Any = None  # a sparse block's FFN record (mpipar.model.moe.MoeSaved); g, u, m its
    # shared expert's (None without one)
    shared_gate: Any = None  # with --moe-shared-gate: (its sigmoid [.., 1], its ungated output)
    qk: Any = None           # with qk_norm: q, k before their norms and the rstds (QKNormSaved);
    # with latent attention its latents (mpipar.model.latent_attention.LatentSaved)
    post_norms: Any = None   # with sandwich norms: the output norms' record (PostNormSaved)


@dataclass
class StageCache:
    """One microbatch's forward record of a stage: global positions, the token ids (first
    stage), a :class:`BlockSaved` (or offload handle) per block and the head's record."""

    positions: np.ndarray
    tokens: Array | None = None
    blocks: list = field(default_factory=list)
    head: Any = None
    mtp: Any = None     # the multi-token prediction modules' records (mpipar.model.mtp)


@dataclass
class KVCache:
    """Keys and values of the positions seen so far, per block, for incremental decoding.

    ``keys[i]``, ``values[i]``: ``[B, capacity, hkv, D]`` of block ``i`` (this rank's kv heads);
    positions ``[0, length)`` are filled. :meth:`LlamaStage.forward_only` appends a block's new
    positions and attends over the whole prefix (:meth:`attend`)."""

    keys: dict[int, Array]
    values: dict[int, Array]
    length: int = 0

    @classmethod
    def empty(cls, xp, layers: range, batch: int, capacity: int, kv_heads: int, head_dim: int,
              dtype) -> "KVCache":
        """A cache of ``capacity`` positions for blocks ``layers`` (arrays of module ``xp``)."""
        shape = (batch, capacity, kv_heads, head_dim)
        return cls({i: xp.zeros(shape, dtype) for i in layers},
                   {i: xp.zeros(shape, dtype) for i in layers})

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (every block, every position of its capacity)."""
        return sum(int(a.nbytes) for a in (*self.keys.values(), *self.values.values()))

    def append(self, layer: int, k: Array, v: Array, start: int,
               record: Any = None) -> tuple[Array, Array]:
        """Store block ``layer``'s k, v ``[B, n, hkv, D]`` at positions ``[start, start + n)``;
        return its keys and values of positions ``[0, start + n)``. ``record`` (the block's
        attention-input record) is unread: a latent cache stores from it
        (:class:`mpipar.model.latent_attention.LatentKVCache`)."""
        end = start + k.shape[1]
        if end > self.keys[layer].shape[1]:
            raise ValueError(f"KVCache: position {end - 1} is beyond its capacity of "
                             f"{self.keys[layer].shape[1]} positions")
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def attend(self, kernels, layer: int, q: Array, k: Array, v: Array, start: int,
               record: Any, window: int) -> tuple[Array, Array]:
        """:meth:`append` block ``layer``'s new positions, then attend with ``q`` ``[B, n, hq,
        D]`` over every cached one: (out, lse) of ``kernels.attention_fwd``."""
        keys, values = self.append(layer, k, v, start, record)
        return kernels.attention_fwd(q, keys, values, start, 0, True, window=window)


class LinearGrads:
    """The weight gradients of one backward call: ``(dy, x, name) -> dx`` for
    ``y = x @ w.T (+ b)``, accumulating ``dw`` into ``grads[name]`` (and ``db`` into the bias's,
    when the model has one) now, or appending ``(name, dy, x)`` to ``deferred`` for
    :meth:`LlamaStage.weight_backward` (the input/weight split of zero-bubble schedules).
    The kernels add ``dw`` into the gradient buffer itself (float32 under bf16 compute: the
    microbatches' weight gradients accumulate there unrounded). A weight not ``in grads`` is
    frozen (LoRA's base): only its ``dx`` is computed."""

    def __init__(self, kernels, params: dict, grads: dict, deferred: list | None) -> None:
        self.kernels, self.params, self.grads, self.deferred = kernels, params, grads, deferred

    def __call__(self, dy: Array, x: Array, name: str) -> Array:
        w = self.params[name]
        if name not in self.grads:
            return self.kernels.linear_fwd(dy, w.T)
        if self.deferred is None:
            dx, _ = self.kernels.linear_bwd(dy, x, w, dw=self.grads[name])
            self.bias(dy, name)
            return dx
        self.deferred.append((name, dy, x))
        return self.kernels.linear_fwd(dy, w.T)

    def group(self, dys: Sequence[Array], x: Array, names: Sequence[str]) -> Array:
        """``dx`` of linears ``names`` sharing the input ``x``: their weight gradients booked
        one by one (into the float32 buffers, or deferred), then one GEMM
        ``[dy_1 .. dy_n] @ [w_1; ..; w_n]`` (float32 accumulation, one rounding under bf16)."""
        for dy, name in zip(dys, names):
            self.weight(dy, x, name)
        w = self.kernels.concat([self.params[n] for n in names], axis=0)
        return self.kernels.linear_fwd(self.kernels.concat(dys, axis=-1), w.T)

    def weight(self, dy: Array, x: Array, name: str) -> None:
        """Only the weight gradient of ``y = x @ w.T`` (and its bias's): accumulated now or
        deferred; the caller takes ``dx`` from :meth:`input` (the experts' backward computes
        ``dx`` by parts of the rows, ``dw`` once on them all)."""
        if name not in self.grads:
            return
        if self.deferred is None:
            self.kernels.linear_bwd(dy, x, None, dw=self.grads[name])
            self.bias(dy, name)
        else:
            self.deferred.append((name, dy, x))

    def input(self, dy: Array, name: str) -> Array:
        """Only ``dx = dy @ w`` of linear ``name`` (its weight gradient: :meth:`weight`)."""
        return self.kernels.linear_fwd(dy, self.params[name].T)

    def bias(self, dy: Array, name: str) -> None:
        """Accumulate the gradient of weight ``name``'s bias, if the model has one."""
        if bias_name(name) in self.grads:
            self.grads[bias_name(name)] += self.kernels.linear_bias_bwd(dy)


QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
O_PROJ = ("self_attn.o_proj.weight",)
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
DOWN = ("mlp.down_proj.weight",)
"""A block's linears in groups that share one input (:mod:`mpipar.model.tensor_ops`), by name
without the block's ``layers.{i}.``."""


def in_block(i: int, group: Sequence[str]) -> list[str]:
    """The parameter names of linear ``group`` in block ``i``."""
    return [f"layers.{i}.{name}" for name in group]


class DecoderBlock:
    """One decoder block's forward and backward by hand (module docstring), for block ``i`` of
    the weights it is given: the attention's inputs (q/k/v, their norms, RoPE), the attention
    core, the dense or sparse FFN (with a shared expert beside the experts), the sandwich's
    output norms, and what it keeps for backward under the recompute mode (:meth:`keep`,
    :meth:`restore`)."""

    def __init__(self, *, cfg: ModelConfig, kernels, tp: TensorOps, attention: AttentionCore,
                 experts: ExpertExchange, rope: Rotary, recompute: Recompute,
                 store: CacheStore | None) -> None:
        self.cfg, self.kernels, self.tp, self.attention = cfg, kernels, tp, attention
        self.experts, self.rope = experts, rope
        self.recompute, self.store = recompute, store
        self.q_factor = query_factor(cfg.head_dim, cfg.query_pre_attn_scalar)

    def _norm(self, params, name: str) -> Array:
        """What RMSNorm ``name`` multiplies by (:func:`mpipar.model.norms.norm_weight`)."""
        return norm_weight(params, name, self.cfg.norm_unit_offset)

    def keep(self, c: BlockSaved) -> Any:
        """What this block keeps under ``self.recompute`` (module docstring): the record, in
        the store when the mode offloads, else the fields the mode keeps."""
        mode = self.recompute
        if mode.offloads:
            return self.store.put(c)
        if mode.keeps_everything:
            return c
        return replace(c, **{f.name: None for f in fields(c) if not mode.keeps_field(f.name)})

    def restore(self, params, i: int, kept: Any, positions: np.ndarray, bias: Array | None = None
                ) -> BlockSaved:
        """The :class:`BlockSaved` backward needs, from what :meth:`keep` kept; q, k, v stay
        None when dropped (:meth:`backward` recomputes them where it enters h1 anyway)."""
        mode = self.recompute
        if mode.reruns_block:
            return self.forward(params, i, kept.x, positions, bias=bias)[1]
        if mode.offloads:
            return self.store.take(kept)
        if mode.keeps_everything:
            return kept
        ops, p, n, eps = self.kernels, params, f"layers.{i}.", self.cfg.norm_eps
        h1, rstd1 = ops.rmsnorm_fwd(kept.x, self._norm(p, n + INPUT), eps)
        h2, rstd2 = ops.rmsnorm_fwd(kept.x2, self._norm(p, n + self.cfg.norms.pre_ffn), eps)
        m = None if kept.g is None else self.cfg.activation.forward(ops, kept.g, kept.u)
        return replace(kept, h1=h1, rstd1=rstd1, h2=h2, rstd2=rstd2, m=m)

    def _attention_inputs(self, params, i: int, h1_in: Array, positions: np.ndarray,
                          scope: ParamScope = RESIDENT) -> tuple[Array, Array, Array, Any]:
        """q ``[B, S, hq, D]``, k and v ``[B, S, hkv, D]`` as the attention core reads them, and
        the qk-norm's record (None without ``qk_norm``): block ``i``'s q/k/v linears on the
        normed input as they read it (``h1_in``, :meth:`TensorOps.linear_input`), then the
        per-head q/k norms (:mod:`mpipar.model.qk_norm`), then RoPE; under latent attention
        :func:`mpipar.model.latent_attention.latent_fwd`'s (its record in place of qk's)."""
        if self.cfg.latent:
            return latent_fwd(self.kernels, self.tp, params, i, self.cfg, h1_in, positions,
                              self.rope.rotate)
        D, S = self.cfg.head_dim, len(positions)
        q, key, v = (a.reshape(-1, S, a.shape[-1] // D, D)
                     for a in self.tp.linear(params, in_block(i, QKV), h1_in))
        scope.progress()
        qk = None
        if self.cfg.qk_norm:
            q, key, qk = qk_norm_fwd(self.kernels, params, i, q, key, self.cfg.norm_eps,
                                     self.cfg.norm_unit_offset)
        q, key = self.rope.rotate([q, key], positions, local=self.cfg.local_rope(i))
        return scale_queries(q, self.q_factor), key, v, qk

    def forward(self, params, i: int, x: Array, positions: np.ndarray,
                scope: ParamScope = RESIDENT, recorder: Callable | None = None,
                kv: KVCache | None = None, bias: Array | None = None
                ) -> tuple[Array, BlockSaved]:
        """Block ``i`` on the stream ``x`` -> (output stream, every intermediate); ``recorder``:
        a callable ``(layer, name, array)`` handed the :data:`ACTIVATION_NAMES` tensors; ``kv``:
        attend over the cached positions too (incremental decoding, module docstring);
        ``bias``: a sparse block's routing bias."""
        ops, p, n, eps = self.kernels, params, f"layers.{i}.", self.cfg.norm_eps
        h1, rstd1 = ops.rmsnorm_fwd(x, self._norm(p, n + INPUT), eps)
        q, key, v, qk = self._attention_inputs(
            params, i, self.tp.linear_input(h1, self._input_names(i)), positions, scope)
        window = self.cfg.layer_window(i)
        if kv is None:
            out, attention_saved = self.attention.forward(q, key, v, positions, window,
                                                          **self._latent(params, i, key, qk))
        else:
            out, attention_saved = kv.attend(ops, i, q, key, v, int(positions[0]), qk, window)
        scope.progress()
        a, = apply_linears(self.tp, params, in_block(i, O_PROJ), attended_values(out, self.cfg))
        post = None                                  # sandwich norms: the outputs normalised
        if self.cfg.norms.sandwich:
            post = PostNormSaved(a, None)
            a, post.rstd_a = post_norm_fwd(ops, p, n + POST_ATTENTION, a, eps,
                                           self.cfg.norm_unit_offset)
        x2, h2, rstd2 = ops.add_rmsnorm_fwd(x, a, self._norm(p, n + self.cfg.norms.pre_ffn), eps)
        g = u = m = moe = shared_gate = None
        if not self.cfg.is_sparse(i):
            y, g, u, m = self._ffn_fwd(params, i, h2, GATE_UP, DOWN, scope)
        else:
            shared: list = []        # the shared expert, computed while the experts' rows travel
            aside = ((lambda: shared.append(self._shared_fwd(params, i, h2, scope)))
                     if self.cfg.moe_shared_ffn_hidden else None)
            y, moe = moe_forward(ops, params, i, self.cfg, h2, self.experts,
                                 bias, positions if kv is None else None, aside,
                                 None if self.tp.adapters is None else self.tp.adapters.experts)
            if shared:  # the shared expert's output added
                out_s, g, u, m, shared_gate = shared[0]
                y = y + out_s
        if post is not None:
            post.y = y
            y, post.rstd_y = post_norm_fwd(ops, p, n + POST_FFN, y, eps, self.cfg.norm_unit_offset)
        block_out = x2 + y
        if recorder is not None:
            for name, value in zip(ACTIVATION_NAMES, (x, attended_values(out, self.cfg), a, y,
                                                      block_out)):
                recorder(i, name, value)
        if not self.attention.needs_inputs:
            q = key = v = None
        return block_out, BlockSaved(x, h1, rstd1, q, key, v, out, attention_saved, x2, h2, rstd2,
                                     g, u, m, moe, shared_gate, qk, post)

    def _ffn_fwd(self, params, i: int, h2: Array, gate_up: Sequence[str], down: Sequence[str],
                 scope: ParamScope) -> tuple[Array, Array, Array, Array]:
        """Block ``i``'s SwiGLU FFN of weights ``gate_up`` and ``down`` (the dense FFN, or a
        sparse block's shared expert) on ``h2`` -> (output, g, u, m)."""
        g, u = apply_linears(self.tp, params, in_block(i, gate_up), h2)
        scope.progress()
        m = self.cfg.activation.forward(self.kernels, g, u)
        y, = apply_linears(self.tp, params, in_block(i, down), m)
        return y, g, u, m

    def _shared_fwd(self, params, i: int, h2: Array, scope: ParamScope) -> tuple:
        """Sparse block ``i``'s shared expert on ``h2`` -> (its output, g, u, m, the gate's
        record): DeepSeek-V3's, ungated (record None); with ``moe_shared_gate`` Qwen2-MoE's,
        scaled per token by ``s = sigmoid(h2 w_g^T)`` (record ``(s, the ungated output)``)."""
        y, g, u, m = self._ffn_fwd(params, i, h2, SHARED_GATE_UP, SHARED_DOWN, scope)
        if not self.cfg.moe_shared_gate:
            return y, g, u, m, None
        z, = apply_linears(self.tp, params, in_block(i, SHARED_GATE), h2)
        gate = self.kernels.sigmoid(self.kernels.upcast(z))   # float32 under bf16, as the router
        return (gate * y).astype(y.dtype, copy=False), g, u, m, (gate, y)

    def _shared_bwd(self, i: int, dout: Array, c: BlockSaved, lin: LinearGrads,
                    scope: ParamScope) -> Array:
        """The gradient of ``h2`` through :meth:`_shared_fwd`."""
        if c.shared_gate is None:
            return self._ffn_bwd(i, dout, c, SHARED_GATE_UP, SHARED_DOWN, lin, scope)
        gate, y, dt, upcast = *c.shared_gate, dout.dtype, self.kernels.upcast
        dz = (upcast(dout) * upcast(y)).sum(axis=-1, keepdims=True) * gate * (1 - gate)
        dh2 = apply_linears_backward(self.tp, [dz.astype(dt, copy=False)], c.h2,
                                     in_block(i, SHARED_GATE), lin)
        dy = (gate * upcast(dout)).astype(dt, copy=False)
        return dh2 + self._ffn_bwd(i, dy, c, SHARED_GATE_UP, SHARED_DOWN, lin, scope)

    def _ffn_bwd(self, i: int, dout: Array, c: BlockSaved, gate_up: Sequence[str],
                 down: Sequence[str], lin: LinearGrads, scope: ParamScope) -> Array:
        """The gradient of ``h2`` through :meth:`_ffn_fwd`'s FFN (its g, u, m in ``c``)."""
        dm = apply_linears_backward(self.tp, [dout], c.m, in_block(i, down), lin)
        scope.progress()
        dg, du = self.cfg.activation.backward(self.kernels, dm, c.g, c.u)
        return apply_linears_backward(self.tp, [dg, du], c.h2, in_block(i, gate_up), lin)

    def backward(self, params, grads, i: int, dout: Array, c: BlockSaved,
                 positions: np.ndarray, lin: LinearGrads, scope: ParamScope = RESIDENT,
                 aux_weight: float = 0.0) -> Array:
        """Block ``i``'s backward from ``dout`` and its record ``c``: the input stream's
        gradient; ``aux_weight``: each row's weight of a sparse block's balance loss."""
        ops, p, n, post = self.kernels, params, f"layers.{i}.", c.post_norms
        off, pre_ffn = self.cfg.norm_unit_offset, n + self.cfg.norms.pre_ffn
        dy = dout if post is None else post_norm_bwd(ops, p, grads, n + POST_FFN, dout, post.y,
                                                     post.rstd_y, off)
        if c.moe is None:
            dh2 = self._ffn_bwd(i, dy, c, GATE_UP, DOWN, lin, scope)
        else:
            shared: list = []        # the shared expert's, computed while the rows travel
            aside = ((lambda: shared.append(self._shared_bwd(i, dy, c, lin, scope)))
                     if c.g is not None else None)
            dh2 = moe_backward(ops, i, dy, c.moe, self.experts, lin, aux_weight,
                               aside)
            if shared:
                dh2 = dh2 + shared[0]
        scope.progress()
        dx2, dw = ops.add_rmsnorm_bwd(dh2, dout, c.x2, self._norm(p, pre_ffn), c.rstd2)
        grads[pre_ffn] += dw
        da = dx2 if post is None else post_norm_bwd(ops, p, grads, n + POST_ATTENTION, dx2,
                                                    post.a, post.rstd_a, off)
        out = c.attention_out
        do = apply_linears_backward(self.tp, [da], attended_values(out, self.cfg),
                                    in_block(i, O_PROJ), lin)
        scope.progress()
        qkv = self._input_names(i)
        h1_in = self.tp.linear_input(c.h1, qkv)
        q, key, v, qk = c.q, c.k, c.v, c.qk
        if ((q is None and self.attention.needs_inputs)          # dropped by selective
                or (qk is None and (self.cfg.qk_norm or self.cfg.latent))):  # recomputation
            q, key, v, qk = self._attention_inputs(params, i, h1_in, positions)
            if not self.attention.needs_inputs:
                q = key = v = None
        dq, dk, dv = self.attention.backward(values_grad(do, out, self.cfg, ops.xp), q, key, v,
                                             out, c.attention_saved, self.cfg.layer_window(i),
                                             **self._latent(params, i, key, qk, lin))
        scope.progress()
        if self.cfg.latent:
            dh1 = latent_bwd(ops, self.tp, params, grads, i, self.cfg, dq, dk, dv, qk, h1_in,
                             positions, self.rope.rotate, lin)
            return self._input_norm_bwd(params, grads, i, dh1, dx2, c)
        dq, dk = self.rope.rotate([scale_queries(dq, self.q_factor), dk], positions, backward=True,
                              local=self.cfg.local_rope(i))
        if qk is not None:
            dq, dk = qk_norm_bwd(ops, params, grads, i, dq, dk, qk, off)
        dh1 = self.tp.linear_backward([dq, dk, dv], h1_in, qkv, lin)
        return self._input_norm_bwd(params, grads, i, dh1, dx2, c)

    def _latent(self, params, i: int, key: Array | None, qk: Any, lin=None) -> dict:
        """The core's ``latent=`` argument: block ``i``'s :class:`~mpipar.model.latent_attention.
        LatentBlocks` when the core passes latents and they are fewer values than this rank's
        expanded K and V (:func:`~mpipar.model.latent_attention.ring_passes_latent`), else none."""
        lora = None if self.tp.adapters is None else self.tp.adapters.lora
        if not (self.cfg.latent and self.attention.passes_latent
                and ring_passes_latent(self.cfg, key.shape[2], lora)):
            return {}
        return {"latent": LatentBlocks(self.kernels, self.tp, params, i, self.cfg, key, qk, lin)}

    def _input_norm_bwd(self, params, grads, i: int, dh1: Array, dx2: Array, c: BlockSaved
                        ) -> Array:
        """The block input's gradient: through the input norm (``dh1``) and the residual."""
        n = f"layers.{i}.{INPUT}"
        dx, dw = self.kernels.add_rmsnorm_bwd(dh1, dx2, c.x, self._norm(params, n), c.rstd1)
        grads[n] += dw
        return dx

    def _input_names(self, i: int) -> list[str]:
        """The linears of block ``i`` reading its normed input (the group it enters in)."""
        return input_names(self.cfg, i) if self.cfg.latent else in_block(i, QKV)


class LlamaStage:
    """Blocks ``layers`` of the model, plus embedding (``first``) and norm/head/loss (``last``):
    the walk over its units, each block a :class:`DecoderBlock`'s and the head a
    :class:`mpipar.model.head.LmHead`'s."""

    def __init__(self, *, cfg: ModelConfig, kernels, layers: range, first: bool, last: bool,
                 tp: TensorOps, attention: AttentionCore, recompute: Recompute | str = "none",
                 store: CacheStore | None = None, seq_len: int = 0,
                 experts: ExpertExchange | None = None) -> None:
        """``recompute``: a :class:`~mpipar.model.recompute.Recompute` mode or its name (see
        the module docstring); an offloading mode needs ``store``. ``seq_len``: the length of the whole sequences whose positions forward
        receives (dynamic RoPE scaling depends on it; 0: the largest position + 1).
        ``recorder``, when set to a callable ``(layer, name, array)``, receives the
        :data:`ACTIVATION_NAMES` tensors of every block the forward pass runs. ``experts``:
        the sparse blocks' exchange (:mod:`mpipar.model.moe`; default: every expert here,
        whole sequences). ``moe_aux_weight`` (set by the caller) weighs each row's balance loss
        in backward; :meth:`forward` adds its share of the balance loss to ``moe_aux`` and the
        expert loads of each sparse block to ``moe_load`` and the assignments its capacity
        dropped to ``moe_dropped`` (the caller resets them).
        ``moe_bias`` (set by the caller): a sparse block's routing bias ``[E]`` by block index
        (auxiliary-loss-free balancing; a block without one routes on its probabilities)."""
        if isinstance(recompute, str):
            recompute = Recompute.named(recompute)
        if recompute.offloads and store is None:
            raise ValueError(f"recompute={recompute.name!r}: needs a store for the saved "
                             f"activations")
        self.recorder = None
        self.cfg = require_resolved(cfg)
        self.kernels, self.layers, self.first, self.last = kernels, layers, first, last
        self.tp = tp
        self.block = DecoderBlock(cfg=self.cfg, kernels=kernels, tp=tp, attention=attention,
                                  experts=experts or LocalExperts(self.cfg.moe_experts),
                                  rope=Rotary(self.cfg, kernels, seq_len), recompute=recompute,
                                  store=store)
        self.head = LmHead(self.cfg, kernels, tp, recompute, store)
        # Multi-token prediction: its modules run with the head, in its scope.
        self.mtp = MultiTokenPrediction.of(self.cfg, EMBED) if last else None
        self.head.units += self.mtp.units(self.head.units) if self.mtp else []
        self.moe_aux_weight, self.moe_aux = 0.0, 0.0
        self.moe_load: dict[int, Array] = {}
        self.moe_dropped: dict[int, int] = {}
        self.moe_bias: dict[int, Array] = {}

    def param_names(self) -> list[str]:
        return stage_param_names(self.cfg, self.layers, self.first, self.last)

    # ---------------------------------------------------------------- forward
    def forward(self, params: dict[str, Array], inp: Array, positions: np.ndarray,
                targets: Array | None = None, scope: ParamScope = RESIDENT,
                ahead: Array | None = None) -> tuple[Array, StageCache]:
        """Run the stage.

        inp: token ids ``[B, S]`` on the first stage, else the stream. positions: global
        positions ``[S]`` of this rank's tokens. targets ``[B, S]`` on the last stage.
        Returns the stream, or on the last stage the per-token loss ``[B, S]`` (float64).
        scope: holds each unit while it reads ``params``. ahead: the multi-token prediction
        modules' tokens on the last stage (:mod:`mpipar.model.mtp`).
        """
        cache = StageCache(positions, tokens=inp if self.first else None)

        def keep(saved: BlockSaved) -> None:
            if saved.moe is not None:
                self._count_moe(self.layers[len(cache.blocks)], saved.moe)
            cache.blocks.append(self.block.keep(saved))

        def head(x: Array) -> tuple[Array, Any]:
            if self.mtp is not None:
                cache.mtp = self.mtp.forward(self, params, x, targets, ahead, positions)
            return self.head.forward(params, x, targets)

        out = self._walk(params, inp, positions, scope, on_block=keep, head=head)
        if not self.last:
            return out, cache
        loss, cache.head = out
        cache.head = self.head.keep(cache.head)
        return loss, cache

    def _count_moe(self, i: int, moe) -> None:
        """Add a sparse block's share of the balance loss and its load to the step's sums."""
        self.moe_aux += moe.aux
        self.moe_load[i] = self.moe_load.get(i, 0) + moe.counts
        self.moe_dropped[i] = self.moe_dropped.get(i, 0) + moe.dropped

    def forward_only(self, params: dict[str, Array], inp: Array, positions: np.ndarray,
                     targets: Array | None = None, kv: KVCache | None = None,
                     scope: ParamScope = RESIDENT) -> Array:
        """The stage's forward keeping nothing for a backward (evaluation, generation).

        inp and positions as in :meth:`forward` (with ``kv``: the new tokens, at consecutive
        positions from ``kv.length``; the caller advances ``kv.length``). Returns the stream; on
        the last stage the per-token loss ``[B, S]`` (float64) when ``targets`` are given, else
        this rank's logits ``[B*S, V/tp]`` (its vocabulary shard; tokens in row-major order).
        scope: holds each unit while it reads ``params``, as in :meth:`forward`.
        """
        def head(x: Array) -> Array:
            if targets is not None:
                return self.head.forward(params, x, targets)[0]
            return self.head.logits(params, x)[1]

        return self._walk(params, inp, positions, scope, head=head, kv=kv)

    def _walk(self, params, inp: Array, positions: np.ndarray, scope: ParamScope,
              head: Callable[[Array], Any], on_block: Callable[[BlockSaved], None] | None = None,
              kv: KVCache | None = None) -> Any:
        """The forward of the stage's units in order, each inside ``scope.using``: the embedding
        (first stage), each block (its :class:`BlockSaved` handed to ``on_block`` and its
        activations to the recorder, when ``on_block`` is given; ``kv``: incremental decoding),
        then, on the last stage, ``head(stream)`` inside the head's units. Returns what ``head``
        returns, or the stream."""
        x = inp
        if self.first:
            with scope.using(["embed"], False):
                x = self.tp.embed(params, EMBED, inp)
                x = scale_embedding(x, self.cfg.hidden) if self.cfg.embed_scale else x
        for i in self.layers:
            with scope.using([f"layers.{i}"], False):
                recorder = self.recorder if on_block is not None else None
                x, saved = self.block.forward(params, i, x, positions, scope, recorder, kv,
                                              self.moe_bias.get(i))
            if on_block is not None:
                on_block(saved)
        if not self.last:
            return x
        with scope.using(self.head.units, False):
            return head(x)

    # ---------------------------------------------------------------- backward
    def backward(self, params: dict[str, Array], grads: dict[str, Array], dout: Array,
                 cache: StageCache, deferred: list | None = None, on_ready=None,
                 scope: ParamScope = RESIDENT) -> Array | None:
        """Accumulate parameter gradients into ``grads`` (+=) and return d(input).

        dout: the stream's gradient, or on the last stage the weight of each token's loss
        ``[B, S]`` (``1 / tokens in the global batch`` for the mean loss). Returns the input
        stream's gradient, or None on the first stage (token ids have no gradient).

        deferred: if a list is given, the weight gradients of the linear layers are not computed
        but appended to it as ``(name, dy, x)`` for :meth:`weight_backward` to run later.
        on_ready: called with the list of parameter names whose gradients this call has finished,
        after each block (the hook that launches data-parallel bucket reductions early).
        scope: holds each unit during its backward (:class:`ParamScope`).
        """
        lin = LinearGrads(self.kernels, params, grads, deferred)
        final = deferred is None
        notify = on_ready if final else None
        dx = dout
        if self.last:
            with scope.using(self.head.units, True, final):
                dx_mtp = self.mtp and self.mtp.backward(self, params, grads, cache.mtp,
                                                        cache.positions, lin, scope)
                dx = self.head.backward(params, grads, dout, cache.head, lin)
                dx = dx if dx_mtp is None else dx + dx_mtp
            # tied: final after the embedding's backward
            tied_here = self.first and self.head.weight == EMBED
            notify and notify(["norm.weight"] + ([] if tied_here else [self.head.weight])
                              + (self.mtp.final_names(self) if self.mtp else []))
        for i in reversed(self.layers):  # pop: each block's activations go once it is done
            with scope.using([f"layers.{i}"], True, final):
                saved = self.block.restore(params, i, cache.blocks.pop(), cache.positions,
                                           self.moe_bias.get(i))
                dx = self.block.backward(params, grads, i, dx, saved, cache.positions, lin,
                                         scope, self.moe_aux_weight)
            notify and notify([s.name for s in block_param_specs(self.cfg, i)])
        if not self.first:
            return dx
        with scope.using(["embed"], True):
            dx = scale_embedding(dx, self.cfg.hidden) if self.cfg.embed_scale else dx
            self.tp.embed_backward(grads, EMBED, dx, cache.tokens)
        notify and notify([EMBED])
        return None

    def weight_backward(self, grads: dict[str, Array], deferred: list,
                        scope: ParamScope = RESIDENT) -> None:
        """Run the weight-gradient GEMMs (and bias sums) that :meth:`backward` deferred, then
        tell ``scope`` which units' gradients are now final."""
        units = dict.fromkeys(unit_of(name) for name, _, _ in deferred)
        if any(name == self.head.weight for name, _, _ in deferred):
            units.update(dict.fromkeys(self.head.units))
        lin = LinearGrads(self.kernels, {}, grads, None)
        for name, dy, x in deferred:
            self.kernels.linear_bwd(dy, x, None, dw=grads[name])
            lin.bias(dy, name)
        deferred.clear()
        scope.weights_done(list(units))
