"""Configuration errors of the launched CLI: exit 2 on every rank, the message (and --help)
printed once."""
from __future__ import annotations

import subprocess
import sys

from conftest import launch_env, mpirun, needs_mpirun


@needs_mpirun
def test_cli_bad_layout_every_rank_exits_2(tmp_path):
    """Under mpirun, a layout that does not fit fails on every rank, once, with status 2."""
    proc = subprocess.run([*mpirun(3), sys.executable, "-m", "mpipar.train", "--tp", "2",
                           "--run-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=launch_env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("tp*pp*sp = 2*1*1 = 2 must divide the world size 3") == 1
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cli_argparse_choice_exit_2():
    proc = subprocess.run([sys.executable, "-m", "mpipar.train", "--dtype", "float16"],
                          capture_output=True, text=True, timeout=60, env=launch_env())
    assert proc.returncode == 2 and "invalid choice: 'float16'" in proc.stderr


@needs_mpirun
def test_argparse_errors_and_help_print_once_under_mpirun():
    """An argparse error (and --help) is printed by rank 0 only; every rank
    exits with argparse's status."""
    bad = subprocess.run([*mpirun(4), sys.executable, "-m", "mpipar.train", "--dtype",
                          "float16"], capture_output=True, text=True, timeout=120, env=launch_env())
    assert bad.returncode == 2
    assert bad.stderr.count("invalid choice: 'float16'") == 1, bad.stderr
    # one line, not the whole usage first: where the flags are listed instead
    assert bad.stderr.count("(python -m mpipar.train --help lists every flag)") == 1, bad.stderr
    assert "usage:" not in bad.stderr and len(bad.stderr.splitlines()) == 1, bad.stderr
    helped = subprocess.run([*mpirun(4), sys.executable, "-m", "mpipar.train", "--help"],
                            capture_output=True, text=True, timeout=120, env=launch_env())
    assert helped.returncode == 0 and helped.stdout.count("usage: python -m mpipar.train") == 1
    flat = " ".join(helped.stdout.split())
    assert "pipeline schedule (one of gpipe, 1f1b, interleaved, zb-h1; default: 1f1b)" in flat
    assert "(one of ring, ulysses, hybrid, halo; default: ring)" in flat
