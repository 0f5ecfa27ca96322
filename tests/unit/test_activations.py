"""Activation dumps and the offload store, in one process: a single-process dump holds what the
model computes (block outputs chain into the next block's input, ``output == (input +
attention_out) + mlp`` exactly, ``attention_out`` is the attention tensor through o_proj, layer
0's input is the embedding of the step's tokens); the reader reassembles hand-cut zigzag x TP
pieces exactly and refuses a missing rank file, a stale file of another run and an uncovered
region; the offload store round-trips nested structures. Every layout: mpi/test_activations.py."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from activation_dumps import dumping_rank, reference_tensors, single_process_dump
from layouts import small_config, token_source
from mpipar.checkpoint.activations import (ActivationRecorder, OffloadStore, load_global, step_dir,
                                write_rank_dump)
from mpipar.model.llama import ACTIVATION_NAMES
from mpipar.model.params import init_params
from mpipar.rules import validate
from mpipar.training import step as trainer


# --------------------------------------------------------------------------- serial


def test_single_process_dump_holds_the_model_tensors():
    run_dir = single_process_dump()
    cfg = validate(small_config("float64"), 1)
    m = cfg.model
    for step in (1, 2):
        assert sorted(os.listdir(step_dir(run_dir, step))) == ["rank_0.h5"]
    with h5py.File(step_dir(run_dir, 1) / "rank_0.h5", "r") as f:
        assert (f.attrs["dp"], f.attrs["tp"], f.attrs["pp"], f.attrs["sp"]) == (0, 0, 0, 0)
        assert f.attrs["world_rank"] == 0 and f.attrs["world_size"] == 1
        assert f.attrs["grid"].tolist() == [1, 1, 1, 1]
        assert f.attrs["positions"].tolist() == list(range(cfg.train.seq_len))
        assert f.attrs["rows"].tolist() == list(range(cfg.train.global_batch_size))
        assert f.attrs["layers"].tolist() == list(range(m.layers))
        d = f["layer_0/attention"]
        assert d.fletcher32 and d.chunks is not None
        assert d.attrs["columns"].tolist() == [0, m.heads * m.head_dim]
        assert d.attrs["heads"].tolist() == [0, m.heads]
        samples = f.attrs["samples"]
    from mpipar.data.sources import Sampler
    sampler = Sampler(token_source(cfg.train.seq_len), cfg.train.global_batch_size,
                      cfg.train.seed, cfg.train.shuffle)
    assert samples.tolist() == sampler.indices(0).tolist()

    params = init_params(m, cfg.train.seed, np.float64)  # the step-1 forward uses these
    tokens = sampler.batch(0)[0]
    t = {(i, n): load_global(run_dir, 1, i, n) for i in range(m.layers) for n in ACTIVATION_NAMES}
    assert t[0, "input"].shape == (8, 16, m.hidden)
    assert t[0, "attention"].shape == (8, 16, m.heads * m.head_dim)
    assert np.array_equal(t[0, "input"], params["embed_tokens.weight"][tokens])
    for i in range(m.layers):
        assert np.array_equal(t[i, "output"], (t[i, "input"] + t[i, "attention_out"]) + t[i, "mlp"])
        wo = params[f"layers.{i}.self_attn.o_proj.weight"]
        assert np.abs(t[i, "attention"] @ wo.T - t[i, "attention_out"]).max() <= 1e-13
        if i + 1 < m.layers:
            assert np.array_equal(t[i, "output"], t[i + 1, "input"])
    # Step 2 runs after one update: different activations from the same tokens' layer-0 path.
    assert not np.array_equal(load_global(run_dir, 2, 1, "mlp"), t[1, "mlp"])


@pytest.mark.parametrize("mode", ["full", "offload"])
def test_dump_records_the_forward_pass_only_under_recompute(mode, tmp_path):
    """Full recompute re-runs blocks in backward; offload round-trips caches: the dump still
    holds each microbatch once, bit-identical to the run without recompute."""
    from mpi4py import MPI
    cfg = small_config("float64")
    cfg.train.recompute = mode
    trainer.train_step(dumping_rank(cfg, MPI.COMM_SELF, str(tmp_path), "1"), 0)
    for (i, name), want in reference_tensors(1).items():
        assert np.array_equal(load_global(tmp_path, 1, i, name), want), (i, name)


def _fake_dump(run_dir, world_split: tuple[int, int], glob: dict[str, np.ndarray]) -> None:
    """Cut global ``[B, S, W]`` tensors into sp (zigzag) x tp pieces as ranks would write them."""
    from mpipar.parallel.sequence_split import SeqLayout
    sp, tp = world_split
    B, S, H = glob["input"].shape
    A = glob["attention"].shape[-1]
    layout = SeqLayout(S, sp, "zigzag")
    for s in range(sp):
        for t in range(tp):
            rank = s * tp + t
            pos = layout.positions(s)
            rec = ActivationRecorder({3: [1, 0]})  # two microbatches, run in reverse order
            for mb in (1, 0):
                rows = slice(mb * B // 2, (mb + 1) * B // 2)
                for name in ACTIVATION_NAMES:
                    cols = slice(t * A // tp, (t + 1) * A // tp) if name == "attention" else \
                        slice(None)
                    rec(3, name, glob[name][rows][:, pos][..., cols])
            attrs = dict(world_rank=rank, world_size=sp * tp, grid=np.array([1, tp, 1, sp]),
                         dp=0, tp=t, pp=0, sp=s, step=5, positions=pos,
                         segments=np.array(layout.segments(s)), rows=np.arange(B),
                         samples=np.arange(B), global_batch=B, seq_len=S, hidden=H, heads=4,
                         head_dim=A // 4, dtype="float64")
            columns = {n: (0, H) for n in ACTIVATION_NAMES}
            columns["attention"] = (t * A // tp, (t + 1) * A // tp)
            write_rank_dump(step_dir(run_dir, 5) / f"rank_{rank}.h5", rec, attrs, columns,
                            (t * 4 // tp, (t + 1) * 4 // tp))


def test_reader_reassembles_zigzag_and_tp_pieces_and_refuses_gaps(tmp_path):
    rng = np.random.default_rng(0)
    glob = {n: rng.standard_normal((4, 12, 8 if n == "attention" else 6))
            for n in ACTIVATION_NAMES}
    _fake_dump(tmp_path, (3, 2), glob)
    for name in ACTIVATION_NAMES:
        assert np.array_equal(load_global(tmp_path, 5, 3, name), glob[name])
    with pytest.raises(ValueError, match="no rank dumped layer 2"):
        load_global(tmp_path, 5, 2, "mlp")
    with pytest.raises(FileNotFoundError, match="step 6"):
        load_global(tmp_path, 6, 3, "mlp")
    with pytest.raises(ValueError, match="name='bogus'"):
        load_global(tmp_path, 5, 3, "bogus")

    d = step_dir(tmp_path, 5)
    (d / "rank_6.h5").write_bytes((d / "rank_0.h5").read_bytes())
    with pytest.raises(ValueError, match="rank_6.h5 do not belong"):
        load_global(tmp_path, 5, 3, "mlp")
    (d / "rank_6.h5").unlink()

    with h5py.File(d / "rank_3.h5", "a") as f:  # claim fewer columns than its shard
        f["layer_3/attention"].attrs["columns"] = np.array([0, 4])
    with h5py.File(d / "rank_1.h5", "a") as f:
        f["layer_3/attention"].attrs["columns"] = np.array([0, 4])
    with pytest.raises(ValueError, match="incomplete"):
        load_global(tmp_path, 5, 3, "attention")

    (d / "rank_4.h5").unlink()
    with pytest.raises(FileNotFoundError, match="lacks rank_4.h5"):
        load_global(tmp_path, 5, 3, "input")


def test_reader_refuses_mixed_runs(tmp_path):
    rng = np.random.default_rng(1)
    glob = {n: rng.standard_normal((2, 4, 4)) for n in ACTIVATION_NAMES}
    _fake_dump(tmp_path, (2, 1), glob)
    with h5py.File(step_dir(tmp_path, 5) / "rank_1.h5", "a") as f:
        f.attrs["seq_len"] = 8
    with pytest.raises(ValueError, match="rank_1.h5: attribute seq_len"):
        load_global(tmp_path, 5, 3, "mlp")


def test_recorder_needs_every_scheduled_forward():
    rec = ActivationRecorder({0: [0, 1]})
    rec(0, "input", np.zeros((1, 2, 3)))
    with pytest.raises(ValueError, match="recorded 1 forward calls, the schedule runs 2"):
        rec.stacked(0, "input")
    with pytest.raises(ValueError, match="layer=4"):
        rec(4, "input", np.zeros((1, 2, 3)))


def test_offload_store_round_trips_nested_structures(tmp_path):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 5, 2))
    tree = {"x": a, "ctx": (a[:, 1], rng.integers(0, 9, (4,)), np.array(2.5), 7, None,
                            np.float32(1.5)),
            "mask": rng.random((2, 3)) > 0.5, "empty": np.zeros((0, 4), np.float32),
            "list": [np.arange(6, dtype=np.int32).reshape(2, 3)]}
    store = OffloadStore(tmp_path / "scratch" / "s.h5")
    k1, k2 = store.put(tree), store.put({"y": a * 2})
    path = store.path
    assert path.exists() and store.in_flight == 2
    got = store.take(k1)
    assert store.in_flight == 1
    assert type(got["ctx"]) is tuple and type(got["list"]) is list
    assert got["ctx"][3:5] == (7, None) and type(got["ctx"][2]) is np.ndarray
    assert type(got["ctx"][5]) is np.float32 and got["ctx"][5] == np.float32(1.5)
    for want, have in ((tree["x"], got["x"]), (tree["ctx"][0], got["ctx"][0]),
                       (tree["ctx"][1], got["ctx"][1]), (tree["ctx"][2], got["ctx"][2]),
                       (tree["mask"], got["mask"]), (tree["empty"], got["empty"]),
                       (tree["list"][0], got["list"][0])):
        assert have.dtype == want.dtype and np.array_equal(have, want)
    with pytest.raises(ValueError, match="offload key 0"):
        store.take(k1)
    assert np.array_equal(store.take(k2)["y"], a * 2)
    store.close()
    assert not path.exists()


