"""``python -m mpipar.compare`` on launched training runs: two runs of one seed are bit-identical
(exit 0), another seed's run is not (exit 1)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from launch import TINY


@pytest.mark.slow
def test_two_runs_of_one_seed_pass_and_other_seeds_fail(tmp_path):
    """Real runs: the same configuration twice is bit-identical; another seed is not."""
    def train(name, seed):
        subprocess.run([sys.executable, "-m", "mpipar.train", *TINY, "--steps", "3", "--seed",
                        str(seed), "--run-dir", str(tmp_path / name)], check=True, timeout=600,
                       capture_output=True)
        return str(tmp_path / name)
    a, b, c = train("a", 7), train("b", 7), train("c", 8)
    assert subprocess.run([sys.executable, "-m", "mpipar.compare", a, b]).returncode == 0
    assert subprocess.run([sys.executable, "-m", "mpipar.compare", a, c],
                          capture_output=True).returncode == 1
