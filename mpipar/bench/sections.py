"""Benchmarks: `python -m mpipar.bench [SECTION] [--quick] [--json PATH]`.

Each benchmark is a registered section with a subcommand of its own; with no subcommand every
section runs in registration order. A section is a function `run(args) -> dict` that prints a
human-readable table and returns JSON-serialisable results (written with `--json PATH` as
`{section: results}`); `configure(parser)` may add section options.

Sections:
  kernels      every kernel op for every available backend, side by side, float32 and float64; the
               fused kernels against the ops they replace; attention forward/backward GFLOP/s
               and % of the GEMM probe at long sequences, per thread count
  memory       peak memory (tracemalloc) of one training step for each --recompute mode; with
               --zero STAGES under mpirun -n N: dp = N, each ZeRO stage's memory per rank
               against a --budget-mb, and ZeRO-3's exposed all-gather time against its transfer
               time
  comm         under a launcher: send/recv, all-reduce and all-gather latency and bandwidth inside
               a node and across nodes, the GEMM speed, the per-op overhead and the compression
               codecs' work every rank gets with all ranks busy; written as the hardware file the
               planner reads (python -m mpipar.plan --hardware FILE)
  planner      the planner's predicted step time (from a hardware file) against the measured one
               of training runs of several layouts, side by side
  train        one training step of mpipar against PyTorch eager (transformers Llama, sdpa,
               AdamW) on the same model and threads, interleaved; dp=2 against PyTorch DDP (gloo)
  compression  convergence of gradient compression: the default model trained under mpirun with
               no, int8 and top-k compression, with and without error feedback (loss table, plot)
  gpu          on a CUDA device (mpipar.bench.gpu): attention TFLOP/s against the GEMM of equal
               FLOPs, end-to-end tokens/s and MFU of a 350M Llama against PyTorch eager

Sections that compare thread counts run each count in child processes started with
OMP/OPENBLAS/MKL/NUMBA_NUM_THREADS set (NumPy's BLAS reads its thread count once, at import).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable

from mpipar.runtime import nodes

# Before NumPy: under a launcher each rank gets its share of the node's cores for BLAS (as in
# python -m mpipar.train), not all of them (8 ranks x all-core BLAS pools thrash 2 cores). The
# jobs this module starts get the environment as it was, to budget their own threads.
LAUNCH_ENV = dict(os.environ)
nodes.configure_threads(None)

import numpy as np  # noqa: E402

from mpipar import kernels  # noqa: E402
from mpipar.kernels import numpy_ref  # noqa: E402
from mpipar.rules import validate


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
        "add_rmsnorm_fwd": (x, rand(b, s, hid), norm_w, 1e-5),
        "add_rmsnorm_bwd": (rand(b, s, hid), rand(b, s, hid), x, norm_w, rstd),
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
    """Time every op of every requested, available backend; print one table per run; then the
    fused kernels against their unfused ops and the attention rows (one child per thread count)."""
    if args.attention_only:  # a child of _attention_by_threads: this process's thread count
        return {"attention": measure_attention(args)}
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
    fused = measure_fusions(shape, args.dtypes, "numba" if numba_backend else "numpy", repeats, min_seconds)
    attention = attention_by_threads(args)
    return {"shape": shape.__dict__, "repeats": repeats, "backends": names,
            "numba_backend": numba_backend.describe() if numba_backend else None, "rows": rows,
            "fused": fused, "attention": attention}


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


def unfused_compositions(backend: Any, cases: dict[str, tuple[Any, ...]]) -> dict[str, Callable[[], Any]]:
    """Fused op -> the unfused ops it replaces, called with the same arguments (kernel_cases)."""
    x, r, w, eps = cases["add_rmsnorm_fwd"]
    dy, ds, s, w2, rstd = cases["add_rmsnorm_bwd"]
    return {
        "add_rmsnorm_fwd": lambda: (x + r, *backend.rmsnorm_fwd(x + r, w, eps)),
        "add_rmsnorm_bwd": lambda: (backend.rmsnorm_bwd(dy, s, w2, rstd)[0] + ds),
    }


def measure_fusions(shape: KernelShape, dtypes: str, backend_name: str, repeats: int,
                    min_seconds: float) -> list[dict[str, Any]]:
    """Each fused kernel of `backend_name` against the unfused ops of the same backend; prints a table."""
    backend = kernels.get_backend(backend_name)
    rows = []
    for dtype_name in dtypes.split(","):
        dtype = np.dtype(dtype_name.strip())
        cases = kernel_cases(shape, dtype)
        for op, unfused in unfused_compositions(backend, cases).items():
            fn, call_args = getattr(backend, op), cases[op]
            fused_s = time_call(lambda: fn(*call_args), lambda: None, repeats, min_seconds)
            unfused_s = time_call(unfused, lambda: None, repeats, min_seconds)
            rows.append({"op": op, "dtype": dtype.name, "backend": backend_name, "fused_ms": fused_s * 1e3,
                         "unfused_ms": unfused_s * 1e3, "speedup": unfused_s / fused_s})
    print(f"\nfused kernels ({backend_name} backend) against the ops they replace, same arguments")
    print(f"{'op':<20} {'dtype':<8} {'unfused ms':>11} {'fused ms':>9} {'speed-up':>9}")
    for r in rows:
        print(f"{r['op']:<20} {r['dtype']:<8} {r['unfused_ms']:>11.3f} {r['fused_ms']:>9.3f} {r['speedup']:>8.2f}x")
    return rows


def attention_flops(batch: int, seq: int, heads: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of causal attention counted the standard way: per head, half of
    4 * seq**2 * head_dim forward (Q K^T and P V) and 2.5 times that backward."""
    fwd = 0.5 * 4.0 * seq * seq * head_dim * heads * batch
    return fwd, 2.5 * fwd


def best_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(fastest wall, fastest CPU) seconds of `repeats` timed calls after one untimed call (which
    compiles). CPU seconds are this process's, all threads: with one thread, the time the call
    ran, however many other processes shared the cores meanwhile."""
    fn()
    wall = cpu = math.inf
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - cpu_start)
    return wall, cpu


def cpu_probe_flops(dtype: np.dtype, n: int = 384, seconds: float = 0.25) -> float:
    """FLOPs per CPU second of the GEMM probe's product (`[n, n] @ [n, n]`, as
    `mpipar.runtime.peak.measure_peak_flops`), the fastest of repeated calls over `seconds` of CPU."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
    best, spent = math.inf, 0.0
    while spent < seconds:
        start = time.process_time()
        a @ a
        took = time.process_time() - start
        spent += took
        best = min(best, took) if took > 0 else best
    return 2.0 * n ** 3 / best


