"""A predicted MPI call: what each parallel axis says one step hands to MPI.

Each axis predicts its own traffic beside its runtime (:func:`mpipar.parallel.tensor.cost.
tensor_calls`, :func:`mpipar.parallel.sequence.cost.sequence_calls`, :func:`mpipar.parallel.pipeline.
cost.pipeline_calls`, :func:`mpipar.parallel.data_parallel.cost.reduction_calls`,
:func:`mpipar.parallel.fsdp.cost.sharded_calls`) as a list of :class:`Call`, under the ledger's
counting convention (:mod:`mpipar.runtime.comm`: the payload of each call, sender side; a
receive counts a call and no bytes). The planner (:mod:`mpipar.plan.traffic`) concatenates
them; the ledger tests hold the engine to them exactly. Nothing here needs MPI.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpipar.runtime.precision import ELEMENT_BYTES


@dataclass(frozen=True)
class Call:
    """``count`` MPI calls of ``op`` (the ledger's operation names) on group ``group``, each
    handing over ``nbytes``; point-to-point calls name their ``peer`` (a grid rank)."""

    group: str
    op: str
    nbytes: int
    count: int = 1
    peer: int | None = None


def element_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (``"float32"``: 4, ``"bfloat16"``: 2; no ml_dtypes
    needed). Which dtype an axis's tensors travel in is :class:`mpipar.runtime.precision.
    Precision`'s: activations and their gradients, parameters gathered for compute in the compute
    dtype; accumulated gradients in the master dtype; the dp x sp reduction in its own."""
    return ELEMENT_BYTES[dtype] if dtype in ELEMENT_BYTES else np.dtype(dtype).itemsize
