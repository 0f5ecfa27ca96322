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
