"""Benchmarks: `python -m mpipar.bench [SECTION] [--quick] [--json PATH]`.

Each benchmark is a registered section with a subcommand of its own; with no subcommand every
section runs in registration order. A section is a function `run(args) -> dict` that prints a
human-readable table and returns JSON-serialisable results (written with `--json PATH` as
`{section: results}`); `configure(parser)` may add section options.

Sections:
  kernels   every kernel op for every available backend, side by side, float32 and float64
  memory    peak memory (tracemalloc) of one training step for each --recompute mode
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mpipar import kernels
from mpipar.kernels import numpy_ref


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
        "linear_bias_bwd": (rand(b, s, ffn),),
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
