"""The JIT kernels compiled once per node before step 1, and said so.

Numba compiles a kernel on its first call and keeps it in its on-disk cache (``NUMBA_CACHE_DIR``,
else ``kernels/__pycache__``). Left to step 1, every rank of a node compiles the same kernels at
once, on cores the ranks share (eight ranks on two cores: minutes of silence). Instead the
first ranks of each node, one a core up to the parts of :data:`mpipar.kernels.warmup.PARTS`,
each call their parts' kernels of the run's dtype on tiny inputs
(:func:`mpipar.kernels.warmup.warm_up`) while the others wait at a barrier, asleep between
polls (a spinning barrier would take the cores the compiling ranks need); then every rank
loads what they compiled from the cache. Rank 0 says what is compiled before, and how long it took
after. ``python -m mpipar.bench warmup`` fills the cache ahead of a job.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

from mpipar.kernels import Backend, warmup
from mpipar.runtime.comm import Group
from mpipar.runtime.nodes import cpu_count, shared_memory_nodes

FIRST_RUN_SECONDS = (60, 120)
"""A cold cache's compile time, seconds of one core (measured on the 2-core test machine: the
float32 kernels ready in 70 s on one process, 36 s on 8 ranks with two compiling; bfloat16 runs
the float32 kernels, float64 has its own)."""


def cache_dir() -> str:
    """Where Numba keeps the compiled kernels."""
    return os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
        os.path.dirname(warmup.__file__), "__pycache__")


def announcement(backend: Backend, dtype_name: str) -> str:
    """What rank 0 prints before the kernels are compiled or loaded."""
    lo, hi = FIRST_RUN_SECONDS
    ops = ", ".join(warmup.compiled_ops(backend))
    return (f"compiling the {backend.name} kernels for {dtype_name} ({ops}) on one rank per "
            f"core of each node (up to {len(warmup.PARTS)}, a part each) while the others "
            f"wait, then loading them from the cache ({cache_dir()}): "
            f"with an empty cache about {lo}-{hi} s before step 1; a filled cache loads in "
            f"seconds (python -m mpipar.bench warmup fills it ahead of a job)")


def compiling_parts(nodes: list, rank: int, cores: int) -> tuple:
    """The warm-up parts ``rank`` compiles: the node's first ``min(ranks on it, cores, parts)``
    ranks deal :data:`mpipar.kernels.warmup.PARTS` out in turn (the costliest first); the
    others none. ``nodes``: each rank's node, in rank order."""
    local = [r for r, node in enumerate(nodes) if node == nodes[rank]]
    workers = max(1, min(len(local), cores, len(warmup.PARTS)))
    index = local.index(rank)
    return warmup.PARTS[index::workers] if index < workers else ()


def compile_once(backend: Backend, dtype: Any, dtype_name: str, group: Group,
                 say: Callable[[str], None] | None = None) -> float:
    """Compile (or load) ``backend``'s JIT kernels for ``dtype`` on the first ranks of each
    node of ``group``, a part each (a collective; :func:`compiling_parts`), then load them on
    every rank from the cache. ``say``: rank 0's printer
    (None elsewhere). Returns this rank's seconds in it, the wait included; no-op (0) for a
    backend that compiles nothing."""
    if not warmup.compiles(backend):
        return 0.0
    t0 = time.perf_counter()
    if say is not None:
        say(announcement(backend, dtype_name))
    nodes = shared_memory_nodes(group.comm) if group.size > 1 else [0]
    parts = compiling_parts(nodes, group.rank, cpu_count())
    if parts:
        warmup.warm_up(backend, dtype, parts)
    group.idle_barrier()  # the waiting ranks leave the node's cores to its compiling ranks
    warmup.warm_up(backend, dtype)      # loads what the node compiled (and compiles the rest)
    seconds = time.perf_counter() - t0
    if say is not None:
        say(f"kernels ready in {seconds:.1f} s")
    return seconds
