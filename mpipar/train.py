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
    """Parse, apply a Hugging Face checkpoint's model settings, validate; exit 2 on error."""
    args = build_parser().parse_args(argv)
    try:
        cfg = config_mod.from_args(args)
        tr = cfg.train
        if tr.resume and (tr.resume != "auto" or tr.save_dir):  # else validate() names the rule
            from mpipar import checkpoint
            path, _ = checkpoint.resolve_resume(tr.resume, tr.save_dir)
            if path is not None:
                cfg.model = config_mod.model_from_checkpoint(
                    checkpoint.read_model_config(path), config_mod.given_model_fields(args),
                    source=str(path))
        if tr.init_from_hf or tr.export_hf:
            from mpipar import hf
            if tr.init_from_hf:
                checkpoint = hf.read_model_config(tr.init_from_hf, tr.hf_untie_embeddings)
                cfg.model = hf.model_config_with_overrides(
                    checkpoint, config_mod.given_model_fields(args), source=tr.init_from_hf)
            if tr.export_hf:
                try:
                    hf.check_export_target(tr.export_hf)
                except ValueError as exc:
                    raise ConfigError(f"--export-hf {tr.export_hf}: {exc}") from None
        return cfg.resolved(world)
    except ConfigError as exc:
        fail_usage(str(exc))
        raise  # unreachable: fail_usage exits


def main(argv: list[str] | None = None, comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    install_abort_hook(comm)
    from mpipar.backend import configure_threads, local_size_from_env
    # Thread pools are sized before NumPy/Numba load; from the launcher's environment when it
    # says how many ranks share the node (no collective), else after validation by a split.
    threads = configure_threads(None) if local_size_from_env() or comm.Get_size() == 1 else 0
    cfg = resolve_config(argv, comm.Get_size())
    threads = threads or configure_threads(comm)

    from mpipar.data import DataError
    tr = cfg.train
    from mpipar.engine import Engine
    from mpipar.metrics import MetricsWriter

    rank0 = comm.Get_rank() == 0
    start = 0
    try:
        engine = Engine(cfg, comm)
        resume_from = None
        if tr.resume:  # every rank reads the same files: the answer is the same everywhere
            from mpipar import checkpoint
            resume_from, notes = checkpoint.resolve_resume(tr.resume, tr.save_dir)
            for note in notes if rank0 else ():
                print(f"mpipar: {note}", flush=True)
        if resume_from is not None:
            start = checkpoint.load(engine, resume_from)
            if rank0:
                print(f"mpipar: resumed from {resume_from} at step {start}", flush=True)
        elif tr.init_from_hf:
            from mpipar.hf import load_hf
            engine.load_params(load_hf(tr.init_from_hf, tr.dtype, tr.hf_untie_embeddings)[1])
    except (DataError, ConfigError) as exc:
        fail_usage(str(exc))
    writer = MetricsWriter(tr.run_dir, enabled=rank0, append=start > 0)
    if rank0:
        os.makedirs(tr.run_dir, exist_ok=True)
        with open(os.path.join(tr.run_dir, "config.toml"), "w") as fh:
            fh.write(cfg.to_toml())
        print(f"mpipar: layout {engine.grid.describe()} | kernels {engine.kernels.describe()} | "
              f"model {cfg.model.layers}x{cfg.model.hidden} heads {cfg.model.heads}/"
              f"{cfg.model.kv_heads} vocab {cfg.model.vocab_size} | data {engine.source.path} "
              f"({engine.source.num_samples} samples of {tr.seq_len}) | {tr.dtype} | "
              f"{threads} thread(s)/rank", flush=True)
    saved = start
    for k in range(start, tr.steps):
        engine.ledger.reset()
        result = engine.train_step(k)
        writer.write(result, engine.ledger)
        if tr.save_dir and tr.save_every and result.step % tr.save_every == 0:
            checkpoint_save(engine, cfg, result.step, rank0)
            saved = result.step
        if rank0 and tr.log_every and (result.step % tr.log_every == 0 or result.step == 1
                                       or result.step == tr.steps):
            print(f"step {result.step:>6}/{tr.steps}  loss {result.loss:.4f}  "
                  f"grad_norm {result.grad_norm:.3f}  lr {result.lr:.2e}  "
                  f"{result.tokens / result.step_time_s:,.0f} tok/s", flush=True)
    writer.close()
    if tr.save_dir and saved != tr.steps:
        checkpoint_save(engine, cfg, tr.steps, rank0)
    if tr.export_hf:
        export_hf(engine, cfg, rank0)
    return 0


def checkpoint_save(engine, cfg: Config, step: int, rank0: bool) -> None:
    """Save and commit a checkpoint of ``step`` (collective), pruning to ``keep_last``."""
    from mpipar import checkpoint
    path = checkpoint.save(engine, cfg, step, cfg.train.save_dir, cfg.train.keep_last)
    if rank0:
        print(f"mpipar: saved checkpoint {path}", flush=True)


def export_hf(engine, cfg: Config, rank0: bool) -> None:
    """Gather the global weights (collective) and let rank 0 write the HF directory."""
    from mpipar import hf
    params = engine.gather_params()
    if not rank0:
        return
    tr = cfg.train
    extra = (hf.passthrough_config(tr.init_from_hf) if tr.init_from_hf
             else {"max_position_embeddings": max(hf.DEFAULT_MAX_POSITIONS, tr.seq_len)})
    hf.save_hf(tr.export_hf, cfg.model, params, dtype=tr.export_dtype or tr.dtype,
               extra_config=extra)
    print(f"mpipar: exported Hugging Face Llama weights ({tr.export_dtype or tr.dtype}) to "
          f"{tr.export_hf}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
