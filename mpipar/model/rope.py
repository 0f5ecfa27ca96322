"""The RoPE frequency scalings (``model.rope_type``, transformers' ``rope_type`` names).

A scaling is a :class:`RopeScaling` that says which of the model's RoPE fields it reads and
how it depends on the sequence; the configuration's rules, the Hugging Face reader and writer
and the document-packing rule ask it instead of comparing its name. The frequencies themselves
are the kernels' (:func:`mpipar.kernels.numpy_ref.rope_inv_freq`, given the name):

- ``default``: plain RoPE;
- ``linear``: every frequency divided by ``rope_factor``;
- ``dynamic``: NTK scaling, theta grows for sequences longer than the pretraining context
  ``rope_original_max_positions``, so it depends on the whole sequence's length;
- ``llama3``: Llama 3.1's rule, frequencies between the wavelengths set by the low and high
  frequency factors and the pretraining context are divided by ``rope_factor`` or blended.

The configuration resolves a name to its scaling once (:attr:`mpipar.config.ModelConfig.rope`).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """One scaling. ``scales``: reads ``rope_factor``; ``pretraining_context``: reads
    ``rope_original_max_positions``; ``frequency_band``: reads the low and high frequency
    factors; ``by_sequence_length``: its frequencies depend on the whole sequence's length."""

    name: str
    scales: bool = False
    pretraining_context: bool = False
    frequency_band: bool = False
    by_sequence_length: bool = False

    @staticmethod
    def named(name: str) -> RopeScaling:
        """The scaling called ``name``; ValueError naming the value and the choices otherwise."""
        if name not in SCALINGS:
            raise ValueError(f"rope_type={name!r}: must be one of {', '.join(ROPE_TYPES)}")
        return SCALINGS[name]

    def __str__(self) -> str:
        return self.name


DEFAULT = RopeScaling("default")
LINEAR = RopeScaling("linear", scales=True)
DYNAMIC = RopeScaling("dynamic", scales=True, pretraining_context=True, by_sequence_length=True)
LLAMA3 = RopeScaling("llama3", scales=True, pretraining_context=True, frequency_band=True)

SCALINGS: dict[str, RopeScaling] = {s.name: s for s in (DEFAULT, LINEAR, DYNAMIC, LLAMA3)}
ROPE_TYPES = tuple(SCALINGS)
"""The names ``model.rope_type`` accepts (those mpipar computes exactly)."""
