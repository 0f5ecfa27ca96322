"""The training run as users live it: the default run, preemption, failures, bad data.

Every test launches ``python -m mpipar.train`` (under ``mpirun`` for several ranks) as a
subprocess. Faults are injected by small driver scripts that wrap one real function of the
engine on one rank before calling ``mpipar.train.main``."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import MPIRUN, launch_env, mpirun, needs_mpirun, open_mpi
from launch import TINY, metrics, rank_pids, run_train, start_train, wait_for_steps


# ---------------------------------------------------------------------------- default run
@pytest.mark.timeout(600)  # a hang guard: 8 ranks on 2 busy cores once took 240 s (now 9-20 s)
@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_default_run(tmp_path, ranks):
    """No flag but a short --steps, from a shell that sets no thread variable: the embedded
    default trains on 1, 2 and 8 ranks with the node's cores split among the ranks (the BLAS
    threads each rank really runs, which the banner prints), the loss falls clearly, and
    RUN_DIR holds config, metrics, timeline, summary and a checkpoint."""
    if ranks > 1 and not os.path.exists(MPIRUN):
        pytest.skip("no mpirun beside this Python (install mpipar[mpich])")
    from mpipar.checkpoint import directory
    from mpipar.config import Config
    from mpipar.plan.traffic import predict_step_bytes
    from mpipar.runtime.topology import Coord
    from mpipar.rules import validate
    from mpipar.runtime.nodes import threads_per_rank

    proc = run_train(ranks, ["--steps", "20"], cwd=tmp_path, timeout=540, bare=True)
    assert proc.returncode == 0, proc.stderr
    assert f"layout world={ranks} dp={ranks} tp=1 pp=1 sp=1" in proc.stdout
    # Ranks whose OpenBLAS kept every core took 5.5 s a step here instead of 0.08 (2 ranks).
    assert f"| {threads_per_rank(ranks)} thread(s)/rank |" in proc.stdout, proc.stdout
    run = tmp_path / "runs" / "mpipar"
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 21))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert abs(first - math.log(256)) < 0.1 and last < first - 1.5, (first, last)
    summary = json.loads((run / "summary.json").read_text())
    for r in rows:
        assert r["mfu"] == pytest.approx(r["flops"] / r["step_time_s"] / summary["peak_flops"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_time_s"])
        assert r["mfu"] > 0 and r["skipped_steps"] == 0
        assert len(r["memory_bytes"]) == ranks and min(r["memory_bytes"]) > 2**20
        assert set(r["time"]) == {"compute", "tp_comm", "sp_comm", "ep_comm", "pipeline_wait", "dp_comm",
                                  "optimizer", "io"}
        assert r["time"]["compute"] > 0
    # Bytes per group are the planner's (data parallel: the gradient buckets and the loss).
    saved = __import__("tomllib").loads((run / "config.toml").read_text())
    cfg = validate(Config.from_dict(saved), ranks)
    assert rows[-1]["comm_bytes_max"] == predict_step_bytes(cfg, Coord(0, 0, 0, 0))
    assert directory.latest(run / "checkpoints") == run / "checkpoints" / "step_00000020"
    assert summary["status"] == "completed" and summary["steps"] == [1, 20]
    assert "bottleneck:" in (run / "summary.txt").read_text()
    timeline = json.loads((run / "timeline.json").read_text())
    assert timeline["step"] == 20 and len(timeline["ranks"]) == ranks
    assert all([op[0] for op in r["ops"]] == ["fwd", "bwd"] for r in timeline["ranks"])


def test_progress_bar_on_a_terminal_log_lines_otherwise(tmp_path):
    """stdout a terminal: a tqdm bar and no log lines; a pipe: one line every --log-every."""
    import pty

    args = [sys.executable, "-m", "mpipar.train", *TINY[:-2], "--steps", "4", "--log-every", "2"]
    leader, follower = pty.openpty()
    proc = subprocess.Popen([*args, "--run-dir", str(tmp_path / "tty")], stdout=follower,
                            stderr=follower, text=True, env=launch_env())
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=120) == 0
    tty = b"".join(chunks).decode(errors="replace")
    assert "4/4" in tty and ("step/s" in tty or "s/step" in tty), tty
    assert "step      2/4" not in tty
    piped = run_train(1, [*TINY[:-2], "--steps", "4", "--log-every", "2",
                      "--run-dir", str(tmp_path / "pipe")])
    lines = [line for line in piped.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "4/4"]


# ------------------------------------------------------------------------------ preemption
@needs_mpirun
@pytest.mark.parametrize("sig,flags", [(signal.SIGTERM, []), (signal.SIGUSR1, []),
                                       (signal.SIGUSR1, ["--async-save", "--save-every", "1"])],
                         ids=["TERM", "USR1", "USR1-async-save"])
def test_stop_signal_to_mpirun_checkpoints_and_exits_0(tmp_path, sig, flags):
    """mpirun forwards the signal to every rank: the step finishes, a checkpoint is committed at
    the step the metrics end with, every rank exits 0. Open MPI 5's mpirun (PRRTE) kills the
    ranks about 1 s after it forwards SIGTERM, with no setting to wait longer: there, SIGUSR1 is
    the stop signal (docs/failures.md, jobs/README.md). With --async-save every step, the stop
    waits for the background write in flight and commits it; every checkpoint left verifies."""
    from mpi4py import MPI

    from mpipar.checkpoint import directory

    if sig == signal.SIGTERM and MPI.Get_library_version().startswith("Open MPI v5"):
        pytest.skip("Open MPI 5's mpirun SIGKILLs the ranks 1 s after SIGTERM: use SIGUSR1")
    run = tmp_path / "run"
    proc = start_train(4, [*TINY, "--dp", "2", "--pp", "2", "--micro-batch-size", "1",
                       "--steps", "100000", "--run-dir", str(run), *flags])
    wait_for_steps(run, 3, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    last = metrics(run)[-1]["step"]
    assert directory.latest(run / "checkpoints") == run / "checkpoints" / f"step_{last:08d}"
    if flags:
        from mpipar.checkpoint import reader
        saved = directory.list_checkpoints(run / "checkpoints")
        assert len(saved) >= 3 and all(reader.verify(p) == [] for p in saved)
        assert "(written in the background)" in out
    assert f"preempted after step {last} of 100000 on a stop signal" in out
    assert json.loads((run / "summary.json").read_text())["status"] == f"preempted after step {last}"


@needs_mpirun
def test_ctrl_c_checkpoints_prints_one_line_and_exits_130(tmp_path):
    """Ctrl-C (SIGINT to the launcher's whole process group, as a terminal
    sends it) printed a KeyboardInterrupt traceback from every rank and committed nothing. Now
    it is a stop like SIGTERM: the step finishes, a checkpoint is committed, rank 0 prints one
    line, every rank exits 130; --resume auto continues from the checkpoint."""
    from mpipar.checkpoint import directory, reader

    run = tmp_path / "run"
    common = [*TINY, "--dp", "2", "--run-dir", str(run)]
    proc = subprocess.Popen([MPIRUN, "-n", "2", sys.executable, "-m", "mpipar.train", *common,
                             "--steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for_steps(run, 3, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = metrics(run)[-1]["step"]
    assert [r["step"] for r in metrics(run)] == list(range(1, last + 1))
    saved = run / "checkpoints" / f"step_{last:08d}"
    assert directory.latest(run / "checkpoints") == saved and reader.verify(saved) == []
    line = (f"mpipar: interrupted after step {last} of 100000 on a stop signal (SIGINT); "
            f"checkpoint {saved}; continue with --resume auto")
    assert out.count("mpipar: interrupted") == 1 and line in out, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == f"interrupted after step {last}"
    again = run_train(2, [*common, "--steps", str(last + 1), "--resume", "auto"])
    assert again.returncode == 0, again.stderr
    assert [r["step"] for r in metrics(run)] == list(range(1, last + 2))


@needs_mpirun
def test_sigusr1_to_one_rank_stops_all_and_resume_is_exact(tmp_path):
    """SIGUSR1 reaches only the last rank: all ranks stop after the same step (a collective
    decision), and ``--resume auto`` then gives bit for bit the losses, norms and LRs of an
    uninterrupted run."""
    steps = 400
    common = [*TINY, "--pp", "2", "--micro-batch-size", "2", "--dtype", "float64",
              "--steps", str(steps)]
    run = tmp_path / "run"
    proc = start_train(2, [*common, "--run-dir", str(run)])
    wait_for_steps(run, 3, proc)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGUSR1)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    stopped = metrics(run)[-1]["step"]
    assert stopped < steps and f"preempted after step {stopped}" in out
    again = run_train(2, [*common, "--run-dir", str(run), "--resume", "auto"])
    assert again.returncode == 0, again.stderr
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped:08d}'} at step {stopped}" \
        in again.stdout
    reference = run_train(2, [*common, "--run-dir", str(tmp_path / "reference")])
    assert reference.returncode == 0, reference.stderr
    got, want = metrics(run), metrics(tmp_path / "reference")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in got] == [r[key] for r in want], key


# -------------------------------------------------------------------------------- failures
BLOCK_INIT = """
    import pathlib, sys, time
    from mpi4py import MPI
    from mpipar import train
    from mpipar.training import rank
    def blocked(*args, **kwargs):
        pathlib.Path(sys.argv[1], f"ready.{MPI.COMM_WORLD.rank}").touch()
        time.sleep(600)  # initialisation that never ends (a huge model, a slow filesystem)
    rank.build_rank = blocked
    sys.exit(train.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("ranks,sig", [(1, signal.SIGTERM), (2, signal.SIGTERM),
                                       (2, signal.SIGINT)])
def test_a_stop_signal_during_initialisation_exits_promptly(tmp_path, ranks, sig):
    """SIGTERM or SIGINT before the first step: nothing to checkpoint,
    so the job ends at once with status 128 + the signal (143, 130), each signalled rank's
    report in failure.txt, no KeyboardInterrupt traceback."""
    if ranks > 1 and not os.path.exists(MPIRUN):
        pytest.skip("no mpirun beside this Python (install mpipar[mpich])")
    script = tmp_path / "block.py"
    script.write_text(textwrap.dedent(BLOCK_INIT))
    run = tmp_path / "run"
    launch = mpirun(ranks) if ranks > 1 else []
    proc = subprocess.Popen([*launch, sys.executable, str(script), str(tmp_path), *TINY,
                             "--run-dir", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=launch_env())
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready.{r}").exists() for r in range(ranks)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the ranks never reached initialisation"
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 30
    # Each rank exits 128 + its signal (failure.txt says so below). MPICH's mpiexec forwards the
    # signal and passes that status on; Open MPI's mpirun forwards SIGTERM for either signal and
    # then reports its own 1.
    openmpi_launcher = ranks > 1 and open_mpi()
    launcher_status = 1 if openmpi_launcher else 128 + sig
    sig = signal.SIGTERM if openmpi_launcher else sig
    assert proc.returncode == launcher_status, (proc.returncode, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = _failures(run)
    assert lines and all(f["kind"] == "signal" and f["exit"] == 128 + sig for f in lines), lines
    assert all(f["message"] == f"mpipar: rank {f['rank']}: {sig.name} during initialisation; "
                               f"nothing to checkpoint, stopping" for f in lines), lines
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    from mpipar.checkpoint.directory import list_checkpoints
    assert list_checkpoints(run / "checkpoints") == []


@needs_mpirun
def test_sigkill_of_one_rank_ends_the_job_within_30_s(tmp_path):
    run = tmp_path / "run"
    proc = start_train(4, [*TINY, "--dp", "2", "--pp", "2", "--micro-batch-size", "1",
                       "--steps", "100000", "--run-dir", str(run)])
    wait_for_steps(run, 3, proc)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 4, ranks
    t0 = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 30


def _failures(run_dir) -> list[dict]:
    from mpipar.training import failure
    return failure.read(str(run_dir))


STALL = """
    import sys, time
    from mpi4py import MPI
    from mpipar import train
    from mpipar.parallel.data_parallel import reducer as data
    real = data.GradReducer.finish
    calls = [0]
    def finish(self):
        calls[0] += 1
        if calls[0] == 3 and MPI.COMM_WORLD.rank == 1:
            time.sleep(120)  # rank 1 hangs inside step 3; rank 0 waits in the gradient all-reduce
        return real(self)
    data.GradReducer.finish = finish
    sys.exit(train.main(sys.argv[1:]))
"""


@needs_mpirun
def test_collective_watchdog_names_the_operation_and_group(tmp_path):
    """Rank 1 hangs in step 3: rank 0's watchdog reports the blocked all-reduce durably in
    failure.txt and summary.json (the launcher may drop an aborting job's stderr), then aborts."""
    script = tmp_path / "stall.py"
    script.write_text(textwrap.dedent(STALL))
    run = tmp_path / "run"
    proc = run_train(2, [*TINY, "--steps", "10", "--collective-timeout", "3",
                         "--run-dir", str(run)], script=str(script), timeout=240)
    ended = time.time()
    assert proc.returncode == 4, proc.stderr  # failure.EXIT_WATCHDOG, through MPI_Abort and mpirun
    lines = _failures(run)
    assert [(f["rank"], f["exit"], f["kind"]) for f in lines] == [(0, 4, "watchdog")], lines
    assert ended - lines[0]["time"] < 30  # the job ends promptly once the watchdog fires
    assert lines[0]["message"].startswith(
        "mpipar: rank 0: collective watchdog: iallreduce on group 'dp_sp' (size 2) has been "
        "blocked")
    assert "longer than --collective-timeout 3 s" in lines[0]["message"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == 4
    assert summary["failures"] == lines and summary["last_step"] == 2
    assert [r["step"] for r in metrics(run)] == [1, 2]


STALL_OUTSIDE_STEPS = """
    import sys, time
    from mpi4py import MPI
    from mpipar import train
    from mpipar.observe import metrics
    from mpipar.training import state
    module, name = {"checkpoint": (state.TrainState, "pieces"),  # every rank, in every save
                    "shutdown": (metrics, "gather_timeline")}[sys.argv[1]]
    real, calls = getattr(module, name), [0]
    def stalled(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(sys.argv[2]) and MPI.COMM_WORLD.rank == 1:
            time.sleep(120)  # rank 1 stops (kill -STOP) while rank 0 waits in a collective
        return real(*args, **kwargs)
    setattr(module, name, stalled)
    sys.exit(train.main(sys.argv[3:]))
"""


@needs_mpirun
@pytest.mark.parametrize("where,call,steps,saved", [("checkpoint", 2, 5, 1),
                                                     ("shutdown", 1, 2, 2)])
def test_the_watchdog_covers_checkpoints_and_shutdown(tmp_path, where, call, steps, saved):
    """A rank stopped during a checkpoint save hung the job: the save's gather
    and broadcast bypassed the watched ledger. Every collective outside the engine (checkpoint
    commit, telemetry, timeline, shutdown) now goes through the watched control group: the job
    ends with status 4 naming the call, and nothing committed is lost."""
    from mpipar.checkpoint import directory, reader

    script = tmp_path / "stall.py"
    script.write_text(textwrap.dedent(STALL_OUTSIDE_STEPS))
    run = tmp_path / "run"
    proc = run_train(2, [where, str(call), *TINY, "--steps", str(steps), "--save-every", "1",
                         "--collective-timeout", "3", "--run-dir", str(run)],
                     script=str(script), timeout=240)
    ended = time.time()
    assert proc.returncode == 4, proc.stderr
    lines = _failures(run)
    assert ended - lines[0]["time"] < 30  # the job ends promptly once the watchdog fires
    assert [(f["rank"], f["exit"], f["kind"]) for f in lines] == [(0, 4, "watchdog")], lines
    assert lines[0]["message"].startswith(
        "mpipar: rank 0: collective watchdog: gather_object on group 'world' (size 2) has been "
        "blocked"), lines
    ck = run / "checkpoints"
    assert [r["step"] for r in metrics(run)] == list(range(1, saved + 1 + (where != "shutdown")))
    assert directory.latest(ck) == ck / f"step_{saved:08d}" and reader.verify(
        ck / f"step_{saved:08d}") == []


SLOW_FIRST_STEP = """
    import sys, time
    from mpi4py import MPI
    from mpipar import train
    from mpipar.training import step as trainer
    real = trainer.train_step
    def step(rank, k):
        if k == 0 and MPI.COMM_WORLD.rank == 1:
            time.sleep(8)  # as compiling every kernel with an empty Numba cache does
        return real(rank, k)
    trainer.train_step = step
    sys.exit(train.main(sys.argv[1:]))
"""


@needs_mpirun
def test_a_slow_first_step_is_not_a_hang(tmp_path):
    """With an empty Numba cache step 1 compiles every kernel (measured: 11.6
    s in the issue, 90 s on a loaded 2-core machine) while a peer waits in a collective, and
    --collective-timeout 4 aborted a healthy run. Until step 1 has finished the limit is
    --startup-timeout (600 s): rank 1 spends 8 s in step 1 and the run completes; later steps
    keep the short limit (test_collective_watchdog_names_the_operation_and_group)."""
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent(SLOW_FIRST_STEP))
    run = tmp_path / "run"
    proc = run_train(2, [*TINY, "--steps", "3", "--collective-timeout", "3", "--run-dir",
                     str(run)], script=str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _failures(run) == []
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert metrics(run)[0]["time_max"]["dp_comm"] > 3  # rank 0 did wait longer than 3 s


@needs_mpirun
@pytest.mark.parametrize("flags", [["--hidden", "1000000"], ["--vocab-size", "1000000000000"],
                                   ["--layers", "100000000"]], ids=["hidden", "vocab", "layers"])
def test_absurd_sizes_exit_2_naming_needed_and_available_bytes(tmp_path, flags):
    """Absurd sizes allocated until the machine swapped, or died with a
    MemoryError traceback. The planner's memory of a rank is compared with its share of the
    node's available memory before anything is allocated: exit 2 within seconds, printing the
    bytes needed (here the lower bound: twice the weights of one rank) and available."""
    from mpipar.plan.memory import memory_lower_bound
    from mpipar.train import resolve_config

    args = [*TINY, *flags, "--run-dir", str(tmp_path / "run")]
    need = memory_lower_bound(resolve_config(args, 2))
    t0 = time.monotonic()
    proc = run_train(2, args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - t0 < 60  # mpirun, imports and the check: seconds, even when busy
    assert proc.stderr.count(f"mpipar: error: rank 0 needs at least {need:,} bytes") == 1, \
        proc.stderr
    assert "bytes available for 2 rank(s)" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@needs_mpirun
def test_node_shared_parameters_larger_than_dev_shm_exit_2(tmp_path):
    """ZeRO-3 in node shared memory whose parameters /dev/shm could not hold (a window larger
    than the tmpfs fails with SIGBUS when touched) exits 2 before anything is allocated, once,
    naming the bytes and the fix; --allow-oversubscribed-memory (RAM) does not skip it."""
    from mpipar.plan.memory import memory_lower_bound
    from mpipar.train import resolve_config

    args = [*TINY, "--zero", "3", "--zero-shared", "node", "--hidden", "1000000",
            "--allow-oversubscribed-memory", "--run-dir", str(tmp_path / "run")]
    need = memory_lower_bound(resolve_config(args, 2)) // 2 // 2 * 2
    proc = run_train(2, args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(f"mpipar: error: parallel.zero_shared='node': the 2 rank(s) of this "
                             f"node hold at least {need:,} bytes of parameters in shared "
                             f"memory, but /dev/shm has ") == 1, proc.stderr
    assert "--zero-shared off" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


NAN = """
    import sys
    import numpy as np
    from mpipar import train
    from mpipar.parallel.data_parallel import reducer as data
    real = data.GradReducer.finish
    calls = [0]
    def finish(self):
        calls[0] += 1
        if calls[0] == 3:  # step 3: one gradient element is NaN
            self.buckets[0].grads[0] = np.nan
        return real(self)
    data.GradReducer.finish = finish
    sys.exit(train.main(sys.argv[1:]))
"""


def test_on_nan_skip_counts_the_step_and_leaves_the_state_untouched(tmp_path):
    from mpipar.checkpoint import reader

    script = tmp_path / "nan.py"
    script.write_text(textwrap.dedent(NAN))
    run = tmp_path / "run"
    proc = run_train(1, [*TINY, "--steps", "4", "--on-nan", "skip", "--save-every", "1",
                     "--run-dir", str(run)], script=str(script))
    assert proc.returncode == 0, proc.stderr
    rows = metrics(run)
    assert [r["skipped"] for r in rows] == [False, False, True, False]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1]
    assert math.isnan(rows[2]["grad_norm"])
    assert math.isfinite(rows[3]["loss"]) and math.isfinite(rows[3]["grad_norm"])
    assert json.loads((run / "summary.json").read_text())["skipped_steps"] == 1
    # The skipped update changed nothing: the state after step 3 is the state after step 2.
    ck = run / "checkpoints"
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        before = reader.read_tensors(ck / "step_00000002", kind)
        after = reader.read_tensors(ck / "step_00000003", kind)
        assert all(np.array_equal(before[n], after[n]) for n in before), kind


def test_on_nan_stop_saves_and_exits_3_then_resume_continues(tmp_path):
    from mpipar.checkpoint import directory, reader

    script = tmp_path / "nan.py"
    script.write_text(textwrap.dedent(NAN))
    run = tmp_path / "run"
    proc = run_train(1, [*TINY, "--steps", "5", "--on-nan", "stop", "--save-every", "2",
                     "--run-dir", str(run)], script=str(script))
    assert proc.returncode == 3, proc.stderr
    assert "step 3: loss" in proc.stderr and "is not finite (--on-nan stop)" in proc.stderr
    [line] = _failures(run)
    assert (line["rank"], line["exit"], line["kind"]) == (0, 3, "nonfinite")
    assert line["message"].startswith("mpipar: step 3: loss")
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    ck = run / "checkpoints"
    assert directory.latest(ck) == ck / "step_00000003" and reader.verify(ck / "step_00000003") == []
    before, after = (reader.read_tensors(ck / f"step_0000000{k}") for k in (2, 3))
    assert all(np.array_equal(before[n], after[n]) for n in before)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stopped at step 3: non-finite loss or gradient norm"
    assert summary["failures"] == [line]
    again = run_train(1, [*TINY, "--steps", "5", "--on-nan", "stop", "--resume", "auto",
                      "--run-dir", str(run)])
    assert again.returncode == 0, again.stderr
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1]  # carried over the resume
    assert _failures(run) == []  # the report describes the latest run, which finished
    assert "failures" not in json.loads((run / "summary.json").read_text())


# -------------------------------------------------------------------------------- bad data
def _bad_data(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    np.save(tmp_path / "short.npy", np.zeros((4, 10), dtype=np.int64))
    (tmp_path / "garbage.npy").write_bytes(b"not an array" * 8)
    (tmp_path / "garbage.h5").write_bytes(b"not hdf5" * 16)
    return {
        "missing": (tmp_path / "nope.bin", "data path {} does not exist"),
        "empty": (tmp_path / "empty.txt", "the token source is empty"),
        "short": (tmp_path / "short.npy", "rows hold 10 tokens, but --seq-len 32 needs rows of "
                                          "seq_len + 1 = 33 tokens"),
        "unreadable-npy": (tmp_path / "garbage.npy", "cannot read {} as a .npy array"),
        "unreadable-h5": (tmp_path / "garbage.h5", "cannot read {} as HDF5"),
    }


@pytest.mark.parametrize("case", ["missing", "empty", "short", "unreadable-npy", "unreadable-h5"])
def test_bad_data_exits_2_with_a_clear_message(tmp_path, case):
    path, message = _bad_data(tmp_path)[case]
    proc = run_train(1, [*TINY, "--data", str(path), "--run-dir", str(tmp_path / "run")],
                     timeout=60)
    assert proc.returncode == 2
    assert message.format(path) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@needs_mpirun
def test_bad_data_under_mpirun_exits_2_once(tmp_path):
    path, message = _bad_data(tmp_path)["short"]
    proc = run_train(4, [*TINY, "--data", str(path), "--run-dir", str(tmp_path / "run")],
                     timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count(message) == 1
