"""Per-step metrics: time breakdown, MFU, memory, one JSON line per step (with the validation
pass's numbers on validation steps: :func:`eval_record`), progress, timeline.

Every rank measures its own step; :class:`Telemetry` gathers the numbers to rank 0 once per
step (one small all-gather, which also carries the stop signal a rank received, so every rank
decides to stop at the same step), and rank 0 writes ``RUN_DIR/metrics.jsonl``. A resumed run
cuts the log back to the step it resumes from (:class:`MetricsWriter`), and the log is fsynced
before each checkpoint commit, so a crash never leaves a step twice or a committed step
missing; a torn last line (a crash mid-write) is skipped by :func:`read_records`.

Time breakdown of a step on one rank (seconds, :data:`TIME_KEYS`), from the ledger and the
pipeline executor's op records:

- ``tp_comm``, ``sp_comm``: ledger seconds of the ``tp`` and the sp groups (``sp``, and hybrid
  attention's ``sp_ulysses`` and ``sp_ring``; spent inside forward/backward ops);
- ``ep_comm``: ledger seconds of the ``ep`` group (the experts' all-to-all dispatch and combine,
  inside forward/backward ops; 0 without expert parallelism);
- ``compute``: the forward/backward ops' time minus the TP, SP and EP communication inside them;
- ``pipeline_wait``: ledger seconds of ``pp`` (blocked in receives: the bubble and the
  point-to-point transfers, plus the loss broadcast);
- ``dp_comm``: ledger seconds of the dp x sp groups (``dp_sp``, and hierarchical reduction's
  ``dp_sp_intra`` and ``dp_sp_inter``), ``tp_pp`` and ``pp_ends`` (gradient reduction, ZeRO
  all-gather, loss and gradient-norm all-reduces, the tied embedding's gradient sum);
- ``optimizer``: the rest of the engine's step time (clipping, AdamW, batch slicing);
- ``io``: time outside the engine's step since the previous step's record (the checkpoint
  written after that record: a step's record is logged before its checkpoint commits). With
  ``--async-save`` only the blocking part: the copy to host memory, a wait for a write still
  in flight, and the commit (the background write itself overlaps the following steps).

What the optimizer costs is measured around it too (:class:`OptimizerCost`, rank 0's in the
record as ``optimizer_s`` and ``optimizer_bytes``): the seconds of clipping and the update, and
the bytes they hand to MPI (Muon's exchanges, ZeRO's all-gathers; the ledger's count, all groups).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mpipar.runtime.comm import Group, Ledger

if TYPE_CHECKING:
    from mpipar.parallel.pipeline.executor import OpRecord

TIME_KEYS = ("compute", "tp_comm", "sp_comm", "ep_comm", "pipeline_wait", "dp_comm", "optimizer",
             "io")
OPTIONAL_TIME_KEYS = ("ep_comm",)
"""Time keys a record may lack (logs written before they were measured): read as 0."""
SP_GROUPS = ("sp", "sp_ulysses", "sp_ring")
DP_GROUPS = ("dp_sp", "dp_sp_intra", "dp_sp_inter", "tp_pp", "pp_ends")
GROUPS = ("tp", *SP_GROUPS, "pp", *DP_GROUPS, "ep")
COMPUTE_OPS = ("fwd", "bwd", "bwd_input", "bwd_weight")

MFU_CAUSE = ("an MFU over 100% is a measurement problem, not speed: the peak probe was "
             "disturbed (other processes on the cores while it ran) or the ranks' threads "
             "oversubscribe the cores (ranks x threads per rank > cores: set OMP_NUM_THREADS "
             "and NUMBA_NUM_THREADS to cores / ranks per node)")
"""Why a step's MFU can exceed 1: what the log line and the summary say beside it."""

NO_TARGETS = ("no counted target in the global batch: every label is masked (--loss-mask, "
              "--eod-mask-loss), so its loss and gradient norm are 0 by definition, not a "
              "measurement (the optimizer stepped on a zero gradient)")
"""What the step line says of a step whose global batch has no counted target."""


def rate_text(record: dict[str, Any]) -> str:
    """A step line's throughput: tokens/s and MFU, or for a warm-up step (the first step of a
    process, fresh or resumed) that it measures none."""
    if record.get("warmup"):
        return (f"warm-up step {record['step_time_s']:.3g} s (compiling, first touches: no "
                f"throughput)")
    return f"{record['tokens_per_s']:,.0f} tok/s  {mfu_text(record['mfu'])}"


