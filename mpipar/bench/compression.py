"""``python -m mpipar.bench compression``: convergence of gradient compression. The default
model trained under mpirun (dp = ranks) with no, int8 and top-k compression, with and without
error feedback and the top-k catch-up: a final-loss table against no compression, the wire bytes
a step, and a plot of the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from mpipar.bench.harness import LAUNCH_ENV, Section, mpirun, print_header


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
    launcher = mpirun()
    if launcher is None:
        raise SystemExit("compression: no mpirun beside this Python or on PATH")
    cmd = [launcher, "-n", str(args.ranks), sys.executable, "-m", "mpipar.train", *flags]
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


def run(args: argparse.Namespace) -> dict[str, Any]:
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
    """The final-loss table: each variant against no compression, with its wire bytes."""
    header = (f"{'variant':<14} {'final loss':>10} {'vs none':>8} {'wire bytes/step':>16} "
              f"{'fewer':>7} {'step s':>7}")
    print_header(header)
    for r in rows:
        fewer = f"{r['bytes_ratio']:.1f}x" if r["bytes_ratio"] else "-"
        print(f"{r['variant']:<14} {r['final_loss']:>10.4f} {100 * r['vs_none']:>+7.2f}% "
              f"{r['wire_bytes']:>16,} {fewer:>7} {r['step_time_s']:>7.3f}")
    print("vs none: final loss relative to no compression; wire bytes: what rank 0 put on the "
          "wire in the last step (all groups); fewer: none's wire bytes over the variant's; "
          "step s: median step time (ranks sharing this machine's cores: not a speed figure)")


def configure(parser: argparse.ArgumentParser) -> None:
    """The compression section's options: variants, steps, ranks, top-k ratio, warm-up, nodes."""
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


SECTION = Section("compression", run, "final loss of the default model trained with no, int8 and "
                  "top-k gradient compression, with and without error feedback (mpirun)", configure)