def measure_attention(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Attention forward and backward of the numba backend (this process's threads), causal, one
    row per (dtype, head dim, sequence length), each next to a fresh GEMM probe of the same threads."""
    import numba

    from mpipar.runtime.peak import measure_peak_flops

    backend = kernels.get_backend("numba")
    rng = np.random.default_rng(0)
    b, hq = args.attn_batch, args.attn_heads
    rows = []
    for dtype_name in args.attn_dtypes.split(","):
        dtype = np.dtype(dtype_name.strip())
        for d in _ints(args.attn_head_dims):
            for s in _ints(args.attn_seqs):
                q = rng.standard_normal((b, s, hq, d)).astype(dtype)
                k, v = (rng.standard_normal((b, s, max(1, hq // 2), d)).astype(dtype) for _ in range(2))
                out, lse = backend.attention_fwd(q, k, v)
                dout = rng.standard_normal(q.shape).astype(dtype)
                fwd_s, fwd_cpu = best_seconds(lambda: backend.attention_fwd(q, k, v), args.attn_repeats)
                bwd_s, bwd_cpu = best_seconds(lambda: backend.attention_bwd(q, k, v, out, lse, dout),
                                              args.attn_repeats)
                fwd_flops, bwd_flops = attention_flops(b, s, hq, d)
                rows.append({"dtype": dtype.name, "head_dim": d, "seq": s, "batch": b, "heads": hq,
                             "kv_heads": k.shape[2], "threads": numba.get_num_threads(),
                             "fwd_s": fwd_s, "bwd_s": bwd_s, "fwd_gflops": fwd_flops / fwd_s / 1e9,
                             "bwd_gflops": bwd_flops / bwd_s / 1e9,
                             "probe_gflops": measure_peak_flops(dtype.name) / 1e9,
                             "fwd_cpu_s": fwd_cpu, "bwd_cpu_s": bwd_cpu,
                             "fwd_cpu_pct_probe": 100 * fwd_flops / fwd_cpu / cpu_probe_flops(dtype),
                             "bwd_cpu_pct_probe": 100 * bwd_flops / bwd_cpu / cpu_probe_flops(dtype)})
    return rows


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def run_child(section_argv: list[str], threads: int, launcher: tuple[str, ...] = ()) -> dict[str, Any]:
    """Results of `python -m mpipar.bench SECTION_ARGV --json F` run in a child process (under
    `launcher`, e.g. mpirun) with `threads` threads for BLAS, OpenMP and Numba."""
    from mpipar.runtime.nodes import THREAD_VARS

    env = dict(os.environ, **{var: str(threads) for var in THREAD_VARS})
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-") as tmp:
        path = os.path.join(tmp, "results.json")
        argv = [*launcher, sys.executable, "-m", "mpipar.bench", *section_argv, "--json", path]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"bench child {' '.join(argv)} failed with status {proc.returncode}:\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)


def thread_counts(text: str) -> list[int]:
    """--threads: a comma list, or "" for 1 and every core of this machine."""
    counts = _ints(text) or sorted({1, _cpu_count()})
    if any(t < 1 for t in counts):
        raise SystemExit(f"--threads {text!r}: thread counts must be >= 1")
    return counts


def _cpu_count() -> int:
    from mpipar.runtime.nodes import cpu_count

    return cpu_count()


def attention_by_threads(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The attention rows measured in one child per thread count, the children alternating for
    --attn-rounds rounds; each row keeps its fastest round. Prints the table."""
    if not _ints(args.attn_seqs) or kernels.available_backends()["numba"] is not None:
        return []
    argv = ["kernels", "--attention-only", "--attn-seqs", args.attn_seqs, "--attn-head-dims", args.attn_head_dims,
            "--attn-heads", str(args.attn_heads), "--attn-batch", str(args.attn_batch), "--attn-dtypes",
            args.attn_dtypes, "--attn-repeats", str(1 if args.quick else args.attn_repeats)]
    best: dict[tuple, dict[str, Any]] = {}
    for _ in range(1 if args.quick else args.attn_rounds):
        for t in thread_counts(args.attn_threads):
            for row in run_child(argv, t)["kernels"]["attention"]:
                key = (row["dtype"], row["head_dim"], row["seq"], row["threads"])
                old = best.get(key)
                if old is None:
                    best[key] = row
                    continue
                for phase in ("fwd", "bwd"):
                    if row[f"{phase}_s"] < old[f"{phase}_s"]:
                        old[f"{phase}_s"], old[f"{phase}_gflops"] = row[f"{phase}_s"], row[f"{phase}_gflops"]
                    if row[f"{phase}_cpu_pct_probe"] > old[f"{phase}_cpu_pct_probe"]:
                        old[f"{phase}_cpu_s"] = row[f"{phase}_cpu_s"]
                        old[f"{phase}_cpu_pct_probe"] = row[f"{phase}_cpu_pct_probe"]
                old["probe_gflops"] = max(old["probe_gflops"], row["probe_gflops"])
    rows = list(best.values())
    _print_attention_table(rows)
    return rows


def _print_attention_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"\nattention (numba backend), causal, batch {r0['batch']}, heads {r0['heads']}/{r0['kv_heads']}: "
          "GFLOP/s and % of the GEMM probe (mpipar.runtime.peak.measure_peak_flops, same threads, measured "
          "beside each row); FLOPs per head: forward half of 4 S^2 D, backward 2.5x forward")
    header = (f"{'dtype':<8} {'D':>4} {'seq':>6} {'thr':>4} {'fwd ms':>9} {'GFLOP/s':>8} {'%probe':>7} "
              f"{'bwd ms':>9} {'GFLOP/s':>8} {'%probe':>7} {'probe':>7} {'vs 1 thread':>12} {'CPU %probe':>11}")
    print(header)
    print("-" * len(header))
    single = {(r["dtype"], r["head_dim"], r["seq"]): r for r in rows if r["threads"] == 1}
    for r in sorted(rows, key=lambda r: (r["dtype"], r["head_dim"], r["seq"], r["threads"])):
        one = single.get((r["dtype"], r["head_dim"], r["seq"]))
        speedup = "" if one is None or r["threads"] == 1 else \
            f"{one['fwd_s'] / r['fwd_s']:.2f}x/{one['bwd_s'] / r['bwd_s']:.2f}x"
        r["fwd_pct_probe"] = 100 * r["fwd_gflops"] / r["probe_gflops"]
        r["bwd_pct_probe"] = 100 * r["bwd_gflops"] / r["probe_gflops"]
        cpu = f"{r['fwd_cpu_pct_probe']:.0f}%/{r['bwd_cpu_pct_probe']:.0f}%" if r["threads"] == 1 else ""
        print(f"{r['dtype']:<8} {r['head_dim']:>4} {r['seq']:>6} {r['threads']:>4} {r['fwd_s'] * 1e3:>9.1f} "
              f"{r['fwd_gflops']:>8.1f} {r['fwd_pct_probe']:>6.0f}% {r['bwd_s'] * 1e3:>9.1f} "
              f"{r['bwd_gflops']:>8.1f} {r['bwd_pct_probe']:>6.0f}% {r['probe_gflops']:>7.1f} {speedup:>12} "
              f"{cpu:>11}")
    print("vs 1 thread: forward / backward speed-up over the same row at 1 thread; CPU %probe (1 thread): "
          "forward / backward FLOPs per CPU second over the probe's, for a machine shared with other work")


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
    parser.add_argument("--attn-seqs", default="512,2048,8192",
                        help="attention rows: comma list of sequence lengths (empty: no attention rows)")
    parser.add_argument("--attn-head-dims", default="64,128", help="attention rows: comma list of head dims")
    parser.add_argument("--attn-heads", type=int, default=4, help="attention rows: query heads (kv heads: half)")
    parser.add_argument("--attn-batch", type=int, default=1, help="attention rows: batch")
    parser.add_argument("--attn-dtypes", default="float32", help="attention rows: comma list of dtypes")
    parser.add_argument("--attn-threads", default="", help="attention rows: comma list of thread counts, "
                        "one child process each (default: 1 and all cores)")
    parser.add_argument("--attn-rounds", type=int, default=2,
                        help="attention rows: rounds of children (alternating thread counts); best kept")
    parser.add_argument("--attn-repeats", type=int, default=3, help="attention rows: timed calls (fastest kept)")
    parser.add_argument("--attention-only", action="store_true", help=argparse.SUPPRESS)  # child mode


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
    from mpipar.runtime.mpi_init import MPI

    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from mpipar.data.sources import load_tokens
    from mpipar.training.engine import Engine

    comm = comm or MPI.COMM_SELF
    cfg = validate(Config(
        ModelConfig(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    kv_heads=args.kv_heads, ffn_hidden=args.ffn),
        ParallelConfig(tp=comm.Get_size(), tp_sequence_parallel=tp_sequence_parallel),
        TrainConfig(steps=10, seq_len=args.seq, global_batch_size=args.batch,
                    micro_batch_size=args.micro_batch, dtype=args.dtype, backend="numpy",
                    run_dir=run_dir, recompute=mode, warmup_steps=1, log_every=0),
    ), comm.Get_size())
    source = load_tokens(None, 256, args.seq)  # the corpus is cached: load it untraced
    engine, m = _traced_build_and_step(lambda: Engine(cfg, comm, source=source), traced)
    resident, peak, loss = m["resident"], m["step_peak"], m["loss"]
    cpu = []
    for k in (2, 3):  # CPU seconds: robust on a machine shared with other work
        start = time.process_time()
        engine.train_step(k)
        cpu.append(time.process_time() - start)
    engine.close()
    return {"mode": mode, "tp": comm.Get_size(), "tp_sequence_parallel": tp_sequence_parallel,
            "resident": resident, "peak": peak, "activations": peak - resident, "loss": loss,
            "step_cpu_s": min(cpu)}


def _traced_build_and_step(build: Callable[[], Any], traced: bool = True) -> tuple[Any, dict]:
    """``build()`` an engine and run its steps 0 and 1 under tracemalloc (``traced``): the
    engine and {``build_peak``: the peak while building, ``resident``: what it holds after step
    0, ``step_peak``: the peak of step 1, ``loss``: step 1's loss} (zeros when untraced)."""
    if traced:
        tracemalloc.start()
    try:
        engine = build()
        build_peak = tracemalloc.get_traced_memory()[1]
        engine.train_step(0)
        gc.collect()
        resident = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        loss = engine.train_step(1).loss
        step_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return engine, {"build_peak": build_peak, "resident": resident, "step_peak": step_peak,
                    "loss": loss}


def _zero_engine(stage: int, prefetch: int, args: argparse.Namespace, comm, run_dir: str,
                 shared: bool = False):
    """An engine of the --zero benchmark model with dp = every rank of ``comm`` (``shared``:
    ZeRO-3's parameters in node shared memory)."""
    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from mpipar.data.sources import load_tokens
    from mpipar.training.engine import Engine

    world = comm.Get_size()
    cfg = validate(Config(
        ModelConfig(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    kv_heads=args.kv_heads, ffn_hidden=args.ffn),
        ParallelConfig(dp=world, zero=stage, zero_prefetch=prefetch,
                       zero_shared="node" if shared else "off",
                       ranks_per_node=args.ranks_per_node),
        TrainConfig(steps=10, seq_len=args.seq, global_batch_size=args.batch,
                    micro_batch_size=args.micro_batch, dtype=args.dtype, backend="numpy",
                    run_dir=run_dir, recompute=args.modes.split(",")[0], warmup_steps=1,
                    log_every=0),
    ), world)
    return Engine(cfg, comm, source=load_tokens(None, 256, args.seq))


def measure_zero_memory(stage: int, prefetch: int, args: argparse.Namespace, comm,
                        run_dir: str, shared: bool = False) -> tuple[dict[str, Any], Any]:
    """Build and train one ZeRO ``stage`` engine under tracemalloc (only its own allocations
    are traced): the peak of building it, what it holds between steps (``resident``: state,
    the unit pool, caches) and the peak of a step; the planner's prediction beside them.
    ``shared``: ZeRO-3 in node shared memory, whose slices (not NumPy's, so not traced) are
    added to each figure."""
    from mpipar.plan.memory import predict_memory

    gc.collect()
    engine, m = _traced_build_and_step(
        lambda: _zero_engine(stage, prefetch, args, comm, run_dir, shared))
    extra = engine.sharded.shared_bytes if engine.sharded else 0
    build, resident, step, loss = (m["build_peak"] + extra, m["resident"] + extra,
                                   m["step_peak"] + extra, m["loss"])
    pool = (sum(b.nbytes for bufs in engine.sharded.pool.free.values() for b in bufs)
            if engine.sharded else 0)
    predicted = predict_memory(engine.cfg, engine.grid.coord)
    return {"zero": f"{stage}n" if shared else stage, "prefetch": prefetch,
            "build_peak": build, "resident": resident,
            "step_peak": step, "peak": max(build, step), "pool": pool,
            "state_predicted": predicted.state, "total_predicted": predicted.total,
            "loss": loss}, engine


def _gather_seconds(engine) -> tuple[float, float, int]:
    """(seconds blocked in all-gather waits and tests, of them in tests, all-gathers) the
    ledger booked since its reset."""
    e = engine.ledger.entries.get(("dp_sp", "iallgather"))
    return (e.seconds, e.tested, e.messages) if e else (0.0, 0.0, 0)


def run_zero_memory(args: argparse.Namespace, comm) -> dict[str, Any]:
    """The --zero benchmark: each stage's memory per rank (largest over ranks) against the
    budget, then ZeRO-3's steps at prefetch 0 (every all-gather waited as soon as posted: its
    whole transfer) and at --prefetch, interleaved step by step, with their step times."""
    world, rank0 = comm.Get_size(), comm.Get_rank() == 0
    say = print if rank0 else (lambda *a, **k: None)
    stages = [int(s) for s in args.zero.split(",")]
    mib = 2.0 ** 20
    say(f"memory: ZeRO stages, dp={world}, numpy kernels, {args.dtype}; layers={args.layers} "
        f"hidden={args.hidden} heads={args.heads}/{args.kv_heads} ffn={args.ffn} vocab=256 "
        f"seq={args.seq} batch={args.batch} micro_batch={args.micro_batch}; budget "
        f"{args.budget_mb} MiB per rank")
    from mpipar.data.sources import load_tokens
    load_tokens(None, 256, args.seq)  # the corpus is cached: load it untraced
    rows, engines = [], {}
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-zero-") as run_dir:
        run_dir = comm.bcast(run_dir)
        for stage in stages + (["3n"] if args.zero_shared else []):
            mine, engines[stage] = measure_zero_memory(3 if stage == "3n" else stage,
                                                       args.prefetch, args, comm, run_dir,
                                                       shared=stage == "3n")
            if stage not in (3, "3n"):      # only ZeRO-3's engines go on (to the overlap runs)
                engines.pop(stage).close()
            every = comm.allgather(mine)
            rows.append({**mine, **{k: max(r[k] for r in every) for k in mine
                                    if k not in ("zero", "prefetch", "loss")}})
        full_state = rows[0]["state_predicted"] if stages[0] == 0 else None
        header = (f"{'zero':>4} {'build MiB':>10} {'resident':>9} {'step peak':>10} "
                  f"{'pool MiB':>9} {'state (planner)':>16} {'fits':>5}  loss")
        say(header)
        say("-" * len(header))
        for r in rows:
            r["fits"] = r["peak"] <= args.budget_mb * mib
            say(f"{r['zero']:>4} {r['build_peak'] / mib:>10.1f} {r['resident'] / mib:>9.1f} "
                f"{r['step_peak'] / mib:>10.1f} {r['pool'] / mib:>9.1f} "
                f"{r['state_predicted'] / mib:>16.1f} {'yes' if r['fits'] else 'NO':>5}  "
                f"{r['loss']:.6f}")
        for key in (3, "3n"):
            if full_state and key in engines:
                r3 = rows[(stages + ["3n"]).index(key)]
                r3["resident_vs_share"] = r3["resident"] / (full_state / world + r3["pool"])
                say(f"ZeRO-{key} resident / (ZeRO-0 state / {world} + pool) = "
                    f"{r3['resident_vs_share']:.3f}")
        overlap = (_zero_overlap(engines.get(3), args, comm, run_dir, say, engines.get("3n"))
                   if 3 in engines else {})
        if "3n" in engines:
            engines.pop("3n").close()
    return {"config": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads",
                                                     "ffn", "seq", "batch", "micro_batch",
                                                     "dtype", "budget_mb", "prefetch")}
            | {"dp": world}, "rows": rows, "overlap": overlap}


