"""``python -m mpipar.bench memory``: peak memory (tracemalloc) of one training step for each
--recompute mode, one process or tp = N under ``mpirun -n N`` (with and without
--tp-sequence-parallel); with ``--zero STAGES`` under ``mpirun -n N``: dp = N, each ZeRO stage's
memory per rank against a --budget-mb, and ZeRO-3's exposed all-gather time against its
transfer time. ``--dtype float32,bfloat16`` measures each precision and prints the memory per
rank side by side (bf16: half the compute copies and activations, float32 masters beside).
``--lora-rank R``: full fine-tuning against LoRA (:mod:`mpipar.bench.lora_memory`).

Figures are bytes of NumPy allocations (tracemalloc sees every one); node shared memory
(ZeRO-3 ``--zero-shared``) is added by hand, HDF5 buffers (offload) are not counted.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
import tracemalloc
from typing import Any, Callable

from mpipar.bench.harness import Section, print_header, rank0_print
from mpipar.rules import validate


def measure_step_memory(mode: str, args: argparse.Namespace, run_dir: str, traced: bool = True,
                        comm=None, tp_sequence_parallel: bool = False) -> dict[str, Any]:
    """Train with ``--recompute mode`` on ``comm`` (default: one process) as tensor parallelism
    over all its ranks: a warm-up step, then one step under tracemalloc (which sees every NumPy
    allocation), then two untraced, timed steps.

    Returns this rank's ``resident`` (bytes held between steps: parameters, gradients, optimizer
    state, buffers), ``peak`` (highest traced bytes during the step), ``activations`` (peak -
    resident: what the step adds, saved activations first), ``loss`` and ``step_cpu_s`` (CPU
    seconds of the faster of two more untraced steps). ``traced=False`` runs the same steps
    untraced (a warm-up that fills the process's lazy caches before the first measurement).
    """
    from mpipar.runtime.mpi_init import MPI

    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from mpipar.data.sources import load_tokens
    from mpipar.training.rank import build_rank
    from mpipar.training.step import close, train_step

    comm = comm or MPI.COMM_SELF
    cfg = validate(Config(
        ModelConfig(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    kv_heads=args.kv_heads, ffn_hidden=args.ffn),
        ParallelConfig(tp=comm.Get_size(), tp_sequence_parallel=tp_sequence_parallel),
        TrainConfig(steps=10, seq_len=args.seq, global_batch_size=args.batch,
                    micro_batch_size=args.micro_batch, dtype=args.dtype, backend="numpy",
                    run_dir=run_dir, recompute=mode, warmup_steps=1, log_every=0),
    ), comm.Get_size())
    source = load_tokens(None, 256, args.seq)  # the corpus is cached: load it untraced
    rank, m = _traced_build_and_step(lambda: build_rank(cfg, comm, source=source), traced)
    resident, peak, loss = m["resident"], m["step_peak"], m["loss"]
    saved = _saved_bytes(rank) if mode != "offload" else 0
    cpu = []
    for k in (2, 3):  # CPU seconds: robust on a machine shared with other work
        start = time.process_time()
        train_step(rank, k)
        cpu.append(time.process_time() - start)
    close(rank)
    return {"mode": mode, "tp": comm.Get_size(), "tp_sequence_parallel": tp_sequence_parallel,
            "resident": resident, "peak": peak, "activations": peak - resident, "saved": saved,
            "loss": loss, "step_cpu_s": min(cpu)}


def _saved_bytes(rank) -> int:
    """Bytes the model keeps for backward from one microbatch's forward (its one chunk: the
    benchmark runs pp = 1): the arrays of the forward's record, the step's working set aside."""
    import dataclasses
    from mpipar.training.batches import prepare

    def nbytes(node: Any) -> int:
        if dataclasses.is_dataclass(node):
            return sum(nbytes(getattr(node, f.name)) for f in dataclasses.fields(node))
        if isinstance(node, (list, tuple)):
            return sum(nbytes(v) for v in node)
        return getattr(node, "nbytes", 0) if hasattr(node, "dtype") else 0

    mb = prepare(rank, rank.data.sampler, 0).microbatches[0]
    chunk = rank.model.chunks[0]
    _, cache = chunk.forward(rank.params, mb.tokens, rank.model.positions, mb.targets)
    return nbytes(cache.blocks) + nbytes(cache.head)


def _traced_build_and_step(build: Callable[[], Any], traced: bool = True) -> tuple[Any, dict]:
    """``build()`` a rank and run its steps 0 and 1 under tracemalloc (``traced``): the
    rank and {``build_peak``: the peak while building, ``resident``: what it holds after step
    0, ``step_peak``: the peak of step 1, ``loss``: step 1's loss} (zeros when untraced)."""
    from mpipar.training.step import train_step
    if traced:
        tracemalloc.start()
    try:
        rank = build()
        build_peak = tracemalloc.get_traced_memory()[1]
        train_step(rank, 0)
        gc.collect()
        resident = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        loss = train_step(rank, 1).loss
        step_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return rank, {"build_peak": build_peak, "resident": resident, "step_peak": step_peak,
                    "loss": loss}


def _zero_rank(stage: int, prefetch: int, args: argparse.Namespace, comm, run_dir: str,
                 shared: bool = False):
    """A rank of the --zero benchmark model with dp = every rank of ``comm`` (``shared``:
    ZeRO-3's parameters in node shared memory)."""
    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from mpipar.data.sources import load_tokens
    from mpipar.training.rank import build_rank

    world = comm.Get_size()
    cfg = validate(Config(
        ModelConfig(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    kv_heads=args.kv_heads, ffn_hidden=args.ffn),
        ParallelConfig(dp=world, zero=stage, zero_prefetch=prefetch,
                       zero_shared="node" if shared else "off",
                       ranks_per_node=args.ranks_per_node),
        TrainConfig(steps=10, seq_len=args.seq, global_batch_size=args.batch,
                    micro_batch_size=args.micro_batch, dtype=args.dtype, backend="numpy",
                    run_dir=run_dir, recompute=args.modes.split(",")[0], warmup_steps=1,
                    log_every=0),
    ), world)
    return build_rank(cfg, comm, source=load_tokens(None, 256, args.seq))


def measure_zero_memory(stage: int, prefetch: int, args: argparse.Namespace, comm,
                        run_dir: str, shared: bool = False) -> tuple[dict[str, Any], Any]:
    """Build and train one ZeRO ``stage`` rank under tracemalloc (only its own allocations
    are traced): the peak of building it, what it holds between steps (``resident``: state,
    the unit pool, caches) and the peak of a step; the planner's prediction beside them.
    ``shared``: ZeRO-3 in node shared memory, whose slices (not NumPy's, so not traced) are
    added to each figure."""
    from mpipar.plan.memory import predict_memory

    gc.collect()
    rank, m = _traced_build_and_step(
        lambda: _zero_rank(stage, prefetch, args, comm, run_dir, shared))
    sharded = rank.weights.sharded
    extra = sharded.shared_bytes if sharded else 0
    build, resident, step, loss = (m["build_peak"] + extra, m["resident"] + extra,
                                   m["step_peak"] + extra, m["loss"])
    pool = (sum(b.nbytes for bufs in sharded.pool.free.values() for b in bufs)
            if sharded else 0)
    predicted = predict_memory(rank.layout, rank.coord)
    return {"zero": f"{stage}n" if shared else stage, "prefetch": prefetch,
            "build_peak": build, "resident": resident,
            "step_peak": step, "peak": max(build, step), "pool": pool,
            "state_predicted": predicted.state, "total_predicted": predicted.total,
            "loss": loss}, rank


def _gather_seconds(rank) -> tuple[float, float, int]:
    """(seconds blocked in all-gather waits and tests, of them in tests, all-gathers) the
    ledger booked since its reset."""
    e = rank.ledger.entries.get(("dp_sp", "iallgather"))
    return (e.seconds, e.tested, e.messages) if e else (0.0, 0.0, 0)


def run_zero_memory(args: argparse.Namespace, comm) -> dict[str, Any]:
    """The --zero benchmark: each stage's memory per rank (largest over built) against the
    budget, then ZeRO-3's steps at prefetch 0 (every all-gather waited as soon as posted: its
    whole transfer) and at --prefetch, interleaved step by step, with their step times."""
    world, say = comm.Get_size(), rank0_print(comm)
    stages = [int(s) for s in args.zero.split(",")]
    mib = 2.0 ** 20
    say(f"memory: ZeRO stages, dp={world}, numpy kernels, {args.dtype}; layers={args.layers} "
        f"hidden={args.hidden} heads={args.heads}/{args.kv_heads} ffn={args.ffn} vocab=256 "
        f"seq={args.seq} batch={args.batch} micro_batch={args.micro_batch}; budget "
        f"{args.budget_mb} MiB per rank")
    from mpipar.data.sources import load_tokens
    from mpipar.training.step import close
    load_tokens(None, 256, args.seq)  # the corpus is cached: load it untraced
    rows, built = [], {}
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-zero-") as run_dir:
        run_dir = comm.bcast(run_dir)
        for stage in stages + (["3n"] if args.zero_shared else []):
            mine, built[stage] = measure_zero_memory(3 if stage == "3n" else stage,
                                                     args.prefetch, args, comm, run_dir,
                                                     shared=stage == "3n")
            if stage not in (3, "3n"):      # only ZeRO-3's ranks go on (to the overlap runs)
                close(built.pop(stage))
            every = comm.allgather(mine)
            rows.append({**mine, **{k: max(r[k] for r in every) for k in mine
                                    if k not in ("zero", "prefetch", "loss")}})
        full_state = rows[0]["state_predicted"] if stages[0] == 0 else None
        header = (f"{'zero':>4} {'build MiB':>10} {'resident':>9} {'step peak':>10} "
                  f"{'pool MiB':>9} {'state (planner)':>16} {'fits':>5}  loss")
        print_header(header, say)
        for r in rows:
            r["fits"] = r["peak"] <= args.budget_mb * mib
            say(f"{r['zero']:>4} {r['build_peak'] / mib:>10.1f} {r['resident'] / mib:>9.1f} "
                f"{r['step_peak'] / mib:>10.1f} {r['pool'] / mib:>9.1f} "
                f"{r['state_predicted'] / mib:>16.1f} {'yes' if r['fits'] else 'NO':>5}  "
                f"{r['loss']:.6f}")
        for key in (3, "3n"):
            if full_state and key in built:
                r3 = rows[(stages + ["3n"]).index(key)]
                r3["resident_vs_share"] = r3["resident"] / (full_state / world + r3["pool"])
                say(f"ZeRO-{key} resident / (ZeRO-0 state / {world} + pool) = "
                    f"{r3['resident_vs_share']:.3f}")
        overlap = (_zero_overlap(built.get(3), args, comm, run_dir, say, built.get("3n"))
                   if 3 in built else {})
        if "3n" in built:
            close(built.pop("3n"))
    return {"config": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads",
                                                     "ffn", "seq", "batch", "micro_batch",
                                                     "dtype", "budget_mb", "prefetch")}
            | {"dp": world}, "rows": rows, "overlap": overlap}


