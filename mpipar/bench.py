"""Benchmarks: `python -m mpipar.bench [SECTION] [--quick] [--json PATH]`.

Each benchmark is a registered section with a subcommand of its own; with no subcommand every
section runs in registration order. A section is a function `run(args) -> dict` that prints a
human-readable table and returns JSON-serialisable results (written with `--json PATH` as
`{section: results}`); `configure(parser)` may add section options.

Sections:
  kernels   every kernel op for every available backend, side by side, float32 and float64
  memory    peak memory (tracemalloc) of one training step for each --recompute mode
  comm      under a launcher: send/recv, all-reduce and all-gather latency and bandwidth inside a
            node and across nodes, the GEMM speed and the per-op overhead every rank gets with
            all ranks busy; written
            as the hardware file the planner reads (python -m mpipar.plan --hardware FILE)
  planner   the planner's predicted step time (from a hardware file) against the measured one of
            training runs of several layouts, side by side
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

from mpipar import backend

# Before NumPy: under a launcher each rank gets its share of the node's cores for BLAS (as in
# python -m mpipar.train), not all of them (8 ranks x all-core BLAS pools thrash 2 cores). The
# jobs this module starts get the environment as it was, to budget their own threads.
LAUNCH_ENV = dict(os.environ)
backend.configure_threads(None)

import numpy as np  # noqa: E402

from mpipar import kernels  # noqa: E402
from mpipar.kernels import numpy_ref  # noqa: E402


@dataclass(frozen=True)
class Section:
    """A registered benchmark: `run(args)` prints a table and returns JSON-able results."""

    name: str
    run: Callable[[argparse.Namespace], dict[str, Any]]
    help: str
    configure: Callable[[argparse.ArgumentParser], None] | None = None


SECTIONS: dict[str, Section] = {}


def register(name: str, run: Callable[[argparse.Namespace], dict[str, Any]], help: str,
             configure: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Add a section: subcommand `name`, run by `run(args)`; `configure(parser)` adds its options."""
    if name in SECTIONS:
        raise ValueError(f"bench section {name!r} is already registered")
    SECTIONS[name] = Section(name, run, help, configure)


def time_call(fn: Callable[[], Any], sync: Callable[[], None], repeats: int, min_seconds: float) -> float:
    """Median seconds per call of `fn` over `repeats` batches.

    Two warm-up calls come first (the first one includes any JIT compilation); each batch runs
    enough calls to last at least `min_seconds`; `sync` waits for asynchronous devices.
    """
    for _ in range(2):
        fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(min_seconds / one))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


