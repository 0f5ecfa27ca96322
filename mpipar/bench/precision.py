"""``python -m mpipar.bench precision``: does mixed precision train like float32? The default
run (``mpirun -n RANKS python -m mpipar.train --steps STEPS``) in float32, in bfloat16 (float32
master weights, gradients and reduction) and in bfloat16 with a bf16 gradient reduction: the
final loss of each (mean of the last ``--last`` steps) against float32's, within
``--tolerance``, with the bytes a step sends and the step time.

How far apart two precisions end is measured against how far float32 ends from itself: the
``float32-numpy`` variant is float32 with the NumPy kernels (the same arithmetic in another
summation order, float32's own round-off as the only change) and ``float64`` the run without
round-off to speak of. Over several ``--seeds`` the section also compares the means over the
seeds (each variant's final losses averaged): one 300-step run at lr 3e-3 ends a few per cent
from any perturbation of itself (docs/benchmarks.md, "Mixed precision"), the seeds' mean less.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from mpipar.bench.harness import Section, print_header, train_run, variant_names

PRECISION_VARIANTS = {
    "float32": ["--dtype", "float32"],
    "bfloat16": ["--dtype", "bfloat16"],
    "bfloat16-reduce": ["--dtype", "bfloat16", "--reduce-dtype", "bfloat16"],
    "float32-numpy": ["--dtype", "float32", "--backend", "numpy"],
    "float64": ["--dtype", "float64"],
}
"""Variant name -> its ``python -m mpipar.train`` flags."""


def _train(name: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train one variant with ``seed`` under mpirun (the default model, corpus and layout) and
    read its metrics: losses per step, the final loss, the median step time after step 1 and
    the bytes rank 0 handed to MPI in the last step (all groups)."""
    flags = [*PRECISION_VARIANTS[name], "--steps", str(args.steps), "--seed", str(seed),
             "--log-every", "0", "--tensorboard", "off", *args.train_flags.split()]
    records, wall = train_run("precision", args.ranks, flags,
                              os.path.join(args.out, f"{name}-seed{seed}"))
    losses = [r["loss"] for r in records]
    return {"variant": name, "seed": seed, "flags": flags, "losses": losses,
            "final_loss": statistics.mean(losses[-args.last:]),
            "step_time_s": statistics.median(r["step_time_s"] for r in records[1:] or records),
            "bytes": sum(records[-1].get("comm_bytes", {}).values()), "wall_s": wall}


def _against(rows: list[dict[str, Any]], base: dict[str, Any], tolerance: float) -> None:
    """Each row's final loss (and bytes) against ``base``'s, and whether it is within
    ``tolerance``, in place."""
    for r in rows:
        r["vs_float32"] = r["final_loss"] / base["final_loss"] - 1
        r["tracks"] = abs(r["vs_float32"]) <= tolerance
        r["bytes_ratio"] = r["bytes"] / base["bytes"] if base["bytes"] else None


