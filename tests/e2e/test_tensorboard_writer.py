"""mpipar's own TensorBoard event writer (mpipar.observe.tensorboard), in a fresh interpreter:
writing events imports no framework nor protobuf."""
from __future__ import annotations

import subprocess
import sys

from conftest import launch_env

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
