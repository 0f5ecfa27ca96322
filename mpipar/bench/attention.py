"""The kernels section's attention rows: the numba backend's causal attention forward and
backward, GFLOP/s and % of the GEMM probe at long sequences, measured in one child process per
thread count (``python -m mpipar.bench kernels --attention-only``: OMP/OPENBLAS/MKL/NUMBA
thread counts are read once, at import, so each count needs a process of its own).

Arrays: q ``[batch, seq, heads, head_dim]``, k and v ``[batch, seq, heads // 2, head_dim]``.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

from mpipar import kernels
from mpipar.model.flops import attention_flops
from mpipar.bench.harness import best_seconds, ints, print_header, run_child, thread_counts


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
        for d in ints(args.attn_head_dims):
            for s in ints(args.attn_seqs):
                q = rng.standard_normal((b, s, hq, d)).astype(dtype)
                k, v = (rng.standard_normal((b, s, max(1, hq // 2), d)).astype(dtype) for _ in range(2))
                out, lse = backend.attention_fwd(q, k, v)
                dout = rng.standard_normal(q.shape).astype(dtype)
                fwd_s, fwd_cpu = best_seconds(lambda: backend.attention_fwd(q, k, v), args.attn_repeats)
                bwd_s, bwd_cpu = best_seconds(lambda: backend.attention_bwd(q, k, v, out, lse, dout),
                                              args.attn_repeats)
                fwd_flops, bwd_flops = attention_flops(b, s, s, hq, d, causal=True)
                rows.append({"dtype": dtype.name, "head_dim": d, "seq": s, "batch": b, "heads": hq,
                             "kv_heads": k.shape[2], "threads": numba.get_num_threads(),
                             "fwd_s": fwd_s, "bwd_s": bwd_s, "fwd_gflops": fwd_flops / fwd_s / 1e9,
                             "bwd_gflops": bwd_flops / bwd_s / 1e9,
                             "probe_gflops": measure_peak_flops(dtype.name) / 1e9,
                             "fwd_cpu_s": fwd_cpu, "bwd_cpu_s": bwd_cpu,
                             "fwd_cpu_pct_probe": 100 * fwd_flops / fwd_cpu / cpu_probe_flops(dtype),
                             "bwd_cpu_pct_probe": 100 * bwd_flops / bwd_cpu / cpu_probe_flops(dtype)})
    return rows


def attention_by_threads(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The attention rows measured in one child per thread count, the children alternating for
    --attn-rounds rounds; each row keeps its fastest round. Prints the table."""
    if not ints(args.attn_seqs) or kernels.available_backends()["numba"] is not None:
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
    """The attention table; adds each row's % of the probe (``fwd_pct_probe``, ``bwd_pct_probe``)."""
    if not rows:
        return
    r0 = rows[0]
    print(f"\nattention (numba backend), causal, batch {r0['batch']}, heads {r0['heads']}/{r0['kv_heads']}: "
          "GFLOP/s and % of the GEMM probe (mpipar.runtime.peak.measure_peak_flops, same threads, measured "
          "beside each row); FLOPs per head: forward half of 4 S^2 D, backward 2.5x forward")
    header = (f"{'dtype':<8} {'D':>4} {'seq':>6} {'thr':>4} {'fwd ms':>9} {'GFLOP/s':>8} {'%probe':>7} "
              f"{'bwd ms':>9} {'GFLOP/s':>8} {'%probe':>7} {'probe':>7} {'vs 1 thread':>12} {'CPU %probe':>11}")
    print_header(header)
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

