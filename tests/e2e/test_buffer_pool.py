"""The step's buffer pool (:func:`mpipar.runtime.host_memory.pool_freed_memory`): once the first step has
allocated its activations, later steps reuse the freed memory and touch no new pages. Counted
with the kernel's page-fault counter in a fresh process (the allocator setting is process-wide),
against the same steps with the pool left off."""
from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, tempfile
from mpi4py import MPI
from mpipar.training import engine as engine_mod
from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
from mpipar.rules import validate
if sys.argv[1] == "off":
    engine_mod.pool_freed_memory = lambda: False
cfg = validate(Config(ModelConfig(hidden=128, layers=2, heads=4, kv_heads=2),
             ParallelConfig(), TrainConfig(seq_len=256, global_batch_size=4, micro_batch_size=2,
                                           dtype="float64", backend="numpy",
                                           run_dir=tempfile.mkdtemp())), 1)
engine = engine_mod.Engine(cfg, MPI.COMM_SELF)
for k in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.train_step(k)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_of_third_step(pool: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, pool], capture_output=True, text=True,
                         check=True, timeout=900)
    return int(out.stdout.split()[-1])


@pytest.mark.timeout(1900)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_later_steps_reuse_the_first_steps_memory():
    pooled, unpooled = _faults_of_third_step("on"), _faults_of_third_step("off")
    assert unpooled > 1000  # 2 microbatches of 1 MiB activations, freed and mapped again
    assert pooled < unpooled / 50, (pooled, unpooled)


LARGE = """
import resource, sys
import numpy as np
from mpipar.runtime.host_memory import pool_freed_memory
(getattr(np, '_core', None) or np.core).multiarray._set_madvise_hugepage(False)  # 4 KiB pages, not huge
if sys.argv[1] == "on":
    assert pool_freed_memory()
for k in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(48 << 20, np.uint8)   # over glibc's 32 MiB ceiling for M_MMAP_THRESHOLD
    a[:] = k
    del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_arrays_over_the_mmap_ceiling_reuse_freed_memory():
    """An array of 48 MiB, freed and asked for again, is the same memory under the pool (no new
    pages), where glibc would otherwise map and the kernel zero 12,288 new pages every time."""
    def faults(pool: str) -> int:
        out = subprocess.run([sys.executable, "-c", LARGE, pool], capture_output=True, text=True,
                             check=True, timeout=300)
        return int(out.stdout.split()[-1])
    pooled, unpooled = faults("on"), faults("off")
    assert unpooled >= 12000, unpooled
    assert pooled < 100, pooled
