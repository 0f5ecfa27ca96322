"""The FFN's gated activation (``model.ffn_activation``): ``m = act(g) * u`` of the gate and up
projections, a kernel pair of :mod:`mpipar.kernels` each.

- ``silu``: SwiGLU (Llama, Qwen, Mistral), ``swiglu_fwd``/``swiglu_bwd``;
- ``gelu_tanh``: GeGLU with the tanh approximation of GELU (Gemma's ``gelu_pytorch_tanh``),
  ``geglu_fwd``/``geglu_bwd``.

The configuration resolves the name once (:attr:`mpipar.config.ModelConfig.activation`); the
dense FFN and a sparse block's shared expert call it. A mixture of experts' routed experts are
SwiGLU (the configuration refuses another activation with experts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Array = Any


@dataclass(frozen=True)
class FfnActivation:
    """One activation: its name, the kernels of its forward and backward and transformers'
    ``hidden_act`` names for it (the first is the one an export writes)."""

    name: str
    forward_kernel: str
    backward_kernel: str
    hf_names: tuple[str, ...]

    @staticmethod
    def named(name: str) -> FfnActivation:
        """The activation called ``name``; ValueError naming the value and the choices."""
        if name not in ACTIVATIONS:
            raise ValueError(f"ffn_activation={name!r}: must be one of "
                             f"{', '.join(FFN_ACTIVATIONS)}")
        return ACTIVATIONS[name]

    def __str__(self) -> str:
        return self.name

    def forward(self, kernels, g: Array, u: Array) -> Array:
        """``m = act(g) * u``."""
        return getattr(kernels, self.forward_kernel)(g, u)

    def backward(self, kernels, dm: Array, g: Array, u: Array) -> tuple[Array, Array]:
        """(dg, du) of :meth:`forward` given ``dm``."""
        return getattr(kernels, self.backward_kernel)(dm, g, u)


SILU = FfnActivation("silu", "swiglu_fwd", "swiglu_bwd", ("silu", "swish"))
GELU_TANH = FfnActivation("gelu_tanh", "geglu_fwd", "geglu_bwd",
                          ("gelu_pytorch_tanh", "gelu_tanh"))
ACTIVATIONS: dict[str, FfnActivation] = {a.name: a for a in (SILU, GELU_TANH)}
FFN_ACTIVATIONS = tuple(ACTIVATIONS)
"""The names ``model.ffn_activation`` accepts."""
