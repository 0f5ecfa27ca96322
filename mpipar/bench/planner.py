"""``python -m mpipar.bench planner``: the planner's predicted step time against the measured one
of training runs of several layouts, side by side: from a hardware file (``python -m mpipar.bench
comm``), or probed here after each run as ``python -m mpipar.plan`` probes, with the machine's
load at that moment (how much longer the other processes make a step, :func:`mpipar.plan.cli.
machine_load`) beside it.
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


def probed_hardware(cfg: Any, ranks: int) -> Any:
    """The hardware ``python -m mpipar.plan`` probes for ``cfg`` on ``ranks`` ranks of this node
    (its default links)."""
    from mpipar.plan import cli
    args = cli.build_parser().parse_args(["--world", str(ranks)])
    return cli._probed_hardware(args, cfg)[0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train each layout for ``--steps`` steps under ``--launcher`` and print the planner's
    predicted step time (``--hardware`` file, else probed right after the run) beside the
    measured median, with the load average before the run (the other processes') and the
    slowdown it implies."""
    from mpipar.plan.cli import machine_load
    from mpipar.plan.step_time import Hardware, predict_step_time
    from mpipar.rules import validate

    fixed = Hardware.load(args.hardware) if args.hardware else None
    launch = args.launcher.split() + ["-n", str(args.ranks)]
    steps = 6 if args.quick else args.steps
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-planner-") as tmp:
        for i, layout in enumerate(args.layouts.split(";")):
            flags = [*layout.split(), "--steps", str(steps), *args.train_args.split()]
            slowdown, load = machine_load(args.ranks)[0], os.getloadavg()[0]  # not ours yet
            measured, cfg = measured_step_time(launch, flags, os.path.join(tmp, str(i)))
            hw = fixed or probed_hardware(cfg, args.ranks)      # probed right after the run
            predicted = predict_step_time(validate(cfg, args.ranks), hw)
            rows.append({"layout": layout, "predicted_s": predicted.total, "measured_s": measured,
                         "ratio": predicted.total / measured, "load": load,
                         "load_slowdown": slowdown,
                         "ratio_under_load": predicted.total * slowdown / measured,
                         "hardware": hw.to_dict()})
    print(f"planner: {args.ranks} ranks, {steps} steps each, the default model "
          f"{args.train_args}; hardware {args.hardware or 'probed after each run'}")
    header = (f"{'layout':<44} {'predicted ms':>13} {'measured ms':>12} {'predicted/measured':>19}"
              f" {'load':>6} {'x load':>7} {'under load/measured':>20}")
    print_header(header)
    for r in rows:
        print(f"{r['layout']:<44} {r['predicted_s'] * 1e3:>13.1f} {r['measured_s'] * 1e3:>12.1f} "
              f"{r['ratio']:>19.2f} {r['load']:>6.1f} {r['load_slowdown']:>7.2f} "
              f"{r['ratio_under_load']:>20.2f}")
    return {"rows": rows}


def configure(parser: argparse.ArgumentParser) -> None:
    """The planner section's options: hardware file, launcher, ranks, steps, layouts."""
    parser.add_argument("--hardware", default="",
                        help="from python -m mpipar.bench comm (default: probed after each run "
                             "as python -m mpipar.plan probes)")
    parser.add_argument("--launcher", default="mpirun", help="the launch command (before -n)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--layouts", default=";".join(PLANNER_LAYOUTS),
                        help="';'-separated layout flags")
    parser.add_argument("--train-args", default="", help="more mpipar.train flags for every run")


SECTION = Section("planner", run, "predicted against measured step time of several layouts",
                  configure)
