"""ZeRO-2/3's rule: a group to shard over, a flat dense reduce-scatter, a prefetch depth, node
shared memory for ZeRO-3 on the CPU."""
from __future__ import annotations

from mpipar.config import require
from mpipar.layout import Layout
from mpipar.runtime.device import device_of
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.parallel.fsdp.modes import in_node_memory


def check_config(layout: Layout) -> None:
    """ZeRO-2/3 shard over dp x sp (a group of one shards nothing) with a flat, dense
    reduce-scatter per unit (neither the hierarchical reduction nor compression), and a prefetch
    depth >= 0; node shared memory is for ZeRO-3 on the CPU."""
    p = layout.parallel
    require(p.zero_prefetch >= 0, f"parallel.zero_prefetch={p.zero_prefetch}: must be >= 0")
    if in_node_memory(p):
        require(p.zero == 3, f"parallel.zero_shared='node' with parallel.zero={p.zero}: node "
                             f"shared memory holds ZeRO-3's parameters (use zero=3)")
        require(not device_of(layout.train).gpu,
                "parallel.zero_shared='node' with train.device='cuda': node shared memory "
                "holds host arrays (use device='cpu', or zero_shared='off')")
    if p.zero < 2:
        return
    dp = layout.dp
    require(dp * p.sp > 1, f"parallel.zero={p.zero}: ZeRO-2/3 shard over dp x sp, which needs "
                           f"dp*sp > 1 (got dp={dp}, sp={p.sp})")
    reduction = reduction_of(p)
    require(not reduction.hierarchical, f"parallel.dp_reduce={p.dp_reduce!r} with parallel.zero="
                                   f"{p.zero}: ZeRO-2/3 reduce-scatter each unit over the flat "
                                   f"dp x sp group (use dp_reduce='flat', or zero <= 1)")
    require(not reduction.compresses, f"parallel.grad_compression={p.grad_compression!r} with "
                                          f"parallel.zero={p.zero}: ZeRO-2/3 reduce dense "
                                          f"gradients (use grad_compression='none', or zero <= 1)")
