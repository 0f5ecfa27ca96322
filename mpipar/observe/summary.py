"""A run's summary and diagnosis: its numbers (steady-state step time, throughput, MFU, the time
breakdown, bytes, memory, the pipeline bubble, validation), its bottleneck and what to change.
Read from ``metrics.jsonl``, ``timeline.json`` and ``config.toml`` (each record checked: a
malformed one is a ValueError naming the file and the field); written by every training run at
its end and by ``python -m mpipar.report``, which adds the plots. Needs no matplotlib.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mpipar.observe.metrics import (MFU_CAUSE, OPTIONAL_TIME_KEYS, TIME_KEYS, mfu_text,
                                    read_records)
from mpipar.parallel.sequence.registry import SP_MODES
from mpipar.parallel.sequence_split import MIN_CHUNK, balanced_chunks
from mpipar.runtime.precision import Precision

LABELS = {"compute": "compute", "tp_comm": "TP communication", "sp_comm": "SP communication",
          "ep_comm": "expert all-to-all (EP communication)",
          "pipeline_wait": "pipeline wait (bubble and transfers)",
          "dp_comm": "DP gradient communication", "optimizer": "optimizer step",
          "io": "I/O (checkpoints)"}


BUBBLE_LIMIT = 0.30
IMBALANCE_LIMIT = 1.10
"""The mean max/mean attention work over the sp ranks above which the diagnosis names a split
that evens it (packed documents)."""


# ----------------------------------------------------------------------------------- loading
def load_run(run_dir: str) -> tuple[list[dict], dict | None, dict | None]:
    """(metrics records, timeline or None, config dict or None) of ``run_dir``, each checked to
    hold what the analysis and the plots read (ValueError naming the file, step and field
    otherwise: the files may come from elsewhere, or be damaged)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a run directory?)")
    records = read_records(path)
    for record in records:
        _check_record(record, path)
    timeline = config = None
    if os.path.exists(os.path.join(run_dir, "timeline.json")):
        with open(os.path.join(run_dir, "timeline.json")) as fh:
            timeline = json.load(fh)
        _check_timeline(timeline, os.path.join(run_dir, "timeline.json"))
    if os.path.exists(os.path.join(run_dir, "config.toml")):
        with open(os.path.join(run_dir, "config.toml"), "rb") as fh:
            config = tomllib.load(fh)
        _check_config(config, os.path.join(run_dir, "config.toml"))
    return records, timeline, config


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers(value: Any) -> bool:
    """A list of numbers, or an object of them."""
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, list) and all(_number(v) for v in value)


def _check_record(r: dict, path: str) -> None:
    """A step record as :func:`mpipar.observe.metrics.step_record` writes it."""
    checks = [(k, r.get(k), _number) for k in ("loss", "step_time_s", "tokens_per_s", "mfu")]
    checks.append(("time", r.get("time"), lambda t: isinstance(t, dict) and all(
        _number(t.get(k)) for k in TIME_KEYS if k in t or k not in OPTIONAL_TIME_KEYS)))
    optional = {"memory_bytes": lambda v: isinstance(v, list) and _numbers(v),
                "comm_bytes_max": lambda v: isinstance(v, dict) and _numbers(v),
                "inter_node_bytes_max": _number, "skipped_steps": _number,
                "optimizer_s": _number, "optimizer_bytes": _number,
                "attention_imbalance": _number,
                "eval": lambda v: isinstance(v, dict) and _number(v.get("loss"))
                and _number(v.get("perplexity")),
                "recovered": lambda v: isinstance(v, dict) and all(
                    _number(v.get(k)) for k in ("seconds", "resumed_step", "world"))}
    checks += [(k, r[k], ok) for k, ok in optional.items() if k in r]
    for key, value, ok in checks:
        if not ok(value):
            raise ValueError(f"{path}: step {r['step']}: {key}={str(value)[:60]} is not what a "
                             f"step record holds (see docs/run-directory.md, metrics.jsonl)")


