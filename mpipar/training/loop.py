"""The training loop of ``python -m mpipar.train`` and everything written around it: the steps,
validation passes, metrics, progress and TensorBoard records, checkpoints every ``--save-every``
steps and at the end, the timeline and summary, stop signals (a preemption finishes the step,
commits a checkpoint and exits 0), ``--on-nan``, and the Hugging Face export. The program
(:mod:`mpipar.train`) parses, claims the outputs and builds the rank; :func:`run` runs it.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mpipar.config import Config
from mpipar.training.failure import EXIT_EXCEPTION, EXIT_NONFINITE, FailureReport

if TYPE_CHECKING:  # mpipar.runtime.comm loads NumPy, which must wait for the thread settings
    from mpipar.checkpoint.background import AsyncSaver
    from mpipar.observe.trace import Tracer
    from mpipar.runtime.comm import Group, Watchdog
    from mpipar.training.rank import Rank

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


@dataclass
class RunContext:
    """What :func:`main` sets up around the rank, for the functions that run it."""

    cfg: Config
    control: Group               # every collective outside the rank's groups (watched)
    stop: StopRequest
    report: FailureReport
    notes: list[str]             # lines to print once training starts
    watchdog: Watchdog | None = None
    saver: AsyncSaver | None = None  # --async-save: the write in flight (set by run)
    tracer: Tracer | None = None     # --trace-steps (set by run)
    io_spans: list = field(default_factory=list)  # checkpoint I/O (what, thread, start, end)
    threads: int = 1             # compute threads per rank
    on_node: int = 1             # ranks sharing this rank's node
    peak_rate: float | None = None  # this rank's probed FLOP/s (measured once, kept by a recovery)
    allreduce: str = "allreduce auto"  # the MPI all-reduce algorithm, as the start-up line says
    on_rank_failure: Any = None  # --on-rank-failure's object (mpipar.training.recovery)
    replaced: Rank | None = None  # the rank rebuilt after a rank failure (closed in its place)
    recovered: dict | None = None  # the ``recovered`` record of the next step's line

    @property
    def rank0(self) -> bool:
        return self.control.rank == 0


def run(rank: Rank, start: int, ctx: RunContext) -> int:
    """The training loop and everything written around it (see the module docstring). Under
    ``--on-rank-failure shrink`` a rank failure in the loop (its steps, evaluations and saves)
    or at its end (the commit in flight, the trace, the last checkpoint) is recovered
    (:func:`_train`); one before it (the compile, the peaks, the first books) or after the last
    checkpoint (the timeline, the summary, the export) ends the job with the failure report,
    as under ``abort``: nothing is lost that ``--resume auto`` cannot find."""
    from mpipar.observe import metrics

    if ctx.on_rank_failure is None:
        from mpipar.training.recovery import Abort
        ctx.on_rank_failure = Abort()
    ctx.on_rank_failure.start(ctx.control)
    tr = ctx.cfg.train
    t_run = time.perf_counter()
    from mpipar.runtime.compile_once import compile_once
    compile_once(rank.compute.kernels, rank.compute.dtype, tr.dtype, ctx.control,
                 (lambda text: print(f"mpipar: {text}", flush=True)) if ctx.rank0 else None)
    books = Books.open(rank, start, ctx)
    if ctx.rank0:
        _announce(rank, ctx, books.peaks)
    if tr.async_save:
        ctx.saver = _async_saver(ctx)
    ctx.tracer = _tracer(rank, ctx)
    ctx.stop.training()
    rank, loop, books, path = _train(rank, start, ctx, books)
    books.close()
    peaks, flops, rank0 = books.peaks, books.flops, ctx.rank0
    if loop.last is None:  # nothing to train (steps reached already, or --steps 0)
        _finish(rank, ctx, export=True)
        return 0
    result, started = loop.last
    path = path or _step_path(tr.save_dir, result.step)
    timeline = metrics.gather_timeline(ctx.control, result.step, rank.executor.timeline,
                                       started, tuple(rank.coord))
    if rank0:
        _report_end(ctx, loop, result, path)
        _write_summary(ctx.cfg, timeline, loop.status, peaks, flops, time.perf_counter() - t_run,
                       rank.compute.kernels.describe())
        if loop.signum:
            print(f"mpipar: {loop.status} of {tr.steps} on a stop signal "
                  f"({signal.Signals(loop.signum).name}); checkpoint {path}; continue with "
                  f"--resume auto", flush=True)
    _finish(rank, ctx, export=loop.status == "completed")
    return loop.code


def _announce(rank: Rank, ctx: RunContext, peaks: list[float]) -> None:
    """Rank 0, before step 1: config.toml, the notes, and one line describing the run."""
    cfg, tr = ctx.cfg, ctx.cfg.train
    with open(os.path.join(tr.run_dir, "config.toml"), "w") as fh:
        fh.write(cfg.to_toml())
    for note in ctx.notes:
        print(f"mpipar: {note}", flush=True)
    c, w, source = rank.compute, rank.weights, rank.data.source
    catch_up = ", AdamW catching up what top-k held back" if w.catch_up else ""
    print(f"mpipar: layout {rank.comms.grid.describe()} | {w.reducer.describe()}{catch_up} | "
          f"kernels {c.kernels.describe()} | {c.attention} | model {cfg.model.layers}x{cfg.model.hidden} "
          f"heads {cfg.model.heads}/{cfg.model.kv_heads} vocab {cfg.model.vocab_size} | data {source.path} "
          f"({source.num_samples} samples of {tr.seq_len}) | global batch "
          f"{tr.global_batch_size} x {tr.seq_len} | {c.precision.describe()} | device "
          f"{c.device.describe()} | MPI buffers {rank.comms.mpi_path.describe()} | "
          f"{ctx.threads} thread(s)/rank | {ctx.allreduce} | "
          f"peak {sum(peaks) / 1e9:,.1f} GFLOP/s over {len(peaks)} rank(s)", flush=True)


@dataclass
class LoopOutcome:
    status: str = "completed"
    code: int = 0
    signum: int = 0      # the stop signal the ranks agreed on (0: none)
    saved: int = 0       # the step of the last checkpoint written in the loop
    last: tuple | None = None  # (StepResult, time.time() at its start) of the last step


def _loop(rank: Rank, start: int, ctx: RunContext, books: Books) -> LoopOutcome:
    """Steps start+1 .. steps. Each step's record is written (rank 0) before its checkpoint
    commits, fsynced with it; a save's I/O time goes into the next record."""
    from mpipar.observe import metrics
    from mpipar.training import step as steps
    tr = ctx.cfg.train
    telemetry, writer, progress = books.telemetry, books.writer, books.progress
    peaks, flops, skipped = books.peaks, books.flops, books.skipped
    out, io = LoopOutcome(saved=start), 0.0
    for k in range(start, tr.steps):
        rank.ledger.reset()
        ctx.on_rank_failure.before_step(rank, k)   # the state copies' exchange is the step's
        if ctx.tracer is not None:
            ctx.tracer.begin(k + 1)
        started = time.time()
        result = steps.train_step(rank, k)
        if ctx.tracer is not None:
            ctx.tracer.pipeline(rank.executor)
        nonfinite = not (math.isfinite(result.loss) and math.isfinite(result.grad_norm))
        times = metrics.time_breakdown(result.step_time_s, rank.ledger.seconds_by_group(),
                                       rank.executor.timeline, io)
        signum, ranks = telemetry.exchange(
            ctx.stop.signum, times, rank.ledger.bytes_by_group(),
            sum(links["inter"] for links in rank.ledger.bytes_by_link().values()),
            writing=ctx.saver is not None and ctx.saver.writing())
        if ctx.watchdog is not None:
            ctx.watchdog.steady()  # every rank has finished a step: start-up is over
        skipped += nonfinite
        record = metrics.step_record(result, ranks, rank.ledger, flops, sum(peaks), nonfinite,
                                     skipped)
        record["world"] = ctx.control.size
        if k == start:   # this process's first step: compiling, first touches, no throughput
            record["warmup"] = True
        if ctx.recovered is not None:
            record["recovered"], ctx.recovered = ctx.recovered, None
        if rank.data.eval_set is not None and _eval_due(result.step, tr):
            record["eval"] = metrics.eval_record(steps.evaluate(rank), rank.eval_ledger)
        writer.write(record)
        progress.update(record)
        out.last, io = (result, started), 0.0
        if ctx.saver is not None and ctx.saver.pending and not any(r["writing"] for r in ranks):
            t0 = time.perf_counter()  # every rank's shard is written: commit it now
            writer.sync()
            _finish_async(ctx, progress)
            io = time.perf_counter() - t0
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
            checkpoint_save(rank, ctx, result.step, progress)
            out.saved, io = result.step, io + time.perf_counter() - t0
        if ctx.tracer is not None:
            ctx.tracer.end(result.step)
    return out


