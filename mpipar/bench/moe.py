"""``python -m mpipar.bench moe``: expert parallelism against replicated experts, and the ep
exchange blocking against overlapped with compute. An 8-expert top-2 model (``--moe-experts 8
--moe-top-k 2``, the default model otherwise) trained on ``--ranks`` ranks with ``--ep 1``
(every rank computes every expert for its own tokens) and ``--ep 8`` (each rank computes one
expert for the tokens of its 8-rank group, sent by all-to-all), the latter blocking
(``--no-ep-overlap``) and overlapped (``parallel.ep_overlap``, the default:
:func:`mpipar.model.moe.experts_fwd`) in turn ``--repeats`` times, side by side in one run:
tokens/s (median after step 1; of the repeats, the median), the seconds a step waits in the ep
group's calls (every rank's mean over the steps after the first, from ``--trace-steps``: the
rows' all-to-all-v, blocked in it or in the non-blocking one's waits and tests, and the
counts' all-to-all), the ep bytes a step sends, the training state a rank holds (weights,
gradients, AdamW moments: the planner's :func:`mpipar.plan.memory.predict_memory`, which
``tests/mpi/test_moe.py`` holds equal to the engine's buffers; under ep 8 a rank holds one
expert of each block, not 8: :mod:`mpipar.parallel.experts`) and peak memory per rank (the
process's peak RSS). Then a probe of MPI's progress (:func:`probe`): whether an all-to-all-v
posted non-blocking moves while the rank computes, with and without a ``Test`` per GEMM.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from mpipar.bench.harness import Section, mpirun, print_header, run_child, train_run
from mpipar.config.cli import add_arguments, from_args
from mpipar.observe.trace import TRACE_FILE
from mpipar.plan.memory import predict_memory
from mpipar.rules import validate
from mpipar.runtime.topology import Coord

ROWS_OPS = ("alltoallv", "ialltoallv")


def _state_mib(flags: list[str], ranks: int) -> float:
    """MiB of training state (weights, masters, gradients, moments) rank 0 of the run of
    ``flags`` on ``ranks`` ranks holds, as the planner counts it."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    layout = validate(from_args(parser.parse_args(flags)), ranks)
    return predict_memory(layout, Coord(0, 0, 0, 0)).state / 2**20


def ep_wait(trace_path: str, ranks: int, steps: int) -> dict[str, float]:
    """Seconds per step and rank in the ep group's calls of a run's ``trace.json`` (``steps``
    traced steps): ``rows`` (the all-to-all-v, blocking or non-blocking) and ``counts``."""
    with open(trace_path, encoding="utf-8") as fh:
        events = json.load(fh)["traceEvents"]
    out = {"rows": 0.0, "counts": 0.0}
    for e in events:
        if e.get("ph") == "X" and e.get("args", {}).get("group") == "ep":
            out["rows" if e["name"] in ROWS_OPS else "counts"] += e["dur"] / 1e6
    return {k: v / ranks / steps for k, v in out.items()}


