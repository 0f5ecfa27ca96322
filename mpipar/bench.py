"""Benchmarks: `python -m mpipar.bench [SECTION] [--quick] [--json PATH]`.

Each benchmark is a registered section with a subcommand of its own; with no subcommand every
section runs in registration order. A section is a function `run(args) -> dict` that prints a
human-readable table and returns JSON-serialisable results (written with `--json PATH` as
`{section: results}`); `configure(parser)` may add section options.

Sections:
  kernels      every kernel op for every available backend, side by side, float32 and float64
  memory       peak memory (tracemalloc) of one training step for each --recompute mode
  compression  convergence of gradient compression: the default model trained under mpirun with
               no, int8 and top-k compression, with and without error feedback (loss table, plot)
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
# compression section
# ----------------------------------------------------------------------------------------------

COMPRESSION_VARIANTS = {
    "none": [],
    "int8": ["--grad-compression", "int8"],
    "int8-noef": ["--grad-compression", "int8", "--error-feedback", "off"],
    "topk": ["--grad-compression", "topk"],
    "topk-noef": ["--grad-compression", "topk", "--error-feedback", "off"],
}
"""Variant name -> its ``python -m mpipar.train`` flags (top-k at --topk-ratio)."""


def _mpirun() -> str:
    """The launcher beside this Python (the [mpich] extra), else the one on PATH."""
    import shutil
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = beside if os.path.exists(beside) else shutil.which("mpirun")
    if found is None:
        raise SystemExit("compression: no mpirun beside this Python or on PATH")
    return found


def _train_variant(name: str, args: argparse.Namespace, out: str) -> dict[str, Any]:
    """Train one variant under mpirun (the default model and corpus, dp = ranks) and read its
    metrics: losses per step, the final loss (mean of the last ``--last`` steps), the median
    step time after step 1, and rank 0's bytes per step across nodes and in total."""
    import subprocess

    run_dir = os.path.join(out, name)
    flags = [*COMPRESSION_VARIANTS[name], "--topk-ratio", str(args.topk_ratio),
             "--steps", str(args.steps), "--dp", str(args.ranks), "--run-dir", run_dir,
             "--log-every", "0", "--tensorboard", "off", *args.train_flags.split()]
    if args.ranks_per_node:
        flags += ["--ranks-per-node", str(args.ranks_per_node), "--dp-reduce", args.dp_reduce]
    cmd = [_mpirun(), "-n", str(args.ranks), sys.executable, "-m", "mpipar.train", *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"compression: {name} failed ({' '.join(cmd)}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    losses = [r["loss"] for r in records]
    wire = records[-1].get("comm_wire_bytes", {})
    return {"variant": name, "flags": flags, "losses": losses,
            "final_loss": statistics.mean(losses[-args.last:]),
            "step_time_s": statistics.median(r["step_time_s"] for r in records[1:] or records),
            "inter_node_bytes": sum(v["inter"] for v in wire.values()),
            "wire_bytes": sum(v["intra"] + v["inter"] for v in wire.values()),
            "wall_s": time.perf_counter() - start}


def _plot_losses(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Loss per step of every variant (raw, faint) and its 20-step running mean."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        losses = np.asarray(r["losses"])
        steps = np.arange(1, losses.size + 1)
        line, = ax.plot(steps, losses, alpha=0.25, linewidth=0.8)
        width = min(20, losses.size)
        smooth = np.convolve(losses, np.ones(width) / width, mode="valid")
        ax.plot(steps[width - 1:], smooth, color=line.get_color(), linewidth=1.6,
                label=f"{r['variant']} (final {r['final_loss']:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(top=min(ax.get_ylim()[1], float(np.median([r["losses"][0] for r in rows])) + 0.2))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_compression(args: argparse.Namespace) -> dict[str, Any]:
    """Train each variant side by side and compare its final loss with no compression's."""
    if args.quick:
        args.steps, args.ranks, args.last = 30, 4, 10
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in COMPRESSION_VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from "
                         f"{', '.join(COMPRESSION_VARIANTS)}")
    if "none" not in names:
        names.insert(0, "none")
    os.makedirs(args.out, exist_ok=True)
    reduce = (f"{args.dp_reduce} on nodes of {args.ranks_per_node}" if args.ranks_per_node
              else "flat over dp")
    title = (f"default model, stdlib corpus, dp={args.ranks} ({reduce}), {args.steps} steps, "
             f"top-k ratio {args.topk_ratio:g}")
    print(f"compression: {title}; final loss = mean of the last {args.last} steps")
    rows = []
    for name in names:
        rows.append(_train_variant(name, args, args.out))
        print(f"  {name}: final loss {rows[-1]['final_loss']:.4f} "
              f"({rows[-1]['wall_s']:.0f} s)", flush=True)
    base = rows[0]
    for r in rows:
        r["vs_none"] = r["final_loss"] / base["final_loss"] - 1
        r["bytes_ratio"] = (base["wire_bytes"] / r["wire_bytes"]) if r["wire_bytes"] else None
    _print_compression(rows)
    plot = os.path.join(args.out, "compression_loss.png")
    _plot_losses(rows, plot, title)
    print(f"loss plot: {plot}")
    return {"config": {"steps": args.steps, "ranks": args.ranks, "last": args.last,
                       "topk_ratio": args.topk_ratio, "ranks_per_node": args.ranks_per_node,
                       "dp_reduce": args.dp_reduce, "train_flags": args.train_flags},
            "rows": [{k: v for k, v in r.items() if k != "losses"} | {"losses": r["losses"]}
                     for r in rows], "plot": plot}


def _print_compression(rows: list[dict[str, Any]]) -> None:
    header = (f"{'variant':<10} {'final loss':>10} {'vs none':>8} {'wire bytes/step':>16} "
              f"{'fewer':>7} {'step s':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        fewer = f"{r['bytes_ratio']:.1f}x" if r["bytes_ratio"] else "-"
        print(f"{r['variant']:<10} {r['final_loss']:>10.4f} {100 * r['vs_none']:>+7.2f}% "
              f"{r['wire_bytes']:>16,} {fewer:>7} {r['step_time_s']:>7.3f}")
    print("vs none: final loss relative to no compression; wire bytes: what rank 0 put on the "
          "wire in the last step (all groups); fewer: none's wire bytes over the variant's; "
          "step s: median step time (ranks sharing this machine's cores: not a speed figure)")


def _configure_compression(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", default="none,int8,topk,topk-noef",
                        help=f"comma list of {', '.join(COMPRESSION_VARIANTS)} (none is always "
                             f"run)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=8, help="mpirun -n (dp = ranks)")
    parser.add_argument("--last", type=int, default=20, help="final loss: mean of the last N steps")
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="nodes of K ranks (compression then runs across them with "
                             "--dp-reduce hierarchical)")
    parser.add_argument("--dp-reduce", default="hierarchical", choices=("flat", "hierarchical"))
    parser.add_argument("--train-flags", default="", help="more python -m mpipar.train flags")
    parser.add_argument("--out", default="runs/bench-compression",
                        help="run directories and compression_loss.png go here")


register("compression", run_compression, "final loss of the default model trained with no, int8 "
         "and top-k gradient compression, with and without error feedback (mpirun)",
         _configure_compression)


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