def _zero_overlap(engine, args: argparse.Namespace, comm, run_dir: str, say,
                  shared=None) -> dict[str, Any]:
    """ZeRO-3 at prefetch 0 against ``engine`` (at --prefetch), and ``shared`` (node shared
    memory) when given, steps interleaved: the seconds a step blocks in all-gather waits and
    tests (the ledger; the test share apart; node shared: in the barrier that publishes the
    update), and the step times."""
    blocking = _zero_engine(3, 0, args, comm, run_dir)
    blocking.train_step(0)
    runs = [("prefetch0", blocking), (f"prefetch{args.prefetch}", engine)]
    runs += [("node shared", shared)] if shared is not None else []
    out = {}
    for name, eng in runs:
        out[name] = {"waited_s": 0.0, "tested_s": 0.0, "gathers": 0, "step_s": [],
                     "inter_bytes": 0}
    for k in range(2, 2 + args.zero_steps):
        for name, eng in runs:
            eng.ledger.reset()
            comm.Barrier()
            t0 = time.perf_counter()
            eng.train_step(k)
            out[name]["step_s"].append(time.perf_counter() - t0)
            seconds, tested, count = _gather_seconds(eng)
            if eng is shared:         # the barrier publishing the update (and across nodes,
                published = [e for (g, op), e in eng.ledger.entries.items()  # its all-gathers)
                             if op == "barrier" or g == "dp_sp_inter"]
                seconds += sum(e.seconds for e in published)
                count += sum(e.messages for e in published if e.bytes)
            out[name]["waited_s"] += seconds / args.zero_steps
            out[name]["tested_s"] += tested / args.zero_steps
            out[name]["gathers"] = count
            out[name]["inter_bytes"] = sum(links["inter"] for links
                                           in eng.ledger.bytes_by_link().values())
    for row in out.values():       # the slowest rank's (its test share beside it)
        row["waited_s"], row["tested_s"] = max(comm.allgather((row["waited_s"],
                                                               row["tested_s"])))
        row["inter_bytes"] = max(comm.allgather(row["inter_bytes"]))
        row["step_s"] = statistics.median(row["step_s"])
    base = out["prefetch0"]["waited_s"]
    for name, row in out.items():
        row["exposed_fraction"] = row["waited_s"] / base if base else float("nan")
        where = (f"{row['tested_s'] * 1e3:.1f} ms of it in test calls, the rank moving the "
                 f"data" if name != "node shared" else "all of it publishing the update: its "
                 "barrier, and across nodes the all-gathers into each node's copy")
        across = (f"; {row['inter_bytes'] / 1e6:.2f} MB a step across nodes (the rank that "
                  f"sends most)" if args.ranks_per_node else "")
        say(f"ZeRO-3 {name}: {row['gathers']} all-gathers a step, blocked "
            f"{row['waited_s'] * 1e3:.1f} ms a step ({100 * row['exposed_fraction']:.0f}% of "
            f"prefetch 0's, whose wait is the whole transfer; {where}); step "
            f"{row['step_s']:.3f} s{across}")
    blocking.close()
    return out


