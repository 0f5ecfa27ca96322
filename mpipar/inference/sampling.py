"""How generation picks the next token from the logits: greedy, or sampled with temperature,
top-k and top-p (nucleus) from a seeded generator.

:func:`next_token` is a pure function of the logits and one uniform draw:

- ``temperature == 0``: the argmax (the lowest id among equal maxima), no draw;
- otherwise the logits are divided by the temperature and the tokens ordered by decreasing
  logit (ties by increasing id); ``top_k`` keeps the first ``k`` (0: all); ``top_p`` keeps the
  shortest prefix whose probability reaches ``p`` (1: all; at least one token); one uniform
  ``u`` in ``[0, 1)`` from the generator picks the first token whose cumulative renormalised
  probability exceeds ``u``.

Every rank of a generation run holds the same logits and a generator seeded alike, so every
rank picks the same token without any message (:mod:`mpipar.generate`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (see the module docstring); errors name the flags of
    ``python -m mpipar.generate``."""

    temperature: float = 1.0   # 0: greedy
    top_k: int = 0             # 0: no limit
    top_p: float = 1.0         # 1: no limit

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"--temperature {self.temperature}: must be >= 0 (0 is greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"--top-k {self.top_k!r}: must be an integer >= 0 (0: no limit)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p}: must be in (0, 1] (1: no limit)")


def candidates(logits: np.ndarray, sampling: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, their renormalised probabilities) that ``sampling`` keeps, in decreasing
    order of probability; ``logits`` ``[V]``. Temperature must be > 0."""
    z = np.asarray(logits, dtype=np.float64)
    order = np.argsort(-z, kind="stable")
    if sampling.top_k:
        order = order[:sampling.top_k]
    scaled = z[order] / sampling.temperature
    prob = np.exp(scaled - scaled[0])
    prob /= prob.sum()
    if sampling.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(prob), sampling.top_p, side="left")) + 1
        order, prob = order[:keep], prob[:keep] / prob[:keep].sum()
    return order, prob


def next_token(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """The next token of ``logits`` ``[V]`` (module docstring); draws one uniform from ``rng``
    unless greedy."""
    if sampling.temperature == 0:
        return int(np.argmax(logits))
    ids, prob = candidates(logits, sampling)
    pick = int(np.searchsorted(np.cumsum(prob), rng.random(), side="right"))
    return int(ids[min(pick, ids.size - 1)])
