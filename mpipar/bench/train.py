"""``python -m mpipar.bench train``: one training step of mpipar against PyTorch eager
(transformers Llama, sdpa, AdamW) on the same model and threads, interleaved step by step, one
comparison per thread count and dtype (float32; bfloat16: mpipar's mixed precision, its bf16
GEMMs as each ``--cpu-bf16-gemm`` says, against PyTorch's bf16 autocast); then dp=2 (``mpirun
-n 2``) against PyTorch DDP (gloo), float32. The header names the CPU and its bf16 flags; each
thread count's GEMM rates (NumPy float32, oneMKL bf16, PyTorch float32 and bf16) follow the table.

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


def _variants(args: argparse.Namespace, notes: list[str]) -> list[tuple[str, str]]:
    """(dtype, bf16 GEMM) of each 1-rank comparison: float32, then bfloat16 once per
    ``--cpu-bf16-gemm`` choice (an explicit mkl where MKL does not load is left out, noted)."""
    from mpipar.kernels import mkl_bf16

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    gemms = [g.strip() for g in args.cpu_bf16_gemm.split(",") if g.strip()]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")] + [
        g for g in gemms if g not in mkl_bf16.CHOICES]
    if bad:
        raise SystemExit(f"bench train: unknown {bad}: --dtypes takes float32, bfloat16; "
                         f"--cpu-bf16-gemm {', '.join(mkl_bf16.CHOICES)}")
    missing = mkl_bf16.unavailable_reason()
    if "mkl" in gemms and "bfloat16" in dtypes and missing is not None:
        notes.append(f"bf16 through mkl skipped: {missing}; {mkl_bf16.INSTALL}")
        gemms = [g for g in gemms if g != "mkl"]
    return ([("float32", "auto")] if "float32" in dtypes else []) + (
        [("bfloat16", g) for g in gemms] if "bfloat16" in dtypes else [])


def cpu_line() -> str:
    """The CPU's model name, its bf16 flags and whether oneMKL loads (the header's)."""
    from mpipar.kernels import mkl_bf16

    try:
        with open("/proc/cpuinfo") as fh:
            name = next((ln.partition(":")[2].strip() for ln in fh if ln.startswith("model name")),
                        "unknown")
    except OSError:
        name = "unknown"
    flags = mkl_bf16.cpu_bf16_flags()
    missing = mkl_bf16.unavailable_reason()
    return (f"CPU {name}; bf16 flags: {', '.join(flags) or 'none of ' + ', '.join(mkl_bf16.BF16_FLAGS)}"
            f"; {missing or mkl_bf16.version()}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """mpipar against PyTorch eager, one comparison per thread count, then dp=2 against DDP."""
    if args.serve:
        serve(args)
        return {}
    if args.quick:
        args.steps, args.warmup, args.gemm_size = min(args.steps, 2), 1, min(args.gemm_size, 512)
    model = _model_argv(args)
    why_not = torch_missing()
    notes = [] if why_not is None else [f"PyTorch peer skipped: {why_not}"]
    variants = _variants(args, notes)
    print(f"train: Llama hidden {args.hidden}, {args.layers} layers, heads {args.heads}/{args.kv_heads}, "
          f"ffn {args.ffn}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per peer, interleaved; cores={cpu_count()}\n"
          f"{cpu_line()}")
    rows = []
    for t in thread_counts(args.threads):
        for k, (dtype, gemm) in enumerate(variants):
            peer = [*model, f"--peer-dtype={dtype}", f"--peer-gemm={gemm}",
                    f"--gemm-size={args.gemm_size if k == 0 else 0}"]
            servers = [Server("mpipar", ["--serve", "mpipar", *peer], t)]
            if why_not is None:
                servers.append(Server("torch", ["--serve", "torch", "--world", "1", *peer], t))
            label = (f"{t} thread(s), 1 rank, float32" if dtype == "float32" else
                     f"{t} thread(s), 1 rank, bf16 (GEMMs {gemm}; autocast)")
            rows.append(run_comparison(label, servers, args))
    launcher = mpirun()
    if args.dp2 and (launcher is None or args.batch % 2):
        notes.append("dp=2 skipped: " + ("no mpirun found" if launcher is None else f"batch {args.batch} is odd"))
    elif args.dp2:
        servers = [Server("mpipar", ["--serve", "mpipar", *model], 1, (launcher, "-n", "2"))]
        if why_not is None:
            servers.append(Server("torch", ["--serve", "torch", "--world", "2", *model], 1))
        rows.append(run_comparison("dp=2, 1 thread/rank (torch: DDP gloo)", servers, args))
    _print_train(rows, notes)
    _print_gemms(rows, args.gemm_size)
    return {"model": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab",
                                                    "seq", "batch")},
            "rows": rows, "notes": notes}


def _print_train(rows: list[dict[str, Any]], notes: list[str]) -> None:
    """The race table (tokens/s, MFU, CPU seconds per step), the notes, then the per-op profiles."""
    header = (f"{'run':<52} {'mpipar tok/s':>13} {'MFU':>6} {'torch tok/s':>12} {'MFU':>6} "
              f"{'mpipar/torch':>13} {'CPU s/step m/t':>15} {'per CPU s':>10}")
    print_header(header)
    for r in rows:
        m, t = r["mpipar"], r.get("torch")
        line = f"{r['label']:<52} {m['tokens_per_s']:>13.0f} {100 * m['mfu']:>5.1f}%"
        if t is not None:
            line += (f" {t['tokens_per_s']:>12.0f} {100 * t['mfu']:>5.1f}% "
                     f"{m['tokens_per_s'] / t['tokens_per_s']:>12.2f}x "
                     f"{m['median_cpu_step_s']:>7.2f}/{t['median_cpu_step_s']:<7.2f} "
                     f"{t['median_cpu_step_s'] / m['median_cpu_step_s']:>9.2f}x")
        print(line)
    print("tok/s from the median step; MFU = model FLOPs/step (mpipar.model.flops.model_flops_per_step, the same "
          "for both) / step time / the float32 GEMM probe of the same threads x ranks (bf16 rows "
          "too); CPU s/step: median CPU "
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


def _print_gemms(rows: list[dict[str, Any]], n: int) -> None:
    """Each thread count's GEMM rates (its first row's peers measured them) and, per bf16 row,
    its tokens/s over the float32 row's of the same threads, mpipar's and PyTorch's."""
    base: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["ranks"] != 1:
            continue
        rates = {**r["mpipar"]["info"].get("gemm_gflops", {}),
                 **(r.get("torch") or {}).get("info", {}).get("gemm_gflops", {})}
        if rates:
            print(f"GEMM {n}^3, {r['threads']} thread(s): " + ", ".join(
                f"{k} {v:,.1f}" for k, v in rates.items()) + " GFLOP/s")
        if r["label"].endswith("float32"):
            base[r["threads"]] = r
        elif r["threads"] in base:
            f32 = base[r["threads"]]
            line = (f"{r['label']}: bf16 / float32 tokens/s: mpipar "
                    f"{r['mpipar']['tokens_per_s'] / f32['mpipar']['tokens_per_s']:.2f}x")
            if r.get("torch") and f32.get("torch"):
                line += f", torch {r['torch']['tokens_per_s'] / f32['torch']['tokens_per_s']:.2f}x"
            print(line)


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
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma list of float32, bfloat16 (the 1-rank comparisons)")
    parser.add_argument("--cpu-bf16-gemm", default="auto",
                        help="comma list of mpipar's bf16 GEMMs to compare: auto, mkl, float32 "
                             "(one bf16 comparison each)")
    parser.add_argument("--gemm-size", type=int, default=2048,
                        help="the n of the n^3 GEMM rates per thread count (0: none)")
    parser.add_argument("--peer-dtype", default="float32", help=argparse.SUPPRESS)  # child: dtype
    parser.add_argument("--peer-gemm", default="auto", help=argparse.SUPPRESS)  # child: bf16 GEMM
    parser.add_argument("--serve", choices=("mpipar", "torch"), help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)  # torch child: DDP ranks


SECTION = Section("train", run, "a training step of mpipar against PyTorch eager, same model and "
                  "threads", configure)
