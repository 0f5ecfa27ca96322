"""`python -m mpipar.bench train` on a tiny model, one rank: mpipar's step served by a child
process, the PyTorch eager peer when torch is importable (the dp = 2 row, `mpirun -n 2` against
DDP, writes the same record fields). The numbers are
checked against their definitions (tokens / median step, model FLOPs / step / probe), not timed."""

from __future__ import annotations

import json
import statistics

import pytest

from mpipar.bench.__main__ import build_parser, main
from mpipar.bench.train import torch_missing
from mpipar.bench.train_peer import train_config
from mpipar.model.flops import model_flops_per_step

pytest.importorskip("numba")

MODEL = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "64",
         "--vocab", "256", "--seq", "32", "--batch", "4"]


@pytest.mark.timeout(600)
def test_bench_train_rows(tmp_path, capsys):
    path = tmp_path / "train.json"
    assert main(["train", *MODEL, "--threads", "1", "--steps", "2", "--warmup", "1", "--no-dp2",
                 "--dtypes", "float32", "--gemm-size", "64", "--json", str(path)]) == 0
    result = json.loads(path.read_text())["train"]
    torch_here = torch_missing() is None
    assert [r["ranks"] for r in result["rows"]] == [1]
    args = build_parser()[1]["train"].parse_args(MODEL)
    flops = model_flops_per_step(train_config(args, 1, str(tmp_path)))
    for row in result["rows"]:
        assert row["flops_per_step"] == pytest.approx(flops)  # the same model FLOPs for dp = 1 and 2
        peers = ["mpipar"] + (["torch"] if torch_here else [])
        assert [p for p in ("mpipar", "torch") if p in row] == peers
        for peer in peers:
            r = row[peer]
            assert len(r["step_s"]) == 2 and r["median_step_s"] == pytest.approx(statistics.median(r["step_s"]))
            assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["median_step_s"])
            assert len(r["cpu_step_s"]) == 2 and all(c > 0 for c in r["cpu_step_s"])
            assert r["tokens_per_cpu_s"] == pytest.approx(4 * 32 / statistics.median(r["cpu_step_s"]))
            assert r["mfu"] == pytest.approx(flops / r["median_step_s"] / row["peak_flops"])
            assert r["info"]["ranks"] == row["ranks"]
        parts = row["breakdown"]
        assert {"linear_fwd", "attention_fwd", "attention_bwd", "other"} <= set(parts)
        assert sum(v for k, v in parts.items() if k != "step") == pytest.approx(parts["step"])
    out = capsys.readouterr().out
    assert "mpipar per-op time" in out
    assert ("PyTorch peer skipped" in out) != torch_here