def _train(ep: int, overlap: bool, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One run under mpirun; its metrics: tokens/s, ep waits and bytes, memory, losses."""
    traced = f"2-{args.steps}" if ep > 1 and args.steps > 1 else ""
    flags = ["--moe-experts", "8", "--moe-top-k", "2", "--ep", str(ep), "--steps",
             str(args.steps), "--log-every", "0", "--tensorboard", "off",
             *(["--trace-steps", traced] if traced else []),
             *([] if overlap else ["--no-ep-overlap"]), *args.train_flags.split()]
    run_dir = os.path.join(args.out, f"ep{ep}{tag}")
    records, _ = train_run("moe", args.ranks, flags, run_dir)
    later = records[1:] or records
    wait = (ep_wait(os.path.join(run_dir, TRACE_FILE), args.ranks, args.steps - 1) if traced
            else {"rows": 0.0, "counts": 0.0})
    return {"ep": ep, "overlap": overlap and ep > 1, "flags": flags,
            "losses": [r["loss"] for r in records],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "ep_rows_s": wait["rows"], "ep_counts_s": wait["counts"],
            "ep_bytes": records[-1].get("comm_bytes", {}).get("ep", 0),
            "state_mib": _state_mib(flags, args.ranks),
            "peak_memory_mib": max(records[-1]["memory_bytes"]) / 2**20}


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first of ``runs`` (one setting's repeats) with the medians of the timings."""
    keys = ("tokens_per_s", "ep_rows_s", "ep_counts_s")
    return {**runs[0], **{k: statistics.median(r[k] for r in runs) for k in keys},
            "repeats": [{k: r[k] for k in keys} for r in runs]}


PROBE_MODES = ("blocking", "no polling", "test per GEMM")


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """Under mpirun (``--probe``): does a non-blocking all-to-all-v move while the rank
    computes? Per mode, ``--probe-rows`` rows of 256 float64 to each rank and 24 GEMMs of 256
    (what one expert's rows take), timed from a barrier: ``blocking`` (Alltoallv, then the
    GEMMs), ``no polling`` (Ialltoallv, the GEMMs without an MPI call, Wait) and ``test per
    GEMM`` (a Test after each). The seconds per mode are the median over the repeats of every
    rank's mean: the step, the time in the blocking call or the wait, and in the tests."""
    import numpy as np
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.runtime.mpi_init import MPI
    world, ledger = MPI.COMM_WORLD, Ledger()
    group, n, rows = Group(world, "ep", ledger), world.Get_size(), args.probe_rows
    rng = np.random.default_rng(world.Get_rank())
    send, a = rng.standard_normal((n * rows, 256)), rng.standard_normal((256, 256))
    recv, counts = np.empty_like(send), [rows] * n
    times: dict[str, list] = {m: [] for m in PROBE_MODES}
    for _ in range(max(3, args.repeats * 3)):
        for mode in PROBE_MODES:
            world.Barrier()
            ledger.reset()
            t0 = time.perf_counter()
            if mode == "blocking":
                group.alltoallv(send, counts, recv, counts)
            else:
                request = group.ialltoallv(send, counts, recv, counts)
            for _ in range(24):
                a @ a
                if mode == "test per GEMM":
                    request.test()
            if mode != "blocking":
                request.wait()
            step = time.perf_counter() - t0
            mpi = sum(e.seconds for e in ledger.entries.values())
            tested = sum(e.tested for e in ledger.entries.values())
            times[mode].append(world.allreduce(np.array([step, mpi - tested, tested])) / n)
    return {"ranks": n, "rows_per_rank": rows,
            "modes": {m: dict(zip(("step_s", "wait_s", "test_s"),
                                  np.median(np.array(v), axis=0).tolist()))
                      for m, v in times.items()}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train ep = 1, then ep = 8 blocking and overlapped in turn; print them side by side; then
    the progress probe (:func:`probe`) under mpirun."""
    if args.probe:
        return probe(args)
    if args.quick:
        args.steps, args.repeats = 4, 1
    os.makedirs(args.out, exist_ok=True)
    runs = {"ep1": [_train(1, True, args, "")], "blocking": [], "overlapped": []}
    for k in range(args.repeats):
        runs["blocking"].append(_train(8, False, args, f"-blocking-{k}"))
        runs["overlapped"].append(_train(8, True, args, f"-overlapped-{k}"))
    rows = [_median_row(v) for v in runs.values()]
    print_header(f"{'ep':>3} {'exchange':>10} {'tokens/s':>9} {'rows s':>7} {'counts s':>8} "
                 f"{'ep bytes/step':>14} {'state MiB/rank':>15} {'peak MiB/rank':>14} "
                 f"{'final loss':>10}")
    for kind, r in zip(runs, rows):
        kind = "-" if r["ep"] == 1 else kind
        print(f"{r['ep']:>3} {kind:>10} {r['tokens_per_s']:>9.0f} {r['ep_rows_s']:>7.3f} "
              f"{r['ep_counts_s']:>8.3f} {r['ep_bytes']:>14,} {r['state_mib']:>15.1f} "
              f"{r['peak_memory_mib']:>14.0f} {r['losses'][-1]:>10.4f}")
    found = run_child(["moe", "--probe", "--probe-rows", str(args.probe_rows), "--repeats",
                       str(args.repeats)], 1, (mpirun(), "-n", str(args.ranks)))["moe"]
    print_header(f"{'progress probe':>14} {'step s':>8} {'in the call or wait s':>22} "
                 f"{'in tests s':>11}")
    for m, r in found["modes"].items():
        print(f"{m:>14} {r['step_s']:>8.4f} {r['wait_s']:>22.4f} {r['test_s']:>11.4f}")
    return {"config": {"steps": args.steps, "ranks": args.ranks, "repeats": args.repeats,
                       "train_flags": args.train_flags}, "rows": rows, "probe": found}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=8, help="mpirun -n")
    parser.add_argument("--repeats", type=int, default=2,
                        help="ep 8 blocking and overlapped runs, in turn")
    parser.add_argument("--train-flags", default="", help="more python -m mpipar.train flags")
    parser.add_argument("--probe", action="store_true",
                        help="under mpirun: only the progress probe (the section runs it)")
    parser.add_argument("--probe-rows", type=int, default=2048,
                        help="the probe's rows of 256 float64 to each rank")
    parser.add_argument("--out", default="runs/bench-moe", help="run directories")


SECTION = Section("moe", run, "an 8-expert top-2 model on 8 ranks: ep 8 (the exchange blocking "
                  "and overlapped, in turn) against ep 1 (tokens/s, ep waits and bytes, state "
                  "and peak memory per rank; mpirun)", configure)
