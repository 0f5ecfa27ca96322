"""``python -m mpipar.train``: train a Llama model with 4D parallelism over MPI.

    mpirun -n 8 python -m mpipar.train [--config FILE] [flags]

With no flag at all it trains the embedded default (a 4-layer byte-level Llama on the Python
standard library's source) on any number of ranks: without --dp/--tp/--pp/--sp the layout is
pure data parallelism when the world divides the global batch, else the planner's fastest
layout, else (no --global-batch-size given) the batch is rounded up to a multiple of the world
(:func:`mpipar.planner.auto_layout`); the choice is printed.

Writes into ``RUN_DIR``: ``config.toml`` (the full resolved configuration), ``metrics.jsonl`` (one
JSON object per optimizer step: loss, grad norm, LR, tokens/s, MFU, time breakdown, bytes per
group, peak memory per rank, skipped steps; :mod:`mpipar.metrics`; with ``--tensorboard``, or by
default when the ``[tensorboard]`` extra is installed, the same numbers as TensorBoard events in
``RUN_DIR/tensorboard``: :mod:`mpipar.tensorboard`), ``timeline.json`` (every
rank's pipeline ops of the last step), ``summary.json`` and ``summary.txt`` (the run's numbers and
its bottleneck; :mod:`mpipar.report`), and checkpoints in ``--save-dir`` (default
``RUN_DIR/checkpoints``) every ``--save-every`` steps and at the end.

Exit status and failures:

- 0: finished; or preempted: SIGTERM or SIGUSR1 (``mpirun`` forwards both to every rank; one rank
  receiving it is enough) lets the current step finish, every rank agrees to stop after it,
  a checkpoint is committed, and ``--resume auto`` continues exactly from there.
- 2: bad configuration or data: rank 0 prints the error, every rank exits before any collective.
- 3: ``--on-nan stop`` met a non-finite loss or gradient norm: the step's update is not applied,
  a checkpoint of that state is committed (numbered as the step, so ``--resume auto`` continues
  after the offending batch) and the run stops. ``--on-nan skip`` counts such steps
  (``skipped_steps`` in the metrics) and goes on.
- 1: an uncaught exception on any rank aborts the whole job with that rank's number and
  traceback.
- 4: with ``--collective-timeout S`` a rank blocked longer than S seconds in one MPI call aborts
  the job naming the operation and group.
- 128 + signal (143 for SIGTERM): a stop signal before the first step (nothing to checkpoint).

Every abort (and ``--on-nan stop``) is reported durably before the job ends: one JSON line per
failing rank in ``RUN_DIR/failure.txt`` (fsynced) and ``status: "failed"`` in ``summary.json``
(:mod:`mpipar.failure`); a launcher may drop the aborting rank's stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import traceback

from mpi4py import MPI

from mpipar import config as config_mod
from mpipar.config import Config, ConfigError
from mpipar.failure import FailureReport

EXIT_USAGE = 2
EXIT_NONFINITE = 3
EXIT_WATCHDOG = 4
EXIT_EXCEPTION = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def install_abort_hook(report: FailureReport) -> None:
    """Make an uncaught exception on any rank abort the whole job (never a hang), reported
    durably first (:mod:`mpipar.failure`)."""

    def hook(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        report.abort("exception", f"mpipar: rank {report.rank} failed; aborting all ranks\n{text}",
                     EXIT_EXCEPTION)

    sys.excepthook = hook


class StopRequest:
    """Remembers a preemption signal (SIGTERM, SIGUSR1); the loop stops after the current step.
    Before the loop starts (:meth:`training`) there is nothing to checkpoint, so a signal ends
    the job at once: reported, then aborted with status 128 + the signal number."""

    def __init__(self, report: FailureReport) -> None:
        self.report = report
        self.signal: str | None = None
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
        self.signal = name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpipar.train",
        description="Train a Llama-family model with data/tensor/pipeline/sequence parallelism "
                    "over MPI. Flags override --config; see README for every field.")
    config_mod.add_arguments(parser)
    return parser


def fail_usage(message: str, comm: MPI.Comm = MPI.COMM_WORLD) -> None:
    """Print the error once (rank 0) and exit 2 on every rank, without any collective."""
    if comm.Get_rank() == 0:
        sys.stderr.write(f"mpipar: error: {message}\n")
        sys.stderr.flush()
    raise SystemExit(EXIT_USAGE)


def resolve_config(argv: list[str] | None, world: int, notes: list[str] | None = None) -> Config:
    """Parse, default the save directory to ``RUN_DIR/checkpoints``, apply a checkpoint's model
    settings, choose a layout when none is given (a note about it goes to ``notes``), validate;
    exit 2 on error."""
    args = build_parser().parse_args(argv)
    import mpipar.engine  # noqa: F401  (imports every component: their configuration rules)
    try:
        cfg = config_mod.from_args(args)
        tr = cfg.train
        tr.save_dir = tr.save_dir or os.path.join(tr.run_dir, "checkpoints")
        if tr.resume:
            from mpipar import checkpoint
            path, _ = checkpoint.resolve_resume(tr.resume, tr.save_dir)
            if path is not None:
                cfg.model = config_mod.model_from_checkpoint(
                    checkpoint.read_model_config(path), config_mod.given_fields(args, "model"),
                    source=str(path))
        if tr.init_from_hf or tr.export_hf:
            from mpipar import hf
            if tr.init_from_hf:
                hf_model = hf.read_model_config(tr.init_from_hf, tr.hf_untie_embeddings)
                cfg.model = hf.model_config_with_overrides(
                    hf_model, config_mod.given_fields(args, "model"), source=tr.init_from_hf)
            if tr.export_hf:
                try:
                    hf.check_export_target(tr.export_hf)
                except ValueError as exc:
                    raise ConfigError(f"--export-hf {tr.export_hf}: {exc}") from None
        from mpipar.planner import auto_layout
        cfg, note = auto_layout(cfg, world, config_mod.given_names(args, "parallel", "train"))
        if note is not None and notes is not None:
            notes.append(note)
        return cfg.resolved(world)
    except ConfigError as exc:
        fail_usage(str(exc))
        raise  # unreachable: fail_usage exits


def main(argv: list[str] | None = None, comm: MPI.Comm = MPI.COMM_WORLD) -> int:
    report = FailureReport(comm)
    install_abort_hook(report)
    stop = StopRequest(report).install()
    from mpipar.backend import configure_threads, local_size_from_env
    # Thread pools are sized before NumPy/Numba load; from the launcher's environment when it
    # says how many ranks share the node (no collective), else after validation by a split.
    threads = configure_threads(None) if local_size_from_env() or comm.Get_size() == 1 else 0
    notes: list[str] = []
    cfg = resolve_config(argv, comm.Get_size(), notes)
    # Before any collective, so no other rank can have reported into this run's directory yet.
    report.attach(cfg.train.run_dir, fresh=comm.Get_rank() == 0)
    threads = threads or configure_threads(comm)

    from mpipar.data import DataError
    tr = cfg.train
    from mpipar.engine import Engine

    from mpipar.checkpoint import CheckpointError

    rank0 = comm.Get_rank() == 0
    start = 0
    error = None
    try:
        engine = Engine(cfg, comm)
        resume_from = None
        if tr.resume:  # every rank reads the same files: the answer is the same everywhere
            from mpipar import checkpoint
            resume_from, resume_notes = checkpoint.resolve_resume(tr.resume, tr.save_dir)
            for note in resume_notes if rank0 else ():
                print(f"mpipar: {note}", flush=True)
        if resume_from is not None:
            start = checkpoint.load(engine, resume_from)
            if rank0:
                print(f"mpipar: resumed from {resume_from} at step {start}", flush=True)
        elif tr.init_from_hf:
            from mpipar.hf import load_hf
            engine.load_params(load_hf(tr.init_from_hf, tr.dtype, tr.hf_untie_embeddings)[1])
    except (DataError, ConfigError, CheckpointError) as exc:
        error = str(exc)
    # Agree before training: a file error seen by any rank stops every rank with status 2.
    failed = [e for e in comm.allgather(error) if e]
    if failed:
        fail_usage(failed[0])
    try:
        return _run(engine, cfg, comm, start, stop, report, threads, notes)
    finally:
        engine.close()


def _run(engine, cfg: Config, comm: MPI.Comm, start: int, stop: StopRequest,
         report: FailureReport, threads: int, notes: list[str]) -> int:
    """The training loop and everything written around it (see the module docstring)."""
    from mpipar import metrics
    from mpipar.comm import Watchdog
    from mpipar.planner import model_flops_per_step

    tr = cfg.train
    rank0 = comm.Get_rank() == 0
    t_run = time.perf_counter()
    telemetry = metrics.Telemetry(comm)
    watchdog = None
    if tr.collective_timeout:
        watchdog = Watchdog([engine.ledger, telemetry.ledger], tr.collective_timeout,
                            comm.Get_rank(),
                            lambda message: report.abort("watchdog", message, EXIT_WATCHDOG)
                            ).start()
    from mpipar.backend import local_ranks, local_size_from_env
    on_node = local_size_from_env() or local_ranks(comm)[1]
    peaks = telemetry.gather_peaks(metrics.measure_peak(engine.kernels.name, tr.dtype, threads,
                                                        on_node))
    flops = model_flops_per_step(cfg)
    skipped = _skipped_before(tr.run_dir, start) if rank0 else 0
    from mpipar.tensorboard import log_dir
    writer = metrics.MetricsWriter(tr.run_dir, enabled=rank0, append=start > 0,
                                   tensorboard=log_dir(tr.tensorboard, tr.run_dir))
    if rank0:
        with open(os.path.join(tr.run_dir, "config.toml"), "w") as fh:
            fh.write(cfg.to_toml())
        for note in notes:
            print(f"mpipar: {note}", flush=True)
        print(f"mpipar: layout {engine.grid.describe()} | {engine.reducer.describe()} | "
              f"kernels {engine.kernels.describe()} | "
              f"model {cfg.model.layers}x{cfg.model.hidden} heads {cfg.model.heads}/"
              f"{cfg.model.kv_heads} vocab {cfg.model.vocab_size} | data {engine.source.path} "
              f"({engine.source.num_samples} samples of {tr.seq_len}) | global batch "
              f"{tr.global_batch_size} x {tr.seq_len} | {tr.dtype} | {threads} thread(s)/rank | "
              f"peak {sum(peaks) / 1e9:,.1f} GFLOP/s over {len(peaks)} rank(s)", flush=True)
        if start == 0 and _has_checkpoints(tr.save_dir):
            print(f"mpipar: {tr.save_dir} holds checkpoints of an earlier run; this run starts "
                  f"fresh and saves beside them (--resume auto continues instead)", flush=True)
    progress = metrics.Progress(tr.steps, start, tr.log_every, rank0)
    stop.training()
    status, code, saved, last = "completed", 0, start, None
    for k in range(start, tr.steps):
        engine.ledger.reset()
        started = time.time()
        result = engine.train_step(k)
        nonfinite = not (math.isfinite(result.loss) and math.isfinite(result.grad_norm))
        io = 0.0
        if tr.save_every and result.step % tr.save_every == 0:
            t0 = time.perf_counter()
            checkpoint_save(engine, cfg, result.step, progress)
            saved, io = result.step, time.perf_counter() - t0
        times = metrics.time_breakdown(result.step_time_s, engine.ledger.seconds_by_group(),
                                       engine.executor.timeline, io)
        stopping, ranks = telemetry.exchange(
            stop.signal is not None, times, engine.ledger.bytes_by_group(),
            sum(links["inter"] for links in engine.ledger.bytes_by_link().values()))
        skipped += nonfinite
        record = metrics.step_record(result, ranks, engine.ledger, flops, sum(peaks), nonfinite,
                                     skipped)
        writer.write(record)
        progress.update(record)
        last = (result, started)
        if nonfinite and tr.on_nan == "stop":
            status = f"stopped at step {result.step}: non-finite loss or gradient norm"
            code = EXIT_NONFINITE
            break
        if stopping:
            status = f"preempted after step {result.step}"
            break
    progress.close()
    writer.close()
    if last is None:  # nothing to train (steps reached already, or --steps 0)
        _finish(watchdog, engine, cfg, rank0, export=True)
        return 0
    result, started = last
    path = None
    if saved != result.step:
        path = checkpoint_save(engine, cfg, result.step, None)
    timeline = metrics.gather_timeline(comm, result.step, engine.executor.timeline, started,
                                       tuple(engine.grid.coord))
    if rank0:
        if code == EXIT_NONFINITE:
            message = (f"mpipar: step {result.step}: loss {result.loss} / gradient norm "
                       f"{result.grad_norm} is not finite (--on-nan stop); its update was not "
                       f"applied, the state is saved in "
                       f"{path or _step_path(tr.save_dir, result.step)}; exit {EXIT_NONFINITE}")
            report.record("nonfinite", message, EXIT_NONFINITE)
            sys.stderr.write(message + "\n")
        _write_summary(cfg, timeline, status, peaks, flops, time.perf_counter() - t_run)
        if status.startswith("preempted"):
            print(f"mpipar: {status} of {tr.steps} on a stop signal; checkpoint "
                  f"{path or _step_path(tr.save_dir, result.step)}; continue with --resume auto",
                  flush=True)
    _finish(watchdog, engine, cfg, rank0, export=status == "completed")
    return code


def _finish(watchdog, engine, cfg: Config, rank0: bool, export: bool) -> None:
    if watchdog is not None:
        watchdog.stop()
    if export and cfg.train.export_hf:
        export_hf(engine, cfg, rank0)


def _step_path(save_dir: str, step: int) -> str:
    from mpipar.checkpoint import step_dir_name
    return os.path.join(save_dir, step_dir_name(step))


def _has_checkpoints(save_dir: str) -> bool:
    from mpipar.checkpoint import list_checkpoints
    return os.path.isdir(save_dir) and bool(list_checkpoints(save_dir))


def _skipped_before(run_dir: str, start: int) -> int:
    """The skipped-step count of step ``start`` in an earlier run's metrics (0 if none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if start == 0 or not os.path.exists(path):
        return 0
    count = 0
    with open(path) as fh:
        for line in fh:
            if line.strip():
                record = json.loads(line)
                if record.get("step", 0) <= start:
                    count = record.get("skipped_steps", count)
    return count