def mfu_text(mfu: float, digits: int = 2) -> str:
    """``MFU 12.34%``, flagged ``(> 100%: not a real rate)`` when it exceeds 1."""
    flag = " (> 100%: not a real rate)" if mfu > 1 else ""
    return f"MFU {100 * mfu:.{digits}f}%{flag}"


@dataclass
class OptimizerCost:
    """What one optimizer step (clipping and the update) cost this rank: its seconds and the
    bytes it handed to MPI (``ledger`` counts, every group), between :meth:`start` and
    :meth:`stop`. A step that applies no update (a non-finite loss) costs nothing."""

    seconds: float = 0.0
    bytes: int = 0

    def start(self, ledger: Ledger) -> None:
        self.seconds, self.bytes = -time.perf_counter(), -sum(ledger.bytes_by_group().values())

    def stop(self, ledger: Ledger) -> None:
        self.seconds += time.perf_counter()
        self.bytes += sum(ledger.bytes_by_group().values())


@dataclass
class StepResult:
    """What one optimizer step produced (the same on every rank)."""

    step: int          # 1-based number of the step just completed
    loss: float        # mean token loss of this step's forward pass, before the update
    grad_norm: float   # global L2 norm before clipping
    lr: float
    step_time_s: float
    tokens: int        # tokens in the global batch
    # --document-masking with sp > 1: max/mean attention work over the sp ranks (the
    # worst dp replica's sum over its microbatches); None otherwise
    attention_imbalance: float | None = None
    moe: dict | None = None  # mixture of experts: moe_aux_loss, moe_load_max_over_mean and
    #                          moe_dropped (assignments the capacity dropped; with
    #                          --moe-bias-update-rate moe_bias_max_abs), per sparse layer
    # --document-masking: this step's model FLOPs, attention counted inside documents (MFU's
    # numerator); None: the run's constant model_flops_per_step
    flops: float | None = None
    # --objective dpo: dpo_reward_chosen, dpo_reward_rejected (mean over the global batch's
    # pairs) and dpo_accuracy (the fraction whose chosen reward is above the rejected one)
    preference: dict | None = None
    # --loss-mask / --eod-mask-loss: the global batch's counted targets (every rank counts the
    # whole batch, so all agree); 0: every label masked, the loss and gradient are 0 by
    # definition and the record says so (``no_targets``). None: every target counts
    targets: int | None = None
    optimizer: OptimizerCost | None = None  # what the optimizer step cost this rank
    # --mtp-depth: the multi-token prediction loss L_MTP (lambda / D times the sum of the
    # modules' mean token losses; training minimises loss + mtp_loss). None without it
    mtp_loss: float | None = None


@dataclass
class EvalResult:
    """What one validation pass produced (the same on every rank)."""

    loss: float        # mean token loss over every token of the validation batches
    perplexity: float  # exp(loss)
    tokens: int        # tokens in the validation batches
    seconds: float


