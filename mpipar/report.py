"""``python -m mpipar.report RUN_DIR``: plots of a run and a summary naming its bottleneck.

Reads ``RUN_DIR/metrics.jsonl``, ``RUN_DIR/timeline.json`` (the last step's op records of every
rank) and ``RUN_DIR/config.toml``, and writes into ``RUN_DIR/report/`` (or ``--out``):

- ``loss.png`` (skipped steps marked; the validation loss of the evaluated steps beside the
  training loss), ``throughput.png`` (tokens/s and MFU),
  ``time_breakdown.png`` (stacked seconds per step: compute, TP/SP comm, pipeline wait, DP comm,
  optimizer, I/O), ``memory.png`` (peak resident memory per rank), ``timeline.png`` (a Gantt chart
  of each rank's forward / backward / receive-wait ops over the recorded step); ``balance.png``
  when the run records balance (max/mean of the sp ranks' attention work under
  ``--document-masking``, of each sparse layer's expert load under mixture of experts);
- ``summary.txt``: the numbers, the bottleneck and what to change (also printed).

The analysis (:mod:`mpipar.observe.summary`) needs no matplotlib; ``train`` writes the same
summary at the end of every run. Plotting needs the ``[report]`` extra (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from mpipar.observe.metrics import COMPUTE_OPS, TIME_KEYS
from mpipar.observe.summary import LABELS, steady_records, load_run, summarize, summary_text

COLORS = {"compute": "#4c72b0", "tp_comm": "#dd8452", "sp_comm": "#937860",
          "pipeline_wait": "#c44e52", "dp_comm": "#55a868", "optimizer": "#8172b3",
          "io": "#8c8c8c"}
OP_COLORS = {"fwd": "#4c72b0", "bwd": "#dd8452", "bwd_input": "#dd8452", "bwd_weight": "#f3b77b",
             "recv_fwd": "#d9d9d9", "recv_bwd": "#d9d9d9"}


# ------------------------------------------------------------------------------------- plots
def _figure(width: float = 8, height: float = 4.5):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt, *plt.subplots(figsize=(width, height))


def plot_loss(records: list[dict], path: str) -> None:
    plt, fig, ax = _figure()
    steps = [r["step"] for r in records if not r.get("skipped")]
    ax.plot(steps, [r["loss"] for r in records if not r.get("skipped")], lw=1.2,
            label="training loss")
    skipped = [r["step"] for r in records if r.get("skipped")]
    if skipped:
        top = max((r["loss"] for r in records if math.isfinite(r["loss"])), default=1.0)
        ax.scatter(skipped, [top] * len(skipped), marker="x", color="red", label="skipped step")
    evals = [r for r in records if "eval" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval"]["loss"] for r in evals], "o-", lw=1.2,
                color="#dd8452", label="validation loss")
    ax.set(xlabel="step", ylabel="loss (mean token cross-entropy)",
           title="Training and validation loss" if evals else "Training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput(records: list[dict], path: str) -> None:
    plt, fig, ax = _figure()
    records = steady_records(records)
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["tokens_per_s"] for r in records], color="#4c72b0")
    ax.set(xlabel="step", ylabel="tokens / s", title="Throughput and MFU (after step 1)")
    right = ax.twinx()
    right.plot(steps, [100 * r["mfu"] for r in records], color="#dd8452")
    right.set_ylabel("MFU (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_time_breakdown(records: list[dict], path: str) -> None:
    plt, fig, ax = _figure(9, 4.5)
    records = steady_records(records)
    steps = [r["step"] for r in records]
    bottom = [0.0] * len(records)
    for k in TIME_KEYS:
        values = [r["time"][k] for r in records]
        ax.bar(steps, values, bottom=bottom, width=1.0, color=COLORS[k], label=LABELS[k],
               linewidth=0)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="step", ylabel="seconds (mean over ranks)",
           title="Where a step's time goes (after step 1)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_memory(records: list[dict], path: str) -> None:
    plt, fig, ax = _figure()
    memory = records[-1].get("memory_bytes", [])
    ax.bar(range(len(memory)), [m / 2**20 for m in memory], color="#55a868")
    ax.set(xlabel="rank", ylabel="peak resident memory (MiB)", title="Peak memory per rank")
    ax.set_xticks(range(len(memory)))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def balance_series(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """What :func:`plot_balance` draws, by label: the attention work's max/mean over the sp
    ranks (``--document-masking``) and each sparse layer's expert load max/mean (mixture of
    experts), per step where recorded. Empty when the run has neither."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    rows = [r for r in records if "attention_imbalance" in r]
    if rows:
        out["attention work, sp ranks"] = ([r["step"] for r in rows],
                                           [r["attention_imbalance"] for r in rows])
    layers = sorted({k for r in records for k in r.get("moe_load_max_over_mean", {})}, key=int)
    for layer in layers:
        rows = [r for r in records if layer in r.get("moe_load_max_over_mean", {})]
        out[f"expert load, layer {layer}"] = ([r["step"] for r in rows],
                                              [r["moe_load_max_over_mean"][layer] for r in rows])
    return out


