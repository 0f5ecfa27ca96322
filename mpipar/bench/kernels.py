"""``python -m mpipar.bench kernels``: every kernel op for every available backend, side by side,
float32 and float64; the fused kernels against the ops they replace; then the attention rows
(:mod:`mpipar.bench.attention`: GFLOP/s and % of the GEMM probe, one child per thread count).

Shapes: a small Llama-like model (:class:`KernelShape`), tokens = batch x seq.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mpipar import kernels
from mpipar.bench.attention import attention_by_threads, measure_attention
from mpipar.bench.harness import Section, print_header, time_call
from mpipar.kernels import numpy_ref


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
        "geglu_fwd": (rand(b, s, ffn), rand(b, s, ffn)),
        "geglu_bwd": (rand(b, s, ffn), rand(b, s, ffn), rand(b, s, ffn)),
        "attention_fwd": (q, k, v),
        "attention_bwd": (q, k, v, out, lse, rand(b, s, hq, d)),
        "attention_merge": (rand(b, s, hq, d), rand(b, hq, s).astype(lse_dtype),
                            rand(b, s, hq, d), rand(b, hq, s).astype(lse_dtype)),
        "cross_entropy_stats": (logits, targets),
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every op of every requested, available backend; print one table per run; then the
    fused kernels against their unfused ops and the attention rows (one child per thread count)."""
    if args.attention_only:  # a child of attention_by_threads: this process's thread count
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
    """`` numba_threads=N`` for the header line, or nothing without numba."""
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
    print_header(header)
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


def configure(parser: argparse.ArgumentParser) -> None:
    """The kernels section's options: backends, dtypes, the op shapes and the attention rows."""
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


SECTION = Section("kernels", run, "time every kernel op for each available backend", configure)
