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

With ``--on-rank-failure shrink`` (an MPI with ULFM; else exit 2 at start-up) a rank that dies
does not end the job: the survivors go on, on a smaller world, from the last consistent state
(:mod:`mpipar.training.recovery`); when they cannot, exit 1 with the failure report.

Every abort (and ``--on-nan stop``) is reported durably before the job ends: one JSON line per
failing rank in ``RUN_DIR/failure.txt`` (fsynced) and ``status: "failed"`` in ``summary.json``
(:mod:`mpipar.training.failure`); a launcher may drop the aborting rank's stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from mpipar.runtime.mpi_init import MPI, mark_started  # MPI_Init under MPIPAR_INIT_TIMEOUT

from mpipar import config as config_mod
from mpipar.config import cli as config_cli
from mpipar.config import ConfigError
from mpipar.training.failure import (EXIT_EXCEPTION, EXIT_WATCHDOG, FailureReport, fail_usage,
                                     install_abort_hook)
from mpipar.layout import Layout, model_from_checkpoint
from mpipar.training.loop import RunContext, StopRequest, run
# Nothing imported here loads NumPy or Numba: main sizes their thread pools first when the
# launcher says how many ranks share the node (tests/e2e/test_launch.py holds it to that).

if TYPE_CHECKING:  # mpipar.runtime.comm loads NumPy, which must wait for the thread settings
    from mpipar.runtime.comm import Group, Watchdog


class RankZeroParser(argparse.ArgumentParser):
    """An argument parser that prints usage, help and errors on rank 0 only: every rank parses
    the same arguments and exits with the same status, but one copy of the text is enough."""

    def _print_message(self, message: str, file=None) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str):
        """One line naming the bad flag and where the flags are listed, exit 2 (argparse's own
        prints the whole usage, dozens of lines, first)."""
        self.exit(2, f"{self.prog}: error: {message} (python -m mpipar.train --help lists "
                     f"every flag)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = RankZeroParser(
        prog="python -m mpipar.train",
        description="Train a Llama-family model with data/tensor/pipeline/sequence parallelism "
                    "over MPI. Flags override --config; docs/configuration.md lists every field.")
    config_cli.add_arguments(parser)
    return parser


def resolve_config(argv: list[str] | None, world: int, notes: list[str] | None = None,
                   comm: MPI.Comm | None = None) -> Layout:
    """Parse, default the save directory to ``RUN_DIR/checkpoints``, apply a checkpoint's model
    settings, choose a layout when none is given (a note about it goes to ``notes``), validate;
    exit 2 on error. With ``comm`` (every rank of it calls this alike), the ``--resume``
    checkpoint is verified by its ranks together, each hashing its share of the shards."""
    from mpipar.checkpoint.directory import CheckpointError
    args = build_parser().parse_args(argv)
    try:
        cfg = config_cli.from_args(args)
        tr = cfg.train
        tr.save_dir = tr.save_dir or os.path.join(tr.run_dir, "checkpoints")
        if tr.resume:
            from mpipar.checkpoint import reader
            peers = None if comm is None else reader.Peers.of(comm)
            path, _ = reader.resolve_resume(tr.resume, tr.save_dir, peers)
            if path is not None:
                saved = reader.read_config(path)
                from mpipar.training.optimizers import check_resume
                check_resume(saved.train, tr, str(path))
                cfg.model = model_from_checkpoint(
                    saved.model, config_cli.given_fields(args, "model"), source=str(path))
                tr.eval_fraction = config_mod.held_out_from_checkpoint(
                    saved.train, config_cli.given_fields(args, "train"), source=str(path))
        if tr.init_from_hf:
            from mpipar.checkpoint import huggingface as hf
            hf_model = hf.read_model_config(tr.init_from_hf, tr.hf_untie_embeddings)
            cfg.model = hf.model_config_with_overrides(
                hf_model, config_cli.given_fields(args, "model"), source=tr.init_from_hf)
        from mpipar.plan.search import auto_layout
        from mpipar.rules import validate
        cfg, note = auto_layout(cfg, world, config_cli.given_names(args, "parallel", "train"))
        if note is not None and notes is not None:
            notes.append(note)
        return validate(cfg, world)
    except (ConfigError, CheckpointError) as exc:
        fail_usage(str(exc))
        raise  # unreachable: fail_usage exits


