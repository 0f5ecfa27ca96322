"""Parameter names, global shapes, initialisation and tensor-parallel sharding.

Names follow Hugging Face Llama without the ``model.`` prefix; matrices are ``[out, in]`` as in
``torch.nn.Linear``. Every parameter is initialised as its *global* tensor from a generator seeded
by ``(seed, crc32(name))`` and then sliced, so every layout starts from the same numbers.

TP sharding (Megatron): q/k/v/gate/up are column-parallel (rows of ``[out, in]`` split, i.e. whole
heads), o/down are row-parallel (columns split), the embedding and LM head are vocab-parallel
(rows split after padding the vocabulary up to a multiple of tp with zero rows). Norm weights are
replicated.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from mpipar.config import ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: global shape, TP-sharded axis (None = replicated) and owning block."""

    name: str
    shape: tuple[int, ...]
    tp_axis: int | None
    layer: int | None  # block index; None for embedding, final norm and head

    @property
    def vocab_parallel(self) -> bool:
        return self.name in ("embed_tokens.weight", "lm_head.weight")


def block_param_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    """Specs of decoder block ``i``."""
    h, q, kv, f = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden
    p = f"layers.{i}."
    return [
        ParamSpec(p + "input_layernorm.weight", (h,), None, i),
        ParamSpec(p + "self_attn.q_proj.weight", (q, h), 0, i),
        ParamSpec(p + "self_attn.k_proj.weight", (kv, h), 0, i),
        ParamSpec(p + "self_attn.v_proj.weight", (kv, h), 0, i),
        ParamSpec(p + "self_attn.o_proj.weight", (h, q), 1, i),
        ParamSpec(p + "post_attention_layernorm.weight", (h,), None, i),
        ParamSpec(p + "mlp.gate_proj.weight", (f, h), 0, i),
        ParamSpec(p + "mlp.up_proj.weight", (f, h), 0, i),
        ParamSpec(p + "mlp.down_proj.weight", (h, f), 1, i),
    ]


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter of the model, in forward order."""
    cfg = cfg.resolved()
    specs = [ParamSpec("embed_tokens.weight", (cfg.vocab_size, cfg.hidden), 0, None)]
    for i in range(cfg.layers):
        specs += block_param_specs(cfg, i)
    specs += [ParamSpec("norm.weight", (cfg.hidden,), None, None),
              ParamSpec("lm_head.weight", (cfg.vocab_size, cfg.hidden), 0, None)]
    return specs


def stage_param_names(cfg: ModelConfig, layers: range, first: bool, last: bool) -> list[str]:
    """Parameters of a pipeline stage holding blocks ``layers``, plus the embedding (``first``)
    and the final norm and LM head (``last``), in forward order."""
    names = ["embed_tokens.weight"] if first else []
    for i in layers:
        names += [s.name for s in block_param_specs(cfg, i)]
    return names + (["norm.weight", "lm_head.weight"] if last else [])


def param_stage(spec: ParamSpec, layers: int, p: int, v: int = 1) -> int:
    """Global virtual stage holding ``spec``: its block's stage (``layers / (p*v)`` blocks a
    stage), the embedding on stage 0, the final norm and LM head on the last."""
    if spec.layer is None:
        return 0 if spec.name == "embed_tokens.weight" else p * v - 1
    return spec.layer // (layers // (p * v))


def init_param(spec: ParamSpec, cfg: ModelConfig, seed: int) -> np.ndarray:
    """The global float64 initial value of one parameter (independent of layout)."""
    if len(spec.shape) == 1:
        return np.ones(spec.shape)
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    std = cfg.init_std
    if spec.name.endswith(("o_proj.weight", "down_proj.weight")):
        std = cfg.init_std / math.sqrt(2 * cfg.layers)  # residual-branch outputs (GPT-2 scaling)
    return rng.normal(0.0, std, size=spec.shape)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp (padding rows are zero and never used)."""
    return -(-vocab_size // tp) * tp


def shard(spec: ParamSpec, value: np.ndarray, tp_rank: int, tp_size: int) -> np.ndarray:
    """This TP rank's slice of a global parameter (vocab-parallel ones padded first)."""
    if spec.tp_axis is None or tp_size == 1:
        return np.ascontiguousarray(value)
    if spec.vocab_parallel:
        pad = padded_vocab(value.shape[0], tp_size) - value.shape[0]
        if pad:
            value = np.concatenate([value, np.zeros((pad,) + value.shape[1:], value.dtype)])
    n = value.shape[spec.tp_axis] // tp_size
    index = [slice(None)] * value.ndim
    index[spec.tp_axis] = slice(tp_rank * n, (tp_rank + 1) * n)
    return np.ascontiguousarray(value[tuple(index)])


def unshard(spec: ParamSpec, pieces: list[np.ndarray]) -> np.ndarray:
    """Inverse of :func:`shard`: join the TP slices (in tp-rank order) and drop vocab padding."""
    if spec.tp_axis is None:
        return pieces[0]
    full = np.concatenate(pieces, axis=spec.tp_axis)
    if spec.vocab_parallel:
        full = full[: spec.shape[0]]
    return full


def init_params(cfg: ModelConfig, seed: int, dtype: np.dtype, names: set[str] | None = None,
                tp_rank: int = 0, tp_size: int = 1) -> dict[str, np.ndarray]:
    """Initial local shards of the parameters in ``names`` (all when None), cast to ``dtype``."""
    cfg = cfg.resolved()
    out = {}
    for spec in param_specs(cfg):
        if names is None or spec.name in names:
            out[spec.name] = shard(spec, init_param(spec, cfg, seed).astype(dtype), tp_rank, tp_size)
    return out