def peak_memory_bytes() -> int:
    """This process's peak resident memory (VmHWM; ``ru_maxrss`` where /proc is absent)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def time_breakdown(step_time_s: float, ledger_seconds: dict[str, float],
                   timeline: list["OpRecord"], io_s: float = 0.0) -> dict[str, float]:
    """Seconds per :data:`TIME_KEYS` of one step on one rank (see the module docstring)."""
    tp = ledger_seconds.get("tp", 0.0)
    sp = sum(ledger_seconds.get(g, 0.0) for g in SP_GROUPS)
    ep = ledger_seconds.get("ep", 0.0)
    ops = sum(r.end - r.start for r in timeline if r.kind in COMPUTE_OPS)
    out = {"compute": max(0.0, ops - tp - sp - ep), "tp_comm": tp, "sp_comm": sp, "ep_comm": ep,
           "pipeline_wait": ledger_seconds.get("pp", 0.0),
           "dp_comm": sum(ledger_seconds.get(g, 0.0) for g in DP_GROUPS)}
    out["optimizer"] = max(0.0, step_time_s - sum(out.values()))
    out["io"] = io_s
    return out


def measure_peak(backend_name: str, dtype: str, threads: int, ranks_on_node: int,
                 device=None, rate: float | None = None) -> float:
    """FLOP/s peak of this rank: for cupy its share of the device's (ranks placed on one GPU
    share its rate, so the run's peak counts each GPU once); else a short GEMM probe with this
    rank's ``threads``, times its share of the node's cores (less than 1 when more ranks x
    threads than cores share the node). ``device``: the rank's
    :class:`~mpipar.runtime.device.Device` (cupy only). ``rate``: :func:`rank_rate`'s value
    measured already (a recovery's smaller world changes how many ranks share the node, not
    the rate of this process's threads), else it is measured."""
    from mpipar.runtime import nodes
    rate = rank_rate(backend_name, dtype) if rate is None else rate
    if backend_name == "cupy":
        from mpipar.runtime.device import ranks_sharing
        share = ranks_sharing(device.index, device.visible, ranks_on_node) if device else 1
        return rate / share
    return rate * nodes.cpu_peak_share(threads, ranks_on_node)


def rank_rate(backend_name: str, dtype: str) -> float:
    """The FLOP/s of this rank before any sharing: a CUDA device's rate for cupy, else a short
    GEMM probe with this process's threads (a quarter of a second and more: the part of
    :func:`measure_peak` worth measuring once)."""
    from mpipar.runtime import peak
    if backend_name == "cupy":
        return peak.gpu_peak_flops(dtype)
    return peak.measure_peak_flops(dtype)


class Telemetry:
    """The per-step exchange of every rank's numbers: an all-gather over ``group``, the run's
    control group (its own ledger, so the engine's byte counts stay those the planner
    predicts)."""

    FIELDS = ("stop", "memory", "inter_bytes", *TIME_KEYS, *(f"bytes_{g}" for g in GROUPS),
              "writing")

    def __init__(self, group: Group) -> None:
        self.group = group
        self.size, self.rank = group.size, group.rank

    def gather_peaks(self, peak: float) -> list[float]:
        """Every rank's FLOP/s peak, on every rank."""
        out = np.empty(self.size)
        self.group.allgather(np.array([peak]), out)
        return out.tolist()

    def exchange(self, stop: int, times: dict[str, float], step_bytes: dict[str, int],
                 inter_bytes: int = 0, writing: bool = False
                 ) -> tuple[int, list[dict[str, float]]]:
        """``stop``: the number of the stop signal this rank received (0: none);
        ``inter_bytes``: this rank's wire bytes across nodes; ``writing``: whether its
        asynchronous checkpoint write is still running. Returns (the highest stop signal
        of any rank, 0 if none: the same on every rank; every rank's numbers as dicts of
        :attr:`FIELDS`)."""
        row = np.array([float(stop), float(peak_memory_bytes()), float(inter_bytes),
                        *(times[k] for k in TIME_KEYS),
                        *(float(step_bytes.get(g, 0)) for g in GROUPS), float(writing)])
        table = np.empty((self.size, row.size))
        self.group.allgather(row, table)
        ranks = [dict(zip(self.FIELDS, r.tolist())) for r in table]
        return int(max(r["stop"] for r in ranks)), ranks


def step_record(result: StepResult, ranks: list[dict[str, float]], ledger: Ledger,
                flops: float, peak_total: float, skipped: bool, skipped_total: int
                ) -> dict[str, Any]:
    """The metrics.jsonl line of a step (``ledger`` is rank 0's, ``ranks`` every rank's row)."""
    times = {k: float(np.mean([r[k] for r in ranks])) for k in TIME_KEYS}
    flops = result.flops if result.flops is not None else flops
    return {
        "step": result.step,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "tokens_per_s": result.tokens / result.step_time_s,
        "step_time_s": result.step_time_s,
        "tokens": result.tokens,
        "flops": flops,
        "mfu": flops / result.step_time_s / peak_total,
        "skipped": skipped,
        "skipped_steps": skipped_total,
        "time": times,                                   # mean over ranks
        "time_max": {k: max(r[k] for r in ranks) for k in TIME_KEYS},
        "comm_bytes": ledger.bytes_by_group(),           # rank 0
        "comm_bytes_max": {g: int(max(r[f"bytes_{g}"] for r in ranks)) for g in GROUPS
                           if any(r[f"bytes_{g}"] for r in ranks)},
        "comm_wire_bytes": ledger.bytes_by_link(),       # rank 0, inside / across nodes
        "inter_node_bytes_max": int(max(r["inter_bytes"] for r in ranks)),
        "comm_seconds": ledger.seconds_by_group(),       # rank 0
        "staging": {"bytes": ledger.staging.bytes, "copies": ledger.staging.messages,
                    "seconds": ledger.staging.seconds},  # rank 0: arrays <-> MPI host buffers
        "memory_bytes": [int(r["memory"]) for r in ranks],
        **({} if result.attention_imbalance is None
           else {"attention_imbalance": result.attention_imbalance}),
        **(result.moe or {}),
        **(result.preference or {}),
        **({} if result.targets is None else {"counted_targets": result.targets}),
        **({"no_targets": True} if result.targets == 0 else {}),
        **({} if result.optimizer is None else {"optimizer_s": result.optimizer.seconds,
                                                "optimizer_bytes": result.optimizer.bytes}),
        **({} if result.mtp_loss is None else {"mtp_loss": result.mtp_loss}),
    }


def read_records(path: str) -> list[dict[str, Any]]:
    """The step records of a ``metrics.jsonl``: JSON objects with an integer ``step`` >= 1. A
    torn last line (a crash or a full disk in the middle of a write: the file is fsynced only
    at checkpoint commits) is skipped; any other line that is not such a record is a
    ValueError naming the file and the line."""
    with open(path, "rb") as fh:
        lines = [line for line in fh.read().split(b"\n") if line.strip()]
    records = []
    for k, line in enumerate(lines):
        try:
            record = json.loads(line)
        except RecursionError:
            raise ValueError(f"{path}: line {k + 1} is JSON nested too deeply for a step "
                             f"record") from None
        except ValueError:  # not JSON, or not UTF-8
            if k < len(lines) - 1:
                raise ValueError(f"{path}: line {k + 1} is not JSON ({line[:60]!r}...)") from None
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"{path}: line {k + 1} is not a step record (a JSON object with an "
                             f"integer step >= 1): {line[:60]!r}")
        records.append(record)
    return records