def plot_balance(records: list[dict], path: str) -> None:
    """Max over mean per step (1 = perfectly even) of :func:`balance_series`."""
    plt, fig, ax = _figure()
    for label, (steps, values) in balance_series(records).items():
        ax.plot(steps, values, lw=1.2, label=label)
    ax.axhline(1.0, color="#8c8c8c", lw=0.8, ls="--")
    ax.set(xlabel="step", ylabel="max / mean (1 = even)",
           title="Balance: attention work over sp ranks, expert load per sparse layer")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_timeline(timeline: dict, path: str) -> None:
    """Gantt chart: one row per rank, a bar per op, coloured by kind, labelled by microbatch."""
    ranks = timeline["ranks"]
    plt, fig, ax = _figure(10, 1.0 + 0.5 * len(ranks))
    for row, rank in enumerate(ranks):
        for kind, mb, chunk, start, end in rank["ops"]:
            if kind not in OP_COLORS or end <= start:
                continue
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (row - 0.4, 0.8),
                           facecolors=OP_COLORS[kind],
                           edgecolor="white" if kind in COMPUTE_OPS else "none", linewidth=0.5)
            if kind in COMPUTE_OPS and (end - start) > 0:
                ax.text((start + end) / 2 * 1e3, row, str(mb), ha="center", va="center",
                        fontsize=6, clip_on=True)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r['rank']} (pp {r['coord']['pp']})" for r in ranks])
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=OP_COLORS[k])
               for k in ("fwd", "bwd", "bwd_weight", "recv_fwd")]
    ax.legend(handles, ["forward", "backward (whole, or input grad)", "backward (weight grad)",
                        "waiting (recv)"],
              fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set(xlabel="ms since the step began", title=f"Pipeline timeline of step {timeline['step']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(run_dir: str, out_dir: str | None = None) -> tuple[list[str], str]:
    """Write the plots and summary.txt of ``run_dir``; returns (paths written, summary text)."""
    records, timeline, config = load_run(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no steps")
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, fn in (("loss", plot_loss), ("throughput", plot_throughput),
                     ("time_breakdown", plot_time_breakdown), ("memory", plot_memory)):
        path = os.path.join(out_dir, f"{name}.png")
        fn(records, path)
        written.append(path)
    if balance_series(records):
        path = os.path.join(out_dir, "balance.png")
        plot_balance(records, path)
        written.append(path)
    if timeline:
        path = os.path.join(out_dir, "timeline.png")
        plot_timeline(timeline, path)
        written.append(path)
    status = None
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        with open(os.path.join(run_dir, "summary.json")) as fh:
            summary = json.load(fh)
        status = summary.get("status") if isinstance(summary, dict) else None
        if status is not None and not isinstance(status, str):
            raise ValueError(f"{run_dir}/summary.json: status={status!r} must be a string")
    text = summary_text(summarize(records, timeline, config, status))
    path = os.path.join(out_dir, "summary.txt")
    with open(path, "w") as fh:
        fh.write(text)
    written.append(path)
    return written, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mpipar.report",
        description="Plots and a bottleneck summary of a training run.")
    parser.add_argument("run_dir", help="the run's directory (--run-dir of mpipar.train)")
    parser.add_argument("--out", help="where to write (default: RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        written, text = write_report(args.run_dir, args.out)
    except (OSError, ValueError) as exc:  # a missing, unreadable or malformed file
        sys.stderr.write(f"mpipar.report: error: {exc}\n")
        return 2
    except ImportError as exc:
        sys.stderr.write(f"mpipar.report: error: plotting needs matplotlib "
                         f"(pip install 'mpipar[report]'): {exc}\n")
        return 2
    sys.stdout.write(text)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