# ----------------------------------------------------------------------------------------------
# kernels section
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelShape:
    """A small Llama-like model: tokens = batch * seq, hidden = heads * head_dim."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


def kernel_cases(shape: KernelShape, dtype: np.dtype, seed: int = 0) -> dict[str, tuple[Any, ...]]:
    """op name -> positional arguments (NumPy arrays and scalars) at `shape` in `dtype`."""
    rng = np.random.default_rng(seed)
    b, s, hq, hkv, d = shape.batch, shape.seq, shape.heads, shape.kv_heads, shape.head_dim
    hid, ffn, vocab, n = shape.hidden, shape.ffn, shape.vocab, shape.batch * shape.seq

    def rand(*dims: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(dims) * scale).astype(dtype)

    x, w_gate, w_up = rand(b, s, hid), rand(ffn, hid, scale=hid ** -0.5), rand(ffn, hid, scale=hid ** -0.5)
    norm_w = rand(hid) + 1
    _, rstd = numpy_ref.rmsnorm_fwd(x, norm_w, 1e-5)
    positions = np.arange(s, dtype=np.int64)
    cos, sin = numpy_ref.rope_cos_sin(positions, d, 10000.0, dtype)
    q, k, v = rand(b, s, hq, d), rand(b, s, hkv, d), rand(b, s, hkv, d)
    out, lse = numpy_ref.attention_fwd(q, k, v)
    lse_dtype = numpy_ref.stat_dtype(dtype)
    logits = rand(n, vocab, scale=2.0)
    targets = rng.integers(0, vocab, n)
    _, ce_lse = numpy_ref.cross_entropy_fwd(logits, targets)
    return {
        "linear_fwd": (x, w_gate),
        "linear_bwd": (rand(b, s, ffn), x, w_gate),
        "linear_swiglu_fwd": (x, w_gate, w_up),
        "embedding_fwd": (rand(vocab, hid), targets.reshape(b, s)),
        "embedding_bwd": (np.zeros((vocab, hid), dtype), x, targets.reshape(b, s)),
        "rmsnorm_fwd": (x, norm_w, 1e-5),
        "rmsnorm_bwd": (rand(b, s, hid), x, norm_w, rstd),
        "rope_cos_sin": (positions, d, 10000.0, np.dtype(dtype)),
        "rope_fwd": (q, cos, sin),
        "rope_bwd": (rand(b, s, hq, d), cos, sin),
        "swiglu_fwd": (rand(b, s, ffn), rand(b, s, ffn)),
        "swiglu_bwd": (rand(b, s, ffn), rand(b, s, ffn), rand(b, s, ffn)),
        "attention_fwd": (q, k, v),
        "attention_bwd": (q, k, v, out, lse, rand(b, s, hq, d)),
        "attention_merge": (rand(b, s, hq, d), rand(b, hq, s).astype(lse_dtype),
                            rand(b, s, hq, d), rand(b, hq, s).astype(lse_dtype)),
        "cross_entropy_stats": (logits, targets),
        "cross_entropy_fwd": (logits, targets),
        "cross_entropy_bwd": (logits, targets, ce_lse, np.full(n, 1.0 / n, lse_dtype)),
    }


def _implementations(names: list[str]) -> dict[str, tuple[dict[str, Callable[..., Any]], Any, Callable[[], None]]]:
    """Backend name -> (op -> its own implementation, array converter, device sync).

    For numba these are the numba_cpu functions themselves, including those the dispatcher
    routes to NumPy, so the table shows why it does.
    """
    impls: dict[str, tuple[dict[str, Callable[..., Any]], Any, Callable[[], None]]] = {}
    for name in names:
        if name == "numpy":
            impls[name] = ({op: getattr(numpy_ref, op) for op in kernels.OPS}, lambda a: a, lambda: None)
        elif name == "numba":
            from mpipar.kernels import numba_cpu

            impls[name] = ({op: getattr(numba_cpu, op) for op in numba_cpu.IMPLEMENTED}, lambda a: a, lambda: None)
        elif name == "cupy":
            import cupy

            backend = kernels.get_backend("cupy")
            impls[name] = ({op: getattr(backend, op) for op in kernels.OPS}, cupy.asarray,
                           cupy.cuda.get_current_stream().synchronize)
    return impls


def run_kernels(args: argparse.Namespace) -> dict[str, Any]:
    """Time every op of every requested, available backend; print one table per run."""
    available = kernels.available_backends()
    wanted = [n.strip() for n in args.backends.split(",")] if args.backends else list(kernels.BACKENDS)
    for name in wanted:
        if name not in kernels.BACKENDS:
            raise SystemExit(f"--backends: unknown backend {name!r}; choose from {', '.join(kernels.BACKENDS)}")
    if "numpy" not in wanted:
        wanted.insert(0, "numpy")  # the reference column the ratios are relative to
    names = [n for n in wanted if available[n] is None]
    shape = KernelShape(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim, args.ffn, args.vocab)
    repeats, min_seconds = (3, 0.005) if args.quick else (args.repeats, 0.02)
    impls = _implementations(names)
    numba_backend = kernels.get_backend("numba") if "numba" in names else None

    print(f"kernels: batch={shape.batch} seq={shape.seq} heads={shape.heads} kv_heads={shape.kv_heads} "
          f"head_dim={shape.head_dim} hidden={shape.hidden} ffn={shape.ffn} vocab={shape.vocab}; "
          f"median of {repeats}; cores={os.cpu_count()}{_numba_threads()}")
    for name in kernels.BACKENDS:
        if available[name] is not None and name in wanted:
            print(f"  {name}: unavailable ({available[name]})")
    if numba_backend is not None:
        print(f"  numba backend: {numba_backend.describe()}")

    rows: list[dict[str, Any]] = []
    for dtype_name in args.dtypes.split(","):
        dtype = np.dtype(dtype_name.strip())
        cases = kernel_cases(shape, dtype)
        for op in kernels.OPS:
            for name in names:
                table, convert, sync = impls[name]
                if op not in table:
                    continue
                call_args = tuple(convert(a) if isinstance(a, np.ndarray) else a for a in cases[op])
                fn = table[op]
                seconds = time_call(lambda: fn(*call_args), sync, repeats, min_seconds)
                rows.append({"op": op, "dtype": dtype.name, "backend": name, "ms": seconds * 1e3})
    _print_kernel_table(rows, names, numba_backend)
    return {"shape": shape.__dict__, "repeats": repeats, "backends": names,
            "numba_backend": numba_backend.describe() if numba_backend else None, "rows": rows}


def _numba_threads() -> str:
    try:
        import numba
    except ImportError:
        return ""
    return f" numba_threads={numba.get_num_threads()}"


def _print_kernel_table(rows: list[dict[str, Any]], names: list[str], numba_backend: Any) -> None:
    """One line per (op, dtype): ms per backend and its speed-up over numpy (numpy ms / ms)."""
    by_key = {(r["op"], r["dtype"], r["backend"]): r["ms"] for r in rows}
    header = f"{'op':<20} {'dtype':<8}" + "".join(f" {n + ' ms':>11} {'vs numpy':>8}" for n in names)
    if numba_backend is not None:
        header += "  numba backend uses"
    print(header)
    print("-" * len(header))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    for dtype in dtypes:
        for op in kernels.OPS:
            base = by_key.get((op, dtype, "numpy"))
            if base is None:
                continue
            line = f"{op:<20} {dtype:<8}"
            for name in names:
                ms = by_key.get((op, dtype, name))
                line += f" {'-':>11} {'':>8}" if ms is None else f" {ms:>11.3f} {base / ms:>7.2f}x"
            if numba_backend is not None:
                line += f"  {numba_backend.per_op[op]}"
            print(line)
    print("vs numpy = numpy ms / backend ms (above 1: faster than numpy)")


def _configure_kernels(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", default="", help="comma list of backends (default: all available)")
    parser.add_argument("--dtypes", default="float32,float64", help="comma list of dtypes")
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per op (median is shown)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=256)


register("kernels", run_kernels, "time every kernel op for each available backend", _configure_kernels)


# ----------------------------------------------------------------------------------------------
# memory section
# ----------------------------------------------------------------------------------------------

def measure_step_memory(mode: str, args: argparse.Namespace, run_dir: str, traced: bool = True,
                        comm=None, tp_sequence_parallel: bool = False) -> dict[str, Any]:
    """Train with ``--recompute mode`` on ``comm`` (default: one process) as tensor parallelism
    over all its ranks: a warm-up step, then one step under tracemalloc (which sees every NumPy
    allocation), then two untraced, timed steps.

    Returns this rank's ``resident`` (bytes held between steps: parameters, gradients, optimizer
    state, buffers), ``peak`` (highest traced bytes during the step), ``activations`` (peak -
    resident: what the step adds, saved activations first), ``loss`` and ``step_cpu_s`` (CPU
    seconds of the faster of two more untraced steps). ``traced=False`` runs the same steps
    untraced (a warm-up that fills the process's lazy caches before the first measurement).
    """
    from mpi4py import MPI

    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from mpipar.data import load_tokens
    from mpipar.engine import Engine

    comm = comm or MPI.COMM_SELF
    cfg = Config(
        ModelConfig(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    kv_heads=args.kv_heads, ffn_hidden=args.ffn),
        ParallelConfig(tp=comm.Get_size(), tp_sequence_parallel=tp_sequence_parallel),
        TrainConfig(steps=10, seq_len=args.seq, global_batch_size=args.batch,
                    micro_batch_size=args.micro_batch, dtype=args.dtype, backend="numpy",
                    run_dir=run_dir, recompute=mode, warmup_steps=1, log_every=0),
    ).resolved(comm.Get_size())
    source = load_tokens(None, 256, args.seq)  # the corpus is cached: load it untraced
    if traced:
        tracemalloc.start()
    try:
        engine = Engine(cfg, comm, source=source)
        engine.train_step(0)
        gc.collect()
        resident = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        loss = engine.train_step(1).loss
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    cpu = []
    for k in (2, 3):  # CPU seconds: robust on a machine shared with other work
        start = time.process_time()
        engine.train_step(k)
        cpu.append(time.process_time() - start)
    engine.close()
    return {"mode": mode, "tp": comm.Get_size(), "tp_sequence_parallel": tp_sequence_parallel,
            "resident": resident, "peak": peak, "activations": peak - resident, "loss": loss,
            "step_cpu_s": min(cpu)}


def run_memory(args: argparse.Namespace, comm=None) -> dict[str, Any]:
    """Measure every requested recompute mode on one model; print bytes and ratios to none.

    Under ``mpirun -n N`` (or with a ``comm`` of N ranks) the model runs with tp = N, each mode
    without and with --tp-sequence-parallel, side by side; the figures are the largest over the
    ranks, and a ratio column gives what sequence parallelism keeps of the step's activations."""
    from mpi4py import MPI

    from mpipar.model.llama import RECOMPUTE_MODES

    comm = comm or MPI.COMM_WORLD
    tp, rank0 = comm.Get_size(), comm.Get_rank() == 0
    say = print if rank0 else (lambda *a, **k: None)
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads = 4, 128, 4, 2
        args.ffn, args.seq, args.batch, args.micro_batch = 344, 128, 2, 2
    modes = [m.strip() for m in args.modes.split(",")]
    for m in modes:
        if m not in RECOMPUTE_MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; choose from "
                             f"{', '.join(RECOMPUTE_MODES)}")
    if "none" not in modes:
        modes.insert(0, "none")  # the reference the ratios are relative to
    variants = [(m, sp) for m in modes for sp in ((False, True) if tp > 1 else (False,))]
    say(f"memory: one training step, {'single process' if tp == 1 else f'tp={tp}'}, numpy "
        f"kernels, {args.dtype}; layers={args.layers} hidden={args.hidden} heads={args.heads}/"
        f"{args.kv_heads} ffn={args.ffn} vocab=256 seq={args.seq} batch={args.batch} "
        f"micro_batch={args.micro_batch}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-memory-") as run_dir:
        run_dir = comm.bcast(run_dir)
        measure_step_memory("none", args, run_dir, traced=False, comm=comm)
        for mode, seqpar in variants:
            mine = measure_step_memory(mode, args, run_dir, comm=comm,
                                       tp_sequence_parallel=seqpar)
            every = comm.allgather(mine)
            rows.append({**mine, **{k: max(r[k] for r in every)
                                    for k in ("resident", "peak", "activations", "step_cpu_s")}})
            gc.collect()
    _print_memory(rows, say)
    return {"config": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads",
                                                     "ffn", "seq", "batch", "micro_batch",
                                                     "dtype")} | {"tp": tp},
            "rows": rows}


