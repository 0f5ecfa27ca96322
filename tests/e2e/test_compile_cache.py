"""A run computes the same bits whatever the compiled-kernel cache holds. Eight ranks on a fresh
``NUMBA_CACHE_DIR`` (the two ranks compiling a part each run it freshly compiled and load the
other's: every kernel's compiled code enters the gradients), again on the cache they filled
(every kernel loaded), and on that cache less the cross-entropy kernels (some kernels loaded,
others compiled: a cache another configuration filled) log bit-identical losses and gradient
norms in float32 (bfloat16 runs the same float32 kernels); one rank, on the filled cache and
on it less the cross-entropy kernels (compiled in that one process), logs the same bits as
itself; and each run says what it compiles before step 1. The flags that make it so:
tests/unit/test_kernel_flags.py."""
from __future__ import annotations

import os
import shutil

import pytest

from conftest import MPIRUN
from launch import metrics, run_train

SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--seq-len", "64",
         "--global-batch-size", "8", "--steps", "3", "--backend", "numba", "--log-every", "1",
         "--tensorboard", "off"]


def _partial(cache, to):
    """A copy of the kernel cache ``cache`` at ``to`` less the cross-entropy kernels (the vexp
    callers with REORDER flags: they compile, the others load)."""
    shutil.copytree(cache, to)
    dropped = [p for p in to.rglob("*") if "_ce_stats-" in p.name or "_ce_bwd-" in p.name]
    assert dropped
    for path in dropped:
        path.unlink()
    return to


def _train(ranks, dtype, cache, run_dir, tmp_path, monkeypatch) -> list[dict]:
    """The small run on ``ranks`` ranks with kernel cache ``cache``: its metrics, after checking
    that it said what it compiles before step 1."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    proc = run_train(ranks, [*SMALL, "--dtype", dtype, "--run-dir", str(run_dir)],
                     cwd=tmp_path, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    said = next(k for k, line in enumerate(lines) if "compiling the numba kernels" in line)
    ready = next(k for k, line in enumerate(lines) if line.startswith("mpipar: kernels ready"))
    first = next(k for k, line in enumerate(lines) if line.startswith("step      1/3"))
    assert said < ready < first, proc.stdout
    assert f"for {dtype} (" in lines[said] and "one rank per core of each node" in lines[said]
    return metrics(run_dir)


def _same_bits(runs: dict, first: str) -> None:
    for name, got in runs.items():
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in got] == [r[key] for r in runs[first]], (name, key)  # to the bit


@pytest.mark.timeout(1500)  # a cold cache compiles the kernels: about a minute of both cores
def test_a_cold_and_a_warm_cache_train_the_same_bits(tmp_path, monkeypatch):
    if not os.path.exists(MPIRUN):
        pytest.skip("no mpirun beside this Python (install mpipar[mpich])")
    dtype, cache = "float32", tmp_path / "numba-cache"
    eight = {}
    for name in ("cold", "warm", "partial"):
        if name == "partial":
            cache = _partial(cache, tmp_path / "partial-cache")
        eight[name] = _train(8, dtype, cache, tmp_path / f"8-{name}", tmp_path, monkeypatch)
    assert [r["step"] for r in eight["cold"]] == [1, 2, 3]
    assert eight["cold"][-1]["loss"] < eight["cold"][0]["loss"]
    _same_bits(eight, "cold")
    one = {"warm": _train(1, dtype, tmp_path / "numba-cache", tmp_path / "1-warm", tmp_path,
                          monkeypatch),
           "partial": _train(1, dtype, _partial(tmp_path / "numba-cache", tmp_path / "1-cache"),
                             tmp_path / "1-partial", tmp_path, monkeypatch)}
    assert [r["step"] for r in one["warm"]] == [1, 2, 3]
    _same_bits(one, "warm")
