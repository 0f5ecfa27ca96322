"""Sharded HDF5 checkpoints: what is written, resume bit-exactness, resharding, crashes and
corruption. In-process tests use one rank (COMM_SELF); multi-rank ones launch ``mpirun``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hdf5_damage import invert_chunk_bytes
from layouts import VOCAB, small_config, token_source
from mpipar.checkpoint import directory, reader, tools, writer
from mpipar.checkpoint.index import KINDS
from mpipar.config import ConfigError
from mpipar.model.params import param_specs
from mpipar.rules import validate
from mpipar.runtime.comm import Group, Ledger

from conftest import launch_env, mpirun, needs_mpirun


# ------------------------------------------------------------------ flat pieces -> rectangles
@pytest.mark.parametrize("local_shape,valid_rows,row0,col0", [
    ((7, 5), 7, 0, 0), ((7, 5), 4, 8, 0), ((6, 4), 6, 0, 12), ((11,), 11, 0, 0), ((3, 1), 2, 5, 0)])
def test_piece_blocks_tile_exactly_the_valid_part_of_a_flat_range(local_shape, valid_rows, row0,
                                                                  col0):
    """Every flat range [lo, hi) of a shard with padding rows maps to rectangles that hold exactly
    its valid elements at their global positions (naive reference: element by element)."""
    rng = np.random.default_rng(0)
    size = int(np.prod(local_shape))
    local = np.arange(size, dtype=np.float64).reshape(local_shape) + 1
    valid = (slice(0, valid_rows),) + tuple(slice(0, n) for n in local_shape[1:])
    region = (slice(row0, row0 + valid_rows),) + tuple(slice(col0, col0 + n)
                                                       for n in local_shape[1:])
    cuts = [(0, size), (0, 0), (size - 1, size)] + [tuple(sorted(rng.integers(0, size + 1, 2)))
                                                  for _ in range(40)]
    for lo, hi in cuts:
        want = {}
        for flat in range(lo, hi):
            idx = np.unravel_index(flat, local_shape)
            if idx[0] < valid_rows:
                pos = (idx[0] + row0,) + tuple(i + col0 for i in idx[1:])
                want[pos] = local[idx]
        got = {}
        blocks = writer.piece_blocks(local_shape, valid, region, lo, hi, local.reshape(-1)[lo:hi])
        assert len(blocks) <= 3
        for glob, block in blocks:
            assert block.shape == tuple(s.stop - s.start for s in glob)
            for idx in np.ndindex(block.shape):
                pos = tuple(s.start + i for s, i in zip(glob, idx))
                assert pos not in got
                got[pos] = block[idx]
        assert got == want, (lo, hi)


def test_flat_rectangles_rejects_bad_ranges():
    with pytest.raises(ValueError, match=r"\[3, 2\)"):
        writer.flat_rectangles((2, 2), 3, 2)
    with pytest.raises(ValueError, match="1-D and 2-D"):
        writer.flat_rectangles((2, 2, 2), 0, 8)


# ------------------------------------------------------------------ one rank, in process
def _engine(**train):
    from mpi4py import MPI

    from mpipar.training.engine import Engine
    cfg = small_config()
    for key, value in train.items():
        setattr(cfg.train, key, value)
    cfg = validate(cfg, 1)
    return Engine(cfg, MPI.COMM_SELF, source=token_source()), cfg


def _world(eng) -> Group:
    """An unwatched group over the engine's world, for a checkpoint save."""
    return Group(eng.grid.comm, "world", Ledger())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A save directory with the checkpoints of steps 1 and 2 of a one-rank run, and the engine's
    state at step 2 (params, moments) to compare with."""
    root = tmp_path_factory.mktemp("ckpt") / "save"
    eng, cfg = _engine()
    for k in range(2):
        eng.train_step(k)
        writer.save(eng.state, eng.run_position(k + 1), root, _world(eng))
    state = {"param": {n: p.copy() for n, p in eng.params.items()},
             "exp_avg": {n: m.copy() for n, m in eng.optimizer.m.items()},
             "exp_avg_sq": {n: v.copy() for n, v in eng.optimizer.v.items()}}
    return root, cfg, state


def test_checkpoint_layout_and_contents(saved):
    root, cfg, state = saved
    path = root / "step_00000002"
    assert (root / "latest").read_text() == "step_00000002\n"
    assert sorted(os.listdir(path)) == ["index.h5", "index.sha256", "shard_00000.h5"]
    assert reader.verify(path) == []
    with h5py.File(path / "index.h5", "r") as f:
        assert f.attrs["step"] == 2 and f.attrs["optimizer_step"] == 2
        assert f["lr_schedule"].attrs["next_step"] == 2
        assert f["data"].attrs["samples_consumed"] == 2 * cfg.train.global_batch_size
        assert f["shards/shard_00000.h5"].attrs["sha256"] == directory.sha256_file(
            path / "shard_00000.h5")
        for kind in KINDS:
            assert list(f[kind]) == [s.name for s in param_specs(cfg.model)]  # forward order
            assert all(f[kind][n].is_virtual for n in f[kind])
    with h5py.File(path / "shard_00000.h5", "r") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert len(names) == 3 * len(state["param"])
        assert all(f[n].fletcher32 and f[n].chunks for n in names)
    for kind, want in state.items():
        got = reader.read_tensors(path, kind)
        assert set(got) == set(want)
        for name in want:  # one rank, vocab 13 unpadded: the local shards are the global tensors
            assert got[name].dtype == np.float64 and np.array_equal(got[name], want[name]), name
    assert reader.read_config(path).to_toml() == cfg.to_toml()
    assert reader.read_model_config(path) == cfg.model
    info = tools.inspect(root)  # a save directory means its latest
    assert info["step"] == 2 and info["layout"]["dp"] == 1 and len(info["shards"]) == 1
    assert {"name": "exp_avg_sq/norm.weight", "shape": [32], "dtype": "float64",
            "sources": 1} in info["tensors"]


def test_keep_last_prunes_and_a_save_cleans_leftover_temporaries(tmp_path):
    eng, _ = _engine()
    (tmp_path / ".step_00000007.tmp").mkdir(parents=True)
    (tmp_path / ".step_00000007.tmp" / "shard_00000.h5").write_bytes(b"partial")
    for step in (1, 2, 3):
        writer.save(eng.state, eng.run_position(step), tmp_path, _world(eng), keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002", "step_00000003"]
    assert directory.latest(tmp_path) == tmp_path / "step_00000003"


def test_load_restores_the_state_exactly(saved):
    root, _, state = saved
    eng, _ = _engine()
    assert reader.load(eng.state, root / "step_00000002") == 2
    assert eng.optimizer.step_count == 2
    for name in state["param"]:
        assert np.array_equal(eng.params[name], state["param"][name])
        assert np.array_equal(eng.optimizer.m[name], state["exp_avg"][name])
        assert np.array_equal(eng.optimizer.v[name], state["exp_avg_sq"][name])


def _zero_bytes(path, offset: int, count: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(b"\0" * count)


DAMAGE = {
    "flipped": (lambda p: invert_chunk_bytes(p / "shard_00000.h5", "param/norm.weight/0"),
                ["shard_00000.h5", "sha256", "param/norm.weight/0", "fletcher32"]),
    "truncated": (lambda p: os.truncate(p / "shard_00000.h5", 5000),
                  ["shard_00000.h5", "5000 bytes", "truncated"]),
    "missing": (lambda p: os.remove(p / "shard_00000.h5"), ["shard_00000.h5", "missing shard"]),
    "index": (lambda p: _zero_bytes(p / "index.h5", 100, 16), ["index.h5", "sha256"]),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_named_by_verify_load_and_resume(saved, tmp_path, damage):
    root, _, _ = saved
    shutil.copytree(root, tmp_path / "save")
    root = tmp_path / "save"
    path = root / "step_00000002"
    apply, words = DAMAGE[damage]
    apply(path)
    problems = reader.verify(path)
    assert len(problems) == 1 and all(w in problems[0] for w in words), problems
    eng, _ = _engine()
    with pytest.raises(directory.CheckpointError, match="failed verification") as err:
        reader.load(eng.state, path)
    assert words[0] in str(err.value)
    with pytest.raises(ConfigError, match=words[0]):
        reader.resolve_resume(str(path), "")
    found, notes = reader.resolve_resume("auto", root)
    assert found == root / "step_00000001"
    assert len(notes) == 1 and f"checkpoint {path} failed verification" in notes[0]
    assert notes[0].endswith(f"falling back to {root / 'step_00000001'}")
    if damage == "missing":  # what verification prevents: HDF5 reads a missing source as fill
        with h5py.File(path / "index.h5", "r") as f:
            assert np.isnan(f["param/norm.weight"][()]).all()


def test_resume_auto_with_nothing_usable_starts_fresh(saved, tmp_path):
    assert reader.resolve_resume("auto", tmp_path / "none") == (
        None, [f"no checkpoint in {tmp_path / 'none'}; starting fresh"])
    root, _, _ = saved
    shutil.copytree(root / "step_00000001", tmp_path / "s" / "step_00000001")
    os.remove(tmp_path / "s" / "step_00000001" / "shard_00000.h5")
    found, notes = reader.resolve_resume("auto", tmp_path / "s")
    assert found is None and "starting fresh" in notes[0] and "missing shard" in notes[0]
    assert reader.resolve_resume("", "") == (None, [])


def test_cli_consolidate_export_inspect_verify(saved, tmp_path, capsys):
    from mpipar import ckpt as cli
    from mpipar.checkpoint.huggingface import load_hf

    root, cfg, state = saved
    assert cli.main(["consolidate", str(root), str(tmp_path / "all.h5")]) == 0
    with h5py.File(tmp_path / "all.h5", "r") as f:
        assert f.attrs["step"] == 2
        for kind, want in state.items():
            for name, value in want.items():
                ds = f[f"{kind}/{name}"]
                assert not ds.is_virtual and ds.fletcher32 and np.array_equal(ds[()], value)
    assert cli.main(["export-hf", str(root), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    model, params = load_hf(tmp_path / "hf")
    assert model.hidden == cfg.model.hidden and model.vocab_size == VOCAB
    for name, value in state["param"].items():
        assert params[name].dtype == np.float32
        assert np.array_equal(params[name], value.astype(np.float32))
    capsys.readouterr()
    assert cli.main(["inspect", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["optimizer_step"] == 2
    assert cli.main(["verify", str(root / "step_00000001"), str(root)]) == 0
    assert capsys.readouterr().out.count("sha256 checksums match") == 2
    assert cli.main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err


def test_verify_accepts_the_latest_file_and_the_save_directory(saved, capsys):
    """README's ``ckpt verify runs/exp1/checkpoints/latest`` failed ("no
    such checkpoint directory") because ``latest`` is a file; it means the checkpoint it
    names, as the save directory does."""
    from mpipar import ckpt as cli

    root, _, _ = saved
    assert directory.resolve_path(root / "latest") == root / "step_00000002"
    assert cli.main(["verify", str(root / "latest"), str(root)]) == 0
    out = capsys.readouterr().out
    assert out.count(f"ok {root / 'step_00000002'}: index and 1 shard(s) present") == 2, out


def test_a_latest_pointer_that_is_not_text_is_named_and_resume_auto_falls_back(saved, tmp_path,
                                                                               capsys):
    """A ``latest`` that is not UTF-8 was a UnicodeDecodeError traceback in
    resume and in ``ckpt verify``. Now verify exits 2 naming the file; ``--resume auto``
    notes it and takes the newest checkpoint that verifies."""
    from mpipar import ckpt as cli

    root, _, _ = saved
    shutil.copytree(root, tmp_path / "save")
    root = tmp_path / "save"
    (root / "latest").write_bytes(b"\xff\xfe\x00garbage")
    for spec in (root / "latest", root):
        assert cli.main(["verify", str(spec)]) == 2
        err = capsys.readouterr().err
        assert f"{root / 'latest'}: unreadable" in err and "Traceback" not in err, err
    found, notes = reader.resolve_resume("auto", root)
    assert found == root / "step_00000002" and reader.verify(found) == []
    assert notes == [f"{root / 'latest'}: unreadable ('utf-8' codec can't decode byte 0xff in "
                     f"position 0: invalid start byte); it should hold the name of a checkpoint "
                     f"directory such as step_00000001; taking the newest checkpoint that "
                     f"verifies"]


def test_consolidate_and_export_refuse_to_write_inside_a_checkpoint(saved, tmp_path, capsys):
    """``ckpt consolidate CK CK/index.h5`` overwrote the checkpoint's own
    index and broke it. Writing inside a checkpoint (or over ``latest``) is refused, exit 2,
    and the checkpoint still verifies."""
    from mpipar import ckpt as cli

    root, _, _ = saved
    shutil.copytree(root, tmp_path / "save")
    root = tmp_path / "save"
    ck = root / "step_00000002"
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    for args in (["consolidate", str(ck), str(ck / "index.h5")],
                 ["consolidate", str(root), str(root / "step_00000001" / "all.h5")],
                 ["consolidate", str(ck), str(root / "latest")],
                 ["export-hf", str(ck), str(ck / "hf")]):
        assert cli.main(args) == 2, args
        err = capsys.readouterr().err
        assert f"{args[2]}: " in err and ("inside the checkpoint" in err or "'latest'" in err), err
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before
    assert reader.verify(ck) == [] and reader.verify(root / "step_00000001") == []
    assert directory.latest(root) == ck
    assert cli.main(["consolidate", str(ck), str(root / "all.h5")]) == 0  # beside: allowed


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
    (8, ["--dp", "2", "--tp", "2", "--pp", "2"], 8, ["--tp", "4", "--pp", "2"]),
    (8, ["--pp", "2", "--sp", "2", "--tp", "2"], 8, ["--dp", "8"]),
    (4, ["--dp", "4", "--zero", "1"], 4, ["--dp", "2", "--tp", "2"]),
    (4, ["--pp", "2", "--dp", "2", "--schedule", "interleaved", "--virtual-stages", "2"],
     2, ["--pp", "2", "--schedule", "1f1b"]),
    (4, ["--tp", "4", "--tp-sequence-parallel"], 4, ["--tp", "2", "--pp", "2"]),
    (4, ["--dp", "2", "--tp", "2"], 4, ["--tp", "2", "--sp", "2", "--tp-sequence-parallel"]),
]


@needs_mpirun
@pytest.mark.parametrize("n_a,layout_a,n_b,layout_b", RESHARD,
                         ids=["dp2tp2pp2-tp4pp2", "pp2sp2tp2-dp8", "dp4zero1-dp2tp2",
                              "interleaved-1f1b", "tp4seqpar-tp2pp2", "dp2tp2-tp2sp2seqpar"])
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
def write_shard(path, pieces, state, place):
    # The save of step 2: ranks 0 and 1 write their shards, then rank 2 dies; 3 never writes.
    if path.parent.name != ".step_00000002.tmp":
        return real(path, pieces, state, place)
    from mpi4py import MPI
    record = real(path, pieces, state, place) if place.rank < 2 else None
    MPI.COMM_WORLD.Barrier()
    if place.rank == 2:
        pathlib.Path(sys.argv[1]).touch()  # the test's evidence (stderr may be lost)
        os.kill(os.getpid(), signal.SIGKILL)
    return record if place.rank < 2 else real(path, pieces, state, place)
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
