"""TensorBoard event files written without TensorFlow, read back with TensorBoard's own reader
(:mod:`tensorboard_events`): the CRC, every number of every metrics record at its step as the
float32 TensorBoard stores scalars as, the directory setting. A launched run's events:
e2e/test_tensorboard.py."""
from __future__ import annotations

import os

import numpy as np

from mpipar.observe import tensorboard
from mpipar.observe.metrics import MetricsWriter
from tensorboard_events import assert_events_hold, leaves, read_events


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