def _check_timeline(timeline: Any, path: str) -> None:
    """``{"step": int, "ranks": [{"rank": int, "coord": {"pp": int, ...}, "ops": [[kind,
    microbatch, chunk, start, end], ...]}, ...]}``."""
    def rank_ok(r: Any) -> bool:
        return (isinstance(r, dict) and isinstance(r.get("rank"), int)
                and isinstance(r.get("coord"), dict) and isinstance(r["coord"].get("pp"), int)
                and isinstance(r.get("ops"), list) and all(
                    isinstance(o, list) and len(o) == 5 and isinstance(o[0], str)
                    and _number(o[3]) and _number(o[4]) for o in r["ops"]))

    if not (isinstance(timeline, dict) and isinstance(timeline.get("step"), int)
            and isinstance(timeline.get("ranks"), list)):
        raise ValueError(f"{path}: must be an object with an integer 'step' and a list 'ranks'")
    bad = next((k for k, r in enumerate(timeline["ranks"]) if not rank_ok(r)), None)
    if bad is not None:
        raise ValueError(f"{path}: ranks[{bad}] must be an object with an integer 'rank', a "
                         f"'coord' with an integer 'pp' and 'ops' of [kind, microbatch, chunk, "
                         f"start, end]")


_CONFIG_FIELDS = {
    "parallel": {"dp": 1, "tp": 1, "pp": 1, "sp": 1, "virtual_stages": 1, "zero": 0,
                 "ranks_per_node": 0, "schedule": str, "sp_mode": str, "sp_split": str,
                 "dp_reduce": str, "grad_compression": str, "zero_shared": str,
                 "reduce_dtype": str},
    "train": {"global_batch_size": 1, "micro_batch_size": 1, "seq_len": 1, "recompute": str,
              "backend": str, "dtype": str, "document_masking": bool, "eos_token_id": -1,
              "eod_mask_loss": bool, "loss_mask": bool},
    "model": {"layers": 1, "sliding_window": 0, "window_layers": str, "moe_experts": 0,
              "moe_top_k": 0},
}
"""The config.toml fields the summary reads: a type (str, bool), or the least integer allowed."""


def _check_config(config: dict, path: str) -> None:
    for section, fields in _CONFIG_FIELDS.items():
        table = config.get(section, {})
        if not isinstance(table, dict):
            raise ValueError(f"{path}: [{section}] must be a table")
        for key, rule in fields.items():
            if key not in table:
                continue
            value = table[key]
            ok = (isinstance(value, rule) if rule in (str, bool) else
                  isinstance(value, int) and not isinstance(value, bool) and value >= rule)
            if not ok:
                what = ({str: "a string", bool: "true or false"}.get(rule)
                        or f"an integer >= {rule}")
                raise ValueError(f"{path}: {section}.{key}={value!r} must be {what}")


# ---------------------------------------------------------------------------------- analysis
def timeline_bubble(timeline: dict | None) -> float | None:
    """Mean over ranks of the fraction of the step spent blocked in pipeline receives."""
    if not timeline or not timeline.get("ranks"):
        return None
    fractions = []
    for rank in timeline["ranks"]:
        ops = rank["ops"]
        if not ops:
            continue
        span = max(o[4] for o in ops) - min(o[3] for o in ops)
        wait = sum(o[4] - o[3] for o in ops if o[0].startswith("recv"))
        fractions.append(wait / span if span > 0 else 0.0)
    return statistics.mean(fractions) if fractions else None


def steady_records(records: list[dict]) -> list[dict]:
    """The steps that measure throughput: all but the warm-up steps (``warmup``: the first step
    each process ran, a fresh run's and a resumed run's, slow with compilation and first touches;
    in a log without the mark, step 1), if there are any others."""
    steady = [r for r in records[1:] if not r.get("warmup")]
    return steady or records


