"""Muon's math, as ``torch.optim.Muon`` defines it, and which parameters it updates.

Muon (``--optimizer muon``) updates each 2-D weight of the decoder blocks with an orthogonalised
momentum; every other parameter keeps AdamW (:mod:`mpipar.training.optim`). For a matrix with
gradient ``g`` (the clipping coefficient applied first), momentum buffer ``buf``, momentum
``mu`` and learning rate ``lr``::

    buf <- buf + (1 - mu) (g - buf)                       (lerp)
    u    = g + mu (buf - g)    with Nesterov, else buf
    O    = NS(u)                                          (Newton-Schulz, below)
    w   <- w (1 - lr wd)                                  (decoupled weight decay)
    w   <- w - lr adjust(rows, cols) O

``NS``: ``X = u / max(||u||_F, 1e-7)``, transposed when it has more rows than columns, then
``steps`` quintic iterations ``A = X X^T``, ``B = b A + c A A``, ``X = a X + B X`` with
``(a, b, c) = (3.4445, -4.7750, 2.0315)``, transposed back. The iterations are GEMMs in the
arrays' dtype (float64 exact in float64). ``adjust``: ``original`` sqrt(max(1, rows / cols))
(Keller Jordan's), ``match_rms_adamw`` 0.2 sqrt(max(rows, cols)) (Moonshot's).

Which matrices: every 2-D weight named inside a decoder block (q, k, v, o, gate, up, down, each
as Hugging Face stores it; every expert's w1, w3, w2; the shared expert's), not the routers
(``block_sparse_moe.gate``, ``mlp.shared_expert_gate``): they route, AdamW updates them.

Everything here is array code on NumPy or CuPy (the arrays' module) and talks to no MPI; the
distributed optimizer around it is :mod:`mpipar.training.muon_parallel`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpipar.kernels.numpy_ref import array_module

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic Newton-Schulz iteration (torch.optim.Muon's defaults)."""
NS_EPS = 1e-7
"""The floor of the Frobenius norm the update is divided by."""
ROUTERS = ("block_sparse_moe.gate.weight", "mlp.shared_expert_gate.weight")
"""2-D block weights that route or gate rather than transform: AdamW's."""


@dataclass(frozen=True)
class AdjustLR:
    """A rule scaling Muon's learning rate by the matrix's global shape (``--muon-adjust-lr``)."""

    name: str
    rule: Callable[[int, int], float]
    """rows, cols -> the factor multiplying ``lr``."""

    def ratio(self, rows: int, cols: int) -> float:
        """The factor multiplying ``lr`` for a ``rows x cols`` matrix."""
        return self.rule(rows, cols)


ADJUST_LR = {
    # Keller Jordan's Muon.
    "original": AdjustLR("original", lambda r, c: math.sqrt(max(1.0, r / c))),
    # Moonshot's: the update's RMS matches AdamW's, so AdamW's lr and decay carry over.
    "match_rms_adamw": AdjustLR("match_rms_adamw", lambda r, c: 0.2 * math.sqrt(max(r, c))),
}
"""The ``--muon-adjust-lr`` rules by name (the config field's choices, in this order)."""


@dataclass(frozen=True)
class MuonConfig:
    """Muon's hyper-parameters (``--muon-*``); lr and weight decay are AdamW's."""

    momentum: float = 0.95
    ns_steps: int = 5
    nesterov: bool = True
    adjust: AdjustLR = ADJUST_LR["original"]

    def problem(self) -> str | None:
        """The first broken rule, as ``field=value: rule``, or None."""
        if not 0 <= self.momentum < 1:
            return f"muon_momentum={self.momentum}: must be in [0, 1)"
        if self.ns_steps <= 0:
            return f"muon_ns_steps={self.ns_steps}: must be >= 1"
        return None


def is_muon_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """Whether Muon updates parameter ``name`` of global ``shape``: a 2-D weight of a decoder
    block, not a router."""
    return (len(shape) == 2 and name.startswith("layers.") and name.endswith(".weight")
            and not name.endswith(ROUTERS))


def momentum_update(buf: Any, g: Any, momentum: float, nesterov: bool,
                    scale: float = 1.0) -> Any:
    """Advance the momentum buffer ``buf`` in place with gradient ``g`` (times ``scale``, the
    clipping coefficient) and return the update Newton-Schulz orthogonalises (a new array):
    ``g + mu (buf - g)`` with Nesterov, else a copy of ``buf``. Elementwise: any shape, any
    slice of a matrix."""
    if scale != 1.0:
        g = g * scale
    xp = array_module(buf)
    diff = xp.subtract(g, buf)
    diff *= 1.0 - momentum
    buf += diff
    if not nesterov:
        return buf.copy()
    out = xp.subtract(buf, g)
    out *= momentum
    out += g
    return out


def newton_schulz(u: Any, steps: int, eps: float = NS_EPS,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS) -> Any:
    """The orthogonalised ``u`` (2-D, a new array in its dtype): ``steps`` quintic iterations
    on ``u / max(||u||_F, eps)``, on the transpose when ``u`` has more rows than columns."""
    if u.ndim != 2:
        raise ValueError(f"newton_schulz needs a matrix, got shape {u.shape}")
    xp = array_module(u)
    a, b, c = coefficients
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / max(float(xp.linalg.norm(x)), eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = gram @ gram
        poly *= c
        poly += b * gram
        nxt = poly @ x
        nxt += a * x
        x = nxt
    return xp.ascontiguousarray(x.T if tall else x)


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of :func:`newton_schulz` on a ``rows x cols`` matrix (m = min, n = max): per
    iteration ``X X^T`` 2 m^2 n, ``A A`` 2 m^3, ``B X`` 2 m^2 n."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def apply_update(p: Any, o: Any, lr: float, weight_decay: float, ratio: float) -> None:
    """``p <- p (1 - lr wd) - lr ratio o``, in place (any shape; ``o`` the orthogonalised
    update's matching part)."""
    if weight_decay != 0:
        p *= 1.0 - lr * weight_decay
    p -= (lr * ratio) * o
