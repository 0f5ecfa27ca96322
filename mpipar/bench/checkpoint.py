"""``python -m mpipar.bench checkpoint``: the step time a checkpoint costs, synchronous against
asynchronous (``--async-save``), side by side in one run.

One training run under ``mpirun`` per variant, the same seed, model and layout: ``none`` (no
save), ``sync`` and ``async`` (a save every ``--save-every`` steps), repeated ``--repeats``
times in turn. From each run's ``metrics.jsonl``: the time of steps 2.. (the engine's step time
plus the ``io`` time the loop spent outside it, i.e. the blocking part of the saves), and so the
cost of one save = (the variant's time - ``none``'s) / saves. ``blocking`` is the io part of it
(the whole write for sync; the copy to host memory, any wait and the commit for async); the rest
is what the write slows the steps it overlaps (the GIL, the disk, the cores). The run has
``steps = (saves + 1) * save_every - 1`` steps, so every counted save is followed by steps that
record it; the end-of-run save is not counted.

With ``--driver-mb N`` only the cost of the file a shard is written through: an N MiB shard
(4 MiB float32 tensors, stored as the writer stores them) written through
:class:`mpipar.runtime.hdf5_sink.HDF5Sink` (h5py's file-object driver, its space reserved first,
as every save writes) against h5py's default driver (``sec2``), both fsynced, in ``--repeats``
interleaved rounds (the order alternating); the median of the rounds' time ratios
(:func:`time_driver`).

Then the verification a resume starts with (:func:`time_verify`, under ``mpirun -n
--verify-ranks``): the last synchronous run's checkpoint verified by every rank alone (as
before ranks verified together: each hashes and checks every shard file) against the ranks
together (each its share, one all-gather), in turn, from the page cache; the slowest rank's time.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from mpipar.bench.harness import Section, mpirun, print_header, run_child, train_run

VARIANTS = {"none": [], "sync": ["--save-every"], "async": ["--save-every", "--async-save"]}


def _flags(name: str, args: argparse.Namespace, run_dir: str) -> list[str]:
    flags = [f if f != "--save-every" else f"--save-every={args.save_every}"
             for f in VARIANTS[name]]
    return [*flags, "--steps", str((args.saves + 1) * args.save_every - 1),
            "--save-dir", os.path.join(run_dir, "ck"), "--keep-last", "2", "--log-every", "0",
            "--tensorboard", "off", *args.train_flags.split()]


def _train(name: str, repeat: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of a variant: its time after step 1 (engine + io) and its io time."""
    run_dir = os.path.join(args.out, f"{name}-{repeat}")
    records, _ = train_run("checkpoint", args.ranks, _flags(name, args, run_dir), run_dir)
    records = records[1:]
    io = sum(r["time_max"]["io"] for r in records)
    return {"steps_s": sum(r["step_time_s"] for r in records) + io, "io_s": io,
            "step_s": statistics.median(r["step_time_s"] for r in records)}


def time_verify(args: argparse.Namespace) -> dict[str, Any]:
    """Under mpirun (``--verify PATH``): the checkpoint at PATH verified by every rank alone and
    by the ranks together, ``--repeats`` times in turn, the cache cleared before each; per way,
    the slowest rank's seconds of each repeat."""
    import time

    from mpipar.checkpoint import reader
    from mpipar.checkpoint.directory import resolve_path
    from mpipar.runtime.mpi_init import MPI
    world = MPI.COMM_WORLD
    peers = reader.Peers.of(world)
    path = resolve_path(args.verify)
    times: dict[str, list[float]] = {"alone": [], "together": []}
    for _ in range(args.repeats):
        for way in times:
            reader.forget_verified()
            world.Barrier()
            t0 = time.perf_counter()
            problems = reader.verify(path, peers if way == "together" else None)
            seconds = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if problems:
                raise SystemExit(f"checkpoint --verify {path}: {'; '.join(problems)}")
            times[way].append(seconds)
    return {"ranks": world.Get_size(), "path": str(path),
            "bytes": sum(f.stat().st_size for f in path.iterdir()), **times}


def _write_shard_file(path: str, blocks: list, through_sink: bool) -> float:
    """Seconds to write ``blocks`` as a shard's datasets to ``path`` and fsync it, through an
    :class:`~mpipar.runtime.hdf5_sink.HDF5Sink` (its space reserved first) or h5py's default
    driver."""
    import time

    import h5py

    from mpipar.checkpoint.writer import DATASET_OPTIONS
    from mpipar.runtime.hdf5_sink import HDF5Sink
    t0 = time.perf_counter()
    target = path
    if through_sink:
        target = HDF5Sink.create(path)
        target.reserve(sum(b.nbytes for b in blocks) + (1 << 20))
    with h5py.File(target, "w") as f:
        for i, block in enumerate(blocks):
            f.create_dataset(f"param/t{i}/0", data=block, **DATASET_OPTIONS)
    if through_sink:
        target.close()
        if target.error is not None:
            raise SystemExit(f"checkpoint --driver-mb: writing {path}: {target.error}")
    else:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return seconds


