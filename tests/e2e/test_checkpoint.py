"""Sharded HDF5 checkpoints of launched runs (``python -m mpipar.train``, under ``mpirun`` for
several ranks): resume bit-exactness, resharding into another layout, the changes a resume
names, a rank killed during a save, flipped bytes that ``--resume auto`` falls back from."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import launch_env, mpirun, needs_mpirun
from hdf5_damage import invert_chunk_bytes
from layouts import VOCAB
from mpipar.checkpoint import directory, reader
from mpipar.checkpoint.index import KINDS


# ------------------------------------------------------------------ the CLI under mpirun
MODEL = ["--hidden", "32", "--layers", "4", "--heads", "4", "--kv-heads", "4", "--seq-len", "16",
         "--global-batch-size", "8", "--micro-batch-size", "1", "--vocab-size", str(VOCAB),
         "--backend", "numpy", "--log-every", "0", "--init-std", "0.2", "--lr", "1e-2",
         "--min-lr", "1e-3", "--warmup-steps", "1", "--clip-grad", "0.5", "--seed", "11"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "samples.npy"
    np.save(path, np.random.default_rng(3).integers(0, VOCAB, size=(64, 17)))
    return str(path)


def train(ranks: int, run_dir, *flags: str, data: str,
          check: bool = True) -> subprocess.CompletedProcess:
    """``python -m mpipar.train`` on ``ranks`` processes (no mpirun for one)."""
    launch = mpirun(ranks) if ranks > 1 else []
    proc = subprocess.run([*launch, sys.executable, "-m", "mpipar.train", *MODEL, "--data", data,
                           "--run-dir", str(run_dir), *flags],
                          capture_output=True, text=True, timeout=180, env=launch_env())
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@needs_mpirun
@pytest.mark.parametrize("dtype,ranks,layout", [
    ("float64", 4, ["--tp", "2", "--pp", "2"]),
    ("float32", 4, ["--dp", "2", "--sp", "2", "--zero", "1"])])
def test_resume_is_bit_exact(tmp_path, data, dtype, ranks, layout):
    """4 steps, saving every 2 (cosine schedule), against: the step-2 checkpoint + a new process
    that resumes and trains steps 3..4. Losses, norms, LRs, parameters and both AdamW moments
    agree bit for bit."""
    common = ["--dtype", dtype, "--steps", "4", *layout]
    train(ranks, tmp_path / "a", *common, "--save-dir", str(tmp_path / "a" / "ck"),
          "--save-every", "2", data=data)
    (tmp_path / "b").mkdir()
    with open(tmp_path / "a" / "metrics.jsonl") as fh:  # the run that was "interrupted" at 2
        (tmp_path / "b" / "metrics.jsonl").write_text("".join(fh.readlines()[:2]))
    proc = train(ranks, tmp_path / "b", *common, "--save-dir", str(tmp_path / "b" / "ck"),
                 "--resume", str(tmp_path / "a" / "ck" / "step_00000002"), data=data)
    assert f"resumed from {tmp_path / 'a' / 'ck' / 'step_00000002'} at step 2" in proc.stdout
    assert "the checkpoint's run used" not in proc.stdout  # nothing changed: nothing to say
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    for kind in KINDS:
        x = reader.read_tensors(tmp_path / "a" / "ck", kind)
        y = reader.read_tensors(tmp_path / "b" / "ck", kind)
        for name in x:
            assert x[name].dtype == np.dtype(dtype) and np.array_equal(x[name], y[name]), name


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data):
    """The one-process float64 run of 2 steps: its metrics and final checkpoint."""
    run = tmp_path_factory.mktemp("reference")
    train(1, run, "--dtype", "float64", "--steps", "2", "--save-dir", str(run / "ck"), data=data)
    return metrics(run), {k: reader.read_tensors(run / "ck", k) for k in KINDS}


RESHARD = [
    (8, ["--pp", "2", "--sp", "2", "--tp", "2"], 8, ["--dp", "8"]),
    (4, ["--pp", "2", "--dp", "2", "--schedule", "interleaved", "--virtual-stages", "2"],
     2, ["--pp", "2", "--schedule", "1f1b"]),
    (4, ["--tp", "4", "--tp-sequence-parallel"], 4, ["--tp", "2", "--pp", "2"]),
]
"""Through the command line: every axis to data parallelism, another world size and schedule,
tp sequence parallelism to the pipeline. The layout-to-layout matrix (ZeRO-1/3, node shared
memory, tied embeddings) is tests/mpi/test_checkpoint.py's, in one job."""


