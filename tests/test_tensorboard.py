"""TensorBoard event files written without TensorFlow, read back with TensorBoard's own reader:
every number of every metrics.jsonl record is there, at its step, as the float32 TensorBoard
stores scalars as."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import MPIRUN, needs_mpirun
from tensorboard_events import assert_events_hold, leaves, read_events
from mpipar.observe import tensorboard
from mpipar.observe.metrics import MetricsWriter

def test_crc32c_matches_the_standard_and_tensorboards():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    assert tensorboard.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 300):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert tensorboard.masked_crc32c(data) == masked_crc32c(data)


def test_any_flat_dict_and_metrics_records_read_back(tmp_path):
    records = [{"step": 1, "loss": 2.5, "skipped": False, "time": {"compute": 0.25, "io": 0.0},
                "comm_bytes": {"tp": 1 << 40}, "memory_bytes": [123456789, 987654321],
                "note": "text is left out"},
               {"step": 2, "loss": float("nan"), "skipped": True, "time": {"compute": 1e-9},
                "eval_loss": 3.0, "flops": 1e39}]
    writer = MetricsWriter(str(tmp_path / "run"), tensorboard=str(tmp_path / "tb"))
    for r in records:
        writer.write(r)
    writer.close()
    acc = read_events(tmp_path / "tb")
    assert sorted(acc.Tags()["scalars"]) == sorted(set(leaves(records[0])) | set(leaves(records[1])))
    assert np.isnan(acc.Scalars("loss")[1].value) and acc.Scalars("flops")[0].value == np.inf
    assert_events_hold([records[0]], acc)
    assert [(e.step, e.value) for e in acc.Scalars("skipped")] == [(1, 0.0), (2, 1.0)]
    assert acc.Scalars("memory_bytes/rank_1")[0].value == float(np.float32(987654321))
    assert tensorboard.scalars({"eval_loss": 1.5, "step": 9}) == {"eval_loss": 1.5}


def test_the_directory_setting(tmp_path, monkeypatch):
    assert tensorboard.log_dir("off", "run") is None
    assert tensorboard.log_dir("tb/x", "run") == "tb/x"
    monkeypatch.setattr(tensorboard, "installed", lambda: True)
    assert tensorboard.log_dir("", "run") == os.path.join("run", "tensorboard")
    monkeypatch.setattr(tensorboard, "installed", lambda: False)
    assert tensorboard.log_dir("", "run") is None


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