def time_driver(args: argparse.Namespace) -> dict[str, Any]:
    """``--driver-mb``: the file-object driver's write time against the default driver's
    (module docstring), printed."""
    import numpy as np
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal((1024, 1024), dtype=np.float32)
              for _ in range(max(1, round(args.driver_mb / 4)))]
    mib = sum(b.nbytes for b in blocks) / 2**20
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "driver-shard.h5")
    times: dict[str, list[float]] = {"fileobj": [], "sec2": []}
    for i in range(args.repeats):
        for way in (("fileobj", "sec2") if i % 2 == 0 else ("sec2", "fileobj")):
            times[way].append(_write_shard_file(path, blocks, way == "fileobj"))
    ratios = [a / b for a, b in zip(times["fileobj"], times["sec2"])]
    print_header(f"{'driver (' + f'{mib:.0f}' + ' MiB)':<18} {'median s':>9} {'MiB/s':>7} "
                 f"{'rounds s':>32}")
    for way in times:
        med = statistics.median(times[way])
        print(f"{way:<18} {med:>9.3f} {mib / med:>7.0f} "
              f"{', '.join(f'{t:.3f}' for t in times[way]):>32}")
    print(f"fileobj / sec2: median of the rounds' ratios {statistics.median(ratios):.3f} "
          f"(from {min(ratios):.3f} to {max(ratios):.3f}); both fsynced, in {args.out}")
    return {"mib": mib, "rounds": args.repeats, **times, "ratios": ratios,
            "ratio": statistics.median(ratios)}


def _verify_rows(args: argparse.Namespace) -> dict[str, Any] | None:
    """:func:`time_verify` of the last synchronous run's checkpoint, printed."""
    if not args.verify_ranks:
        return None
    found = run_child(["checkpoint", "--verify", os.path.join(args.out, f"sync-{args.repeats - 1}",
                                                              "ck"),
                       "--repeats", str(max(args.repeats, 3))], 1,
                      (mpirun(), "-n", str(args.verify_ranks)))["checkpoint"]
    alone, together = (statistics.median(found[w]) for w in ("alone", "together"))
    print_header(f"{'verify (' + str(found['ranks']) + ' ranks)':<18} {'median s':>9} "
                 f"{'runs s':>24}")
    for way in ("alone", "together"):
        print(f"{way:<18} {statistics.median(found[way]):>9.3f} "
              f"{', '.join(f'{t:.3f}' for t in found[way]):>24}")
    print(f"alone / together: {alone / together:.2f} ({found['bytes'] / 2**20:.1f} MiB, from the "
          f"page cache; the slowest rank)")
    return dict(found, ratio=alone / together)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each variant ``--repeats`` times, in turn; the cost of a save per variant; then the
    verification a resume starts with, alone against together."""
    if args.verify:
        return time_verify(args)
    if args.driver_mb:
        return time_driver(args)
    if args.quick:
        args.saves, args.repeats, args.save_every = 2, 1, 3
    os.makedirs(args.out, exist_ok=True)
    print(f"checkpoint: {args.ranks} ranks, {args.saves} saves every {args.save_every} steps, "
          f"{args.repeats} repeat(s); flags: {args.train_flags}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats):
        for name in VARIANTS:
            runs[name].append(_train(name, repeat, args))
            print(f"  {name} #{repeat + 1}: {runs[name][-1]['steps_s']:.2f} s after step 1",
                  flush=True)
    base = statistics.median(r["steps_s"] for r in runs["none"])
    rows = []
    for name in ("sync", "async"):
        total = statistics.median(r["steps_s"] for r in runs[name])
        io = statistics.median(r["io_s"] for r in runs[name])
        rows.append({"variant": name, "cost_per_save_s": (total - base) / args.saves,
                     "blocking_per_save_s": io / args.saves,
                     "step_s": statistics.median(r["step_s"] for r in runs[name])})
    step = statistics.median(r["step_s"] for r in runs["none"])
    _print_rows(rows, step)
    return {"config": {"ranks": args.ranks, "saves": args.saves, "save_every": args.save_every,
                       "repeats": args.repeats, "train_flags": args.train_flags},
            "step_s_without_saves": step, "rows": rows, "runs": runs,
            "verify": _verify_rows(args)}


def _print_rows(rows: list[dict[str, Any]], step: float) -> None:
    print_header(f"{'variant':<8} {'cost/save s':>11} {'in steps':>9} {'blocking s':>10} "
                 f"{'median step s':>13}")
    for r in rows:
        print(f"{r['variant']:<8} {r['cost_per_save_s']:>11.3f} "
              f"{r['cost_per_save_s'] / step:>9.2f} {r['blocking_per_save_s']:>10.3f} "
              f"{r['step_s']:>13.3f}")
    print(f"cost/save: time of the run after step 1 minus that of the run without saves, per "
          f"save ('in steps': over the median step without saves, {step:.3f} s); blocking: the "
          f"io time of metrics.jsonl per save (slowest rank)")


def configure(parser: argparse.ArgumentParser) -> None:
    """The checkpoint section's options: ranks, saves, their interval, repeats, the model."""
    parser.add_argument("--ranks", type=int, default=2, help="mpirun -n")
    parser.add_argument("--saves", type=int, default=3, help="saves counted per run")
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--train-flags", default="--hidden 384 --layers 4 --heads 6 --kv-heads 2 "
                                                  "--seq-len 64 --global-batch-size 4 "
                                                  "--dp 2 --zero 1",
                        help="python -m mpipar.train flags (model, layout)")
    parser.add_argument("--out", default="runs/bench-checkpoint", help="run directories")
    parser.add_argument("--verify-ranks", type=int, default=8,
                        help="mpirun -n of the verification timing (0: none)")
    parser.add_argument("--driver-mb", type=float, default=0,
                        help="only time writing a shard of this many MiB through the file "
                             "object every save uses against h5py's default driver (--repeats "
                             "rounds, interleaved)")
    parser.add_argument("--verify", metavar="PATH", default=None,
                        help="under mpirun: only time verifying PATH (the section runs it)")


SECTION = Section("checkpoint", run, "the step time a checkpoint costs, synchronous against "
                  "--async-save, side by side (mpirun); verifying one alone against together",
                  configure)
