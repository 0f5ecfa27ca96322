"""The RoPE frequency scalings (``model.rope_type``, transformers' ``rope_type`` names).

A scaling is a :class:`RopeScaling` that says which of the model's RoPE fields it reads and
how it depends on the sequence; the configuration's rules, the Hugging Face reader and writer
and the document-packing rule ask it instead of comparing its name, and the model asks it for
the tables' arguments (:meth:`RopeScaling.table_arguments`). The frequencies and magnitude
factors themselves are the kernels' (:mod:`mpipar.kernels.rope_frequencies`, given the name):

- ``default``: plain RoPE;
- ``linear``: every frequency divided by ``rope_factor``;
- ``dynamic``: NTK scaling, theta grows for sequences longer than the pretraining context
  ``rope_original_max_positions``, so it depends on the whole sequence's length;
- ``llama3``: Llama 3.1's rule, frequencies between the wavelengths set by the low and high
  frequency factors and the pretraining context are divided by ``rope_factor`` or blended;
- ``yarn``: frequencies divided by ``rope_factor`` and kept blended by a linear ramp over the
  dimensions that turn between ``rope_beta_slow`` and ``rope_beta_fast`` times over the
  pretraining context, and the cos and sin tables multiplied by yarn's attention factor (from
  ``rope_factor``, ``rope_mscale`` and ``rope_mscale_all_dim``). Latent attention (DeepSeek-V3)
  also multiplies its softmax scale by ``yarn_mscale(rope_factor, rope_mscale_all_dim) ** 2``
  when ``rope_mscale_all_dim`` is set (:meth:`RopeScaling.softmax_factor`), as transformers'
  DeepSeek-V3 attention does; standard attention does not (transformers' Llama and Qwen3).

The configuration resolves a name to its scaling once (:attr:`mpipar.config.ModelConfig.rope`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any



@dataclass(frozen=True)
class RopeScaling:
    """One scaling. ``scales``: reads ``rope_factor``; ``pretraining_context``: reads
    ``rope_original_max_positions``; ``frequency_band``: reads the low and high frequency
    factors; ``by_sequence_length``: its frequencies depend on the whole sequence's length;
    ``correction_range``: reads the beta and mscale fields (yarn)."""

    name: str
    scales: bool = False
    pretraining_context: bool = False
    frequency_band: bool = False
    by_sequence_length: bool = False
    correction_range: bool = False

    @staticmethod
    def named(name: str) -> RopeScaling:
        """The scaling called ``name``; ValueError naming the value and the choices otherwise."""
        if name not in SCALINGS:
            raise ValueError(f"rope_type={name!r}: must be one of {', '.join(ROPE_TYPES)}")
        return SCALINGS[name]

    def table_arguments(self, m: Any) -> dict[str, Any]:
        """The scaling arguments of the kernels' ``rope_cos_sin`` from model config ``m``."""
        out = dict(scaling=self.name, factor=m.rope_factor, low_freq_factor=m.rope_low_freq_factor,
                   high_freq_factor=m.rope_high_freq_factor,
                   original_max_positions=m.rope_original_max_positions)
        if self.correction_range:
            out.update(beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow,
                       mscale=m.rope_mscale, mscale_all_dim=m.rope_mscale_all_dim)
        return out

    def softmax_factor(self, m: Any) -> float:
        """What latent attention multiplies its softmax scale by: under yarn with
        ``rope_mscale_all_dim`` set, ``yarn_mscale(rope_factor, rope_mscale_all_dim) ** 2``;
        else 1."""
        if not (self.correction_range and m.rope_mscale_all_dim):
            return 1.0
        # imported here: the configuration imports this module before the thread pools are
        # sized, so nothing here may load NumPy at import
        from mpipar.kernels.rope_frequencies import yarn_mscale
        return yarn_mscale(m.rope_factor, m.rope_mscale_all_dim) ** 2

    def __str__(self) -> str:
        return self.name


DEFAULT = RopeScaling("default")
LINEAR = RopeScaling("linear", scales=True)
DYNAMIC = RopeScaling("dynamic", scales=True, pretraining_context=True, by_sequence_length=True)
LLAMA3 = RopeScaling("llama3", scales=True, pretraining_context=True, frequency_band=True)
YARN = RopeScaling("yarn", scales=True, pretraining_context=True, correction_range=True)

SCALINGS: dict[str, RopeScaling] = {s.name: s for s in (DEFAULT, LINEAR, DYNAMIC, LLAMA3, YARN)}
ROPE_TYPES = tuple(SCALINGS)
"""The names ``model.rope_type`` accepts (those mpipar computes exactly)."""
