"""``python -m mpipar.bench moe``: expert parallelism against replicated experts. An 8-expert
top-2 model (``--moe-experts 8 --moe-top-k 2``, the default model otherwise) trained on
``--ranks`` ranks with ``--ep 1`` (every rank computes every expert for its own tokens) and
``--ep 8`` (each rank computes one expert for the tokens of its 8-rank group, sent by
all-to-all), side by side in one run: tokens/s (median after step 1), the ep bytes a step
sends, peak memory per rank (the experts' weights, gradients and optimizer state are still
replicated over dp x sp under ep: :mod:`mpipar.parallel.experts`).
"""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from mpipar.bench.harness import Section, print_header, train_run


def _train(ep: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run under mpirun; its metrics: tokens/s, ep bytes, peak memory, losses."""
    flags = ["--moe-experts", "8", "--moe-top-k", "2", "--ep", str(ep), "--steps",
             str(args.steps), "--log-every", "0", "--tensorboard", "off",
             *args.train_flags.split()]
    records, _ = train_run("moe", args.ranks, flags, os.path.join(args.out, f"ep{ep}"))
    later = records[1:] or records
    return {"ep": ep, "flags": flags, "losses": [r["loss"] for r in records],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "ep_bytes": records[-1].get("comm_bytes", {}).get("ep", 0),
            "peak_memory_mib": max(records[-1]["memory_bytes"]) / 2**20}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train ep = 1 and ep = 8 and print them side by side."""
    if args.quick:
        args.steps = 4
    os.makedirs(args.out, exist_ok=True)
    rows = [_train(ep, args) for ep in (1, 8)]
    print_header(f"{'ep':>3} {'tokens/s':>9} {'ep bytes/step':>14} {'peak MiB/rank':>14} "
                 f"{'final loss':>10}")
    for r in rows:
        print(f"{r['ep']:>3} {r['tokens_per_s']:>9.0f} {r['ep_bytes']:>14,} "
              f"{r['peak_memory_mib']:>14.0f} {r['losses'][-1]:>10.4f}")
    return {"config": {"steps": args.steps, "ranks": args.ranks,
                       "train_flags": args.train_flags}, "rows": rows}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=8, help="mpirun -n")
    parser.add_argument("--train-flags", default="", help="more python -m mpipar.train flags")
    parser.add_argument("--out", default="runs/bench-moe", help="run directories")


SECTION = Section("moe", run, "an 8-expert top-2 model on 8 ranks: ep 8 against ep 1 "
                  "(tokens/s, ep bytes, memory per rank; mpirun)", configure)
