"""Gradient compression: the int8 and top-k codecs against direct computations, error feedback's
bookkeeping, and (8 ranks) the compressed reductions of GradReducer against the same math done
on one rank from every rank's gradient, identical on every rank, and unbiased over steps only
with error feedback."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import assert_all_ranks, launch_env, mpirun, needs_mpirun
from mpipar.parallel.compression import BLOCK, Int8Codec, TopKCodec
from mpipar.rules import validate


def _gradient(rng, pieces: int, n: int, dtype) -> np.ndarray:
    """Rows of blocks at very different magnitudes, one block all zero."""
    x = rng.normal(size=(pieces, n)) * np.repeat(10.0 ** rng.uniform(-6, 2, (pieces, n // BLOCK)),
                                                  BLOCK, axis=1)
    x[0, :BLOCK] = 0
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_int8_is_rint_of_per_block_scale(dtype):
    """Each block: int8 values rint(x / s) with s = max|x| / 127 (float32), decoded as q * s, so
    every element is within half a step of the input; 1 + 4/BLOCK bytes an element."""
    rng = np.random.default_rng(0)
    x = _gradient(rng, 3, 4 * BLOCK, dtype)
    codec = Int8Codec(np)
    packed = np.empty((3, codec.packed_bytes(4 * BLOCK)), np.uint8)
    assert packed.shape[1] == 4 * BLOCK * (1 + 4 / BLOCK)
    codec.encode(x, packed)
    blocks = x.astype(np.float64).reshape(3, 4, BLOCK)
    scale = (np.abs(blocks).max(axis=2) / 127).astype(np.float32).astype(np.float64)
    q = np.rint(blocks / np.where(scale > 0, scale, 1)[:, :, None])
    want = (q * scale[:, :, None]).reshape(3, -1)
    got = codec.decode(packed, np.empty_like(x))
    assert np.allclose(got, want, rtol=1e-6 if dtype == "float32" else 1e-15, atol=0)
    step = np.repeat(scale, BLOCK, axis=1).reshape(3, -1)
    assert np.all(np.abs(got - x) <= 0.5 * step * (1 + 1e-5) + 1e-30)
    assert not got[0, :BLOCK].any()
    parts = codec.decode(packed, np.empty_like(x))
    assert np.array_equal(codec.decode_sum(packed, np.empty(4 * BLOCK, x.dtype)),
                          parts[0] + parts[1] + parts[2])


def test_topk_sends_the_largest_magnitudes():
    """k = ceil(ratio * n) values and their indices; the decoded sum of pieces is the dense sum
    of each piece's k largest-magnitude elements."""
    rng = np.random.default_rng(1)
    n, ratio = 1000, 0.013
    codec = TopKCodec(np, ratio)
    k = math.ceil(ratio * n)
    xs = rng.normal(size=(3, n))
    packed = np.empty((3, codec.packed_bytes(n, 8)), np.uint8)
    assert packed.shape[1] == k * 12
    want = np.zeros(n)
    for i, x in enumerate(xs):
        sent = codec.encode(x[None].copy(), packed[i:i + 1])
        top = np.argsort(-np.abs(x))[:k]
        assert sorted(sent.tolist()) == sorted(top.tolist())
        want[top] += x[top]
    assert np.array_equal(codec.decode_sum(packed, np.empty(n)), want)


@pytest.mark.parametrize("codec", [Int8Codec(np), TopKCodec(np, 0.05)], ids=["int8", "topk"])
def test_error_feedback_sends_everything_over_steps(codec):
    """With a residual kept and added back, what was sent over T steps plus the last residual
    is the sum of the T inputs (float64 rounding only)."""
    rng = np.random.default_rng(2)
    n = 2 * BLOCK
    residual = np.zeros(n)
    sent_total, true_total = np.zeros(n), np.zeros(n)
    for _ in range(20):
        g = rng.normal(size=n) * 10.0 ** rng.uniform(-3, 1)
        true_total += g
        packed = np.empty((1, codec.packed_bytes(n, 8)), np.uint8)
        codec.encode_feedback(g.reshape(1, n).copy(), residual, packed)
        sent_total += codec.decode_sum(packed, np.empty(n))
    assert np.allclose(sent_total + residual, true_total, rtol=0, atol=1e-12 * np.abs(
        true_total).max())


