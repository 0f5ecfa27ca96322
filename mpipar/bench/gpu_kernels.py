"""``python -m mpipar.bench gpu --kernels``: the device's two ceilings and the bf16 training
step's kernels one by one at the 1.1B model's shapes (16k tokens, hidden 2048, FFN 5632, 32
heads of 64, 4 kv heads, vocabulary 32000): median device time of each
(``cupyx.profiler.benchmark``), achieved bandwidth against the fewest bytes the op must move,
or TFLOP/s for the GEMMs and attention. What a profile row should be compared with.

- ceilings: a 1 GiB device copy (bytes read + written) and a cuBLAS bf16 GEMM 8192^3;
- the linears' GEMMs: forward, input gradient, weight gradient into float32 (beta = 1);
- the fused row and elementwise kernels (RMSNorm, RoPE, SwiGLU), the column cuts and joins;
- cuDNN attention forward and backward (GQA, causal), when the frontend imports;
- the optimizer's passes over a 1.1B model's float32 gradients: the norm and AdamW.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

T, H, F, HQ, HKV, D, V = 16384, 2048, 5632, 32, 4, 64, 32000
"""bench.gpu's 1.1B model at its tokens a step (tests/unit/test_gpu_check.py holds them equal;
not imported from there: bench.gpu imports this module)."""


def run() -> list[dict[str, Any]]:
    """Every row, printed as it is measured and returned: name, ms, and TB/s or TFLOP/s."""
    import cupy
    import ml_dtypes
    from cupyx.profiler import benchmark

    from mpipar.kernels import cublas, cuda_fused as cf, cuda_moves as cm
    rows: list[dict[str, Any]] = []
    rng = cupy.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def bf(*shape: int) -> Any:
        return rng.standard_normal(shape, dtype=cupy.float32).astype(bf16)

    def row(name: str, fn: Callable[[], Any], nbytes: float = 0.0, flops: float = 0.0,
            repeat: int = 20) -> None:
        ms = float(np.median(benchmark(fn, n_repeat=repeat, n_warmup=3).gpu_times[0])) * 1e3
        out: dict[str, Any] = {"name": name, "ms": ms}
        text = f"kernels {name:44s} {ms:8.3f} ms"
        if nbytes:
            out["tb_per_s"] = nbytes / ms / 1e9
            text += f"  {out['tb_per_s']:6.2f} TB/s"
        if flops:
            out["tflop_per_s"] = flops / ms / 1e9
            text += f"  {out['tflop_per_s']:6.1f} TFLOP/s"
        print(text, flush=True)
        rows.append(out)

    _ceilings(row, bf, cublas)
    _gemms(row, bf, cublas)
    _fused(row, bf, cf, cm)
    _attention(row, bf)
    _optimizer(row, rng)
    return rows


def _ceilings(row: Callable, bf: Callable, cublas: Any) -> None:
    import cupy
    big = cupy.empty(2**29, np.dtype("uint16"))
    copy = cupy.empty_like(big)
    row("copy 1 GiB", lambda: copy.__setitem__(Ellipsis, big), nbytes=2 * big.nbytes)
    a, b = bf(8192, 8192), bf(8192, 8192)
    row("GEMM 8192^3", lambda: cublas.matmul(a, b), flops=2 * 8192**3)


def _gemms(row: Callable, bf: Callable, cublas: Any) -> None:
    import cupy
    for name, out, k in (("qkv", (HQ + 2 * HKV) * D, H), ("o", H, H), ("gate_up", 2 * F, H),
                         ("down", H, F), ("head", V, H)):
        x, w, dy = bf(T, k), bf(out, k), bf(T, out)
        dw = cupy.zeros((out, k), np.float32)
        flops = 2 * T * out * k
        row(f"GEMM {name} forward", lambda: cublas.matmul(x, w, trans_b=True), flops=flops)
        row(f"GEMM {name} input gradient", lambda: cublas.matmul(dy, w), flops=flops)
        row(f"GEMM {name} weight gradient (float32, beta 1)",
            lambda: cublas.matmul(dy, x, trans_a=True, out=dw, beta=1.0), flops=flops)


def _fused(row: Callable, bf: Callable, cf: Any, cm: Any) -> None:
    import cupy
    x, r, dy, ds, w = bf(T, H), bf(T, H), bf(T, H), bf(T, H), bf(H)
    act = T * H * 2
    row("rmsnorm_fwd", lambda: cf.rmsnorm_fwd(x, w, 1e-5), nbytes=2 * act)
    row("add_rmsnorm_fwd", lambda: cf.add_rmsnorm_fwd(x, r, w, 1e-5), nbytes=4 * act)
    s, _, rstd = cf.add_rmsnorm_fwd(x, r, w, 1e-5)
    row("add_rmsnorm_bwd", lambda: cf.add_rmsnorm_bwd(dy, ds, s, w, rstd), nbytes=4 * act)
    q = bf(T // 2048, 2048, HQ, D)
    angle = cupy.arange(2048 * D // 2, dtype=cupy.float32).reshape(2048, D // 2) * 1e-3
    cos, sin = cupy.cos(angle), cupy.sin(angle)
    row("rope_fwd (q)", lambda: cf.rope_fwd(q, cos, sin), nbytes=2 * q.nbytes)
    g, u, dh = bf(T, F), bf(T, F), bf(T, F)
    row("swiglu_fwd", lambda: cf.swiglu_fwd(g, u), nbytes=3 * g.nbytes)
    row("swiglu_bwd", lambda: cf.swiglu_bwd(dh, g, u), nbytes=5 * g.nbytes)
    stacked = bf(T, 2 * F)
    row("split_columns (gate/up)", lambda: cm.split_columns(stacked, [F, F]),
        nbytes=2 * stacked.nbytes)
    row("concat (gate/up gradients)", lambda: cm.concat([g, u], axis=-1),
        nbytes=2 * stacked.nbytes)


def _attention(row: Callable, bf: Callable) -> None:
    from mpipar.kernels import cudnn_attention as ca
    if ca.frontend_unavailable() is not None:
        print(f"kernels attention skipped: {ca.frontend_unavailable()}")
        return
    q, k, v, do = bf(8, 2048, HQ, D), bf(8, 2048, HKV, D), bf(8, 2048, HKV, D), bf(8, 2048, HQ, D)
    flops = 4 * 8 * HQ * 2048 * 2048 * D / 2
    out, lse = ca.attention_fwd(q, k, v)
    row("cuDNN attention forward (GQA 32/4, D 64, causal)", lambda: ca.attention_fwd(q, k, v),
        flops=flops)
    row("cuDNN attention backward", lambda: ca.attention_bwd(q, k, v, out, lse, do),
        flops=2.5 * flops)


def _optimizer(row: Callable, rng: Any) -> None:
    import cupy

    from mpipar.training import optim
    shapes = [(V, H), (V, H), (H,)] + 22 * [(HQ * D, H), (HKV * D, H), (HKV * D, H), (H, H),
                                            (F, H), (F, H), (H, F), (H,), (H,)]
    grads = [rng.standard_normal(shape, dtype=cupy.float32) for shape in shapes]
    nbytes = sum(g.nbytes for g in grads)
    row("gradient norm (sum of squares, 201 arrays)", lambda: optim.sum_squares(grads),
        nbytes=nbytes, repeat=5)
    params = [g.copy() for g in grads]
    m, v = [cupy.zeros_like(g) for g in grads], [cupy.ones_like(g) for g in grads]
    row("AdamW, fused, clipped (201 arrays)",
        lambda: [optim.adamw_update(p, g, mm, vv, 3, 1e-4, 0.9, 0.95, 1e-8, 0.1, 0.5)
                 for p, g, mm, vv in zip(params, grads, m, v)], nbytes=7 * nbytes, repeat=5)
