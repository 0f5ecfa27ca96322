"""Mixtral (``MixtralForCausalLM``) and Qwen2-MoE (``Qwen2MoeForCausalLM``) in Hugging Face
checkpoints: the config fields of their sparse blocks, read and written, and Qwen2-MoE's tensor
names; :mod:`mpipar.checkpoint.huggingface` asks these rules.

The hub layout is mpipar's own naming: ``model.layers.{i}.block_sparse_moe.gate.weight`` (the
router ``[E, H]``) and ``...experts.{e}.w1/w3/w2.weight`` (gate, up, down), so tensors map by
the ``model.`` prefix alone. Mixtral's blocks are all sparse; its ``intermediate_size`` is an
expert's width; the router is Mixtral's (softmax over every expert, top ``num_experts_per_tok``
renormalised). Its ``router_aux_loss_coef`` weighs Switch's load-balancing loss, not mpipar's
sequence-wise one: it is not read (``--moe-aux-loss-coef`` sets mpipar's) and written as 0.

Qwen2-MoE's hub names its router ``model.layers.{i}.mlp.gate.weight`` and its experts
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (:func:`hub_name` maps mpipar's Mixtral
names to them); its shared expert (``mlp.shared_expert.*``, ``mlp.shared_expert_gate.weight``)
is mpipar's ``--moe-shared-ffn-hidden`` with ``--moe-shared-gate``. Its ``decoder_sparse_step``
and ``mlp_only_layers`` give ``moe_layers``; the dense blocks' width is ``intermediate_size``,
an expert's ``moe_intermediate_size``. Its ``norm_topk_prob`` (absent: false, transformers'
default) is ``moe_norm_topk``: true renormalises the top K weights (Mixtral's router), false
uses the K softmax probabilities as they are (Qwen1.5-MoE-A2.7B); an export writes it back. A
model without renormalisation has no Mixtral form; without a shared expert it has no Qwen2-MoE
one either (transformers' Qwen2-MoE block always has one): it is not exported.

Qwen3-MoE (``qwen3_moe``) has Qwen2-MoE's hub names, sparse layers and ``norm_topk_prob`` but no
shared expert (a ``shared_expert_intermediate_size`` is refused); transformers 5 writes its
``num_experts`` as ``num_local_experts`` (both read; they must agree). Its attention and export
are :mod:`mpipar.checkpoint.hf_qwen3`'s.
Functions raise ValueError naming the field; the caller turns it into its error type.
"""
from __future__ import annotations

from typing import Any, Mapping

from mpipar.config import ModelConfig

MIXTRAL = "mixtral"
QWEN2_MOE = "qwen2_moe"
QWEN3_MOE = "qwen3_moe"     # Qwen2-MoE's hub names and sparse layers, no shared expert
DEEPSEEK_V3 = "deepseek_v3"  # Qwen2-MoE's hub names of router and experts (hf_deepseek)
_QWEN_MOE = {QWEN2_MOE: dict(experts=60, top_k=4, ffn=1408, name="Qwen2-MoE"),
             QWEN3_MOE: dict(experts=128, top_k=8, ffn=768, name="Qwen3-MoE")}
