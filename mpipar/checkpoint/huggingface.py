"""Hugging Face Llama, Qwen2, Qwen3 and Mistral checkpoints in and out: ``config.json`` +
safetensors (the mixtures of experts' fields: :mod:`mpipar.checkpoint.hf_moe`).

A Hugging Face directory holds ``config.json`` and the weights, either in one
``model.safetensors`` or in shards listed by ``model.safetensors.index.json``. Tensor names are
mpipar's parameter names with a ``model.`` prefix (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``model.norm.weight``), except the head,
``lm_head.weight``, which has none. Matrices are ``[out, in]`` in both. Both sides apply RoPE
in the rotate-half convention (pairs ``(i, i + head_dim/2)``), so q/k projections map without
any permutation; grouped-query heads are the ``kv_heads`` row blocks of k/v in both.

    python -m mpipar.hf inspect DIR      # what of the checkpoint mpipar supports, field by field
    python -m mpipar.hf convert SRC DST [--dtype float16|float32|float64]

What mpipar reads (:func:`support`): ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (whose q, k
and v projections have biases: mpipar's ``attention_bias``) and ``MistralForCausalLM`` (whose
``sliding_window`` is mpipar's, on every layer), ``Qwen3ForCausalLM`` and
``Qwen3MoeForCausalLM`` (per-head q/k norms: mpipar's ``qk_norm``,
:mod:`mpipar.checkpoint.hf_qwen3`), ``Gemma3ForCausalLM`` (:mod:`mpipar.checkpoint.hf_gemma3`),
Mixtral and Qwen2-MoE; RoPE scaling of ``rope_type``
``default``, ``linear``, ``dynamic``, ``llama3`` and ``yarn`` (:mod:`mpipar.checkpoint.hf_rope`;
``rope_scaling`` in transformers 4.x,
``rope_parameters`` in 5.x); tied embeddings (``tie_word_embeddings: true``), kept as one
parameter, or untied on request (the LM head then starts as a copy of the embedding and trains
apart). What is refused, with the field named: another architecture or ``model_type``, the other
RoPE types (longrope, ...), ``partial_rotary_factor`` below 1, Llama's
``attention_bias`` (it adds an o_proj bias mpipar does not have) and ``mlp_bias``, Qwen2's sliding
window, a ``hidden_act`` other than SiLU, missing or unexpected tensors, and shapes that disagree
with the config. An export writes ``Qwen2ForCausalLM`` for a model with attention biases,
``MistralForCausalLM`` for one with a sliding window on every layer, ``Qwen3ForCausalLM``
(``Qwen3MoeForCausalLM`` with experts) for one with ``qk_norm``, ``Gemma3ForCausalLM`` for one
with Gemma's settings, and ``LlamaForCausalLM``
otherwise, tied or not as the model is.

A directory may come from elsewhere: every config.json field is checked for its type and range
(a wrong one is refused naming it), the shard files an index lists must be relative paths
inside the directory (:func:`weight_files`), and tensors are checked from the safetensors
headers before any is read (:func:`check_tensors`).

bfloat16 tensors: safetensors' NumPy API has no bfloat16, so they are read from the file's raw
bytes and widened exactly to float32 (a bfloat16 is the upper 16 bits of a float32), and an
export in bfloat16 (``ml_dtypes.bfloat16`` arrays) writes the file's format itself
(:mod:`mpipar.checkpoint.safetensors_format`). Other tensors keep the file's dtype unless a
dtype is asked for.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from mpipar.checkpoint import hf_deepseek, hf_gemma3, hf_moe, hf_qwen3, hf_rope
from mpipar.checkpoint.export_dir import publish
from mpipar.checkpoint.hf_families import ARCHITECTURES, MAX_POSITIONS
from mpipar.checkpoint.safetensors_format import read_header, write_safetensors
from mpipar.config import ConfigError, ModelConfig
from mpipar.model.mtp import all_blocks
from mpipar.model.params import EMBED, HEAD, param_specs
from mpipar.model.rope import ROPE_TYPES, RopeScaling
from mpipar.layout import model_from_checkpoint, resolve_model
from mpipar.runtime.precision import numpy_dtype

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

SAVE_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""dtypes :func:`save_hf` writes and :func:`load_hf` casts to."""

PASSTHROUGH_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
"""config.json fields that do not change the computation but that an export should carry over."""

DEFAULT_MAX_POSITIONS = 4096
"""``max_position_embeddings`` written when the caller gives none (mpipar's RoPE has no limit)."""

