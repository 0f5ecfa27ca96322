"""Benchmarks: `python -m mpipar.bench [SECTION] [--quick] [--json PATH] [section flags]`.

Each benchmark is a section with a subcommand and a module of its own; with no subcommand every
section runs in the order of :data:`SECTIONS`. A section's `run(args) -> dict` prints a
human-readable table and returns JSON-serialisable results (written with `--json PATH` as
`{section: results}`); its `configure(parser)` adds the section's options. What they share
(timing, printing, child processes, the thread budget) is :mod:`mpipar.bench.harness`.

Sections:
  warmup       compile the kernels of each --dtype into the cache (NUMBA_CACHE_DIR) ahead of a
               job, so that its first run loads them instead of compiling them (bench/warmup.py)
  kernels      every kernel op for every available backend, side by side, float32 and float64; the
               fused kernels against the ops they replace; attention forward/backward GFLOP/s
               and % of the GEMM probe at long sequences, per thread count (bench/attention.py)
  memory       peak memory (tracemalloc) of one training step for each --recompute mode; with
               --zero STAGES under mpirun -n N: dp = N, each ZeRO stage's memory per rank
               against a --budget-mb, and ZeRO-3's exposed all-gather time against its transfer
               time
  window       under mpirun -n SP: sliding-window attention over sequence parallelism, the SP
               bytes and step time of the full causal ring, the windowed ring and the halo
               exchange as the sequence grows (the ledger checked against the planner)
  comm         under a launcher: send/recv, all-reduce and all-gather latency and bandwidth inside
               a node and across nodes, the GEMM speed, the per-op overhead and the compression
               codecs' work every rank gets with all ranks busy; written as the hardware file the
               planner reads (python -m mpipar.plan --hardware FILE)
  planner      the planner's predicted step time (from a hardware file) against the measured one
               of training runs of several layouts, side by side
  train        one training step of mpipar against PyTorch eager (transformers Llama, sdpa,
               AdamW) on the same model and threads, interleaved, in float32 and in bf16 (against
               autocast; --cpu-bf16-gemm auto,mkl,float32), with the GEMM rates of both and the
               CPU's bf16 flags; dp=2 against PyTorch DDP (gloo); each peer a child process
               serving steps on request (bench/train_peer.py)
  gpu          on a CUDA device: attention TFLOP/s of each bf16 backend against the GEMM of equal
               FLOPs; bf16 tokens/s, MFU and memory of 1.1B and 350M Llamas against PyTorch
               eager (autocast, float32 masters), each peer a child process; with --static [--arch
               sm_80,sm_90] [--json FILE] no benchmark but the NVRTC compile gate
               (mpipar.kernels.cuda_gate), whose exit status the command returns
  compression  convergence of gradient compression: the default model trained under mpirun with
               no, int8 and top-k compression, with and without error feedback (loss table, plot)
  documents    packed documents: max/mean attention work per sp rank under the contiguous,
               zigzag and balanced splits (log-normal document lengths); document-masked
               attention time against full causal at seq 8192
  precision    mixed precision: the default run under mpirun in float32 and in bfloat16 (with a
               float32 and a bf16 gradient reduction), final losses side by side
  muon         the default run under mpirun with AdamW and with Muon, each at the learning rate
               a short sweep picks: final losses over seeds, the optimizer step's seconds, share
               of the step and bytes handed to MPI (bench/muon.py)
  checkpoint   the step time a checkpoint costs, synchronous against --async-save, under
               mpirun; then verifying one before a resume, every rank alone against the ranks
               together (bench/checkpoint.py)
  recovery     under Open MPI with ULFM: a rank killed mid-run, the time to the next step and the
               steps redone under --on-rank-failure shrink (from memory, from the checkpoint)
               against a requeue resuming from the last checkpoint (bench/recovery.py)
  tiles        on a CUDA device: flash_mma's tile candidates per kernel role (NVRTC's registers
               and spills, then each timed against the present tiles on packed documents or
               full causal); --compile-only --arch sm_90 needs no device (bench/tiles.py)

Sections that compare thread counts run each count in child processes started with
OMP/OPENBLAS/MKL/NUMBA_NUM_THREADS set (NumPy's BLAS reads its thread count once, at import).
"""

from __future__ import annotations

import argparse
import sys

# The harness first: it sets this process's thread budget before the sections load NumPy.
from mpipar.bench import harness
from mpipar.bench import (checkpoint, comm, compression, documents, gpu, kernels, memory,
                          moe, muon, planner, precision, recovery, tiles, train, warmup, window)

SECTIONS: dict[str, harness.Section] = {
    s.name: s for s in (warmup.SECTION, kernels.SECTION, memory.SECTION, window.SECTION, comm.SECTION,
                        planner.SECTION, train.SECTION, gpu.SECTION, compression.SECTION,
                        precision.SECTION, muon.SECTION, checkpoint.SECTION, documents.SECTION,
                        moe.SECTION, recovery.SECTION, tiles.SECTION)}
"""Section name -> section, in the order a run without a subcommand takes them."""


def _common_options() -> argparse.ArgumentParser:
    """--quick and --json, accepted before and after the subcommand."""
    # SUPPRESS: an option given before or after the subcommand lands in the same namespace field.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quick", action="store_true", default=argparse.SUPPRESS,
                        help="fewer repeats and shorter batches")
    common.add_argument("--json", metavar="PATH", default=argparse.SUPPRESS,
                        help="also write the results as JSON to PATH")
    return common


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and one subparser per section."""
    common = _common_options()
    parser = argparse.ArgumentParser(prog="python -m mpipar.bench", parents=[common],
                                     description="mpipar benchmarks; with no section, all sections run.")
    parser.set_defaults(quick=False, json=None, section=None)
    sub = parser.add_subparsers(dest="section", metavar="SECTION")
    subparsers = {}
    for section in SECTIONS.values():
        p = sub.add_parser(section.name, parents=[common], help=section.help, description=section.help)
        if section.configure is not None:
            section.configure(p)
        subparsers[section.name] = p
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    """Run the chosen section (or all of them) and optionally write JSON results; the exit
    status (``gpu --static``: the compile gate's)."""
    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    if args.section == "gpu" and args.static:  # no benchmark: the gate's own output and status
        return gpu.compile_gate(args)
    if args.section is not None:
        chosen = {args.section: args}
    else:
        chosen = {}
        for name, sub in subparsers.items():
            ns = sub.parse_args([])
            ns.quick, ns.json, ns.section = args.quick, args.json, name
            chosen[name] = ns
    results = {}
    for name, ns in chosen.items():
        results[name] = SECTIONS[name].run(ns)
        print()
    if args.json:
        harness.write_results(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