def _zero_overlap(rank, args: argparse.Namespace, comm, run_dir: str, say,
                  shared=None) -> dict[str, Any]:
    """ZeRO-3 at prefetch 0 against ``rank`` (at --prefetch), and ``shared`` (node shared
    memory) when given, steps interleaved: the seconds a step blocks in all-gather waits and
    tests (the ledger; the test share apart; node shared: in the barrier that publishes the
    update), and the step times."""
    from mpipar.training.step import close, train_step
    blocking = _zero_rank(3, 0, args, comm, run_dir)
    train_step(blocking, 0)
    runs = [("prefetch0", blocking), (f"prefetch{args.prefetch}", rank)]
    runs += [("node shared", shared)] if shared is not None else []
    out = {}
    for name, eng in runs:
        out[name] = {"waited_s": 0.0, "tested_s": 0.0, "gathers": 0, "step_s": [],
                     "inter_bytes": 0}
    for k in range(2, 2 + args.zero_steps):
        for name, eng in runs:
            eng.ledger.reset()
            comm.Barrier()
            t0 = time.perf_counter()
            train_step(eng, k)
            out[name]["step_s"].append(time.perf_counter() - t0)
            seconds, tested, count = _gather_seconds(eng)
            if eng is shared:         # the barrier publishing the update (and across nodes,
                published = [e for (g, op), e in eng.ledger.entries.items()  # its all-gathers)
                             if op == "barrier" or g == "dp_sp_inter"]
                seconds += sum(e.seconds for e in published)
                count += sum(e.messages for e in published if e.bytes)
            out[name]["waited_s"] += seconds / args.zero_steps
            out[name]["tested_s"] += tested / args.zero_steps
            out[name]["gathers"] = count
            out[name]["inter_bytes"] = sum(links["inter"] for links
                                           in eng.ledger.bytes_by_link().values())
    for row in out.values():       # the slowest rank's (its test share beside it)
        row["waited_s"], row["tested_s"] = max(comm.allgather((row["waited_s"],
                                                               row["tested_s"])))
        row["inter_bytes"] = max(comm.allgather(row["inter_bytes"]))
        row["step_s"] = statistics.median(row["step_s"])
    base = out["prefetch0"]["waited_s"]
    for name, row in out.items():
        row["exposed_fraction"] = row["waited_s"] / base if base else float("nan")
        where = (f"{row['tested_s'] * 1e3:.1f} ms of it in test calls, the rank moving the "
                 f"data" if name != "node shared" else "all of it publishing the update: its "
                 "barrier, and across nodes the all-gathers into each node's copy")
        across = (f"; {row['inter_bytes'] / 1e6:.2f} MB a step across nodes (the rank that "
                  f"sends most)" if args.ranks_per_node else "")
        say(f"ZeRO-3 {name}: {row['gathers']} all-gathers a step, blocked "
            f"{row['waited_s'] * 1e3:.1f} ms a step ({100 * row['exposed_fraction']:.0f}% of "
            f"prefetch 0's, whose wait is the whole transfer; {where}); step "
            f"{row['step_s']:.3f} s{across}")
    close(blocking)
    return out


