"""AdamW, gradient-norm clipping and learning-rate schedules.

Nothing here talks to MPI: the engine sums `grad_norm_sq` over its groups, takes the square
root and passes the global norm to `clip_grads`. Arrays may be numpy or cupy; the array module
is taken from the arrays themselves. All updates are in place and in the arrays' dtype.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


def _array_module(a: Any) -> Any:
    """numpy, or cupy for cupy arrays (without importing cupy otherwise)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


@dataclass
class AdamWConfig:
    """AdamW hyper-parameters (decoupled weight decay, as torch.optim.AdamW)."""

    lr: float
    """Peak learning rate; the schedule may scale it per step."""
    beta1: float = 0.9
    """Decay rate of the first moment (mean of gradients)."""
    beta2: float = 0.95
    """Decay rate of the second moment (mean of squared gradients)."""
    eps: float = 1e-8
    """Added to the bias-corrected root of the second moment."""
    weight_decay: float = 0.1
    """Decoupled decay: each step multiplies decayed parameters by 1 - lr * weight_decay."""

    def __post_init__(self) -> None:
        if not self.lr >= 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")


def adamw_update(p: Any, g: Any, m: Any, v: Any, step: int, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float) -> None:
    """One AdamW step, in place on `p` (parameters), `m`, `v` (moments), all the same shape.

    `step` is the 1-based count of updates including this one (bias correction uses
    beta**step). Works on arrays of any shape, including views into flat buffers:

        p *= 1 - lr * weight_decay
        m  = beta1 * m + (1 - beta1) * g
        v  = beta2 * v + (1 - beta2) * g * g
        p -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

    Scalars are Python floats, so the arithmetic stays in the arrays' dtype.
    """
    if not p.shape == g.shape == m.shape == v.shape:
        raise ValueError(f"adamw_update needs equal shapes, got p {p.shape}, g {g.shape}, "
                         f"m {m.shape}, v {v.shape}")
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count including this update), got {step}")
    xp = _array_module(p)
    if weight_decay != 0:
        p *= 1.0 - lr * weight_decay
    scratch = xp.empty_like(m)
    xp.multiply(g, 1.0 - beta1, out=scratch)
    m *= beta1
    m += scratch
    xp.multiply(g, g, out=scratch)
    scratch *= 1.0 - beta2
    v *= beta2
    v += scratch
    xp.sqrt(v, out=scratch)
    scratch /= math.sqrt(1.0 - beta2 ** step)
    scratch += eps
    xp.divide(m, scratch, out=scratch)
    scratch *= lr / (1.0 - beta1 ** step)
    p -= scratch