def summarize(records: list[dict], timeline: dict | None = None, config: dict | None = None,
              status: str | None = None) -> dict[str, Any]:
    """The numbers of a run: losses, medians of throughput, mean time breakdown, bytes, memory."""
    if not records:
        raise ValueError("summarize: no step records")
    steady = steady_records(records)
    finite = [r["loss"] for r in records if not r.get("skipped") and not r.get("no_targets")
              and math.isfinite(r["loss"])]
    times = {k: statistics.mean(r["time"].get(k, 0.0) for r in steady) for k in TIME_KEYS}
    par = (config or {}).get("parallel", {})
    tr = (config or {}).get("train", {})
    out: dict[str, Any] = {
        "status": status,
        "steps": [records[0]["step"], records[-1]["step"]],
        "loss_first": finite[0] if finite else None,
        "loss_last": statistics.mean(finite[-LAST_K:]) if finite else None,
        "loss_last_k": min(LAST_K, len(finite)),
        "step_time_mean_s": statistics.mean(r["step_time_s"] for r in steady),
        "loss_min": min(finite) if finite else None,
        "step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "mfu_over_100": sum(r["mfu"] > 1 for r in records if not r.get("warmup")),
        "time_s": times,
        "comm_bytes_per_step": records[-1].get("comm_bytes_max", {}),
        "inter_node_bytes_per_step": records[-1].get("inter_node_bytes_max", 0),
        "memory_bytes": records[-1].get("memory_bytes", []),
        "skipped_steps": records[-1].get("skipped_steps", 0),
        "no_target_steps": [r["step"] for r in records if r.get("no_targets")],
        "eval": _last_eval(records),
        "layout": {k: par[k] for k in ("dp", "tp", "pp", "sp", "schedule", "virtual_stages",
                                       "zero", "sp_mode", "sp_split", "ranks_per_node",
                                       "dp_reduce", "grad_compression") if k in par},
    }
    if par.get("sp_split") == "balanced" and tr.get("seq_len") and par.get("sp"):
        out["layout"]["sp_min_chunk"] = par.get("sp_min_chunk", MIN_CHUNK)
        out["sp_tokens"] = tr["seq_len"] // par["sp"]
    if par.get("zero") == 3 and par.get("zero_shared", "off") != "off":
        out["layout"]["zero_shared"] = par["zero_shared"]
    if tr.get("global_batch_size") and tr.get("micro_batch_size") and par.get("dp"):
        out["layout"]["micro_batch_size"] = tr["micro_batch_size"]
        out["layout"]["microbatches"] = tr["global_batch_size"] // (par["dp"]
                                                                  * tr["micro_batch_size"])
    model = (config or {}).get("model", {})
    if model.get("layers"):
        out["layers"] = model["layers"]
    if model.get("sliding_window"):
        out["window"] = {"sliding_window": model["sliding_window"],
                         "window_layers": model.get("window_layers", "all"),
                         "seq_len": tr.get("seq_len")}
    out.update(_documents(tr, steady))
    out.update(_optimizer_cost(steady, tr, out["step_time_s"]))
    if tr.get("recompute"):
        out["layout"]["recompute"] = tr["recompute"]
        out["layout"]["backend"] = tr["backend"]
    if tr.get("dtype"):
        out["dtype"] = tr["dtype"]
        out["precision"] = Precision.named(tr["dtype"], par.get("reduce_dtype", "float32")
                                           ).describe()
    out.update(_moe_dropped(records, model.get("moe_top_k")))
    out.update(_moe_balance(steady, model))
    mtp = [r["mtp_loss"] for r in records if _number(r.get("mtp_loss"))]
    if mtp:   # multi-token prediction: its loss over the last steps, beside the main loss
        out["mtp_loss_last"] = statistics.mean(mtp[-LAST_K:])
    bubble = timeline_bubble(timeline)
    if bubble is None:
        pipe = times["compute"] + times["tp_comm"] + times["sp_comm"] + times["pipeline_wait"]
        bubble = times["pipeline_wait"] / pipe if pipe > 0 else 0.0
    out["bubble"] = bubble
    recoveries = [dict(r["recovered"], step=r["step"]) for r in records
                  if isinstance(r.get("recovered"), dict)]
    if recoveries:
        out["recoveries"] = recoveries
    return out


