"""TensorBoard event files of a launched two-rank run, read back with TensorBoard's own reader
(:mod:`tensorboard_events`): every number of every metrics.jsonl record is there, at its step."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import MPIRUN, needs_mpirun
from tensorboard_events import assert_events_hold, read_events


@needs_mpirun
def test_a_run_writes_every_metric_of_every_step(tmp_path):
    """Two ranks (TP=2, so there are bytes per group); the default directory, since the
    tensorboard package is installed."""
    run = tmp_path / "run"
    proc = subprocess.run([MPIRUN, "-n", "2", sys.executable, "-m", "mpipar.train", "--tp", "2",
                           "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                           "--seq-len", "32", "--global-batch-size", "4", "--steps", "3",
                           "--backend", "numpy", "--log-every", "0", "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    with open(run / "metrics.jsonl") as fh:
        records = [json.loads(line) for line in fh]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert len(os.listdir(run / "tensorboard")) == 1  # rank 0 alone writes
    acc = read_events(run / "tensorboard")
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "time/compute",
                "time_max/tp_comm", "comm_bytes/tp", "comm_bytes_max/tp", "comm_seconds/tp",
                "memory_bytes/rank_1"):
        assert tag in acc.Tags()["scalars"], tag
    assert_events_hold(records, acc)