# -------------------------------------------------------------------------- 8 ranks, MPI
def _reducer(comm, codec: str, hierarchical: bool, sharded: bool, feedback: bool, n: int,
             ratio: float = 0.01):
    """A GradReducer of one bucket of ``n`` float64 elements over dp = 8 on nodes of 4."""
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.parallel.compression import make_codec
    from mpipar.parallel.data_parallel import GradReducer, ReduceGroups
    from mpipar.runtime.topology import ProcessGrid

    grid = ProcessGrid(comm, 8, 1, 1, 1, ranks_per_node=4)
    if hierarchical:
        grid.split_dp_sp_by_node()
    ledger = Ledger()
    g = {name: Group(c, name, ledger, grid.group_nodes(name)) for name, c in grid.comms.items()}
    groups = (ReduceGroups(g["dp_sp"], g["dp_sp_inter"], g["dp_sp_intra"]) if hierarchical
              else ReduceGroups(g["dp_sp"], g["dp_sp"]))
    return GradReducer({"w": np.zeros(n)}, ["w"], groups, bucket_mb=1e3, sharded=sharded, xp=np,
                       codec=make_codec(codec, ratio, np), feedback=feedback)


def _reduce(red, grad: np.ndarray) -> np.ndarray:
    red.start_step()
    red.grads["w"][...] = grad
    red.ready(["w"])
    red.finish()
    b = red.buckets[0]
    return (b.owned_grad if red.sharded else red.grads["w"]).copy()


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("codec,sharded", [("int8", False), ("int8", True), ("topk", False),
                                           ("topk", True)])
