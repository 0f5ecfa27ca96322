"""``python -m mpipar.train``: train a Llama model with 4D parallelism over MPI.

    mpirun -n 8 python -m mpipar.train [--config FILE] [flags]

Writes ``RUN_DIR/config.toml`` (the full resolved configuration) and ``RUN_DIR/metrics.jsonl``
(one JSON object per optimizer step). Bad configuration or data: every rank prints nothing but
rank 0 prints the error, and every rank exits with status 2 before any collective. An uncaught
exception on any rank aborts the whole job with that rank's number and traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from mpi4py import MPI

from mpipar import config as config_mod
from mpipar.config import Config, ConfigError

EXIT_USAGE = 2


def install_abort_hook(comm: MPI.Comm = MPI.COMM_WORLD) -> None:
    """Make an uncaught exception on any rank abort the whole job (never a hang)."""
    rank = comm.Get_rank()

    def hook(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"mpipar: rank {rank} failed; aborting all ranks\n{text}")
        sys.stderr.flush()
        comm.Abort(1)

    sys.excepthook = hook


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpipar.train",
        description="Train a Llama-family model with data/tensor/pipeline/sequence parallelism "
                    "over MPI. Flags override --config; see README for every field.")
    config_mod.add_arguments(parser)
    return parser


def fail_usage(message: str, comm: MPI.Comm = MPI.COMM_WORLD) -> None:
    """Print the error once (rank 0) and exit 2 on every rank, without any collective."""
    if comm.Get_rank() == 0:
        sys.stderr.write(f"mpipar: error: {message}\n")
        sys.stderr.flush()
    raise SystemExit(EXIT_USAGE)


def resolve_config(argv: list[str] | None, world: int) -> Config:
    args = build_parser().parse_args(argv)
    try:
        return config_mod.from_args(args).resolved(world)
    except ConfigError as exc:
        fail_usage(str(exc))
        raise  # unreachable: fail_usage exits


def main(argv: list[str] | None = None, comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    install_abort_hook(comm)
    cfg = resolve_config(argv, comm.Get_size())
    from mpipar.backend import configure_threads
    threads = configure_threads(comm)  # before NumPy/Numba load their thread pools

    from mpipar.data import DataError
    from mpipar.engine import Engine
    from mpipar.metrics import MetricsWriter

    try:
        engine = Engine(cfg, comm)
    except DataError as exc:
        fail_usage(str(exc))
    rank0 = comm.Get_rank() == 0
    tr = cfg.train
    writer = MetricsWriter(tr.run_dir, enabled=rank0)
    if rank0:
        os.makedirs(tr.run_dir, exist_ok=True)
        with open(os.path.join(tr.run_dir, "config.toml"), "w") as fh:
            fh.write(cfg.to_toml())
        print(f"mpipar: layout {engine.grid.describe()} | kernels {engine.kernels.describe()} | "
              f"model {cfg.model.layers}x{cfg.model.hidden} heads {cfg.model.heads}/"
              f"{cfg.model.kv_heads} vocab {cfg.model.vocab_size} | data {engine.source.path} "
              f"({engine.source.num_samples} samples of {tr.seq_len}) | {tr.dtype} | "
              f"{threads} thread(s)/rank", flush=True)
    for k in range(tr.steps):
        engine.ledger.reset()
        result = engine.train_step(k)
        writer.write(result, engine.ledger)
        if rank0 and tr.log_every and (result.step % tr.log_every == 0 or result.step == 1
                                       or result.step == tr.steps):
            print(f"step {result.step:>6}/{tr.steps}  loss {result.loss:.4f}  "
                  f"grad_norm {result.grad_norm:.3f}  lr {result.lr:.2e}  "
                  f"{result.tokens / result.step_time_s:,.0f} tok/s", flush=True)
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
