"""``python -m mpipar.plan --world N``: which layouts fit, how much memory and traffic each
needs, and which should be fastest.

    python -m mpipar.plan --world 8 [--memory-gb G] [--top K] [model/train/parallel flags | --config FILE]

Every factorisation ``dp x tp x pp x sp`` of the world is tried with every free choice (pipeline
schedule, SP mode and split, microbatch size, ZeRO stage; with ``--ranks-per-node K`` describing
several nodes also flat or hierarchical reduction, no, int8 or top-k gradient compression, and
hybrid SP with Ulysses inside a node); flags given fix a choice. Per layout the first recompute
mode (none, selective, full) that fits ``--memory-gb`` is taken. Layouts are ranked by the step
time model of :mod:`mpipar.plan.step_time`, with a rank's rates probed here on its share of the
cores (:mod:`mpipar.plan.probe`: the model's own forward and backward, a kernel call, a
memory-bound pass; or ``--peak-gflops``), the links inside a node (``--intra-gbps``,
default half this machine's memory-copy bandwidth: a shared-memory transport copies twice) and
across nodes (``--inter-gbps``, default 10) and compression's encode/decode work measured here,
or all of them from ``--hardware FILE`` (``python -m mpipar.bench comm``: its nodes too). Step
times within 10% of each other are a tie, marked ``N=``: the simplest layout of a tie is listed
first (and ``train`` picks it). Each row shows its bytes per group and, across nodes, the wire
bytes on the slow link. The rejected ones are listed with the configuration rule they break or
the memory they would need. With ``--document-masking`` attention's work and the ring's traffic
are those of the data's first global batch (its documents; the balanced split is tried too).
The times are those of this machine without other work; a busy machine's load average is
printed with how much longer it makes steps (:func:`machine_load`).
Exit status 0 when a layout fits, 1 when none does, 2 for bad flags or data the run could not
read.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import numpy as np

from mpipar.config import cli as config_cli
from mpipar.config import Config, ConfigError
from mpipar.model.params import param_specs
from mpipar.layout import resolve_model
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.plan.memory import trained_parameter_count
from mpipar.plan.search import TIE, Candidate, Plan, plan_layouts
from mpipar.plan.step_time import Hardware, StepDocuments, with_nodes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpipar.plan",
        description="Enumerate, check and rank the parallel layouts of a model on N ranks.")
    parser.add_argument("--world", type=int, required=True, metavar="N", help="number of ranks")
    parser.add_argument("--memory-gb", type=float, metavar="G",
                        help="memory per rank in GiB (default: no limit)")
    parser.add_argument("--top", type=int, default=10, metavar="K",
                        help="show the K fastest layouts (default 10; 0 shows all)")
    parser.add_argument("--peak-gflops", type=float, metavar="F",
                        help="per-rank peak GFLOP/s (default: a GEMM probe on this machine)")
    parser.add_argument("--inter-gbps", "--bandwidth-gbs", dest="inter_gbps", type=float,
                        default=10.0, metavar="B",
                        help="per-rank link bandwidth across nodes in GB/s (default 10)")
    parser.add_argument("--intra-gbps", type=float, metavar="B",
                        help="per-rank link bandwidth inside a node in GB/s (default: half "
                             "the memory-copy bandwidth a probe measures here)")
    parser.add_argument("--inter-latency-us", "--latency-us", dest="inter_latency_us",
                        type=float, default=10.0, metavar="L",
                        help="seconds per MPI call across nodes, in microseconds (default 10)")
    parser.add_argument("--intra-latency-us", type=float, default=1.0, metavar="L",
                        help="seconds per MPI call inside a node, in microseconds (default 1)")
    parser.add_argument("--hardware", metavar="FILE",
                        help="measured peak, links, op overhead, nodes and compression work from "
                             "python -m mpipar.bench comm (replaces the five options above)")
    config_cli.add_arguments(parser)
    return parser


def _fail(message: str) -> int:
    sys.stderr.write(f"mpipar.plan.cli: error: {message}\n")
    return 2


def _gib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def _nodes(base: Config, world: int) -> str:
    k = base.parallel.ranks_per_node
    if not k or k >= world:
        return "one node"
    return f"{world // k} nodes x {k} ranks"


def format_plan(plan: Plan, base: Config, world: int, hw: Hardware, memory_gb: float | None,
                top: int, peak_note: str, link_note: str = "given",
                documents: StepDocuments | None = None, load_line: str = "") -> str:
    """The report printed by the CLI; ``load_line``: what the machine's load does to it."""
    m, tr = resolve_model(base.model), base.train
    params = sum(math.prod(s.shape) for s in param_specs(m))
    lines = [
        f"mpipar plan: world {world}, model {m.layers} layers x {m.hidden} hidden, heads "
        f"{m.heads}/{m.kv_heads}, vocab {m.vocab_size} ({params / 1e6:.2f} M parameters), global "
        f"batch {tr.global_batch_size} x {tr.seq_len} tokens, {tr.dtype}",
        _training_line(base),
        f"time model: FLOPs / {hw.peak_flops / 1e9:,.1f} GFLOP/s per rank + kernel calls x "
        f"{hw.op_overhead * 1e6:,.1f} us + optimizer passes / {hw.elementwise_rate / 1e6:,.0f} M "
        f"elements/s ({peak_note}) + wire "
        f"bytes / link bandwidth + latency per MPI call, inside a node "
        f"{hw.intra_bandwidth / 1e9:.3g} GB/s ({link_note}) + {hw.intra_latency * 1e6:g} us, "
        f"across nodes {hw.bandwidth / 1e9:g} GB/s + {hw.latency * 1e6:g} us "
        f"({_nodes(base, world)}); compression's work {hw.int8_seconds * 1e9:.3g} ns (int8), "
        f"{hw.topk_seconds * 1e9:.3g} ns (top-k) per element; the pipeline by "
        f"a dry run of its schedule (bubble included)",
        *([_documents_line(documents, tr.seq_len)] if documents is not None else []),
        *([load_line] if load_line else []),
        f"memory limit: {'none' if memory_gb is None else f'{memory_gb:g} GiB per rank'}",
        "",
        f"{'#':>3}  {'layout':<66} {'step ms':>8} {'tok/s':>10} {'bubble':>6}  "
        f"{'memory MiB: total = weights + grads + optimizer + activations':<60}  "
        f"bytes/step per group",
    ]
    shown = plan.ranked if top == 0 else plan.ranked[:top]
    for i, c in enumerate(shown, 1):
        lines.append(_row(i, c, tr.global_batch_size * tr.seq_len))
    if len(shown) < len(plan.ranked):
        lines.append(f"     ... {len(plan.ranked) - len(shown)} more (--top 0 shows all)")
    if any(c.tie for c in shown):
        lines.append(f"     N=: a tie, step times within {100 * TIE:g}% of the tie's fastest (the "
                     f"time model cannot tell them apart); the simplest layout of a tie is "
                     f"listed first (fewest parallel axes, then the lowest ZeRO stage, no node "
                     f"shared memory, least recompute), and train picks it")
    if not plan.ranked:
        lines.append("     no layout fits")
    if plan.rejected:
        lines += ["", f"rejected ({len(plan.rejected)}):"]
        lines += [f"  {r.layout}: {r.reason}" for r in plan.rejected]
    return "\n".join(lines) + "\n"


