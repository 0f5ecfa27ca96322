"""FLOPs of the model: what the time model divides by the peak, and what MFU is measured against.

Forward FLOPs of a block count its matrix products (q, k, v, o; gate, up, down: two FLOPs a
multiply-add) and attention's ``q k^T`` and ``p v`` over the keys a query sees; a sparse
block's FFN counts its router and the ``K`` experts each token runs; backward is twice forward.
The multi-token prediction modules count their projection, block and LM head
(:func:`mtp_module_flops_per_token`). Attention's products use ``head_dim`` as configured (Qwen3's is not ``hidden / heads``); the
norms, Qwen3's per-head q/k norms (``qk_norm``) among them, are elementwise and not counted.
Latent attention counts its own projections (:func:`latent_projection_flops`) and ``p v`` over
``v_head_dim`` (the kernels' zero-padded value columns are not the model's work); Gemma 3's
local layers count the keys inside their window.
:func:`attention_flops` is the one count of attention's FLOPs, the model's and the benchmarks'.
"""
from __future__ import annotations

import numpy as np

from mpipar.config import Config, ModelConfig
from mpipar.model.attention import document_offsets
from mpipar.model.mtp import mtp_layers
from mpipar.layout import Layout


def attention_flops(batch: int, sq: float, sk: float, heads: int, head_dim: int,
                    causal: bool = False, value_dim: int = 0) -> tuple[float, float]:
    """(forward, backward) FLOPs of attention: ``batch`` x ``heads`` blocks of ``sq`` queries
    over ``sk`` keys, ``q k^T`` over ``head_dim`` and ``p v`` over ``value_dim`` (0: the
    same; latent attention's values are narrower) at two FLOPs a multiply-add (``4 B H Sq Sk
    D`` with equal widths), halved when ``causal`` over a square block (FlashAttention's
    count); backward 2.5 times forward (five GEMMs against two). One query over the mean keys
    a query sees (``sq`` 1, ``sk`` the context) is the model's count per token."""
    widths = head_dim + (value_dim or head_dim)
    fwd = 2.0 * batch * heads * widths * sq * sk * (0.5 if causal else 1.0)
    return fwd, 2.5 * fwd


def block_flops_per_token(model: ModelConfig, tp: int, context: float) -> float:
    """Forward FLOPs of one block of the resolved ``model`` for one token on one of ``tp``
    tensor-parallel ranks, attending to ``context`` keys."""
    H, D = model.hidden, model.head_dim
    hq, hkv, F = model.heads // tp, model.kv_heads // tp, model.ffn_hidden // tp
    if model.latent:
        return (latent_projection_flops(model, tp) + 2 * 3 * H * F
                + attention_flops(1, 1, context, hq, D, value_dim=model.value_dim)[0])
    matmul = 2 * H * (2 * hq * D + 2 * hkv * D) + 2 * 3 * H * F   # q, o, k, v; gate, up, down
    return matmul + attention_flops(1, 1, context, hq, D)[0]       # q k^T and p v


def latent_projection_flops(model: ModelConfig, tp: int) -> float:
    """Forward FLOPs of latent attention's linears for one token on one of ``tp`` ranks: the
    query's down- and up-projection (``H x r_q``, ``r_q x heads D``; without a query latent
    ``H x heads D``), the kv down-projection with the RoPE key (``H x (r_kv + d_r)``) and its
    up-projection (``r_kv x heads (D - d_r + d_v)``), and o (``heads d_v x H``). The
    down-projections are whole on every tp rank; the rest split by heads."""
    m, H, D = model, model.hidden, model.head_dim
    h, rq, r = m.heads // tp, m.latent_q_rank, m.latent_kv_rank
    query = H * rq + rq * h * D if rq else H * h * D
    kv = H * (r + m.rope_head_dim) + r * h * (D - m.rope_head_dim + m.value_dim)
    return 2.0 * (query + kv + h * m.value_dim * H)


def sparse_ffn_extra(model: ModelConfig) -> float:
    """Forward FLOPs per token a sparse block's FFN adds to the dense one's
    (:func:`block_flops_per_token` counts a dense FFN): the router (``H x E``) and ``K``
    experts of width ``moe_ffn_hidden`` and the shared expert of width
    ``moe_shared_ffn_hidden`` (and its gate, ``H x 1``) in place of gate, up and down of
    ``ffn_hidden``."""
    H = model.hidden
    return 2 * H * (model.moe_experts + model.moe_shared_gate) + 6 * H * (
        model.moe_top_k * model.moe_ffn_hidden + model.moe_shared_ffn_hidden - model.ffn_hidden)


def mtp_module_flops_per_token(model: ModelConfig, context: float) -> float:
    """Forward FLOPs of one multi-token prediction module (:mod:`mpipar.model.mtp`) per
    token: its projection ``[H, 2H]``, its (dense) block and the shared LM head. Every position
    of a row is counted, those past its last target too (the module runs them)."""
    H = model.hidden
    return 2 * H * 2 * H + block_flops_per_token(model, 1, context) + 2 * H * model.vocab_size


def window_context(seq_len: int, window: int) -> float:
    """Mean keys a query sees over a sequence: (S + 1) / 2 causal; with a sliding window W the
    query at position i sees min(i + 1, W)."""
    if window == 0 or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def document_context(docs: np.ndarray, window: int) -> float:
    """Mean keys a query sees in packed samples with document masking: ``docs [B, S]`` the
    document of each position (:func:`mpipar.model.attention.document_ids`); the query at
    offset j inside its document sees min(j + 1, W) keys (W = ``window``, 0: unlimited)."""
    docs = np.asarray(docs)
    if docs.size == 0:
        return 0.0
    keys = document_offsets(docs) + 1
    keys = keys if window == 0 else np.minimum(keys, window)
    return float(keys.mean())


def model_flops_per_step(cfg: Config | Layout, docs: np.ndarray | None = None) -> float:
    """Model FLOPs of one optimizer step of ``cfg`` (a configuration with a resolved model, or
    a Layout): forward + backward = 3 x forward, causal attention (a query at position i sees
    i + 1 keys, or min(i + 1, W) in a layer with a sliding window W), whatever the layout and
    recompute mode. With ``docs`` (the step's document ids ``[global batch, S]`` under
    ``--document-masking``) attention counts the keys each query sees inside its document
    (:func:`document_context`): the work done, not the full causal square."""
    m, tr = cfg.model, cfg.train
    context = ((lambda w: document_context(docs, w)) if docs is not None
               else (lambda w: window_context(tr.seq_len, w)))
    per_token = (sum(block_flops_per_token(m, 1, context(w)) for w in m.windows())
                 + 2 * m.hidden * m.vocab_size                     # LM head
                 + sum(map(m.is_sparse, range(m.layers))) * sparse_ffn_extra(m)
                 + sum(mtp_module_flops_per_token(m, context(m.layer_window(j)))
                       for j in mtp_layers(m)))
    return 3.0 * per_token * tr.global_batch_size * tr.seq_len
