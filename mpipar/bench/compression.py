"""``python -m mpipar.bench compression``: convergence of gradient compression. The default
model trained under mpirun (dp = ranks) with no, int8 and top-k compression, with and without
error feedback, the default warm-up and the top-k catch-up, for each seed and each layout (flat,
or hierarchical on nodes of K ranks): a final-loss table against no compression of the same
seed and layout (each row the mean over the seeds), the wire bytes a step, and a plot of the
losses.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import numpy as np

from mpipar.bench.harness import Section, print_header, train_run, variant_names
from mpipar.parallel.data_parallel.modes import NODE_SPLITS, hierarchical_named


COMPRESSION_VARIANTS = {
    "none": [],
    "int8": ["--grad-compression", "int8"],
    "int8-w0": ["--grad-compression", "int8", "--compression-warmup", "0"],
    "int8-noef": ["--grad-compression", "int8", "--error-feedback", "off"],
    "int8-noef-w0": ["--grad-compression", "int8", "--error-feedback", "off",
                     "--compression-warmup", "0"],
    "topk": ["--grad-compression", "topk"],
    "topk-w0": ["--grad-compression", "topk", "--compression-warmup", "0"],
    "topk-noef": ["--grad-compression", "topk", "--error-feedback", "off"],
    "topk-warm": ["--grad-compression", "topk"],
    "topk-warm-noef": ["--grad-compression", "topk", "--error-feedback", "off"],
    "topk-plain": ["--grad-compression", "topk", "--topk-catch-up", "off"],
    "topk-warm-plain": ["--grad-compression", "topk", "--topk-catch-up", "off"],
}
"""Variant name -> its ``python -m mpipar.train`` flags (top-k at --topk-ratio). Without a
suffix the run's defaults: error feedback, the codec's default warm-up (a share of the steps,
:func:`mpipar.parallel.data_parallel.reducer.warmup_steps`); ``-w0``: compressed from the first step;
``-warm``: after the bench's --warmup uncompressed steps; ``-noef``: no error feedback;
``-plain``: AdamW without the catch-up, one step on each arriving sum."""


def _layout_flags(layout: str) -> list[str]:
    """``flat`` (the job's own nodes, flat reduction) or ``hierK`` (nodes of K ranks,
    hierarchical reduction: compression across the nodes only)."""
    if layout == "flat":
        return []
    if layout.startswith("hier") and layout[4:].isdigit():
        return ["--ranks-per-node", layout[4:], "--dp-reduce", "hierarchical"]
    raise SystemExit(f"--layouts: {layout!r}: flat or hierK (nodes of K ranks)")


def _train_variant(name: str, args: argparse.Namespace, out: str, seed: int = 1234,
                   layout: str = "flat") -> dict[str, Any]:
    """Train one variant under mpirun (the default model and corpus, dp = ranks) and read its
    metrics: losses per step, the final loss (mean of the last ``--last`` steps), the median
    step time after step 1, and rank 0's bytes per step across nodes and in total."""
    run_dir = os.path.join(out, f"{layout}-{name}-{seed}")
    warm = ["--compression-warmup", str(args.warmup)] if "-warm" in name else []
    flags = [*COMPRESSION_VARIANTS[name], *warm, "--topk-ratio", str(args.topk_ratio),
             "--steps", str(args.steps), "--dp", str(args.ranks),
             "--seed", str(seed), "--log-every", "0", "--tensorboard", "off",
             *_layout_flags(layout), *args.train_flags.split()]
    records, wall = train_run("compression", args.ranks, flags, run_dir)
    losses = [r["loss"] for r in records]
    wire = records[-1].get("comm_wire_bytes", {})
    return {"variant": name, "layout": layout, "seed": seed, "flags": flags, "losses": losses,
            "final_loss": statistics.mean(losses[-args.last:]),
            "first_loss": statistics.mean(losses[:args.last]),
            "step_time_s": statistics.median(r["step_time_s"] for r in records[1:] or records),
            "inter_node_bytes": sum(v["inter"] for v in wire.values()),
            "wire_bytes": sum(v["intra"] + v["inter"] for v in wire.values()),
            "wall_s": wall}


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


def _train_all(args: argparse.Namespace, names: list[str], seeds: list[int],
               layouts: list[str]) -> list[dict[str, Any]]:
    """Every (layout, variant, seed), ``--jobs`` launches at a time; in that order."""
    from concurrent.futures import ThreadPoolExecutor

    todo = [(layout, name, seed) for layout in layouts for name in names for seed in seeds]

    def one(job: tuple[str, str, int]) -> dict[str, Any]:
        layout, name, seed = job
        row = _train_variant(name, args, args.out, seed, layout)
        print(f"  {layout} {name} seed {seed}: final loss {row['final_loss']:.4f} "
              f"({row['wall_s']:.0f} s)", flush=True)
        return row
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        return list(pool.map(one, todo))


