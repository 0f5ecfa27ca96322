"""``python -m mpipar.bench train``: one training step of mpipar against PyTorch eager
(transformers Llama, sdpa, AdamW) on the same model and threads, interleaved step by step, one
comparison per thread count; then dp=2 (``mpirun -n 2``) against PyTorch DDP (gloo).

Each peer is a child process serving steps on request (:mod:`mpipar.bench.train_peer`); this
module starts them, races them and prints tokens/s, MFU against mpipar's GEMM probe, CPU
seconds per step and mpipar's per-op profile of one step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from mpipar.bench.harness import Section, mpirun, print_header, thread_counts
from mpipar.bench.train_peer import REPLY, serve
from mpipar.runtime.nodes import THREAD_VARS, cpu_count


class Server:
    """A serving child process (`python -m mpipar.bench train --serve ...`) with `threads` threads."""

    def __init__(self, name: str, argv: list[str], threads: int, launcher: tuple[str, ...] = ()) -> None:
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
    """The model's flags, as the serving children get them."""
    return [f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "backend")]


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


def run(args: argparse.Namespace) -> dict[str, Any]:
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
          f"{args.warmup} warm-up + {args.steps} timed steps per peer, interleaved; cores={cpu_count()}")
    rows = []
    for t in thread_counts(args.threads):
        servers = [Server("mpipar", ["--serve", "mpipar", *model], t)]
        if why_not is None:
            servers.append(Server("torch", ["--serve", "torch", "--world", "1", *model], t))
        rows.append(run_comparison(f"{t} thread(s), 1 rank", servers, args))
    launcher = mpirun()
    if args.dp2 and (launcher is None or args.batch % 2):
        notes.append("dp=2 skipped: " + ("no mpirun found" if launcher is None else f"batch {args.batch} is odd"))
    elif args.dp2:
        servers = [Server("mpipar", ["--serve", "mpipar", *model], 1, (launcher, "-n", "2"))]
        if why_not is None:
            servers.append(Server("torch", ["--serve", "torch", "--world", "2", *model], 1))
        rows.append(run_comparison("dp=2, 1 thread/rank (torch: DDP gloo)", servers, args))
    _print_train(rows, notes)
    return {"model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab",
                                                    "seq", "batch")},
            "rows": rows, "notes": notes}


def _print_train(rows: list[dict[str, Any]], notes: list[str]) -> None:
    """The race table (tokens/s, MFU, CPU seconds per step), the notes, then the per-op profiles."""
    header = (f"{'run':<40} {'mpipar tok/s':>13} {'MFU':>6} {'torch tok/s':>12} {'MFU':>6} "
              f"{'mpipar/torch':>13} {'CPU s/step m/t':>15} {'per CPU s':>10}")
    print_header(header)
    for r in rows:
        m, t = r["mpipar"], r.get("torch")
        line = f"{r['label']:<40} {m['tokens_per_s']:>13.0f} {100 * m['mfu']:>5.1f}%"
        if t is not None:
            line += (f" {t['tokens_per_s']:>12.0f} {100 * t['mfu']:>5.1f}% "
                     f"{m['tokens_per_s'] / t['tokens_per_s']:>12.2f}x "
                     f"{m['median_cpu_step_s']:>7.2f}/{t['median_cpu_step_s']:<7.2f} "
                     f"{t['median_cpu_step_s'] / m['median_cpu_step_s']:>9.2f}x")
        print(line)
    print("tok/s from the median step; MFU = model FLOPs/step (mpipar.model.flops.model_flops_per_step, the same "
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


def configure(parser: argparse.ArgumentParser) -> None:
    """The train section's options: thread counts, steps, the model; --serve and --world for the peers."""
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


SECTION = Section("train", run, "a training step of mpipar against PyTorch eager, same model and "
                  "threads", configure)