class AdamW:
    """AdamW over a dict of named parameters (whole tensors or this rank's shards).

    params: name -> array, any shape; the moments m, v are zero arrays of the same shape and dtype.
    decay: name -> whether weight decay applies; default True iff the array is at least 2-D
        (matrices and embeddings decay; norms' gains and biases do not). When `params` hold
        shards, pass the mask computed from the global shapes.
    """

    def __init__(self, params: Mapping[str, Any], cfg: AdamWConfig,
                 decay: Mapping[str, bool] | None = None):
        if decay is None:
            decay = {name: p.ndim >= 2 for name, p in params.items()}
        _check_names("decay mask", decay.keys(), params.keys())
        self.cfg = cfg
        self.decay = {name: bool(decay[name]) for name in params}
        self.m = {name: _array_module(p).zeros_like(p) for name, p in params.items()}
        self.v = {name: _array_module(p).zeros_like(p) for name, p in params.items()}
        self.step_count = 0

    def step(self, params: Mapping[str, Any], grads: Mapping[str, Any], lr: float) -> None:
        """Update every parameter in place with its gradient at learning rate `lr`."""
        _check_names("params", params.keys(), self.m.keys())
        _check_names("grads", grads.keys(), self.m.keys())
        self.step_count += 1
        cfg = self.cfg
        for name, p in params.items():
            wd = cfg.weight_decay if self.decay[name] else 0.0
            adamw_update(p, grads[name], self.m[name], self.v[name], self.step_count, lr,
                         cfg.beta1, cfg.beta2, cfg.eps, wd)

    def state_dict(self) -> dict:
        """{"step": int, "m": {name: array}, "v": {name: array}}; the arrays are the live
        moments (not copies), so save them before the next step."""
        return {"step": self.step_count, "m": dict(self.m), "v": dict(self.v)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a `state_dict` into this optimizer (moments keep their dtype and device).

        Raises ValueError when keys, parameter names or shapes differ."""
        missing = {"step", "m", "v"} - set(state)
        if missing:
            raise ValueError(f"optimizer state lacks keys {sorted(missing)} (needs step, m, v)")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"optimizer state step must be an integer >= 0, got {step!r}")
        for key in ("m", "v"):
            _check_names(f"optimizer state '{key}'", state[key].keys(), self.m.keys())
            for name, src in state[key].items():
                if tuple(src.shape) != tuple(self.m[name].shape):
                    raise ValueError(f"optimizer state '{key}' for {name} has shape {tuple(src.shape)}, "
                                     f"expected {tuple(self.m[name].shape)}")
        for key, dst in (("m", self.m), ("v", self.v)):
            for name, arr in dst.items():
                arr[...] = _array_module(arr).asarray(state[key][name], dtype=arr.dtype)
        self.step_count = int(step)


def _check_names(what: str, got: Any, expected: Any) -> None:
    got, expected = set(got), set(expected)
    if got != expected:
        raise ValueError(f"{what} names differ from the parameters: missing {sorted(expected - got)}, "
                         f"unexpected {sorted(got - expected)}")


def grad_norm_sq(grads: Mapping[str, Any], include: Callable[[str], bool] | None = None) -> float:
    """Sum of squares of this rank's gradients whose name passes `include` (default all),
    accumulated in float64. The global norm is sqrt of the sum over ranks."""
    total = 0.0
    for name in sorted(grads):
        if include is not None and not include(name):
            continue
        g = grads[name]
        flat = g.reshape(-1)
        if flat.dtype != np.float64:
            flat = flat.astype(np.float64)
        total += float(_array_module(flat).dot(flat, flat))
    return total


def clip_grads(grads: Mapping[str, Any], max_norm: float, total_norm: float) -> float:
    """Scale every gradient in place so that the global norm is at most `max_norm`.

    coef = min(1, max_norm / (total_norm + 1e-6)), as torch.nn.utils.clip_grad_norm_; gradients
    are multiplied only when coef < 1 (multiplying by 1.0 is exact). Clipping is off when
    max_norm <= 0. Returns the coefficient (1.0 when off). A non-finite or negative total_norm
    raises ValueError rather than silently zeroing or poisoning the gradients.
    """
    if max_norm <= 0:
        return 1.0
    if not (math.isfinite(total_norm) and total_norm >= 0):
        raise ValueError(f"total_norm must be finite and >= 0 to clip, got {total_norm}")
    coef = min(1.0, max_norm / (total_norm + 1e-6))
    if coef < 1.0:
        for g in grads.values():
            g *= coef
    return coef


@dataclass
class LRSchedule:
    """Learning rate of each optimizer step: linear warm-up, then constant or cosine decay."""

    kind: str
    """"constant" or "cosine"."""
    lr: float
    """Peak learning rate, reached at the end of warm-up."""
    min_lr: float = 0.0
    """Final learning rate of the cosine decay (ignored by "constant")."""
    warmup_steps: int = 0
    """Steps of linear warm-up: step s < warmup_steps gets lr * (s + 1) / warmup_steps."""
    total_steps: int = 1
    """Step at which the cosine reaches min_lr (and stays there)."""

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "cosine"):
            raise ValueError(f"kind must be 'constant' or 'cosine', got {self.kind!r}")
        if not self.lr >= 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must satisfy 0 <= min_lr <= lr = {self.lr}, got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")

    def __call__(self, step: int) -> float:
        """Learning rate for the optimizer step about to be taken (`step` is 0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / span))
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