def recovery_text(rec: dict[str, Any]) -> str:
    """One line naming a recovery of ``--on-rank-failure shrink`` (a ``recovered`` record of
    metrics.jsonl, with ``step``: the first step trained after it)."""
    when = (f"in step {rec['failed_step']}" if "failed_step" in rec
            else f"before step {rec['step']}")
    worlds = (f"{rec['old_world']} -> {rec['world']} ranks" if "old_world" in rec
              else f"{rec['world']} ranks after")
    layouts = (f", {rec['old_layout']} -> {rec['layout']}" if "old_layout" in rec else "")
    redone = (f", {rec['steps_redone']} step(s) redone" if "steps_redone" in rec else "")
    return (f"recovery {when}: rank(s) {rec['failed_ranks']} lost ({worlds}{layouts}); "
            f"state of step {rec['resumed_step']} restored from {rec['from']}{redone}; "
            f"{rec['seconds']:.3g} s to recover; go on with {rec['layout_flags']}")


def _documents(train: dict[str, Any], steady: list[dict]) -> dict[str, Any]:
    """``documents`` (``--document-masking``: the EOS id), ``loss_targets`` (what
    ``--eod-mask-loss`` and ``--loss-mask`` leave out) and ``attention_imbalance`` (the mean
    and the worst over the steady steps of the sp ranks' attention work, max over mean)."""
    out: dict[str, Any] = {}
    if train.get("document_masking"):
        out["documents"] = {"eos_token_id": train.get("eos_token_id")}
    dropped = (["EOS inputs (--eod-mask-loss)"] if train.get("eod_mask_loss") else []) + (
        ["prompt tokens (--loss-mask: completions only)"] if train.get("loss_mask") else [])
    if dropped:
        out["loss_targets"] = "all but " + " and ".join(dropped)
    values = [r["attention_imbalance"] for r in steady if "attention_imbalance" in r]
    if values:
        out["attention_imbalance"] = {"mean": statistics.mean(values), "max": max(values)}
    return out


def _optimizer_cost(steady: list[dict], train: dict[str, Any], step_s: float
                    ) -> dict[str, Any]:
    """What the optimizer step costs (rank 0's ``optimizer_s`` and ``optimizer_bytes``):
    median seconds, their share of the median step, median bytes handed to MPI."""
    timed = [r for r in steady if "optimizer_s" in r]
    if not timed:
        return {}
    seconds = statistics.median(r["optimizer_s"] for r in timed)
    return {"optimizer_cost": {"optimizer": train.get("optimizer", "adamw"), "seconds": seconds,
                               "share": seconds / step_s if step_s > 0 else 0.0,
                               "bytes": int(statistics.median(r["optimizer_bytes"]
                                                              for r in timed))}}


def optimizer_text(cost: dict[str, Any]) -> str:
    """The summary's line on what the optimizer step costs."""
    return (f"optimizer ({cost['optimizer']}, rank 0, median): {cost['seconds']:.4g} s a step "
            f"({100 * cost['share']:.1f}% of the median step), {cost['bytes']:,} bytes a step "
            f"handed to MPI")


def _moe_dropped(records: list[dict], top_k: int | None) -> dict[str, Any]:
    """``moe_dropped``: the assignments the expert capacity dropped over the run (every step
    and sparse layer), and with ``top_k`` their share of the sparse layers' assignments
    (``moe_dropped_fraction``); nothing for a run that dropped none."""
    rows = [r for r in records if r.get("moe_dropped")]
    total = sum(sum(r["moe_dropped"].values()) for r in rows)
    if not total:
        return {}
    out: dict[str, Any] = {"moe_dropped": total}
    if top_k:
        out["moe_dropped_fraction"] = total / sum(r["tokens"] * top_k * len(r["moe_dropped"])
                                                  for r in rows)
    return out


