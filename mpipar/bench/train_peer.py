"""The peers of ``python -m mpipar.bench train``: child processes that serve training steps on
request, so that the driver (:mod:`mpipar.bench.train`) can interleave them step by step.

Protocol: the child (``python -m mpipar.bench train --serve mpipar|torch ...``) builds its
peer and answers ``ready`` with the peer's facts; then it reads one command a line on stdin
(:data:`COMMANDS`; end of input means quit) and answers each on stdout with one line of
:data:`REPLY` and a JSON object (any other output is ignored):

- ``step``: ``{"seconds": wall, "cpu_seconds": CPU}`` of one training step;
- ``profile``: ``{"breakdown": {op: seconds}}`` of one step under cProfile (mpipar only);
- ``quit``: the peer closes and the child ends.

mpipar's peer is MPI.COMM_WORLD (one rank, or data parallel under ``mpirun -n 2``: rank 0
reads the commands and broadcasts them); PyTorch's is this process as rank 0 of DDP (gloo),
ranks 1.. spawned by it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

from mpipar import kernels
from mpipar.rules import validate

REPLY = "@bench "  # prefix of a serving child's answer lines (any other output is ignored)
COMMANDS = ("quit", "step", "profile")


def train_config(args: argparse.Namespace, world: int, run_dir: str) -> Any:
    """The resolved mpipar Config of the benchmarked model (pure data parallelism over `world`)
    in the peer's dtype, its bf16 GEMMs as ``--cpu-bf16-gemm`` says."""
    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig

    return validate(Config(
        ModelConfig(vocab_size=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    kv_heads=args.kv_heads, ffn_hidden=args.ffn),
        ParallelConfig(),
        TrainConfig(steps=1000, seq_len=args.seq, global_batch_size=args.batch,
                    dtype=args.peer_dtype, cpu_bf16_gemm=args.peer_gemm, backend=args.backend,
                    run_dir=run_dir, log_every=0),
    ), world)


class MpiparPeer:
    """mpipar's training step on MPI.COMM_WORLD (one rank, or data parallel under mpirun)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import numba
        from mpipar.runtime.mpi_init import MPI

        from mpipar.runtime.peak import measure_peak_flops
        from mpipar.training.rank import build_rank
        from mpipar.model.flops import model_flops_per_step

        self.comm = MPI.COMM_WORLD
        self.rank0 = self.comm.Get_rank() == 0
        self.tmp = tempfile.TemporaryDirectory(prefix="mpipar-bench-train-")
        cfg = train_config(args, self.comm.Get_size(), self.tmp.name)
        self.rank = build_rank(cfg, self.comm)
        self.steps = 0
        self.info = {"ranks": self.comm.Get_size(), "threads": numba.get_num_threads(),
                     "peak_flops_per_rank": measure_peak_flops("float32"),
                     "flops_per_step": model_flops_per_step(cfg), "tokens_per_step": args.batch * args.seq,
                     "kernels": self.rank.compute.kernels.describe(),
                     "gemm_gflops": gemm_rates("mpipar", args.gemm_size)}

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
        from mpipar.training.step import train_step
        start, cpu = time.perf_counter(), time.process_time()
        train_step(self.rank, self.steps)
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
            elif func == "step" and path.endswith(os.path.join("mpipar", "training", "optim.py")):
                parts["optimizer"] = parts.get("optimizer", 0.0) + cumulative
        parts["other"] = total - sum(parts.values())
        parts["step"] = total
        return parts

    def reply(self, message: dict[str, Any]) -> None:
        if self.rank0:
            print(REPLY + json.dumps(message), flush=True)

    def close(self) -> None:
        from mpipar.training.step import close
        close(self.rank)
        self.tmp.cleanup()


class TorchTrainer:
    """The same model in PyTorch eager as a new user writes it: transformers' LlamaForCausalLM
    (attn_implementation="sdpa"), float32 (or for a bf16 peer, float32 parameters under
    ``torch.autocast("cpu", torch.bfloat16)``), torch.optim.AdamW with mpipar's defaults (no weight
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
        self.autocast = args.peer_dtype == "bfloat16"   # bf16 autocast, float32 parameters
        self.steps = 0

    def step(self) -> tuple[float, float]:
        """(wall, CPU) seconds of one training step, like :meth:`MpiparPeer.step`."""
        torch = self.torch
        start, cpu = time.perf_counter(), time.process_time()
        inputs, targets = self.sampler.batch(self.steps, self.rows)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(input_ids=torch.from_numpy(inputs)).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab),
                                                     torch.from_numpy(targets).reshape(-1))
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
                     "torch": self.trainer.torch.__version__,
                     "gemm_gflops": gemm_rates("torch", args.gemm_size)}

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


def gemm_rates(peer: str, n: int) -> dict[str, float]:
    """GFLOP/s of one ``n``-cubed GEMM with this process's threads, per kind: mpipar's peer
    NumPy's float32 BLAS and, where MKL loads, oneMKL's bf16 GEMM (:mod:`mpipar.kernels.mkl_bf16`);
    PyTorch's its float32 and bf16 ``torch.mm``. ``n`` 0: none."""
    from mpipar.bench.harness import time_call

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    calls: dict[str, Any] = {}
    if n and peer == "mpipar":
        from mpipar.kernels import mkl_bf16
        calls["numpy float32"] = lambda: a @ b
        if mkl_bf16.unavailable_reason() is None:
            import ml_dtypes
            a16, b16 = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
            calls["mkl bf16"] = lambda: mkl_bf16.gemm(a16, b16)
    elif n:
        import torch
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        ha, hb = ta.bfloat16(), tb.bfloat16()
        calls = {"torch float32": lambda: ta @ tb, "torch bf16": lambda: ha @ hb}
    return {k: 2 * n ** 3 / time_call(f, lambda: None, 3, 0.2) / 1e9 for k, f in calls.items()}


def _read_command() -> str:
    """The next command on stdin; end of input (or an unknown line) is quit."""
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

