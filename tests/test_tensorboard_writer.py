"""What keeps mpipar's own TensorBoard event writer (mpipar.observe.tensorboard) over a maintained
one: it imports no framework nor protobuf, and every step's event is in the file when the call
that wrote it returns (a killed run keeps every step it logged)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import launch_env
from mpipar.observe.tensorboard import EventWriter

IMPORTS = """
import sys
from mpipar.observe.tensorboard import EventWriter, scalars
writer = EventWriter(sys.argv[1])
writer.add_scalars(1, scalars({"step": 1, "loss": 2.5, "time": {"compute": 0.1}}))
writer.close()
print(sorted(m for m in ("torch", "tensorflow", "tensorboardX", "google.protobuf", "numpy")
             if m in sys.modules))
"""


def test_writing_events_imports_no_framework(tmp_path):
    proc = subprocess.run([sys.executable, "-c", IMPORTS, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env=launch_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


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
