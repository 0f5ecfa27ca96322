"""``python -m mpipar.bench moe``: expert parallelism against replicated experts. An 8-expert
top-2 model (``--moe-experts 8 --moe-top-k 2``, the default model otherwise) trained on
``--ranks`` ranks with ``--ep 1`` (every rank computes every expert for its own tokens) and
``--ep 8`` (each rank computes one expert for the tokens of its 8-rank group, sent by
all-to-all) twice: blocking (``--no-ep-overlap``) and overlapped with compute
(``parallel.ep_overlap``, the default: :func:`mpipar.model.moe.experts_fwd`), side by side in one run:
tokens/s (median after step 1), the seconds a step spends in the ep group's calls on rank 0
(blocked in them, or in the non-blocking ones' waits and tests: the exposed exchange), the ep
bytes a step sends, the training state a rank holds (weights, gradients, AdamW moments: the planner's
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


def _train(ep: int, overlap: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One run under mpirun; its metrics: tokens/s, ep seconds and bytes, memory, losses."""
    flags = ["--moe-experts", "8", "--moe-top-k", "2", "--ep", str(ep), "--steps",
             str(args.steps), "--log-every", "0", "--tensorboard", "off",
             *([] if overlap else ["--no-ep-overlap"]), *args.train_flags.split()]
    name = f"ep{ep}" + ("" if overlap or ep == 1 else "-blocking")
    records, _ = train_run("moe", args.ranks, flags, os.path.join(args.out, name))
    later = records[1:] or records
    return {"ep": ep, "overlap": overlap and ep > 1, "flags": flags,
            "losses": [r["loss"] for r in records],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "ep_seconds": statistics.median(r.get("comm_seconds", {}).get("ep", 0.0)
                                            for r in later),
            "ep_bytes": records[-1].get("comm_bytes", {}).get("ep", 0),
            "state_mib": _state_mib(flags, args.ranks),
            "peak_memory_mib": max(records[-1]["memory_bytes"]) / 2**20}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train ep = 1, ep = 8 blocking and ep = 8 overlapped; print them side by side."""
    if args.quick:
        args.steps = 4
    os.makedirs(args.out, exist_ok=True)
    rows = [_train(ep, overlap, args) for ep, overlap in ((1, True), (8, False), (8, True))]
    print_header(f"{'ep':>3} {'exchange':>10} {'tokens/s':>9} {'ep s/step':>10} "
                 f"{'ep bytes/step':>14} {'state MiB/rank':>15} {'peak MiB/rank':>14} "
                 f"{'final loss':>10}")
    for r in rows:
        kind = "-" if r["ep"] == 1 else ("overlapped" if r["overlap"] else "blocking")
        print(f"{r['ep']:>3} {kind:>10} {r['tokens_per_s']:>9.0f} {r['ep_seconds']:>10.3f} "
              f"{r['ep_bytes']:>14,} {r['state_mib']:>15.1f} {r['peak_memory_mib']:>14.0f} "
              f"{r['losses'][-1]:>10.4f}")
    return {"config": {"steps": args.steps, "ranks": args.ranks,
                       "train_flags": args.train_flags}, "rows": rows}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=8, help="mpirun -n")
    parser.add_argument("--train-flags", default="", help="more python -m mpipar.train flags")
    parser.add_argument("--out", default="runs/bench-moe", help="run directories")


SECTION = Section("moe", run, "an 8-expert top-2 model on 8 ranks: ep 8 (blocking and "
                  "overlapped exchange) against ep 1 (tokens/s, ep seconds and bytes, state "
                  "and peak memory per rank; mpirun)", configure)
