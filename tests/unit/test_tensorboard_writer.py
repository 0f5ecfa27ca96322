"""What keeps mpipar's own TensorBoard event writer (mpipar.observe.tensorboard) over a maintained
one, in process: every step's event is in the file when the call that wrote it returns (a killed
run keeps every step it logged). That it imports no framework nor protobuf:
e2e/test_tensorboard_writer.py."""
from __future__ import annotations

import pytest

from mpipar.observe.tensorboard import EventWriter


def test_each_step_is_in_the_file_when_add_scalars_returns(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="reading event files back needs the tensorboard package")
    writer = EventWriter(str(tmp_path))
    for step in range(1, 6):
        writer.add_scalars(step, {"loss": float(step)})
        acc = event_accumulator.EventAccumulator(str(tmp_path))
        acc.Reload()
        assert [e.step for e in acc.Scalars("loss")] == list(range(1, step + 1))
    writer.close()