def test_flat_compressed_reduction_is_the_codecs_math(world, codec, sharded):
    """Flat over dp = 8: every rank ends with the same sum (ZeRO-1: its owned slice of it), equal
    bit for bit to the codec's math applied on one rank to every rank's gradient: int8 encodes
    each rank's pieces, each owner sums its decoded pieces in rank order, re-encodes and every
    rank decodes; top-k adds every rank's k largest. Two steps, so the residuals take part."""
    n = 8 * 4 * BLOCK
    fails = []
    red = _reducer(world, codec, False, sharded, True, n)
    rng = np.random.default_rng(10 + world.rank)
    ref = Int8Codec(np) if codec == "int8" else TopKCodec(np, 0.01)
    residual = np.zeros(n)
    gathered_residual = np.zeros(n)          # the owners' second residuals, whole
    for _ in range(2):
        grad = rng.normal(size=n)
        got = _reduce(red, grad)
        grads = np.array(world.allgather(grad))
        residuals = np.array(world.allgather(residual))
        if codec == "int8":
            per = [np.empty((8, ref.packed_bytes(n // 8)), np.uint8) for _ in range(8)]
            new_res = []
            for r in range(8):
                x, e = grads[r].reshape(8, -1).copy(), residuals[r].copy()
                ref.encode_feedback(x, e, per[r])
                new_res.append(e)
            total = np.empty(n)
            for owner in range(8):
                pieces = np.stack([per[r][owner] for r in range(8)])
                s = ref.decode_sum(pieces, np.empty(n // 8))
                if sharded:
                    total[owner * n // 8:(owner + 1) * n // 8] = s
                    continue
                packed = np.empty((1, ref.packed_bytes(n // 8)), np.uint8)
                ref.encode_feedback(s.reshape(1, -1),
                                    gathered_residual[owner * n // 8:(owner + 1) * n // 8], packed)
                total[owner * n // 8:(owner + 1) * n // 8] = ref.decode(packed,
                                                                        np.empty((1, n // 8)))
        else:
            packed = np.empty((8, ref.packed_bytes(n, 8)), np.uint8)
            new_res = []
            for r in range(8):
                e = residuals[r].copy()
                ref.encode_feedback(grads[r].reshape(1, -1).copy(), e, packed[r:r + 1])
                new_res.append(e)
            total = ref.decode_sum(packed, np.empty(n))
        residual = new_res[world.rank]
        want = total[world.rank * n // 8:(world.rank + 1) * n // 8] if sharded else total
        if not np.array_equal(got, want):
            fails.append(f"differs from the codec's math by {np.abs(got - want).max():.3g}")
        if not sharded and not all(np.array_equal(got, x) for x in world.allgather(got)):
            fails.append("ranks hold different sums")
    assert_all_ranks(world, fails)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("codec,hierarchical", [("int8", True), ("topk", True),
                                                ("topk", False)])
def test_error_feedback_makes_the_compressed_sum_unbiased(world, codec, hierarchical):
    """The same gradients every step: with error feedback the mean of T = 40 compressed sums
    approaches the exact sum (what is not sent now is sent later); without it the error stays.
    Every rank holds the same sum (hierarchical: on 2 nodes of 4)."""
    n, steps = 8 * 2 * BLOCK, 40
    rng = np.random.default_rng(20 + world.rank)
    grad = rng.normal(size=n) * np.repeat(10.0 ** rng.uniform(-2, 0, n // BLOCK), BLOCK)
    exact = np.sum(world.allgather(grad), axis=0)
    errors, fails = {}, []
    for feedback in (True, False):
        red = _reducer(world, codec, hierarchical, False, feedback, n, ratio=0.1)
        mean = np.zeros(n)
        for _ in range(steps):
            got = _reduce(red, grad)
            mean += got / steps
        if not all(np.array_equal(got, x) for x in world.allgather(got)):
            fails.append(f"feedback={feedback}: ranks hold different sums")
        errors[feedback] = np.abs(mean - exact).max() / np.abs(exact).max()
    if not errors[True] < 0.2 * errors[False]:
        fails.append(f"error with feedback {errors[True]:.3g}, without {errors[False]:.3g}")
    assert_all_ranks(world, fails)


# ---------------------------------------------------------------------- residuals in checkpoints
@pytest.mark.mpi(min_size=8)
def test_residuals_load_slot_by_slot_or_summed(world):
    """One int8 step at dp=8 (8 slots, each rank's residual, plus the owners' second ones) is
    saved; loaded into the same layout the residuals are bit-identical; into dp=4 tp=2
    hierarchical on nodes of 4 (2 slots) their sum, the gradient still owed, lands whole in
    slot 0, per element."""
    import shutil
    import tempfile
    from pathlib import Path

    from layouts import global_state, small_config, token_source
    from mpipar.checkpoint import reader, writer
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.training.engine import Engine

    root = Path(world.bcast(tempfile.mkdtemp(prefix="mpipar-ef-") if world.rank == 0 else None))
    fails = []
    try:
        a = Engine(validate(small_config(dp=8, grad_compression="int8"), 8), world,
                   source=token_source())
        a.train_step(0)
        path = writer.save(a.state, a.run_position(1), root, Group(world, "world", Ledger()))
        saved = global_state(a, world)
        kinds = sorted({k for k, _ in saved if k.startswith("residual")})
        if set(kinds) != {f"residual_send.{s}" for s in range(8)} | {"residual_gather"}:
            fails.append(f"residual kinds {kinds}")
        same = Engine(validate(small_config(dp=8, grad_compression="int8"), 8), world,
                      source=token_source())
        reader.load(same.state, path)
        again = global_state(same, world)
        fails += [f"{key} differs" for key in saved if not np.array_equal(saved[key], again[key])]
        other = Engine(validate(small_config(dp=4, tp=2, ranks_per_node=4, dp_reduce="hierarchical",
                                    grad_compression="int8"), 8), world,
                       source=token_source())
        reader.load(other.state, path)
        moved = global_state(other, world)
        for name in a.state.shapes:
            owed = sum(saved[(k, name)] for k in kinds)
            if not np.allclose(moved[("residual_send.0", name)], owed, rtol=0, atol=1e-12):
                fails.append(f"{name}: slot 0 does not hold the sum")
            if np.any(moved[("residual_send.1", name)]):
                fails.append(f"{name}: slot 1 is not zero")
    except Exception as exc:
        fails.append(f"{type(exc).__name__}: {exc}")
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    assert_all_ranks(world, fails)


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
                               "--data", str(data), "--run-dir", str(tmp_path / run),
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