# Non-persistent RoPE buffers that old transformers versions wrote into checkpoints.
_IGNORED_SUFFIX = ".self_attn.rotary_emb.inv_freq"
_ACTIVATIONS = ("silu", "swish")  # transformers maps both names to SiLU
_HF_FIELD = {  # mpipar ModelConfig field -> config.json field
    "vocab_size": "vocab_size", "hidden": "hidden_size", "layers": "num_hidden_layers",
    "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "ffn_hidden": "intermediate_size", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
    "init_std": "initializer_range", "rope_type": "rope_scaling.rope_type",
    "rope_factor": "rope_scaling.factor", "rope_low_freq_factor": "rope_scaling.low_freq_factor",
    "rope_high_freq_factor": "rope_scaling.high_freq_factor",
    "rope_original_max_positions": "rope_scaling.original_max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings", "attention_bias": "model_type (qwen2: q/k/v biases)",
    "sliding_window": "sliding_window (mistral)", "moe_norm_topk": "norm_topk_prob",
    "qk_norm": "model_type (qwen3: q_norm, k_norm)",
    "norm_placement": "model_type (gemma3_text: four norms per block)",
    "norm_unit_offset": "model_type (gemma3_text: norms scaled by 1 + w)",
    "embed_scale": "model_type (gemma3_text: embedding x sqrt(hidden))",
    "ffn_activation": "hidden_activation", "query_pre_attn_scalar": "query_pre_attn_scalar",
    "rope_local_theta": "rope_local_base_freq", "window_layers": "layer_types"}
_NUMPY_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


class HFCheckpointError(ConfigError):
    """A Hugging Face directory mpipar cannot use; the message names the file, field or tensor."""


# ----------------------------------------------------------------------------------- names
def hf_name(name: str, kind: str = "llama") -> str:
    """Hugging Face tensor name of mpipar parameter ``name`` in a ``model_type`` ``kind``."""
    return name if name == HEAD else hf_moe.hub_name("model." + name, kind)


def mpipar_name(name: str) -> str:
    """mpipar parameter name of Hugging Face tensor ``name`` (inverse of :func:`hf_name`)."""
    return name if name == HEAD else name.removeprefix("model.")


# ---------------------------------------------------------------------------------- config
def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of directory ``path``."""
    file = Path(path) / CONFIG_FILE
    if not Path(path).is_dir():
        raise HFCheckpointError(f"{path}: not a directory (a Hugging Face model directory holds "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    if file.exists() and not file.is_file():
        raise HFCheckpointError(f"{file}: not a regular file")
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise HFCheckpointError(f"{file}: file not found") from None
    except (OSError, ValueError) as exc:
        raise HFCheckpointError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise HFCheckpointError(f"{file}: must hold a JSON object")
    return raw


Reading = tuple[str, dict[str, Any]]
"""What a config rule makes of its fields: a description, and the ModelConfig fields it sets."""


def _architecture(raw: Mapping[str, Any]) -> Reading:
    """``model_type`` and ``architectures``: a Llama, Qwen2 or Mistral causal LM."""
    kind = raw.get("model_type", "llama")
    if not isinstance(kind, str) or kind not in ARCHITECTURES:
        raise HFCheckpointError(f"model_type={kind!r} is not supported; mpipar reads "
                                f"{', '.join(map(repr, ARCHITECTURES))}")
    archs = raw.get("architectures")
    if archs is not None and archs != [ARCHITECTURES[kind]]:
        raise HFCheckpointError(f"architectures={archs!r} is not supported for model_type "
                                f"{kind!r}; mpipar reads and writes [{ARCHITECTURES[kind]!r}]")
    return ARCHITECTURES[kind], {}


def _attention(raw: Mapping[str, Any]) -> Reading:
    """Attention biases and window: Qwen2's q/k/v biases over the whole causal context; a Llama
    without biases; Qwen3's per-head q/k norms (:mod:`mpipar.checkpoint.hf_qwen3`)."""
    if raw.get("model_type") in hf_qwen3.KINDS:
        return _moe(hf_qwen3.read_attention, raw)
    if raw.get("model_type") == hf_deepseek.KIND:
        return _moe(hf_deepseek.read_attention, raw)
    if raw.get("model_type") == hf_gemma3.GEMMA3_TEXT:
        return _moe(hf_gemma3.read_attention, raw)
    if raw.get("model_type", "llama") in ("qwen2", hf_moe.QWEN2_MOE):
        if _flag(raw, "use_sliding_window"):
            raise HFCheckpointError("use_sliding_window=true is not supported; mpipar attends "
                                    "to the whole causal context")
        _moe(hf_qwen3.check_layer_types, raw)
        bias = raw.get("model_type") == "qwen2" or raw.get("qkv_bias", True) is True
        return (f"q, k and v projections {'with' if bias else 'without'} biases (Qwen2), full "
                f"causal attention"), {"attention_bias": bias}
    if raw.get("model_type", "llama") == "mistral":
        window = raw.get("sliding_window")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                                   or window < 1):
            raise HFCheckpointError(f"sliding_window={window!r}: must be a positive integer or "
                                    f"null")
        if raw.get("layer_types"):
            raise HFCheckpointError(f"layer_types={raw['layer_types']!r} is not supported for "
                                    f"model_type 'mistral' (every layer uses sliding_window)")
        if not window:
            return "no attention biases, full causal attention (Mistral)", {"sliding_window": 0}
        return (f"no attention biases, a sliding window of {window} positions on every layer "
                f"(Mistral)", {"sliding_window": window, "window_layers": "all"})
    if _flag(raw, "attention_bias"):
        raise HFCheckpointError("attention_bias=true is not supported: in LlamaForCausalLM it "
                                "also gives o_proj a bias, which mpipar does not have (its "
                                "attention biases are Qwen2's: q, k and v)")
    return "no attention biases", {"attention_bias": False}


