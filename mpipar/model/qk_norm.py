"""Query/key normalisation (``qk_norm``, Qwen3's ``q_norm`` and ``k_norm``): an RMSNorm over
each head's ``head_dim`` features of the queries and of the keys, after the q/k projections and
before RoPE, with one weight of ``head_dim`` elements for all query heads and one for all key
heads.

The weights are ``layers.{i}.self_attn.q_norm.weight`` and ``...k_norm.weight`` ``[D]``
(Qwen3's names). Under tensor parallelism each tp rank holds both whole and applies them to its
own heads, so each rank's gradient is a partial sum over its heads: the placement table marks
them ``heads_replicated`` (:mod:`mpipar.parallel.placement`) and their gradients are summed
over tp. Under sequence parallelism each rank normalises its own tokens (the norm is per
token and head, so it needs no other rank); the gradient sum over dp x sp covers them.

Forward keeps the normalised tensors' inputs and their ``rstd`` (:class:`QKNormSaved`) for
backward; a recompute mode that drops them has the block rebuild them from the q/k
projections (:meth:`mpipar.model.llama.DecoderBlock.backward`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpipar.model.norms import norm_weight

Array = Any

Q_NORM, K_NORM = "self_attn.q_norm.weight", "self_attn.k_norm.weight"
"""The weights of block ``i`` (``layers.{i}.`` + these names), each ``[head_dim]``."""


@dataclass
class QKNormSaved:
    """What backward reads: the queries and keys before the norm (``[B, S, h, D]``) and their
    ``rstd`` ``[B, S, h]``."""

    q: Array
    rstd_q: Array
    k: Array
    rstd_k: Array


def qk_norm_fwd(kernels, params, i: int, q: Array, k: Array, eps: float,
                unit_offset: bool = False) -> tuple[Array, Array, QKNormSaved]:
    """Block ``i``'s normalised queries and keys ``(q', k', record)`` of ``q`` ``[B, S, hq,
    D]`` and ``k`` ``[B, S, hkv, D]`` (before RoPE); ``unit_offset``: the norms multiply by
    ``1 + w`` (:func:`mpipar.model.norms.norm_weight`)."""
    p = f"layers.{i}."
    qn, rstd_q = kernels.rmsnorm_fwd(q, norm_weight(params, p + Q_NORM, unit_offset), eps)
    kn, rstd_k = kernels.rmsnorm_fwd(k, norm_weight(params, p + K_NORM, unit_offset), eps)
    return qn, kn, QKNormSaved(q, rstd_q, k, rstd_k)


def qk_norm_bwd(kernels, params, grads, i: int, dq: Array, dk: Array, saved: QKNormSaved,
                unit_offset: bool = False) -> tuple[Array, Array]:
    """The gradients of :func:`qk_norm_fwd`'s inputs from those of its outputs; the weights'
    (this rank's heads' share) accumulated into ``grads``."""
    p = f"layers.{i}."
    dq, dwq = kernels.rmsnorm_bwd(dq, saved.q, norm_weight(params, p + Q_NORM, unit_offset),
                                  saved.rstd_q)
    dk, dwk = kernels.rmsnorm_bwd(dk, saved.k, norm_weight(params, p + K_NORM, unit_offset),
                                  saved.rstd_k)
    grads[p + Q_NORM] += dwq
    grads[p + K_NORM] += dwk
    return dq, dk