def _print_memory(rows: list[dict[str, Any]], say: Callable[..., None]) -> None:
    """The memory table: each mode against none, and tp sequence parallelism against none."""
    base = rows[0]
    plain = {r["mode"]: r for r in rows if not r["tp_sequence_parallel"]}
    header = (f"{'mode':<10} {'tp-SP':>5} {'peak MiB':>9} {'vs none':>8} {'step adds MiB':>14} "
              f"{'vs none':>8} {'vs no tp-SP':>11} {'resident MiB':>13} {'cpu s':>7} "
              f"{'vs none':>8}  loss")
    say(header)
    say("-" * len(header))
    mib = 2.0 ** 20
    for r in rows:
        r["peak_ratio"] = r["peak"] / base["peak"]
        r["activations_ratio"] = r["activations"] / base["activations"]
        r["tp_sequence_parallel_ratio"] = r["activations"] / plain[r["mode"]]["activations"]
        r["time_ratio"] = r["step_cpu_s"] / base["step_cpu_s"]
        say(f"{r['mode']:<10} {'on' if r['tp_sequence_parallel'] else 'off':>5} "
            f"{r['peak'] / mib:>9.1f} {r['peak_ratio']:>7.2f}x {r['activations'] / mib:>14.1f} "
            f"{r['activations_ratio']:>7.2f}x {r['tp_sequence_parallel_ratio']:>10.2f}x "
            f"{r['resident'] / mib:>13.1f} {r['step_cpu_s']:>7.2f} {r['time_ratio']:>7.2f}x  "
            f"{r['loss']:.10f}")
    say("peak: highest traced bytes during the step (the largest over ranks); step adds: peak "
        "minus what is held between steps (parameters, gradients, optimizer state); vs no "
        "tp-SP: step adds against the same mode without --tp-sequence-parallel; cpu s: CPU "
        "seconds of a step (untraced); offload's HDF5 buffers are not NumPy memory and are not "
        "counted")