def _mlp(raw: Mapping[str, Any]) -> Reading:
    """The MLP: SwiGLU with SiLU (Gemma 3: GeGLU), no biases."""
    if _flag(raw, "mlp_bias"):
        raise HFCheckpointError(f"mlp_bias={raw['mlp_bias']!r} is not supported; mpipar's MLP "
                                f"has no biases")
    if raw.get("model_type") == hf_gemma3.GEMMA3_TEXT:
        return _moe(hf_gemma3.read_mlp, raw)
    act = raw.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise HFCheckpointError(f"hidden_act={act!r} is not supported; mpipar's MLP is SwiGLU "
                                f"with 'silu'")
    return "SwiGLU (silu), no biases", {}


def _moe(rule, arg):
    """A rule of :mod:`mpipar.checkpoint.hf_moe` or :mod:`mpipar.checkpoint.hf_qwen3`, its
    ValueError as an HFCheckpointError."""
    try:
        return rule(arg)
    except ValueError as exc:
        raise HFCheckpointError(str(exc)) from None


def _positive(value: Any) -> bool:
    """Whether ``value`` is a finite number above 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:  # an integer beyond float's range
        return False


def _number(params: Mapping[str, Any], name: str, where: str, default: Any = None) -> float:
    value = params.get(name, default)
    if value is None:
        raise HFCheckpointError(f"{where}.{name} is missing")
    if not _positive(value):
        raise HFCheckpointError(f"{where}.{name}={value!r} must be a positive number")
    return float(value)


def _rope(raw: Mapping[str, Any]) -> Reading:
    """RoPE theta and scaling from either config style, refusing types mpipar does not implement.

    transformers 4.x: ``rope_theta`` at top level, scaling in ``rope_scaling`` (None = plain RoPE).
    transformers 5.x: ``rope_parameters = {"rope_type": ..., "rope_theta": ...}``. As in
    transformers, a non-empty ``rope_scaling`` takes precedence over ``rope_parameters``; llama3's
    ``original_max_position_embeddings`` is a top-level field if there is one, else the scaling's,
    else ``max_position_embeddings``; dynamic scaling starts beyond ``max_position_embeddings``.
    """
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = _moe(lambda r: hf_gemma3.global_rope(r, r.get(field)), raw) or {}
    if not isinstance(params, dict):
        raise HFCheckpointError(f"{field}={params!r} must be an object or null")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HFCheckpointError(f"{field}.rope_type={kind!r} is not supported; mpipar "
                                f"implements {', '.join(map(repr, ROPE_TYPES))}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise HFCheckpointError(f"partial_rotary_factor={partial!r} is not supported; mpipar "
                                f"rotates the whole head (1.0)")
    top, inner = raw.get("rope_theta"), params.get("rope_theta")
    for name, value in (("rope_theta", top), (f"{field}.rope_theta", inner)):
        if value is not None and not _positive(value):
            raise HFCheckpointError(f"{name}={value!r} must be a positive number")
    if top is not None and inner is not None and float(top) != float(inner):
        raise HFCheckpointError(f"rope_theta={top!r} contradicts {field}.rope_theta={inner!r}")
    theta = float(inner if inner is not None else top if top is not None else 10000.0)
    out: dict[str, Any] = {"rope_theta": theta, "rope_type": kind}
    rope = RopeScaling.named(kind)
    if not rope.scales:
        return f"plain RoPE, theta {theta:g}", out
    out["rope_factor"] = _number(params, "factor", field)
    if not rope.pretraining_context:
        return f"{kind} RoPE scaling, factor {out['rope_factor']:g}, theta {theta:g}", out
    model = raw.get("model_type", "llama")  # an unknown one is the architecture rule's error
    positions = raw.get("max_position_embeddings") or MAX_POSITIONS.get(
        model if isinstance(model, str) else "llama", MAX_POSITIONS["llama"])
    if rope.frequency_band:
        positions = raw.get("original_max_position_embeddings",
                            params.get("original_max_position_embeddings", positions))
        out["rope_low_freq_factor"] = _number(params, "low_freq_factor", field)
        out["rope_high_freq_factor"] = _number(params, "high_freq_factor", field)
        if not out["rope_low_freq_factor"] < out["rope_high_freq_factor"]:
            raise HFCheckpointError(f"{field}.low_freq_factor={out['rope_low_freq_factor']!r} "
                                    f"must be below high_freq_factor="
                                    f"{out['rope_high_freq_factor']!r}")
    extra = (f", low/high frequency factors {out['rope_low_freq_factor']:g}/"
             f"{out['rope_high_freq_factor']:g}" if rope.frequency_band else "")
    if rope.correction_range:
        extra, yarn = _moe(lambda r: hf_rope.read_yarn(r, params, field), raw)
        positions = yarn.pop("rope_original_max_positions")
        out.update(yarn)
    if not _count(positions):
        raise HFCheckpointError(f"original_max_position_embeddings={positions!r} must be an "
                                f"integer in [1, {MAX_SIZE}]")
    out["rope_original_max_positions"] = positions
    return (f"{kind} RoPE scaling, factor {out['rope_factor']:g}{extra}, pretraining context "
            f"{positions}, theta {theta:g}"), out


def _tie(raw: Mapping[str, Any], untie_embeddings: bool) -> Reading:
    """``tie_word_embeddings``: one parameter for embedding and LM head, unless untied."""
    if not _flag(raw, "tie_word_embeddings"):
        return "untied embedding and LM head", {"tie_embeddings": False}
    if untie_embeddings:
        return ("tied in the checkpoint, untied on request: the LM head starts as a copy of the "
                "embedding and trains apart", {"tie_embeddings": False})
    return "tied: one parameter for embedding and LM head", {"tie_embeddings": True}


def _shape(raw: Mapping[str, Any]) -> Reading:
    """The sizes, with transformers' defaults for the optional ones."""
    hidden = _int_field(raw, "hidden_size")
    heads = _int_field(raw, "num_attention_heads")
    kv_heads = _int_field(raw, "num_key_value_heads", heads)
    if raw.get("head_dim") is None and hidden % heads:
        raise HFCheckpointError(f"hidden_size={hidden} is not divisible by "
                                f"num_attention_heads={heads} and head_dim is not given")
    head_dim = _int_field(raw, "head_dim", hidden // heads)
    if head_dim % 2:
        raise HFCheckpointError(f"head_dim={head_dim} must be even (RoPE rotates pairs)")
    if heads % kv_heads:
        raise HFCheckpointError(f"num_key_value_heads={kv_heads} must divide "
                                f"num_attention_heads={heads}")
    fields = dict(vocab_size=_int_field(raw, "vocab_size"), hidden=hidden,
                  layers=_int_field(raw, "num_hidden_layers"), heads=heads, kv_heads=kv_heads,
                  head_dim=head_dim, ffn_hidden=_int_field(raw, "intermediate_size"),
                  norm_eps=_float_field(raw, "rms_norm_eps", 1e-6),
                  init_std=_float_field(raw, "initializer_range", 0.02))
    return (f"{fields['layers']} layers x {hidden} hidden, heads {heads}/{kv_heads} of "
            f"{head_dim}, FFN {fields['ffn_hidden']}, vocabulary {fields['vocab_size']}"), fields


def _int_field(raw: Mapping[str, Any], name: str, default: int | None = None) -> int:
    """``raw[name]`` as a positive int; absent or null takes ``default`` (None: required)."""
    value = raw.get(name)
    value = default if value is None else value
    if value is None:
        raise HFCheckpointError(f"field {name} is missing")
    if not _count(value):
        raise HFCheckpointError(f"{name}={value!r} must be an integer in [1, {MAX_SIZE}]")
    return value


MAX_SIZE = 2**31 - 1
"""The largest size a config.json may give (vocabulary, widths, layers, heads, positions)."""


def _count(value: Any) -> bool:
    """Whether ``value`` is an integer in [1, MAX_SIZE] (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, int) and 1 <= value <= MAX_SIZE


def _flag(raw: Mapping[str, Any], name: str) -> bool:
    """``raw[name]`` as a bool; absent or null is False."""
    value = raw.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HFCheckpointError(f"{name}={value!r} must be true or false")
    return value


def _float_field(raw: Mapping[str, Any], name: str, default: float) -> float:
    value = raw.get(name)
    value = default if value is None else value
    if not _positive(value):
        raise HFCheckpointError(f"{name}={value!r} must be a positive number")
    return float(value)


_RULES = (("architecture", _architecture), ("shape", _shape), ("attention", _attention),
          ("mlp", _mlp), ("rope", _rope),
          ("experts", lambda r: _moe(hf_deepseek.read_experts if r.get("model_type") ==
                                     hf_deepseek.KIND else hf_moe.read_experts, r)))
"""Each aspect of a config.json and the rule that reads it (:func:`support`)."""


@dataclass(frozen=True)
class Support:
    """What mpipar makes of one aspect of a checkpoint's ``config.json``: ``reading`` describes
    it when supported; ``problem`` names the field and the reason when not (empty: supported)."""

    aspect: str
    reading: str
    problem: str = ""


def support(raw: Mapping[str, Any], untie_embeddings: bool = False
            ) -> tuple[list[Support], dict[str, Any]]:
    """Every aspect of a parsed ``config.json`` (architecture, shape, attention, MLP, RoPE, tied
    embeddings), supported or not, and the ModelConfig fields of the supported ones."""
    found, fields, raw = [], {}, hf_gemma3.with_defaults(raw)
    rules = _RULES + (("embeddings", lambda r: _tie(r, untie_embeddings)),)
    for aspect, rule in rules:
        try:
            reading, values = rule(raw)
        except HFCheckpointError as exc:
            found.append(Support(aspect, "", str(exc)))
            continue
        found.append(Support(aspect, reading))
        fields.update(values)
    return found, fields


def model_config_from_hf(raw: Mapping[str, Any], where: str = CONFIG_FILE,
                         untie_embeddings: bool = False) -> ModelConfig:
    """mpipar's (resolved) ModelConfig from a parsed Llama or Qwen2 ``config.json``; refuse what
    mpipar cannot compute exactly, naming the first field at fault (:func:`support` lists them
    all). Absent optional fields take transformers' defaults."""
    found, fields = support(raw, untie_embeddings)
    for aspect in found:
        if aspect.problem:
            raise HFCheckpointError(f"{where}: {aspect.problem}")
    return resolve_model(ModelConfig(**fields))


def read_model_config(path: str | os.PathLike, untie_embeddings: bool = False) -> ModelConfig:
    """The ModelConfig of the checkpoint in directory ``path``, from ``config.json`` alone (cheap:
    use it to validate a run before any weights are read). Raises HFCheckpointError."""
    raw = read_config_json(path)
    cfg = model_config_from_hf(raw, str(Path(path) / CONFIG_FILE), untie_embeddings)
    return hf_deepseek.with_stored_mtp(cfg, raw, weight_files(path))


def passthrough_config(path: str | os.PathLike) -> dict[str, Any]:
    """The :data:`PASSTHROUGH_FIELDS` present in ``path``'s config.json (for a later export)."""
    raw = read_config_json(path)
    return {k: raw[k] for k in PASSTHROUGH_FIELDS if k in raw}


def model_type(cfg: ModelConfig) -> str:
    """The ``model_type`` mpipar writes ``cfg`` as: qwen2 with attention biases (q/k/v), mistral
    with a sliding window on every layer, qwen3 (qwen3_moe with experts) with qk_norm, else
    llama; deepseek_v3 with latent attention; gemma3_text with Gemma's norms, activation and
    scales. A window on some layers only, or with biases, has no such architecture
    (HFCheckpointError). Multi-token prediction modules only in a DeepSeek-V3."""
    if cfg.mtp_depth and not cfg.latent:
        raise HFCheckpointError(f"model.mtp_depth={cfg.mtp_depth}: only DeepSeek-V3's format "
                                f"(latent attention) stores multi-token prediction modules")
    if cfg.latent:
        if hf_deepseek.export_problem(cfg):
            raise HFCheckpointError(hf_deepseek.export_problem(cfg))
        return hf_deepseek.KIND
    if hf_gemma3.is_gemma(cfg):
        if hf_gemma3.export_problem(cfg):
            raise HFCheckpointError(hf_gemma3.export_problem(cfg))
        return hf_gemma3.GEMMA3_TEXT
    if cfg.qk_norm:
        if hf_qwen3.export_problem(cfg):
            raise HFCheckpointError(hf_qwen3.export_problem(cfg))
        return hf_qwen3.export_kind(cfg)
    if cfg.sliding_window and (cfg.attention_bias or not cfg.window_set().every_layer):
        raise HFCheckpointError(
            f"model.sliding_window={cfg.sliding_window} with window_layers="
            f"{cfg.window_layers!r} and attention_bias={cfg.attention_bias}: only a window on "
            f"every layer without biases (MistralForCausalLM) can be exported")
    if cfg.moe_experts and hf_moe.export_problem(cfg):
        raise HFCheckpointError(hf_moe.export_problem(cfg))
    if cfg.moe_experts:
        return hf_moe.export_kind(cfg)
    return "qwen2" if cfg.attention_bias else "mistral" if cfg.sliding_window else "llama"


def architecture(cfg: ModelConfig) -> str:
    """The transformers architecture mpipar writes ``cfg`` as (see :func:`model_type`)."""
    return ARCHITECTURES[model_type(cfg)]


def hf_config(cfg: ModelConfig, dtype: str, extra: Mapping[str, Any] | None = None) -> dict:
    """The ``config.json`` of mpipar's model ``cfg`` with weights in ``dtype``: a
    Qwen2ForCausalLM when it has attention biases, else a LlamaForCausalLM; tied or not as the
    model is. RoPE is written in both styles (top-level ``rope_theta`` and ``rope_scaling`` for
    transformers 4.x, ``rope_parameters`` for 5.x); ``extra`` may set the
    :data:`PASSTHROUGH_FIELDS`, except that dynamic RoPE scaling fixes ``max_position_embeddings``
    (its pretraining context)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(PASSTHROUGH_FIELDS))
    if unknown:
        raise ValueError(f"extra config fields {unknown}: only {list(PASSTHROUGH_FIELDS)} may be "
                         f"given; the others follow from the model config")
    m = resolve_model(cfg)
    kind = model_type(m)
    out = {
        "architectures": [architecture(m)],
        "model_type": kind,
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden,
        "intermediate_size": m.ffn_hidden,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": DEFAULT_MAX_POSITIONS,
        "initializer_range": m.init_std,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "attention_dropout": 0.0,
        "tie_word_embeddings": m.tie_embeddings,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    out.update({"qwen2": {"use_sliding_window": False},
                "mistral": {"sliding_window": m.sliding_window},
                "mixtral": hf_moe.mixtral_fields(m), "qwen2_moe": hf_moe.qwen2_moe_fields(m),
                "qwen3": hf_qwen3.config_fields(m), "qwen3_moe": hf_qwen3.config_fields(m),
                hf_deepseek.KIND: hf_deepseek.config_fields(m) if m.latent else {}}.get(
        kind, {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}))
    out.update(extra)
    scaling = hf_rope.scaling_fields(m)
    if scaling:
        out["rope_scaling"] = scaling
    if m.rope.by_sequence_length:      # transformers scales beyond max_position_embeddings
        out["max_position_embeddings"] = m.rope_original_max_positions
    out["rope_parameters"] = {"rope_type": m.rope_type, "rope_theta": m.rope_theta, **scaling}
    if kind == hf_gemma3.GEMMA3_TEXT:
        for name in ("hidden_act", "mlp_bias", "pretraining_tp"):   # not Gemma's fields
            out.pop(name, None)
        out.update(hf_gemma3.config_fields(m, out["rope_parameters"]))
    return out


def model_config_with_overrides(hf_cfg: ModelConfig, overrides: Mapping[str, Any],
                                source: str = "the Hugging Face checkpoint") -> ModelConfig:
    """The (resolved) model config of a run initialised from a checkpoint: see
    :func:`mpipar.layout.model_from_checkpoint` (errors name the config.json field)."""
    return model_from_checkpoint(hf_cfg, overrides, source, _HF_FIELD)


# --------------------------------------------------------------------------------- tensors
MAX_WEIGHT_MAP, MAX_INDEX_BYTES = 1 << 18, 1 << 26  # an index's tensors (DeepSeek-V3: ~92k), bytes


def weight_files(path: str | os.PathLike) -> dict[str, Path]:
    """Where each tensor of directory ``path`` lives: ``{hf name: safetensors file}``. The shards
    an index lists must be relative paths inside ``path`` (no absolute path, no ``..``), so that
    an index cannot make mpipar read a file outside the directory (nor be over its bounds)."""
    root = Path(path)
    single, index = root / WEIGHTS_FILE, root / INDEX_FILE
    if single.is_file():
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise HFCheckpointError(f"{index}: larger than {MAX_INDEX_BYTES} bytes")
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HFCheckpointError(f"{index}: needs a JSON object with a 'weight_map' "
                                    f"({type(exc).__name__}: {exc})") from None
        if not isinstance(weight_map, dict) or len(weight_map) > MAX_WEIGHT_MAP:
            raise HFCheckpointError(f"{index}: 'weight_map' must map tensor names to files "
                                    f"(at most {MAX_WEIGHT_MAP:,})")
        files = {name: root / _shard_name(index, name, shard) for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise HFCheckpointError(f"{index}: shard file {shard.relative_to(root)} does not "
                                        f"exist")
        return files
    others = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pth"))
    hint = f" (found {others}: convert them to safetensors first)" if others else ""
    raise HFCheckpointError(f"{root}: no {WEIGHTS_FILE} and no {INDEX_FILE}{hint}")


def _shard_name(index: Path, name: Any, shard: Any) -> str:
    """The shard file of tensor ``name`` in ``index``'s weight map: a relative path without
    ``..`` (HFCheckpointError naming the entry otherwise)."""
    if not isinstance(shard, str) or not shard:
        raise HFCheckpointError(f"{index}: weight_map[{name!r}] = {shard!r} must be the name of "
                                f"a safetensors file")
    parts = Path(shard).parts
    if Path(shard).is_absolute() or ".." in parts:
        raise HFCheckpointError(f"{index}: weight_map[{name!r}] = {shard!r} points outside the "
                                f"model directory; shard files must be relative paths inside it")
    return shard


@contextlib.contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """``safe_open(file)`` for NumPy; a file it cannot open (truncated, a damaged header) is an
    HFCheckpointError naming the file."""
    from safetensors import safe_open
    try:
        handle = safe_open(str(file), framework="np")
    except Exception as exc:  # safetensors raises its own error types
        raise HFCheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
    with handle as f:
        yield f


def _read_file(file: Path, names: list[str]) -> dict[str, np.ndarray]:
    """Tensors ``names`` of safetensors ``file`` (checked by :func:`check_tensors`) as NumPy
    arrays (bfloat16 widened to float32)."""
    out, bf16 = {}, []
    with open_safetensors(file) as f:
        for name in names:
            if f.get_slice(name).get_dtype() == "BF16":
                bf16.append(name)
            else:
                out[name] = f.get_tensor(name)
    if bf16:
        header, start = read_header(file)
        for name in bf16:
            begin, end = header[name]["data_offsets"]
            bits = np.fromfile(file, dtype="<u2", count=(end - begin) // 2, offset=start + begin)
            # A bfloat16 is the upper half of the float32 of the same value: shift the bits up.
            out[name] = (bits.astype(np.uint32) << 16).view(np.float32).reshape(
                header[name]["shape"])
    return out


def _check_dtype(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        dt = numpy_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(SAVE_DTYPES)}") from None
    if dt.name not in SAVE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(SAVE_DTYPES)}")
    return dt


def check_tensors(root: Path, raw: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Path]:
    """Check, from the safetensors headers alone, that directory ``root`` holds exactly the
    tensors of the model ``cfg`` that its config ``raw`` implies, each with its shape and a dtype
    mpipar reads; returns ``{mpipar name: safetensors file}`` of the parameters to read. A tied
    checkpoint's head is its embedding (a stored ``lm_head.weight`` is then ignored, as
    transformers ignores it). Raises HFCheckpointError naming the file, tensors or shapes."""
    family = raw.get("model_type", "llama")
    files = {n: f for n, f in weight_files(root).items() if not n.endswith(_IGNORED_SUFFIX)
             and not (family == hf_deepseek.KIND
                      and hf_deepseek.not_parameters(raw, n, cfg.mtp_depth))}
    tied = _flag(hf_gemma3.with_defaults(raw), "tie_word_embeddings")
    specs = {s.name: s for s in param_specs(cfg) if not (tied and s.name == HEAD)}
    expected = {hf_name(n, family) for n in specs}
    missing = sorted(expected - set(files))
    unexpected = sorted(set(files) - expected - ({HEAD} if tied else set()))
    for what, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise HFCheckpointError(f"{root}: {len(names)} {what} tensor(s) for a "
                                    f"{architecture(cfg)} with {cfg.layers} layers: {shown}")
    stored = {n: files[hf_name(n, family)] for n in specs}
    by_file: dict[Path, list[str]] = {}
    for name, file in stored.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            present = set(f.keys())
            for name in names:
                hf = hf_name(name, family)
                if hf not in present:
                    raise HFCheckpointError(f"{file}: tensor {hf} is listed in {INDEX_FILE} "
                                            f"but not stored in this shard")
                piece = f.get_slice(hf)
                kind, shape = piece.get_dtype(), list(piece.get_shape())
                if kind not in _NUMPY_DTYPES and kind != "BF16":
                    raise HFCheckpointError(f"{file}: tensor {hf} has dtype {kind}; mpipar "
                                            f"reads floating-point F16, BF16, F32 and F64 tensors")
                if tuple(shape) != specs[name].shape:
                    raise HFCheckpointError(f"{root}: tensor {hf} has shape {shape}, "
                                            f"{CONFIG_FILE} implies {list(specs[name].shape)}")
    return stored


def stored_bytes(stored: Mapping[str, Path], kind: str = "llama") -> int:
    """Bytes :func:`load_hf` holds for the tensors ``stored`` (:func:`check_tensors`'s
    ``{mpipar name: file}``), from the headers: each as read, bfloat16 widened to float32."""
    by_file: dict[Path, list[str]] = {}
    for name, file in stored.items():
        by_file.setdefault(file, []).append(hf_name(name, kind))
    total = 0
    for file, names in by_file.items():
        with open_safetensors(file) as f:
            for name in names:
                piece = f.get_slice(name)
                kind = piece.get_dtype()
                size = 4 if kind == "BF16" else np.dtype(_NUMPY_DTYPES[kind]).itemsize
                total += size * math.prod(piece.get_shape())
    return total


def load_hf(path: str | os.PathLike, dtype: Any = None,
            untie_embeddings: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read the Hugging Face Llama or Qwen2 checkpoint in directory ``path``.

    Returns the resolved ModelConfig and every parameter as a global array under mpipar's name
    (shapes as in :func:`mpipar.model.params.param_specs`, e.g. ``layers.0.self_attn.k_proj.weight``
    ``[kv_heads * head_dim, hidden]``). ``dtype`` None keeps each tensor's file dtype (bfloat16
    becomes float32); else every tensor is cast to it (float16, float32 or float64). A tied
    checkpoint gives a tied model (no ``lm_head.weight``), or with ``untie_embeddings`` an untied
    one whose ``lm_head.weight`` is a copy of the embedding. Raises HFCheckpointError (a
    ConfigError) naming the field or tensors.
    """
    dt = _check_dtype(dtype)
    root = Path(path)
    raw = read_config_json(root)
    cfg = model_config_from_hf(raw, str(root / CONFIG_FILE), untie_embeddings)
    cfg = hf_deepseek.with_stored_mtp(cfg, raw, weight_files(root))
    stored, kind = check_tensors(root, raw, cfg), raw.get("model_type", "llama")
    wanted: dict[Path, list[str]] = {}
    for name, file in stored.items():
        wanted.setdefault(file, []).append(hf_name(name, kind))
    arrays = {n: v for file, names in wanted.items() for n, v in _read_file(file, names).items()}
    params = {name: arrays[hf_name(name, kind)] if dt is None
              else arrays[hf_name(name, kind)].astype(dt) for name in stored}
    if any(s.name == HEAD for s in param_specs(cfg)) and HEAD not in params:  # untied on request
        params[HEAD] = params[EMBED].copy()
    if kind == hf_deepseek.KIND:
        params = hf_deepseek.from_hub(cfg, raw, params)
    return cfg, params