def _seed_means(runs: dict[int, list[dict[str, Any]]], names: list[str]) -> list[dict[str, Any]]:
    """Per variant, the mean over the seeds of its final loss, and the mean and standard error
    of its per-seed difference from float32 (relative)."""
    means = []
    for name in names:
        rows = [next(r for r in seed_rows if r["variant"] == name) for seed_rows in runs.values()]
        diffs = [r["vs_float32"] for r in rows]
        means.append({"variant": name, "final_loss": statistics.mean(r["final_loss"] for r in rows),
                      "diff_mean": statistics.mean(diffs),
                      "diff_stderr": (statistics.stdev(diffs) / len(diffs) ** 0.5
                                      if len(diffs) > 1 else 0.0)})
    base = next(m for m in means if m["variant"] == "float32")
    for m in means:
        m["vs_float32"] = m["final_loss"] / base["final_loss"] - 1
    return means


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train each variant for each seed and compare its final loss with float32's (per seed,
    and the means over the seeds)."""
    if args.quick:
        args.steps, args.ranks, args.last, args.tolerance = 30, 2, 10, 0.03
    names = variant_names(args.variants, PRECISION_VARIANTS, "float32")
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    os.makedirs(args.out, exist_ok=True)
    print(f"precision: the default run on {args.ranks} ranks, {args.steps} steps, seeds "
          f"{', '.join(map(str, seeds))}; final loss = mean of the last {args.last} steps, "
          f"against float32's within {100 * args.tolerance:g} %")
    runs: dict[int, list[dict[str, Any]]] = {}
    for seed in seeds:
        rows = runs[seed] = []
        for name in names:
            rows.append(_train(name, seed, args))
            print(f"  seed {seed} {name}: final loss {rows[-1]['final_loss']:.4f} "
                  f"({rows[-1]['wall_s']:.0f} s)", flush=True)
        _against(rows, next(r for r in rows if r["variant"] == "float32"), args.tolerance)
        _print_precision(rows, seed)
    out = {"config": {"steps": args.steps, "ranks": args.ranks, "last": args.last,
                      "tolerance": args.tolerance, "train_flags": args.train_flags,
                      "seeds": seeds},
           "rows": [r for rows in runs.values() for r in rows],
           "tracks": all(r["tracks"] for rows in runs.values() for r in rows)}
    if len(seeds) > 1:
        out["seed_means"] = means = _seed_means(runs, names)
        for m in means:
            m["tracks"] = abs(m["vs_float32"]) <= args.tolerance
        _print_means(means, len(seeds))
        out["means_track"] = all(m["tracks"] for m in means)
    return out


def _print_precision(rows: list[dict[str, Any]], seed: int) -> None:
    header = (f"seed {seed}: {'variant':<16} {'final loss':>10} {'vs float32':>10} {'tracks':>6} "
              f"{'bytes/step':>12} {'vs float32':>10} {'step s':>7}")
    print_header(header)
    for r in rows:
        ratio = f"{r['bytes_ratio']:.2f}x" if r["bytes_ratio"] else "-"
        print(f"{'':>{len(str(seed)) + 7}}{r['variant']:<16} {r['final_loss']:>10.4f} "
              f"{100 * r['vs_float32']:>+9.2f}% {'yes' if r['tracks'] else 'NO':>6} "
              f"{r['bytes']:>12,} {ratio:>10} {r['step_time_s']:>7.3f}")
    print("bytes/step: what rank 0 handed to MPI in the last step, all groups; step s: median "
          "step time (CPU bf16 upcasts to float32 at every op: not a speed figure)")


def _print_means(means: list[dict[str, Any]], seeds: int) -> None:
    print_header(f"{'mean of ' + str(seeds) + ' seeds':<18} {'final loss':>10} {'vs float32':>10} "
                 f"{'tracks':>6} {'per-seed difference':>22}")
    for m in means:
        print(f"{m['variant']:<18} {m['final_loss']:>10.4f} {100 * m['vs_float32']:>+9.2f}% "
              f"{'yes' if m['tracks'] else 'NO':>6} {100 * m['diff_mean']:>+13.2f} "
              f"+- {100 * m['diff_stderr']:.2f} %")
    print("per-seed difference: the mean of each seed's final loss against that seed's float32, "
          "+- its standard error")


def configure(parser: argparse.ArgumentParser) -> None:
    """The precision section's options: variants, steps, ranks, the final-loss window."""
    parser.add_argument("--variants", default="float32,bfloat16,bfloat16-reduce",
                        help=f"comma list of {', '.join(PRECISION_VARIANTS)} (float32 is "
                             f"always run)")
    parser.add_argument("--seeds", default="1234",
                        help="comma list of --seed values (the default run's is 1234); with "
                             "several, the means over the seeds are compared too")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=8, help="mpirun -n")
    parser.add_argument("--last", type=int, default=20, help="final loss: mean of the last N steps")
    parser.add_argument("--tolerance", type=float, default=0.01,
                        help="a variant tracks float32 when its final loss is within this "
                             "relative difference")
    parser.add_argument("--train-flags", default="", help="more python -m mpipar.train flags")
    parser.add_argument("--out", default="runs/bench-precision", help="run directories")


SECTION = Section("precision", run, "the default run in float32 and bfloat16 (mixed precision): "
                  "final losses side by side (mpirun)", configure)
