"""Gemma 3's text model (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``) in Hugging Face
checkpoints: its config read and written; :mod:`mpipar.checkpoint.huggingface` asks these rules.

What a Gemma 3 is in mpipar's fields:

- local and global layers: ``layer_types`` (or, in older configs, ``sliding_window_pattern``
  P: layer i is local unless (i + 1) % P == 0) name the ``sliding_attention`` layers, which
  attend within ``sliding_window``: mpipar's ``sliding_window`` and ``window_layers`` (a comma
  list of the local layers, or ``all``);
- RoPE: the global layers' base and scaling (``rope_parameters.full_attention`` in
  transformers 5.x, ``rope_theta`` and ``rope_scaling`` in 4.x) are mpipar's ``rope_theta`` and
  ``rope_type``...; the local layers' base (``rope_parameters.sliding_attention.rope_theta``,
  ``rope_local_base_freq``), unscaled, is ``rope_local_theta``;
- per-head q/k norms (``qk_norm``), four norms per block (``norm_placement`` ``sandwich``), every
  norm multiplying by 1 + w (``norm_unit_offset``), the embedding scaled by sqrt(hidden)
  (``embed_scale``), GeGLU with tanh GELU (``ffn_activation`` ``gelu_tanh``), the attention scale
  1/sqrt(``query_pre_attn_scalar``), tied embeddings by default;
- tensor names are transformers' (``model.layers.{i}.pre_feedforward_layernorm.weight``, ...).

Refused, naming the field: ``attn_logit_softcapping`` and ``final_logit_softcapping`` other than
null (Gemma 2's tanh soft-capping, which mpipar does not compute; Gemma 3 sets neither),
``use_bidirectional_attention``, ``attention_bias``, a scaled RoPE on the local layers, layer
types other than ``sliding_attention`` and ``full_attention``. The multimodal ``gemma3``
checkpoint (``Gemma3ForConditionalGeneration``) is not read: its text part must be saved as a
``gemma3_text`` model first.

An export writes ``gemma3_text`` for a model with the sandwich norms; a model with some of
Gemma's settings but not all (or with experts or q/k/v biases) has no such form and is refused,
naming the fields. Functions raise ValueError naming the field; the caller turns it into its
error type.
"""
from __future__ import annotations

from typing import Any, Mapping

from mpipar.config import ModelConfig
from mpipar.model.activation import GELU_TANH

GEMMA3_TEXT = "gemma3_text"

DEFAULTS: dict[str, Any] = {
    "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072, "rope_local_base_freq": 10000.0}
"""transformers' ``Gemma3TextConfig`` defaults of the fields mpipar reads (a config.json
written with ``use_diff`` may leave them out)."""
GLOBAL_THETA = 1_000_000.0
"""transformers' default RoPE base of Gemma 3's global layers."""

LOCAL, GLOBAL = "sliding_attention", "full_attention"


def with_defaults(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with transformers' Gemma 3 defaults for the fields it leaves out (a
    ``gemma3_text`` config; any other is returned as it is)."""
    if raw.get("model_type") != GEMMA3_TEXT:
        return dict(raw)
    out = {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None
                          or k not in ("tie_word_embeddings", "query_pre_attn_scalar")}}
    nested = out.get("rope_parameters")
    if not out.get("rope_scaling") and not (isinstance(nested, dict) and GLOBAL in nested) \
            and out.get("rope_theta") is None:
        out["rope_theta"] = GLOBAL_THETA
    return out


def global_rope(raw: Mapping[str, Any], params: Any) -> Any:
    """The RoPE parameters of a Gemma 3's global layers from ``rope_parameters`` (transformers
    5.x: one entry per layer type); ``params`` as they are for any other config."""
    if raw.get("model_type") != GEMMA3_TEXT or not isinstance(params, dict) or \
            GLOBAL not in params:
        return params
    full = params[GLOBAL] or {"rope_type": "default"}
    if not isinstance(full, dict):
        raise ValueError(f"rope_parameters.{GLOBAL}={full!r} must be an object")
    return full if "rope_theta" in full or raw.get("rope_theta") is not None else \
        {**full, "rope_theta": GLOBAL_THETA}


def local_layers(raw: Mapping[str, Any]) -> list[int]:
    """The ``sliding_attention`` layers of a Gemma 3 config (``layer_types``, else
    ``sliding_window_pattern``)."""
    layers = raw.get("num_hidden_layers")
    kinds = raw.get("layer_types")
    if kinds is None:
        pattern = raw.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"sliding_window_pattern={pattern!r} must be a positive integer")
        return [i for i in range(layers) if (i + 1) % pattern]
    if not isinstance(kinds, list) or len(kinds) != layers:
        raise ValueError(f"layer_types={kinds!r} must list one type per layer "
                         f"(num_hidden_layers={layers})")
    others = sorted(set(map(str, kinds)) - {LOCAL, GLOBAL})
    if others:
        raise ValueError(f"layer_types {others} are not supported; mpipar reads "
                         f"'{LOCAL}' and '{GLOBAL}'")
    return [i for i, kind in enumerate(kinds) if kind == LOCAL]


def _local_theta(raw: Mapping[str, Any]) -> float:
    """The local layers' RoPE base (unscaled): ``rope_parameters.sliding_attention``, else
    ``rope_local_base_freq``."""
    params = raw.get("rope_parameters")
    local = params.get(LOCAL) if isinstance(params, dict) else None
    if local is None:
        theta = raw.get("rope_local_base_freq")
    else:
        kind = local.get("rope_type", "default") if isinstance(local, dict) else local
        if kind != "default":
            raise ValueError(f"rope_parameters.{LOCAL}.rope_type={kind!r} is not supported; "
                             f"mpipar's local layers use plain RoPE ('default')")
        theta = local.get("rope_theta", raw.get("rope_local_base_freq"))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"the local layers' RoPE base (rope_local_base_freq)={theta!r} must be "
                         f"a positive number")
    return float(theta)


def read_attention(raw: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(a reading, ModelConfig fields) of a Gemma 3's attention and block structure."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(name) is not None:
            raise ValueError(f"{name}={raw[name]!r} is not supported; mpipar computes no logit "
                             f"soft-capping (Gemma 3 sets it to null)")
    for name in ("use_bidirectional_attention", "attention_bias"):
        if raw.get(name):
            raise ValueError(f"{name}={raw[name]!r} is not supported for model_type "
                             f"{GEMMA3_TEXT!r} (must be false)")
    scalar = raw.get("query_pre_attn_scalar")
    if isinstance(scalar, bool) or not isinstance(scalar, (int, float)) or not scalar > 0:
        raise ValueError(f"query_pre_attn_scalar={scalar!r} must be a positive number")
    local = local_layers(raw)
    window = raw.get("sliding_window")
    if local and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window={window!r} must be a positive integer (layers "
                         f"{local[:4]}... are sliding_attention)")
    theta = _local_theta(raw)
    fields: dict[str, Any] = {
        "attention_bias": False, "qk_norm": True, "norm_placement": "sandwich",
        "norm_unit_offset": True, "embed_scale": True, "query_pre_attn_scalar": float(scalar),
        "sliding_window": window if local else 0,
        "window_layers": ("all" if len(local) == raw.get("num_hidden_layers")
                          else ",".join(map(str, local)) or "all"),
        "rope_local_theta": theta if local else 0.0}
    return (f"Gemma 3: {len(local)} sliding-window layers of {window} positions (RoPE base "
            f"{theta:g}) among {raw.get('num_hidden_layers')}, q/k norms, four norms per block "
            f"scaled by 1 + w, embedding x sqrt(hidden), attention scale 1/sqrt({scalar:g})",
            fields)


def read_mlp(raw: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Gemma 3's MLP: GeGLU with ``hidden_activation`` gelu_pytorch_tanh."""
    act = raw.get("hidden_activation")
    if act not in GELU_TANH.hf_names:
        raise ValueError(f"hidden_activation={act!r} is not supported; mpipar's Gemma 3 MLP is "
                         f"GeGLU with {GELU_TANH.hf_names[0]!r}")
    return "GeGLU (gelu_pytorch_tanh), no biases", {"ffn_activation": GELU_TANH.name}


