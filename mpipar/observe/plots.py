"""The plots of a run (``python -m mpipar.report`` draws them): loss, throughput, time breakdown,
memory, balance and the pipeline timeline of the last recorded step, each a PNG. The loss and
throughput plots mark each rank-failure recovery (``--on-rank-failure shrink``) with a dashed
line before the first step trained after it. Needs matplotlib (the ``[report]`` extra),
imported on the first plot."""
from __future__ import annotations

import math
from typing import Any

from mpipar.observe.metrics import COMPUTE_OPS, TIME_KEYS
from mpipar.observe.summary import LABELS, steady_records

COLORS = {"compute": "#4c72b0", "tp_comm": "#dd8452", "sp_comm": "#937860", "ep_comm": "#da8bc3",
          "pipeline_wait": "#c44e52", "dp_comm": "#55a868", "optimizer": "#8172b3",
          "io": "#8c8c8c"}
OP_COLORS = {"fwd": "#4c72b0", "bwd": "#dd8452", "bwd_input": "#dd8452", "bwd_weight": "#f3b77b",
             "recv_fwd": "#d9d9d9", "recv_bwd": "#d9d9d9"}


def _figure(width: float = 8, height: float = 4.5):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt, *plt.subplots(figsize=(width, height))


def recovery_marks(records: list[dict]) -> list[tuple[float, str]]:
    """(x, label) of each recovery's marker: half a step before the first step after it."""
    return [(r["step"] - 0.5, f"ranks {r['recovered'].get('old_world', '?')} -> "
                              f"{r['recovered']['world']}")
            for r in records if isinstance(r.get("recovered"), dict)]


def _mark_recoveries(ax, records: list[dict]) -> None:
    for i, (x, label) in enumerate(recovery_marks(records)):
        ax.axvline(x, color="black", ls=":", lw=1.0,
                   label="rank failure recovered" if i == 0 else None)
        ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), fontsize="x-small",
                    rotation=90, va="top", ha="right")


def plot_loss(records: list[dict], path: str) -> None:
    plt, fig, ax = _figure()
    measured = [r for r in records if not r.get("skipped") and not r.get("no_targets")]
    ax.plot([r["step"] for r in measured], [r["loss"] for r in measured], lw=1.2,
            label="training loss")
    skipped = [r["step"] for r in records if r.get("skipped")]
    if skipped:
        top = max((r["loss"] for r in records if math.isfinite(r["loss"])), default=1.0)
        ax.scatter(skipped, [top] * len(skipped), marker="x", color="red", label="skipped step")
    evals = [r for r in records if "eval" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval"]["loss"] for r in evals], "o-", lw=1.2,
                color="#dd8452", label="validation loss")
    _mark_recoveries(ax, records)
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
    tokens = ax.plot(steps, [r["tokens_per_s"] for r in records], color="#4c72b0",
                     label="tokens / s (left)")
    ax.set(xlabel="step", ylabel="tokens / s", title="Throughput and MFU (warm-up steps left out)")
    right = ax.twinx()
    mfu = right.plot(steps, [100 * r["mfu"] for r in records], color="#dd8452", ls="--",
                     label="MFU % (right)")
    right.set_ylabel("MFU (%)")
    _mark_recoveries(ax, records)
    ax.legend(tokens + mfu, [line.get_label() for line in tokens + mfu], fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_time_breakdown(records: list[dict], path: str) -> None:
    plt, fig, ax = _figure(9, 4.5)
    records = steady_records(records)
    steps = [r["step"] for r in records]
    bottom = [0.0] * len(records)
    for k in TIME_KEYS:
        values = [r["time"].get(k, 0.0) for r in records]
        ax.bar(steps, values, bottom=bottom, width=1.0, color=COLORS[k], label=LABELS[k],
               linewidth=0)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="step", ylabel="seconds (mean over ranks)",
           title="Where a step's time goes (warm-up steps left out)")
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


def balance_title(series: dict[str, Any]) -> str:
    """balance.png's title: only what the run records (:func:`balance_series`' labels)."""
    parts = (["attention work over sp ranks"] if "attention work, sp ranks" in series else []) + (
        ["expert load per sparse layer"] if any(k.startswith("expert") for k in series) else [])
    return "Balance: " + ", ".join(parts)


def plot_balance(records: list[dict], path: str, ceiling: float | None = None) -> None:
    """Max over mean per step (1 = perfectly even) of :func:`balance_series`; ``ceiling``: the
    experts' load max/mean when the router sends every token to the same top-k experts
    (experts / top-k), drawn when given. The title names only what the run records."""
    plt, fig, ax = _figure()
    series = balance_series(records)
    for label, (steps, values) in series.items():
        ax.plot(steps, values, lw=1.2, label=label)
    ax.axhline(1.0, color="#8c8c8c", lw=0.8, ls="--")
    experts = any(label.startswith("expert") for label in series)
    if ceiling and experts:
        ax.axhline(ceiling, color="#c44e52", lw=0.8, ls=":",
                   label=f"collapse ceiling (experts / top-k = {ceiling:g})")
    ax.set(xlabel="step", ylabel="max / mean (1 = even)", title=balance_title(series))
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
    stages = len({r["coord"]["pp"] for r in ranks})
    what = "Pipeline timeline" if stages > 1 else "Timeline (forward and backward ops)"
    ax.set(xlabel="ms since the step began", title=f"{what} of step {timeline['step']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