def eval_record(result: EvalResult, ledger: Ledger) -> dict[str, Any]:
    """The ``eval`` part of a validation step's metrics.jsonl line: the validation pass's loss,
    perplexity, tokens, seconds and bytes per group (its own ledger, rank 0's)."""
    return {"loss": result.loss, "perplexity": result.perplexity, "tokens": result.tokens,
            "seconds": result.seconds, "comm_bytes": ledger.bytes_by_group()}


class MetricsWriter:
    """Writes step records to ``RUN_DIR/metrics.jsonl`` (rank 0: ``enabled``) and, with a
    ``tensorboard`` directory, their numbers to a new TensorBoard event file there
    (:mod:`mpipar.observe.tensorboard`). A fresh run (``start`` 0) starts the file anew; a run resumed
    at step ``start`` keeps the records of steps 1..start and drops any later ones (steps a
    crashed run logged after its last checkpoint, which the resumed run trains again),
    rewriting the file through a rename."""

    def __init__(self, run_dir: str, enabled: bool = True, start: int = 0,
                 tensorboard: str | None = None) -> None:
        self.enabled = enabled
        self._fh = None
        self._events = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            path = os.path.join(run_dir, "metrics.jsonl")
            kept = ([r for r in read_records(path) if r.get("step", 0) <= start]
                    if start and os.path.exists(path) else [])
            tmp = f"{path}.tmp.{os.getpid()}"
            with open(tmp, "w") as fh:
                fh.write("".join(json.dumps(r) + "\n" for r in kept))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            self._fh = open(path, "a")
            if tensorboard:
                from mpipar.observe.tensorboard import EventWriter
                self._events = EventWriter(tensorboard)

    def write(self, record: dict[str, Any]) -> None:
        """One record with a ``step`` and any (nested) numbers."""
        if not self.enabled:
            return
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._events is not None:
            from mpipar.observe.tensorboard import scalars
            self._events.add_scalars(record["step"], scalars(record))

    def sync(self) -> None:
        """Make every record written so far durable (before a checkpoint commits)."""
        if self._fh is not None:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self.sync()
            self._fh.close()
            self._fh = None
        if self._events is not None:
            self._events.close()
            self._events = None


LAUNCHERS = frozenset({"mpirun", "mpiexec", "mpiexec.hydra", "hydra_pmi_proxy", "orterun",
                       "orted", "prterun", "prted"})
"""Process names of MPI launchers and their per-node proxies, which forward a rank's output."""


