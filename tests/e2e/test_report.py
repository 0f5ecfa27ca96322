"""``python -m mpipar.report``, launched: the CLI writes the report and fails cleanly, and the
report of a real (launched) training run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import launch_env
from mpipar import report
from report_records import PLOTS, png_size, record, write_run_dir


def test_cli_writes_the_report_and_fails_cleanly(tmp_path):
    run = write_run_dir(tmp_path, [record(s, 4.0, compute=0.1) for s in (1, 2)])
    proc = subprocess.run([sys.executable, "-m", "mpipar.report", run, "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                           env=launch_env())
    assert proc.returncode == 0, proc.stderr
    assert "bottleneck: compute" in proc.stdout
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        [f"{n}.png" for n in PLOTS if n != "timeline"] + ["summary.txt"])
    missing = subprocess.run([sys.executable, "-m", "mpipar.report", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60, env=launch_env())
    assert missing.returncode == 2 and "no metrics" in missing.stderr


def test_report_of_a_real_run(tmp_path):
    """Train 3 steps of two microbatches on one process, then report on it."""
    run = tmp_path / "real"
    proc = subprocess.run([sys.executable, "-m", "mpipar.train", "--hidden", "32", "--layers", "2",
                           "--heads", "2", "--kv-heads", "1", "--seq-len", "16",
                           "--global-batch-size", "4", "--micro-batch-size", "2", "--steps", "3",
                           "--backend", "numpy", "--log-every", "0", "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=300, env=launch_env())
    assert proc.returncode == 0, proc.stderr
    written, text = report.write_report(str(run))
    assert all(png_size(p)[0] > 0 for p in written if p.endswith(".png"))
    assert len(written) == 6 and "bottleneck:" in text
    timeline = json.loads((run / "timeline.json").read_text())
    assert [op[:2] for op in timeline["ranks"][0]["ops"]] == [["fwd", 0], ["bwd", 0],
                                                              ["fwd", 1], ["bwd", 1]]