def _train(rank: Rank, start: int, ctx: RunContext, books: Books
           ) -> tuple[Rank, LoopOutcome, Books, str | None]:
    """:func:`_loop` and :func:`_last_save`; under ``--on-rank-failure shrink`` a rank failure
    in them is recovered (:mod:`mpipar.training.recovery`) and the loop goes on from the
    restored step. Returns the rank that finished, the outcome, the books and the path of the
    last checkpoint written."""
    while True:
        try:
            out = _loop(rank, start, ctx, books)
            return rank, out, books, _last_save(rank, ctx, out)
        except ctx.on_rank_failure.survivable as exc:
            books.close()
            rank, start, books = _recover(rank, ctx, exc)


def _last_save(rank: Rank, ctx: RunContext, out: LoopOutcome) -> str | None:
    """The end of the loop (its last step, or a stop): the write in flight committed, the
    trace written, and a checkpoint of the last step when the loop did not save it."""
    path = _finish_async(ctx, None)
    if ctx.tracer is not None:  # a run that stopped before its last traced step
        ctx.tracer.end(ctx.cfg.train.steps)
    if out.last is not None and out.saved != out.last[0].step:
        path = checkpoint_save(rank, ctx, out.last[0].step, None, wait=True)
    return path


def _recover(rank: Rank, ctx: RunContext, exc: BaseException) -> tuple[Rank, int, Books]:
    """The survivors' rank on the smaller world, the step it starts after, fresh books (the new
    rank 0 writes the metrics from there); the run's context follows the new world. Survivors
    that cannot go on end the job with the failure report."""
    from mpipar.training.recovery import Unrecoverable
    failed_at = ctx.control.rank
    if ctx.watchdog is not None:
        ctx.watchdog.rewatch([])  # the failed calls stay in flight on the old ledgers
    try:
        got = ctx.on_rank_failure.recover(rank, ctx.control, exc)
    except Unrecoverable as err:
        ctx.report.abort("rank_failure", f"mpipar: rank {failed_at}: a rank failed and the "
                                         f"survivors cannot go on: {err}", EXIT_EXCEPTION)
    ctx.control, ctx.cfg, ctx.replaced = got.control, got.rank.layout, got.rank
    if got.nodes:   # fewer ranks share the node now: the same probe, a larger share of it
        from mpipar.runtime.nodes import ranks_on_node
        ctx.on_node = ranks_on_node(list(got.nodes), ctx.control.rank)
    ctx.report.comm, ctx.report.rank = got.control.comm, got.control.rank
    if ctx.watchdog is not None:
        ctx.watchdog.rewatch([ctx.control.ledger, got.rank.ledger, got.rank.eval_ledger])
    if ctx.saver is not None:
        ctx.saver = _async_saver(ctx)
    books = Books.open(got.rank, got.start, ctx)
    rec = got.record
    ctx.recovered = {**rec, "seconds": time.perf_counter() - got.detected}
    if ctx.tracer is not None:
        ctx.tracer.recovered(ctx.control, _traced_ledgers(got.rank, ctx), _coord(got.rank),
                             got.detected, time.perf_counter(), ctx.recovered)
    if ctx.rank0:
        books.progress.note(
            f"mpipar: rank(s) {rec['failed_ranks']} failed; {rec['world']} ranks go on from "
            f"step {rec['resumed_step']} ({rec['from']}), layout "
            f"{got.rank.comms.grid.describe()} ({rec['layout_flags']})")
    return got.rank, got.start, books