LAST_K = 5
"""The steps the summary's final loss and the experts' balance are means over (the last k)."""
COLLAPSE = 0.95
"""The share of its ceiling (experts / top-k) above which a sparse layer's load max/mean is
called collapsed: the router sends (nearly) every token to the same top-k experts."""


def _moe_balance(steady: list[dict], model: dict[str, Any]) -> dict[str, Any]:
    """``moe_balance`` of a mixture-of-experts run: over its last :data:`LAST_K` steady steps
    the mean balance loss (``aux_loss``) and each sparse layer's mean load max/mean (``load``),
    against the ``ceiling`` experts / top-k, with the ``collapsed`` layers (above
    :data:`COLLAPSE` of it) and the config's balance settings; nothing for a dense run."""
    rows = [r for r in steady if r.get("moe_load_max_over_mean")][-LAST_K:]
    if not rows:
        return {}
    layers = sorted({k for r in rows for k in r["moe_load_max_over_mean"]}, key=int)
    load = {k: statistics.mean(r["moe_load_max_over_mean"][k] for r in rows
                               if k in r["moe_load_max_over_mean"]) for k in layers}
    experts, top_k = model.get("moe_experts"), model.get("moe_top_k")
    ceiling = experts / top_k if experts and top_k else None
    aux = [r["moe_aux_loss"] for r in rows if _number(r.get("moe_aux_loss"))]
    return {"moe_balance": {
        "steps": len(rows), "aux_loss": statistics.mean(aux) if aux else None, "load": load,
        "ceiling": ceiling,
        "collapsed": [k for k, v in load.items() if ceiling and v >= COLLAPSE * ceiling],
        "aux_loss_coef": model.get("moe_aux_loss_coef"),
        "bias_update_rate": model.get("moe_bias_update_rate")}}


def _balance_text(b: dict[str, Any]) -> str:
    """The summary's line on the experts' balance."""
    ceiling = f" (ceiling experts / top-k = {b['ceiling']:g})" if b["ceiling"] else ""
    aux = "n/a" if b["aux_loss"] is None else f"{b['aux_loss']:.4g}"
    collapsed = (f"; collapsed: layer(s) {', '.join(b['collapsed'])}" if b["collapsed"]
                 else "")
    return (f"expert balance (mean of the last {b['steps']} steps): balance loss {aux}, load "
            f"max/mean per sparse layer " + ", ".join(f"{k}: {v:.2f}" for k, v in b["load"].items())
            + ceiling + collapsed)


def _balance_remedy(b: dict[str, Any] | None) -> list[str]:
    """What to change when the router collapsed in some sparse layers."""
    if not b or not b["collapsed"]:
        return []
    coef = b.get("aux_loss_coef")
    now = f" (now {coef:g})" if _number(coef) else ""
    bias = ("" if _number(b.get("bias_update_rate")) and b["bias_update_rate"] > 0
            else ", or loss-free balancing with --moe-bias-update-rate 0.001")
    return [f"the router collapsed in sparse layer(s) {', '.join(b['collapsed'])} (load "
            f"max/mean at its ceiling {b['ceiling']:g}: every token to the same top-k experts): "
            f"raise --moe-aux-loss-coef{now}{bias}; --moe-capacity-factor bounds an expert's "
            f"load meanwhile"]


def _last_eval(records: list[dict]) -> dict[str, Any] | None:
    """The last validation of a run: ``step``, ``loss``, ``perplexity`` (None if none ran)."""
    evals = [r for r in records if "eval" in r]
    if not evals:
        return None
    return {"step": evals[-1]["step"], "loss": evals[-1]["eval"]["loss"],
            "perplexity": evals[-1]["eval"]["perplexity"]}


