"""``python -m mpipar.bench moe``: expert parallelism against replicated experts. An 8-expert
top-2 model (``--moe-experts 8 --moe-top-k 2``, the default model otherwise) trained on
``--ranks`` ranks with ``--ep 1`` (every rank computes every expert for its own tokens) and
``--ep 8`` (each rank computes one expert for the tokens of its 8-rank group, sent by
all-to-all), side by side in one run: tokens/s (median after step 1), the ep bytes a step
sends, the training state a rank holds (weights, gradients, AdamW moments: the planner's
:func:`mpipar.plan.memory.predict_memory`, which ``tests/mpi/test_moe.py`` holds equal to the
engine's buffers; under ep 8 a rank holds one expert of each block, not 8:
:mod:`mpipar.parallel.experts`) and peak memory per rank (the process's peak RSS).
"""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from mpipar.bench.harness import Section, print_header, train_run
from mpipar.config import add_arguments, from_args
from mpipar.plan.memory import predict_memory
from mpipar.rules import validate
from mpipar.runtime.topology import Coord


def _state_mib(flags: list[str], ranks: int) -> float:
    """MiB of training state (weights, masters, gradients, moments) rank 0 of the run of
    ``flags`` on ``ranks`` ranks holds, as the planner counts it."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    layout = validate(from_args(parser.parse_args(flags)), ranks)
    return predict_memory(layout, Coord(0, 0, 0, 0)).state / 2**20


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
            "state_mib": _state_mib(flags, args.ranks),
            "peak_memory_mib": max(records[-1]["memory_bytes"]) / 2**20}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train ep = 1 and ep = 8 and print them side by side."""
    if args.quick:
        args.steps = 4
    os.makedirs(args.out, exist_ok=True)
    rows = [_train(ep, args) for ep in (1, 8)]
    print_header(f"{'ep':>3} {'tokens/s':>9} {'ep bytes/step':>14} {'state MiB/rank':>15} "
                 f"{'peak MiB/rank':>14} {'final loss':>10}")
    for r in rows:
        print(f"{r['ep']:>3} {r['tokens_per_s']:>9.0f} {r['ep_bytes']:>14,} "
              f"{r['state_mib']:>15.1f} {r['peak_memory_mib']:>14.0f} {r['losses'][-1]:>10.4f}")
    return {"config": {"steps": args.steps, "ranks": args.ranks,
                       "train_flags": args.train_flags}, "rows": rows}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=8, help="mpirun -n")
    parser.add_argument("--train-flags", default="", help="more python -m mpipar.train flags")
    parser.add_argument("--out", default="runs/bench-moe", help="run directories")


SECTION = Section("moe", run, "an 8-expert top-2 model on 8 ranks: ep 8 against ep 1 "
                  "(tokens/s, ep bytes, state and peak memory per rank; mpirun)", configure)
