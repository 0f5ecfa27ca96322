"""A run computes the same bits whatever the compiled-kernel cache holds: the same command on a
fresh ``NUMBA_CACHE_DIR`` (every kernel compiled in the run), again on the cache it filled
(every kernel loaded), and on that cache less the cross-entropy kernels (some kernels loaded,
others compiled: a cache another configuration filled) logs bit-identical losses and gradient
norms, on one rank and eight, in float32 (bfloat16 runs the same float32 kernels); and the run
says what it compiles before step 1. The flags that make it so: tests/unit/test_kernel_flags.py."""
from __future__ import annotations

import os
import shutil

import pytest

from conftest import MPIRUN
from launch import metrics, run_train

SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seq-len", "64",
         "--global-batch-size", "8", "--steps", "3", "--backend", "numba", "--log-every", "1",
         "--tensorboard", "off"]


@pytest.mark.timeout(1500)  # a cold cache compiles the kernels: 1-2 min of one core
@pytest.mark.parametrize("ranks,dtype", [(1, "float32"), (8, "float32")])
def test_a_cold_and_a_warm_cache_train_the_same_bits(tmp_path, monkeypatch, ranks, dtype):
    if ranks > 1 and not os.path.exists(MPIRUN):
        pytest.skip("no mpirun beside this Python (install mpipar[mpich])")
    cache = tmp_path / "numba-cache"
    runs = {}
    for name in ("cold", "warm", "partial"):
        if name == "partial":  # the vexp callers with REORDER flags compile, the others load
            shutil.copytree(cache, tmp_path / "partial-cache")
            cache = tmp_path / "partial-cache"
            dropped = [p for p in cache.rglob("*") if "_ce_stats-" in p.name or "_ce_bwd-" in p.name]
            assert dropped
            for path in dropped:
                path.unlink()
        monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
        proc = run_train(ranks, [*SMALL, "--dtype", dtype, "--run-dir", str(tmp_path / name)],
                         cwd=tmp_path, timeout=1400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = metrics(tmp_path / name)
        lines = proc.stdout.splitlines()
        said = next(k for k, line in enumerate(lines) if "compiling the numba kernels" in line)
        ready = next(k for k, line in enumerate(lines) if line.startswith("mpipar: kernels ready"))
        first = next(k for k, line in enumerate(lines) if line.startswith("step      1/3"))
        assert said < ready < first, proc.stdout
        assert f"for {dtype} (" in lines[said] and "one rank per core of each node" in lines[said]
    cold = runs["cold"]
    assert [r["step"] for r in cold] == [1, 2, 3]
    for name in ("warm", "partial"):
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in runs[name]] == [r[key] for r in cold], (name, key)  # to the bit
    assert cold[-1]["loss"] < cold[0]["loss"]
