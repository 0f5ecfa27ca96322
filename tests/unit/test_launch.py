"""Launching under any MPI, in process: the progress bar only on the user's terminal. The launcher,
the environment of the jobs a test starts, node shapes and CPU shares: e2e/test_launch.py."""
from __future__ import annotations

import os
import pty


def test_bar_only_on_the_users_terminal():
    """A terminal is the user's unless Open MPI launched the process and it is not the
    process's controlling terminal (Open MPI gives each rank a pty even when mpirun writes to a
    file); a pipe never is."""
    from mpipar.observe.metrics import users_terminal

    leader, follower = pty.openpty()
    read, write = os.pipe()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty, \
                os.fdopen(write, "w", closefd=False) as pipe:
            assert users_terminal(tty, {})
            assert not users_terminal(pipe, {})
            assert not users_terminal(tty, {"OMPI_COMM_WORLD_SIZE": "2"})
    finally:
        for fd in (leader, follower, read, write):
            os.close(fd)


def test_a_pipe_to_mpirun_on_a_terminal_is_the_users_terminal(tmp_path):
    """Under MPICH's mpirun rank 0's stdout is a pipe to hydra's proxy, so no bar was shown
    although mpirun wrote to the user's terminal. A rank whose parents are MPI launchers, the
    top one writing to a terminal, gets the bar; ``mpirun > log`` and a pipe from a process
    that is no launcher (``python ... | tee log``) do not. (A /proc of three processes.)"""
    from mpipar.observe.metrics import launcher_terminal
    leader, follower = pty.openpty()

    def process(pid: int, comm: str, parent: int, out: str) -> None:
        (tmp_path / str(pid) / "fd").mkdir(parents=True)
        (tmp_path / str(pid) / "comm").write_text(comm + "\n")
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {parent} 1 1 0 -1\n")
        os.symlink(out, tmp_path / str(pid) / "fd" / "1")
    try:
        (tmp_path / "log").write_text("")
        process(30, "bash", 1, os.ttyname(follower))
        process(20, "mpirun", 30, os.ttyname(follower))
        process(10, "hydra_pmi_proxy", 20, str(tmp_path / "pipe"))
        process(21, "mpirun", 30, str(tmp_path / "log"))
        process(11, "hydra_pmi_proxy", 21, str(tmp_path / "pipe"))
        assert launcher_terminal(10, str(tmp_path))
        assert not launcher_terminal(11, str(tmp_path))     # mpirun > log
        assert not launcher_terminal(30, str(tmp_path))     # no launcher: python | tee
        assert not launcher_terminal(99, str(tmp_path))     # no such process
    finally:
        os.close(leader)
        os.close(follower)