@needs_mpirun
@pytest.mark.parametrize("n_a,layout_a,n_b,layout_b", RESHARD,
                         ids=["pp2sp2tp2-dp8", "interleaved-1f1b", "tp4seqpar-tp2pp2"])
def test_resume_under_another_layout(tmp_path, data, uninterrupted, n_a, layout_a, n_b,
                                     layout_b):
    """Step 1 under layout A, saved; step 2 under layout B from that checkpoint: equal to the
    uninterrupted one-process run to 1e-10 (loss, norm, parameters and moments). With one
    warm-up step the LR of step 1 does not depend on --steps."""
    common = ["--dtype", "float64", "--save-dir", str(tmp_path / "ck")]
    train(n_a, tmp_path / "a", *common, "--steps", "1", *layout_a, data=data)
    train(n_b, tmp_path / "b", *common, "--steps", "2", "--resume", "auto", *layout_b, data=data)
    ref_metrics, ref_state = uninterrupted
    got = metrics(tmp_path / "b")
    assert [r["step"] for r in got] == [2]
    for key in ("loss", "grad_norm", "lr"):
        assert abs(got[0][key] - ref_metrics[1][key]) <= 1e-10 * abs(ref_metrics[1][key]), key
    for kind, want in ref_state.items():
        state = reader.read_tensors(tmp_path / "ck" / "step_00000002", kind)
        for name, value in want.items():
            err = np.abs(state[name] - value).max() / np.abs(value).max()
            assert err <= 1e-10, (kind, name, err)


def test_resume_names_what_changed(tmp_path, data):
    """Resuming with another batch size, seed, data source or schedule said
    nothing. Each change is printed with what it means; the run goes on."""
    save = tmp_path / "ck"
    train(1, tmp_path / "a", "--steps", "1", "--save-dir", str(save), data=data)
    other = tmp_path / "other.npy"
    np.save(other, np.random.default_rng(4).integers(0, VOCAB, size=(32, 17)))
    proc = train(1, tmp_path / "b", "--steps", "2", "--save-dir", str(save), "--resume", "auto",
                 "--global-batch-size", "4", "--seed", "12", "--no-shuffle", data=str(other))
    samples = "later steps read other samples than the checkpoint's run would have"
    lr = "the learning rate of later steps differs from the checkpoint's run"
    changes = [line for line in proc.stdout.splitlines() if "the checkpoint's run used" in line]
    assert changes == [
        f"mpipar: train.data is {str(other)!r}, the checkpoint's run used {data!r}: {samples}",
        f"mpipar: train.global_batch_size is 4, the checkpoint's run used 8: {samples}",
        f"mpipar: train.seed is 12, the checkpoint's run used 11: {samples}",
        f"mpipar: train.shuffle is False, the checkpoint's run used True: {samples}",
        f"mpipar: train.steps is 2, the checkpoint's run used 1: {lr}"], proc.stdout
    assert [r["step"] for r in metrics(tmp_path / "b")] == [2]


KILL_DURING_SAVE = """
import os, pathlib, signal, sys
from mpipar import train
from mpipar.checkpoint import writer
real = writer._write_shard
def write_shard(path, pieces, state, place, *rest):
    # The save of step 2: ranks 0 and 1 write their shards, then rank 2 dies; 3 never writes.
    if path.parent.name != ".step_00000002.tmp":
        return real(path, pieces, state, place, *rest)
    from mpi4py import MPI
    record = real(path, pieces, state, place, *rest) if place.rank < 2 else None
    MPI.COMM_WORLD.Barrier()
    if place.rank == 2:
        pathlib.Path(sys.argv[1]).touch()  # the test's evidence (stderr may be lost)
        os.kill(os.getpid(), signal.SIGKILL)
    return record if place.rank < 2 else real(path, pieces, state, place, *rest)
writer._write_shard = write_shard
sys.exit(train.main(sys.argv[2:]))
"""


