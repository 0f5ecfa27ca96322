"""The data-parallel reduction's rule: buckets, the bf16 reduction, hierarchical nodes,
compression and its warm-up, the all-reduce algorithm's hardware file."""
from __future__ import annotations

import os

from mpipar.config import require
from mpipar.layout import Layout
from mpipar.model.mtp import embedding_at_last
from mpipar.runtime.precision import Precision
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.runtime.allreduce_modes import algorithm_named


def check_config(layout: Layout) -> None:
    """Buckets need a size; a bf16 reduction needs bf16 compute and no compression;
    hierarchical reduction needs nodes that split dp x sp evenly; top-k a ratio in (0, 1]; a
    compression warm-up a compression and a count >= 0; error-feedback residuals, one per
    rank, cannot follow a tied embedding across pipeline ranks."""
    from mpipar.runtime.topology import GridShape, NodeMap

    p, dp, world = layout.parallel, layout.dp, layout.world
    reduction = reduction_of(p)
    require(p.bucket_mb > 0, f"parallel.bucket_mb={p.bucket_mb}: must be > 0")
    require(0 < p.topk_ratio <= 1, f"parallel.topk_ratio={p.topk_ratio}: must be in (0, 1]")
    require(p.compression_warmup >= -1,
            f"parallel.compression_warmup={p.compression_warmup}: must be >= 0 (or -1: the "
            f"codec's default share of the steps)")
    require(p.compression_warmup <= 0 or reduction.compresses,
            f"parallel.compression_warmup={p.compression_warmup}: only with --grad-compression "
            f"int8 or topk (there is nothing to warm up from)")
    require(not (reduction.keeps_residual and dp * p.sp > 1
                 and embedding_at_last(layout.model) and p.pp > 1),
            f"parallel.grad_compression={p.grad_compression!r} with error feedback: not with "
            f"{_embedding_copies(layout.model)} and pp={p.pp} (the embedding's two copies, on "
            f"the first and the last stage, keep different residuals, and a checkpoint holds "
            f"one); use --error-feedback off, pp=1, untied embeddings and no MTP")
    require(p.reduce_dtype != "bfloat16" or Precision.of(layout.train, p).mixed,
            f"parallel.reduce_dtype='bfloat16' with train.dtype={layout.train.dtype!r}: a bf16 "
            f"gradient reduction is part of mixed precision (use --dtype bfloat16, or "
            f"--reduce-dtype float32)")
    require(p.reduce_dtype != "bfloat16" or not reduction.compresses,
            f"parallel.reduce_dtype='bfloat16' with parallel.grad_compression="
            f"{p.grad_compression!r}: a compressed reduction sends its own encoding of the "
            f"float32 gradients (use one or the other)")
    require(not p.allreduce_hardware or algorithm_named(p.allreduce_algorithm).chooses_per_size,
            f"parallel.allreduce_hardware={p.allreduce_hardware!r}: only with "
            f"--allreduce-algorithm auto (not {p.allreduce_algorithm!r})")
    require(not p.allreduce_hardware or os.path.isfile(p.allreduce_hardware),
            f"parallel.allreduce_hardware={p.allreduce_hardware!r}: no such file")
    if reduction.hierarchical and p.ranks_per_node:
        problem = GridShape(dp, p.tp, p.pp, p.sp).node_split_problem(
            NodeMap.blocks(world, p.ranks_per_node))
        require(problem is None, f"parallel.dp_reduce='hierarchical' with "
                                 f"ranks_per_node={p.ranks_per_node}: {problem}")


def _embedding_copies(m) -> str:
    """What puts a copy of the embedding on the last stage too (the rule above names it)."""
    return "model.tie_embeddings" if m.tie_embeddings else f"model.mtp_depth={m.mtp_depth}"
