"""``--async-save`` in launched runs: a SIGKILL while a background write is in flight (training
already past it) leaves `latest` at the previous checkpoint, verified, and the run resumes to
the same numbers; a synchronous and an asynchronous run of one seed are bit-identical
(``mpipar.compare``) with equal checkpoints. One rank in process: unit/test_async_checkpoint.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import launch_env, mpirun, needs_mpirun
from launch import metrics
from layouts import VOCAB
from mpipar import compare
from mpipar.checkpoint import directory, reader
from mpipar.checkpoint.index import KINDS

MODEL = ["--hidden", "32", "--layers", "4", "--heads", "4", "--kv-heads", "4", "--seq-len", "16",
         "--global-batch-size", "8", "--micro-batch-size", "1", "--vocab-size", str(VOCAB),
         "--backend", "numpy", "--log-every", "0", "--init-std", "0.2", "--lr", "1e-2",
         "--min-lr", "1e-3", "--warmup-steps", "1", "--clip-grad", "0.5", "--seed", "11",
         "--dtype", "float64"]
LAYOUT = {4: ["--dp", "2", "--pp", "2", "--zero", "1"], 2: ["--dp", "2", "--zero", "1"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "samples.npy"
    np.save(path, np.random.default_rng(3).integers(0, VOCAB, size=(64, 17)))
    return str(path)


def launch(program: list[str], run_dir, *flags: str, data: str,
           ranks: int = 4) -> subprocess.CompletedProcess:
    return subprocess.run([*mpirun(ranks), sys.executable, *program, *MODEL, *LAYOUT[ranks],
                           "--data", data,
                           "--run-dir", str(run_dir), *flags],
                          capture_output=True, text=True, timeout=180, env=launch_env())


# The write of step 2's shard on rank 2 waits (on the background thread) until rank 0 has logged
# step 3, i.e. until training has gone on past the save; then rank 2 kills itself.
KILL_DURING_ASYNC_WRITE = """
import json, os, pathlib, signal, sys, time
from mpipar import train
from mpipar.checkpoint import writer
real = writer._write_shard
evidence, run_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def write_shard(path, pieces, state, place, *rest):
    if path.parent.name != ".step_00000002.tmp" or place.rank != 2:
        return real(path, pieces, state, place, *rest)
    log = run_dir / "metrics.jsonl"
    while not (log.exists() and any(json.loads(l)["step"] == 3 for l in log.read_text().splitlines()
                                     if l.endswith("}"))):
        time.sleep(0.05)
    evidence.touch()  # the test's evidence (stderr may be lost)
    os.kill(os.getpid(), signal.SIGKILL)
writer._write_shard = write_shard
sys.exit(train.main(sys.argv[3:]))
"""


@needs_mpirun
def test_sigkill_during_an_async_write_keeps_latest_and_resumes(tmp_path, data):
    """4 ranks (dp 2 x pp 2, ZeRO-1: every rank writes), --async-save every step: rank 2 dies
    while writing step 2's shard, after step 3 has trained and been logged. `latest` names step
    1, which verifies; the partial step 2 has no index; a run resumed in the same run directory
    trains steps 2 and 3 to
    the numbers the killed run logged, bit for bit."""
    save = tmp_path / "ck"
    script = tmp_path / "kill.py"
    script.write_text(KILL_DURING_ASYNC_WRITE)
    killed = tmp_path / "killed"
    common = ["--steps", "3", "--save-dir", str(save)]
    proc = launch([str(script), str(killed), str(tmp_path / "a")], tmp_path / "a", *common,
                  "--save-every", "1", "--async-save", data=data)
    assert proc.returncode != 0 and killed.exists(), proc.stdout + proc.stderr
    assert [r["step"] for r in metrics(tmp_path / "a")] == [1, 2, 3]  # trained past the save
    assert sorted(os.listdir(save)) == [".step_00000002.tmp", "latest", "lock", "step_00000001"]
    assert "index.h5" not in os.listdir(save / ".step_00000002.tmp")
    assert directory.latest(save) == save / "step_00000001"
    verify = subprocess.run([sys.executable, "-m", "mpipar.ckpt", "verify", str(save)],
                            capture_output=True, text=True, timeout=60, env=launch_env())
    assert verify.returncode == 0 and f"ok {save / 'step_00000001'}" in verify.stdout
    a = metrics(tmp_path / "a")
    proc = launch(["-m", "mpipar.train"], tmp_path / "a", *common, "--resume", "auto",
                  "--async-save", data=data)  # in the same run directory
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {save / 'step_00000001'} at step 1" in proc.stdout
    b = metrics(tmp_path / "a")
    assert [r["step"] for r in b] == [1, 2, 3]  # 1 kept from the killed run's log
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]
    assert directory.latest(save) == save / "step_00000003"
    assert reader.verify(save / "step_00000003") == []


@needs_mpirun
def test_sync_and_async_saves_are_bit_identical(tmp_path, data):
    """The same 2-rank run (dp 2, ZeRO-1: both ranks write) with synchronous and with asynchronous saves every step: losses and
    gradient norms bit-identical (mpipar.compare with its default tolerance, zero), every
    checkpoint equal tensor for tensor, and the async run's io time (the blocking part)
    recorded."""
    runs = {}
    for mode in ("sync", "async"):
        flags = ["--async-save"] if mode == "async" else []
        proc = launch(["-m", "mpipar.train"], tmp_path / mode, "--steps", "3", "--save-every",
                      "1", "--save-dir", str(tmp_path / mode / "ck"), *flags, data=data, ranks=2)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[mode] = tmp_path / mode
    assert "written in the background" in proc.stdout
    a, b = compare.load(str(runs["sync"])), compare.load(str(runs["async"]))
    diffs = compare.differences(a, b, ("loss", "grad_norm"))
    assert len(diffs) == 6 and compare.report(diffs, 0.0, 0.0)[1] is None
    for step in (1, 2, 3):
        name = directory.step_dir_name(step)
        x, y = runs["sync"] / "ck" / name, runs["async"] / "ck" / name
        assert reader.verify(y) == []
        for kind in KINDS:
            want, got = reader.read_tensors(x, kind), reader.read_tensors(y, kind)
            assert set(want) == set(got)
            assert all(np.array_equal(want[n], got[n]) for n in want), (step, kind)
    assert all(r["time"]["io"] > 0 for r in metrics(runs["async"])[1:])