def load_selection_biases(path: str | os.PathLike) -> dict[int, np.ndarray]:
    """The routers' selection biases a DeepSeek-V3 checkpoint stores (``e_score_correction_bias``
    of each sparse block, float64 ``[E]``, for :meth:`mpipar.model.moe.RoutingBias.load`); empty
    for another model."""
    files, cfg = weight_files(path), read_model_config(path)
    names = {i: hf_deepseek.SELECTION_BIAS.format(i=i) for i in all_blocks(cfg)
             if cfg.is_sparse(i) and cfg.latent}
    found = {i: _read_file(files[n], [n])[n] for i, n in names.items() if n in files}
    return {i: np.asarray(b, dtype=np.float64) for i, b in found.items()}


# ---------------------------------------------------------------------------------- export
def _replaceable(path: Path) -> bool:
    """May an export replace ``path``? Only a previous export (or an empty directory) may go."""
    if not path.exists():
        return True
    return path.is_dir() and set(os.listdir(path)) <= {CONFIG_FILE, WEIGHTS_FILE}


def check_export_target(path: str | os.PathLike) -> None:
    """Raise ValueError unless :func:`save_hf` may write ``path`` (call it before training)."""
    p = Path(path)
    if not _replaceable(p):
        extra = sorted(set(os.listdir(p)) - {CONFIG_FILE, WEIGHTS_FILE}) if p.is_dir() else []
        raise ValueError(f"export directory {p}: exists and holds more than a previous export "
                         f"({extra[:5] or 'not a directory'}); choose a new or empty directory")
    parent = p.resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(f"export directory {p}: parent {parent} is not a writable directory")


