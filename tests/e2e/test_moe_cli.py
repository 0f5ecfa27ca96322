"""``mpirun -n 8 python -m mpipar.train --moe-experts 8 --moe-top-k 2 --ep 8``: the issue's
command line runs with no other flag (here a tiny model and one step besides) and its
metrics carry the balance loss, the loads and the ep group's bytes; a bad --ep exits 2 with one
message."""
from __future__ import annotations

from conftest import needs_mpirun
from launch import TINY, metrics, run_train


@needs_mpirun
def test_moe_with_expert_parallelism_trains_from_the_command_line(tmp_path):
    proc = run_train(8, ["--moe-experts", "8", "--moe-top-k", "2", "--ep", "8", *TINY,
                         "--global-batch-size", "8", "--steps", "2", "--run-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["comm_bytes"]["ep"] > 0 and 0 < r["moe_aux_loss"] < 0.01
        assert sorted(r["moe_load_max_over_mean"]) == ["0", "1"]


@needs_mpirun
def test_ep_not_dividing_the_experts_exits_2(tmp_path):
    proc = run_train(2, ["--moe-experts", "3", "--ep", "2", *TINY, "--steps", "1",
                         "--run-dir", str(tmp_path)])
    assert proc.returncode == 2
    assert proc.stderr.count("parallel.ep=2: must divide model.moe_experts=3") == 1, proc.stderr