@needs_mpirun
def test_kill_during_a_save_keeps_the_previous_checkpoint(tmp_path, data, uninterrupted):
    """A rank SIGKILLs itself after half of the step-2 shards are written (ZeRO-1: all 4 ranks
    write; the fault is injected by a driver script around the real shard writer). The job
    fails, `latest` still names step 1, which verifies and resumes (step 2 then equals the
    uninterrupted run's); the partial directory is ignored and the next save removes it."""
    save = tmp_path / "ck"
    common = ["--dtype", "float64", "--steps", "2", "--dp", "2", "--pp", "2", "--zero", "1",
              "--save-dir", str(save)]
    script = tmp_path / "kill.py"
    script.write_text(KILL_DURING_SAVE)
    killed = tmp_path / "killed"
    launch = [*mpirun(4), sys.executable, str(script), str(killed), *MODEL, "--data", data,
              "--run-dir", str(tmp_path / "a"), *common, "--save-every", "1"]
    proc = subprocess.run(launch, capture_output=True, text=True, timeout=180, env=launch_env())
    assert proc.returncode != 0
    assert killed.exists()
    assert sorted(os.listdir(save)) == [".step_00000002.tmp", "latest", "lock", "step_00000001"]
    assert "index.h5" not in os.listdir(save / ".step_00000002.tmp")
    assert directory.latest(save) == save / "step_00000001" and reader.verify(save / "step_00000001") == []
    proc = train(4, tmp_path / "b", *common, "--resume", "auto", data=data)
    assert f"resumed from {save / 'step_00000001'} at step 1" in proc.stdout
    got, want = metrics(tmp_path / "b")[0]["loss"], uninterrupted[0][1]["loss"]
    assert abs(got - want) <= 1e-10 * want
    assert sorted(os.listdir(save)) == ["latest", "lock", "step_00000001", "step_00000002"]


def test_flipped_bytes_are_named_and_resume_auto_falls_back(tmp_path, data):
    save = tmp_path / "ck"
    common = ["--dtype", "float64", "--steps", "2", "--save-dir", str(save)]
    train(1, tmp_path / "a", *common, "--save-every", "1", data=data)
    shard = save / "step_00000002" / "shard_00000.h5"
    invert_chunk_bytes(shard, "exp_avg/lm_head.weight/0")
    proc = subprocess.run([sys.executable, "-m", "mpipar.ckpt", "verify", str(save)],
                          capture_output=True, text=True, timeout=60, env=launch_env())
    assert proc.returncode == 1
    assert f"{shard}: sha256" in proc.stdout and "exp_avg/lm_head.weight/0" in proc.stdout
    proc = train(1, tmp_path / "b", *common, "--resume", "auto", data=data)
    assert f"checkpoint {save / 'step_00000002'} failed verification" in proc.stdout
    assert f"falling back to {save / 'step_00000001'}" in proc.stdout
    assert f"resumed from {save / 'step_00000001'} at step 1" in proc.stdout
    assert metrics(tmp_path / "b")[0]["loss"] == metrics(tmp_path / "a")[1]["loss"]
    assert reader.verify(save / "step_00000002") == []  # the resumed run saved it again


@needs_mpirun
def test_the_bench_times_verification_alone_and_together(tmp_path, data):
    """``bench checkpoint``'s verification timing, as the section launches it: both ways on
    every rank of a 2-rank job, of the checkpoint ``latest`` names (its bytes counted)."""
    train(2, tmp_path / "run", "--dp", "2", "--zero", "1", "--steps", "1", "--save-dir",
          str(tmp_path / "ck"), data=data)
    out = tmp_path / "verify.json"
    proc = subprocess.run([*mpirun(2), sys.executable, "-m", "mpipar.bench", "checkpoint",
                           "--verify", str(tmp_path / "ck"), "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, env=launch_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(out.read_text())["checkpoint"]
    ck = directory.resolve_path(tmp_path / "ck")
    assert found["ranks"] == 2 and found["path"] == str(ck)
    assert found["bytes"] == sum(f.stat().st_size for f in ck.iterdir())
    assert len(found["alone"]) == len(found["together"]) == 2
    assert all(t > 0 for t in found["alone"] + found["together"])
