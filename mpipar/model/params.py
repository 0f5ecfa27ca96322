"""The model's parameters as dense global tensors: names, shapes, initialisation.

Names follow Hugging Face Llama without the ``model.`` prefix; matrices are ``[out, in]`` as in
``torch.nn.Linear``. Every parameter is initialised as its *global* tensor from a generator seeded
by ``(seed, crc32(name))``, so every layout starts from the same numbers. How the grid splits
and places them is not the model's business: :mod:`mpipar.parallel.placement` holds that table.

Config facts change the set: ``attention_bias`` adds the q/k/v biases
(``layers.{i}.self_attn.{q,k,v}_proj.bias``, Qwen2's), ``qk_norm`` the per-head query and key
norms (``layers.{i}.self_attn.{q,k}_norm.weight`` ``[head_dim]``, Qwen3's), ``latent_kv_rank``
latent attention's projections and norms in place of q/k/v
(:mod:`mpipar.model.latent_attention`, DeepSeek-V3's names), the ``sandwich`` norm placement a
block's two output norms and its pre-FFN norm under Gemma's name (:mod:`mpipar.model.norms`),
``tie_embeddings`` drops ``lm_head.weight``: the LM head then reads ``embed_tokens.weight``
(:func:`head_weight_name`), and ``mtp_depth`` adds the multi-token prediction modules after the
head, each under its block index ``layers.{layers + k - 1}.`` (:mod:`mpipar.model.mtp`).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from mpipar.config import ModelConfig
from mpipar.model.latent_attention import latent_param_shapes
from mpipar.model.mtp import HEAD_NORM, embedding_at_last, mtp_layers, mtp_param_shapes
from mpipar.model.norms import INPUT, POST_ATTENTION, POST_FFN
from mpipar.model.qk_norm import K_NORM, Q_NORM


EMBED, HEAD = "embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its global shape and the block that owns it."""

    name: str
    shape: tuple[int, ...]
    layer: int | None  # block index; None for embedding, final norm and head


def block_param_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    """Specs of decoder block ``i``."""
    h, q, kv, f = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden
    p, norms = f"layers.{i}.", cfg.norms
    biases = [ParamSpec(p + f"self_attn.{x}_proj.bias", (n,), i)
              for x, n in (("q", q), ("k", kv), ("v", kv))] if cfg.attention_bias else []
    if cfg.latent:
        attention = [ParamSpec(p + name, shape, i) for name, shape in latent_param_shapes(cfg)]
        q = cfg.heads * cfg.value_dim
    else:
        attention = [ParamSpec(p + "self_attn.q_proj.weight", (q, h), i),
                     ParamSpec(p + "self_attn.k_proj.weight", (kv, h), i),
                     ParamSpec(p + "self_attn.v_proj.weight", (kv, h), i)]
    return [
        ParamSpec(p + INPUT, (h,), i),
        *attention,
        *biases,
        *([ParamSpec(p + Q_NORM, (cfg.head_dim,), i), ParamSpec(p + K_NORM, (cfg.head_dim,), i)]
          if cfg.qk_norm else []),
        ParamSpec(p + "self_attn.o_proj.weight", (h, q), i),
        *(ParamSpec(p + name, (h,), i) for name in dict.fromkeys((POST_ATTENTION, norms.pre_ffn))),
        *(moe_param_specs(cfg, i) if cfg.is_sparse(i) else [
            ParamSpec(p + "mlp.gate_proj.weight", (f, h), i),
            ParamSpec(p + "mlp.up_proj.weight", (f, h), i),
            ParamSpec(p + "mlp.down_proj.weight", (h, f), i)]),
        *([ParamSpec(p + POST_FFN, (h,), i)] if norms.sandwich else []),
    ]


ROUTER = "block_sparse_moe.gate.weight"
EXPERT = "block_sparse_moe.experts.{e}.{w}.weight"
"""A sparse block's router ``[E, H]`` and expert weights (Mixtral's names, without
``layers.{i}.``): ``w1`` gate ``[F, H]``, ``w3`` up ``[F, H]``, ``w2`` down ``[H, F]``."""


def expert_names(i: int, e: int) -> tuple[str, str, str]:
    """(w1 gate, w3 up, w2 down) of expert ``e`` of block ``i``."""
    return tuple(f"layers.{i}." + EXPERT.format(e=e, w=w) for w in ("w1", "w3", "w2"))


SHARED_GATE_UP = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")
SHARED_DOWN = ("mlp.shared_expert.down_proj.weight",)
SHARED_GATE = ("mlp.shared_expert_gate.weight",)
"""A sparse block's shared expert (``--moe-shared-ffn-hidden F_s``, DeepSeek-V3's: every token
runs it and its output is added to the routed experts'), without ``layers.{i}.``: a dense
SwiGLU FFN laid out as the dense FFN's (gate, up ``[F_s, H]``, down ``[H, F_s]``; Qwen2-MoE's
names); with ``--moe-shared-gate`` (Qwen2-MoE's) its output is scaled per token by
``sigmoid(x w_g^T)``, ``w_g`` ``[1, H]``."""


