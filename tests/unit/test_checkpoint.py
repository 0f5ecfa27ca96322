"""Sharded HDF5 checkpoints on one rank, in process (COMM_SELF): flat pieces cut into rectangles,
what is written, keep-last, exact loads, damage named by verify, load and resume, and the
``python -m mpipar.ckpt`` commands. Launched runs (resume bit-exactness, resharding, a crash
during a save, flipped bytes): e2e/test_checkpoint.py; 8 ranks in one job: mpi/."""
from __future__ import annotations

import json
import os
import shutil

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
from mpipar.training import step as trainer


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
def _rank(**train):
    from mpi4py import MPI


    from mpipar.training.rank import build_rank
    cfg = small_config()
    for key, value in train.items():
        setattr(cfg.train, key, value)
    cfg = validate(cfg, 1)
    return build_rank(cfg, MPI.COMM_SELF, source=token_source()), cfg


def _world(rank) -> Group:
    """An unwatched group over the engine's world, for a checkpoint save."""
    return Group(rank.comms.grid.comm, "world", Ledger())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A save directory with the checkpoints of steps 1 and 2 of a one-rank run, and the engine's
    state at step 2 (params, moments) to compare with."""
    root = tmp_path_factory.mktemp("ckpt") / "save"
    rank, cfg = _rank()
    for k in range(2):
        trainer.train_step(rank, k)
        writer.save(rank.state, trainer.run_position(rank, k + 1), root, _world(rank))
    state = {"param": {n: p.copy() for n, p in rank.params.items()},
             "exp_avg": {n: m.copy() for n, m in rank.weights.optimizer.m.items()},
             "exp_avg_sq": {n: v.copy() for n, v in rank.weights.optimizer.v.items()}}
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
    rank, _ = _rank()
    (tmp_path / ".step_00000007.tmp").mkdir(parents=True)
    (tmp_path / ".step_00000007.tmp" / "shard_00000.h5").write_bytes(b"partial")
    for step in (1, 2, 3):
        writer.save(rank.state, trainer.run_position(rank, step), tmp_path, _world(rank), keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002", "step_00000003"]
    assert directory.latest(tmp_path) == tmp_path / "step_00000003"


def test_load_restores_the_state_exactly(saved):
    root, _, state = saved
    rank, _ = _rank()
    assert reader.load(rank.state, root / "step_00000002") == 2
    assert rank.weights.optimizer.step_count == 2
    for name in state["param"]:
        assert np.array_equal(rank.params[name], state["param"][name])
        assert np.array_equal(rank.weights.optimizer.m[name], state["exp_avg"][name])
        assert np.array_equal(rank.weights.optimizer.v[name], state["exp_avg_sq"][name])


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
    rank, _ = _rank()
    with pytest.raises(directory.CheckpointError, match="failed verification") as err:
        reader.load(rank.state, path)
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
    from mpipar.checkpoint import cli
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
    """docs/checkpoints.md's ``ckpt verify runs/exp1/checkpoints/latest`` failed ("no
    such checkpoint directory") because ``latest`` is a file; it means the checkpoint it
    names, as the save directory does."""
    from mpipar.checkpoint import cli

    root, _, _ = saved
    assert directory.resolve_path(root / "latest") == root / "step_00000002"
    assert cli.main(["verify", str(root / "latest"), str(root)]) == 0
    out = capsys.readouterr().out
    assert out.count(f"ok {root / 'step_00000002'}: index and 1 shard(s) present") == 2, out


def test_verify_takes_a_run_directory_and_refuses_what_is_no_checkpoint(saved, tmp_path,
                                                                      capsys):
    """``ckpt verify RUN_DIR`` verifies the run's latest checkpoint (RUN_DIR/checkpoints); a
    path that does not exist, or a directory that holds no checkpoint, is bad input (exit 2
    naming it), not a checkpoint "never committed" (damage, exit 1)."""
    from mpipar.checkpoint import cli

    root, _, _ = saved
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(root, run / "checkpoints")
    assert cli.main(["verify", str(run)]) == 0
    assert f"ok {run / 'checkpoints' / 'step_00000002'}:" in capsys.readouterr().out
    assert cli.main(["verify", str(tmp_path / "nowhere")]) == 2
    assert f"{tmp_path / 'nowhere'}: no such file or directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["verify", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "not a checkpoint (no index.h5)" in err and "never committed" not in err


def test_a_latest_pointer_that_is_not_text_is_named_and_resume_auto_falls_back(saved, tmp_path,
                                                                               capsys):
    """A ``latest`` that is not UTF-8 was a UnicodeDecodeError traceback in
    resume and in ``ckpt verify``. Now verify exits 2 naming the file; ``--resume auto``
    notes it and takes the newest checkpoint that verifies."""
    from mpipar.checkpoint import cli

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
    from mpipar.checkpoint import cli

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
