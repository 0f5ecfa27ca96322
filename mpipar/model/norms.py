"""Where a decoder block's RMSNorms sit (``model.norm_placement``) and their form
(``model.norm_unit_offset``).

Placements (a :class:`NormPlacement`; the configuration resolves the name once,
:attr:`mpipar.config.ModelConfig.norms`):

- ``pre`` (Llama): ``input_layernorm`` before attention and ``post_attention_layernorm`` (in
  Llama's naming the norm *before* the FFN, on the residual stream after attention);
- ``sandwich`` (Gemma 2 and 3): four norms, transformers' Gemma names: ``input_layernorm``
  before attention, ``post_attention_layernorm`` on the attention's output (after o_proj)
  before it joins the residual stream, ``pre_feedforward_layernorm`` before the FFN and
  ``post_feedforward_layernorm`` on the FFN's output before it joins the stream::

      x2 = x + N_pa(attention(N_in(x)))        out = x2 + N_pf(ffn(N_ff(x2)))

The two output norms are per token, on the stream's tokens as the block holds them (token
shards under ``--tp-sequence-parallel``, whole and identical on every tp rank otherwise), so
they need no communication and are placed as the other norms (``replicated``,
:mod:`mpipar.parallel.placement`). Their record (:class:`PostNormSaved`: each input and its
``rstd``) is kept by every recompute mode that keeps the attention output (it is one stream's
worth per norm).

Form: with ``norm_unit_offset`` every RMSNorm of the model (the blocks', the final norm and the
per-head q/k norms) multiplies by ``1 + w`` instead of ``w`` (Gemma's), so its weights start at
0; the gradient with respect to ``w`` is the one with respect to ``1 + w``. The norms apply in
the kernels' own dtype recipe: ``(x * rstd) * (1 + w)``, with the float64 test reference
computing transformers' formula in float64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Array = Any

INPUT = "input_layernorm.weight"
POST_ATTENTION = "post_attention_layernorm.weight"
PRE_FFN = "pre_feedforward_layernorm.weight"
POST_FFN = "post_feedforward_layernorm.weight"
"""A block's norm weights (``layers.{i}.`` + these names), each ``[hidden]``."""


@dataclass(frozen=True)
class NormPlacement:
    """One placement. ``sandwich``: the attention's and the FFN's outputs are normalised too."""

    name: str
    sandwich: bool = False

    @staticmethod
    def named(name: str) -> NormPlacement:
        """The placement called ``name``; ValueError naming the value and the choices."""
        if name not in PLACEMENTS:
            raise ValueError(f"norm_placement={name!r}: must be one of "
                             f"{', '.join(NORM_PLACEMENTS)}")
        return PLACEMENTS[name]

    def __str__(self) -> str:
        return self.name

    @property
    def pre_ffn(self) -> str:
        """The weight of the norm before the FFN (on the residual stream after attention)."""
        return PRE_FFN if self.sandwich else POST_ATTENTION

    @property
    def block_norms(self) -> tuple[str, ...]:
        """Every norm weight of a block, in forward order."""
        return (INPUT, POST_ATTENTION, PRE_FFN, POST_FFN) if self.sandwich else \
            (INPUT, POST_ATTENTION)

    @property
    def per_block(self) -> int:
        """How many RMSNorms over the hidden width a block has."""
        return len(self.block_norms)


PRE = NormPlacement("pre")
SANDWICH = NormPlacement("sandwich", sandwich=True)
PLACEMENTS: dict[str, NormPlacement] = {p.name: p for p in (PRE, SANDWICH)}
NORM_PLACEMENTS = tuple(PLACEMENTS)
"""The names ``model.norm_placement`` accepts."""


def norm_weight(params, name: str, unit_offset: bool) -> Array:
    """The factor RMSNorm ``name`` multiplies by: its weight, or ``1 + w`` with
    ``unit_offset`` (for a bfloat16 weight computed and kept in float32, as transformers'
    ``1.0 + weight.float()``: the kernels' bf16 recipe upcasts the weight anyway)."""
    w = params[name]
    if not unit_offset:
        return w
    if w.dtype.name == "bfloat16":
        w = w.astype("float32")
    return w + w.dtype.type(1)


@dataclass
class PostNormSaved:
    """What the sandwich's two output norms keep for backward: the attention's output after
    o_proj ``a`` and its ``rstd``, the FFN's output ``y`` and its ``rstd``."""

    a: Array
    rstd_a: Array
    y: Array | None = None
    rstd_y: Array | None = None


def post_norm_fwd(kernels, params, name: str, x: Array, eps: float, unit_offset: bool
                  ) -> tuple[Array, Array]:
    """RMSNorm ``name`` (``layers.{i}.`` included) of a branch's output ``x`` -> (normed,
    rstd)."""
    return kernels.rmsnorm_fwd(x, norm_weight(params, name, unit_offset), eps)


def post_norm_bwd(kernels, params, grads, name: str, dy: Array, x: Array, rstd: Array,
                  unit_offset: bool) -> Array:
    """The gradient of :func:`post_norm_fwd`'s input ``x``; its weight's accumulated."""
    dx, dw = kernels.rmsnorm_bwd(dy, x, norm_weight(params, name, unit_offset), rstd)
    grads[name] += dw
    return dx
