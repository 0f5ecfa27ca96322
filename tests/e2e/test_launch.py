"""Launching under any MPI: the launcher of the MPI that mpi4py loaded, a clean environment for
the jobs a test starts, the node shape MPI sees, CPU shares under core binding, BLAS workers that
sleep between GEMMs.

These start their own jobs (with MPICH's or Open MPI's mpiexec, whichever library mpi4py uses:
CI runs them in both venvs)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import launch_env, mpi_launcher, mpirun, needs_mpirun


@needs_mpirun
def test_launcher_is_the_one_of_the_loaded_mpi_library():
    """The mpiexec the tests use belongs to the library mpi4py loaded (Hydra for MPICH)."""
    from mpi4py import MPI

    path, flags = mpi_launcher()
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60,
                             env=launch_env())
    text = version.stdout + version.stderr
    if MPI.Get_library_version().startswith("Open MPI"):
        assert "Open MPI" in text or "OpenRTE" in text or "prte" in text.lower(), text
        assert "--oversubscribe" in flags
        assert ("--allow-run-as-root" in flags) == (os.geteuid() == 0)
    else:
        assert "HYDRA" in text, text
        assert flags == ()


@needs_mpirun
def test_jobs_started_from_a_rank_environment_get_a_clean_one(tmp_path, monkeypatch):
    """A process that carries a launcher's variables (as one started by mpirun or one that
    called MPI_Init does) still starts a job of its own with the right size."""
    for var, value in {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
                       "PMIX_RANK": "3", "PMIX_NAMESPACE": "stale", "PMI_FD": "99",
                       "PMI_SIZE": "4", "PMI_RANK": "3", "MPI_LOCALNRANKS": "4",
                       "OMPI_MCA_mpi_yield_when_idle": "1"}.items():
        monkeypatch.setenv(var, value)
    env = launch_env()
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"            # the user's settings stay
    assert not {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_FD", "MPI_LOCALNRANKS"} & set(env)
    proc = subprocess.run([*mpirun(2), sys.executable, "-c",
                           "import sys; from mpi4py import MPI; sys.stdout.write(f'size {MPI.COMM_WORLD.Get_size()}\\n')"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    # mpiexec forwards the two ranks' lines as they come: they may run together ("size 2size 2")
    assert proc.stdout.count("size 2") == 2 and "size 1" not in proc.stdout, proc.stdout


@needs_mpirun
def test_node_shape_inside_a_job():
    """``python -m mpipar.runtime.nodes`` prints what COMM_TYPE_SHARED and the host names say."""
    proc = subprocess.run([*mpirun(3), sys.executable, "-m", "mpipar.runtime.nodes"],
                          capture_output=True, text=True, timeout=120, env=launch_env())
    assert proc.returncode == 0, proc.stderr
    host = os.uname().nodename
    assert re.search(rf"mpipar: 1 node\(s\) x 3 rank\(s\) per node: {re.escape(host)} "
                     rf"\(ranks 0-2\); 1 thread\(s\)/rank", proc.stdout), proc.stdout


SHARE = """
    import os, sys
    from mpipar.runtime import nodes
    cores = sorted(os.sched_getaffinity(0))
    if sys.argv[1] == "bound":  # as Open MPI binds a rank: one core of the launcher's
        os.sched_setaffinity(0, {cores[0]})
    ranks = int(sys.argv[2])
    threads = nodes.threads_per_rank(ranks)
    print(nodes.ranks_sharing_cores(ranks), threads, nodes.cpu_peak_share(threads, ranks))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
@pytest.mark.parametrize("mode, ranks", [("bound", 2), ("free", 2), ("free", 4)])
def test_cpu_share_from_the_cores_a_rank_may_use(tmp_path, mode, ranks):
    """A rank bound to one of the launcher's C cores next to C - 1 others has its core to
    itself (share 1, Open MPI's binding); unbound ranks share the launcher's cores."""
    script = tmp_path / "share.py"
    script.write_text(textwrap.dedent(SHARE))
    out = subprocess.run([sys.executable, str(script), mode, str(ranks)], capture_output=True,
                         text=True, timeout=60, env=launch_env())
    assert out.returncode == 0, out.stderr
    sharing, threads, share = out.stdout.split()
    cores = len(os.sched_getaffinity(0))
    if mode == "bound":
        want = max(1, round(ranks / cores))
        assert (int(sharing), int(threads)) == (want, 1)
        assert float(share) == min(1.0, 1 / want)
    else:
        assert int(sharing) == ranks
        assert int(threads) == max(1, cores // ranks)
        assert float(share) == min(1.0, cores / (int(threads) * ranks))


POOLS = """
    import os, sys
    import numpy, numba
    from mpipar.runtime import nodes
    numba.get_num_threads()  # Numba's pool started before the settings
    before = nodes.threads_in_use()
    nodes.configure_threads({ranks})
    print(before, nodes.threads_in_use(), numba.get_num_threads(), os.environ["OPENBLAS_NUM_THREADS"])
"""


def test_pools_loaded_before_the_thread_settings_are_sized_to_them(tmp_path):
    """A rank that learns from MPI how many ranks share its node has NumPy and Numba loaded by
    then: ``configure_threads`` sizes their pools, not only the variables they read at load."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: a pool of every size is one thread")
    script = tmp_path / "pools.py"
    script.write_text(textwrap.dedent(POOLS.format(ranks=cores)))
    env = {k: v for k, v in launch_env().items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    before, blas, numba_threads, variable = map(int, out.stdout.split())
    assert before > 1                                # loaded with every core
    assert (blas, numba_threads, variable) == (1, 1, 1)


def test_the_entry_points_load_neither_numpy_nor_numba_on_import():
    """``python -m mpipar.train`` and ``mpipar.generate`` size the thread pools before NumPy and
    Numba load when the launcher gives the ranks per node, so importing them loads neither."""
    code = "import sys, mpipar.train, mpipar.generate; print(sorted({'numpy', 'numba'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=launch_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


SPIN = """
    import os, sys
    from mpipar.runtime import nodes
    nodes.configure_threads(1)
    print(os.environ["OPENBLAS_THREAD_TIMEOUT"], "numpy" in sys.modules)
"""


@pytest.mark.parametrize("given, want", [(None, "4"), ("28", "28")])
def test_blas_workers_sleep_between_gemms_unless_the_user_says(tmp_path, given, want):
    """``configure_threads`` sets OpenBLAS's worker spin to 2^4 cycles (``BLAS_SPIN``) before
    NumPy loads, and keeps a value the user set."""
    script = tmp_path / "spin.py"
    script.write_text(textwrap.dedent(SPIN))
    env = {k: v for k, v in launch_env().items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if given is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [want, "False"]     # set before NumPy (and OpenBLAS) loads