def _write_summary(cfg: Config, timeline: dict, status: str, peaks: list[float], flops: float,
                   wall_s: float) -> None:
    """Rank 0: timeline.json, summary.json and summary.txt of the run so far; prints the text."""
    from mpipar import failure, metrics, report
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


def checkpoint_save(engine, cfg: Config, step: int, progress) -> str:
    """Save and commit a checkpoint of ``step`` (collective), pruning to ``keep_last``; rank 0
    says so (through ``progress`` when a bar is showing)."""
    from mpipar import checkpoint
    path = checkpoint.save(engine, cfg, step, cfg.train.save_dir, cfg.train.keep_last)
    if engine.grid.rank == 0:
        text = f"mpipar: saved checkpoint {path}"
        if progress is not None:
            progress.note(text)
        else:
            print(text, flush=True)
    return str(path)


def export_hf(engine, cfg: Config, rank0: bool) -> None:
    """Gather the global weights (collective) and let rank 0 write the HF directory."""
    from mpipar import hf
    params = engine.gather_params()
    if not rank0:
        return
    tr = cfg.train
    extra = (hf.passthrough_config(tr.init_from_hf) if tr.init_from_hf
             else {"max_position_embeddings": max(hf.DEFAULT_MAX_POSITIONS, tr.seq_len)})
    hf.save_hf(tr.export_hf, cfg.model, params, dtype=tr.export_dtype or tr.dtype,
               extra_config=extra)
    print(f"mpipar: exported Hugging Face Llama weights ({tr.export_dtype or tr.dtype}) to "
          f"{tr.export_hf}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
