"""``python -m mpipar.train``: train a Llama model with 4D parallelism over MPI.

    mpirun -n 8 python -m mpipar.train [--config FILE] [flags]

With no flag at all it trains the embedded default (a 4-layer byte-level Llama on the Python
standard library's source) on any number of ranks: without --dp/--tp/--pp/--sp the layout is
pure data parallelism when the world divides the global batch, else the planner's fastest
layout, else (no --global-batch-size given) the batch is rounded up to a multiple of the world
(:func:`mpipar.plan.search.auto_layout`); the choice is printed.

Writes into ``RUN_DIR``: ``config.toml`` (the full resolved configuration), ``metrics.jsonl`` (one
JSON object per optimizer step: loss, grad norm, LR, tokens/s, MFU, time breakdown, bytes per
group, peak memory per rank, skipped steps, and on validation steps (``--eval-every``, the last
step; with ``--eval-data`` or ``--eval-fraction``) the validation loss and perplexity under
``eval``; :mod:`mpipar.observe.metrics`; with ``--tensorboard``, or by
default when the ``[tensorboard]`` extra is installed, the same numbers as TensorBoard events in
``RUN_DIR/tensorboard``: :mod:`mpipar.observe.tensorboard`), ``timeline.json`` (every
rank's pipeline ops of the last step), ``summary.json`` and ``summary.txt`` (the run's numbers and
its bottleneck; :mod:`mpipar.report`), and checkpoints in ``--save-dir`` (default
``RUN_DIR/checkpoints``) every ``--save-every`` steps and at the end.

Before anything is allocated the run claims its directories (:mod:`mpipar.training.rundir`): the planner's
memory of each rank against its share of the node's available memory, every output directory
created and proved writable, and a lock on the run and save directories (a second run there, or
a fresh run beside an earlier run's checkpoints, exits 2).

Exit status and failures:

- 0: finished; or preempted: SIGTERM or SIGUSR1 (``mpirun`` forwards both to every rank; one rank
  receiving it is enough) lets the current step finish, every rank agrees to stop after it,
  a checkpoint is committed, and ``--resume auto`` continues exactly from there.
- 130: SIGINT (Ctrl-C) in the loop: the same as a preemption (the step finishes, a checkpoint
  is committed, rank 0 prints one line), but the status says it was interrupted.
- 2: bad configuration, data or output directory, or too little memory: rank 0 prints the error
  once, every rank exits before any step.
- 3: ``--on-nan stop`` met a non-finite loss or gradient norm: the step's update is not applied,
  a checkpoint of that state is committed (numbered as the step, so ``--resume auto`` continues
  after the offending batch) and the run stops. ``--on-nan skip`` counts such steps
  (``skipped_steps`` in the metrics) and goes on.
- 1: an uncaught exception on any rank aborts the whole job with that rank's number and
  traceback.
- 4: with ``--collective-timeout S`` a rank blocked longer than S seconds in one MPI call
  (any collective of the run: steps, checkpoints, telemetry, the timeline, shutdown; until step
  1 has finished, ``--startup-timeout``) aborts the job naming the operation and group.
- 128 + signal (143 for SIGTERM, 130 for SIGINT): a stop signal before the first step (nothing
  to checkpoint).

Every abort (and ``--on-nan stop``) is reported durably before the job ends: one JSON line per
failing rank in ``RUN_DIR/failure.txt`` (fsynced) and ``status: "failed"`` in ``summary.json``
(:mod:`mpipar.training.failure`); a launcher may drop the aborting rank's stderr.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mpipar.runtime.mpi_init import MPI, mark_started  # MPI_Init under MPIPAR_INIT_TIMEOUT

from mpipar import config as config_mod
from mpipar.config import Config, ConfigError
from mpipar.training.failure import (EXIT_NONFINITE, EXIT_WATCHDOG, FailureReport, fail_usage,
                                     install_abort_hook)
from mpipar.layout import Layout, model_from_checkpoint
from mpipar.rules import validate

if TYPE_CHECKING:  # mpipar.runtime.comm loads NumPy, which must wait for the thread settings
    from mpipar.runtime.comm import Group, Watchdog

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # checkpoint, then exit 0
STOP_SIGNALS = (*PREEMPTION_SIGNALS, signal.SIGINT)    # SIGINT (Ctrl-C): checkpoint, exit 130


class StopRequest:
    """Remembers a stop signal (SIGTERM, SIGUSR1, SIGINT); the loop stops after the current
    step. Before the loop starts (:meth:`training`) there is nothing to checkpoint, so a signal
    ends the job at once: reported, then aborted with status 128 + the signal number. SIGINT
    replaces Python's KeyboardInterrupt, which would print a traceback on every rank and
    commit nothing."""

    def __init__(self, report: FailureReport) -> None:
        self.report = report
        self.signum = 0  # the signal received (0: none)
        self._in_loop = False

    def install(self) -> "StopRequest":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def training(self) -> None:
        """From now on a signal stops the loop after the current step (a checkpoint follows)."""
        self._in_loop = True

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self._in_loop:
            self.report.abort("signal", f"mpipar: rank {self.report.rank}: {name} during "
                                        f"initialisation; nothing to checkpoint, stopping",
                              128 + signum)
        self.signum = signum


def stop_outcome(signum: int, step: int) -> tuple[str, int]:
    """(status, exit code) of a run stopped by ``signum`` after ``step``: a preemption signal
    exits 0 (the scheduler asked; the run continues with --resume auto), SIGINT 130."""
    if signum in PREEMPTION_SIGNALS:
        return f"preempted after step {step}", 0
    return f"interrupted after step {step}", 128 + signum


class RankZeroParser(argparse.ArgumentParser):
    """An argument parser that prints usage, help and errors on rank 0 only: every rank parses
    the same arguments and exits with the same status, but one copy of the text is enough."""

    def _print_message(self, message: str, file=None) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    parser = RankZeroParser(
        prog="python -m mpipar.train",
        description="Train a Llama-family model with data/tensor/pipeline/sequence parallelism "
                    "over MPI. Flags override --config; see README for every field.")
    config_mod.add_arguments(parser)
    return parser


def resolve_config(argv: list[str] | None, world: int, notes: list[str] | None = None) -> Layout:
    """Parse, default the save directory to ``RUN_DIR/checkpoints``, apply a checkpoint's model
    settings, choose a layout when none is given (a note about it goes to ``notes``), validate;
    exit 2 on error."""
    from mpipar.checkpoint.directory import CheckpointError
    args = build_parser().parse_args(argv)
    try:
        cfg = config_mod.from_args(args)
        tr = cfg.train
        tr.save_dir = tr.save_dir or os.path.join(tr.run_dir, "checkpoints")
        if tr.resume:
            from mpipar.checkpoint import reader
            path, _ = reader.resolve_resume(tr.resume, tr.save_dir)
            if path is not None:
                saved = reader.read_config(path)
                cfg.model = model_from_checkpoint(
                    saved.model, config_mod.given_fields(args, "model"), source=str(path))
                tr.eval_fraction = config_mod.held_out_from_checkpoint(
                    saved.train, config_mod.given_fields(args, "train"), source=str(path))
        if tr.init_from_hf:
            from mpipar.checkpoint import huggingface as hf
            hf_model = hf.read_model_config(tr.init_from_hf, tr.hf_untie_embeddings)
            cfg.model = hf.model_config_with_overrides(
                hf_model, config_mod.given_fields(args, "model"), source=tr.init_from_hf)
        from mpipar.plan.search import auto_layout
        cfg, note = auto_layout(cfg, world, config_mod.given_names(args, "parallel", "train"))
        if note is not None and notes is not None:
            notes.append(note)
        return validate(cfg, world)
    except (ConfigError, CheckpointError) as exc:
        fail_usage(str(exc))
        raise  # unreachable: fail_usage exits


@dataclass
class RunContext:
    """What :func:`main` sets up around the engine, for the functions that run it."""

    cfg: Config
    control: Group               # every collective outside the engine (watched)
    stop: StopRequest
    report: FailureReport
    notes: list[str]             # lines to print once training starts
    watchdog: Watchdog | None = None
    threads: int = 1             # compute threads per rank
    on_node: int = 1             # ranks sharing this rank's node

    @property
    def rank0(self) -> bool:
        return self.control.rank == 0


def main(argv: list[str] | None = None, comm: MPI.Comm | None = None) -> int:
    comm = MPI.COMM_WORLD if comm is None else comm
    report = FailureReport(comm)
    install_abort_hook(report)
    stop = StopRequest(report).install()
    from mpipar.runtime.nodes import configure_threads, local_size_from_env, ranks_on_node
    # Thread pools are sized before NumPy/Numba load when the launcher says how many ranks
    # share the node; else after validation, from every rank's processor name.
    known = local_size_from_env() or (1 if comm.Get_size() == 1 else None)
    if known:
        configure_threads(known)
    notes: list[str] = []
    cfg = resolve_config(argv, comm.Get_size(), notes)
    from mpipar.runtime.comm import Group, Ledger
    ctx = RunContext(cfg, Group(comm, "world", Ledger()), stop, report, notes)
    ctx.watchdog = _start_watchdog(ctx)
    ctx.on_node = known or ranks_on_node(ctx.control.allgather_object(MPI.Get_processor_name()),
                                         comm.Get_rank())
    ctx.threads = configure_threads(ctx.on_node)  # a value set before (or by the user) stays
    lock = _claim(ctx)
    mark_started(ctx.control.rank)   # _claim ended in a collective over the world
    try:
        # Under the lock: no other run can be reporting into this run directory.
        report.attach(cfg.train.run_dir, fresh=ctx.rank0)
        engine, start = _build(ctx)
        try:
            return _run(engine, start, ctx)
        finally:
            engine.close()
    finally:
        if lock is not None:
            lock.release()


def _start_watchdog(ctx: RunContext) -> Watchdog | None:
    """With --collective-timeout: watch the control group now, the engine once it exists."""
    from mpipar.runtime.comm import Watchdog
    tr = ctx.cfg.train
    if not tr.collective_timeout:
        return None
    return Watchdog([ctx.control.ledger], tr.collective_timeout, ctx.control.rank,
                    lambda message: ctx.report.abort("watchdog", message, EXIT_WATCHDOG),
                    startup=tr.startup_timeout).start()


def _agree(control: Group, error: str | None) -> None:
    """Every rank's error (None: none) gathered: any one stops every rank with status 2, the
    first printed once."""
    failed = [e for e in control.allgather_object(error) if e]
    if failed:
        fail_usage(failed[0], control.comm)


def _claim(ctx: RunContext):
    """Before anything is allocated: the memory check, every output directory created and
    proved writable, and (rank 0) the lock on the run and save directories, refusing a run
    that would overwrite another run's checkpoints or metrics (:mod:`mpipar.training.rundir`).
    Returns the lock (rank 0)."""
    from mpipar.training import rundir
    cfg, lock, error = ctx.cfg, None, None
    try:
        check_memory(cfg, ctx.control.rank, ctx.on_node)
        check_shared_memory(cfg, ctx.control.rank, ctx.on_node)
        rundir.prepare_outputs(cfg)
        if ctx.rank0:
            lock = rundir.RunLock([cfg.train.run_dir, cfg.train.save_dir]).acquire()
            rundir.refuse_earlier_run(cfg)
    except ConfigError as exc:
        error = str(exc)
    try:
        _agree(ctx.control, error)
    except SystemExit:
        if lock is not None:
            lock.release()
        raise
    return lock


def check_memory(cfg: Config, rank: int, on_node: int) -> None:
    """Refuse (ConfigError) a run whose rank ``rank`` is predicted to need more than its share
    of the node's available memory (``on_node`` ranks share it), before anything is allocated:
    the planner's peak (parameters, gradients, AdamW moments, activations, the token batch and
    the global tensors of initialisation; :func:`mpipar.plan.memory.predict_peak_memory`), or for
    sizes too large to list, its lower bound. ``--allow-oversubscribed-memory`` skips it."""
    from mpipar.runtime.memory import available_memory_bytes
    from mpipar.plan.memory import memory_lower_bound, predict_peak_memory
    from mpipar.runtime.topology import rank_coord
    available = available_memory_bytes()
    if cfg.train.allow_oversubscribed_memory or available is None:
        return
    share = available // on_node
    need, what = memory_lower_bound(cfg), "at least"
    if need <= share:
        par = cfg.parallel
        need = predict_peak_memory(cfg, rank_coord(rank, par.dp, par.tp, par.pp, par.sp))
        what = "about"
    if need > share:
        raise ConfigError(
            f"rank {rank} needs {what} {need:,} bytes ({need / 2**30:,.3g} GiB, the planner's "
            f"estimate of its parameters, gradients, AdamW moments, activations, token batch "
            f"and initialisation) but this node has {available:,} bytes available for {on_node} "
            f"rank(s), {share:,} each: use a smaller model or batch, spread it over more ranks "
            f"or nodes (--tp, --pp, --zero 1, --recompute), or set "
            f"train.allow_oversubscribed_memory (--allow-oversubscribed-memory) to start anyway")


def check_shared_memory(cfg: Config, rank: int, on_node: int) -> None:
    """Refuse (ConfigError) ZeRO-3 in node shared memory whose parameters (this rank's part of
    its node's copy, ``on_node`` ranks alike) would not fit the free space of the shared-memory
    directory: a window larger than it fails only when touched, with SIGBUS."""
    from mpipar.runtime.memory import SHARED_MEMORY_DIR, shared_memory_bytes
    from mpipar.plan.memory import memory_lower_bound
    from mpipar.plan.rank import node_copy
    from mpipar.runtime.topology import rank_coord
    par = cfg.parallel
    copy = node_copy(cfg, rank_coord(rank, par.dp, par.tp, par.pp, par.sp))
    if copy is None:
        return
    # ranks sharing one copy: given nodes say; detected ones are not known yet (a collective)
    per_copy = copy[0] if par.ranks_per_node else max(1, min(par.dp * par.sp, on_node // par.tp))
    free = shared_memory_bytes()
    need = memory_lower_bound(cfg) // 2 // per_copy * on_node   # the weights' parts
    if free is not None and need > free:
        raise ConfigError(
            f"parallel.zero_shared='node': the {on_node} rank(s) of this node hold at least "
            f"{need:,} bytes of parameters in shared memory, but {SHARED_MEMORY_DIR} has "
            f"{free:,} bytes free: enlarge it (a container's is 64 MiB unless given more, e.g. "
            f"docker run --shm-size), or set parallel.zero_shared='off' (--zero-shared off)")


def _build(ctx: RunContext):
    """The engine, with its state from ``--resume`` or ``--init-from-hf``; a data, checkpoint or
    configuration error on any rank stops every rank with status 2. Returns (engine, the step it
    starts after)."""
    from mpipar.checkpoint.directory import CheckpointError
    from mpipar.data.sources import DataError
    from mpipar.training.engine import Engine
    engine, start, error = None, 0, None
    try:
        engine = Engine(ctx.cfg, ctx.control.comm)
        if ctx.watchdog is not None:
            ctx.watchdog.watch(engine.ledger)
            ctx.watchdog.watch(engine.eval_ledger)
        start = _load_state(engine, ctx)
    except (DataError, ConfigError, CheckpointError) as exc:
        error = str(exc)
    _agree(ctx.control, error)
    return engine, start


def _load_state(engine, ctx: RunContext) -> int:
    """Load ``--resume`` (every rank reads the same files: the same answer everywhere) or
    ``--init-from-hf`` into ``engine``; returns the step the checkpoint holds (0: fresh)."""
    tr = ctx.cfg.train
    if tr.resume:
        from mpipar.checkpoint import reader
        path, notes = reader.resolve_resume(tr.resume, tr.save_dir)
        if path is not None:
            start = reader.load(engine.state, path)
            notes += [f"resumed from {path} at step {start}",
                      *reader.resume_changes(path, engine.run_position(start))]
        for note in notes if ctx.rank0 else ():
            print(f"mpipar: {note}", flush=True)
        if path is not None:
            return start
    if tr.init_from_hf:
        from mpipar.checkpoint.huggingface import load_hf
        engine.load_params(load_hf(tr.init_from_hf, tr.dtype, tr.hf_untie_embeddings)[1],
                           source=f"--init-from-hf {tr.init_from_hf}")
    return 0


def _run(engine, start: int, ctx: RunContext) -> int:
    """The training loop and everything written around it (see the module docstring)."""
    from mpipar.observe import metrics
    from mpipar.plan.flops import model_flops_per_step

    tr, rank0 = ctx.cfg.train, ctx.rank0
    t_run = time.perf_counter()
    telemetry = metrics.Telemetry(ctx.control)
    peaks = telemetry.gather_peaks(metrics.measure_peak(engine.kernels.name, tr.dtype,
                                                        ctx.threads, ctx.on_node))
    flops = model_flops_per_step(ctx.cfg)
    from mpipar.observe.tensorboard import log_dir
    writer = metrics.MetricsWriter(tr.run_dir, enabled=rank0, start=start,
                                   tensorboard=log_dir(tr.tensorboard, tr.run_dir))
    skipped = _skipped_before(tr.run_dir, start) if rank0 else 0
    if rank0:
        _announce(engine, ctx, peaks)
    progress = metrics.Progress(tr.steps, start, tr.log_every, rank0)
    ctx.stop.training()
    loop = _loop(engine, start, ctx, telemetry, writer, progress, (peaks, flops, skipped))
    progress.close()
    writer.close()
    if loop.last is None:  # nothing to train (steps reached already, or --steps 0)
        _finish(engine, ctx, export=True)
        return 0
    result, started = loop.last
    path = None
    if loop.saved != result.step:
        path = checkpoint_save(engine, ctx, result.step, None)
    path = path or _step_path(tr.save_dir, result.step)
    timeline = metrics.gather_timeline(ctx.control, result.step, engine.executor.timeline,
                                       started, tuple(engine.grid.coord))
    if rank0:
        _report_end(ctx, loop, result, path)
        _write_summary(ctx.cfg, timeline, loop.status, peaks, flops, time.perf_counter() - t_run)
        if loop.signum:
            print(f"mpipar: {loop.status} of {tr.steps} on a stop signal "
                  f"({signal.Signals(loop.signum).name}); checkpoint {path}; continue with "
                  f"--resume auto", flush=True)
    _finish(engine, ctx, export=loop.status == "completed")
    return loop.code


def _announce(engine, ctx: RunContext, peaks: list[float]) -> None:
    """Rank 0, before step 1: config.toml, the notes, and one line describing the run."""
    cfg, tr = ctx.cfg, ctx.cfg.train
    with open(os.path.join(tr.run_dir, "config.toml"), "w") as fh:
        fh.write(cfg.to_toml())
    for note in ctx.notes:
        print(f"mpipar: {note}", flush=True)
    catch_up = ", AdamW catching up what top-k held back" if engine.catch_up else ""
    print(f"mpipar: layout {engine.grid.describe()} | {engine.reducer.describe()}{catch_up} | "
          f"kernels {engine.kernels.describe()} | model {cfg.model.layers}x{cfg.model.hidden} "
          f"heads {cfg.model.heads}/{cfg.model.kv_heads} vocab {cfg.model.vocab_size} | data {engine.source.path} "
          f"({engine.source.num_samples} samples of {tr.seq_len}) | global batch "
          f"{tr.global_batch_size} x {tr.seq_len} | {tr.dtype} | device "
          f"{engine.device.describe()} | MPI buffers {engine.mpi_path.describe()} | "
          f"{ctx.threads} thread(s)/rank | "
          f"peak {sum(peaks) / 1e9:,.1f} GFLOP/s over {len(peaks)} rank(s)", flush=True)


@dataclass
class LoopOutcome:
    status: str = "completed"
    code: int = 0
    signum: int = 0      # the stop signal the ranks agreed on (0: none)
    saved: int = 0       # the step of the last checkpoint written in the loop
    last: tuple | None = None  # (StepResult, time.time() at its start) of the last step


def _loop(engine, start: int, ctx: RunContext, telemetry, writer, progress,
          totals: tuple[list[float], float, int]) -> LoopOutcome:
    """Steps start+1 .. steps. Each step's record is written (rank 0) before its checkpoint
    commits, fsynced with it; a save's I/O time goes into the next record."""
    from mpipar.observe import metrics
    tr = ctx.cfg.train
    peaks, flops, skipped = totals
    out, io = LoopOutcome(saved=start), 0.0
    for k in range(start, tr.steps):
        engine.ledger.reset()
        started = time.time()
        result = engine.train_step(k)
        nonfinite = not (math.isfinite(result.loss) and math.isfinite(result.grad_norm))
        times = metrics.time_breakdown(result.step_time_s, engine.ledger.seconds_by_group(),
                                       engine.executor.timeline, io)
        signum, ranks = telemetry.exchange(
            ctx.stop.signum, times, engine.ledger.bytes_by_group(),
            sum(links["inter"] for links in engine.ledger.bytes_by_link().values()))
        if ctx.watchdog is not None:
            ctx.watchdog.steady()  # every rank has finished a step: start-up is over
        skipped += nonfinite
        record = metrics.step_record(result, ranks, engine.ledger, flops, sum(peaks), nonfinite,
                                     skipped)
        if engine.eval_set is not None and _eval_due(result.step, tr):
            record["eval"] = metrics.eval_record(engine.evaluate(), engine.eval_ledger)
        writer.write(record)
        progress.update(record)
        out.last, io = (result, started), 0.0
        if nonfinite and tr.on_nan == "stop":
            out.status = f"stopped at step {result.step}: non-finite loss or gradient norm"
            out.code = EXIT_NONFINITE
            break
        if signum:
            out.signum = signum
            out.status, out.code = stop_outcome(signum, result.step)
            break
        if tr.save_every and result.step % tr.save_every == 0:
            t0 = time.perf_counter()
            writer.sync()
            checkpoint_save(engine, ctx, result.step, progress)
            out.saved, io = result.step, time.perf_counter() - t0
    return out


def _report_end(ctx: RunContext, loop: LoopOutcome, result, path: str) -> None:
    """Rank 0: the line and the failure record of a --on-nan stop."""
    if loop.code != EXIT_NONFINITE:
        return
    message = (f"mpipar: step {result.step}: loss {result.loss} / gradient norm "
               f"{result.grad_norm} is not finite (--on-nan stop); its update was not applied, "
               f"the state is saved in {path}; exit {EXIT_NONFINITE}")
    ctx.report.record("nonfinite", message, EXIT_NONFINITE)
    sys.stderr.write(message + "\n")


def _finish(engine, ctx: RunContext, export: bool) -> None:
    """Export (when asked and the run completed), then a last barrier under the watchdog: every
    rank has finished every collective before the watchdog stops and MPI shuts down."""
    if export and ctx.cfg.train.export_hf:
        export_hf(engine, ctx.cfg, ctx.rank0)
    ctx.control.barrier()
    if ctx.watchdog is not None:
        ctx.watchdog.stop()


def _eval_due(step: int, tr) -> bool:
    """Whether the validation loss is computed after ``step`` (1-based): every ``eval_every``
    steps and after the last."""
    return step == tr.steps or bool(tr.eval_every and step % tr.eval_every == 0)


def _step_path(save_dir: str, step: int) -> str:
    from mpipar.checkpoint.directory import step_dir_name
    return os.path.join(save_dir, step_dir_name(step))


def _skipped_before(run_dir: str, start: int) -> int:
    """The skipped-step count of step ``start`` in the metrics kept from an earlier run."""
    from mpipar.observe.metrics import read_records
    path = os.path.join(run_dir, "metrics.jsonl")
    if start == 0 or not os.path.exists(path):
        return 0
    records = [r for r in read_records(path) if r.get("step", 0) <= start]
    return records[-1].get("skipped_steps", 0) if records else 0


def _write_summary(cfg: Config, timeline: dict, status: str, peaks: list[float], flops: float,
                   wall_s: float) -> None:
    """Rank 0: timeline.json, summary.json and summary.txt of the run so far; prints the text."""
    from mpipar import report
    from mpipar.training import failure
    from mpipar.observe import metrics
    run_dir = cfg.train.run_dir
    metrics.write_json(os.path.join(run_dir, "timeline.json"), timeline)
    records, _, _ = report.load_run(run_dir)
    summary = report.summarize(records, timeline, cfg.to_dict(), status)
    summary.update(wall_s=wall_s, peak_flops=sum(peaks), peak_flops_per_rank=peaks,
                   model_flops_per_step=flops, save_dir=cfg.train.save_dir,
                   diagnosis=report.diagnose(summary))
    failures = failure.read(run_dir)
    if failures:
        summary["failures"] = failures
    metrics.write_json(os.path.join(run_dir, "summary.json"), summary)
    text = report.summary_text(summary)
    with open(os.path.join(run_dir, "summary.txt"), "w") as fh:
        fh.write(text)
    print(text, end="", flush=True)


def checkpoint_save(engine, ctx: RunContext, step: int, progress) -> str:
    """Save and commit a checkpoint of ``step`` (collective over the watched control group),
    pruning to ``keep_last``; rank 0 says so (through ``progress`` when a bar is showing)."""
    from mpipar.checkpoint import writer
    tr = ctx.cfg.train
    path = writer.save(engine.state, engine.run_position(step), tr.save_dir, ctx.control,
                           tr.keep_last)
    if ctx.rank0:
        text = f"mpipar: saved checkpoint {path}"
        if progress is not None:
            progress.note(text)
        else:
            print(text, flush=True)
    return str(path)


def export_hf(engine, cfg: Config, rank0: bool) -> None:
    """Gather the global weights (collective) and let rank 0 write the HF directory."""
    from mpipar.checkpoint import huggingface as hf
    params = engine.gather_params()
    if not rank0:
        return
    tr = cfg.train
    extra = (hf.passthrough_config(tr.init_from_hf) if tr.init_from_hf
             else {"max_position_embeddings": max(hf.DEFAULT_MAX_POSITIONS, tr.seq_len)})
    hf.save_hf(tr.export_hf, cfg.model, params, dtype=tr.export_dtype or tr.dtype,
               extra_config=extra)
    print(f"mpipar: exported Hugging Face weights ({hf.architecture(cfg.model)}, "
          f"{tr.export_dtype or tr.dtype}) to {tr.export_hf}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
