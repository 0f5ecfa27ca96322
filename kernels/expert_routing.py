"""Expert routing kernels of a mixture-of-experts block: the router's softmax and top-k (or
DeepSeek-V3's sigmoid scores and grouped top-k), the token permutation by expert and its inverse, the capacity's counts and keep mask. (The
experts' grouped SwiGLU GEMMs, one per weight and expert and part of its rows, are
:func:`mpipar.model.moe.experts_fwd`'s: they go through a kernel backend's
``linear_fwd``/``swiglu_fwd`` and overlap the ep exchange.)

Array-module generic (NumPy or CuPy arrays; ``xp`` is the arrays' module): every backend's
``routing`` (:class:`mpipar.kernels.Backend`) is this module. No MPI.

Shapes: ``N`` tokens, ``H`` hidden, ``E`` experts, ``K`` experts per token, ``A = N*K``
assignments (token ``n``'s ``k``-th choice is assignment ``n*K + k``), ``F`` expert width.
"""
from __future__ import annotations

from typing import Any

import numpy as np

Array = Any


def softmax(logits: Array, xp) -> Array:
    """Row softmax of ``logits`` ``[N, E]`` (max subtracted)."""
    z = logits - logits.max(axis=-1, keepdims=True)
    e = xp.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_bwd(dp: Array, p: Array) -> Array:
    """Gradient of the logits from that of the softmax ``p`` ``[N, E]``."""
    return p * (dp - (dp * p).sum(axis=-1, keepdims=True))


def sigmoid(logits: Array, xp) -> Array:
    """Elementwise ``1 / (1 + exp(-logits))`` ``[N, E]`` (DeepSeek-V3's router scores)."""
    return 1.0 / (1.0 + xp.exp(-logits))


def sigmoid_bwd(ds: Array, s: Array) -> Array:
    """Gradient of the logits from that of the sigmoid ``s`` ``[N, E]``."""
    return ds * s * (1.0 - s)


