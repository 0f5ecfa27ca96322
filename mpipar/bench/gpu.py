"""``python -m mpipar.bench gpu``: the training step on one CUDA device, against PyTorch eager.

- attention: each bf16 attention backend (mpipar's ``flash_mma``, cuDNN's fused attention) forward
  and backward TFLOP/s, causal, seq 2k-16k at 16k tokens, head dim 64 and 128, against a cuBLAS
  bf16 GEMM of equal FLOPs and torch's SDPA flash backend (:mod:`mpipar.bench.gpu_attention`);
- train: tokens/s, MFU (against the bf16 dense peak) and peak device memory of bf16 training
  steps of a Llama of 1.1B parameters (TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4 kv
  heads, FFN 5632, vocabulary 32000) and of 350M, at seq 2048 and 4096 with 16k tokens a step;
  beside the same model, data and GPU in PyTorch eager (transformers ``LlamaForCausalLM``, sdpa,
  float32 weights and AdamW under ``torch.autocast(bfloat16)``: the float32-master recipe
  mpipar's ``--dtype bfloat16`` follows), each in its own process, one after the other.

Without a CUDA device the section prints why and returns ``{"skipped": reason}``. Timings: CUDA
events or a device synchronisation around the timed steps, after warm-up; each peer runs in a
child process so that neither's memory pool or compiled kernels favour the other.

``--kernels``: no comparison, but the device's ceilings and the step's kernels one by one
(:mod:`mpipar.bench.gpu_kernels`).

``--profile``: no comparison, but where mpipar's step (the first of ``--models`` and ``--seqs``)
spends its device time, op by op (:func:`profile`).

``python -m mpipar.bench gpu --static [--arch sm_80,sm_90] [--json FILE]`` runs no benchmark
but the compile gate (:mod:`mpipar.kernels.cuda_gate`: every CUDA source compiled through NVRTC
for each architecture, no device needed), with the gate's table, JSON and exit status.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from mpipar.bench.harness import Section
from mpipar.rules import validate

MODELS = {
    "1.1B": dict(vocab_size=32000, hidden=2048, layers=22, heads=32, kv_heads=4, ffn_hidden=5632),
    "350M": dict(vocab_size=32000, hidden=1024, layers=24, heads=16, kv_heads=16,
                 ffn_hidden=2816),
}
TOKENS_PER_STEP = 16384


def configure(parser: argparse.ArgumentParser) -> None:
    """The gpu section's options: models, sequence lengths, steps; --static and --arch for the
    gate; --peer (internal: one peer's training run in this process)."""
    parser.add_argument("--models", default="1.1B,350M", help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--seqs", default="2048,4096", help="comma-separated sequence lengths")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--no-attention", action="store_true", help="skip the attention table")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the comparison: where mpipar's step of the first "
                             "model and seq spends its device time, op by op")
    parser.add_argument("--kernels", action="store_true",
                        help="instead of the comparison: the device's copy and GEMM ceilings and "
                             "the step's kernels one by one at the 1.1B model's shapes "
                             "(mpipar.bench.gpu_kernels)")
    parser.add_argument("--static", action="store_true",
                        help="no benchmark: the NVRTC compile gate of every CUDA kernel "
                             "(python -m mpipar.kernels.cuda_gate; --json FILE gets its report)")
    parser.add_argument("--arch", metavar="ARCHS",
                        help="--static: comma-separated architectures (default: the gate's, "
                             "sm_80,sm_90)")
    parser.add_argument("--peer", help=argparse.SUPPRESS)   # "mpipar|torch:MODEL:SEQ"


def compile_gate(args: argparse.Namespace) -> int:
    """``--static``: the compile gate's status (0 every kernel passes, 1 one fails, 2 no CuPy or
    NVRTC), its table printed and its report written to ``--json``."""
    from mpipar.kernels import cuda_gate

    argv = (["--arch", args.arch] if args.arch else []) + (["--json", args.json] if args.json else [])
    return cuda_gate.main(argv)


