"""``python -m mpipar.bench comm`` under a launcher: send/recv, all-reduce and all-gather
latency and bandwidth inside a node and across nodes, the GEMM speed, the per-op overhead and
the compression codecs' work every rank gets with all ranks busy; written as the hardware file
the planner reads (``python -m mpipar.plan --hardware FILE``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, Callable

import numpy as np

from mpipar import kernels
from mpipar.bench.harness import Section, print_header, sustained
from mpipar.runtime import nodes
from mpipar.runtime.mpi_init import MPI


def _timed(fn: Callable[[], Any], comm: Any, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's seconds for one ``fn()`` (all ranks start
    together after a barrier)."""
    fn()
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        samples.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return statistics.median(samples)


def measure_link(comm: Any, small: int, large: int, repeats: int) -> dict[str, float]:
    """Latency (seconds per call of ``small`` bytes) and bandwidth (bytes/s) over ``comm``:
    send/recv between its ranks 0 and 1 (a ping-pong: half the round trip), all-reduce (bus
    bandwidth: ``2 (n-1)/n x bytes / time``, as the planner counts it) and all-gather
    (``(n-1)/n x n x bytes / time``)."""
    n, rank = comm.Get_size(), comm.Get_rank()
    out: dict[str, float] = {}
    for label, size in (("latency", small), ("bandwidth", large)):
        buf, back = np.ones(size // 8), np.empty(size // 8)
        gathered = np.empty(n * (size // 8))

        def pingpong() -> None:
            if rank == 0:
                comm.Send(buf, 1)
                comm.Recv(back, 1)
            elif rank == 1:
                comm.Recv(back, 0)
                comm.Send(buf, 0)

        seconds = {"sendrecv": _timed(pingpong, comm, repeats) / 2,
                   "allreduce": _timed(lambda: comm.Allreduce(buf, back), comm, repeats),
                   "allgather": _timed(lambda: comm.Allgather(buf, gathered), comm, repeats)}
        if label == "latency":
            out.update({f"{op}_latency": t for op, t in seconds.items()})
        else:
            moved = {"sendrecv": size, "allreduce": 2 * (n - 1) / n * size,
                     "allgather": (n - 1) * size}
            out.update({f"{op}_bandwidth": moved[op] / t for op, t in seconds.items()})
    return out


def measure_compute(dtype: str, n: int, hidden: int, seconds: float
                    ) -> tuple[float, float, float]:
    """(FLOP/s of an ``[n, n] @ [n, n]`` GEMM, seconds of a kernel call on one token, elements/s
    of an in-place multiply of 2^20 elements), all sustained (:func:`sustained`) while every rank
    runs them: the compute speed, the Python and NumPy dispatch cost per op, and the
    memory-bound speed of the optimizer's passes that a step meets on this machine now."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    out = np.empty((n, n), dtype)
    flops = 2.0 * n ** 3 / sustained(lambda: np.matmul(a, b, out=out), seconds)
    k = kernels.get_backend("numpy")
    x, w = np.ones((1, 1, hidden), dtype), np.ones(hidden, dtype)
    big, other = np.ones(2**20, dtype), np.full(2**20, 0.5, dtype)
    elements = 2**20 / sustained(lambda: np.multiply(big, other, out=big), seconds)
    return flops, sustained(lambda: k.rmsnorm_fwd(x, w, 1e-5), seconds), elements


def codec_work(dtype: str, repeats: int) -> tuple[float, float]:
    """Seconds per element of a rank's int8 and top-k (1%) encode and decode work (the fastest
    of ``repeats``, :func:`mpipar.parallel.compression.local_work_seconds`) while every rank
    runs it."""
    from mpipar.parallel.compression import Int8Codec, TopKCodec, local_work_seconds
    return (local_work_seconds(Int8Codec(np), dtype=dtype, repeats=repeats),
            local_work_seconds(TopKCodec(np, 0.01), dtype=dtype, repeats=repeats))


def measure_algorithms(groups: dict[str, Any], sizes: list[int], repeats: int
                       ) -> dict[str, dict[str, dict[int, float]]]:
    """Seconds of one non-blocking all-reduce (``Iallreduce`` + ``Wait``, as the gradient
    buckets run it) of each of ``sizes`` bytes under each library algorithm, forced through
    MPICH's control variables (:class:`mpipar.runtime.allreduce.MpiT`), over each group of
    ``groups`` (name -> communicator, every rank in one of each): group -> algorithm -> {bytes:
    seconds}. ``auto`` (the library's own choice) is measured too."""
    from mpipar.runtime.allreduce import LIBRARY_ALGORITHMS, MpiT
    mpit = MpiT()
    out: dict[str, dict[str, dict[int, float]]] = {}
    for name, comm in groups.items():
        if MPI.COMM_WORLD.allreduce(comm.Get_size(), op=MPI.MIN) < 2:
            continue
        for algorithm in ("auto", *LIBRARY_ALGORITHMS):
            mpit.set_algorithm(algorithm)
            for size in sizes:
                buf = np.ones(size // 4, np.float32)
                seconds = _timed(lambda: comm.Iallreduce(MPI.IN_PLACE, buf).Wait(), comm, repeats)
                out.setdefault(name, {}).setdefault(algorithm, {})[size] = seconds
    mpit.set_algorithm("auto")
    return out


def _print_algorithms(table: dict[str, dict[str, dict[int, float]]]) -> None:
    """Per group and size: each algorithm's time, the fastest marked."""
    for group, per in table.items():
        sizes = sorted(next(iter(per.values())))
        print_header(f"{'all-reduce over ' + group:<24} " + " ".join(f"{a:>13}" for a in per))
        for size in sizes:
            best = min(per, key=lambda a: per[a][size])
            cells = " ".join(f"{per[a][size] * 1e3:>11.3f}{'*' if a == best else ' '}"
                             f" " for a in per)
            print(f"{size / 2**20:>10.3f} MiB (ms)      {cells}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Links inside a node and across nodes, compute speed and per-op overhead of every rank,
    measured with all ranks busy at once; rank 0 prints them and writes the hardware file."""
    from mpipar.plan.step_time import Hardware

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    ids = nodes.shared_memory_nodes(comm)
    node = comm.Split(ids[rank], rank)
    across = comm.Split(node.Get_rank(), rank)         # one rank per node: the same local rank
    node_count = len(set(ids))
    repeats = 5 if args.quick else args.repeats
    small, large = 8, (1 if args.quick else args.mb) * 2**20
    links = {}
    for scope, group in (("intra", node), ("inter", across)):
        if comm.allreduce(group.Get_size(), op=MPI.MIN) >= 2:
            links[scope] = measure_link(group, small, large, repeats)
    on_node = node.Get_size()
    comm.Barrier()
    peak, overhead, elements = measure_compute(args.dtype, args.gemm, args.hidden,
                                               0.5 if args.quick else 2)
    codecs = codec_work(args.dtype, 3 if args.quick else 10)
    peaks, overheads, rates = comm.gather(peak), comm.gather(overhead), comm.gather(elements)
    codecs = comm.gather(codecs)
    algorithms = {}
    if args.algorithms and "MPICH" not in MPI.Get_library_version():
        if rank == 0:
            print("comm: --algorithms forces each algorithm through MPICH's control variables; "
                  "this library is not MPICH: not measured")
    elif args.algorithms:
        sizes = [int(float(k) * 1024) for k in args.sizes_kib.split(",")]
        algorithms = measure_algorithms({"world": comm, "intra": node, "inter": across}, sizes,
                                        3 if args.quick else args.repeats)
    for c in (across, node):
        c.Free()
    if rank != 0:
        return {}
    hw = Hardware.from_links(min(peaks), statistics.median(overheads), min(rates), links,
                             on_node, node_count, tuple(max(c[i] for c in codecs) for i in (0, 1)))
    if algorithms:
        hw = dataclasses.replace(hw, allreduce_seconds={
            a: {str(size): t for size, t in per.items()}
            for a, per in algorithms["world"].items()})
    print(f"comm: {comm.Get_size()} ranks on {node_count} node(s) x {on_node}; {args.dtype} GEMM "
          f"{args.gemm}^3 {min(peaks) / 1e9:.2f} GFLOP/s per rank (slowest; all ranks at once), "
          f"op overhead {statistics.median(overheads) * 1e6:.1f} us (median rank), in-place "
          f"pass {min(rates) / 1e6:.0f} M elements/s (slowest), compression work "
          f"{hw.int8_seconds * 1e9:.2f} ns (int8), {hw.topk_seconds * 1e9:.2f} ns (top-k 1%) per "
          f"element (slowest)")
    header = f"{'link':<6} {'op':<10} {'latency us':>11} {'bandwidth MB/s':>15}"
    print_header(header)
    for scope, values in links.items():
        for op in ("sendrecv", "allreduce", "allgather"):
            print(f"{scope:<6} {op:<10} {values[op + '_latency'] * 1e6:>11.1f} "
                  f"{values[op + '_bandwidth'] / 1e6:>15.1f}")
    if algorithms:
        _print_algorithms(algorithms)
    hw.save(args.out)
    print(f"comm: wrote {args.out} (python -m mpipar.plan --hardware {args.out})")
    return {"links": links, "hardware": hw.to_dict(),
            "algorithms": {g: {a: {str(k): v for k, v in per.items()} for a, per in t.items()}
                           for g, t in algorithms.items()}}


def configure(parser: argparse.ArgumentParser) -> None:
    """The comm section's options: the hardware file, message size, repeats and the probes' sizes."""
    parser.add_argument("--out", default="hardware.json", help="the hardware file to write")
    parser.add_argument("--mb", type=int, default=4, help="MiB of the bandwidth messages")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats (median)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="dtype of the GEMM probe (train's default: float32)")
    parser.add_argument("--hidden", type=int, default=128, help="width of the op-overhead probe")
    parser.add_argument("--algorithms", action="store_true",
                        help="also time the non-blocking all-reduce under each MPI algorithm "
                             "(ring, tree, rabenseifner, the library's auto; MPICH) over the "
                             "world, a node and across nodes, and write the world's timings into "
                             "the hardware file for --allreduce-algorithm auto")
    parser.add_argument("--sizes-kib", default="64,1024,4096,25600",
                        help="--algorithms: message sizes in KiB (the job's bucket sizes; 25600 "
                             "is --bucket-mb 25)")
    parser.add_argument("--gemm", type=int, default=256,
                        help="size of the GEMM probe (near the model's matrices)")


SECTION = Section("comm", run, "MPI link latency/bandwidth, compute speed and op overhead (under a "
                  "launcher); writes the planner's hardware file", configure)