def diagnose(summary: dict[str, Any]) -> list[str]:
    """The bottleneck (first line) and what to change (following lines) of a run summary."""
    t = summary["time_s"]
    total = sum(t.values()) or 1.0
    frac = {k: v / total for k, v in t.items()}
    worst = max(TIME_KEYS, key=lambda k: t[k])
    lay = summary.get("layout", {})
    dp, tp, pp, sp = (lay.get(k, 1) for k in ("dp", "tp", "pp", "sp"))
    lines = [f"bottleneck: {LABELS[worst]} ({100 * frac[worst]:.0f}% of the step time)"]
    bubble = summary.get("bubble", 0.0)
    if pp > 1 and bubble > BUBBLE_LIMIT:
        lines.append(f"pipeline bubble {100 * bubble:.0f}% > {100 * BUBBLE_LIMIT:.0f}%: use "
                     + ", or ".join(_bubble_remedies(lay, summary.get("layers"))))
    if tp > 1 and t["tp_comm"] > t["compute"]:
        lines.append(f"TP communication ({t['tp_comm']:.3g} s) is above compute "
                     f"({t['compute']:.3g} s): use a smaller --tp (e.g. --tp {tp // 2}) and give "
                     f"the factor to dp or pp; keep tp within a node")
    window = summary.get("window")
    if sp > 1 and t["sp_comm"] > 0.5 * t["compute"]:
        if window and not SP_MODES[lay.get("sp_mode", "ring")].sends_window:
            lines.append(f"SP communication ({t['sp_comm']:.3g} s) is over half of compute: with "
                         f"a sliding window of {window['sliding_window']} tokens, --sp-mode halo "
                         f"sends each rank only the K/V within the window (bytes grow with the "
                         f"window, not the sequence); or use a smaller --sp")
        else:
            lines.append(f"SP communication ({t['sp_comm']:.3g} s) is over half of compute: use "
                         f"a smaller --sp, --sp-overlap (ring), or --sp-mode ulysses; SP pays off "
                         f"for long sequences")
    if dp * sp > 1 and frac["dp_comm"] > 0.25:
        lines.append(f"gradient reduction over dp x sp takes {100 * frac['dp_comm']:.0f}% of the "
                     f"step: do more work per reduction (a larger global batch per rank), use "
                     f"fewer DP ranks, or a larger --bucket-mb so reductions overlap backward")
    lines += _imbalance_remedy(summary.get("attention_imbalance"), lay, summary.get("sp_tokens"))
    if frac.get("ep_comm", 0.0) > 0.25:
        lines.append(f"the experts' all-to-all takes {100 * frac['ep_comm']:.0f}% of the step: "
                     f"a smaller --ep (experts replicated over fewer ranks), ep within a node, "
                     f"or more tokens per microbatch")
    lines += _balance_remedy(summary.get("moe_balance"))
    if frac["optimizer"] > 0.25:
        zero = (" --zero 1 shards it over dp x sp;" if dp * sp > 1 and not lay.get("zero")
                else "")
        lines.append(f"the optimizer step takes {100 * frac['optimizer']:.0f}% of the step:{zero} "
                     f"larger batches amortise it")
    if frac["io"] > 0.10:
        lines.append(f"I/O takes {100 * frac['io']:.0f}% of the time: checkpoint less often "
                     f"(--save-every)")
    if summary.get("mfu_over_100"):
        lines.append(f"{summary['mfu_over_100']} step(s) report an MFU over 100%: {MFU_CAUSE}")
    if summary.get("skipped_steps"):
        lines.append(f"{summary['skipped_steps']} step(s) were skipped for a non-finite loss or "
                     f"gradient norm: lower --lr, lengthen --warmup-steps or lower --clip-grad")
    memory = [m for m in summary.get("memory_bytes", []) if m]
    if len(memory) > 1 and max(memory) > 1.5 * min(memory):
        hi, lo = memory.index(max(memory)), memory.index(min(memory))
        lines.append(f"memory is unbalanced: rank {hi} peaks at {max(memory) / 2**20:.0f} MiB, "
                     f"rank {lo} at {min(memory) / 2**20:.0f} MiB (pipeline stages with the "
                     f"embedding or head, or ZeRO off); --recompute or --zero 1 lowers the peak")
    if len(lines) == 1:
        if worst == "compute":
            kernels = ("; --backend auto (numba, or cupy on a GPU) is faster than numpy"
                       if lay.get("backend") == "numpy" else "")
            lines.append(f"compute-bound at {mfu_text(summary.get('mfu', 0), 1)}: larger "
                         f"microbatches use the GEMMs better{kernels}")
        else:
            lines.append(f"no rule fired; the largest share is {LABELS[worst]}")
    return lines