def grouped_choice(score: Array, k: int, groups: int, topk_groups: int, xp) -> Array:
    """DeepSeek-V3's choice of experts: the ``E`` experts cut into ``groups`` consecutive groups,
    each group scored by the sum of its two largest ``score``s, and each token's ``k`` experts
    the largest scores within its ``topk_groups`` best groups. score ``[N, E]`` -> experts
    ``[N, K]`` int64, largest first (ties: the lower index)."""
    n, E = score.shape
    per = score.reshape(n, groups, E // groups)
    best2 = -xp.sort(-per, axis=-1)[..., :2]
    group_score = best2.sum(axis=-1)                                     # [N, groups]
    chosen = xp.argsort(-group_score, axis=-1, kind="stable")[:, :topk_groups]
    mask = xp.zeros((n, groups), dtype=bool)
    xp.put_along_axis(mask, chosen, True, axis=-1)
    masked = xp.where(xp.repeat(mask, E // groups, axis=-1), score, -xp.inf)
    return xp.argsort(-masked, axis=-1, kind="stable")[:, :k].astype(xp.int64)


def route_topk(probs: Array, k: int, xp, bias: Array | None = None, normalize: bool = True
               ) -> tuple[Array, Array]:
    """Mixtral's routing: the ``k`` most probable experts of each token and their weights
    renormalised to sum to 1. probs ``[N, E]`` -> (experts ``[N, K]`` int64, most probable
    first (ties: the lower index), weights ``[N, K]``). ``bias`` ``[E]`` (DeepSeek-V3's
    auxiliary-loss-free routing): the experts with the largest ``probs + bias`` are chosen, their
    weights still the *unbiased* probabilities renormalised. ``normalize`` False (Qwen2-MoE's
    ``norm_topk_prob: false``): the weights are the chosen probabilities as they are."""
    score = probs if bias is None else probs + bias
    order = xp.argsort(-score, axis=-1, kind="stable")[:, :k]
    chosen = xp.take_along_axis(probs, order, axis=-1)
    if normalize:
        chosen = chosen / chosen.sum(axis=-1, keepdims=True)
    return order.astype(xp.int64), chosen


def route_topk_bwd(dweights: Array, weights: Array, chosen_sum: Array | None, experts: Array,
                   num_experts: int, xp, scale: float = 1.0) -> Array:
    """Gradient of the probabilities ``[N, E]`` from that of the weights ``[N, K]``: the
    renormalised ones (``weights = scale * p_chosen / chosen_sum``, ``chosen_sum`` ``[N, 1]``),
    or with ``chosen_sum`` None the chosen probabilities as they are (``weights = scale *
    p_chosen``: the gradient passes through, times ``scale``)."""
    if chosen_sum is None:
        dchosen = dweights * scale
    else:
        dchosen = (dweights * scale - (dweights * weights).sum(axis=-1, keepdims=True)
                   ) / chosen_sum
    dp = xp.zeros((weights.shape[0], num_experts), dtype=dweights.dtype)
    xp.put_along_axis(dp, experts, dchosen, axis=-1)
    return dp


def permutation(experts: Array, num_experts: int, xp, keep: Array | None = None
                ) -> tuple[Array, Array]:
    """The assignments ``[A]`` sorted by expert (stable: token order within an expert) and the
    count of each expert ``[E]`` (int64). ``experts`` ``[N, K]``; ``keep`` ``[N, K]`` bool
    (capacity): only the kept assignments, ``[A_kept]`` (the dropped ones sort last, as an
    expert ``E``, and are cut off)."""
    flat = experts.reshape(-1)
    if keep is not None:
        flat = xp.where(keep.reshape(-1), flat, num_experts)
    order = xp.argsort(flat, kind="stable")
    counts = xp.bincount(flat, minlength=num_experts + 1)[:num_experts].astype(xp.int64)
    return (order if keep is None else order[:int(counts.sum())]), counts


def permute(x: Array, order: Array, k: int) -> Array:
    """The tokens of the assignments ``order`` ``[A]``: rows ``order // k`` of ``x`` ``[N, H]``
    -> ``[A, H]`` grouped by expert."""
    return x[order // k]


def _scatter(rows: Array, order: Array, n: int, k: int, xp) -> Array:
    """``rows`` ``[A', H]`` (in ``order``) back in assignment order ``[N*K, H]``; the
    assignments ``order`` leaves out (dropped by capacity) zero."""
    if len(order) == n * k:
        per = xp.empty_like(rows)
    else:
        per = xp.zeros((n * k,) + rows.shape[1:], rows.dtype)
    per[order] = rows
    return per


def unpermute_combine(ys: Array, order: Array, weights: Array, xp) -> Array:
    """The layer's output ``[N, H]``: each token's sum of its experts' outputs ``ys`` ``[A, H]``
    (in ``order``) weighted by ``weights`` ``[N, K]``; also returns the outputs in assignment
    order ``[N, K, H]`` (backward needs them). An assignment ``order`` leaves out (dropped by
    capacity) has output 0: it adds nothing, its weight is not given to the others."""
    n, k = weights.shape
    per = _scatter(ys, order, n, k, xp)
    per = per.reshape(n, k, -1)
    return (per * weights[..., None]).sum(axis=1), per


def unpermute_sum(dxs: Array, order: Array, n: int, k: int, xp) -> Array:
    """Inverse of :func:`permute` for gradients: ``dxs`` ``[A, H]`` (in ``order``) summed into
    the tokens ``[N, H]`` (the assignments ``order`` leaves out add nothing)."""
    per = _scatter(dxs, order, n, k, xp)
    return per.reshape(n, k, -1).sum(axis=1)


def host(a: Array) -> np.ndarray:
    """``a`` as a NumPy array (a CuPy array copied to the host)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def block_counts(experts: Array, blocks: Array, num_blocks: int, num_experts: int, xp) -> Array:
    """Assignments of each position block, row and expert ``[G, B, E]`` (float64 counts):
    ``experts`` ``[B, S, K]`` the choices of ``B`` rows of ``S`` tokens, ``blocks`` ``[S]``
    (int64) the position block of each token, ``G`` blocks."""
    B, S, k = experts.shape
    E = num_experts
    key = (blocks[None, :, None] * B + xp.arange(B)[:, None, None]) * E + experts
    return xp.bincount(key.reshape(-1), minlength=num_blocks * B * E).astype(
        xp.float64).reshape(num_blocks, B, E)


def capacity_keep(experts: Array, positions: Array, blocks: Array, local: Array, whole: Array,
                  cap: int, xp) -> Array:
    """Which assignments a per-sequence expert capacity keeps ``[B, S, K]`` (bool): in each row
    and expert, the first ``cap`` in order of (position, slot) of the *whole* row. ``experts``
    ``[B, S, K]`` this rank's tokens' choices at global ``positions`` ``[S]`` (int64, any
    order), ``blocks`` ``[S]`` their position blocks; ``local`` ``[G, B, E]`` this rank's
    assignments per block (:func:`block_counts`), ``whole`` the same summed over the ranks
    holding the rows' other blocks. An assignment's rank in its (row, expert) is the whole
    rows' assignments in earlier blocks plus this rank's earlier ones in the same block."""
    B, S, k = experts.shape
    E = whole.shape[-1]
    by_pos = xp.argsort(positions, kind="stable")
    seq = experts[:, by_pos, :]                                   # [B, S, K], position order
    key = (xp.arange(B)[:, None, None] * E + seq).reshape(-1)     # (row, expert) of each
    order = xp.argsort(key, kind="stable")                        # by (row, expert, pos, slot)
    starts = xp.cumsum(xp.bincount(key, minlength=B * E)) - xp.bincount(key, minlength=B * E)
    rank = xp.empty_like(key)
    rank[order] = xp.arange(key.size) - starts[key[order]]
    # ``rank`` counts this rank's earlier assignments in earlier blocks too: swap those for
    # the whole rows' (``whole``'s exclusive prefix over blocks less ``local``'s)
    before = (xp.cumsum(whole, axis=0) - whole) - (xp.cumsum(local, axis=0) - local)
    shift = before[blocks[by_pos][None, :, None], xp.arange(B)[:, None, None], seq]
    keep = xp.empty(experts.shape, dtype=bool)
    keep[:, by_pos, :] = (rank.reshape(B, S, k) + shift.astype(rank.dtype)) < cap
    return keep
