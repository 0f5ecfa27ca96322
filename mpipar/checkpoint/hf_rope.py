"""RoPE scaling in Hugging Face configs: the ``rope_scaling`` / ``rope_parameters`` object mpipar
writes for a scaled RoPE, and yarn's fields read.

yarn (``rope_type`` or ``type`` ``"yarn"``: DeepSeek-V3's released checkpoints, Qwen3's
long-context configs) reads ``factor`` (the common reader's), ``original_max_position_embeddings``
(a top-level field if there is one, as transformers gives it precedence, else the scaling's; it
must be given: mpipar does not guess the pretraining context from ``max_position_embeddings``),
``beta_fast`` and ``beta_slow`` (32 and 1 when absent or null, as transformers defaults them;
``beta_fast`` must exceed ``beta_slow``), ``mscale`` and ``mscale_all_dim`` (0 when absent: unset).
An explicit ``attention_factor`` and ``truncate: false`` are refused by name: mpipar derives the
attention factor from the mscales and truncates the correction range, as transformers does by
default. The writer gives beta and mscale fields only where they differ from those defaults, so a
read config is written back as it was.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from mpipar.config import ModelConfig

BETA_FAST, BETA_SLOW = 32.0, 1.0
"""transformers' defaults of yarn's ``beta_fast`` and ``beta_slow``."""


def _number(params: Mapping[str, Any], name: str, field: str, default: float, low: float
            ) -> float:
    value = params.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < low:
        raise ValueError(f"{field}.{name}={value!r} must be a number >= {low:g}")
    return float(value)


def read_yarn(raw: Mapping[str, Any], params: Mapping[str, Any], field: str
              ) -> tuple[str, dict[str, Any]]:
    """(a reading, ModelConfig fields) of a yarn scaling ``params`` found under ``field`` of
    config ``raw``, its pretraining context included; ValueError naming the field otherwise."""
    positions = raw.get("original_max_position_embeddings",
                        params.get("original_max_position_embeddings"))
    if positions is None:
        raise ValueError(f"{field}.original_max_position_embeddings is missing: yarn RoPE needs "
                         f"the pretraining context")
    if params.get("attention_factor") is not None:
        raise ValueError(f"{field}.attention_factor={params['attention_factor']!r} is not "
                         f"supported; mpipar derives yarn's attention factor from factor, "
                         f"mscale and mscale_all_dim")
    if params.get("truncate", True) is not True:
        raise ValueError(f"{field}.truncate={params['truncate']!r} is not supported; mpipar "
                         f"truncates yarn's correction range (true)")
    out = {"rope_original_max_positions": positions,
           "rope_beta_fast": _number(params, "beta_fast", field, BETA_FAST, 0) or BETA_FAST,
           "rope_beta_slow": _number(params, "beta_slow", field, BETA_SLOW, 0) or BETA_SLOW,
           "rope_mscale": _number(params, "mscale", field, 0.0, 0),
           "rope_mscale_all_dim": _number(params, "mscale_all_dim", field, 0.0, 0)}
    if not out["rope_beta_fast"] > out["rope_beta_slow"]:
        raise ValueError(f"{field}.beta_fast={out['rope_beta_fast']:g} must be above "
                         f"beta_slow={out['rope_beta_slow']:g}")
    return (f", beta fast/slow {out['rope_beta_fast']:g}/{out['rope_beta_slow']:g}, mscale "
            f"{out['rope_mscale']:g}, mscale_all_dim {out['rope_mscale_all_dim']:g}"), out


def scaling_fields(m: ModelConfig) -> dict[str, Any]:
    """transformers' scaling parameters of ``m``'s RoPE (empty for plain RoPE)."""
    if not m.rope.scales:
        return {}
    out: dict[str, Any] = {"rope_type": m.rope_type, "factor": m.rope_factor}
    if m.rope.frequency_band:
        out.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
                   original_max_position_embeddings=m.rope_original_max_positions)
    if m.rope.correction_range:
        out["original_max_position_embeddings"] = m.rope_original_max_positions
        out.update({k: v for k, v in (("beta_fast", m.rope_beta_fast),
                                      ("beta_slow", m.rope_beta_slow),
                                      ("mscale", m.rope_mscale),
                                      ("mscale_all_dim", m.rope_mscale_all_dim))
                    if v != {"beta_fast": BETA_FAST, "beta_slow": BETA_SLOW}.get(k, 0.0)})
    return out
