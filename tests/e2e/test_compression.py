"""Gradient compression in launched 4-rank runs: a resume is bit-exact (residuals and top-k's
catch-up counts included), the warm-up steps are uncompressed, and top-k's catch-up is one
update under ZeRO-0 and ZeRO-1."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import launch_env, mpirun, needs_mpirun

MODEL = ["--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--seq-len", "16",
         "--global-batch-size", "8", "--micro-batch-size", "1", "--vocab-size", "13",
         "--backend", "numpy", "--log-every", "0", "--init-std", "0.2", "--lr", "1e-2",
         "--min-lr", "1e-3", "--warmup-steps", "1", "--seed", "11", "--steps", "4"]


@pytest.mark.parametrize("layout", [
    ["--dtype", "float32", "--dp", "4", "--ranks-per-node", "2", "--dp-reduce", "hierarchical",
     "--grad-compression", "int8"],
    ["--dtype", "float64", "--dp", "2", "--sp", "2", "--grad-compression", "topk",
     "--topk-ratio", "0.05", "--zero", "1"],
    ["--dtype", "float64", "--dp", "4", "--grad-compression", "int8", "--compression-warmup",
     "3"],
    ["--dtype", "float64", "--dp", "4", "--grad-compression", "topk", "--topk-ratio", "0.05",
     "--compression-warmup", "1"]],
    ids=["hierarchical-int8", "topk-zero1", "int8-warmup-across-the-resume", "topk-catch-up"])
@needs_mpirun
def test_resume_with_compression_is_bit_exact(tmp_path, layout):
    """4 steps saving at 2, against resuming from the step-2 checkpoint in a new job: losses,
    norms, parameters, moments, every residual and (top-k) the catch-up's wait counts agree bit
    for bit (4 ranks)."""
    import json
    import subprocess
    import sys

    from mpipar.checkpoint import reader, tools

    data = tmp_path / "samples.npy"
    np.save(data, np.random.default_rng(3).integers(0, 13, size=(64, 17)))

    def train(run: str, *flags: str) -> None:
        proc = subprocess.run([*mpirun(4), sys.executable, "-m", "mpipar.train", *MODEL,
                               *layout, "--data", str(data), "--run-dir", str(tmp_path / run),
                               "--save-dir", str(tmp_path / run / "ck"), *flags],
                              capture_output=True, text=True, timeout=300, env=launch_env())
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def records(run: str) -> list[dict]:
        with open(tmp_path / run / "metrics.jsonl") as fh:
            return [json.loads(line) for line in fh]

    train("a", "--save-every", "2")
    train("b", "--resume", str(tmp_path / "a" / "ck" / "step_00000002"))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in records("a")][2:] == [r[key] for r in records("b")], key
    held = {t["name"].split("/")[0] for t in tools.inspect(tmp_path / "a" / "ck")["tensors"]}
    assert any(k.startswith("residual_send.") for k in held), held
    assert ("idle_steps" in held) == ("topk" in layout), held   # the catch-up's wait counts
    for kind in held:
        x = reader.read_tensors(tmp_path / "a" / "ck", kind)
        y = reader.read_tensors(tmp_path / "b" / "ck", kind)
        assert all(np.array_equal(x[n], y[n]) for n in x), kind


@needs_mpirun
def test_warmup_steps_are_uncompressed_then_compression_starts(tmp_path):
    """--compression-warmup 2 (int8, flat dp = 4, float64): steps 1-2 equal the uncompressed run
    bit for bit (loss, gradient norm; the wire bytes of the same all-reduce); steps 3-4 put the compressed run's bytes on
    the wire, and step 3's gradient norm is the int8 sum's, no longer the dense one."""
    import json
    import subprocess
    import sys

    data = tmp_path / "samples.npy"
    np.save(data, np.random.default_rng(3).integers(0, 13, size=(64, 17)))

    def train(run: str, *flags: str) -> list[dict]:
        proc = subprocess.run([*mpirun(4), sys.executable, "-m", "mpipar.train", *MODEL,
                               "--dtype", "float64", "--dp", "4", "--data", str(data),
                               "--run-dir", str(tmp_path / run), *flags],
                              capture_output=True, text=True, timeout=300, env=launch_env())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        with open(tmp_path / run / "metrics.jsonl") as fh:
            return [json.loads(line) for line in fh]

    def wire(r: dict) -> int:
        return sum(v["intra"] + v["inter"] for v in r["comm_wire_bytes"].values())

    dense = train("dense")
    warm = train("warm", "--grad-compression", "int8", "--compression-warmup", "2")
    cold = train("cold", "--grad-compression", "int8")
    for k in (0, 1):
        assert (warm[k]["loss"], warm[k]["grad_norm"]) == (dense[k]["loss"], dense[k]["grad_norm"])
        # the same all-reduce, of a bucket padded to whole int8 scale blocks (a few elements)
        assert wire(dense[k]) <= wire(warm[k]) < 1.01 * wire(dense[k])
    assert warm[2]["loss"] == dense[2]["loss"]       # the parameters after two dense updates
    assert warm[2]["grad_norm"] != dense[2]["grad_norm"]
    assert abs(warm[2]["grad_norm"] / dense[2]["grad_norm"] - 1) < 0.05   # int8 of the same sum
    for k in (2, 3):
        assert wire(warm[k]) == wire(cold[k]) < wire(dense[k]) / 3.5


@needs_mpirun
def test_catch_up_is_one_update_under_zero0_and_zero1(tmp_path):
    """Top-k 5 % with error feedback, flat dp = 4, float64, 5 steps: ZeRO-1's owned slices
    catch up exactly as ZeRO-0's whole shards (losses and final parameters <= 1e-12), and
    --topk-catch-up off trains differently from the third step on (the catch-up acts)."""
    import json
    import subprocess
    import sys

    from mpipar.checkpoint import reader

    data = tmp_path / "samples.npy"
    np.save(data, np.random.default_rng(3).integers(0, 13, size=(64, 17)))

    def train(run: str, *flags: str) -> tuple[list[float], dict]:
        proc = subprocess.run([*mpirun(4), sys.executable, "-m", "mpipar.train", *MODEL,
                               "--steps", "5", "--dtype", "float64", "--dp", "4",
                               "--grad-compression", "topk", "--topk-ratio", "0.05",
                               "--compression-warmup", "0", "--data", str(data), "--run-dir", str(tmp_path / run),
                               "--save-dir", str(tmp_path / run / "ck"), *flags],
                              capture_output=True, text=True, timeout=300, env=launch_env())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        with open(tmp_path / run / "metrics.jsonl") as fh:
            losses = [json.loads(line)["loss"] for line in fh]
        return losses, reader.read_tensors(tmp_path / run / "ck", "param")

    zero0, p0 = train("zero0")
    zero1, p1 = train("zero1", "--zero", "1")
    off, _ = train("off", "--topk-catch-up", "off")
    np.testing.assert_allclose(zero1, zero0, rtol=1e-12)
    for name in p0:
        np.testing.assert_allclose(p1[name], p0[name], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(off[:2], zero0[:2], rtol=1e-14)  # step 1: nothing waited yet
    assert all(abs(a / b - 1) > 1e-9 for a, b in zip(off[2:], zero0[2:])), (off, zero0)
