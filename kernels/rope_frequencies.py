"""RoPE inverse frequencies under transformers' scaling rules, and yarn's magnitude factors.

Host NumPy in float64 throughout (transformers computes the same rules in float32,
``modeling_rope_utils``): :func:`rope_inv_freq` for every rule of :data:`ROPE_SCALINGS`,
:func:`rope_attention_factor` (what a rule multiplies the cos and sin tables by: 1 except under
yarn) and :func:`yarn_mscale` (yarn's ``0.1 m ln s + 1``, which DeepSeek-V3's attention also
applies to its softmax scale). The tables themselves are :func:`numpy_ref.rope_cos_sin`'s.
"""
from __future__ import annotations

import math

import numpy as np

ROPE_SCALINGS = ("default", "linear", "dynamic", "llama3", "yarn")
"""RoPE frequency rules of :func:`rope_inv_freq` (transformers' ``rope_type`` names)."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"rope_cos_sin: {message}")


def rope_inv_freq(head_dim: int, theta: float, scaling: str = "default", factor: float = 1.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_positions: int = 0, seq_len: int = 0, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> np.ndarray:
    """RoPE inverse frequencies `[head_dim // 2]`, float64 (host NumPy), under a scaling rule.

    default: ``theta ** (-2i / head_dim)``. linear: those divided by ``factor`` (positions
    stretched by ``factor``). dynamic (NTK): for ``seq_len`` beyond ``original_max_positions``,
    theta becomes ``theta * (factor * seq_len / original - (factor - 1)) ** (d / (d - 2))``;
    otherwise default. llama3 (Llama 3.1): with wavelengths ``2 pi / f``, the frequencies whose
    wavelength exceeds ``original / low_freq_factor`` are divided by ``factor``, those below
    ``original / high_freq_factor`` kept, and those between interpolated:
    ``(1 - s) f / factor + s f`` with ``s = (original / wavelength - low) / (high - low)``.
    yarn: ``f / factor`` blended with ``f`` by a linear ramp over frequency index ``i``:
    ``(1 - e) f / factor + e f`` with ``e = 1 - clip((i - lo) / (hi - lo), 0, 1)``, where the
    correction range ``[lo, hi]`` holds the dimensions that turn ``beta_fast`` and ``beta_slow``
    times over ``original_max_positions`` (``d ln(original / (2 pi beta)) / (2 ln theta)``,
    floored and ceiled, clipped to ``[0, d - 1]``; ``hi`` is nudged by 0.001 when equal).
    These are transformers' rules (``modeling_rope_utils``), here in float64 throughout.
    """
    _check(head_dim > 0 and head_dim % 2 == 0, f"head_dim={head_dim} must be positive and even")
    _check(theta > 0, f"theta={theta} must be > 0")
    _check(scaling in ROPE_SCALINGS,
           f"scaling={scaling!r} must be one of {', '.join(ROPE_SCALINGS)}")
    _check(scaling == "default" or factor > 0, f"factor={factor} must be > 0")
    exponent = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    if scaling == "dynamic":
        _check(original_max_positions >= 1, f"original_max_positions={original_max_positions} "
                                            f"must be >= 1 for dynamic scaling")
        if seq_len > original_max_positions:
            theta = theta * (factor * seq_len / original_max_positions - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = theta ** -exponent
    if scaling == "linear":
        return inv_freq / factor
    if scaling == "llama3":
        _check(original_max_positions >= 1 and 0 < low_freq_factor < high_freq_factor,
               f"llama3 scaling needs original_max_positions >= 1 (got {original_max_positions}) "
               f"and 0 < low_freq_factor < high_freq_factor (got {low_freq_factor}, {high_freq_factor})")
        wavelength = 2 * math.pi / inv_freq
        smooth = (original_max_positions / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
        between = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        long = wavelength > original_max_positions / low_freq_factor
        short = wavelength < original_max_positions / high_freq_factor
        return np.where(long, inv_freq / factor, np.where(short, inv_freq, between))
    if scaling == "yarn":
        _check(original_max_positions >= 1 and beta_fast > beta_slow > 0,
               f"yarn scaling needs original_max_positions >= 1 (got {original_max_positions}) "
               f"and beta_fast > beta_slow > 0 (got {beta_fast}, {beta_slow})")

        def dimension(rotations: float) -> float:
            return head_dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo = max(math.floor(dimension(beta_fast)), 0)
        hi = min(math.ceil(dimension(beta_slow)), head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - lo) / ((hi + 0.001 if hi == lo else hi) - lo), 0, 1)
        kept = 1 - ramp
        return inv_freq / factor * (1 - kept) + inv_freq * kept
    return inv_freq


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """yarn's magnitude factor ``0.1 mscale ln(scale) + 1`` (1 for ``scale`` <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(scaling: str, factor: float = 1.0, mscale: float = 0.0,
                          mscale_all_dim: float = 0.0) -> float:
    """What the rule multiplies the cos and sin tables by: 1, except under yarn
    ``yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)`` when both are set
    (non-zero), else ``yarn_mscale(factor)`` (transformers' ``attention_factor``)."""
    if scaling != "yarn":
        return 1.0
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)