def _imbalance_remedy(imbalance: dict[str, float] | None, lay: dict[str, Any],
                      tokens: int | None = None) -> list[str]:
    """What evens the sp ranks' attention work of a run whose mean max/mean is above
    :data:`IMBALANCE_LIMIT`: another split or mode; under the balanced split, smaller chunks
    where ``--sp-min-chunk`` kept a rank's ``tokens`` in fewer chunks than the finest deal's,
    else nothing."""
    if not imbalance or imbalance["mean"] <= IMBALANCE_LIMIT:
        return []
    head = (f"attention work is uneven over the sp ranks (max/mean {imbalance['mean']:.2f} on "
            f"average): ")
    if lay.get("sp_split") == "balanced":
        floor = lay.get("sp_min_chunk", MIN_CHUNK)
        chunks = balanced_chunks(tokens, floor) if tokens else 0
        if not tokens or chunks >= balanced_chunks(tokens, 1):
            return []
        return [head + f"--sp-split balanced cut a rank's {tokens} tokens into at most "
                       f"{chunks} chunk(s) (--sp-min-chunk {floor}); a "
                       f"smaller --sp-min-chunk deals finer chunks, at a kernel call per pair "
                       f"of a rank's runs in each ring block"]
    mode = SP_MODES[lay.get("sp_mode", "ring")]
    if mode.balanced_split:
        return [head + "--sp-split balanced deals each microbatch's documents so that every "
                       "rank's work is equal"]
    dealer = next(m for m in SP_MODES.values() if m.balanced_split)
    return [head + f"--sp-mode {dealer.name} --sp-split balanced deals each microbatch's "
                   "documents evenly" + mode.balance_hint]


