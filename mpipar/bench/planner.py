"""``python -m mpipar.bench planner``: the planner's predicted step time (from a hardware file,
``python -m mpipar.bench comm``) against the measured one of training runs of several layouts,
side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from mpipar.bench.harness import LAUNCH_ENV, Section, print_header


PLANNER_LAYOUTS = ("--dp 8", "--dp 4 --tp 2", "--dp 2 --tp 2 --pp 2 --micro-batch-size 2",
                   "--dp 2 --sp 2 --tp 2", "--tp 2 --sp 2 --pp 2 --micro-batch-size 4")


def measured_step_time(launch: list[str], flags: list[str], run_dir: str) -> tuple[float, Any]:
    """Median step time of steps after the first third of a training run of ``flags`` (the
    default model), and the run's resolved config."""
    from mpipar.config import Config

    proc = subprocess.run([*launch, sys.executable, "-m", "mpipar.train", *flags, "--run-dir",
                           run_dir, "--log-every", "0"], capture_output=True, text=True,
                          timeout=900, env=LAUNCH_ENV)
    if proc.returncode != 0:
        raise SystemExit(f"planner: training {' '.join(flags)} failed:\n{proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        times = [json.loads(line)["step_time_s"] for line in fh]
    return statistics.median(times[len(times) // 3:]), Config.from_toml(
        os.path.join(run_dir, "config.toml"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train each layout for ``--steps`` steps under ``--launcher`` and print the planner's
    predicted step time (``--hardware`` file) beside the measured median."""
    from mpipar.plan.step_time import Hardware, predict_step_time
    from mpipar.rules import validate

    hw = Hardware.load(args.hardware)
    launch = args.launcher.split() + ["-n", str(args.ranks)]
    steps = 6 if args.quick else args.steps
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-planner-") as tmp:
        for i, layout in enumerate(args.layouts.split(";")):
            flags = [*layout.split(), "--steps", str(steps), *args.train_args.split()]
            measured, cfg = measured_step_time(launch, flags, os.path.join(tmp, str(i)))
            predicted = predict_step_time(validate(cfg, args.ranks), hw)
            rows.append({"layout": layout, "predicted_s": predicted.total, "measured_s": measured,
                         "ratio": predicted.total / measured})
    print(f"planner: {args.ranks} ranks, {steps} steps each, the default model "
          f"{args.train_args}; hardware {args.hardware}")
    header = f"{'layout':<44} {'predicted ms':>13} {'measured ms':>12} {'predicted/measured':>19}"
    print_header(header)
    for r in rows:
        print(f"{r['layout']:<44} {r['predicted_s'] * 1e3:>13.1f} {r['measured_s'] * 1e3:>12.1f} "
              f"{r['ratio']:>19.2f}")
    return {"hardware": hw.to_dict(), "rows": rows}


def configure(parser: argparse.ArgumentParser) -> None:
    """The planner section's options: hardware file, launcher, ranks, steps, layouts."""
    parser.add_argument("--hardware", default="hardware.json",
                        help="from python -m mpipar.bench comm")
    parser.add_argument("--launcher", default="mpirun", help="the launch command (before -n)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--layouts", default=";".join(PLANNER_LAYOUTS),
                        help="';'-separated layout flags")
    parser.add_argument("--train-args", default="", help="more mpipar.train flags for every run")


SECTION = Section("planner", run, "predicted against measured step time of several layouts",
                  configure)