def launcher_terminal(pid: int | None = None, proc: str = "/proc") -> bool:
    """Whether the process ``pid`` (default: this one's parent) is an MPI launcher (or a chain
    of them, :data:`LAUNCHERS`) whose own stdout is a terminal: under MPICH's mpirun rank 0's
    stdout is a pipe to its proxy, which forwards what it writes, bar redraws included, to the
    terminal mpirun was started from. ``mpirun ... > log`` or ``| tee log`` is no terminal."""
    pid = os.getppid() if pid is None else pid
    top = None
    try:
        for _ in range(8):
            with open(f"{proc}/{pid}/comm") as fh:
                if fh.read().strip() not in LAUNCHERS:
                    break
            top = pid
            with open(f"{proc}/{pid}/stat") as fh:         # field 4: the parent's pid
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        if top is None:
            return False
        fd = os.open(f"{proc}/{top}/fd/1", os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            return os.isatty(fd)
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return False


def users_terminal(stream: Any = None, env: dict[str, str] | None = None) -> bool:
    """Whether ``stream`` (stdout) is the terminal the user watches. Open MPI gives every rank a
    pseudo-terminal of its own whatever mpirun's output is (a log file too), so under Open MPI
    (``OMPI_COMM_WORLD_SIZE`` set) only the process's controlling terminal counts; a pipe to an
    MPI launcher writing to a terminal counts (:func:`launcher_terminal`)."""
    stream = sys.stdout if stream is None else stream
    env = os.environ if env is None else env
    try:
        if not stream.isatty():
            return stat.S_ISFIFO(os.fstat(stream.fileno()).st_mode) and launcher_terminal()
        if "OMPI_COMM_WORLD_SIZE" not in env:
            return True
        with open("/proc/self/stat") as fh:          # field 7: the controlling terminal
            controlling = int(fh.read().rsplit(")", 1)[1].split()[4])
        return controlling != 0 and controlling == os.fstat(stream.fileno()).st_rdev
    except (OSError, ValueError, IndexError):
        return False


class Progress:
    """Rank 0's progress: a tqdm bar when stdout is the user's terminal (:func:`users_terminal`:
    also through mpirun), else a line every ``every`` steps (and the last, and each warm-up
    step: a process's first, whose time is compilation, not throughput); ``every = 0`` prints
    nothing."""

    def __init__(self, total: int, start: int, every: int, enabled: bool,
                 tty: bool | None = None) -> None:
        self.total, self.every, self.enabled = total, every, enabled and every > 0
        self.bar = None
        self._mfu_flagged = False
        if self.enabled and (users_terminal() if tty is None else tty):
            from tqdm import tqdm
            # A terminal that reports a size of 0 x 0 (a fresh pty) would hide the bar: fall back.
            size = shutil.get_terminal_size()
            self.bar = tqdm(total=total, initial=start, unit="step", ncols=size.columns,
                            nrows=size.lines)

    def update(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        loss = "n/a" if record.get("no_targets") else f"{record['loss']:.4f}"
        if self.bar is not None:
            self.bar.update(1)
            rates = ({"tok_s": "warm-up"} if record.get("warmup") else
                     {"tok_s": f"{record['tokens_per_s']:,.0f}",
                      "mfu": f"{100 * record['mfu']:.1f}%"
                      + ("(>100%!)" if record["mfu"] > 1 else "")})
            self.bar.set_postfix(loss=loss, **rates, refresh=False)
        elif step % self.every == 0 or record.get("warmup") or step == self.total:
            skipped = f"  skipped {record['skipped_steps']}" if record["skipped_steps"] else ""
            print(f"step {step:>6}/{self.total}  loss {loss}  "
                  f"grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  "
                  f"{rate_text(record)}{skipped}", flush=True)
        if record.get("no_targets"):
            self.note(f"step {step:>6}/{self.total}  {NO_TARGETS}")
        if record["mfu"] > 1 and not record.get("warmup") and not self._mfu_flagged:
            self._mfu_flagged = True
            self.note(f"step {step}: {MFU_CAUSE}")
        if "eval" in record:
            self.note(f"step {step:>6}/{self.total}  validation loss "
                      f"{record['eval']['loss']:.4f}  perplexity "
                      f"{record['eval']['perplexity']:.3f}")

    def note(self, text: str) -> None:
        """A message that does not break the bar."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def gather_timeline(group: Group, step: int, timeline: list["OpRecord"], started: float,
                    coord: tuple[int, ...]) -> dict[str, Any] | None:
    """Every rank's op records of ``step`` on rank 0 (None elsewhere): a collective over the
    run's control ``group``, once a run.

    ``started`` is ``time.time()`` when this rank began the step; op times are shifted so that
    all ranks share one clock whose zero is the earliest rank's start (ranks of one node share
    the wall clock; across nodes the offset is as good as their clock synchronisation)."""
    mine = {"rank": group.rank, "coord": dict(zip(("dp", "tp", "pp", "sp"), coord)),
            "started": started,
            "ops": [[r.kind, r.microbatch, r.chunk, r.start, r.end] for r in timeline]}
    rows = group.gather_object(mine, root=0)
    if rows is None:
        return None
    zero = min(r["started"] for r in rows)
    for r in rows:
        shift = r.pop("started") - zero
        r["ops"] = [[k, mb, c, s + shift, e + shift] for k, mb, c, s, e in r["ops"]]
    return {"step": step, "ranks": rows}


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON through a temporary file and a rename (never half a file)."""
    tmp = f"{path}.tmp.{os.getpid()}.{time.monotonic_ns()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)