"""transformers' defaults of the two Qwen mixtures of experts' fields."""
_QWEN2_MOE_NAMES = ((".block_sparse_moe.gate.", ".mlp.gate."),
                    (".block_sparse_moe.experts.", ".mlp.experts."),
                    (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


def hub_name(name: str, kind: str) -> str:
    """The hub's name of tensor ``name`` (mpipar's, ``model.``-prefixed) in a checkpoint of
    ``model_type`` ``kind``: Qwen2-MoE's for the router and the experts (DeepSeek-V3's too, whose
    shared expert is ``mlp.shared_experts``), else ``name``."""
    if kind == DEEPSEEK_V3:
        name = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
    elif not isinstance(kind, str) or kind not in _QWEN_MOE:
        return name
    if ".block_sparse_moe." not in name:
        return name
    for ours, theirs in _QWEN2_MOE_NAMES:
        name = name.replace(ours, theirs)
    return name


MAX_EXPERTS = 1 << 16
"""The most experts (and layers) a config.json of a mixture of experts may declare: far above
any published model (DeepSeek-V3: 256 routed experts), and small enough that what is sized by
it (router rows, tensor names, layer lists) is checked before anything is allocated."""


def _count(raw: Mapping[str, Any], name: str, default: int, limit: int | None = None) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    if limit is not None and value > limit:
        raise ValueError(f"{name}={value} must be at most {limit} (mpipar's bound on a mixture "
                         f"of experts, far above any published model)")
    return value


def read_experts(raw: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(a reading, ModelConfig fields) of the FFN kind: dense, Mixtral's or Qwen2-MoE's
    experts."""
    kind = raw.get("model_type")
    if isinstance(kind, str) and kind in _QWEN_MOE:    # a wrong type: the architecture's error
        return _read_qwen_moe(raw, kind)
    if raw.get("model_type") != MIXTRAL:
        return "dense FFN", {}
    experts = _count(raw, "num_local_experts", 8, MAX_EXPERTS)
    top_k = _count(raw, "num_experts_per_tok", 2, MAX_EXPERTS)
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be <= num_local_experts={experts}")
    if raw.get("sliding_window") is not None:
        raise ValueError(f"sliding_window={raw['sliding_window']!r} is not supported for "
                         f"model_type 'mixtral' (mpipar reads null: full causal attention)")
    if raw.get("router_jitter_noise", 0.0) not in (0, 0.0):
        raise ValueError(f"router_jitter_noise={raw['router_jitter_noise']!r} is not supported "
                         f"(mpipar's router has no noise)")
    ffn = _count(raw, "intermediate_size", 14336)
    return (f"Mixtral experts: {experts} of width {ffn} on every layer, top {top_k} "
            f"renormalised",
            {"moe_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden": ffn,
             "moe_layers": "all"})


def _read_qwen_moe(raw: Mapping[str, Any], kind: str) -> tuple[str, dict[str, Any]]:
    """Qwen2-MoE's or Qwen3-MoE's sparse blocks (transformers' defaults for absent fields)."""
    default = _QWEN_MOE[kind]
    experts = _count(raw, "num_experts", default["experts"], MAX_EXPERTS)
    if kind == QWEN3_MOE and "num_local_experts" in raw:   # transformers 5 writes this name
        local = _count(raw, "num_local_experts", experts, MAX_EXPERTS)
        if "num_experts" in raw and local != experts:
            raise ValueError(f"num_local_experts={local} contradicts num_experts={experts} "
                             f"(two names of one field: they must be equal)")
        experts = local
    top_k = _count(raw, "num_experts_per_tok", default["top_k"], MAX_EXPERTS)
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be <= num_experts={experts}")
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"norm_topk_prob={norm!r} must be true or false")
    layers = _count(raw, "num_hidden_layers", 24, MAX_EXPERTS)
    step = _count(raw, "decoder_sparse_step", 1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise ValueError(f"mlp_only_layers={dense!r} must be a list of layer indices")
    sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if not sparse:
        raise ValueError(f"decoder_sparse_step={step}, mlp_only_layers={dense}: no sparse layer")
    ffn = _count(raw, "moe_intermediate_size", default["ffn"])
    spec = "all" if len(sparse) == layers else ",".join(map(str, sparse))
    fields = {"moe_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden": ffn,
              "moe_layers": spec, "moe_norm_topk": norm}
    reading = (f"{default['name']} experts: {experts} of width {ffn} on layers {spec}, top "
               f"{top_k} {'renormalised' if norm else 'not renormalised (norm_topk_prob false)'}")
    if kind == QWEN3_MOE:
        if raw.get("shared_expert_intermediate_size") is not None:
            raise ValueError(f"shared_expert_intermediate_size="
                             f"{raw['shared_expert_intermediate_size']!r} is not supported for "
                             f"model_type 'qwen3_moe', which has no shared expert (must be "
                             f"absent)")
        return reading + ", no shared expert", fields
    shared = _count(raw, "shared_expert_intermediate_size", 5632)
    return (reading + f", a gated shared expert of width {shared}",
            {**fields, "moe_shared_ffn_hidden": shared, "moe_shared_gate": True})


def export_kind(m: ModelConfig) -> str:
    """The ``model_type`` mpipar's mixture of experts ``m`` is written as (its problem:
    :func:`export_problem`): Qwen2-MoE with a shared expert, else Mixtral."""
    return QWEN2_MOE if m.moe_shared_ffn_hidden else MIXTRAL


def export_problem(m: ModelConfig) -> str:
    """Why mpipar's mixture-of-experts model ``m`` has no Mixtral form ('' if it has one)."""
    if m.moe_shared_ffn_hidden:
        if m.moe_shared_gate and not m.sliding_window:
            return ""
        return (f"model.moe_shared_ffn_hidden={m.moe_shared_ffn_hidden}, moe_shared_gate="
                f"{m.moe_shared_gate}, sliding_window={m.sliding_window}: a shared expert is "
                f"exported as Qwen2MoeForCausalLM's, which is gated (--moe-shared-gate), "
                f"without window (MixtralForCausalLM has no shared expert)")
    if not m.moe_norm_topk:
        return ("model.moe_norm_topk=False (--no-moe-norm-topk) without a shared expert: "
                "MixtralForCausalLM renormalises the top K router weights, and Qwen2MoeForCausalLM"
                " (norm_topk_prob false) always has a shared expert (--moe-shared-ffn-hidden with "
                "--moe-shared-gate)")
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


def qwen2_moe_fields(m: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a Qwen2-MoE (beyond the Llama ones)."""
    return {"num_experts": m.moe_experts, "num_experts_per_tok": m.moe_top_k,
            "moe_intermediate_size": m.moe_ffn_hidden,
            "shared_expert_intermediate_size": m.moe_shared_ffn_hidden,
            "norm_topk_prob": m.moe_norm_topk,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(m.layers) if not m.is_sparse(i)],
            "qkv_bias": m.attention_bias, "use_sliding_window": False, "sliding_window": None,
            "router_aux_loss_coef": 0.0, "output_router_logits": False}


def export_notes(model: Any, biases: Mapping[int, Any]) -> list[str]:
    """What an export to Mixtral (or Qwen2-MoE) says of the training settings it has no place
    for (none for a dense model or a plain MoE): the routing biases of auxiliary-loss-free balancing
    (``{sparse block: [E]}``) are dropped, as torchtitan drops a buffer its target lacks, and
    the exported model chooses experts by the probabilities alone; a capacity factor is not
    carried either: the exported model routes dropless (every token to its K experts)."""
    notes, target = [], "Qwen2-MoE" if getattr(model, "moe_shared_ffn_hidden", 0) else "Mixtral"
    if getattr(model, "latent_kv_rank", 0):     # DeepSeek-V3: e_score_correction_bias
        target, biases = "DeepSeek-V3", {}
    if biases:
        largest = max(float(abs(b).max()) for b in biases.values())
        notes.append(f"the routing biases of --moe-bias-update-rate ({len(biases)} sparse blocks, "
                     f"max |bias| {largest:.3g}) are not part of {target} and are not exported: "
                     f"the exported model chooses its experts by the router's probabilities alone")
    capacity = getattr(model, "moe_capacity_factor", 0.0)
    if capacity:
        notes.append(f"--moe-capacity-factor {capacity:g} is not part of {target}: the exported "
                     f"model routes every token to its {model.moe_top_k} experts (dropless)")
    return notes