@dataclass
class Books:
    """What the loop writes through, over the run's control group: the telemetry, the metrics
    (rank 0) and the progress, and the totals of the records (peaks, model FLOPs a step, steps
    skipped so far)."""
    telemetry: Any
    writer: Any
    progress: Any
    peaks: list[float]
    flops: float
    skipped: int

    @classmethod
    def open(cls, rank: Rank, start: int, ctx: RunContext) -> Books:
        """Books for a loop from step ``start`` (metrics.jsonl keeps the records up to it)."""
        from mpipar.model.flops import model_flops_per_step
        from mpipar.observe import metrics
        from mpipar.observe.tensorboard import log_dir
        tr, rank0 = ctx.cfg.train, ctx.rank0
        telemetry = metrics.Telemetry(ctx.control)
        if ctx.peak_rate is None:
            ctx.peak_rate = metrics.rank_rate(rank.compute.kernels.name, tr.dtype)
        peaks = telemetry.gather_peaks(metrics.measure_peak(
            rank.compute.kernels.name, tr.dtype, ctx.threads, ctx.on_node, rank.compute.device,
            ctx.peak_rate))
        skipped = _skipped_before(tr.run_dir, start) if rank0 else 0
        writer = metrics.MetricsWriter(tr.run_dir, enabled=rank0, start=start,
                                       tensorboard=log_dir(tr.tensorboard, tr.run_dir))
        return cls(telemetry, writer, metrics.Progress(tr.steps, start, tr.log_every, rank0),
                   peaks, model_flops_per_step(ctx.cfg), skipped)

    def close(self) -> None:
        self.progress.close()
        self.writer.close()