def moe_param_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    """The router, the experts and the shared expert (if any) of sparse block ``i`` (in place
    of the dense FFN)."""
    h, f, fs = cfg.hidden, cfg.moe_ffn_hidden, cfg.moe_shared_ffn_hidden
    specs = [ParamSpec(f"layers.{i}." + ROUTER, (cfg.moe_experts, h), i)]
    for e in range(cfg.moe_experts):
        w1, w3, w2 = expert_names(i, e)
        specs += [ParamSpec(w1, (f, h), i), ParamSpec(w3, (f, h), i), ParamSpec(w2, (h, f), i)]
    if fs:
        p = f"layers.{i}."
        specs += [ParamSpec(p + name, (fs, h), i) for name in SHARED_GATE_UP]
        specs += [ParamSpec(p + SHARED_DOWN[0], (h, fs), i)]
        if cfg.moe_shared_gate:
            specs.append(ParamSpec(p + SHARED_GATE[0], (1, h), i))
    return specs


def require_resolved(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` itself, if its derived sizes are filled in (a Layout's model, or one read from a
    checkpoint or a Hugging Face directory, is: :func:`mpipar.layout.resolve_model`); else a
    ValueError: the model never guesses a default."""
    if cfg.head_dim <= 0 or cfg.ffn_hidden <= 0:
        raise ValueError(f"model config with head_dim={cfg.head_dim}, ffn_hidden={cfg.ffn_hidden}: "
                         f"not resolved (mpipar.layout.resolve_model fills them in)")
    return cfg


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter of the (resolved) model, in forward order."""
    require_resolved(cfg)
    specs = [ParamSpec(EMBED, (cfg.vocab_size, cfg.hidden), None)]
    for i in range(cfg.layers):
        specs += block_param_specs(cfg, i)
    specs.append(ParamSpec("norm.weight", (cfg.hidden,), None))
    if not cfg.tie_embeddings:
        specs.append(ParamSpec(HEAD, (cfg.vocab_size, cfg.hidden), None))
    for j in mtp_layers(cfg):
        specs += mtp_param_specs(cfg, j)
    return specs


def mtp_param_specs(cfg: ModelConfig, j: int) -> list[ParamSpec]:
    """Specs of the multi-token prediction module at block index ``j``
    (:mod:`mpipar.model.mtp`): its norms and projection, its block, its head's norm."""
    own = [ParamSpec(f"layers.{j}.{name}", shape, j) for name, shape in mtp_param_shapes(cfg)]
    return own + block_param_specs(cfg, j) + [ParamSpec(f"layers.{j}.{HEAD_NORM}",
                                                        (cfg.hidden,), j)]


def bias_name(weight: str) -> str:
    """The name of the bias of linear weight ``weight`` (``...q_proj.weight`` -> ``...bias``)."""
    return weight.removesuffix("weight") + "bias"


def head_weight_name(cfg: ModelConfig) -> str:
    """The parameter the LM head multiplies by: ``lm_head.weight``, or the embedding when tied."""
    return EMBED if cfg.tie_embeddings else HEAD


def stage_param_names(cfg: ModelConfig, layers: range, first: bool, last: bool) -> list[str]:
    """Parameters of a pipeline stage holding blocks ``layers``, plus the embedding (``first``)
    and the final norm and LM head (``last``; the embedding when tied), in forward order, each
    once."""
    names = [EMBED] if first else []
    for i in layers:
        names += [s.name for s in block_param_specs(cfg, i)]
    if last:
        names.append("norm.weight")
        if head_weight_name(cfg) not in names:  # tied, on a single stage: already there
            names.append(head_weight_name(cfg))
        if embedding_at_last(cfg) and EMBED not in names:   # the MTP modules' inputs
            names.append(EMBED)
        for j in mtp_layers(cfg):
            names += [s.name for s in mtp_param_specs(cfg, j)]
    return names


def unit_of(name: str) -> str:
    """The *unit* parameter ``name`` is read in (:class:`mpipar.model.llama.ParamScope`): its
    block ``layers.{i}``, the embedding ``embed``, or ``head`` (final norm and LM head)."""
    if name.startswith("layers."):
        return ".".join(name.split(".")[:2])
    return "embed" if name == EMBED else "head"


def stage_units(names: list[str]) -> list[tuple[str, list[str]]]:
    """``(unit, parameter names)`` of a stage's parameters ``names`` (forward order), in the
    order their first parameter comes."""
    by_unit: dict[str, list[str]] = {}
    for name in names:
        by_unit.setdefault(unit_of(name), []).append(name)
    return list(by_unit.items())


def init_param(spec: ParamSpec, cfg: ModelConfig, seed: int) -> np.ndarray:
    """The global float64 initial value of one parameter (independent of layout): norm weights
    ones (zeros with ``norm_unit_offset``: the norm multiplies by 1 + w), biases zeros,
    matrices normal."""
    if spec.name.endswith(".bias"):
        return np.zeros(spec.shape)
    if len(spec.shape) == 1:
        return np.zeros(spec.shape) if cfg.norm_unit_offset else np.ones(spec.shape)
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    std = cfg.init_std
    if spec.name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        std = cfg.init_std / math.sqrt(2 * cfg.layers)  # residual-branch outputs (GPT-2 scaling)
    return rng.normal(0.0, std, size=spec.shape)


def init_params(cfg: ModelConfig, seed: int, dtype: np.dtype) -> dict[str, np.ndarray]:
    """Every parameter's initial global tensor, cast to ``dtype`` (a single process's model)."""
    return {spec.name: init_param(spec, cfg, seed).astype(dtype) for spec in param_specs(cfg)}
