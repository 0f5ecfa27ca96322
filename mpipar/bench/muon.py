"""``python -m mpipar.bench muon``: does Muon train the default run better than AdamW, each at
its own tuned learning rate, and what does its optimizer step cost?

The default run (``mpirun -n RANKS python -m mpipar.train --steps STEPS``) with ``--optimizer
adamw`` and ``--optimizer muon``. First a learning-rate sweep per optimizer (``--lrs-adamw``,
``--lrs-muon``; ``--sweep-steps`` steps, one seed, ``--sweep-seed``): the rate with the lowest
final loss is the optimizer's (a list of one rate skips its sweep). Then each optimizer at its
rate over ``--seeds``: the final loss (mean of the last ``--last`` steps) per seed, its mean and
standard deviation over the seeds, Muon's per-seed difference from AdamW, and what the optimizer
step costs (the runs' ``optimizer_s`` and ``optimizer_bytes``: rank 0's seconds of clipping and
the update, and the bytes it handed to MPI): its median seconds, their share of the median step,
and its bytes per step beside the bytes of the whole step. ``--min-lr`` is a tenth of each rate
(the default run's ratio), so the cosine schedule has the same shape for every rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from mpipar.bench.harness import Section, print_header, train_run

OPTIMIZERS = ("adamw", "muon")


def _train(optimizer: str, lr: float, seed: int, steps: int, args: argparse.Namespace,
           tag: str) -> dict[str, Any]:
    """One run of the default run with ``optimizer`` at ``lr`` under mpirun, and its numbers."""
    flags = ["--optimizer", optimizer, "--lr", repr(lr), "--min-lr", repr(lr / 10),
             "--steps", str(steps), "--seed", str(seed), "--log-every", "0",
             "--tensorboard", "off", *args.train_flags.split()]
    records, wall = train_run("muon", args.ranks, flags,
                              os.path.join(args.out, f"{tag}-{optimizer}-lr{lr:g}-seed{seed}"))
    return run_numbers(records, args.last) | {"optimizer": optimizer, "lr": lr, "seed": seed,
                                              "steps": steps, "flags": flags, "wall_s": wall}


def run_numbers(records: list[dict[str, Any]], last: int) -> dict[str, Any]:
    """A run's numbers from its metrics records: the final loss (mean of the last ``last``
    steps), and from the steps after the first (a warm-up) the median step time, the median
    optimizer seconds and their share of the step, the optimizer's bytes and all the bytes rank
    0 handed to MPI in the last step."""
    losses = [r["loss"] for r in records]
    steady = records[1:] or records
    step_s = statistics.median(r["step_time_s"] for r in steady)
    opt_s = statistics.median(r.get("optimizer_s", 0.0) for r in steady)
    return {"losses": losses, "final_loss": statistics.mean(losses[-last:]),
            "step_time_s": step_s, "optimizer_s": opt_s, "optimizer_share": opt_s / step_s,
            "optimizer_bytes": int(statistics.median(r.get("optimizer_bytes", 0)
                                                     for r in steady)),
            "step_bytes": sum(records[-1].get("comm_bytes", {}).values())}


def best_lr(rows: list[dict[str, Any]]) -> float:
    """The learning rate of the row with the lowest final loss (a non-finite loss never wins)."""
    finite = [r for r in rows if r["final_loss"] == r["final_loss"]
              and r["final_loss"] != float("inf")]
    if not finite:
        raise SystemExit(f"muon: every rate of the sweep diverged: {[r['lr'] for r in rows]}")
    return min(finite, key=lambda r: r["final_loss"])["lr"]


def seed_means(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per optimizer, over its seeds: the final loss's mean and standard deviation, and the means
    of the step time, the optimizer's seconds, share and bytes, and the step's bytes; for Muon
    also the per-seed difference from AdamW's final loss (relative): mean and standard error."""
    out: dict[str, dict[str, Any]] = {}
    for name in OPTIMIZERS:
        mine = [r for r in rows if r["optimizer"] == name]
        if not mine:
            continue
        finals = [r["final_loss"] for r in mine]
        out[name] = {"seeds": len(mine), "lr": mine[0]["lr"], "final_loss": statistics.mean(finals),
                     "final_loss_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                     **{k: statistics.mean(r[k] for r in mine)
                        for k in ("step_time_s", "optimizer_s", "optimizer_share",
                                  "optimizer_bytes", "step_bytes")}}
    if len(out) == len(OPTIMIZERS):
        base = {r["seed"]: r["final_loss"] for r in rows if r["optimizer"] == "adamw"}
        diffs = [r["final_loss"] / base[r["seed"]] - 1 for r in rows
                 if r["optimizer"] == "muon" and r["seed"] in base]
        out["muon"]["vs_adamw"] = statistics.mean(diffs)
        out["muon"]["vs_adamw_stderr"] = (statistics.stdev(diffs) / len(diffs) ** 0.5
                                          if len(diffs) > 1 else 0.0)
    return out