def _report_end(ctx: RunContext, loop: LoopOutcome, result, path: str) -> None:
    """Rank 0: the line and the failure record of a --on-nan stop."""
    if loop.code != EXIT_NONFINITE:
        return
    message = (f"mpipar: step {result.step}: loss {result.loss} / gradient norm "
               f"{result.grad_norm} is not finite (--on-nan stop); its update was not applied, "
               f"the state is saved in {path}; exit {EXIT_NONFINITE}")
    ctx.report.record("nonfinite", message, EXIT_NONFINITE)
    sys.stderr.write(message + "\n")


def _finish(rank: Rank, ctx: RunContext, export: bool) -> None:
    """Export (when asked and the run completed), then a last barrier under the watchdog: every
    rank has finished every collective before the watchdog stops and MPI shuts down."""
    tr = ctx.cfg.train
    if export and (tr.export_hf or tr.export_adapter):
        export_hf(rank, ctx.cfg, ctx.rank0)
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
                   wall_s: float, kernels: str) -> None:
    """Rank 0: timeline.json, summary.json and summary.txt of the run so far; prints the text."""
    from mpipar.observe.summary import diagnose, load_run, summarize, summary_text
    from mpipar.training import failure
    from mpipar.observe import metrics
    run_dir = cfg.train.run_dir
    metrics.write_json(os.path.join(run_dir, "timeline.json"), timeline)
    records, _, _ = load_run(run_dir)
    summary = summarize(records, timeline, cfg.to_dict(), status)
    summary.update(wall_s=wall_s, peak_flops=sum(peaks), peak_flops_per_rank=peaks,
                   model_flops_per_step=flops, save_dir=cfg.train.save_dir, kernels=kernels,
                   diagnosis=diagnose(summary))
    failures = failure.read(run_dir)
    if failures:
        summary["failures"] = failures
    metrics.write_json(os.path.join(run_dir, "summary.json"), summary)
    text = summary_text(summary)
    with open(os.path.join(run_dir, "summary.txt"), "w") as fh:
        fh.write(text)
    print(text, end="", flush=True)


def checkpoint_save(rank: Rank, ctx: RunContext, step: int, progress, wait: bool = False) -> str:
    """Save and commit a checkpoint of ``step`` (collective over the watched control group),
    pruning to ``keep_last``; rank 0 says so (through ``progress`` when a bar is showing).
    With ``--async-save`` (and not ``wait``) the write in flight is finished first, and this
    one only begins: its shards are written in the background and committed later
    (:mod:`mpipar.checkpoint.background`)."""
    from mpipar.checkpoint import writer
    from mpipar.training.step import run_position
    tr = ctx.cfg.train
    if ctx.saver is not None:
        _finish_async(ctx, progress)
        if not wait:
            ctx.saver.start(rank.state, run_position(rank, step))
            return _step_path(tr.save_dir, step)
    t0 = time.perf_counter()
    path = writer.save(rank.state, run_position(rank, step), tr.save_dir, ctx.control,
                       tr.keep_last)
    ctx.io_spans.append((f"checkpoint save {path.name}", "main", t0, time.perf_counter()))
    _say_saved(ctx, progress, path, "")
    return str(path)