def run(args: argparse.Namespace, comm=None) -> dict[str, Any]:
    """Measure every requested recompute mode on one model; print bytes and ratios to none.

    Under ``mpirun -n N`` (or with a ``comm`` of N ranks) the model runs with tp = N, each mode
    without and with --tp-sequence-parallel, side by side; the figures are the largest over the
    ranks, and a ratio column gives what sequence parallelism keeps of the step's activations."""
    from mpipar.runtime.mpi_init import MPI

    from mpipar.model.recompute import NONE, RECOMPUTE_MODES

    comm = comm or MPI.COMM_WORLD
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise SystemExit(f"--dtype: {bad or 'none given'}; choose from {', '.join(DTYPES)}")
    if len(dtypes) > 1:
        by_dtype = {d: run(argparse.Namespace(**{**vars(args), "dtype": d}), comm)
                    for d in dtypes}
        if not args.zero:
            _print_dtypes(by_dtype, rank0_print(comm))
        return {"by_dtype": by_dtype}
    if args.zero:
        return run_zero_memory(args, comm)
    tp, say = comm.Get_size(), rank0_print(comm)
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads = 4, 128, 4, 2
        args.ffn, args.seq, args.batch, args.micro_batch = 344, 128, 2, 2
    if args.lora_rank:
        from mpipar.bench.lora_memory import run_lora_memory
        return run_lora_memory(args, comm, _traced_build_and_step)
    modes = [m.strip() for m in args.modes.split(",")]
    for m in modes:
        if m not in RECOMPUTE_MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; choose from "
                             f"{', '.join(RECOMPUTE_MODES)}")
    if NONE.name not in modes:
        modes.insert(0, NONE.name)  # the reference the ratios are relative to
    variants = [(m, sp) for m in modes for sp in ((False, True) if tp > 1 else (False,))]
    say(f"memory: one training step, {'single process' if tp == 1 else f'tp={tp}'}, numpy "
        f"kernels, {args.dtype}; layers={args.layers} hidden={args.hidden} heads={args.heads}/"
        f"{args.kv_heads} ffn={args.ffn} vocab=256 seq={args.seq} batch={args.batch} "
        f"micro_batch={args.micro_batch}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="mpipar-bench-memory-") as run_dir:
        run_dir = comm.bcast(run_dir)
        measure_step_memory("none", args, run_dir, traced=False, comm=comm)
        for mode, seqpar in variants:
            mine = measure_step_memory(mode, args, run_dir, comm=comm,
                                       tp_sequence_parallel=seqpar)
            every = comm.allgather(mine)
            rows.append({**mine, **{k: max(r[k] for r in every)
                                    for k in ("resident", "peak", "activations", "step_cpu_s")}})
            gc.collect()
    _print_memory(rows, say)
    return {"config": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads",
                                                     "ffn", "seq", "batch", "micro_batch",
                                                     "dtype")} | {"tp": tp},
            "rows": rows}