def save_hf(path: str | os.PathLike, cfg: ModelConfig, params: Mapping[str, np.ndarray],
            dtype: Any = None, extra_config: Mapping[str, Any] | None = None,
            biases: Mapping[int, Any] | None = None) -> None:
    """Write ``params`` (mpipar names, global shapes) as a Hugging Face model (:func:`hf_config`:
    Qwen2ForCausalLM with attention biases, else LlamaForCausalLM; a tied model's embedding once).

    Writes ``config.json`` and ``model.safetensors`` into a temporary directory beside ``path``
    and renames it into place, so ``path`` never holds a partial export. An existing ``path`` is
    replaced only if it is empty or a previous export (config.json and model.safetensors alone):
    it is renamed to ``.NAME.old-PID`` beside it, the new one renamed in, then the old removed
    (a crash between the two renames leaves the old export under that hidden name). ``dtype``
    None keeps the parameters' dtype (they must share one); else float16, bfloat16 (rounded to
    nearest even), float32 or float64. ``extra_config`` sets :data:`PASSTHROUGH_FIELDS`.
    A DeepSeek-V3 also gets each sparse block's ``e_score_correction_bias`` (``biases``, by
    block; zeros where none), in float32 as transformers keeps it.
    """
    from safetensors.numpy import save_file

    dt = _check_dtype(dtype)
    specs = {s.name: s for s in param_specs(cfg)}
    missing, unexpected = sorted(set(specs) - set(params)), sorted(set(params) - set(specs))
    if missing or unexpected:
        raise ValueError(f"save_hf: parameters do not match the model config: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    for name, spec in specs.items():
        if tuple(np.shape(params[name])) != spec.shape:
            raise ValueError(f"save_hf: {name} has shape {list(np.shape(params[name]))}, the "
                             f"model config needs {list(spec.shape)}")
    if dt is None:
        kinds = sorted({np.asarray(v).dtype.name for v in params.values()})
        if len(kinds) != 1:
            raise ValueError(f"save_hf: parameters have dtypes {kinds}; pass dtype to pick one")
        dt = _check_dtype(kinds[0])
    config = hf_config(cfg, dt.name, extra_config)
    if config["model_type"] == hf_deepseek.KIND:
        params = hf_deepseek.to_hub(cfg, params)
    tensors = {hf_name(n, config["model_type"]): np.ascontiguousarray(params[n], dtype=dt)
               for n in specs}
    if config["model_type"] == hf_deepseek.KIND:
        tensors.update(hf_deepseek.extra_tensors(cfg, params, biases, dt))

    dst = Path(path)
    check_export_target(dst)

    def write(tmp: Path) -> None:
        if dt.name == "bfloat16":
            write_safetensors(tensors, tmp / WEIGHTS_FILE, {"format": "pt"})
        else:
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    publish(dst, write)
