"""``python -m mpipar.bench precision``: does mixed precision train like float32? The default
run (``mpirun -n RANKS python -m mpipar.train --steps STEPS``) in float32, in bfloat16 (float32
master weights, gradients and reduction) and in bfloat16 with a bf16 gradient reduction: the
final loss of each (mean of the last ``--last`` steps) against float32's, within
``--tolerance``, with the bytes a step sends and the step time.
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
}
"""Variant name -> its ``python -m mpipar.train`` flags."""


def _train(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one variant under mpirun (the default model, corpus and layout) and read its
    metrics: losses per step, the final loss, the median step time after step 1 and the bytes
    rank 0 handed to MPI in the last step (all groups)."""
    flags = [*PRECISION_VARIANTS[name], "--steps", str(args.steps), "--log-every", "0",
             "--tensorboard", "off", *args.train_flags.split()]
    records, wall = train_run("precision", args.ranks, flags, os.path.join(args.out, name))
    losses = [r["loss"] for r in records]
    return {"variant": name, "flags": flags, "losses": losses,
            "final_loss": statistics.mean(losses[-args.last:]),
            "step_time_s": statistics.median(r["step_time_s"] for r in records[1:] or records),
            "bytes": sum(records[-1].get("comm_bytes", {}).values()), "wall_s": wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train each variant and compare its final loss with float32's."""
    if args.quick:
        args.steps, args.ranks, args.last, args.tolerance = 30, 2, 10, 0.03
    names = variant_names(args.variants, PRECISION_VARIANTS, "float32")
    os.makedirs(args.out, exist_ok=True)
    print(f"precision: the default run on {args.ranks} ranks, {args.steps} steps; final loss = "
          f"mean of the last {args.last} steps, against float32's within "
          f"{100 * args.tolerance:g} %")
    rows = []
    for name in names:
        rows.append(_train(name, args))
        print(f"  {name}: final loss {rows[-1]['final_loss']:.4f} ({rows[-1]['wall_s']:.0f} s)",
              flush=True)
    base = next(r for r in rows if r["variant"] == "float32")
    for r in rows:
        r["vs_float32"] = r["final_loss"] / base["final_loss"] - 1
        r["tracks"] = abs(r["vs_float32"]) <= args.tolerance
        r["bytes_ratio"] = r["bytes"] / base["bytes"] if base["bytes"] else None
    _print_precision(rows)
    return {"config": {"steps": args.steps, "ranks": args.ranks, "last": args.last,
                       "tolerance": args.tolerance, "train_flags": args.train_flags},
            "rows": rows, "tracks": all(r["tracks"] for r in rows)}


def _print_precision(rows: list[dict[str, Any]]) -> None:
    header = (f"{'variant':<16} {'final loss':>10} {'vs float32':>10} {'tracks':>6} "
              f"{'bytes/step':>12} {'vs float32':>10} {'step s':>7}")
    print_header(header)
    for r in rows:
        ratio = f"{r['bytes_ratio']:.2f}x" if r["bytes_ratio"] else "-"
        print(f"{r['variant']:<16} {r['final_loss']:>10.4f} {100 * r['vs_float32']:>+9.2f}% "
              f"{'yes' if r['tracks'] else 'NO':>6} {r['bytes']:>12,} {ratio:>10} "
              f"{r['step_time_s']:>7.3f}")
    print("bytes/step: what rank 0 handed to MPI in the last step, all groups; step s: median "
          "step time (CPU bf16 upcasts to float32 at every op: not a speed figure)")


def configure(parser: argparse.ArgumentParser) -> None:
    """The precision section's options: variants, steps, ranks, the final-loss window."""
    parser.add_argument("--variants", default="float32,bfloat16,bfloat16-reduce",
                        help=f"comma list of {', '.join(PRECISION_VARIANTS)} (float32 is "
                             f"always run)")
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
