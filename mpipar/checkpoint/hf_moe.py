"""Mixtral (``MixtralForCausalLM``) in Hugging Face checkpoints: the config fields of its
sparse blocks, read and written; :mod:`mpipar.checkpoint.huggingface` asks these rules.

The hub layout is mpipar's own naming: ``model.layers.{i}.block_sparse_moe.gate.weight`` (the
router ``[E, H]``) and ``...experts.{e}.w1/w3/w2.weight`` (gate, up, down), so tensors map by
the ``model.`` prefix alone. Mixtral's blocks are all sparse; its ``intermediate_size`` is an
expert's width; the router is Mixtral's (softmax over every expert, top ``num_experts_per_tok``
renormalised). Its ``router_aux_loss_coef`` weighs Switch's load-balancing loss, not mpipar's
sequence-wise one: it is not read (``--moe-aux-loss-coef`` sets mpipar's) and written as 0.
Functions raise ValueError naming the field; the caller turns it into its error type.
"""
from __future__ import annotations

from typing import Any, Mapping

from mpipar.config import ModelConfig

MIXTRAL = "mixtral"


def _count(raw: Mapping[str, Any], name: str, default: int) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


def read_experts(raw: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(a reading, ModelConfig fields) of the FFN kind: dense, or Mixtral's experts."""
    if raw.get("model_type") != MIXTRAL:
        return "dense FFN", {}
    experts = _count(raw, "num_local_experts", 8)
    top_k = _count(raw, "num_experts_per_tok", 2)
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be <= num_local_experts={experts}")
    if raw.get("sliding_window") is not None:
        raise ValueError(f"sliding_window={raw['sliding_window']!r} is not supported for "
                         f"model_type 'mixtral' (mpipar reads null: full causal attention)")
    if raw.get("router_jitter_noise", 0.0) not in (0, 0.0):
        raise ValueError(f"router_jitter_noise={raw['router_jitter_noise']!r} is not supported "
                         f"(mpipar's router has no noise)")
    ffn = _count(raw, "intermediate_size", 14336)
    return (f"Mixtral experts: {experts} of width {ffn} on every layer, top {top_k}",
            {"moe_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden": ffn,
             "moe_layers": "all"})


def export_problem(m: ModelConfig) -> str:
    """Why mpipar's mixture-of-experts model ``m`` has no Mixtral form ('' if it has one)."""
    sparse = all(m.is_sparse(i) for i in range(m.layers))
    if sparse and not m.attention_bias and not m.sliding_window:
        return ""
    return (f"model.moe_layers={m.moe_layers!r}, attention_bias={m.attention_bias}, "
            f"sliding_window={m.sliding_window}: only every layer sparse, without attention "
            f"biases or window, can be exported (MixtralForCausalLM)")


def mixtral_fields(m: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a Mixtral (beyond the Llama ones)."""
    return {"intermediate_size": m.moe_ffn_hidden, "num_local_experts": m.moe_experts,
            "num_experts_per_tok": m.moe_top_k, "sliding_window": None,
            "router_aux_loss_coef": 0.0, "output_router_logits": False,
            "router_jitter_noise": 0.0}


def export_notes(model: Any, biases: Mapping[int, Any]) -> list[str]:
    """What an export to Mixtral says of the training settings Mixtral has no place for (none
    for a dense model or a plain MoE): the routing biases of auxiliary-loss-free balancing
    (``{sparse block: [E]}``) are dropped, as torchtitan drops a buffer its target lacks, and
    the exported model chooses experts by the probabilities alone; a capacity factor is not
    carried either: the exported model routes dropless (every token to its K experts)."""
    notes = []
    if biases:
        largest = max(float(abs(b).max()) for b in biases.values())
        notes.append(f"the routing biases of --moe-bias-update-rate ({len(biases)} sparse blocks, "
                     f"max |bias| {largest:.3g}) are not part of Mixtral and are not exported: "
                     f"the exported model chooses its experts by the router's probabilities alone")
    capacity = getattr(model, "moe_capacity_factor", 0.0)
    if capacity:
        notes.append(f"--moe-capacity-factor {capacity:g} is not part of Mixtral: the exported "
                     f"model routes every token to its {model.moe_top_k} experts (dropless)")
    return notes