def _rates(text: str) -> list[float]:
    rates = [float(v) for v in text.split(",") if v.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise SystemExit(f"muon: learning rates must be a comma list of positive numbers: {text!r}")
    return rates


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The sweep, then each optimizer at its best rate over the seeds."""
    if args.quick:
        args.steps, args.sweep_steps, args.ranks, args.last, args.seeds = 30, 20, 2, 10, "1234"
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    rates = {"adamw": _rates(args.lrs_adamw), "muon": _rates(args.lrs_muon)}
    os.makedirs(args.out, exist_ok=True)
    print(f"muon: the default run on {args.ranks} ranks; sweep {args.sweep_steps} steps, seed "
          f"{args.sweep_seed}; then {args.steps} steps, seeds {', '.join(map(str, seeds))}; final "
          f"loss = mean of the last {args.last} steps", flush=True)
    sweep, best = [], {}
    for name in OPTIMIZERS:
        if len(rates[name]) == 1:
            best[name] = rates[name][0]
            continue
        rows = [_train(name, lr, args.sweep_seed, args.sweep_steps, args, "sweep")
                for lr in rates[name]]
        for r in rows:
            print(f"  sweep {name} lr {r['lr']:g}: final loss {r['final_loss']:.4f} "
                  f"({r['wall_s']:.0f} s)", flush=True)
        sweep += rows
        best[name] = best_lr(rows)
    rows = []
    for seed in seeds:
        for name in OPTIMIZERS:
            rows.append(_train(name, best[name], seed, args.steps, args, "run"))
            print(f"  seed {seed} {name} lr {best[name]:g}: final loss "
                  f"{rows[-1]['final_loss']:.4f} ({rows[-1]['wall_s']:.0f} s)", flush=True)
    means = seed_means(rows)
    _print_means(means, len(seeds))
    strip = ("losses", "flags")
    return {"config": {"steps": args.steps, "ranks": args.ranks, "last": args.last,
                       "seeds": seeds, "sweep_steps": args.sweep_steps,
                       "sweep_seed": args.sweep_seed, "rates": rates,
                       "train_flags": args.train_flags},
            "best_lr": best, "sweep": [{k: v for k, v in r.items() if k not in strip}
                                       for r in sweep],
            "rows": rows, "means": means}


def _print_means(means: dict[str, dict[str, Any]], seeds: int) -> None:
    print_header(f"{'mean of ' + str(seeds) + ' seed(s)':<16} {'lr':>7} {'final loss':>17} "
                 f"{'vs adamw':>16} {'step s':>7} {'optimizer s':>11} {'share':>6} "
                 f"{'opt bytes':>11} {'step bytes':>11}")
    for name, m in means.items():
        vs = (f"{100 * m['vs_adamw']:+.2f} +- {100 * m['vs_adamw_stderr']:.2f}%"
              if "vs_adamw" in m else "")
        print(f"{name:<16} {m['lr']:>7.3g} {m['final_loss']:>9.4f} +- {m['final_loss_sd']:.4f} "
              f"{vs:>16} {m['step_time_s']:>7.3f} {m['optimizer_s']:>11.4f} "
              f"{100 * m['optimizer_share']:>5.1f}% {m['optimizer_bytes']:>11,.0f} "
              f"{m['step_bytes']:>11,.0f}")
    print("final loss: mean +- standard deviation over the seeds; vs adamw: the mean of each "
          "seed's difference from AdamW's, +- its standard error; optimizer s and share: rank "
          "0's median seconds of clipping and the update, and their share of the median step; "
          "bytes: what rank 0 handed to MPI in the optimizer step and in the whole step")


def configure(parser: argparse.ArgumentParser) -> None:
    """The muon section's options: the rates swept, seeds, steps, ranks, the final-loss window."""
    parser.add_argument("--lrs-adamw", default="3e-4,1e-3,3e-3,1e-2",
                        help="AdamW's learning rates swept (one: no sweep)")
    parser.add_argument("--lrs-muon", default="5e-3,1e-2,2e-2,5e-2,1e-1",
                        help="Muon's learning rates swept (one: no sweep)")
    parser.add_argument("--sweep-steps", type=int, default=100)
    parser.add_argument("--sweep-seed", type=int, default=1234)
    parser.add_argument("--seeds", default="1234,1,2", help="comma list of --seed values")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=8, help="mpirun -n")
    parser.add_argument("--last", type=int, default=20, help="final loss: mean of the last N steps")
    parser.add_argument("--train-flags", default="", help="more python -m mpipar.train flags")
    parser.add_argument("--out", default="runs/bench-muon", help="run directories")


SECTION = Section("muon", run, "the default run with AdamW and with Muon, each at its tuned "
                  "learning rate: final losses over seeds, the optimizer's time and bytes (mpirun)",
                  configure)
