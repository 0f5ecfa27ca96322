"""Attention throughput on a CUDA device: each bf16 attention backend mpipar has — its own flash
attention (`flash_mma`) and cuDNN's fused attention (`cudnn_attention`, where its frontend
imports) — forward and backward in TFLOP/s, beside a cuBLAS bf16 GEMM of equal FLOPs
(`cupy.matmul` on 2-D bf16, i.e. gemmEx with float32 compute) and, where torch imports with
CUDA, torch's `scaled_dot_product_attention` on its flash backend, on the same shapes.

FLOPs (:func:`mpipar.model.flops.attention_flops`): forward 4 * B * H * S^2 * D (two GEMMs),
halved when causal; backward 2.5 times the forward (five GEMMs against two), whatever each
implementation actually executes (flash_mma's two-pass backward recomputes S and dP: 7 GEMM
passes). Timing: CUDA events around a few back-to-back calls, after warm-up calls, the median
of `repeats`.

Shapes: B * S = `tokens` (16k) for S in 2048..16384; hidden 2048: 32 heads of 64, 16 of 128.
Called as `run()` (returns the rows, prints a table) by `python -m mpipar.bench gpu`, or
`python -m mpipar.bench.gpu_attention`. :func:`cudnn_rates` times cuDNN's attention alone.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

from mpipar.model.flops import attention_flops

SEQS = (2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS = 16384
HIDDEN = 2048


def median_ms(fn: Callable[[], Any], warmup: int = 3, repeats: int = 10, inner: int = 4,
              event: Callable[[], Any] | None = None) -> float:
    """Median milliseconds per call of `fn()`: `repeats` times, `inner` back-to-back calls
    between two CUDA events (CuPy's, or `event()`'s: torch's), so the host's launch work overlaps
    the device's as in training; after `warmup` untimed calls."""
    import cupy

    make = event or cupy.cuda.Event
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = make(), make()
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        ms = start.elapsed_time(stop) if event else cupy.cuda.get_elapsed_time(start, stop)
        times.append(ms / inner)
    return statistics.median(times)


def gemm_tflops(flops: float, repeats: int = 10) -> float:
    """TFLOP/s of a square bf16 cuBLAS GEMM (cupy.matmul, 2-D) of about `flops` (n a multiple
    of 256)."""
    import cupy
    import ml_dtypes

    n = max(256, int(round((flops / 2) ** (1 / 3) / 256)) * 256)
    a = cupy.random.standard_normal((n, n), cupy.float32).astype(ml_dtypes.bfloat16)
    b = cupy.random.standard_normal((n, n), cupy.float32).astype(ml_dtypes.bfloat16)
    ms = median_ms(lambda: cupy.matmul(a, b), repeats=repeats)
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def mpipar_ms(batch: int, seq: int, heads: int, head_dim: int, causal: bool,
              repeats: int) -> tuple[float, float]:
    """(forward, backward) milliseconds of flash_mma on random bf16 inputs `[B, S, H, D]`."""
    import cupy
    import ml_dtypes

    from mpipar.kernels import flash_mma

    shape = (batch, seq, heads, head_dim)
    q, k, v, do = (cupy.random.standard_normal(shape, cupy.float32).astype(ml_dtypes.bfloat16)
                   for _ in range(4))
    fwd = median_ms(lambda: flash_mma.attention_fwd(q, k, v, causal=causal), repeats=repeats)
    out, lse = flash_mma.attention_fwd(q, k, v, causal=causal)
    bwd = median_ms(lambda: flash_mma.attention_bwd(q, k, v, out, lse, do, causal=causal),
                    repeats=repeats)
    return fwd, bwd


def cudnn_ms(batch: int, seq: int, heads: int, head_dim: int, causal: bool,
             repeats: int) -> tuple[float, float] | None:
    """(forward, backward) milliseconds of cuDNN's fused attention (`cudnn_attention`: whole
    calls as the engine makes them) on random bf16 inputs `[B, S, H, D]`, or None where its
    frontend is missing or refuses the shape."""
    import cupy
    import ml_dtypes

    from mpipar.kernels import cudnn_attention

    if cudnn_attention.frontend_unavailable() is not None:
        return None
    shape = (batch, seq, heads, head_dim)
    q, k, v, do = (cupy.random.standard_normal(shape, cupy.float32).astype(ml_dtypes.bfloat16)
                   for _ in range(4))
    try:
        fwd = median_ms(lambda: cudnn_attention.attention_fwd(q, k, v, causal=causal),
                        repeats=repeats)
        out, lse = cudnn_attention.attention_fwd(q, k, v, causal=causal)
        bwd = median_ms(lambda: cudnn_attention.attention_bwd(q, k, v, out, lse, do,
                                                              causal=causal), repeats=repeats)
    except cudnn_attention.CudnnRefused:
        return None
    return fwd, bwd


def torch_ms(batch: int, seq: int, heads: int, head_dim: int, causal: bool,
             repeats: int) -> tuple[float, float] | None:
    """(forward, backward) milliseconds of torch SDPA's flash backend on `[B, S, H, D]` inputs
    viewed as `[B, H, S, D]`, or None where torch, its CUDA or that backend is missing."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    shape = (batch, seq, heads, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fwd = median_ms(lambda: sdpa(q, k, v, is_causal=causal), repeats=repeats, event=event)
            out = sdpa(q, k, v, is_causal=causal)
            bwd = median_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                            repeats=repeats, event=event)
    except RuntimeError:  # the flash backend refuses this device or shape
        return None
    return fwd, bwd


def _row(seq: int, head_dim: int, tokens: int, causal: bool, repeats: int,
         with_torch: bool) -> dict[str, Any]:
    heads = HIDDEN // head_dim
    batch = max(1, tokens // seq)
    f_flops, b_flops = attention_flops(batch, seq, seq, heads, head_dim, causal)
    fwd, bwd = mpipar_ms(batch, seq, heads, head_dim, causal, repeats)
    gemm = gemm_tflops(f_flops, repeats)
    row = {"seq": seq, "batch": batch, "heads": heads, "head_dim": head_dim, "causal": causal,
           "fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": f_flops / (fwd * 1e9),
           "bwd_tflops": b_flops / (bwd * 1e9), "gemm_tflops": gemm}
    row["fwd_vs_gemm"] = row["fwd_tflops"] / gemm
    dnn = cudnn_ms(batch, seq, heads, head_dim, causal, repeats)
    row["cudnn_fwd_tflops"] = f_flops / (dnn[0] * 1e9) if dnn else None
    row["cudnn_bwd_tflops"] = b_flops / (dnn[1] * 1e9) if dnn else None
    row["best_fwd_vs_gemm"] = max(row["fwd_tflops"], row["cudnn_fwd_tflops"] or 0.0) / gemm
    theirs = torch_ms(batch, seq, heads, head_dim, causal, repeats) if with_torch else None
    row["torch_fwd_tflops"] = f_flops / (theirs[0] * 1e9) if theirs else None
    row["torch_bwd_tflops"] = b_flops / (theirs[1] * 1e9) if theirs else None
    return row


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width text table (TFLOP/s; '-' where torch was not measured)."""
    head = (f"{'D':>4} {'S':>6} {'B':>3} {'H':>3} {'fwd ms':>8} {'fwd TF/s':>9} {'bwd ms':>8} "
            f"{'bwd TF/s':>9} {'GEMM TF/s':>10} {'fwd/GEMM':>9} {'cuDNN fwd':>10} {'cuDNN bwd':>10} "
            f"{'best/GEMM':>10} {'torch fwd':>10} {'torch bwd':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        tf = (lambda x: f"{x:10.1f}" if x is not None else f"{'-':>10}")
        lines.append(f"{r['head_dim']:>4} {r['seq']:>6} {r['batch']:>3} {r['heads']:>3} "
                     f"{r['fwd_ms']:8.3f} {r['fwd_tflops']:9.1f} {r['bwd_ms']:8.3f} "
                     f"{r['bwd_tflops']:9.1f} {r['gemm_tflops']:10.1f} {r['fwd_vs_gemm']:9.1%} "
                     f"{tf(r['cudnn_fwd_tflops'])} {tf(r['cudnn_bwd_tflops'])} "
                     f"{r['best_fwd_vs_gemm']:10.1%} "
                     f"{tf(r['torch_fwd_tflops'])} {tf(r['torch_bwd_tflops'])}")
    return "\n".join(lines)


def run(seqs: tuple[int, ...] = SEQS, head_dims: tuple[int, ...] = HEAD_DIMS,
        tokens: int = TOKENS, causal: bool = True, repeats: int = 10, with_torch: bool = True,
        printer: Callable[[str], Any] | None = print) -> list[dict[str, Any]]:
    """Benchmark every (head dim, seq); returns one dict per shape (keys: seq, batch, heads,
    head_dim, causal, fwd_ms, bwd_ms, fwd_tflops, bwd_tflops, gemm_tflops, fwd_vs_gemm,
    cudnn_fwd_tflops, cudnn_bwd_tflops, best_fwd_vs_gemm, torch_fwd_tflops, torch_bwd_tflops)
    and prints the table through `printer`."""
    rows = [_row(s, d, tokens, causal, repeats, with_torch) for d in head_dims for s in seqs]
    if printer:
        printer(format_table(rows))
    return rows


def cudnn_rates(seq: int = 4096, batch: int = 1, heads: int = 32, kv_heads: int = 8,
                head_dim: int = 128, causal: bool = True, repeats: int = 10,
                warmup: int = 3) -> dict[str, float]:
    """Time cuDNN's attention_fwd and attention_bwd (whole calls as the engine makes them:
    allocation, cuDNN, and the backward's bf16 -> float32 widening; CUDA events around each
    call, median of ``repeats``, graphs built beforehand) on random bf16 inputs: {"fwd_ms",
    "bwd_ms", "fwd_tflops", "bwd_tflops"}. Needs a device. Measured on an H100 80GB HBM3
    (cuDNN 9.19.0, frontend 1.23.0; Hq 32, Hkv 8, D 128, causal): seq 4096 x batch 4 fwd 550 /
    bwd 350 TFLOP/s, seq 8192 x batch 2 fwd 608 / bwd 436."""
    import cupy
    import ml_dtypes

    from mpipar.kernels import cudnn_attention as ca

    def random(shape: tuple[int, ...]) -> Any:
        return cupy.random.standard_normal(shape, cupy.float32).astype(ml_dtypes.bfloat16)

    q, dout = random((batch, seq, heads, head_dim)), random((batch, seq, heads, head_dim))
    k, v = random((batch, seq, kv_heads, head_dim)), random((batch, seq, kv_heads, head_dim))
    out, lse = ca.attention_fwd(q, k, v, causal=causal)
    fwd_ms = median_ms(lambda: ca.attention_fwd(q, k, v, causal=causal), warmup, repeats, 1)
    bwd_ms = median_ms(lambda: ca.attention_bwd(q, k, v, out, lse, dout, causal=causal),
                       warmup, repeats, 1)
    fwd, bwd = attention_flops(batch, seq, seq, heads, head_dim, causal)
    return {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_tflops": fwd / fwd_ms / 1e9,
            "bwd_tflops": bwd / bwd_ms / 1e9}


if __name__ == "__main__":
    run()
