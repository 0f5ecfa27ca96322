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

The plots are :mod:`mpipar.observe.plots`'s. The analysis (:mod:`mpipar.observe.summary`) needs
no matplotlib; ``train`` writes the same summary at the end of every run. Plotting needs the
``[report]`` extra (matplotlib).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from mpipar.observe.plots import (balance_series, plot_balance, plot_loss, plot_memory,
                                  plot_throughput, plot_time_breakdown, plot_timeline)
from mpipar.observe.summary import load_run, summarize, summary_text


def write_report(run_dir: str, out_dir: str | None = None) -> tuple[list[str], str]:
    """Write summary.txt and the plots of ``run_dir``; returns (paths written, summary text).
    Without matplotlib, summary.txt only, and the text says how to get the plots."""
    records, timeline, config = load_run(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no steps")
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
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
    written = [path]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return written, text + (f"plots: not drawn, matplotlib is not installed "
                                f"(pip install 'mpipar[report]', then python -m mpipar.report "
                                f"{run_dir})\n")
    return _plots(records, timeline, config, out_dir) + written, text


def _plots(records: list[dict], timeline: dict | None, config: dict | None,
           out_dir: str) -> list[str]:
    """The PNGs of a run, into ``out_dir``; their paths."""
    written = []
    for name, fn in (("loss", plot_loss), ("throughput", plot_throughput),
                     ("time_breakdown", plot_time_breakdown), ("memory", plot_memory)):
        path = os.path.join(out_dir, f"{name}.png")
        fn(records, path)
        written.append(path)
    if balance_series(records):
        model = (config or {}).get("model", {})
        experts, top_k = model.get("moe_experts"), model.get("moe_top_k")
        path = os.path.join(out_dir, "balance.png")
        plot_balance(records, path, experts / top_k if experts and top_k else None)
        written.append(path)
    if timeline:
        path = os.path.join(out_dir, "timeline.png")
        plot_timeline(timeline, path)
        written.append(path)
    return written


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