def _configure_memory(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default="none,selective,full,offload",
                        help="comma list of --recompute modes (none is always measured)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per microbatch")


register("memory", run_memory, "peak memory of one training step for each --recompute mode "
         "(under mpirun -n N: tp = N, with and without --tp-sequence-parallel)",
         _configure_memory)


# ----------------------------------------------------------------------------------------------
# comm section
# ----------------------------------------------------------------------------------------------

def _timed(fn: Callable[[], Any], comm: Any, repeats: int) -> float:
    """Median over ``repeats`` of the slowest rank's seconds for one ``fn()`` (all ranks start
    together after a barrier)."""
    fn()
    samples = []
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        samples.append(comm.allreduce(time.perf_counter() - start, op=_max_op()))
    return statistics.median(samples)


def _max_op() -> Any:
    from mpi4py import MPI
    return MPI.MAX


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


def sustained(fn: Callable[[], Any], seconds: float) -> float:
    """Mean wall seconds of one ``fn()`` called back to back for about ``seconds``: with every
    rank doing the same at once, what a rank really gets of its share of the cores."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


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


def run_comm(args: argparse.Namespace) -> dict[str, Any]:
    """Links inside a node and across nodes, compute speed and per-op overhead of every rank,
    measured with all ranks busy at once; rank 0 prints them and writes the hardware file."""
    from mpi4py import MPI

    from mpipar.planner import Hardware

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    across = comm.Split(node.Get_rank(), rank)         # one rank per node: the same local rank
    nodes = comm.allreduce(1 if node.Get_rank() == 0 else 0)
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
    peaks, overheads, rates = comm.gather(peak), comm.gather(overhead), comm.gather(elements)
    for c in (across, node):
        c.Free()
    if rank != 0:
        return {}
    hw = Hardware.from_links(min(peaks), statistics.median(overheads), min(rates), links,
                             on_node, nodes)
    print(f"comm: {comm.Get_size()} ranks on {nodes} node(s) x {on_node}; {args.dtype} GEMM "
          f"{args.gemm}^3 {min(peaks) / 1e9:.2f} GFLOP/s per rank (slowest; all ranks at once), "
          f"op overhead {statistics.median(overheads) * 1e6:.1f} us (median rank), in-place "
          f"pass {min(rates) / 1e6:.0f} M elements/s (slowest)")
    header = f"{'link':<6} {'op':<10} {'latency us':>11} {'bandwidth MB/s':>15}"
    print(header)
    print("-" * len(header))
    for scope, values in links.items():
        for op in ("sendrecv", "allreduce", "allgather"):
            print(f"{scope:<6} {op:<10} {values[op + '_latency'] * 1e6:>11.1f} "
                  f"{values[op + '_bandwidth'] / 1e6:>15.1f}")
    hw.save(args.out)
    print(f"comm: wrote {args.out} (python -m mpipar.plan --hardware {args.out})")
    return {"links": links, "hardware": hw.to_dict()}


def _configure_comm(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="hardware.json", help="the hardware file to write")
    parser.add_argument("--mb", type=int, default=4, help="MiB of the bandwidth messages")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats (median)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="dtype of the GEMM probe (train's default: float32)")
    parser.add_argument("--hidden", type=int, default=128, help="width of the op-overhead probe")
    parser.add_argument("--gemm", type=int, default=256,
                        help="size of the GEMM probe (near the model's matrices)")


register("comm", run_comm, "MPI link latency/bandwidth, compute speed and op overhead (under "
         "a launcher); writes the planner's hardware file", _configure_comm)


# ----------------------------------------------------------------------------------------------
# planner section
# ----------------------------------------------------------------------------------------------

PLANNER_LAYOUTS = ("--dp 8", "--dp 4 --tp 2", "--dp 2 --tp 2 --pp 2 --micro-batch-size 2",
                   "--dp 2 --sp 2 --tp 2", "--tp 2 --sp 2 --pp 2 --micro-batch-size 4")


def measured_step_time(launch: list[str], flags: list[str], run_dir: str) -> tuple[float, Any]:
    """Median step time of steps after the first third of a training run of ``flags`` (the
    default model), and the run's resolved config."""
    from mpipar.config import Config

    proc = subprocess.run([*launch, sys.executable, "-m", "mpipar.train", *flags, "--run-dir",
                           run_dir, "--log-every", "0"], capture_output=True, text=True,
                          timeout=900, env=LAUNCH_ENV)
    if proc.returncode != 0:
        raise SystemExit(f"planner: training {' '.join(flags)} failed:\n{proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        times = [json.loads(line)["step_time_s"] for line in fh]
    return statistics.median(times[len(times) // 3:]), Config.from_toml(
        os.path.join(run_dir, "config.toml"))


def run_planner(args: argparse.Namespace) -> dict[str, Any]:
    """Train each layout for ``--steps`` steps under ``--launcher`` and print the planner's
    predicted step time (``--hardware`` file) beside the measured median."""
    from mpipar.planner import Hardware, predict_step_time

    hw = Hardware.load(args.hardware)
    launch = args.launcher.split() + ["-n", str(args.ranks)]
    steps = 6 if args.quick else args.steps
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-planner-") as tmp:
        for i, layout in enumerate(args.layouts.split(";")):
            flags = [*layout.split(), "--steps", str(steps), *args.train_args.split()]
            measured, cfg = measured_step_time(launch, flags, os.path.join(tmp, str(i)))
            predicted = predict_step_time(cfg, hw)
            rows.append({"layout": layout, "predicted_s": predicted.total, "measured_s": measured,
                         "ratio": predicted.total / measured})
    print(f"planner: {args.ranks} ranks, {steps} steps each, the default model "
          f"{args.train_args}; hardware {args.hardware}")
    header = f"{'layout':<44} {'predicted ms':>13} {'measured ms':>12} {'predicted/measured':>19}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['layout']:<44} {r['predicted_s'] * 1e3:>13.1f} {r['measured_s'] * 1e3:>12.1f} "
              f"{r['ratio']:>19.2f}")
    return {"hardware": hw.to_dict(), "rows": rows}


def _configure_planner(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hardware", default="hardware.json",
                        help="from python -m mpipar.bench comm")
    parser.add_argument("--launcher", default="mpirun", help="the launch command (before -n)")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--layouts", default=";".join(PLANNER_LAYOUTS),
                        help="';'-separated layout flags")
    parser.add_argument("--train-args", default="", help="more mpipar.train flags for every run")


register("planner", run_planner, "predicted against measured step time of several layouts",
         _configure_planner)


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------

def _common_options() -> argparse.ArgumentParser:
    # SUPPRESS: an option given before or after the subcommand lands in the same namespace field.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quick", action="store_true", default=argparse.SUPPRESS,
                        help="fewer repeats and shorter batches")
    common.add_argument("--json", metavar="PATH", default=argparse.SUPPRESS,
                        help="also write the results as JSON to PATH")
    return common


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and one subparser per registered section."""
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
    """Run the chosen section (or all of them) and optionally write JSON results."""
    parser, subparsers = build_parser()
    args = parser.parse_args(argv)
    if args.section is not None:
        chosen = {args.section: args}
    else:
        chosen = {}
        for name, sub in subparsers.items():
            ns = sub.parse_args([])
            ns.quick, ns.json, ns.section = args.quick, args.json, name
            chosen[name] = ns
    from mpi4py import MPI

    results = {}
    for name, ns in chosen.items():
        results[name] = SECTIONS[name].run(ns)
        print()
    if args.json and MPI.COMM_WORLD.Get_rank() == 0:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