def relayout(layout: Layout, world: int) -> Layout:
    """The layout of ``layout``'s run on ``world`` ranks (the survivors of a rank failure): tp,
    pp, sp and ep kept and dp the rest (the micro-batch size kept, else one microbatch per
    replica), else the planner's fastest valid layout; the global batch is kept. ConfigError
    when none fits."""
    import dataclasses
    from mpipar.config import Config
    from mpipar.plan.search import auto_layout
    from mpipar.rules import validate
    cfg, errors = layout.config, []
    rest = layout.tp * layout.pp * layout.sp
    for mbs in dict.fromkeys((layout.micro_batch_size, 0)) if world % rest == 0 else ():
        try:
            return validate(Config(cfg.model, dataclasses.replace(cfg.parallel, dp=world // rest),
                                   dataclasses.replace(cfg.train, micro_batch_size=mbs)), world)
        except ConfigError as exc:
            errors.append(str(exc))
    free = Config(cfg.model, dataclasses.replace(cfg.parallel, dp=0, tp=1, pp=1, sp=1),
                  dataclasses.replace(cfg.train, micro_batch_size=0))
    try:
        planned, _ = auto_layout(free, world, {"global_batch_size"})
        return validate(planned, world)
    except ConfigError as exc:
        raise ConfigError("; ".join([*errors, str(exc)])) from None


def main(argv: list[str] | None = None, comm: MPI.Comm | None = None) -> int:
    from mpipar.runtime import allreduce, ulfm
    # The library reads its algorithm controls and its failure detector's in MPI_Init: before
    # the first use of MPI.
    allreduce.preset(allreduce.early_choice(sys.argv[1:] if argv is None else argv))
    ulfm.preset(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    report = FailureReport(comm)
    install_abort_hook(report)
    stop = StopRequest(report).install()
    from mpipar.runtime.nodes import (configure_threads, local_size_from_env, ranks_on_node,
                                      threads_in_use)
    # Thread pools are sized before NumPy/Numba load when the launcher says how many ranks
    # share the node; else after validation, from every rank's processor name.
    known = local_size_from_env() or (1 if comm.Get_size() == 1 else None)
    if known:
        configure_threads(known)
    notes: list[str] = []
    cfg = resolve_config(argv, comm.Get_size(), notes, comm)
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.training.recovery import on_rank_failure
    ctx = RunContext(cfg, Group(comm, "world", Ledger()), stop, report, notes)
    ctx.on_rank_failure = on_rank_failure(cfg.train.on_rank_failure, relayout, cfg.train.save_dir,
                                         cfg.train.state_copies)
    refusal = ctx.on_rank_failure.refusal()   # the same on every rank, before any collective
    if refusal is not None:
        fail_usage(refusal, comm)
    try:
        ctx.allreduce = allreduce.configure(cfg.parallel.allreduce_algorithm,
                                            cfg.parallel.allreduce_hardware,
                                            MPI.Get_library_version())
    except ConfigError as exc:
        fail_usage(str(exc))
    ctx.watchdog = _start_watchdog(ctx)
    ctx.on_node = known or ranks_on_node(ctx.control.allgather_object(MPI.Get_processor_name()),
                                         comm.Get_rank())
    if not known:
        configure_threads(ctx.on_node)  # a value the user set stays
    ctx.threads = threads_in_use()
    lock = _claim(ctx)
    mark_started(ctx.control.rank)   # _claim ended in a collective over the world
    try:
        # Under the lock: no other run can be reporting into this run directory.
        report.attach(cfg.train.run_dir, fresh=ctx.rank0)
        from mpipar.training import step as steps
        from mpipar.checkpoint.writer import SaveError
        rank, start = _build(ctx)
        try:
            code = run(rank, start, ctx)
        except SaveError as exc:  # raised on every rank alike: no collective is left waiting
            code = _save_failed(ctx, exc)
        finally:
            steps.close(ctx.replaced or rank)
    finally:
        if lock is not None:
            lock.release()
    if ctx.replaced is not None or ctx.on_rank_failure.name == "shrink":
        # a process of the job died, or the heartbeat detector runs: MPI_Finalize may wait
        # for good (ulfm.leave)
        ulfm.leave(code)
    return code


def _save_failed(ctx: RunContext, exc: Exception) -> int:
    """A checkpoint that could not be written (a full disk): one line on rank 0 naming the path,
    the bytes and what ``latest`` still names, recorded in ``failure.txt``; exit 1 (damage)."""
    message = f"mpipar: error: {exc}"
    ctx.report.record("checkpoint", message, EXIT_EXCEPTION)
    if ctx.rank0:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    return EXIT_EXCEPTION


def _start_watchdog(ctx: RunContext) -> Watchdog | None:
    """With --collective-timeout: watch the control group now, the rank once it exists."""
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
        from mpipar.plan import admission
        admission.check_memory(cfg, ctx.control.rank, ctx.on_node)
        admission.check_device_memory(cfg, ctx.control.rank, ctx.on_node)
        admission.check_shared_memory(cfg, ctx.control.rank, ctx.on_node)
        rundir.prepare_outputs(cfg)
        if ctx.rank0:
            lock = rundir.RunLock([cfg.train.run_dir, cfg.train.save_dir]).acquire()
            ctx.notes.extend(rundir.refuse_earlier_run(cfg))
    except ConfigError as exc:
        error = str(exc)
    try:
        _agree(ctx.control, error)
    except SystemExit:
        if lock is not None:
            lock.release()
        raise
    return lock


def _build(ctx: RunContext):
    """This process's rank of the run (:func:`mpipar.training.rank.build_rank`), with its state
    from ``--resume`` or ``--init-from-hf``; a data, checkpoint or configuration error on any
    rank stops every rank with status 2. Returns (the rank, the step it starts after)."""
    from mpipar.checkpoint.directory import CheckpointError
    from mpipar.data.sources import DataError
    from mpipar.training import rank as ranks
    built, start, error = None, 0, None
    try:
        built = ranks.build_rank(ctx.cfg, ctx.control.comm)
        if ctx.watchdog is not None:
            ctx.watchdog.watch(built.ledger)
            ctx.watchdog.watch(built.eval_ledger)
        start = _load_state(built, ctx)
    except (DataError, ConfigError, CheckpointError) as exc:
        error = str(exc)
    _agree(ctx.control, error)
    return built, start


def _load_state(rank, ctx: RunContext) -> int:
    """Load ``--resume`` (every rank reads the same files: the same answer everywhere) or
    ``--init-from-hf`` into ``rank``; returns the step the checkpoint holds (0: fresh). Under
    LoRA the frozen base is never in a checkpoint: ``--init-from-hf`` is read first, resumed
    or not; ``--init-adapter`` starts a fresh run's adapters."""
    from mpipar.training import step as steps
    tr = ctx.cfg.train
    lora = rank.weights.frozen is not None
    if tr.init_from_hf and lora:
        _init_from_hf(rank, tr)
    if tr.resume:
        from mpipar.checkpoint import reader
        from mpipar.checkpoint.directory import CheckpointError
        from mpipar.training.optim import extends_with_steps
        path, notes = reader.resolve_resume(tr.resume, tr.save_dir)
        if path is not None:
            start = reader.load(rank.state, path)
            if tr.reset_optimizer:
                from mpipar.training.optimizers import reset_state
                reset_state(rank.weights.optimizer, rank.state.store.local_shapes())
                notes.append("--reset-optimizer: the optimizer state starts afresh")
            try:   # the routing biases and a DPO run's reference, recorded once in the index
                rank.model.routing.load(reader.read_moe_bias(path))
                if rank.data.preference is not None:
                    rank.data.preference.load(reader.read_dpo_reference(path), start)
            except ValueError as exc:
                raise CheckpointError(f"{path}: {exc}") from None
            notes += [f"resumed from {path} at step {start}",
                      *reader.resume_changes(path, steps.run_position(rank, start),
                                             extends_with_steps)]
        for note in notes if ctx.rank0 else ():
            print(f"mpipar: {note}", flush=True)
        if path is not None:
            return start
    if tr.init_from_hf and not lora:
        _init_from_hf(rank, tr)
    if tr.init_adapter:
        from mpipar.checkpoint.peft import read_adapter
        steps.load_params(rank, read_adapter(tr.init_adapter, ctx.cfg.model,
                                             rank.model.table.lora),
                          source=f"--init-adapter {tr.init_adapter}", partial=True)
    return 0


def _init_from_hf(rank, tr) -> None:
    """The parameters of ``--init-from-hf``, read as the masters (float32 under bf16: a float32
    file keeps its precision)."""
    from mpipar.checkpoint.huggingface import load_hf, load_selection_biases
    from mpipar.training import step as steps
    steps.load_params(rank, load_hf(tr.init_from_hf, rank.compute.master_dtype.name,
                                   tr.hf_untie_embeddings)[1],
                     source=f"--init-from-hf {tr.init_from_hf}")
    rank.model.routing.load(load_selection_biases(tr.init_from_hf))  # DeepSeek-V3's, if any


if __name__ == "__main__":
    sys.exit(main())