def _config(model: str, seq: int, steps: int, data: str, device: str = "cuda") -> Any:
    """The resolved bf16 one-process Config of ``model`` at ``seq`` tokens, 16k tokens a step."""
    from mpipar.config import Config, ModelConfig, TrainConfig
    return validate(Config(ModelConfig(**MODELS[model]), train=TrainConfig(
        seq_len=seq, global_batch_size=max(1, TOKENS_PER_STEP // seq), device=device,
        steps=steps, data=data, dtype="bfloat16", log_every=0)), 1)


def _rank(model: str, seq: int, steps: int) -> Any:
    """A one-process bf16 rank of ``model`` at ``seq`` on this device
    (:func:`mpipar.training.rank.build_rank`), over ``steps`` steps of random tokens (16k a
    step)."""
    import numpy as np
    from mpipar.runtime.mpi_init import MPI
    from mpipar.data.sources import load_tokens
    from mpipar.training.rank import build_rank

    path = os.path.join(tempfile.mkdtemp(prefix="mpipar-bench-gpu-"), "tokens.npy")
    batch = max(1, TOKENS_PER_STEP // seq)
    np.save(path, np.random.default_rng(0).integers(0, 32000, (steps * batch, seq + 1)))
    return build_rank(_config(model, seq, steps, path), MPI.COMM_SELF,
                      source=load_tokens(path, 32000, seq))


def _timed_steps(eng: Any, first: int, count: int) -> tuple[float, list[float]]:
    """Seconds a step over steps ``first .. first + count - 1`` (the device synchronised before
    and after), and their losses."""
    import cupy
    from mpipar.training.step import train_step
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    losses = [train_step(eng, k).loss for k in range(first, first + count)]
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / count, losses


def mpipar_train(model: str, seq: int, steps: int) -> dict[str, Any]:
    """mpipar's bf16 training steps of ``model`` on this device: seconds a step (two untimed
    warm-up steps first), tokens/s, and the memory pool's bytes after the steps (what it holds
    is what the steps needed at their peak: CuPy's pool keeps every block it allocated)."""
    import cupy

    t0 = time.perf_counter()
    eng = _rank(model, seq, steps + 2)
    build = time.perf_counter() - t0
    _, warm = _timed_steps(eng, 0, 2)
    step, losses = _timed_steps(eng, 2, steps)
    pool = cupy.get_default_memory_pool()
    return {"step_s": step, "build_s": build, "losses": [float(x) for x in warm + losses],
            "memory_bytes": int(pool.total_bytes()), "attention": str(eng.compute.attention)}


def torch_train(model: str, seq: int, steps: int) -> dict[str, Any]:
    """The same model's steps in PyTorch eager: transformers ``LlamaForCausalLM`` (sdpa) with
    float32 weights, AdamW (PyTorch's default implementation) and ``torch.autocast(bfloat16)``;
    the same 16k tokens a step; peak memory as ``torch.cuda.max_memory_reserved``."""
    import torch
    import transformers
    m = MODELS[model]
    conf = transformers.LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden"],
                                    num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                                    num_key_value_heads=m["kv_heads"],
                                    intermediate_size=m["ffn_hidden"], attn_implementation="sdpa",
                                    tie_word_embeddings=False)
    net = transformers.LlamaForCausalLM(conf).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    batch = max(1, TOKENS_PER_STEP // seq)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, m["vocab_size"], ((steps + 2) * batch, seq + 1), generator=gen).cuda()
    losses: list[float] = []

    def step(k: int) -> None:
        x = ids[k * batch:(k + 1) * batch]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(x[:, :-1], labels=x[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    step(0), step(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(steps):
        step(k + 2)
    torch.cuda.synchronize()
    return {"step_s": (time.perf_counter() - t0) / steps, "losses": [float(x) for x in losses],
            "memory_bytes": int(torch.cuda.max_memory_reserved()),
            "torch": torch.__version__, "transformers": transformers.__version__}


def profile(model: str, seq: int, steps: int = 3) -> dict[str, Any]:
    """Device milliseconds a bf16 step of ``model`` at ``seq`` spends in each kernel op and in
    the optimizer's phases, beside the plain step's time, measured two ways over ``steps`` steps
    each: ``stream``, CUDA events recorded around every op with no synchronisation until the
    step ends (while the host runs ahead of the device, each op's interval is its device time,
    and the plain step less their sum is the device time of the untimed work: residual adds,
    gradient accumulation, casts, launch gaps); ``serial``, a synchronisation after every op (the
    op's device time plus its host launch time, nothing overlapped); ``host``, the host's time in
    the op's call (stream pass). The device time between one timed op's end and the next one's
    start (untimed work or the device waiting for the host) is summed by the op before it: the
    largest of those gaps are listed. Printed as tables and returned."""
    import collections
    import dataclasses
    import cupy
    from mpipar.training.step import close

    eng = _rank(model, seq, 3 * steps + 2)
    _timed_steps(eng, 0, 2)
    plain = _timed_steps(eng, 2, steps)[0] * 1e3
    ms = {m: collections.defaultdict(float) for m in ("stream", "serial")}
    calls: collections.Counter = collections.Counter()
    pending: list[tuple[str, Any, Any]] = []
    host: dict[str, float] = collections.defaultdict(float)
    mode = ["stream"]

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            t0 = time.perf_counter()
            start.record()
            out = fn(*a, **k)
            end.record()
            host[name] += (time.perf_counter() - t0) * 1e3 if mode[0] == "stream" else 0.0
            if mode[0] == "serial":
                end.synchronize()
                ms["serial"][name] += cupy.cuda.get_elapsed_time(start, end)
            else:
                pending.append((name, start, end))
                calls[name] += 1
            return out
        return wrapper

    kernels, optimizer = eng.compute.kernels, eng.weights.optimizer
    for f in dataclasses.fields(kernels):
        if callable(getattr(kernels, f.name)) and f.name != "xp":
            object.__setattr__(kernels, f.name, timed(f.name, getattr(kernels, f.name)))
    for name in ("step", "clip", "grad_norm_sq"):
        setattr(optimizer, name, timed("optimizer." + name, getattr(optimizer, name)))
    stream_step = _timed_steps(eng, 2 + steps, steps)[0] * 1e3
    gaps: dict[str, float] = collections.defaultdict(float)
    for i, (name, start, end) in enumerate(pending):
        ms["stream"][name] += cupy.cuda.get_elapsed_time(start, end)
        if i + 1 < len(pending):
            gaps[name] += cupy.cuda.get_elapsed_time(end, pending[i + 1][1])
    mode[0] = "serial"
    _timed_steps(eng, 2 + 2 * steps, steps)
    rows = sorted(((n, ms["stream"][n] / steps, ms["serial"][n] / steps, host[n] / steps,
                    calls[n] // steps) for n in ms["stream"]), key=lambda r: -r[1])
    timed_sum = sum(r[1] for r in rows)
    print(f"profile {model} seq {seq} bf16: plain step {plain:.1f} ms; with events {stream_step:.1f}"
          f" ms, of which the timed ops {timed_sum:.1f} ms and untimed work {stream_step - timed_sum:.1f}"
          f" ms; ops synchronised one by one {sum(r[2] for r in rows):.1f} ms")
    print(f"  {'op':26s} {'stream ms':>9s} {'serial ms':>9s} {'host ms':>9s} {'calls':>6s}")
    for name, v, w, h, n in rows:
        print(f"  {name:26s} {v:9.2f} {w:9.2f} {h:9.2f} {n:6d}")
    after = sorted(((n, g / steps) for n, g in gaps.items()), key=lambda r: -r[1])
    print(f"  device time between timed ops, by the op before ({sum(g for _, g in after):.1f} ms"
          " a step, the step boundary included):")
    for name, g in after[:10]:
        print(f"    after {name:26s} {g:9.2f} ms")
    close(eng)
    return {"model": model, "seq": seq, "plain_ms": plain, "stream_step_ms": stream_step,
            "ops": {n: {"ms": v, "serial_ms": w, "host_ms": h, "calls": c}
                    for n, v, w, h, c in rows},
            "gaps_after_ms": dict(after)}


def _peer(args: argparse.Namespace) -> dict[str, Any]:
    """``--peer NAME:MODEL:SEQ``: one peer's run in this process, its figures as one JSON line."""
    name, model, seq = args.peer.split(":")
    fn = mpipar_train if name == "mpipar" else torch_train
    try:
        out = fn(model, int(seq), args.steps)
    except Exception as exc:  # the driver reports it beside the other rows
        out = {"error": f"{type(exc).__name__}: {exc}"}
    print("@peer " + json.dumps(out), flush=True)
    return out


def _run_peer(name: str, model: str, seq: int, steps: int) -> dict[str, Any]:
    """One peer in a child process (``--peer``); its JSON line, or the error it died with."""
    cmd = [sys.executable, "-m", "mpipar.bench", "gpu", "--peer", f"{name}:{model}:{seq}",
           "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("@peer "):
            return json.loads(line[6:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def train_rows(models: list[str], seqs: list[int], steps: int) -> list[dict[str, Any]]:
    """mpipar and PyTorch eager on every (model, seq), printed as they finish."""
    from mpipar.runtime.peak import gpu_peak_flops
    from mpipar.model.flops import model_flops_per_step
    peak = gpu_peak_flops("bfloat16")
    rows = []
    for model in models:
        for seq in seqs:
            flops = model_flops_per_step(_config(model, seq, steps, "stdlib"))
            row: dict[str, Any] = {"model": model, "seq": seq, "batch": TOKENS_PER_STEP // seq,
                                   "flops_per_step": flops, "peak_flops": peak}
            for name in ("mpipar", "torch"):
                got = _run_peer(name, model, seq, steps)
                if "step_s" in got:
                    got["tokens_per_s"] = TOKENS_PER_STEP / got["step_s"]
                    got["mfu"] = flops / got["step_s"] / peak
                row[name] = got
            ours, theirs = row["mpipar"], row["torch"]
            text = f"train {model} seq {seq} bf16: "
            for name, got in (("mpipar", ours), ("PyTorch eager", theirs)):
                text += (f"{name} {got['tokens_per_s']:,.0f} tokens/s, MFU {got['mfu']:.1%}, "
                         f"{got['memory_bytes'] / 2**30:.1f} GiB; " if "step_s" in got
                         else f"{name} failed ({got['error']}); ")
            if "step_s" in ours and "step_s" in theirs:
                row["ratio"] = theirs["step_s"] / ours["step_s"]
                text += f"mpipar {row['ratio']:.2f}x"
            print(text, flush=True)
            rows.append(row)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The section: the attention table, then the training rows, printed and returned."""
    if args.peer:
        return _peer(args)
    from mpipar.runtime.device import cuda_unavailable
    reason = cuda_unavailable()
    if reason is not None:
        print(f"gpu: skipped: {reason}")
        return {"skipped": reason}
    models, seqs = args.models.split(","), [int(x) for x in args.seqs.split(",")]
    if args.kernels:
        from mpipar.bench import gpu_kernels
        return {"kernels": gpu_kernels.run()}
    if args.profile:
        return {"profile": profile(models[0], seqs[0])}
    out: dict[str, Any] = {}
    if not args.no_attention:
        from mpipar.bench import gpu_attention
        out["attention"] = gpu_attention.run()
    out["train"] = train_rows(models, seqs, args.steps)
    return out


SECTION = Section("gpu", run, "on a CUDA device: attention TFLOP/s of each bf16 backend against "
                  "the GEMM of equal FLOPs; tokens/s, MFU and memory of bf16 training of 1.1B and "
                  "350M Llamas against PyTorch eager (skipped without one); --static: the NVRTC "
                  "compile gate", configure)