def _training_line(base: Config) -> str:
    """What trains and how: the parameters trained (under LoRA the adapters alone), the
    optimizer, and the objective's rows (DPO: two a pair)."""
    tr = base.train
    trained = trained_parameter_count(base.model, tr)
    what = (f"LoRA rank {tr.lora_rank} on {tr.lora_targets}, the base frozen"
            if tr.lora_rank else "every parameter")
    rows = (f"; DPO: the global batch counts pairs, "
            + ("packed, a row each" if tr.pack_pairs else f"{tr.rows_per_sample} rows each")
            if tr.sequences_per_sample > 1 else "")
    return (f"training: {trained / 1e6:,.3f} M parameters train ({what}), optimizer "
            f"{tr.optimizer}{rows}")


def _documents_line(documents: StepDocuments, seq_len: int) -> str:
    """What the plan read of the packed documents: their count and mean length in the first
    global batch, and the keys a query then sees against full causal attention's."""
    from mpipar.model.flops import document_context
    ids = documents.ids
    count = int((np.diff(ids, axis=1) != 0).sum() + ids.shape[0])
    return (f"documents (--document-masking): the data's first global batch holds {count} "
            f"documents of {ids.size / count:,.1f} tokens on average; a query sees "
            f"{document_context(ids, 0):,.1f} keys on average ({(seq_len + 1) / 2:,.1f} full "
            f"causal): attention and the ring's hops are the batch's")


def _row(i: int, c: Candidate, tokens: int) -> str:
    label = f"{c.tie:>3}=" if c.tie else f"{i:>3} "
    mem = c.memory
    memory = (f"{_gib(mem.total)} = {_gib(mem.weights + mem.masters)} + {_gib(mem.grads)} + "
              f"{_gib(mem.optimizer)} + {_gib(mem.activations)}")
    inter = sum(links["inter"] for links in c.link_bytes.values())
    traffic = ", ".join(f"{g} {b:,}" for g, b in sorted(c.step_bytes.items())) or "none"
    traffic += f" | across nodes {inter:,}" if inter else ""
    return (f"{label} {c.describe():<66} {1e3 * c.time.total:>8.2f} "
            f"{tokens / c.time.total:>10,.0f} {100 * c.time.bubble:>5.0f}%  {memory:<60}  "
            f"{traffic}")


