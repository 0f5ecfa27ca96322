"""The precision of a run: which dtype each kind of array is held in.

``--dtype float32`` or ``float64`` holds everything in that dtype. ``--dtype bfloat16`` is mixed
precision (Megatron's and torchtitan's recipe): the parameters a step computes with, the
activations, what backward saves and every tensor-, sequence- and pipeline-parallel message are
bf16 (*compute* copies); the *master* weights the optimizer updates, the gradients accumulated
over microbatches, the AdamW moments, the softmax and RMSNorm statistics, the cross-entropy and
the loss are float32. The kernels follow one recipe for bf16 inputs (``mpipar.kernels.numpy_ref``:
upcast once, float32 compute, the activation outputs rounded once). The dp x sp reduction sends
the gradients in their own dtype, or with ``--reduce-dtype bfloat16`` rounded to bf16 (half the
bytes; summed in float32 arithmetic, :mod:`mpipar.runtime.comm`).

Names are strings ("float32", "bfloat16"), so the planner can ask for sizes without NumPy
knowing bfloat16; :func:`numpy_dtype` makes the array dtype (bfloat16 through ml_dtypes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes of one element of each dtype a run holds arrays in."""


def numpy_dtype(name: str) -> np.dtype:
    """The array dtype called ``name`` (``bfloat16``: ``ml_dtypes.bfloat16``, the dtype NumPy
    and CuPy arrays of bf16 carry)."""
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def is_bf16(dtype: Any) -> bool:
    """Whether ``dtype`` (a name or an array dtype) is bfloat16 (ml_dtypes need not be
    importable to ask)."""
    if isinstance(dtype, str):
        return dtype == "bfloat16"
    dtype = np.dtype(dtype)
    return dtype.kind == "V" and dtype.name == "bfloat16"


@dataclass(frozen=True)
class Precision:
    """The dtypes of one run (names): ``compute`` (parameters as computed with, activations,
    messages), ``master`` (master weights, gradients, optimizer state) and ``reduce`` (what the
    dp x sp gradient reduction sends)."""

    compute: str
    master: str
    reduce: str

    @classmethod
    def named(cls, dtype: str, reduce_dtype: str = "float32") -> "Precision":
        """The precision of ``--dtype`` and ``--reduce-dtype`` as named."""
        master = "float32" if dtype == "bfloat16" else dtype
        return cls(dtype, master, "bfloat16" if reduce_dtype == "bfloat16" else master)

    @classmethod
    def of(cls, train: Any, parallel: Any) -> "Precision":
        """The precision of ``train.dtype`` and ``parallel.reduce_dtype`` (a configuration's
        sections, or a Layout's)."""
        return cls.named(train.dtype, parallel.reduce_dtype)

    @property
    def mixed(self) -> bool:
        """Whether compute copies differ from the masters (bf16 compute, float32 masters)."""
        return self.compute != self.master

    @property
    def compute_bytes(self) -> int:
        return ELEMENT_BYTES[self.compute]

    @property
    def master_bytes(self) -> int:
        return ELEMENT_BYTES[self.master]

    @property
    def reduce_bytes(self) -> int:
        return ELEMENT_BYTES[self.reduce]

    @property
    def stat_bytes(self) -> int:
        """Bytes of a softmax or RMSNorm statistic: float64 in a float64 run, else float32."""
        return 8 if self.compute == "float64" else 4

    def describe(self) -> str:
        """The precision in words, for the start-up line and the summary."""
        if not self.mixed:
            return self.compute
        reduce = "" if self.reduce == self.master else f", {self.reduce} gradient reduction"
        return f"{self.compute} compute, {self.master} master weights and optimizer{reduce}"