GEMMA_FIELDS = {"norm_placement": "sandwich", "norm_unit_offset": True, "embed_scale": True,
                "ffn_activation": GELU_TANH.name, "qk_norm": True}
"""What a Gemma 3 has (and any model with one of them must have all to be exported as one)."""


def is_gemma(m: ModelConfig) -> bool:
    """Whether ``m`` has any of Gemma's own settings (then it is exported as Gemma 3 or not at
    all)."""
    return (any(getattr(m, k) == v for k, v in GEMMA_FIELDS.items() if k != "qk_norm")
            or m.rope_local_theta > 0 or m.query_pre_attn_scalar > 0)


def export_problem(m: ModelConfig) -> str:
    """Why ``m`` (with one of Gemma's settings) has no Gemma 3 form ('' if it has one)."""
    wrong = {k: getattr(m, k) for k, v in GEMMA_FIELDS.items() if getattr(m, k) != v}
    if m.attention_bias:
        wrong["attention_bias"] = True
    if m.moe_experts:
        wrong["moe_experts"] = m.moe_experts
    if not wrong:
        return ""
    shown = ", ".join(f"model.{k}={v!r}" for k, v in wrong.items())
    return (f"{shown}: a model with Gemma's settings is exported as Gemma3ForCausalLM, which "
            f"needs {', '.join(f'{k}={v!r}' for k, v in GEMMA_FIELDS.items())}, no q/k/v biases "
            f"and no experts")


def _number(x: float) -> int | float:
    """``x`` as an int when it is one (transformers' Gemma 3 config types the scalar an int)."""
    return int(x) if float(x).is_integer() else x


def config_fields(m: ModelConfig, global_rope_params: Mapping[str, Any]) -> dict[str, Any]:
    """The config.json fields of a Gemma 3 beyond the Llama ones; ``global_rope_params``: the
    global layers' ``rope_parameters`` as a Llama's are written."""
    local = [m.layer_window(i) > 0 for i in range(m.layers)]
    local_theta = m.rope_local_theta or m.rope_theta
    local_rope = ({"rope_type": "default", "rope_theta": local_theta} if m.rope_local_theta
                  else dict(global_rope_params))
    return {"hidden_activation": GELU_TANH.hf_names[0],
            "query_pre_attn_scalar": _number(m.query_pre_attn_scalar or m.head_dim),
            "sliding_window": m.sliding_window or None,
            "layer_types": [LOCAL if x else GLOBAL for x in local],
            "rope_local_base_freq": local_theta,
            "rope_parameters": {GLOBAL: dict(global_rope_params), LOCAL: local_rope},
            "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "attention_bias": False, "use_bidirectional_attention": False}