def _print_memory(rows: list[dict[str, Any]], say: Callable[..., None]) -> None:
    """The memory table: each mode against none, and tp sequence parallelism against none."""
    base = rows[0]
    plain = {r["mode"]: r for r in rows if not r["tp_sequence_parallel"]}
    header = (f"{'mode':<10} {'tp-SP':>5} {'peak MiB':>9} {'vs none':>8} {'step adds MiB':>14} "
              f"{'vs none':>8} {'vs no tp-SP':>11} {'resident MiB':>13} {'cpu s':>7} "
              f"{'vs none':>8}  loss")
    print_header(header, say)
    mib = 2.0 ** 20
    for r in rows:
        r["peak_ratio"] = r["peak"] / base["peak"]
        r["activations_ratio"] = r["activations"] / base["activations"]
        r["tp_sequence_parallel_ratio"] = r["activations"] / plain[r["mode"]]["activations"]
        r["time_ratio"] = r["step_cpu_s"] / base["step_cpu_s"]
        say(f"{r['mode']:<10} {'on' if r['tp_sequence_parallel'] else 'off':>5} "
            f"{r['peak'] / mib:>9.1f} {r['peak_ratio']:>7.2f}x {r['activations'] / mib:>14.1f} "
            f"{r['activations_ratio']:>7.2f}x {r['tp_sequence_parallel_ratio']:>10.2f}x "
            f"{r['resident'] / mib:>13.1f} {r['step_cpu_s']:>7.2f} {r['time_ratio']:>7.2f}x  "
            f"{r['loss']:.10f}")
    say("peak: highest traced bytes during the step (the largest over ranks); step adds: peak "
        "minus what is held between steps (parameters, gradients, optimizer state); vs no "
        "tp-SP: step adds against the same mode without --tp-sequence-parallel; cpu s: CPU "
        "seconds of a step (untraced); offload's HDF5 buffers are not NumPy memory and are not "
        "counted")


