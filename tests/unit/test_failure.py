"""The durable failure report (mpipar.training.failure) in one process: lines that cannot be lost
or torn. Concurrent writers in separate processes: e2e/test_failure.py."""
from __future__ import annotations

import json

from mpi4py import MPI

from mpipar.training import failure


def test_record_appends_fsynced_lines_and_marks_the_summary_failed(tmp_path):
    run = tmp_path / "run"
    (run).mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # torn tail
    report = failure.FailureReport(MPI.COMM_SELF)
    assert report.record("exception", "ignored: no run dir yet", 1) == []
    report.attach(str(run), fresh=True)
    lines = report.record("watchdog", "mpipar: rank 0: collective watchdog: ...", 4)
    assert [(x["rank"], x["exit"], x["kind"]) for x in lines] == [(0, 4, "watchdog")]
    assert failure.read(str(run)) == lines
    summary = json.loads((run / "summary.json").read_text())
    assert summary == {"status": "failed", "exit_code": 4, "failure": "rank 0: watchdog",
                       "failures": lines, "last_step": 2}


def test_a_fresh_run_removes_a_stale_report_and_a_torn_line_is_skipped(tmp_path):
    (tmp_path / "failure.txt").write_text('{"rank": 3, "exit": 1, "kind": "exception", '
                                          '"message": "old", "time": 0}\n{"rank": 1, "ex')
    assert [x["message"] for x in failure.read(str(tmp_path))] == ["old"]
    failure.FailureReport(MPI.COMM_SELF).attach(str(tmp_path), fresh=True)
    assert failure.read(str(tmp_path)) == []
    assert failure.read(str(tmp_path / "missing")) == []
