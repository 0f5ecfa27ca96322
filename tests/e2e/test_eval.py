"""Validation in launched runs: the run's metrics, TensorBoard events and report hold the
validation loss, 4 ranks give the single-process numbers, a resumed run validates the same held-out
samples to the same numbers and refuses another split."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import MPIRUN, needs_mpirun


# -------------------------------------------------------------------- the run (CLI)
TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "2", "--seq-len", "16",
        "--global-batch-size", "4", "--backend", "numpy", "--log-every", "0", "--dtype",
        "float64"]


def _train(*args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    launch = [MPIRUN, "-n", str(ranks)] if ranks > 1 else []
    return subprocess.run([*launch, sys.executable, "-m", "mpipar.train", *TINY, *args],
                          capture_output=True, text=True, timeout=300)


def _records(run) -> list[dict]:
    with open(run / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


@needs_mpirun
def test_a_run_logs_plots_and_resumes_its_validation(tmp_path):
    """--eval-every 2 over 5 steps validates after steps 2, 4 and 5 (the last): metrics.jsonl,
    TensorBoard and the report have it; 4 ranks (tp=2, pp=2) give the single-process numbers; a
    resumed run holds out the same samples and validates to the same numbers, and refuses another
    --eval-fraction."""
    from mpipar import report
    evaluation = ["--eval-fraction", "0.02", "--eval-every", "2", "--eval-batches", "2"]
    one, four = tmp_path / "one", tmp_path / "four"
    proc = _train("--steps", "5", *evaluation, "--run-dir", str(one))
    assert proc.returncode == 0, proc.stderr
    records = _records(one)
    assert [r["step"] for r in records if "eval" in r] == [2, 4, 5]
    for r in records:
        if "eval" in r:
            assert r["eval"]["perplexity"] == pytest.approx(np.exp(r["eval"]["loss"]), rel=1e-12)
            assert r["eval"]["tokens"] == 2 * 4 * 16
    proc = _train("--steps", "5", *evaluation, "--tp", "2", "--pp", "2", "--run-dir", str(four),
                  ranks=4)
    assert proc.returncode == 0, proc.stderr
    for a, b in zip(records, _records(four)):
        if "eval" in a:
            assert abs(a["eval"]["loss"] - b["eval"]["loss"]) <= 1e-10 * a["eval"]["loss"]
            assert b["eval"]["comm_bytes"]["tp"] > 0 and b["eval"]["comm_bytes"]["pp"] > 0

    written, text = report.write_report(str(one))
    assert f"validation loss: {records[-1]['eval']['loss']:.4f}" in text
    assert any(p.endswith("loss.png") for p in written)
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(one / "tensorboard"),
                                             size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [
        (r["step"], float(np.float32(r["eval"]["loss"]))) for r in records if "eval" in r]

    resumed = tmp_path / "resumed"
    assert _train("--steps", "3", *evaluation, "--run-dir", str(resumed)).returncode == 0
    proc = _train("--steps", "5", "--resume", "auto", "--eval-every", "2", "--eval-batches", "2",
                  "--run-dir", str(resumed))
    assert proc.returncode == 0, proc.stderr
    again = _records(resumed)
    assert [(r["step"], r["eval"]["loss"]) for r in again if "eval" in r and r["step"] > 3] == [
        (r["step"], r["eval"]["loss"]) for r in records if "eval" in r and r["step"] > 3]
    proc = _train("--steps", "6", "--resume", "auto", "--eval-fraction", "0.05",
                  "--run-dir", str(resumed))
    assert proc.returncode == 2
    assert "train.eval_fraction=0.05" in proc.stderr and "eval_fraction=0.02" in proc.stderr
