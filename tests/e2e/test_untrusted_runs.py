"""A run that must stop before it starts, launched on two ranks: each rank exits 2, one message,
no traceback, and the earlier run's files are as they were."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import launch_env, mpirun, needs_mpirun
from untrusted import TINY, earlier_run, snapshot


@needs_mpirun
def test_every_rank_exits_2_and_one_prints(tmp_path):
    """The same refusal under mpirun on two ranks: each rank exits 2 (reported here by each
    rank's own exit hook), one message, no traceback, nothing written."""
    run = tmp_path / "run"
    earlier_run(run, 5)
    before = snapshot(run)
    script = tmp_path / "each.py"
    script.write_text(
        "import os, sys\n"
        "from mpipar import train\n"
        "try:\n"
        "    code = train.main(sys.argv[1:])\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        f"open(os.path.join({str(tmp_path)!r}, f'status.{{os.getpid()}}'), 'w').write(str(code))\n"
        "sys.exit(code)\n")
    proc = subprocess.run([*mpirun(2), sys.executable, str(script), *TINY, "--tp", "2",
                           "--run-dir", str(run)], capture_output=True, text=True,
                          timeout=240, env=launch_env())
    assert proc.returncode == 2, proc.stderr
    statuses = [(tmp_path / n).read_text() for n in os.listdir(tmp_path) if n.startswith("status.")]
    assert statuses == ["2", "2"]
    assert proc.stderr.count("holds the metrics of an earlier run") == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert snapshot(run) == before
