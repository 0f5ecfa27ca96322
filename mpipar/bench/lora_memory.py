"""``python -m mpipar.bench memory --lora-rank R``: memory of LoRA against full fine-tuning.

Measured: the --layers/--hidden/... model on one process, one training step under tracemalloc
for full fine-tuning (AdamW on every parameter) and for LoRA of rank R on --lora-targets (the
base frozen: no gradient, no optimizer state, no float32 master), each beside the planner's
prediction (:func:`mpipar.plan.memory.predict_memory`) of the same run. Predicted: with
``--predict-model NAME`` (a shape of :data:`mpipar.bench.gpu.MODELS`, e.g. 1.1B) the planner's
memory per rank of the same two runs at that shape, for models a measurement does not fit.
"""
from __future__ import annotations

import argparse
import gc
import tempfile
from typing import Any, Callable

from mpipar.bench.harness import print_header, rank0_print
from mpipar.rules import validate

MIB = 2.0 ** 20


def _config(args: argparse.Namespace, model: dict[str, int], lora_rank: int, run_dir: str,
            world: int = 1):
    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
    return validate(Config(
        ModelConfig(**model),
        ParallelConfig(),
        TrainConfig(steps=10, seq_len=args.seq, global_batch_size=args.batch,
                    micro_batch_size=args.micro_batch, dtype=args.dtype, backend="numpy",
                    run_dir=run_dir, recompute=args.modes.split(",")[0], warmup_steps=1,
                    log_every=0, lora_rank=lora_rank, lora_alpha=2.0 * max(lora_rank, 1),
                    lora_targets=args.lora_targets),
    ), world)


def _predicted(layout) -> dict[str, Any]:
    from mpipar.plan.memory import predict_memory, trained_parameter_count
    from mpipar.runtime.topology import Coord
    mem = predict_memory(layout, Coord(0, 0, 0, 0))
    return {"trained": trained_parameter_count(layout.model, layout.train),
            "weights": mem.weights + mem.masters, "grads": mem.grads,
            "optimizer": mem.optimizer, "activations": mem.activations,
            "state": mem.state, "total": mem.total}


def _measured(layout, traced: Callable[..., tuple[Any, dict]]) -> dict[str, Any]:
    """One process: build, step 0, then step 1 under tracemalloc (``traced``: the memory
    section's, :func:`mpipar.bench.memory._traced_build_and_step`): what it holds between
    steps and the step's peak."""
    from mpipar.data.sources import load_tokens
    from mpipar.runtime.mpi_init import MPI
    from mpipar.training.rank import build_rank
    from mpipar.training.step import close
    source = load_tokens(None, layout.model.vocab_size, layout.train.seq_len)
    rank, m = traced(lambda: build_rank(layout, MPI.COMM_SELF, source=source))
    close(rank)
    gc.collect()
    return {"resident": m["resident"], "peak": m["step_peak"], "loss": m["loss"]}


def run_lora_memory(args: argparse.Namespace, comm,
                    traced: Callable[..., tuple[Any, dict]]) -> dict[str, Any]:
    """Full fine-tuning against LoRA of rank ``args.lora_rank``: measured on the given model
    (rank 0 alone, with ``traced``), predicted on ``args.predict_model`` too; printed side by
    side."""
    from mpipar.bench.gpu import MODELS
    say = rank0_print(comm)
    small = dict(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=args.heads,
                 kv_heads=args.kv_heads, ffn_hidden=args.ffn)
    shapes = [("measured", small)]
    if args.predict_model:
        if args.predict_model not in MODELS:
            raise SystemExit(f"--predict-model {args.predict_model!r}: choose from "
                             f"{', '.join(MODELS)}")
        shapes.append((args.predict_model, MODELS[args.predict_model]))
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-lora-") as run_dir:
        for name, model in shapes:
            for rank in (0, args.lora_rank):
                layout = _config(args, model, rank, run_dir)
                row = {"model": name, "lora_rank": rank, **_predicted(layout)}
                if name == "measured" and comm.Get_rank() == 0:
                    row.update(_measured(layout, traced))
                rows.append(row)
    say(f"memory: full fine-tuning against LoRA rank {args.lora_rank} on {args.lora_targets}, "
        f"one process, {args.dtype}, seq={args.seq} batch={args.batch} "
        f"micro_batch={args.micro_batch}, recompute {args.modes.split(',')[0]}; measured "
        f"model: layers={args.layers} hidden={args.hidden} heads={args.heads}/{args.kv_heads} "
        f"ffn={args.ffn} vocab=256")
    _print_rows(rows, say)
    return {"rows": rows}


def _print_rows(rows: list[dict[str, Any]], say: Callable[..., None]) -> None:
    print_header(f"{'model':<9} {'run':<8} {'trained':>14} {'weights MiB':>12} "
                 f"{'grads MiB':>10} {'optim MiB':>10} {'activ MiB':>10} {'total MiB':>10} "
                 f"{'measured resident':>18} {'measured peak':>14}", say)
    for r in rows:
        run = f"LoRA r{r['lora_rank']}" if r["lora_rank"] else "full"
        measured = (f"{r['resident'] / MIB:>18.1f} {r['peak'] / MIB:>14.1f}" if "peak" in r
                    else f"{'(predicted)':>18} {'':>14}")
        say(f"{r['model']:<9} {run:<8} {r['trained']:>14,} {r['weights'] / MIB:>12.1f} "
            f"{r['grads'] / MIB:>10.1f} {r['optimizer'] / MIB:>10.1f} "
            f"{r['activations'] / MIB:>10.1f} {r['total'] / MIB:>10.1f} {measured}")
    say("trained: parameters the optimizer updates; weights: compute copies and float32 "
        "masters (LoRA's frozen base: its compute copy alone); grads, optim: AdamW's gradients "
        "and two moments (LoRA: the adapters' only); activ, total: the planner's estimate of "
        "the saved activations and of all of it; measured (one process, tracemalloc): what "
        "the rank holds between steps and the peak of a step")
