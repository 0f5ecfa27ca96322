"""What the tensor axis builds for a rank (:class:`mpipar.parallel.axis.RankHooks`): the
model's tensor seam over the ``tp`` group."""
from __future__ import annotations

from typing import Any

from mpipar.layout import Layout
from mpipar.model.lora import Adapters
from mpipar.parallel.axis import Parts
from mpipar.parallel.placement import PlacementTable
from mpipar.parallel.tensor.ops import TensorParallel


def tensor_seams(layout: Layout, comms: Any, compute: Any, table: PlacementTable,
                 parts: Parts) -> Parts:
    """``tensor``: the :class:`TensorParallel` every chunk's linears, embedding and
    cross-entropy go through (with LoRA, its adapters)."""
    lora = table.lora
    return {"tensor": TensorParallel(kernels=compute.kernels, table=table,
                                     group=comms.groups["tp"],
                                     adapters=None if lora is None
                                     else Adapters(compute.kernels, lora, layout.config.train.seed,
                                                   layout.config.train.seq_len))}