def run_memory(args: argparse.Namespace, comm=None) -> dict[str, Any]:
    """Measure every requested recompute mode on one model; print bytes and ratios to none.

    Under ``mpirun -n N`` (or with a ``comm`` of N ranks) the model runs with tp = N, each mode
    without and with --tp-sequence-parallel, side by side; the figures are the largest over the
    ranks, and a ratio column gives what sequence parallelism keeps of the step's activations."""
    from mpipar.runtime.mpi_init import MPI

    from mpipar.model.llama import RECOMPUTE_MODES

    comm = comm or MPI.COMM_WORLD
    if args.zero:
        return run_zero_memory(args, comm)
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
    parser.add_argument("--zero", default="", metavar="STAGES",
                        help="comma list of ZeRO stages to measure with dp = the world instead "
                             "of the recompute modes (the first of --modes is used)")
    parser.add_argument("--budget-mb", type=float, default=256.0,
                        help="--zero: memory per rank a stage's traced peak must fit")
    parser.add_argument("--prefetch", type=int, default=1, help="--zero: ZeRO-3 prefetch depth")
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="--zero: treat each K consecutive ranks as a node (node shared "
                             "memory then keeps a copy on each; bytes across nodes printed)")
    parser.add_argument("--zero-shared", action="store_true",
                        help="--zero with 3: also ZeRO-3 with the parameters in node shared "
                             "memory (row 3n; its blocked time is the barrier publishing the "
                             "update)")
    parser.add_argument("--zero-steps", type=int, default=3,
                        help="--zero: interleaved steps timing ZeRO-3's all-gathers")


