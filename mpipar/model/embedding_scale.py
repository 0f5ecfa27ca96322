"""The embedding's output scale (``model.embed_scale``, Gemma's): the rows the embedding looks
up are multiplied by ``sqrt(hidden)`` before the first block.

The factor is transformers' exactly: ``sqrt(hidden)`` held as a float32 scalar, cast to the
activations' dtype, then multiplied in that dtype (``Gemma3TextScaledWordEmbedding``: a float32
buffer ``.to(weight.dtype)``), so ``sqrt(1152)`` is the float32 nearest to it even in a float64
model. It scales the embedding's use only: a tied LM head multiplies by the unscaled matrix.
Backward multiplies the stream's gradient by the same factor before the embedding's backward.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

Array = Any


def embedding_factor(hidden: int, dtype: Any) -> Any:
    """``sqrt(hidden)`` rounded to float32, then to ``dtype`` (a scalar of that dtype)."""
    return np.asarray(np.float32(math.sqrt(hidden))).astype(dtype)[()]


def scale_embedding(x: Array, hidden: int) -> Array:
    """The embedding's output ``x`` times :func:`embedding_factor` in ``x``'s dtype."""
    return x * embedding_factor(hidden, x.dtype)
