"""``python -m mpipar.bench window`` under ``mpirun -n SP``: sliding-window attention over
sequence parallelism, the SP bytes per step and the step time of the full causal ring, the
windowed ring and the halo exchange, with the window W fixed and the sequence S growing; the
ledger's bytes checked against the planner's prediction.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import numpy as np

from mpipar.bench.harness import Section, ints, rank0_print
from mpipar.rules import validate


def measure_window_step(sp_mode: str, window: int, seq: int, args: argparse.Namespace,
                        data: str, comm: Any) -> dict[str, Any]:
    """Train ``args.steps`` steps with sp = comm size; (median step seconds after the first,
    the SP bytes per step of the rank that sends the most, the planner's prediction of it)."""
    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from mpipar.data.sources import load_tokens
    from mpipar.training.rank import build_rank
    from mpipar.training.step import train_step
    from mpipar.plan.traffic import predict_step_bytes

    sp = comm.Get_size()
    cfg = validate(Config(ModelConfig(vocab_size=256, hidden=args.hidden, layers=args.layers,
                             heads=args.heads, kv_heads=args.kv_heads, sliding_window=window),
                 ParallelConfig(sp=sp, sp_mode=sp_mode),
                 TrainConfig(seq_len=seq, global_batch_size=1, dtype="float32", backend="auto",
                             steps=args.steps)), sp)
    rank = build_rank(cfg, comm, source=load_tokens(data, 256, seq))
    seconds, sent = [], []
    for k in range(args.steps):
        rank.ledger.reset()
        comm.Barrier()
        t0 = time.perf_counter()
        train_step(rank, k)
        comm.Barrier()
        seconds.append(time.perf_counter() - t0)
        sent.append(rank.ledger.bytes_by_group().get("sp", 0))
    predicted = predict_step_bytes(cfg, rank.coord).get("sp", 0)
    most = max(comm.allgather(sent[-1]))
    exact = all(comm.allgather(sent[-1] == predicted))
    return {"mode": sp_mode, "window": window, "seq": seq, "step_s": float(np.median(seconds[1:])),
            "sp_bytes": most, "ledger_equals_planner": exact}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """SP bytes and step time against the window W and the sequence S (W fixed, S growing):
    full causal ring, windowed ring, halo. Run under ``mpirun -n SP``."""
    from mpipar.runtime.mpi_init import MPI

    comm = MPI.COMM_WORLD
    say = rank0_print(comm)
    if args.quick:
        args.seqs, args.window, args.steps = "256,1024", 64, 2
    seqs = ints(args.seqs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-window-") as tmp:
        tmp = comm.bcast(tmp)
        for seq in seqs:
            data = os.path.join(tmp, f"tokens_{seq}.npy")
            if comm.Get_rank() == 0:
                np.save(data, np.random.default_rng(0).integers(0, 256, size=(4, seq + 1)))
            comm.Barrier()
            for mode, window in (("ring", 0), ("ring", args.window), ("halo", args.window)):
                rows.append(measure_window_step(mode, window, seq, args, data, comm))
        comm.Barrier()
    say(f"window: sp={comm.Get_size()}, W={args.window}, layers={args.layers} "
        f"hidden={args.hidden} heads={args.heads}/{args.kv_heads}, float32, one sequence per step")
    say(f"{'mode':>6} {'W':>5} {'S':>6} {'SP MiB/rank':>12} {'step s':>8} {'vs full ring':>13}"
        f" {'ledger=planner':>15}")
    for r in rows:
        base = next(b for b in rows if b["seq"] == r["seq"] and b["window"] == 0)
        say(f"{r['mode']:>6} {r['window']:>5} {r['seq']:>6} {r['sp_bytes'] / 2**20:>12.3f} "
            f"{r['step_s']:>8.3f} {r['step_s'] / base['step_s']:>13.2f} "
            f"{str(r['ledger_equals_planner']):>15}")
    return {"rows": rows}


def configure(parser: argparse.ArgumentParser) -> None:
    """The window section's options: W, the sequence lengths, steps and the model."""
    parser.add_argument("--window", type=int, default=256, help="sliding window W")
    parser.add_argument("--seqs", default="1024,4096", help="comma list of sequence lengths")
    parser.add_argument("--steps", type=int, default=4, help="steps per case (the first is "
                        "not timed)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)


SECTION = Section("window", run, "sliding-window attention over SP (under mpirun -n SP): bytes and "
                  "step time of the full ring, the windowed ring and the halo exchange against S",
                  configure)