def _async_saver(ctx: RunContext) -> AsyncSaver:
    """The background writer of --async-save; failure reports name its write in flight."""
    from mpipar.checkpoint.background import AsyncSaver
    from mpipar.runtime.device import host_copy
    tr = ctx.cfg.train
    saver = AsyncSaver(group=ctx.control, save_dir=tr.save_dir, keep_last=tr.keep_last,
                       copy=host_copy, spans=ctx.io_spans)
    ctx.report.in_flight = saver.describe
    return saver


def _tracer(rank: Rank, ctx: RunContext) -> Tracer | None:
    """The tracer of --trace-steps (None without): the rank's and the control group's
    ledgers, the pipeline's op records, the checkpoint spans."""
    from mpipar.config import trace_step_set
    from mpipar.observe.trace import Tracer
    steps = trace_step_set(ctx.cfg.train.trace_steps)
    if not steps:
        return None
    return Tracer(steps=steps, group=ctx.control, coord=_coord(rank),
                  ledgers=_traced_ledgers(rank, ctx), spans=ctx.io_spans,
                  run_dir=ctx.cfg.train.run_dir)


def _coord(rank: Rank) -> dict[str, int]:
    return dict(zip(("dp", "tp", "pp", "sp"), (int(c) for c in rank.coord)))


def _traced_ledgers(rank: Rank, ctx: RunContext) -> list:
    return [rank.ledger, ctx.control.ledger]


def _finish_async(ctx: RunContext, progress) -> str | None:
    """Wait for the asynchronous write in flight, if any, and commit it (collective)."""
    path = ctx.saver.finish() if ctx.saver is not None else None
    if path is not None:
        _say_saved(ctx, progress, path, " (written in the background)")
    return None if path is None else str(path)


def _say_saved(ctx: RunContext, progress, path, how: str) -> None:
    if ctx.rank0:
        text = f"mpipar: saved checkpoint {path}{how}"
        if progress is not None:
            progress.note(text)
        else:
            print(text, flush=True)


def export_hf(rank: Rank, cfg: Config, rank0: bool) -> None:
    """Gather the global weights (collective) and let rank 0 write the HF directory
    (``--export-hf``; under LoRA the merged model, as PEFT's ``merge_and_unload()``) and the
    PEFT adapter directory (``--export-adapter``)."""
    from mpipar.checkpoint import hf_moe, peft
    from mpipar.checkpoint import huggingface as hf
    from mpipar.training.step import gather_params
    params = gather_params(rank)
    if not rank0:
        return
    tr, lora = cfg.train, rank.model.table.lora
    if tr.export_adapter:
        peft.save_adapter(tr.export_adapter, cfg.model, lora, params,
                          base=tr.init_from_hf or "mpipar")
        print(f"mpipar: exported the LoRA adapter (PEFT) to {tr.export_adapter}", flush=True)
    if not tr.export_hf:
        return
    if lora is not None:
        params = peft.merge(cfg.model, lora, params)
    extra = (hf.passthrough_config(tr.init_from_hf) if tr.init_from_hf
             else {"max_position_embeddings": max(hf.DEFAULT_MAX_POSITIONS, tr.seq_len)})
    hf.save_hf(tr.export_hf, cfg.model, params, dtype=tr.export_dtype or tr.dtype,
               extra_config=extra, biases=rank.model.routing.host())
    for note in hf_moe.export_notes(cfg.model, rank.model.routing.host()):
        print(f"mpipar: {note}", flush=True)
    print(f"mpipar: exported Hugging Face weights ({hf.architecture(cfg.model)}, "
          f"{tr.export_dtype or tr.dtype}) to {tr.export_hf}", flush=True)