register("memory", run_memory, "peak memory of one training step for each --recompute mode "
         "(under mpirun -n N: tp = N, with and without --tp-sequence-parallel)",
         _configure_memory)


# ----------------------------------------------------------------------------------------------
# window section
# ----------------------------------------------------------------------------------------------

def measure_window_step(sp_mode: str, window: int, seq: int, args: argparse.Namespace,
                        data: str, comm: Any) -> dict[str, Any]:
    """Train ``args.steps`` steps with sp = comm size; (median step seconds after the first,
    the SP bytes per step of the rank that sends the most, the planner's prediction of it)."""
    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from mpipar.data.sources import load_tokens
    from mpipar.training.engine import Engine
    from mpipar.plan.traffic import predict_step_bytes

    sp = comm.Get_size()
    cfg = validate(Config(ModelConfig(vocab_size=256, hidden=args.hidden, layers=args.layers,
                             heads=args.heads, kv_heads=args.kv_heads, sliding_window=window),
                 ParallelConfig(sp=sp, sp_mode=sp_mode),
                 TrainConfig(seq_len=seq, global_batch_size=1, dtype="float32", backend="auto",
                             steps=args.steps)), sp)
    engine = Engine(cfg, comm, source=load_tokens(data, 256, seq))
    seconds, sent = [], []
    for k in range(args.steps):
        engine.ledger.reset()
        comm.Barrier()
        t0 = time.perf_counter()
        engine.train_step(k)
        comm.Barrier()
        seconds.append(time.perf_counter() - t0)
        sent.append(engine.ledger.bytes_by_group().get("sp", 0))
    predicted = predict_step_bytes(cfg, engine.grid.coord).get("sp", 0)
    most = max(comm.allgather(sent[-1]))
    exact = all(comm.allgather(sent[-1] == predicted))
    return {"mode": sp_mode, "window": window, "seq": seq, "step_s": float(np.median(seconds[1:])),
            "sp_bytes": most, "ledger_equals_planner": exact}