def _summarise(runs: list[dict[str, Any]], names: list[str], layouts: list[str]
               ) -> list[dict[str, Any]]:
    """One row per (layout, variant): the mean over the seeds of the final loss and of its
    ratio to none's of the same seed and layout (also over the first ``--last`` steps)."""
    base = {(r["layout"], r["seed"]): r for r in runs if r["variant"] == "none"}
    rows = []
    for layout in layouts:
        for name in names:
            mine = [r for r in runs if r["layout"] == layout and r["variant"] == name]
            for r in mine:
                b = base[(layout, r["seed"])]
                r["vs_none"] = r["final_loss"] / b["final_loss"] - 1
                r["first_vs_none"] = r["first_loss"] / b["first_loss"] - 1
            none_bytes = base[(layout, mine[0]["seed"])]["wire_bytes"]
            rows.append({"variant": name, "layout": layout, "seeds": [r["seed"] for r in mine],
                         "final_loss": statistics.mean(r["final_loss"] for r in mine),
                         "vs_none": statistics.mean(r["vs_none"] for r in mine),
                         "vs_none_per_seed": [r["vs_none"] for r in mine],
                         "first_vs_none": statistics.mean(r["first_vs_none"] for r in mine),
                         "wire_bytes": mine[0]["wire_bytes"],
                         "inter_node_bytes": mine[0]["inter_node_bytes"],
                         "bytes_ratio": none_bytes / mine[0]["wire_bytes"]
                         if mine[0]["wire_bytes"] else None,
                         "step_time_s": statistics.median(r["step_time_s"] for r in mine),
                         "losses": mine[0]["losses"]})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train each variant for each seed and layout and compare its final loss with no
    compression's of the same seed and layout."""
    if args.quick:
        args.steps, args.ranks, args.last, args.warmup, args.seeds = 30, 4, 10, 3, "1234"
    names = variant_names(args.variants, COMPRESSION_VARIANTS, "none")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    layouts = [v.strip() for v in args.layouts.split(",") if v.strip()]
    if args.ranks_per_node:               # the older single-layout option
        layouts = [f"hier{args.ranks_per_node}" if hierarchical_named(args.dp_reduce)
                   else "flat"]
    for layout in layouts:
        _layout_flags(layout)
    os.makedirs(args.out, exist_ok=True)
    title = (f"default model, stdlib corpus, dp={args.ranks}, {args.steps} steps, seeds "
             f"{', '.join(map(str, seeds))}, layouts {', '.join(layouts)}, top-k ratio "
             f"{args.topk_ratio:g}")
    print(f"compression: {title}; final loss = mean of the last {args.last} steps, each row the "
          f"mean over the seeds")
    runs = _train_all(args, names, seeds, layouts)
    rows = _summarise(runs, names, layouts)
    _print_compression(rows)
    plot = os.path.join(args.out, "compression_loss.png")
    _plot_losses([r for r in rows if r["layout"] == layouts[0]], plot,
                 f"{title} (layout {layouts[0]}, seed {seeds[0]})")
    print(f"loss plot: {plot}")
    return {"config": {"steps": args.steps, "ranks": args.ranks, "last": args.last,
                       "topk_ratio": args.topk_ratio, "seeds": seeds, "layouts": layouts,
                       "train_flags": args.train_flags},
            "rows": rows, "runs": [{k: v for k, v in r.items() if k != "losses"} for r in runs],
            "plot": plot}


def _print_compression(rows: list[dict[str, Any]]) -> None:
    """The final-loss table: each variant against no compression, with its wire bytes."""
    header = (f"{'layout':<7} {'variant':<14} {'final loss':>10} {'vs none':>8} "
              f"{'per seed':>17} {'first':>7} {'wire bytes/step':>16} {'fewer':>6} "
              f"{'across/step':>12}")
    print_header(header)
    for r in rows:
        fewer = f"{r['bytes_ratio']:.1f}x" if r["bytes_ratio"] else "-"
        seeds = " ".join(f"{100 * v:+.2f}%" for v in r["vs_none_per_seed"])
        print(f"{r['layout']:<7} {r['variant']:<14} {r['final_loss']:>10.4f} "
              f"{100 * r['vs_none']:>+7.2f}% {seeds:>17} {100 * r['first_vs_none']:>+6.2f}% "
              f"{r['wire_bytes']:>16,} {fewer:>6} {r['inter_node_bytes']:>12,}")
    print("vs none: final loss (mean of the last steps) relative to no compression of the same "
          "seed and layout, mean over the seeds (per seed: each); first: the same over the first "
          "steps; wire bytes: what rank 0 put on the wire in the last step (all groups); fewer: "
          "none's over the variant's; across/step: rank 0's bytes across nodes")


def configure(parser: argparse.ArgumentParser) -> None:
    """The compression section's options: variants, seeds, layouts, steps, ranks, top-k ratio,
    warm-up."""
    parser.add_argument("--variants", default="none,int8,int8-w0,int8-noef-w0,topk,topk-w0",
                        help=f"comma list of {', '.join(COMPRESSION_VARIANTS)} (none is always "
                             f"run)")
    parser.add_argument("--seeds", default="1234,1235",
                        help="comma list of --seed values; each row is the mean over them")
    parser.add_argument("--layouts", default="flat,hier4",
                        help="comma list of flat and hierK (nodes of K ranks, --dp-reduce "
                             "hierarchical: compression across the nodes only)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--ranks", type=int, default=8, help="mpirun -n (dp = ranks)")
    parser.add_argument("--last", type=int, default=20, help="final loss: mean of the last N steps")
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=60,
                        help="the -warm variants: --compression-warmup steps")
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="one layout, nodes of K ranks (instead of --layouts)")
    parser.add_argument("--dp-reduce", default="hierarchical", choices=tuple(NODE_SPLITS))
    parser.add_argument("--jobs", type=int, default=1,
                        help="launches at a time (each is --ranks processes)")
    parser.add_argument("--train-flags", default="", help="more python -m mpipar.train flags")
    parser.add_argument("--out", default="runs/bench-compression",
                        help="run directories and compression_loss.png go here")


SECTION = Section("compression", run, "final loss of the default model trained with no, int8 and "
                  "top-k gradient compression, with and without error feedback (mpirun)", configure)