def _print_dtypes(by_dtype: dict[str, dict[str, Any]], say: Callable[..., None]) -> None:
    """Memory per rank of each mode in each precision, side by side, against the first."""
    names = list(by_dtype)
    first = by_dtype[names[0]]["rows"]
    mib = 2.0 ** 20
    what = ("peak", "adds", "saved")
    cols = "".join(f" {d + ' ' + w:>22}" for d in names[1:] for w in what)
    print_header(f"{'mode':<10} {'tp-SP':>5}" + "".join(f" {names[0] + ' ' + w + ' MiB':>22}"
                                                      for w in what) + cols, say)
    for i, base in enumerate(first):
        line = (f"{base['mode']:<10} {'on' if base['tp_sequence_parallel'] else 'off':>5}"
                + "".join(f" {base[k] / mib:>22.1f}" for k in ("peak", "activations", "saved")))
        for d in names[1:]:
            r = by_dtype[d]["rows"][i]
            line += "".join(f" {r[k] / mib:>14.1f} ({r[k] / base[k]:.2f}x)" if base[k] else
                            f" {r[k] / mib:>22.1f}" for k in ("peak", "activations", "saved"))
        say(line)
    say("peak: highest traced bytes of a step per rank (largest over ranks); adds: what the step "
        "adds to what is held between steps (saved activations and the working set of the op "
        "running, whose float32 upcasts and attention scores bf16 does not shrink); saved: "
        f"what one microbatch's forward keeps for backward; (x): against {names[0]}")


DTYPES = ("float32", "float64", "bfloat16")


def configure(parser: argparse.ArgumentParser) -> None:
    """The memory section's options: recompute modes, the model, and the --zero benchmark's."""
    parser.add_argument("--modes", default="none,selective,full,offload",
                        help="comma list of --recompute modes (none is always measured)")
    parser.add_argument("--dtype", default="float32",
                        help=f"comma list of {', '.join(DTYPES)}: each measured, side by side")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per microbatch")
    parser.add_argument("--zero", default="", metavar="STAGES",
                        help="comma list of ZeRO stages to measure with dp = the world instead "
                             "of the recompute modes (the first of --modes is used)")
    parser.add_argument("--budget-mb", type=float, default=256.0,
                        help="--zero: memory per rank a stage's traced peak must fit")
    parser.add_argument("--prefetch", type=int, default=1, help="--zero: ZeRO-3 prefetch depth")
    parser.add_argument("--ranks-per-node", type=int, default=0,
                        help="--zero: treat each K consecutive ranks as a node (node shared "
                             "memory then keeps a copy on each; bytes across nodes printed)")
    parser.add_argument("--zero-shared", action="store_true",
                        help="--zero with 3: also ZeRO-3 with the parameters in node shared "
                             "memory (row 3n; its blocked time is the barrier publishing the "
                             "update)")
    parser.add_argument("--zero-steps", type=int, default=3,
                        help="--zero: interleaved steps timing ZeRO-3's all-gathers")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="full fine-tuning against LoRA of this rank instead of the "
                             "recompute modes (one process; the first of --modes is used)")
    parser.add_argument("--lora-targets",
                        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                        help="--lora-rank: the linears with adapters")
    parser.add_argument("--predict-model", default="",
                        help="--lora-rank: also the planner's prediction at this shape of "
                             "bench gpu's models (e.g. 1.1B), too large to measure here")


SECTION = Section("memory", run, "peak memory of one training step for each --recompute mode "
                  "(under mpirun -n N: tp = N, with and without --tp-sequence-parallel)", configure)
