"""The attention scale (``model.query_pre_attn_scalar``, Gemma's): scores are
``q.k / sqrt(query_pre_attn_scalar)`` instead of ``q.k / sqrt(head_dim)``.

Every attention core and kernel scales by ``1/sqrt(head_dim)``; a model with another scale has
its queries multiplied by ``c = sqrt(head_dim / query_pre_attn_scalar)`` after RoPE (and the
queries' gradient by ``c`` before RoPE's backward), which gives the same scores on every core
(local, ring, zigzag, Ulysses, the KV cache) without the scale travelling with them. With
``query_pre_attn_scalar`` 0 or equal to ``head_dim``, ``c`` is 1 and nothing is multiplied.
"""
from __future__ import annotations

import math
from typing import Any

Array = Any


def query_factor(head_dim: int, query_pre_attn_scalar: float) -> float:
    """``c``: 1 when the scale is ``1/sqrt(head_dim)``, else ``sqrt(head_dim / scalar)``."""
    if query_pre_attn_scalar in (0, head_dim):
        return 1.0
    return math.sqrt(head_dim / query_pre_attn_scalar)


def scale_queries(q: Array, factor: float) -> Array:
    """``q`` (or its gradient) times ``factor`` in its own dtype (no copy when 1)."""
    return q if factor == 1.0 else q * q.dtype.type(factor)
