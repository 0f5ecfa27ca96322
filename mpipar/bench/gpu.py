"""``python -m mpipar.bench gpu``: the GPU engine on one CUDA device.

- kernels: flash attention forward and backward TFLOP/s (causal, one sequence of ``--seq``
  tokens, 16 heads of 128) against a cuBLAS GEMM of equal FLOPs, float32;
- train: tokens/s and MFU of training steps of a Llama of about 350M parameters (hidden 1024,
  24 layers, vocabulary 32000) at ``--seq`` tokens on this device, and the same model in
  PyTorch eager (transformers, sdpa, AdamW) side by side when torch with CUDA is importable.
  float32: ``--dtype bfloat16`` is not built yet (the configuration refuses it).

Without a CUDA device the section prints why and returns ``{"skipped": reason}``. Timings use
CUDA events after warm-up; the figures are measured here, never assumed.

``python -m mpipar.bench gpu --static [--arch sm_80,sm_90] [--json FILE]`` runs no benchmark
but the compile gate (:mod:`mpipar.kernels.cuda_gate`: every CUDA source compiled through NVRTC
for each architecture, no device needed), with the gate's table, JSON and exit status.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from mpipar.bench.harness import Section
from mpipar.rules import validate

MODEL_350M = dict(vocab_size=32000, hidden=1024, layers=24, heads=16, kv_heads=16,
                  ffn_hidden=2816)


def configure(parser: argparse.ArgumentParser) -> None:
    """The gpu section's options: sequence length and steps; --static and --arch for the gate."""
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--static", action="store_true",
                        help="no benchmark: the NVRTC compile gate of every CUDA kernel "
                             "(python -m mpipar.kernels.cuda_gate; --json FILE gets its report)")
    parser.add_argument("--arch", metavar="ARCHS",
                        help="--static: comma-separated architectures (default: the gate's, "
                             "sm_80,sm_90)")


def compile_gate(args: argparse.Namespace) -> int:
    """``--static``: the compile gate's status (0 every kernel passes, 1 one fails, 2 no CuPy or
    NVRTC), its table printed and its report written to ``--json``."""
    from mpipar.kernels import cuda_gate

    argv = (["--arch", args.arch] if args.arch else []) + (["--json", args.json] if args.json else [])
    return cuda_gate.main(argv)


def _gpu_seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median device seconds of ``fn`` (CUDA events), after two warm-up calls."""
    import cupy
    fn(), fn()
    times = []
    for _ in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return sorted(times)[len(times) // 2]


def attention_rates(seq: int, heads: int = 16, head_dim: int = 128) -> dict[str, float]:
    """TFLOP/s of flash attention forward and backward (causal: half the S x S products) and
    of a square cuBLAS GEMM with the forward's FLOPs."""
    import cupy
    from mpipar.kernels import cupy_gpu
    rng = cupy.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, seq, heads, head_dim), dtype=cupy.float32)
                     for _ in range(4))
    out, lse = cupy_gpu.attention_fwd(q, k, v)
    fwd_flops = 2 * 2 * heads * seq * seq * head_dim / 2
    t_fwd = _gpu_seconds(lambda: cupy_gpu.attention_fwd(q, k, v))
    t_bwd = _gpu_seconds(lambda: cupy_gpu.attention_bwd(q, k, v, out, lse, dout))
    n = max(64, round((fwd_flops / 2) ** (1 / 3) / 64) * 64)
    a, b = (rng.standard_normal((n, n), dtype=cupy.float32) for _ in range(2))
    t_gemm = _gpu_seconds(lambda: a @ b)
    gemm = 2 * n ** 3 / t_gemm / 1e12
    return {"seq": seq, "fwd_tflops": fwd_flops / t_fwd / 1e12,
            "bwd_tflops": 2.5 * fwd_flops / t_bwd / 1e12, "gemm_tflops": gemm, "gemm_n": n}


def mpipar_train(seq: int, steps: int) -> dict[str, float]:
    """Tokens/s and MFU of mpipar's training step of the 350M model on this device."""
    import cupy
    from mpipar.runtime.mpi_init import MPI
    from mpipar.runtime.peak import gpu_peak_flops
    from mpipar.config import Config, ModelConfig, TrainConfig
    from mpipar.data.sources import load_tokens
    from mpipar.training.engine import Engine
    from mpipar.model.flops import model_flops_per_step
    import numpy as np, os, tempfile
    path = os.path.join(tempfile.mkdtemp(prefix="mpipar-bench-gpu-"), "tokens.npy")
    np.save(path, np.random.default_rng(0).integers(0, 32000, (8, seq + 1)))
    cfg = validate(Config(ModelConfig(**MODEL_350M), train=TrainConfig(
        seq_len=seq, global_batch_size=1, device="cuda", steps=steps + 1, data=path,
        dtype="float32")), 1)
    eng = Engine(cfg, MPI.COMM_SELF, source=load_tokens(path, 32000, seq))
    eng.train_step(0)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for k in range(steps):
        eng.train_step(k + 1)
    cupy.cuda.Device().synchronize()
    step = (time.perf_counter() - t0) / steps
    return {"tokens_per_s": seq / step, "step_s": step,
            "mfu": model_flops_per_step(cfg) / step / gpu_peak_flops("float32")}


def torch_train(seq: int, steps: int) -> dict[str, float] | str:
    """Tokens/s of the same model in PyTorch eager (sdpa, AdamW, float32), or why not."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        return f"torch/transformers not importable ({exc})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    m = MODEL_350M
    conf = transformers.LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden"],
                                    num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                                    num_key_value_heads=m["kv_heads"],
                                    intermediate_size=m["ffn_hidden"], attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(conf).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, m["vocab_size"], (1, seq + 1), device="cuda")

    def step() -> None:
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return {"tokens_per_s": seq * steps / (time.perf_counter() - t0)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The section: attention rates, then the two training runs, printed and returned."""
    from mpipar.runtime.device import cuda_unavailable
    reason = cuda_unavailable()
    if reason is not None:
        print(f"gpu: skipped: {reason}")
        return {"skipped": reason}
    att = attention_rates(args.seq)
    print(f"attention seq {args.seq}: forward {att['fwd_tflops']:.2f} TFLOP/s, backward "
          f"{att['bwd_tflops']:.2f} TFLOP/s, GEMM of equal FLOPs {att['gemm_tflops']:.2f} TFLOP/s "
          f"(forward {att['fwd_tflops'] / att['gemm_tflops']:.0%} of it)")
    ours = mpipar_train(args.seq, args.steps)
    theirs = torch_train(args.seq, args.steps)
    line = (f"train 350M seq {args.seq} float32: mpipar {ours['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {ours['mfu']:.1%}")
    if isinstance(theirs, dict):
        line += (f"; PyTorch eager {theirs['tokens_per_s']:,.0f} tokens/s (mpipar "
                 f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x)")
    else:
        line += f"; PyTorch eager: {theirs}"
    print(line)
    return {"attention": att, "mpipar": ours, "torch": theirs}


SECTION = Section("gpu", run, "on a CUDA device: flash attention TFLOP/s against the GEMM of equal "
                  "FLOPs; tokens/s and MFU of a 350M Llama against PyTorch eager (skipped without "
                  "one); --static: the NVRTC compile gate", configure)
