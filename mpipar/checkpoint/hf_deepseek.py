"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, ``model_type`` ``deepseek_v3``) in Hugging Face
checkpoints: its config fields read and written, its tensors' layout; :mod:`mpipar.checkpoint.
huggingface` asks these rules.

- Attention is multi-head latent attention (:mod:`mpipar.model.latent_attention`):
  ``q_lora_rank`` (null: one ``q_proj``) is ``latent_q_rank``, ``kv_lora_rank``
  ``latent_kv_rank``, ``qk_rope_head_dim`` ``rope_head_dim``, ``qk_nope_head_dim +
  qk_rope_head_dim`` mpipar's ``head_dim`` (transformers writes ``head_dim`` as the rope width:
  it is not read), ``v_head_dim`` ``v_head_dim``; ``num_key_value_heads`` must equal the heads
  and ``attention_bias`` be false. With ``rope_interleave`` (transformers' default) the rope
  features of each query head and of the shared key come in interleaved pairs; mpipar rotates
  halves, so the rope rows of ``q_b_proj`` (``q_proj``) and ``kv_a_proj_with_mqa`` are permuted
  (evens then odds) on import and back on export (:func:`from_hub`, :func:`to_hub`): the same
  scores. A yarn RoPE (the released models') is read by the RoPE rule
  (:mod:`mpipar.checkpoint.hf_rope`), its softmax-scale factor applied by latent attention.
- The first ``first_k_dense_replace`` layers are dense (``intermediate_size``), the others
  sparse (``moe_layers``): ``n_routed_experts`` experts of ``moe_intermediate_size``, top
  ``num_experts_per_tok``, the grouped sigmoid router (``n_group``, ``topk_group``,
  ``norm_topk_prob``, ``routed_scaling_factor``: :mod:`mpipar.model.router`) and an ungated
  shared expert of ``n_shared_experts x moe_intermediate_size`` (``moe_shared_ffn_hidden``).
  The hub names are Qwen2-MoE's (``mlp.gate``, ``mlp.experts.{e}.gate_proj``, ...) with the
  shared expert as ``mlp.shared_experts.*`` (:func:`mpipar.checkpoint.hf_moe.hub_name`).
- The router's ``e_score_correction_bias`` ``[E]`` (a buffer, not a parameter) is mpipar's
  selection bias (:class:`mpipar.model.moe.RoutingBias`): read by
  :func:`mpipar.checkpoint.huggingface.load_selection_biases`, written by an export (zeros when
  the model has none).
- Multi-token prediction (``num_nextn_predict_layers``, transformers' ``num_mtp_layers``;
  :mod:`mpipar.model.mtp`): the released checkpoints store module k as decoder layer
  ``model.layers.{L + k - 1}`` past the ``num_hidden_layers`` L: its ``enorm``, ``hnorm``,
  ``eh_proj``, a decoder layer's tensors, ``shared_head.norm``, and copies of the shared
  embedding and LM head (``embed_tokens``, ``shared_head.head``). mpipar reads the modules a
  checkpoint stores as ``model.mtp_depth`` (:func:`stored_mtp_depth`; a
  ``save_pretrained`` of transformers, which builds no MTP and ignores those tensors on load,
  stores none: depth 0), never the two copies (the model's own embedding and head are the
  shared ones); an export writes ``num_nextn_predict_layers`` = ``mtp_depth`` and every module
  with its two copies, as the released checkpoints do. ``python -m mpipar.hf inspect`` says
  which.

Functions raise ValueError naming the field; the caller turns it into its error type.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Collection, Mapping

import numpy as np

from mpipar.config import ModelConfig
from mpipar.layout import resolve_model
from mpipar.model.latent_attention import KV_A, Q_B, Q_PROJ
from mpipar.model.lora import base_of, factor_of
from mpipar.model.mtp import all_blocks, mtp_layers as mtp_blocks
from mpipar.model.params import EMBED, HEAD

KIND = "deepseek_v3"
SELECTION_BIAS = "model.layers.{i}.mlp.gate.e_score_correction_bias"


def _count(raw: Mapping[str, Any], name: str, default: Any = None, low: int = 1) -> int:
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    return value


def _positive(raw: Mapping[str, Any], name: str, default: float) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a positive number")
    return float(value)


def read_attention(raw: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(a reading, ModelConfig fields) of DeepSeek-V3's latent attention."""
    heads = _count(raw, "num_attention_heads")
    kv = raw.get("num_key_value_heads", heads)
    if kv != heads:
        raise ValueError(f"num_key_value_heads={kv!r} must equal num_attention_heads={heads} "
                         f"(latent attention expands keys and values for every head)")
    if raw.get("attention_bias", False) not in (False, None):
        raise ValueError(f"attention_bias={raw['attention_bias']!r} is not supported for "
                         f"model_type {KIND!r}; mpipar's latent attention has no biases "
                         f"(must be false)")
    interleave = raw.get("rope_interleave", True)
    if not isinstance(interleave, bool):
        raise ValueError(f"rope_interleave={interleave!r} must be true or false")
    q_rank = raw.get("q_lora_rank", 1536)
    q_rank = 0 if q_rank is None else _count(raw, "q_lora_rank")
    kv_rank = _count(raw, "kv_lora_rank", 512)
    rope = _count(raw, "qk_rope_head_dim", 64)
    nope = _count(raw, "qk_nope_head_dim", 128)
    v = _count(raw, "v_head_dim", 128)
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim={rope} must be even (RoPE rotates pairs)")
    if v > nope + rope:
        raise ValueError(f"v_head_dim={v} must be <= qk_nope_head_dim + qk_rope_head_dim = "
                         f"{nope + rope} (mpipar attends values as zero-padded query-width "
                         f"heads)")
    mtp = mtp_layers(raw)
    queries = f"queries through a rank-{q_rank} latent" if q_rank else "queries by q_proj"
    note = (f"; num_nextn_predict_layers={mtp}: the multi-token prediction modules stored as "
            f"model.layers.{raw.get('num_hidden_layers')}.* on are read as model.mtp_depth "
            f"(none stored: depth 0)" if mtp else "")
    return (f"multi-head latent attention: {queries}, keys/values from a rank-{kv_rank} "
            f"latent, heads of {nope}+{rope} (rope) for queries/keys and {v} for values"
            f"{', interleaved rope pairs permuted to halves' if interleave else ''}{note}",
            {"latent_kv_rank": kv_rank, "latent_q_rank": q_rank, "rope_head_dim": rope,
             "head_dim": nope + rope, "v_head_dim": v, "kv_heads": heads,
             "attention_bias": False})


def mtp_layers(raw: Mapping[str, Any]) -> int:
    """The multi-token prediction modules the config declares."""
    return _count(raw, "num_nextn_predict_layers", raw.get("num_mtp_layers", 0), low=0)


MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
"""A stored MTP module's copies of the shared embedding and LM head (not read)."""


def stored_mtp_depth(raw: Mapping[str, Any], names: Collection[str]) -> int:
    """The MTP modules of those the config declares whose projection the checkpoint's tensors
    ``names`` hold (the first k of them)."""
    layers, depth = raw.get("num_hidden_layers"), 0
    while (depth < mtp_layers(raw)
           and f"model.layers.{layers + depth}.eh_proj.weight" in names):
        depth += 1
    return depth


def with_stored_mtp(cfg: ModelConfig, raw: Mapping[str, Any], names: Collection[str]
                    ) -> ModelConfig:
    """``cfg`` read from config ``raw`` with the modules a DeepSeek-V3 checkpoint of tensors
    ``names`` stores (:func:`stored_mtp_depth`) as its ``mtp_depth``; another model as is."""
    if raw.get("model_type") != KIND or not mtp_layers(raw):
        return cfg
    depth = stored_mtp_depth(raw, names)
    return resolve_model(dataclasses.replace(cfg, mtp_depth=depth)) if depth else cfg


def extra_tensors(m: ModelConfig, params: Mapping[str, np.ndarray],
                  biases: Mapping[int, Any] | None, dtype) -> dict[str, np.ndarray]:
    """What an export stores beside the parameters: each sparse block's selection bias
    (``biases``, by block; zeros where none), in float32 as transformers keeps it, and the
    copies of the embedding and LM head each MTP module's layer holds (in ``dtype``)."""
    out = {SELECTION_BIAS.format(i=i): np.asarray((biases or {}).get(
        i, np.zeros(m.moe_experts)), dtype=np.float32) for i in all_blocks(m) if m.is_sparse(i)}
    return out | {f"model.layers.{j}.{copy}": np.ascontiguousarray(params[source], dtype=dtype)
                  for j in mtp_blocks(m) for copy, source in zip(MTP_COPIES, (EMBED, HEAD))}


def read_experts(raw: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(a reading, ModelConfig fields) of DeepSeek-V3's sparse blocks."""
    from mpipar.checkpoint.hf_moe import MAX_EXPERTS
    experts = _count(raw, "n_routed_experts", 256)
    top_k = _count(raw, "num_experts_per_tok", 8)
    groups, topk_groups = _count(raw, "n_group", 8), _count(raw, "topk_group", 4)
    layers = _count(raw, "num_hidden_layers", 61)
    dense = _count(raw, "first_k_dense_replace", 3, low=0)
    if experts > MAX_EXPERTS:
        raise ValueError(f"n_routed_experts={experts} must be at most {MAX_EXPERTS}")
    if experts % groups or experts // groups < 2 or not 1 <= topk_groups <= groups:
        raise ValueError(f"n_group={groups}, topk_group={topk_groups}: n_group must divide "
                         f"n_routed_experts={experts} into groups of at least 2 experts and "
                         f"topk_group be in [1, n_group]")
    if dense >= layers:
        raise ValueError(f"first_k_dense_replace={dense} must be below num_hidden_layers="
                         f"{layers} (no sparse layer)")
    for name, want in (("moe_layer_freq", 1), ("scoring_func", "sigmoid"),
                       ("topk_method", "noaux_tc")):
        if raw.get(name, want) != want:
            raise ValueError(f"{name}={raw[name]!r} is not supported; mpipar reads "
                             f"DeepSeek-V3's {want!r}")
    norm = raw.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise ValueError(f"norm_topk_prob={norm!r} must be true or false")
    ffn, shared = _count(raw, "moe_intermediate_size", 2048), _count(raw, "n_shared_experts", 1,
                                                                      low=0)
    scale = _positive(raw, "routed_scaling_factor", 2.5)
    spec = "all" if dense == 0 else ",".join(map(str, range(dense, layers)))
    return (f"DeepSeek-V3 experts: {experts} of width {ffn} on layers {dense}.., top {top_k} "
            f"in the best {topk_groups} of {groups} groups by sigmoid scores"
            f"{' renormalised' if norm else ''}, scaled by {scale:g}, {shared} shared "
            f"expert(s) of width {ffn}",
            {"moe_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden": ffn,
             "moe_layers": spec, "moe_norm_topk": norm, "moe_router": "grouped_sigmoid",
             "moe_groups": groups, "moe_topk_groups": topk_groups, "moe_routed_scale": scale,
             "moe_shared_ffn_hidden": shared * ffn, "moe_shared_gate": False})


def not_parameters(raw: Mapping[str, Any], name: str, mtp_depth: int = 0) -> bool:
    """Whether hub tensor ``name`` of a DeepSeek-V3 checkpoint is no parameter of mpipar's
    model of ``mtp_depth`` modules: a router's selection bias (read apart), a multi-token
    prediction module's copy of the embedding or head, or a module past ``mtp_depth``."""
    if name.endswith(".mlp.gate.e_score_correction_bias"):
        return True
    parts, layers = name.split("."), raw.get("num_hidden_layers")
    if not (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and isinstance(layers, int) and int(parts[2]) >= layers):
        return False
    return int(parts[2]) >= layers + mtp_depth or ".".join(parts[3:]) in MTP_COPIES


def _rope_rows(m: ModelConfig, name: str) -> tuple[int, int, int] | None:
    """(rows of a block, start of its rope rows, count of blocks) of weight ``name``, if it
    holds rope rows; else None."""
    if name.endswith(KV_A):
        return m.latent_kv_rank + m.rope_head_dim, m.latent_kv_rank, 1
    if name.endswith((Q_B, Q_PROJ)):
        return m.head_dim, m.head_dim - m.rope_head_dim, m.heads
    return None


def _permute(m: ModelConfig, params: Mapping[str, np.ndarray], inverse: bool
             ) -> dict[str, np.ndarray]:
    d = m.rope_head_dim
    order = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    if inverse:
        order = np.argsort(order)
    out = dict(params)
    for name, w in params.items():
        rows = _rope_rows(m, name)
        if rows is None:
            continue
        size, start, blocks = rows
        w = np.array(w).reshape(blocks, size, -1)
        w[:, start:] = w[:, start:][:, order]
        out[name] = w.reshape(params[name].shape)
    return out


def from_hub(m: ModelConfig, raw: Mapping[str, Any], params: Mapping[str, np.ndarray]
             ) -> dict[str, np.ndarray]:
    """The parameters read from the hub in mpipar's layout (rope rows to halves when
    ``rope_interleave``)."""
    return _permute(m, params, False) if raw.get("rope_interleave", True) else dict(params)


def to_hub(m: ModelConfig, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """mpipar's parameters in the hub's layout (rope rows interleaved: an export writes
    ``rope_interleave`` true)."""
    return _permute(m, params, True)


def _adapter_rows(m: ModelConfig, adapters: Mapping[str, np.ndarray], inverse: bool
                  ) -> dict[str, np.ndarray]:
    """``adapters`` (LoRA factors by mpipar name) with the ``lora_B`` of each weight holding rope
    rows permuted as that weight's rows are (its output rows are the weight's)."""
    bs = {base_of(n): n for n in adapters if factor_of(n) == "lora_B"}
    moved = _permute(m, {w: adapters[n] for w, n in bs.items()}, inverse)
    return {**adapters, **{bs[w]: v for w, v in moved.items()}}


def adapters_from_hub(m: ModelConfig, adapters: Mapping[str, np.ndarray]
                      ) -> dict[str, np.ndarray]:
    """A PEFT adapter of a DeepSeek-V3 (interleaved rope rows, as transformers' default and
    mpipar's export) in mpipar's layout: the rope rows of the ``lora_B`` of ``q_b_proj``
    (``q_proj``) and ``kv_a_proj_with_mqa`` to halves, as :func:`from_hub` does the weights'."""
    return _adapter_rows(m, adapters, False)


def adapters_to_hub(m: ModelConfig, adapters: Mapping[str, np.ndarray]
                    ) -> dict[str, np.ndarray]:
    """mpipar's adapter factors in the hub's layout (:func:`adapters_from_hub` undone)."""
    return _adapter_rows(m, adapters, True)


def export_problem(m: ModelConfig) -> str:
    """Why latent-attention model ``m`` has no DeepseekV3ForCausalLM form ('' if it has one)."""
    sparse = [i for i in range(m.layers) if m.is_sparse(i)]
    first = sparse[0] if sparse else m.layers
    if (not m.moe_experts or sparse != list(range(first, m.layers)) or m.moe_shared_gate
            or not m.router.grouped or m.sliding_window or m.tie_embeddings
            or (m.moe_shared_ffn_hidden % m.moe_ffn_hidden)):
        return (f"model.latent_kv_rank={m.latent_kv_rank} with moe_experts={m.moe_experts}, "
                f"moe_layers={m.moe_layers!r}, moe_router={m.moe_router!r}, "
                f"moe_shared_ffn_hidden={m.moe_shared_ffn_hidden}, moe_shared_gate="
                f"{m.moe_shared_gate}, sliding_window={m.sliding_window}, tie_embeddings="
                f"{m.tie_embeddings}: latent attention is exported as DeepseekV3ForCausalLM, "
                f"which needs experts with the grouped_sigmoid router on the last layers, an "
                f"ungated shared expert of a multiple of moe_ffn_hidden, no window, untied "
                f"embeddings")
    return ""


def config_fields(m: ModelConfig) -> dict[str, Any]:
    """The config.json fields of a DeepSeek-V3 beyond the Llama ones."""
    first = next(i for i in range(m.layers) if m.is_sparse(i))
    return {"q_lora_rank": m.latent_q_rank or None, "kv_lora_rank": m.latent_kv_rank,
            "qk_rope_head_dim": m.rope_head_dim, "qk_nope_head_dim": m.head_dim - m.rope_head_dim,
            "v_head_dim": m.value_dim, "head_dim": m.rope_head_dim, "rope_interleave": True,
            "attention_bias": False, "n_routed_experts": m.moe_experts,
            "num_experts_per_tok": m.moe_top_k, "moe_intermediate_size": m.moe_ffn_hidden,
            "n_shared_experts": m.moe_shared_ffn_hidden // m.moe_ffn_hidden,
            "n_group": m.moe_groups, "topk_group": m.moe_topk_groups,
            "norm_topk_prob": m.moe_norm_topk, "routed_scaling_factor": m.moe_routed_scale,
            "first_k_dense_replace": first, "num_nextn_predict_layers": m.mtp_depth}