def memory_copy_bandwidth(nbytes: int = 1 << 26, repeats: int = 5) -> float:
    """Bytes/s of the fastest of ``repeats`` copies of ``nbytes`` on this machine (a probe, in
    CPU seconds: other processes' load does not lengthen it)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        np.copyto(dst, src)
        best = min(best, time.process_time() - t0)
    return nbytes / best


def codec_seconds(base: Config) -> tuple[float, float]:
    """Seconds per element of a rank's int8 and top-k work in a compressed reduction, probed
    here; (0, 0) when no layout of the plan compresses (no nodes given, compression off)."""
    par = base.parallel
    if not par.ranks_per_node and not reduction_of(par).compresses:
        return 0.0, 0.0
    from mpipar.parallel.compression import Int8Codec, TopKCodec, local_work_seconds
    from mpipar.runtime.precision import Precision
    grads = Precision.of(base.train, par).master          # codecs encode the gradients
    return (local_work_seconds(Int8Codec(np), dtype=grads),
            local_work_seconds(TopKCodec(np, par.topk_ratio), dtype=grads))


def rank_rates(base: Config, on_node: int) -> tuple[float, float, float, str]:
    """A rank's rates as ``train`` runs it, ``on_node`` ranks sharing this node: the probes of
    :func:`mpipar.plan.probe.probe_rank` with a rank's threads (the node's cores divided among
    its ranks), times the share of them a rank gets: (FLOP/s, seconds a kernel call costs
    besides its FLOPs, elements/s of a memory-bound pass, the note that says so)."""
    from mpipar.plan.probe import probe_rank
    from mpipar.runtime.nodes import cpu_count, cpu_peak_share, threads_per_rank
    probe = probe_rank(base, threads_per_rank(on_node))
    share = cpu_peak_share(probe.threads, on_node)
    return (probe.flops * share, probe.op_seconds / share, probe.passes.median * share,
            f"probed here as {on_node} rank(s) on {cpu_count()} core(s) run it: "
            f"{probe.describe()}" + (f"; x {share:.2f} for cores shared" if share < 1 else ""))


def machine_load(on_node: int) -> tuple[float, str]:
    """(how many times longer steps take now than the times the plan shows, the line that
    says so): the cores this node's ranks would share with the other processes that keep it
    busy now (its load average); the plan shows the times on the machine without them."""
    from mpipar.runtime.nodes import cpu_count, load_slowdown, threads_per_rank
    load, slowdown = load_slowdown(threads_per_rank(on_node), on_node)
    if slowdown < 1.1:
        return slowdown, ""
    return slowdown, (f"machine load: load average {load:.1f} on {cpu_count()} core(s): while "
                      f"other processes keep the cores this busy, steps take about "
                      f"{slowdown:.1f}x the times below (which are those of this machine "
                      f"without them)")


def _probed_hardware(args: argparse.Namespace, base: Config) -> tuple[Hardware, str, str]:
    """The hardware of the flags, with what they leave out probed here: (hardware, where the
    peak came from, where the link inside a node came from)."""
    overhead = elementwise = 0.0
    if args.peak_gflops:
        peak, note = args.peak_gflops * 1e9, "given"
    else:
        peak, overhead, elementwise, note = rank_rates(
            base, base.parallel.ranks_per_node or args.world)
    if args.intra_gbps:
        intra, link_note = args.intra_gbps * 1e9, "given"
    else:
        intra, link_note = memory_copy_bandwidth() / 2, "half the memory copy probed here"
    hw = Hardware(peak, args.inter_gbps * 1e9, args.inter_latency_us * 1e-6, intra,
                  args.intra_latency_us * 1e-6, op_overhead=overhead,
                  elementwise_rate=elementwise)
    return dataclasses.replace(hw, **dict(zip(("int8_seconds", "topk_seconds"),
                                              codec_seconds(base)))), note, link_note


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.world < 1:
        return _fail(f"--world {args.world}: must be >= 1")
    if args.memory_gb is not None and not args.memory_gb > 0:
        return _fail(f"--memory-gb {args.memory_gb}: must be > 0")
    if args.top < 0:
        return _fail(f"--top {args.top}: must be >= 0")
    for name in ("peak_gflops", "inter_gbps", "intra_gbps", "inter_latency_us",
                 "intra_latency_us"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            return _fail(f"--{name.replace('_', '-')} {value}: must be > 0")
    try:
        base = config_cli.from_args(args)
    except ConfigError as exc:
        return _fail(str(exc))
    fixed = config_cli.given_names(args, "parallel", "train")
    if args.hardware:
        try:
            hw, note = Hardware.load(args.hardware), f"measured, {args.hardware}"
        except (OSError, ValueError, TypeError) as exc:
            return _fail(f"--hardware {args.hardware}: {exc}")
        link_note = note
    else:
        hw, note, link_note = _probed_hardware(args, base)
    memory = None if args.memory_gb is None else args.memory_gb * 2**30
    base = with_nodes(dataclasses.replace(base, model=resolve_model(base.model)), hw, args.world)
    documents = None
    if base.train.document_masking:
        from mpipar.data.packing import step_documents
        from mpipar.data.sources import DataError
        try:
            documents = StepDocuments(step_documents(base))
        except DataError as exc:
            return _fail(str(exc))
    plan = plan_layouts(base, args.world, fixed, memory, hw, documents)
    _, load_line = machine_load(base.parallel.ranks_per_node or args.world)
    sys.stdout.write(format_plan(plan, base, args.world, hw, args.memory_gb, args.top, note,
                                 link_note, documents, load_line))
    return 0 if plan.ranked else 1


if __name__ == "__main__":
    sys.exit(main())
