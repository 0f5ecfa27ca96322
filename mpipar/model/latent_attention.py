"""Multi-head latent attention (DeepSeek-V3's MLA, ``model.latent_kv_rank`` > 0): the queries,
keys and values a block hands its attention core, made from low-rank latents, forward and
backward by hand.

For each token of the normed stream ``h`` ``[.., H]`` (``h`` as the column-parallel linears read
it, :meth:`mpipar.model.tensor_ops.TensorOps.linear_input`):

- queries: ``c_q = RMSNorm(h W_qa^T)`` ``[r_q]`` (``latent_q_rank``; the norm's weight
  ``q_a_layernorm``), ``q = c_q W_qb^T`` ``[h, D]``; with ``latent_q_rank`` 0 ``q = h W_q^T``;
- keys and values from one latent: ``[c, k_r] = h W_kva^T`` (``c`` ``[r_kv]``,
  ``latent_kv_rank``; ``k_r`` ``[d_r]``, ``rope_head_dim``), ``c_kv = RMSNorm(c)``
  (``kv_a_layernorm``), ``[k_n | v] = c_kv W_kvb^T`` per head (``[h, D - d_r]`` and ``[h,
  d_v]``, ``v_head_dim``);
- each query/key head of ``D = head_dim`` is its nope part then its rope part: ``q = [q_n |
  RoPE(q_r)]`` and ``k = [k_n | RoPE(k_r)]``, the one rotated key ``k_r`` shared by every head;
- values are handed to the core zero-padded from ``d_v`` to ``D`` (the attention kernels take one
  head width; the padded columns of the output are zero and :func:`attended_values` drops them
  before o_proj), so the core's softmax scale is its default ``1 / sqrt(D)``, transformers'
  ``qk_head_dim ** -0.5``; under yarn RoPE with ``rope_mscale_all_dim`` set, transformers'
  DeepSeek-V3 multiplies that scale by :meth:`RopeScaling.softmax_factor
  <mpipar.model.rope.RopeScaling.softmax_factor>`, which is folded into the queries (as
  :mod:`mpipar.model.attention_scale` folds Gemma's scale) and into their gradient.

The latents' norms use transformers' fixed epsilon 1e-6 (:data:`LATENT_NORM_EPS`), not
``norm_eps``. RoPE rotates ``rope_head_dim`` features (:attr:`ModelConfig.rope_dim`), as
rotate-half; DeepSeek-V3's interleaved pairs are a fixed permutation of the rope rows of
``W_qb`` and ``W_kva``, applied at import and undone at export
(:mod:`mpipar.checkpoint.hf_deepseek`).

Tensor parallelism splits heads: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` are column-
parallel (each rank's heads' rows), ``o_proj`` row-parallel. The down-projections ``q_a_proj``
and ``kv_a_proj_with_mqa`` and the two latent norms are ``heads_replicated``
(:mod:`mpipar.parallel.placement`): every tp rank holds them whole and computes the latents of
every token of its (entered) input; the gradients reaching them come from this rank's heads only,
so their weight gradients are partial sums over tp (all-reduced with the other partial ones) and
the stream's gradient through them joins the column-parallel ones' sum over tp. Every linear
goes through the tp seam (:meth:`TensorOps.linear`, :meth:`TensorOps.linear_backward`), so LoRA
adapters on any of them (:mod:`mpipar.model.lora`) are added where the seam adds them; the
up-projections' input gradients stay this rank's partial ones (``summed=False``) until the
down-projections' sum over tp.

What backward reads is a :class:`LatentSaved` (the block keeps it as the attention inputs'
record, where a block with ``qk_norm`` keeps that norm's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mpipar.model.attention import as_activations
from mpipar.model.attention_scale import scale_queries

Array = Any

Q_A, Q_A_NORM, Q_B, Q_PROJ = ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                              "self_attn.q_b_proj.weight", "self_attn.q_proj.weight")
KV_A, KV_A_NORM, KV_B = ("self_attn.kv_a_proj_with_mqa.weight",
                         "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight")
"""Block ``i``'s latent attention weights (``layers.{i}.`` + these; transformers' names)."""

LATENT_NORM_EPS = 1e-6
"""The latents' RMSNorm epsilon (transformers' ``DeepseekV3RMSNorm`` default)."""


def latent_param_shapes(m) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a block's latent attention weights before o_proj, in forward order."""
    q = m.heads * m.head_dim
    nope = m.head_dim - m.rope_head_dim
    queries = ([(Q_A, (m.latent_q_rank, m.hidden)), (Q_A_NORM, (m.latent_q_rank,)),
                (Q_B, (q, m.latent_q_rank))] if m.latent_q_rank else [(Q_PROJ, (q, m.hidden))])
    return queries + [(KV_A, (m.latent_kv_rank + m.rope_head_dim, m.hidden)),
                      (KV_A_NORM, (m.latent_kv_rank,)),
                      (KV_B, (m.heads * (nope + m.value_dim), m.latent_kv_rank))]


