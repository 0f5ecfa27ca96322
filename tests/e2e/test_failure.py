"""The durable failure report (mpipar.training.failure) written by four processes at once: whole
lines, in each writer's order."""
from __future__ import annotations

import json
import multiprocessing
import os

from mpi4py import MPI

from mpipar.training import failure


def _write_many(run_dir: str, who: int) -> None:
    report = failure.FailureReport(MPI.COMM_SELF)
    report.rank = who
    report.attach(run_dir, fresh=False)
    for k in range(20):
        report.record("exception", f"process {who} line {k} " + "x" * 5000, 1)


def test_concurrent_writers_never_interleave(tmp_path):
    """Four processes append 20 long lines each at once: 80 whole lines, in each one's order,
    and a summary that parses."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), who)) for who in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    lines = failure.read(str(tmp_path))
    assert len(lines) == 80
    for who in range(4):
        mine = [x["message"].split()[3] for x in lines if x["rank"] == who]
        assert mine == [str(k) for k in range(20)]
    assert len(json.loads((tmp_path / "summary.json").read_text())["failures"]) <= 80
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f]