def run_window(args: argparse.Namespace) -> dict[str, Any]:
    """SP bytes and step time against the window W and the sequence S (W fixed, S growing):
    full causal ring, windowed ring, halo. Run under ``mpirun -n SP``."""
    from mpipar.runtime.mpi_init import MPI

    comm = MPI.COMM_WORLD
    say = print if comm.Get_rank() == 0 else (lambda *a, **k: None)
    if args.quick:
        args.seqs, args.window, args.steps = "256,1024", 64, 2
    seqs = _ints(args.seqs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-window-") as tmp:
        tmp = comm.bcast(tmp)
        for seq in seqs:
            data = os.path.join(tmp, f"tokens_{seq}.npy")
            if comm.Get_rank() == 0:
                np.save(data, np.random.default_rng(0).integers(0, 256, size=(4, seq + 1)))
            comm.Barrier()
            for mode, window in (("ring", 0), ("ring", args.window), ("halo", args.window)):
                rows.append(measure_window_step(mode, window, seq, args, data, comm))
        comm.Barrier()
    say(f"window: sp={comm.Get_size()}, W={args.window}, layers={args.layers} "
        f"hidden={args.hidden} heads={args.heads}/{args.kv_heads}, float32, one sequence per step")
    say(f"{'mode':>6} {'W':>5} {'S':>6} {'SP MiB/rank':>12} {'step s':>8} {'vs full ring':>13}"
        f" {'ledger=planner':>15}")
    for r in rows:
        base = next(b for b in rows if b["seq"] == r["seq"] and b["window"] == 0)
        say(f"{r['mode']:>6} {r['window']:>5} {r['seq']:>6} {r['sp_bytes'] / 2**20:>12.3f} "
            f"{r['step_s']:>8.3f} {r['step_s'] / base['step_s']:>13.2f} "
            f"{str(r['ledger_equals_planner']):>15}")
    return {"rows": rows}


def _configure_window(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window", type=int, default=256, help="sliding window W")
    parser.add_argument("--seqs", default="1024,4096", help="comma list of sequence lengths")
    parser.add_argument("--steps", type=int, default=4, help="steps per case (the first is "
                        "not timed)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)


register("window", run_window, "sliding-window attention over SP (under mpirun -n SP): bytes "
         "and step time of the full ring, the windowed ring and the halo exchange against S",
         _configure_window)


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
    from mpipar.runtime.mpi_init import MPI
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


def codec_work(dtype: str, repeats: int) -> tuple[float, float]:
    """Seconds per element of a rank's int8 and top-k (1%) encode and decode work (the fastest
    of ``repeats``, :func:`mpipar.parallel.compression.local_work_seconds`) while every rank
    runs it."""
    from mpipar.parallel.compression import Int8Codec, TopKCodec, local_work_seconds
    return (local_work_seconds(Int8Codec(np), dtype=dtype, repeats=repeats),
            local_work_seconds(TopKCodec(np, 0.01), dtype=dtype, repeats=repeats))


def run_comm(args: argparse.Namespace) -> dict[str, Any]:
    """Links inside a node and across nodes, compute speed and per-op overhead of every rank,
    measured with all ranks busy at once; rank 0 prints them and writes the hardware file."""
    from mpipar.runtime.mpi_init import MPI

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
    for c in (across, node):
        c.Free()
    if rank != 0:
        return {}
    hw = Hardware.from_links(min(peaks), statistics.median(overheads), min(rates), links,
                             on_node, node_count, tuple(max(c[i] for c in codecs) for i in (0, 1)))
    print(f"comm: {comm.Get_size()} ranks on {node_count} node(s) x {on_node}; {args.dtype} GEMM "
          f"{args.gemm}^3 {min(peaks) / 1e9:.2f} GFLOP/s per rank (slowest; all ranks at once), "
          f"op overhead {statistics.median(overheads) * 1e6:.1f} us (median rank), in-place "
          f"pass {min(rates) / 1e6:.0f} M elements/s (slowest), compression work "
          f"{hw.int8_seconds * 1e9:.2f} ns (int8), {hw.topk_seconds * 1e9:.2f} ns (top-k 1%) per "
          f"element (slowest)")
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
    from mpipar.plan.step_time import Hardware, predict_step_time

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
# train section: mpipar against PyTorch eager, each peer a child process serving steps on request
# ----------------------------------------------------------------------------------------------

REPLY = "@bench "  # prefix of a serving child's answer lines (any other output is ignored)
COMMANDS = ("quit", "step", "profile")


def train_config(args: argparse.Namespace, world: int, run_dir: str) -> Any:
    """The resolved mpipar Config of the benchmarked model (pure data parallelism over `world`)."""
    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig

    return validate(Config(
        ModelConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    kv_heads=args.kv_heads, ffn_hidden=args.ffn),
        ParallelConfig(),
        TrainConfig(steps=1000, seq_len=args.seq, global_batch_size=args.batch, dtype="float32",
                    backend=args.backend, run_dir=run_dir, log_every=0),
    ), world)


class MpiparPeer:
    """mpipar's training step on MPI.COMM_WORLD (one rank, or data parallel under mpirun)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import numba
        from mpipar.runtime.mpi_init import MPI

        from mpipar.runtime.peak import measure_peak_flops
        from mpipar.training.engine import Engine
        from mpipar.plan.flops import model_flops_per_step

        self.comm = MPI.COMM_WORLD
        self.rank0 = self.comm.Get_rank() == 0
        self.tmp = tempfile.TemporaryDirectory(prefix="mpipar-bench-train-")
        cfg = train_config(args, self.comm.Get_size(), self.tmp.name)
        self.engine = Engine(cfg, self.comm)
        self.steps = 0
        self.info = {"ranks": self.comm.Get_size(), "threads": numba.get_num_threads(),
                     "peak_flops_per_rank": measure_peak_flops("float32"),
                     "flops_per_step": model_flops_per_step(cfg), "tokens_per_step": args.batch * args.seq,
                     "kernels": self.engine.kernels.describe()}

    def command(self) -> str:
        """The next command, read by rank 0 and sent to every rank; other ranks wait without
        spinning (a busy MPI wait would take a core from the peer being timed meanwhile)."""
        code = np.array([COMMANDS.index(_read_command()) if self.rank0 else 0])
        if self.comm.Get_size() > 1:
            req = self.comm.Ibcast(code, root=0)
            while not req.Test():
                time.sleep(0.002)
        return COMMANDS[int(code[0])]

    def step(self) -> tuple[float, float]:
        """(wall, CPU) seconds of one training step (CPU: this rank's process, all its threads)."""
        start, cpu = time.perf_counter(), time.process_time()
        self.engine.train_step(self.steps)
        self.steps += 1
        return time.perf_counter() - start, time.process_time() - cpu

    def profile(self) -> dict[str, float]:
        """Seconds per kernel op (cumulative time of the ops in kernels.OPS), the optimizer and
        the rest, of one step run under cProfile (whose overhead the step then includes)."""
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        total = self.step()[0]
        prof.disable()
        kernel_dir = os.path.dirname(os.path.abspath(kernels.__file__))
        parts: dict[str, float] = {}
        for (path, _, func), (_, _, _, cumulative, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
            if func in kernels.OPS and os.path.abspath(path).startswith(kernel_dir):
                parts[func] = parts.get(func, 0.0) + cumulative
            elif func == "step" and path.endswith(os.path.join("mpipar", "optim.py")):
                parts["optimizer"] = parts.get("optimizer", 0.0) + cumulative
        parts["other"] = total - sum(parts.values())
        parts["step"] = total
        return parts

    def reply(self, message: dict[str, Any]) -> None:
        if self.rank0:
            print(REPLY + json.dumps(message), flush=True)

    def close(self) -> None:
        self.engine.close()
        self.tmp.cleanup()


class TorchTrainer:
    """The same model in PyTorch eager as a new user writes it: transformers' LlamaForCausalLM
    (attn_implementation="sdpa"), float32, torch.optim.AdamW with mpipar's defaults (no weight
    decay on 1-D weights), gradient clipping to norm 1, and mpipar's batches; DDP (gloo) when
    world > 1, each rank on its slice of the global batch."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, init_file: str) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from mpipar.config import TrainConfig
        from mpipar.data.sources import Sampler, load_tokens

        self.torch = torch
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        if world > 1:
            torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                                 world_size=world)
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                          rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                          attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg).train()
        self.model = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
        tr = TrainConfig()
        params = list(model.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": tr.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=tr.lr, betas=(tr.beta1, tr.beta2), eps=tr.eps)
        self.clip = tr.clip_grad
        self.sampler = Sampler(load_tokens(None, args.vocab, args.seq), args.batch, tr.seed, tr.shuffle)
        per = args.batch // world
        self.rows = slice(rank * per, (rank + 1) * per)
        self.vocab = args.vocab
        self.steps = 0

    def step(self) -> tuple[float, float]:
        """(wall, CPU) seconds of one training step, like :meth:`MpiparPeer.step`."""
        torch = self.torch
        start, cpu = time.perf_counter(), time.process_time()
        inputs, targets = self.sampler.batch(self.steps, self.rows)
        logits = self.model(input_ids=torch.from_numpy(inputs)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab), torch.from_numpy(targets).reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.steps += 1
        return time.perf_counter() - start, time.process_time() - cpu


def _torch_rank(rank: int, world: int, init_file: str, options: dict[str, Any]) -> None:
    """Entry of DDP ranks 1..world-1: run a step whenever rank 0 broadcasts one."""
    trainer = TorchTrainer(argparse.Namespace(**options), rank, world, init_file)
    while True:
        command = [None]
        trainer.torch.distributed.broadcast_object_list(command, src=0)
        if command[0] != "step":
            break
        trainer.step()


class TorchPeer:
    """PyTorch's training step: this process is rank 0; DDP ranks 1.. are processes it spawns."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch.multiprocessing as mp

        self.tmp = tempfile.TemporaryDirectory(prefix="mpipar-bench-ddp-")
        init_file = os.path.join(self.tmp.name, "init")
        self.world = args.world
        ctx = mp.get_context("spawn")
        self.others = [ctx.Process(target=_torch_rank, args=(r, self.world, init_file, vars(args)))
                       for r in range(1, self.world)]
        for proc in self.others:
            proc.start()
        self.trainer = TorchTrainer(args, 0, self.world, init_file)
        self.info = {"ranks": self.world, "threads": self.trainer.torch.get_num_threads(),
                     "torch": self.trainer.torch.__version__}

    def command(self) -> str:
        command = _read_command()
        if self.world > 1:
            self.trainer.torch.distributed.broadcast_object_list([command], src=0)
        return command

    def step(self) -> tuple[float, float]:
        return self.trainer.step()

    def reply(self, message: dict[str, Any]) -> None:
        print(REPLY + json.dumps(message), flush=True)

    def close(self) -> None:
        for proc in self.others:
            proc.join(timeout=60)
        self.tmp.cleanup()


def _read_command() -> str:
    line = sys.stdin.readline().strip()
    return line if line in COMMANDS else "quit"  # end of input: quit


def serve(args: argparse.Namespace) -> None:
    """Child mode (--serve PEER): build the peer, answer "ready", then one answer per command."""
    peer = MpiparPeer(args) if args.serve == "mpipar" else TorchPeer(args)
    peer.reply({"ready": True, **peer.info})
    while (command := peer.command()) != "quit":
        if command == "step":
            wall, cpu = peer.step()
            peer.reply({"seconds": wall, "cpu_seconds": cpu})
        else:
            peer.reply({"breakdown": peer.profile()})
    peer.close()


class Server:
    """A serving child process (`python -m mpipar.bench train --serve ...`) with `threads` threads."""

    def __init__(self, name: str, argv: list[str], threads: int, launcher: tuple[str, ...] = ()) -> None:
        from mpipar.runtime.nodes import THREAD_VARS

        self.name = name
        env = dict(os.environ, **{var: str(threads) for var in THREAD_VARS})
        self.errors = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([*launcher, sys.executable, "-m", "mpipar.bench", "train", *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
                                     text=True, bufsize=1, env=env)
        self.info = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        self.errors.seek(0)
        raise RuntimeError(f"bench train peer {self.name} ended (status {self.proc.wait()}):\n"
                           f"{self.errors.read()[-4000:]}")

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.errors.close()


def race(servers: list[Server], warmup: int, steps: int) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each server's steps: `warmup` untimed steps each, then `steps`
    rounds in which every server runs one step in turn (the order reversed every round)."""
    for _ in range(warmup):
        for server in servers:
            server.ask("step")
    times: dict[str, list[tuple[float, float]]] = {s.name: [] for s in servers}
    for k in range(steps):
        for server in servers if k % 2 == 0 else reversed(servers):
            answer = server.ask("step")
            times[server.name].append((answer["seconds"], answer["cpu_seconds"]))
    return times


def torch_missing() -> str | None:
    """None if the PyTorch peer can run here, else why not."""
    import importlib.util

    for module in ("torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not importable (pip install torch==2.13.0 transformers)"
    return None


def _model_argv(args: argparse.Namespace) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "backend")]


def _mpirun() -> str | None:
    """The mpirun beside this Python (the [mpich] extra), else the one on PATH."""
    import shutil

    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


def run_comparison(label: str, servers: list[Server], args: argparse.Namespace) -> dict[str, Any]:
    """Race the servers; tokens/s (median step) and MFU against mpipar's GEMM probe per rank."""
    try:
        times = race(servers, args.warmup, args.steps)
        breakdown = servers[0].ask("profile")["breakdown"] if args.breakdown else None
    finally:
        for server in servers:
            server.close()
    info = servers[0].info
    peak = info["peak_flops_per_rank"] * info["ranks"]
    row: dict[str, Any] = {"label": label, "threads": info["threads"], "ranks": info["ranks"],
                           "peak_flops": peak, "flops_per_step": info["flops_per_step"], "breakdown": breakdown}
    for server in servers:
        wall, cpu = ([t[i] for t in times[server.name]] for i in (0, 1))
        step, cpu_step = statistics.median(wall), statistics.median(cpu)
        row[server.name] = {"step_s": wall, "median_step_s": step, "cpu_step_s": cpu,
                            "median_cpu_step_s": cpu_step, "tokens_per_s": info["tokens_per_step"] / step,
                            "tokens_per_cpu_s": info["tokens_per_step"] / cpu_step,
                            "mfu": info["flops_per_step"] / step / peak, "info": server.info}
    return row


def run_train(args: argparse.Namespace) -> dict[str, Any]:
    """mpipar against PyTorch eager, one comparison per thread count, then dp=2 against DDP."""
    if args.serve:
        serve(args)
        return {}
    if args.quick:
        args.steps, args.warmup = min(args.steps, 2), 1
    model = _model_argv(args)
    why_not = torch_missing()
    notes = [] if why_not is None else [f"PyTorch peer skipped: {why_not}"]
    print(f"train: Llama hidden {args.hidden}, {args.layers} layers, heads {args.heads}/{args.kv_heads}, "
          f"ffn {args.ffn}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}, float32; "
          f"{args.warmup} warm-up + {args.steps} timed steps per peer, interleaved; cores={_cpu_count()}")
    rows = []
    for t in thread_counts(args.threads):
        servers = [Server("mpipar", ["--serve", "mpipar", *model], t)]
        if why_not is None:
            servers.append(Server("torch", ["--serve", "torch", "--world", "1", *model], t))
        rows.append(run_comparison(f"{t} thread(s), 1 rank", servers, args))
    mpirun = _mpirun()
    if args.dp2 and (mpirun is None or args.batch % 2):
        notes.append("dp=2 skipped: " + ("no mpirun found" if mpirun is None else f"batch {args.batch} is odd"))
    elif args.dp2:
        servers = [Server("mpipar", ["--serve", "mpipar", *model], 1, (mpirun, "-n", "2"))]
        if why_not is None:
            servers.append(Server("torch", ["--serve", "torch", "--world", "2", *model], 1))
        rows.append(run_comparison("dp=2, 1 thread/rank (torch: DDP gloo)", servers, args))
    _print_train(rows, notes)
    return {"model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab",
                                                    "seq", "batch")},
            "rows": rows, "notes": notes}


def _print_train(rows: list[dict[str, Any]], notes: list[str]) -> None:
    header = (f"{'run':<40} {'mpipar tok/s':>13} {'MFU':>6} {'torch tok/s':>12} {'MFU':>6} "
              f"{'mpipar/torch':>13} {'CPU s/step m/t':>15} {'per CPU s':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        m, t = r["mpipar"], r.get("torch")
        line = f"{r['label']:<40} {m['tokens_per_s']:>13.0f} {100 * m['mfu']:>5.1f}%"
        if t is not None:
            line += (f" {t['tokens_per_s']:>12.0f} {100 * t['mfu']:>5.1f}% "
                     f"{m['tokens_per_s'] / t['tokens_per_s']:>12.2f}x "
                     f"{m['median_cpu_step_s']:>7.2f}/{t['median_cpu_step_s']:<7.2f} "
                     f"{t['median_cpu_step_s'] / m['median_cpu_step_s']:>9.2f}x")
        print(line)
    print("tok/s from the median step; MFU = model FLOPs/step (mpipar.plan.cost.model_flops_per_step, the same "
          "for both) / step time / the GEMM probe of the same threads x ranks; CPU s/step: median CPU "
          "time of rank 0's process (all its threads), per CPU s = torch/mpipar CPU time of a step (on a "
          "machine shared with other work, the 1-thread rows' fairest ratio)")
    for note in notes:
        print(note)
    for r in rows:
        parts = r["breakdown"]
        if not parts:
            continue
        print(f"\nmpipar per-op time, {r['label']}, one step under cProfile ({parts['step'] * 1e3:.0f} ms):")
        for op, sec in sorted(((k, v) for k, v in parts.items() if k != "step"), key=lambda kv: -kv[1]):
            print(f"  {op:<22} {sec * 1e3:>9.1f} ms {100 * sec / parts['step']:>6.1f}%")


def _configure_train(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", default="", help="comma list of thread counts for the 1-rank comparison "
                        "(default: 1 and all cores)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per peer (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per peer first")
    parser.add_argument("--no-dp2", dest="dp2", action="store_false",
                        help="skip the dp=2 comparison (mpirun -n 2 against DDP)")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                        help="skip mpipar's per-op profile step")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--backend", default="numba", choices=("numba", "numpy"), help="mpipar's kernels")
    parser.add_argument("--serve", choices=("mpipar", "torch"), help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)  # torch child: DDP ranks


register("train", run_train, "a training step of mpipar against PyTorch eager, same model and threads",
         _configure_train)
def _run_gpu(args: argparse.Namespace) -> dict[str, Any]:
    from mpipar.bench import gpu as bench_gpu
    return bench_gpu.run(args)


def _configure_gpu(parser: argparse.ArgumentParser) -> None:
    from mpipar.bench import gpu as bench_gpu
    bench_gpu.configure(parser)


register("gpu", _run_gpu, "on a CUDA device: flash attention TFLOP/s against the GEMM of equal "
         "FLOPs; tokens/s and MFU of a 350M Llama against PyTorch eager (skipped without one)",
         _configure_gpu)


# ----------------------------------------------------------------------------------------------
# compression section
# ----------------------------------------------------------------------------------------------

COMPRESSION_VARIANTS = {
    "none": [],
    "int8": ["--grad-compression", "int8"],
    "int8-noef": ["--grad-compression", "int8", "--error-feedback", "off"],
    "topk": ["--grad-compression", "topk"],
    "topk-noef": ["--grad-compression", "topk", "--error-feedback", "off"],
    "topk-warm": ["--grad-compression", "topk"],
    "topk-warm-noef": ["--grad-compression", "topk", "--error-feedback", "off"],
    "topk-plain": ["--grad-compression", "topk", "--topk-catch-up", "off"],
    "topk-warm-plain": ["--grad-compression", "topk", "--topk-catch-up", "off"],
}
"""Variant name -> its ``python -m mpipar.train`` flags (top-k at --topk-ratio; the ``-warm``
ones after --warmup uncompressed steps; ``-plain``: AdamW without the catch-up, one step on
each arriving sum)."""


def _train_variant(name: str, args: argparse.Namespace, out: str) -> dict[str, Any]:
    """Train one variant under mpirun (the default model and corpus, dp = ranks) and read its
    metrics: losses per step, the final loss (mean of the last ``--last`` steps), the median
    step time after step 1, and rank 0's bytes per step across nodes and in total."""
    run_dir = os.path.join(out, name)
    warm = ["--compression-warmup", str(args.warmup)] if "-warm" in name else []
    flags = [*COMPRESSION_VARIANTS[name], *warm, "--topk-ratio", str(args.topk_ratio),
             "--steps", str(args.steps), "--dp", str(args.ranks), "--run-dir", run_dir,
             "--log-every", "0", "--tensorboard", "off", *args.train_flags.split()]
    if args.ranks_per_node:
        flags += ["--ranks-per-node", str(args.ranks_per_node), "--dp-reduce", args.dp_reduce]
    mpirun = _mpirun()
    if mpirun is None:
        raise SystemExit("compression: no mpirun beside this Python or on PATH")
    cmd = [mpirun, "-n", str(args.ranks), sys.executable, "-m", "mpipar.train", *flags]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=LAUNCH_ENV)
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
        args.steps, args.ranks, args.last, args.warmup = 30, 4, 10, 3
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
             f"top-k ratio {args.topk_ratio:g}, -warm: {args.warmup} steps uncompressed first")
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
    header = (f"{'variant':<14} {'final loss':>10} {'vs none':>8} {'wire bytes/step':>16} "
              f"{'fewer':>7} {'step s':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        fewer = f"{r['bytes_ratio']:.1f}x" if r["bytes_ratio"] else "-"
        print(f"{r['variant']:<14} {r['final_loss']:>10.4f} {100 * r['vs_none']:>+7.2f}% "
              f"{r['wire_bytes']:>16,} {fewer:>7} {r['step_time_s']:>7.3f}")
    print("vs none: final loss relative to no compression; wire bytes: what rank 0 put on the "
          "wire in the last step (all groups); fewer: none's wire bytes over the variant's; "
          "step s: median step time (ranks sharing this machine's cores: not a speed figure)")


def _configure_compression(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", default="none,int8,topk,topk-noef,topk-plain,topk-warm,"
                                               "topk-warm-noef,topk-warm-plain",
                        help=f"comma list of {', '.join(COMPRESSION_VARIANTS)} (none is always "
                             f"run)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=8, help="mpirun -n (dp = ranks)")
    parser.add_argument("--last", type=int, default=20, help="final loss: mean of the last N steps")
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=60,
                        help="the -warm variants: --compression-warmup steps (default 20 %% of "
                             "the 300 steps: with 30, top-k 1 %% ends 8 %% above uncompressed, "
                             "docs/benchmarks.md)")
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
    from mpipar.runtime.mpi_init import MPI

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
