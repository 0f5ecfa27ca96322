"""Launching ``python -m mpipar.train`` (under ``mpirun`` for several ranks) from a test, and
reading what a run wrote: shared by the tests of runs as users live them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from conftest import launch_env, mpirun

TINY = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "32",
        "--global-batch-size", "4", "--backend", "numpy", "--log-every", "0"]


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


THREAD_SETTINGS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
                   "OPENBLAS_THREAD_TIMEOUT")
"""What CI exports and a user's shell usually does not: ``bare`` runs start without them."""


def start_train(ranks: int, args: list[str], script: str | None = None,
                cwd=None, bare: bool = False) -> subprocess.Popen:
    prog = [script] if script else ["-m", "mpipar.train"]
    prefix = mpirun(ranks) if ranks > 1 else []
    env = launch_env()
    if bare:
        env = {k: v for k, v in env.items() if k not in THREAD_SETTINGS}
    return subprocess.Popen([*prefix, sys.executable, *prog, *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def run_train(ranks: int, args: list[str], script: str | None = None, cwd=None,
              timeout: float = 240, bare: bool = False) -> subprocess.CompletedProcess:
    proc = start_train(ranks, args, script, cwd, bare)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_for_steps(run_dir, steps: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Block until ``metrics.jsonl`` holds ``steps`` lines (the ranks are inside the loop)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(path):
            with open(path) as fh:
                if sum(1 for _ in fh) >= steps:
                    return
        time.sleep(0.05)
    raise AssertionError(f"no {steps} steps in {path} after {timeout} s")


def rank_pids(root: int) -> list[int]:
    """Python processes started (through hydra's proxy) by the ``mpirun`` with pid ``root``."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    below, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - below
        below |= frontier
    out = []
    for pid in sorted(below):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if b"mpipar" in fh.read() and os.path.basename(os.readlink(f"/proc/{pid}/exe")) \
                        .startswith("python"):
                    out.append(pid)
        except OSError:
            continue
    return out
