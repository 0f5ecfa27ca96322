"""What every benchmark section shares: the section record, thread setup, timing, printing,
child processes and JSON results.

Importing this module sets the thread budget (before NumPy loads): under a launcher each rank
gets its share of the node's cores for BLAS (as in ``python -m mpipar.train``), not all of them
(8 ranks x all-core BLAS pools thrash 2 cores). The jobs a section starts get the environment as
it was (:data:`LAUNCH_ENV`), to budget their own threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from mpipar.runtime import nodes
from mpipar.runtime.mpi_init import MPI

LAUNCH_ENV = dict(os.environ)
"""The environment before the thread budget: what ``mpipar.train`` jobs started here get."""
nodes.configure_threads(None)


@dataclass(frozen=True)
class Section:
    """A benchmark: subcommand ``name``; ``run(args)`` prints a table and returns JSON-able
    results; ``configure(parser)`` adds the section's options."""

    name: str
    run: Callable[[argparse.Namespace], dict[str, Any]]
    help: str
    configure: Callable[[argparse.ArgumentParser], None] | None = None


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------

def time_call(fn: Callable[[], Any], sync: Callable[[], None], repeats: int, min_seconds: float) -> float:
    """Median seconds per call of `fn` over `repeats` batches.

    Two warm-up calls come first (the first one includes any JIT compilation); each batch runs
    enough calls to last at least `min_seconds`; `sync` waits for asynchronous devices.
    """
    for _ in range(2):
        fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(min_seconds / one))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def best_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(fastest wall, fastest CPU) seconds of `repeats` timed calls after one untimed call (which
    compiles). CPU seconds are this process's, all threads: with one thread, the time the call
    ran, however many other processes shared the cores meanwhile."""
    fn()
    wall = cpu = math.inf
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - cpu_start)
    return wall, cpu


def sustained(fn: Callable[[], Any], seconds: float) -> float:
    """Mean wall seconds of one ``fn()`` called back to back for about ``seconds``: with every
    rank doing the same at once, what a rank really gets of its share of the cores."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


# ----------------------------------------------------------------------------------------------
# printing and options
# ----------------------------------------------------------------------------------------------

def rank0_print(comm: Any) -> Callable[..., None]:
    """``print`` on rank 0 of ``comm``, a function that prints nothing on the other ranks."""
    return print if comm.Get_rank() == 0 else (lambda *a, **k: None)


def print_header(header: str, say: Callable[..., None] = print) -> None:
    """A table's header line and a rule of dashes under it."""
    say(header)
    say("-" * len(header))


def ints(text: str) -> list[int]:
    """A comma list of integers ("" -> [])."""
    return [int(t) for t in text.split(",") if t.strip()]


def thread_counts(text: str) -> list[int]:
    """--threads: a comma list, or "" for 1 and every core of this machine."""
    counts = ints(text) or sorted({1, nodes.cpu_count()})
    if any(t < 1 for t in counts):
        raise SystemExit(f"--threads {text!r}: thread counts must be >= 1")
    return counts


# ----------------------------------------------------------------------------------------------
# child processes and JSON results
# ----------------------------------------------------------------------------------------------

def mpirun() -> str | None:
    """The mpirun beside this Python (the [mpich] extra), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


def run_child(section_argv: list[str], threads: int, launcher: tuple[str, ...] = ()) -> dict[str, Any]:
    """Results of `python -m mpipar.bench SECTION_ARGV --json F` run in a child process (under
    `launcher`, e.g. mpirun) with `threads` threads for BLAS, OpenMP and Numba."""
    env = dict(os.environ, **{var: str(threads) for var in nodes.THREAD_VARS})
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-") as tmp:
        path = os.path.join(tmp, "results.json")
        argv = [*launcher, sys.executable, "-m", "mpipar.bench", *section_argv, "--json", path]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"bench child {' '.join(argv)} failed with status {proc.returncode}:\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)


def variant_names(text: str, known, first: str) -> list[str]:
    """The comma list ``text`` of variants, each one of ``known`` (else the section stops naming
    the unknown ones), with the reference variant ``first`` put first when it is missing."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in known]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(known)}")
    return names if first in names else [first, *names]


def train_run(section: str, ranks: int, flags: list[str], run_dir: str) -> tuple[list[dict], float]:
    """``mpirun -n ranks python -m mpipar.train FLAGS --run-dir RUN_DIR``: every line of its
    metrics.jsonl and the run's wall seconds. A failed run ends the bench ``section`` with its
    command and the tail of its output."""
    launcher = mpirun()
    if launcher is None:
        raise SystemExit(f"{section}: no mpirun beside this Python or on PATH")
    cmd = [launcher, "-n", str(ranks), sys.executable, "-m", "mpipar.train", *flags,
           "--run-dir", run_dir]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=LAUNCH_ENV)
    if proc.returncode != 0:
        raise SystemExit(f"{section}: {' '.join(cmd)} failed:\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return records, time.perf_counter() - start


def write_results(results: dict[str, dict[str, Any]], path: str) -> None:
    """``{section: results}`` as JSON to ``path`` (rank 0 of MPI.COMM_WORLD only)."""
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
        print(f"wrote {path}", file=sys.stderr)
