"""``--allreduce-algorithm`` reaches the MPI library (:mod:`mpipar.runtime.allreduce`): the
variables written before ``MPI_Init`` are what MPICH holds afterwards, read back through its tool
interface (``MPI_T_cvar_read``) in a fresh process per algorithm; the start-up line names it; a
wrong name and an explicit algorithm on a library without such controls exit 2. The sums under
each algorithm on 8 ranks: mpi/test_allreduce.py."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import launch_env
from launch import TINY, run_train
from mpipar.runtime.allreduce import MPICH_NAMES, OPEN_MPI_NAMES


def _mpich() -> bool:
    from mpi4py import MPI
    return "MPICH" in MPI.Get_library_version()


def _open_mpi() -> bool:
    from mpi4py import MPI
    return "Open MPI" in MPI.Get_library_version()


READ_BACK = """
import sys
from mpipar.runtime import allreduce
allreduce.preset(sys.argv[1])
held = allreduce.MpiT().algorithm()
print(held[allreduce.MPICH_BLOCKING], held[allreduce.MPICH_NONBLOCKING])
"""


@pytest.mark.skipif(not _mpich(), reason="reads MPICH's control variables back")
@pytest.mark.parametrize("algorithm", ["auto", "ring", "tree", "rabenseifner"])
def test_the_algorithm_reaches_mpich(algorithm):
    env = {k: v for k, v in launch_env().items() if not k.startswith("MPIR_CVAR_")}
    proc = subprocess.run([sys.executable, "-c", READ_BACK, algorithm], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = MPICH_NAMES.get(algorithm)
    want = ([names["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"],
             names["MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM"]] if names else ["auto", "auto"])
    assert proc.stdout.split() == want


READ_BACK_OPEN_MPI = """
import sys
from mpipar.runtime import allreduce
allreduce.preset(sys.argv[1])
print(*allreduce.MpiT().open_mpi_algorithm().values())
"""


@pytest.mark.skipif(not _open_mpi(), reason="reads Open MPI's MCA parameters back (CI's Open "
                                            "MPI stage runs it)")
@pytest.mark.parametrize("algorithm", ["auto", "ring", "tree", "rabenseifner"])
def test_the_algorithm_reaches_open_mpi(algorithm):
    """The tuned and libnbc parameters written before MPI_Init are what Open MPI holds after
    it, read back through MPI_T (0 0 0: its own decision under auto)."""
    env = {k: v for k, v in launch_env().items() if not k.startswith("OMPI_MCA_coll_")}
    proc = subprocess.run([sys.executable, "-c", READ_BACK_OPEN_MPI, algorithm],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = OPEN_MPI_NAMES.get(algorithm)
    assert proc.stdout.split() == (["1", *names] if names else ["0", "0", "0"])


@pytest.mark.skipif(not _open_mpi(), reason="the start-up line reads Open MPI's parameters back")
def test_the_start_up_line_names_open_mpis_choice(tmp_path):
    run = run_train(1, [*TINY, "--steps", "1", "--run-dir", str(tmp_path / "a"),
                        "--allreduce-algorithm", "rabenseifner"])
    assert run.returncode == 0, run.stderr
    assert ("| allreduce rabenseifner (Open MPI coll_tuned_use_dynamic_rules=1, "
            "coll_tuned_allreduce_algorithm=6, coll_libnbc_iallreduce_algorithm=3) |"
            ) in run.stdout, run.stdout


@pytest.mark.skipif(not _mpich(), reason="the start-up line reads MPICH's variables back")
def test_the_start_up_line_names_it_and_a_wrong_name_exits_2(tmp_path):
    run = run_train(1, [*TINY, "--steps", "1", "--run-dir", str(tmp_path / "a"),
                        "--allreduce-algorithm", "tree"])
    assert run.returncode == 0, run.stderr
    assert ("| allreduce tree (MPICH MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=tree, "
            "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM=tsp_tree) |") in run.stdout, run.stdout
    bad = run_train(1, [*TINY, "--steps", "1", "--run-dir", str(tmp_path / "b"),
                        "--allreduce-algorithm", "butterfly"])
    assert bad.returncode == 2
    assert "--allreduce-algorithm: invalid choice: 'butterfly'" in bad.stderr


NO_CONTROLS = """
import sys
from mpipar import train
from mpipar.runtime import mpi_init
class Other:                                  # a library mpipar knows no controls of
    def __getattr__(self, name):
        return getattr(mpi_init.MPI, name)
    def Get_library_version(self):
        return "SomeMPI 1.0"
train.MPI = Other()
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("algorithm,code", [("ring", 2), ("auto", 0)])
def test_a_library_without_controls(tmp_path, algorithm, code):
    """An explicit algorithm exits 2 with one message; auto keeps the library's choice."""
    proc = subprocess.run([sys.executable, "-c", NO_CONTROLS, *TINY, "--steps", "1",
                           "--run-dir", str(tmp_path), "--allreduce-algorithm", algorithm],
                          capture_output=True, text=True, env=launch_env(), timeout=240)
    assert proc.returncode == code, proc.stderr
    if code == 2:
        assert proc.stderr.count("mpipar: error:") == 1
        assert "allreduce_algorithm='ring': this MPI library offers no control" in proc.stderr
    else:
        assert "| allreduce auto (the library's choice) |" in proc.stdout