def _bubble_remedies(lay: dict[str, Any], layers: int | None) -> list[str]:
    """What would shrink the pipeline bubble of a run with layout ``lay`` (its pp, schedule,
    virtual stages, micro-batch size and microbatches) and ``layers`` blocks (None: unknown),
    leaving out what the run already did."""
    pp, v = lay["pp"], lay.get("virtual_stages", 1)
    schedule, m, mbs = lay.get("schedule"), lay.get("microbatches"), lay.get("micro_batch_size")
    now = f" (now {m} per step for pp={pp})" if m else ""
    how = "a larger --global-batch-size" if mbs == 1 else "a smaller --micro-batch-size"
    out = [f"more microbatches{now} with {how}"]
    if layers is None:
        fits = [2 * v]
    else:
        fits = [w for w in range(v + 1, layers // pp + 1) if layers % (pp * w) == 0]
    if fits and schedule == "interleaved":
        out.append(f"more virtual stages (--virtual-stages {fits[0]}, now {v})")
    elif fits:
        out.append(f"interleaving (--schedule interleaved --virtual-stages {fits[0]})")
    if schedule != "zb-h1":
        out.append("--schedule zb-h1")
    return out


def _attention_text(s: dict[str, Any]) -> str:
    """The attention a run computed: full causal or sliding windows, within documents."""
    window = s.get("window")
    if not window:
        text = "full causal"
    else:
        seq = f" of seq_len {window['seq_len']}" if window.get("seq_len") else ""
        text = (f"sliding window {window['sliding_window']}{seq} on layers "
                f"{window['window_layers']}")
    if s.get("documents"):
        eos = s["documents"]["eos_token_id"]
        end = (f"EOS id {eos}" if isinstance(eos, int) and eos >= 0
               else "the EOS token the data records")
        text = f"document-masked (documents end at {end}), {text} within each document"
    imbalance = s.get("attention_imbalance")
    if imbalance:
        text += (f"; work over the sp ranks max/mean {imbalance['mean']:.3f} on average, "
                 f"{imbalance['max']:.3f} at worst (1 = even)")
    return text


def summary_text(summary: dict[str, Any]) -> str:
    """Human-readable summary: the numbers, then :func:`diagnose`."""
    s = summary
    lay = s.get("layout", {})
    t = s["time_s"]
    total = sum(t.values()) or 1.0
    loss = ("n/a" if s["loss_first"] is None else
            f"first {s['loss_first']:.4f} -> mean of the last {s.get('loss_last_k', 5)} "
            f"{s['loss_last']:.4f} (min {s['loss_min']:.4f})")
    mean_step = (f" (mean {s['step_time_mean_s']:.4g} s)" if "step_time_mean_s" in s else "")
    out = [f"run: steps {s['steps'][0]}..{s['steps'][1]}"
           + (f", {s['status']}" if s.get("status") else ""),
           "layout: " + " ".join(f"{k}={v}" for k, v in lay.items()),
           *([f"precision: {s['precision']}"] if s.get("precision") else []),
           *([f"kernels: {s['kernels']}"] if s.get("kernels") else []),
           "attention: " + _attention_text(s),
           f"loss: {loss}" + (f" (targets: {s['loss_targets']})" if s.get("loss_targets")
                              else ""),
           *([_no_targets_text(s["no_target_steps"])] if s.get("no_target_steps") else []),
           *([f"validation loss: {s['eval']['loss']:.4f} (perplexity "
              f"{s['eval']['perplexity']:.3f}) at step {s['eval']['step']}"] if s.get("eval")
             else []),
           f"throughput (medians without warm-up steps): {s['tokens_per_s']:,.0f} tokens/s, median "
           f"step {s['step_time_s']:.4g} s{mean_step}, {mfu_text(s['mfu'])}",
           "time per step (mean over steps without warm-up and ranks): " + ", ".join(
               f"{k} {t[k]:.3g} s ({100 * t[k] / total:.0f}%)" for k in TIME_KEYS)
           + f"; {total:.4g} s in all (the mean step and the I/O between steps)",
           *([optimizer_text(s["optimizer_cost"])] if s.get("optimizer_cost") else []),
           f"pipeline bubble: {100 * s['bubble']:.0f}%",
           "bytes per step (busiest rank): " + (", ".join(
               f"{g} {b:,}" for g, b in s["comm_bytes_per_step"].items()) or "none")
           + (f"; on the wire across nodes {s['inter_node_bytes_per_step']:,}"
              if s.get("inter_node_bytes_per_step") else ""),
           "peak memory per rank (MiB): " + ", ".join(
               f"{m / 2**20:.0f}" for m in s["memory_bytes"]),
           f"skipped steps: {s['skipped_steps']}",
           *([f"expert capacity: {s['moe_dropped']:,} assignments dropped"
              + (f" ({100 * s['moe_dropped_fraction']:.2f}% of the sparse layers')"
                 if "moe_dropped_fraction" in s else "")] if s.get("moe_dropped") else []),
           *([_balance_text(s["moe_balance"])] if s.get("moe_balance") else []),
           *([f"multi-token prediction loss (mean of the last {min(LAST_K, s['loss_last_k'])} "
              f"steps, beside the loss above): {s['mtp_loss_last']:.4g}"]
             if s.get("mtp_loss_last") is not None else []),
           *(recovery_text(r) for r in s.get("recoveries", ()))]
    return "\n".join(out + diagnose(s)) + "\n"



def _no_targets_text(steps: list[int]) -> str:
    """The summary's line on the steps whose global batch had no counted target."""
    shown = ", ".join(map(str, steps[:10])) + (", ..." if len(steps) > 10 else "")
    return (f"steps with no counted target: {len(steps)} (step {shown}): every label of the "
            f"global batch masked; their loss and gradient norm are 0 by definition, left out "
            f"of the loss figures above")
