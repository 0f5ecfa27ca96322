"""Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``) in Hugging Face
checkpoints: their attention read and written; :mod:`mpipar.checkpoint.huggingface` asks these
rules, and :mod:`mpipar.checkpoint.hf_moe` reads Qwen3-MoE's sparse blocks.

Qwen3's attention is a Llama's with an RMSNorm over each head's queries and keys before RoPE
(``model.layers.{i}.self_attn.q_norm.weight`` and ``k_norm.weight``, ``[head_dim]``: mpipar's
``qk_norm``, with the same tensor names) and a ``head_dim`` of its own (128 with hidden 1024 and
16 heads in Qwen3-0.6B): mpipar's ``head_dim``. Its ``attention_bias`` would give q, k, v *and*
o biases, which mpipar does not have, so it must be false (as in every released Qwen3); its
sliding window (``use_sliding_window``, ``layer_types``) is refused, as Qwen2's: mpipar reads
full causal attention on every layer.

Qwen3-MoE is Qwen3's attention with Qwen2-MoE's sparse blocks without their shared expert:
the router ``mlp.gate.weight`` and the experts ``mlp.experts.{e}.{gate,up,down}_proj.weight``
(the hub names of :func:`mpipar.checkpoint.hf_moe.hub_name`), softmax top ``num_experts_per_tok``
renormalised when ``norm_topk_prob`` is true (mpipar's ``moe_norm_topk``), ``decoder_sparse_step``
and ``mlp_only_layers`` naming the sparse layers (``moe_layers``), the dense layers' width
``intermediate_size`` and an expert's ``moe_intermediate_size``.

An export writes ``qwen3`` for a dense model with ``qk_norm`` and ``qwen3_moe`` for a mixture of
experts with it; a model with ``qk_norm`` and q/k/v biases, a sliding window or a shared expert
has no such form and is refused, naming the field. Functions raise ValueError naming the field;
the caller turns it into its error type.
"""
from __future__ import annotations

from typing import Any, Mapping

from mpipar.config import ModelConfig

QWEN3, QWEN3_MOE = "qwen3", "qwen3_moe"
KINDS = (QWEN3, QWEN3_MOE)
"""The ``model_type`` values of this family."""


def read_attention(raw: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(a reading, ModelConfig fields) of a Qwen3 or Qwen3-MoE attention: per-head q/k norms,
    no biases, full causal attention."""
    bias = raw.get("attention_bias", False)
    if bias is not False and bias is not None:
        raise ValueError(f"attention_bias={bias!r} is not supported for model_type "
                         f"{raw.get('model_type')!r}: it gives q, k, v and o projections "
                         f"biases, and mpipar's attention has none with qk_norm (must be false)")
    window = raw.get("use_sliding_window", False)
    if window is not False and window is not None:
        raise ValueError(f"use_sliding_window={window!r} is not supported; mpipar reads "
                         f"Qwen3's full causal attention (must be false)")
    check_layer_types(raw)
    return ("RMSNorm over each head's queries and keys before RoPE (Qwen3's q_norm, k_norm), "
            "no attention biases, full causal attention",
            {"attention_bias": False, "qk_norm": True})


def check_layer_types(raw: Mapping[str, Any]) -> None:
    """A Qwen config's ``layer_types`` (Qwen2's and Qwen3's alike), if given, names only
    ``full_attention`` layers; ValueError otherwise."""
    kinds = raw.get("layer_types") or []
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"layer_types={kinds!r} must be a list of strings")
    others = sorted(set(kinds) - {"full_attention"})
    if others:
        raise ValueError(f"layer_types {others} are not supported; mpipar's layers are all "
                         f"'full_attention'")


def export_problem(m: ModelConfig) -> str:
    """Why mpipar's model ``m`` with ``qk_norm`` has no Qwen3 or Qwen3-MoE form ('' if it has
    one)."""
    if m.attention_bias or m.sliding_window or m.moe_shared_ffn_hidden:
        return (f"model.qk_norm=True with attention_bias={m.attention_bias}, sliding_window="
                f"{m.sliding_window}, moe_shared_ffn_hidden={m.moe_shared_ffn_hidden}: a model "
                f"with qk_norm is exported as Qwen3ForCausalLM or Qwen3MoeForCausalLM, which "
                f"have no q/k/v biases, no sliding window and no shared expert (all must be "
                f"off)")
    return ""


def export_kind(m: ModelConfig) -> str:
    """The ``model_type`` of ``m`` (with ``qk_norm``): qwen3_moe with experts, else qwen3."""
    return QWEN3_MOE if m.moe_experts else QWEN3


def config_fields(m: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a Qwen3 or Qwen3-MoE beyond the Llama ones."""
    out: dict[str, Any] = {"attention_bias": False, "use_sliding_window": False,
                           "sliding_window": None, "max_window_layers": m.layers,
                           "layer_types": ["full_attention"] * m.layers}
    if m.moe_experts:
        out.update({"num_experts": m.moe_experts, "num_experts_per_tok": m.moe_top_k,
                    "moe_intermediate_size": m.moe_ffn_hidden,
                    "norm_topk_prob": m.moe_norm_topk, "decoder_sparse_step": 1,
                    "mlp_only_layers": [i for i in range(m.layers) if not m.is_sparse(i)],
                    "router_aux_loss_coef": 0.0, "output_router_logits": False})
    return out