def input_names(m, i: int) -> list[str]:
    """The linears of block ``i`` that read the normed stream itself, in one group when they
    share a tp role (``q_a_proj`` and ``kv_a_proj_with_mqa``, both ``heads_replicated``); with
    ``latent_q_rank`` 0 only ``kv_a_proj_with_mqa`` (``q_proj`` is column-parallel: a group of
    its own). Both roles enter the stream (:meth:`TensorOps.linear_input`) alike."""
    return [f"layers.{i}.{n}" for n in ((Q_A, KV_A) if m.latent_q_rank else (KV_A,))]


@dataclass
class LatentSaved:
    """What backward reads (shapes ``[.., n]`` over this rank's tokens as the linears read
    them): the query latent before its norm ``cq``, its ``rstd_q`` and after it ``cqn`` (None
    without ``latent_q_rank``), the kv latent before its norm ``ckv``, ``rstd_kv`` and after it
    ``ckvn``."""

    cq: Array | None
    rstd_q: Array | None
    cqn: Array | None
    ckv: Array
    rstd_kv: Array
    ckvn: Array


def latent_fwd(kernels, tp, params, i: int, m, h1_in: Array, positions,
               rotate: Callable) -> tuple[Array, Array, Array, LatentSaved]:
    """q, k ``[B, S, h, D]`` and v ``[B, S, h, D]`` (zero-padded from ``v_head_dim``) of block
    ``i`` from its entered normed input ``h1_in``, and the record; ``rotate(xs, positions,
    backward=False)`` is the block's RoPE."""
    p, xp, S = f"layers.{i}.", kernels.xp, len(positions)
    D, dr, dv, r = m.head_dim, m.rope_head_dim, m.value_dim, m.latent_kv_rank
    nope = D - dr
    cq = rstd_q = cqn = None
    if m.latent_q_rank:
        cq, kv_a = tp.linear(params, input_names(m, i), h1_in)
        cqn, rstd_q = kernels.rmsnorm_fwd(cq, params[p + Q_A_NORM], LATENT_NORM_EPS)
        q, = tp.linear(params, [p + Q_B], cqn)
    else:
        q, = tp.linear(params, [p + Q_PROJ], h1_in)
        kv_a, = tp.linear(params, input_names(m, i), h1_in)
    ckv, k_r = kernels.split_columns(kv_a, [r, dr])
    ckvn, rstd_kv = kernels.rmsnorm_fwd(ckv, params[p + KV_A_NORM], LATENT_NORM_EPS)
    kv, = tp.linear(params, [p + KV_B], ckvn)
    q = q.reshape(-1, S, q.shape[-1] // D, D)
    q_r, k_r = rotate([xp.ascontiguousarray(q[..., nope:]), k_r.reshape(-1, S, 1, dr)],
                      positions)
    q = xp.concatenate([q[..., :nope], q_r], axis=-1)
    k, v = _heads(xp, m, kv.reshape(-1, S, q.shape[2], nope + dv), k_r)
    q = scale_queries(q, m.rope.softmax_factor(m))
    return q, k, v, LatentSaved(cq, rstd_q, cqn, ckv, rstd_kv, ckvn)


def _heads(xp, m, kv: Array, k_r: Array) -> tuple[Array, Array]:
    """The core's k ``[B, S, h, D]`` and v (zero-padded from ``v_head_dim`` to ``D``) from
    the up-projected latent ``kv = c_kv W_kvb^T`` ``[B, S, h, D - d_r + d_v]`` and the rotated
    RoPE key ``k_r`` ``[B, S, 1, d_r]`` every head shares."""
    nope, h, dr = m.head_dim - m.rope_head_dim, kv.shape[2], m.rope_head_dim
    k = xp.concatenate([kv[..., :nope], xp.broadcast_to(k_r, k_r.shape[:2] + (h, dr))], axis=-1)
    v = xp.zeros(k.shape, k.dtype)
    v[..., :m.value_dim] = kv[..., nope:]
    return k, v


def latent_bwd(kernels, tp, params, grads, i: int, m, dq: Array, dk: Array, dv: Array | None,
               c: LatentSaved, h1_in: Array, positions, rotate: Callable, lin) -> Array:
    """The gradient of the block's normed stream (as :meth:`TensorOps.linear_backward` returns
    it: summed over tp) from those of :func:`latent_fwd`'s q, k, v; weight gradients through
    ``lin`` and, for the latent norms, into ``grads``. ``dv`` None: ``dk`` is the gradient of
    the block's latent ``[B, S, r_kv + d_r]`` (a core that took :class:`LatentBlocks`, which
    booked ``kv_b_proj``'s weight gradient)."""
    p, xp = f"layers.{i}.", kernels.xp
    D, dr, dvh, r = m.head_dim, m.rope_head_dim, m.value_dim, m.latent_kv_rank
    nope = D - dr
    lead = h1_in.shape[:-1]
    dq = scale_queries(dq, m.rope.softmax_factor(m))
    dk_r = (dk[..., r:].reshape(dk.shape[:2] + (1, dr)) if dv is None
            else dk[..., nope:].sum(axis=2, keepdims=True))
    dq_r, dk_r = rotate([xp.ascontiguousarray(dq[..., nope:]), dk_r], positions, backward=True)
    dq = xp.concatenate([dq[..., :nope], dq_r], axis=-1).reshape(lead + (-1,))
    if dv is None:
        dckvn = xp.ascontiguousarray(dk[..., :r]).reshape(lead + (r,))
    else:
        dkv = xp.concatenate([dk[..., :nope], dv[..., :dvh]], axis=-1).reshape(lead + (-1,))
        dckvn = tp.linear_backward([dkv], c.ckvn, [p + KV_B], lin, summed=False)
    dckv, dw = kernels.rmsnorm_bwd(dckvn, c.ckv, params[p + KV_A_NORM], c.rstd_kv)
    grads[p + KV_A_NORM] += dw
    dkv_a = xp.concatenate([dckv.astype(dq.dtype, copy=False), dk_r.reshape(lead + (dr,))],
                           axis=-1)
    if not m.latent_q_rank:
        dh = tp.linear_backward([dkv_a], h1_in, input_names(m, i), lin)
        return dh + tp.linear_backward([dq], h1_in, [p + Q_PROJ], lin)
    dcqn = tp.linear_backward([dq], c.cqn, [p + Q_B], lin, summed=False)
    dcq, dw = kernels.rmsnorm_bwd(dcqn, c.cq, params[p + Q_A_NORM], c.rstd_q)
    grads[p + Q_A_NORM] += dw
    return tp.linear_backward([dcq.astype(dq.dtype, copy=False), dkv_a], h1_in,
                              input_names(m, i), lin)


def ring_passes_latent(m, heads: int, lora=None) -> bool:
    """Whether a ring of latent attention passes each position's latent and RoPE key
    (:class:`LatentBlocks`, ``r_kv + d_r`` values) rather than the expanded K and V of the
    ``heads`` heads a rank holds (``2 x heads x head_dim``, values zero-padded): when that is
    fewer values, and ``kv_b_proj`` carries no adapter of the run's LoRA ``lora``
    (:class:`mpipar.model.lora.Lora` or None: the receiving rank expands through the base
    weight alone). At DeepSeek-V3's shape (128 heads of 192, ``r_kv`` 512, ``d_r`` 64)
    576 against 49,152, 85.3x fewer (10.7x at tp 8)."""
    return (m.latent and (lora is None or "kv_b_proj" not in lora.targets)
            and m.latent_kv_rank + m.rope_head_dim < 2 * heads * m.head_dim)


class LatentBlocks:
    """The blocks of latent attention as a sequence-parallel ring passes them (the interface of
    :class:`mpipar.parallel.sequence.ring.ExpandedBlocks`): per position the kv latent after
    its norm and the rotated RoPE key ``[B, S, r_kv + d_r]`` (what :class:`LatentKVCache`
    holds), expanded through ``kv_b_proj`` on this rank's heads by the rank that attends the
    block (:func:`up_projection`). In backward the expanded block's dk, dv go back through the
    up-projection on that rank: the block's gradient travels latent-sized, and ``kv_b_proj``'s
    weight gradient is booked (through ``lin``) on each rank for the blocks it expanded, its
    sum over sp the one-process gradient. The own block is expanded by :func:`latent_fwd`."""

    def __init__(self, kernels, tp, params, i: int, m, k: Array, record: LatentSaved,
                 lin=None) -> None:
        xp, B, S, r = kernels.xp, k.shape[0], k.shape[1], m.latent_kv_rank
        self.xp, self.m, self.i, self.lin = xp, m, i, lin
        self.expand = up_projection(kernels, tp, params, m)
        self.message = xp.ascontiguousarray(xp.concatenate(
            [record.ckvn.reshape(B, S, r).astype(k.dtype, copy=False),
             k[:, :, 0, m.head_dim - m.rope_head_dim:]], axis=-1))

    def open(self, buf: Array) -> tuple[Array, Array]:
        """(k, v) ``[B, S, h, D]`` of a block's latents (v zero-padded)."""
        return self.expand(self.i, buf)

    def accumulate(self, buf: Array, dbuf: Array, block_grads, kv=None) -> None:
        """Add to ``dbuf`` the gradient of the latents ``buf`` through their expansion, from the
        dk, dv that ``block_grads(k, v, dk, dv)`` adds; ``kv``: the block already expanded."""
        k, v = kv or self.open(buf)
        dk, dv = self.xp.zeros(k.shape, dbuf.dtype), self.xp.zeros(v.shape, dbuf.dtype)
        block_grads(k, v, dk, dv)
        dbuf += self._grad(buf, dk.astype(k.dtype, copy=False), dv.astype(k.dtype, copy=False))

    def _grad(self, buf: Array, dk: Array, dv: Array) -> Array:
        """The latents' gradient ``[B, S, r_kv + d_r]`` from their expansion's; ``kv_b_proj``'s
        weight gradient through ``lin``."""
        m, xp, r = self.m, self.xp, self.m.latent_kv_rank
        nope = m.head_dim - m.rope_head_dim
        B, S = buf.shape[:2]
        dkv = xp.concatenate([dk[..., :nope], dv[..., :m.value_dim]], axis=-1).reshape(B, S, -1)
        dckvn = self.lin(dkv, xp.ascontiguousarray(buf[..., :r]), f"layers.{self.i}." + KV_B)
        return xp.concatenate([dckvn.reshape(B, S, r), dk[..., nope:].sum(axis=2)], axis=-1)

    def result(self, dq: Array, dbuf: Array, like: Array) -> tuple[Array, Array, None]:
        """The core's (dq, the own latents' gradient, None)."""
        dq, dl = as_activations((dq, dbuf), like)
        return dq, dl, None


def attended_values(out: Array, m) -> Array:
    """The attention core's output ``[B, S, h, D]`` as o_proj reads it ``[B, S, h * d_v]``
    (the padded columns dropped; the whole output without latent attention)."""
    B, S = out.shape[:2]
    if not m.latent or m.value_dim == m.head_dim:
        return out.reshape(B, S, -1)
    return out[..., :m.value_dim].reshape(B, S, -1)


def values_grad(do: Array, out: Array, m, xp) -> Array:
    """The gradient of the core's output ``out`` from that of :func:`attended_values`'."""
    if not m.latent or m.value_dim == m.head_dim:
        return do.reshape(out.shape)
    full = xp.zeros(out.shape, do.dtype)
    full[..., :m.value_dim] = do.reshape(out.shape[:-1] + (m.value_dim,))
    return full


@dataclass
class LatentKVCache:
    """The KV cache of latent attention (incremental decoding, as :class:`mpipar.model.llama.
    KVCache`): per block and position the kv latent after its norm ``c_kv`` ``[r_kv]`` and the
    rotated RoPE key ``RoPE(k_r)`` ``[d_r]``, ``latents[i]`` ``[B, capacity, r_kv + d_r]``, in
    place of every head's key and value. Both are what every head reads (the down-projection is
    ``heads_replicated``), so each tp rank holds them whole: ``r_kv + d_r`` values a token and
    block, against the expanded cache's ``2 x heads / tp x head_dim``.

    :meth:`attend` stores the new positions' latents and attends over every cached position.
    With ``absorb`` (:func:`absorbed_attention`, DeepSeek's inference) the up-projection
    ``kv_b_proj`` is absorbed into the queries and the output and the heads attend over the
    latents themselves; without it (``expand``, :func:`up_projection`) every cached position's
    keys and values are rebuilt as :func:`latent_fwd` makes them (this rank's heads) and
    attended by the expanded path's core, one block's at a time."""

    latents: dict[int, Array]
    expand: Callable[[int, Array], tuple[Array, Array]]
    model: Any
    length: int = 0
    absorb: Callable | None = None

    @classmethod
    def empty(cls, xp, layers: range, batch: int, capacity: int, m, dtype,
              expand: Callable[[int, Array], tuple[Array, Array]],
              absorb: Callable | None = None) -> "LatentKVCache":
        """A cache of ``capacity`` positions for blocks ``layers`` of the model ``m``."""
        shape = (batch, capacity, m.latent_kv_rank + m.rope_head_dim)
        return cls({i: xp.zeros(shape, dtype) for i in layers}, expand, m, absorb=absorb)

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (every block, every position of its capacity)."""
        return sum(int(a.nbytes) for a in self.latents.values())

    def append(self, layer: int, k: Array, v: Array, start: int,
               record: LatentSaved) -> tuple[Array, Array]:
        """Store block ``layer``'s new positions ``[start, start + n)``: its latent after the
        norm (``record.ckvn``) and its rotated RoPE key (the rope columns of any head of ``k``
        ``[B, n, h, D]``; ``v`` unread); return the keys and values of positions ``[0, start +
        n)``, expanded."""
        return self.expand(layer, self._store(layer, k, start, record))

    def _store(self, layer: int, k: Array, start: int, record: LatentSaved) -> Array:
        """Store the new positions' latents (as :meth:`append`); the cached ones ``[B, start +
        n, r_kv + d_r]``."""
        m, cache = self.model, self.latents[layer]
        B, n, r = k.shape[0], k.shape[1], m.latent_kv_rank
        end = start + n
        if end > cache.shape[1]:
            raise ValueError(f"LatentKVCache: position {end - 1} is beyond its capacity of "
                             f"{cache.shape[1]} positions")
        cache[:, start:end, :r] = record.ckvn.reshape(B, n, r)
        cache[:, start:end, r:] = k[:, :, 0, m.head_dim - m.rope_head_dim:]
        return cache[:, :end]

    def attend(self, kernels, layer: int, q: Array, k: Array, v: Array, start: int,
               record: LatentSaved, window: int) -> tuple[Array, Array]:
        """Store block ``layer``'s new positions (their q, k, v ``[B, n, h, D]`` at ``[start,
        start + n)``) and attend with ``q`` over every cached one: (out ``[B, n, h, D]``, values
        zero-padded as the core's, lse)."""
        if self.absorb is None:
            keys, values = self.append(layer, k, v, start, record)
            return kernels.attention_fwd(q, keys, values, start, 0, True, window=window)
        return self.absorb(layer, q, self._store(layer, k, start, record), start, window)


def absorbed_attention(kernels, params, m) -> Callable:
    """Block ``i``'s attention of the queries ``q`` ``[B, n, h, D]`` (rotated and scaled, as
    :func:`latent_fwd`'s; this rank's heads) at positions from ``start`` over its cached latents
    ``[B, L, r_kv + d_r]`` (:class:`LatentKVCache`), with ``kv_b_proj`` absorbed: its key rows
    ``W_uk`` ``[h, D - d_r, r_kv]`` into the queries, ``q_n W_uk`` ``[B, n, h, r_kv]``, so that a
    head's score ``q_n . k_n + q_r . k_r`` is ``[q_n W_uk | q_r] . [c_kv | k_r]``, one key head
    of ``r_kv + d_r`` every query head shares, at the expanded path's softmax scale; the values
    are the latents ``c_kv`` (zero-padded to the key width) and the heads' outputs go through the
    value rows ``W_uv`` ``[h, d_v, r_kv]`` after the attention. -> (out ``[B, n, h, D]``, values
    zero-padded, lse). A decoding step costs ``h x (2 r_kv + d_r)`` multiply-adds a cached
    position and block, against the rebuild's ``r_kv x h x (D - d_r + d_v)`` on top of the
    attention's (DeepSeek-V3: 139 k against 16.8 M)."""
    xp, r, dr, nope = kernels.xp, m.latent_kv_rank, m.rope_head_dim, m.head_dim - m.rope_head_dim
    scale = 1.0 / float(m.head_dim) ** 0.5

    def attend(i: int, q: Array, latents: Array, start: int, window: int):
        B, n, h, D = q.shape
        w = params[f"layers.{i}." + KV_B].reshape(h, nope + m.value_dim, r)
        q_abs = xp.einsum("bnhd,hdr->bnhr", q[..., :nope], w[:, :nope])
        keys = xp.ascontiguousarray(latents[:, :, None, :])
        values = xp.zeros(keys.shape, keys.dtype)
        values[..., :r] = keys[..., :r]
        qa = xp.ascontiguousarray(xp.concatenate([q_abs.astype(q.dtype, copy=False),
                                                  q[..., nope:]], axis=-1))
        o, lse = kernels.attention_fwd(qa, keys, values, start, 0, True, scale=scale,
                                       window=window)
        out = xp.zeros(q.shape, o.dtype)
        out[..., :m.value_dim] = xp.einsum("bnhr,hdr->bnhd", o[..., :r], w[:, nope:])
        return out, lse

    return attend


def up_projection(kernels, tp, params, m) -> Callable[[int, Array], tuple[Array, Array]]:
    """Block ``i``'s keys and values ``[B, L, h, D]`` (values zero-padded, as
    :func:`latent_fwd`'s) from its cached latents ``[B, L, r_kv + d_r]`` (:class:`LatentKVCache`):
    ``kv_b_proj`` on this rank's heads, the RoPE key broadcast to each."""
    r, xp = m.latent_kv_rank, kernels.xp

    def expand(i: int, latents: Array) -> tuple[Array, Array]:
        B, L = latents.shape[:2]
        kv, = tp.linear(params, [f"layers.{i}." + KV_B], xp.ascontiguousarray(latents[..., :r]))
        nope = m.head_dim - m.rope_head_dim
        kv = kv.reshape(B, L, -1, nope + m.value_dim)
        return _heads(xp, m, kv, latents[..., r:].reshape(B, L, 1, m.rope_head_dim))

    return expand
