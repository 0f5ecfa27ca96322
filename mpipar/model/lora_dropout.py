"""LoRA dropout: PEFT's ``lora_B(lora_A(dropout(x))) * scale``, the base linear reading ``x``.

Training only: each element of an adapter's input is kept with probability ``1 - p`` and the
kept ones are divided by ``1 - p`` (inverted dropout, as ``torch.nn.Dropout``). The mask is not
drawn from a random stream: it is a function of where the element is in the run,

    keep(seed, step, layer, target, row, position, feature) = u >= p,
    u = SplitMix64(seed, step, layer, target; (row * seq_len + position) * width + feature)
        / 2**64

with ``row`` the sample's row in the step's global batch, ``position`` the token's position in
its sequence, ``feature`` the input column of the targeted linear and ``width`` its input width
(a counter-based generator: the counter is the element's global index, the key the rest). So
every layout (dp, tp, pp, sp, microbatching, recompute) draws the same mask for the same token
and column, and a recomputed forward and its backward draw the mask the forward drew. It has
the distribution of ``torch.nn.Dropout``'s mask, not its draws: a PEFT run and an mpipar run of
the same seed drop different elements.

:class:`LoraDropout` is the dropout of a run; the training step says which microbatch is being
computed (:meth:`LoraDropout.select`: the step and the microbatch's global rows); outside a
training microbatch (evaluation, generation, the DPO reference) nothing is dropped.
"""
from __future__ import annotations

from typing import Any

import numpy as np

Array = Any
_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _mix(z: Array) -> Array:
    """SplitMix64's output function on uint64 ``z`` (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _key(*parts: int) -> int:
    """One 64-bit key of the non-negative integers ``parts`` (SplitMix64 chained)."""
    k = 0
    for part in parts:
        z = (k + (int(part) + 1) * _GAMMA) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        k = z ^ (z >> 31)
    return k


def keep_mask(xp, p: float, key: tuple[int, ...], tokens: np.ndarray, features: range,
              width: int) -> Array:
    """Which elements of an adapter input ``[len(tokens), len(features)]`` are kept (bool,
    array module ``xp``): ``tokens`` the global token indices ``row * seq_len + position``,
    ``features`` the input columns held, of ``width`` in all; ``key`` (seed, step, layer,
    target index). Each element is kept with probability ``1 - p`` (module docstring)."""
    base = np.uint64(_key(*key))
    tok = xp.asarray(np.asarray(tokens, dtype=np.uint64) * np.uint64(width))
    col = xp.arange(features.start, features.stop, dtype=xp.uint64)
    with np.errstate(over="ignore"):
        counter = tok[:, None] + col[None, :] + np.uint64(1)
        u = _mix(base + counter * np.uint64(_GAMMA)) >> np.uint64(11)
    return u >= np.uint64(int(np.ceil(p * 2.0 ** 53)))


class LoraDropout:
    """The adapters' dropout of a run: probability ``p``, ``seed``, whole sequences of
    ``seq_len`` tokens; ``targets``: the target names in their fixed order (the mask's key
    holds a target's index). Inactive until :meth:`select` names a training microbatch."""

    def __init__(self, xp, p: float, seed: int, seq_len: int, targets: tuple[str, ...]) -> None:
        self.xp, self.p, self.seed, self.seq_len = xp, p, seed, seq_len
        self.targets = {t: i for i, t in enumerate(targets)}
        self.tokens: np.ndarray | None = None
        self.step = 0

    def select(self, step: int | None, rows: np.ndarray | None = None,
               positions: np.ndarray | None = None) -> None:
        """Drop on step ``step``'s microbatch of global batch rows ``rows`` ``[B]``, this rank's
        tokens at global ``positions`` ``[S_loc]``; ``step`` None: drop nothing."""
        if step is None:
            self.tokens = None
            return
        self.step = step
        pos = np.asarray(positions, dtype=np.int64)
        self.tokens = (np.asarray(rows, dtype=np.int64)[:, None] * self.seq_len
                       + pos[None, :]).reshape(-1)

    @property
    def active(self) -> bool:
        return self.tokens is not None

    def factor(self, name: str, x: Array, first: int, width: int) -> Array | None:
        """The dropout factor (mask / (1 - p), ``x``'s shape and dtype) of weight ``name``'s
        adapter input ``x`` ``[..., F]`` (its columns ``[first, first + F)`` of ``width``;
        tokens in row-major order of the microbatch), or None while inactive."""
        if self.tokens is None:
            return None
        target = name.split(".")[-2]
        key = (self.seed, self.step, int(name.split(".")[1]), self.targets[target])
        f = x.shape[-1]
        if x.size // f != len(self.tokens):
            raise ValueError(f"{name}: an adapter input of {x.size // f} tokens, the "
                             f"microbatch selected has {len(self.tokens)}")
        keep = keep_mask(self.xp, self.p, key, self.tokens, range(first, first + f), width)
        return (keep.astype(x.dtype) * x.dtype.type(1.0 / (1.0 - self.p))).reshape(x.shape)
