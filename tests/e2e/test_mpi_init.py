"""MPI start-up under a deadline (:mod:`mpipar.runtime.mpi_init`): a rank stuck in ``MPI_Init`` prints
its stack and exits 1 after ``MPIPAR_INIT_TIMEOUT`` seconds instead of hanging the job; a bad
value is refused once with status 2; a normal start is untouched; a launch whose ranks all
came through start-up says so in ``MPIPAR_STARTED_FILE``, which the srun job scripts read.

The hang is real: MPICH's PMI-1 client is pointed (``PMI_PORT``) at a socket that accepts the
connection and never answers, so ``MPI_Init`` waits for its PMI server forever, as a rank whose
launcher lost it does."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from conftest import launch_env, mpirun, needs_mpirun


def _mpich() -> bool:
    from mpi4py import MPI
    return "MPICH" in MPI.Get_library_version()


@pytest.mark.skipif(not _mpich(), reason="the silent PMI server speaks MPICH's PMI_PORT protocol")
@pytest.mark.parametrize("module", ["mpipar.runtime.nodes", "mpipar.train"])
def test_a_rank_stuck_in_mpi_init_ends_after_the_deadline(module, tmp_path):
    server = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog), never answers
    port = server.getsockname()[1]
    started = tmp_path / "started"
    env = dict(launch_env(), PMI_PORT=f"127.0.0.1:{port}", PMI_RANK="0", PMI_SIZE="2",
               PMI_ID="0", MPIPAR_INIT_TIMEOUT="2", MPIPAR_STARTED_FILE=str(started))
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True,
                              timeout=120, env=env)
    finally:
        server.close()
    took = time.monotonic() - start
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("Timeout (0:00:02)!"), proc.stderr
    assert "mpipar/runtime/mpi_init.py" in proc.stderr and "in _initialise" in proc.stderr, proc.stderr
    assert 2.0 <= took < 60, took
    assert proc.stdout == ""
    assert not started.exists()     # the job scripts launch it again


@needs_mpirun
def test_a_launch_marks_that_every_rank_started(tmp_path):
    """Rank 0 creates $MPIPAR_STARTED_FILE once a collective over the world has completed; a
    launch refused before that (bad flags: status 2) does not, nor does the probe."""
    from launch import TINY
    for args, status, marked in ((["--steps", "1"], 0, True), (["--steps", "-1"], 2, False)):
        started = tmp_path / f"started{status}"
        env = dict(launch_env(), MPIPAR_STARTED_FILE=str(started))
        proc = subprocess.run([*mpirun(2), sys.executable, "-m", "mpipar.train", *TINY,
                               "--run-dir", str(tmp_path / f"run{status}"), *args],
                              capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == status, proc.stderr
        assert started.exists() == marked, (args, proc.stderr)


@needs_mpirun
def test_a_bad_deadline_is_refused_once_before_mpi_starts():
    env = dict(launch_env(), MPIPAR_INIT_TIMEOUT="soon")
    proc = subprocess.run([*mpirun(2), sys.executable, "-m", "mpipar.train", "--steps", "1"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    message = ("mpipar: MPIPAR_INIT_TIMEOUT='soon': must be a number of seconds >= 0 "
               "(0: no deadline for MPI_Init)")
    assert proc.stderr.count(message) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@needs_mpirun
def test_a_normal_start_is_untouched_by_the_deadline():
    """A deadline does not fire once MPI_Init has returned (the process outlives it by a
    second), and a deadline of 0 is none."""
    for seconds, sleep in (("5", 6), ("0", 0)):
        env = dict(launch_env(), MPIPAR_INIT_TIMEOUT=seconds)
        proc = subprocess.run([*mpirun(2), sys.executable, "-c",
                               f"import time, mpipar.runtime.mpi_init as m; time.sleep({sleep}); "
                               "print(f'alive{m.MPI.COMM_WORLD.allreduce(1)}', flush=True)"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.count("alive2") == 2, proc.stdout
