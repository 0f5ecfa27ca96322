"""DPO on one process equals transformers + torch.optim.AdamW in float64 with DPO's loss
written out by hand (:mod:`dpo_reference`): losses, rewards, accuracy, gradient norms and the
trained weights over two steps to 1e-10 relative."""
from __future__ import annotations

import math

import h5py
import numpy as np
import pytest

# First: importing dpo_reference skips this module where torch or transformers is missing.
from dpo_reference import (BETA, SHORT, dpo_differences, dpo_rank, packed_differences,
                           torch_dpo, write_pairs)
from transformers_reference import TOL, float64_transformers, make_checkpoint  # noqa: F401

from mpipar.training import step as trainer
from mpipar.training.objective import DPO


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    return make_checkpoint("llama", root), write_pairs(root / "pairs.h5")


def test_dpo_trains_like_torch(files, float64_transformers):
    checkpoint, pairs = files
    rank = dpo_rank(checkpoint, pairs)
    results = [trainer.train_step(rank, k) for k in range(2)]
    want = torch_dpo(checkpoint, pairs)
    diffs = dpo_differences(results, trainer.gather_params(rank), want)
    print(f"\nDPO one process: {diffs}")
    assert results[0].loss == pytest.approx(math.log(2), rel=1e-15)   # the policy is the reference
    assert abs(want[0][1]["dpo_reward_chosen"]) > 1e-3   # step 2's policy has moved
    assert max(diffs.values()) <= TOL, diffs


def test_dpo_with_lora_trains_like_peft(files, float64_transformers, tmp_path):
    """DPO of LoRA adapters equals PyTorch + PEFT: the reference is the base with the initial
    adapter, only the adapters train, the base is unchanged."""
    from lora_reference import make_adapter
    from mpipar.checkpoint.huggingface import load_hf
    from mpipar.model.lora import is_adapter
    checkpoint, pairs = files
    adapter = make_adapter(checkpoint, tmp_path)
    rank = dpo_rank(checkpoint, pairs, adapter=adapter)
    results = [trainer.train_step(rank, k) for k in range(2)]
    want = torch_dpo(checkpoint, pairs, adapter)
    trained = trainer.gather_params(rank)
    adapters = {n: v for n, v in trained.items() if is_adapter(n)}
    diffs = dpo_differences(results, adapters, want)
    print(f"\nDPO with LoRA one process: {diffs}")
    assert results[0].loss == pytest.approx(math.log(2), rel=1e-15)
    assert abs(want[0][1]["dpo_reward_chosen"]) > 1e-3
    assert max(diffs.values()) <= TOL, diffs
    for n, v in load_hf(checkpoint)[1].items():          # the frozen base did not move
        np.testing.assert_array_equal(trained[n], v)


def test_packed_pairs_train_like_unpacked(files, tmp_path):
    """--pack-pairs: the same pairs and global batch (four pairs, two microbatches of two)
    packed into half the rows (the second microbatch's two pairs share a row, its other row
    is padding) train as the unpacked run: losses, rewards, accuracy, gradient norms,
    reference log-probabilities and trained weights over two steps."""
    from mpipar.data.preference import pack_pairs, sequence_lengths
    checkpoint, _ = files
    pairs = write_pairs(tmp_path / "short.h5", SHORT)
    packed = dpo_rank(checkpoint, pairs, pack_pairs=True, batch=4, micro=2)
    with h5py.File(pairs, "r") as f:
        rows = np.asarray(f["loss_mask"])[:-1].reshape(-1, packed.cfg.train.seq_len)
    where = pack_pairs(sequence_lengths(rows[4:8]), 2, rows.shape[1])
    assert (where[1] == -1).all() and (where[0] // rows.shape[1] == 3).any()
    diffs = packed_differences(packed, dpo_rank(checkpoint, pairs, batch=4))
    print(f"\nDPO packed against unpacked, one process: {diffs}")
    assert max(diffs.values()) <= TOL, diffs


def test_pair_gradient_is_the_loss_derivative():
    """row_weights is -d(sum of pair losses)/d(log-prob of the row) (central differences)."""
    dpo, rng = DPO(BETA), np.random.default_rng(3)
    logps, ref = rng.normal(size=6), rng.normal(size=6)
    h = 1e-6
    for i in range(6):
        up, down = logps.copy(), logps.copy()
        up[i] += h
        down[i] -= h
        grad = (dpo.losses(up, ref).sum() - dpo.losses(down, ref).sum()) / (2 * h)
        assert -grad == pytest.approx(dpo.row_weights(logps, ref)[i], rel=1e-7)


def _refused(files, tmp_path, message: str, **changes) -> None:
    from mpipar.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
    from mpipar.rules import validate
    checkpoint, pairs = files
    parallel = changes.pop("parallel", {})
    train = {"seq_len": 12, "global_batch_size": 2, "micro_batch_size": 1, "data": str(pairs),
             "objective": "dpo", "backend": "numpy", **changes}
    cfg = Config(ModelConfig(vocab_size=97), ParallelConfig(**parallel), TrainConfig(**train))
    with pytest.raises(ConfigError, match=message):
        validate(cfg, max(1, parallel.get("sp", 1)))


def test_dpo_rules_name_the_value(files, tmp_path):
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.zeros(100, np.int64))
    _refused(files, tmp_path, r"train.dpo_beta=0.0: must be a finite number > 0", dpo_beta=0.0)
    _refused(files, tmp_path, r"not an HDF5 file written by data prepare --preference",
             data=str(tokens))
    _refused(files, tmp_path, r"pairs of 12 tokens, not --seq-len 10", seq_len=10)
    _refused(files, tmp_path, r"train.global_batch_size=6: more pairs than the 5",
             global_batch_size=6)
    _refused(files, tmp_path, r"train.loss_mask=True with --objective dpo", loss_mask=True)
    _refused(files, tmp_path, r"train.pack_pairs=True: .*pairs.jsonl:1: its prompt \+ chosen "
             r"and prompt \+ rejected take 21 tokens together, more than one packed row of "
             r"--seq-len 12", pack_pairs=True)
    _refused(files, tmp_path, r"train.pack_pairs=True: packs the preference pairs of "
             r"--objective dpo, not objective 'tokens'", pack_pairs=True, objective="tokens",
             data="")


def test_resume_equals_the_uninterrupted_run(files, tmp_path):
    """Checkpointed after step 1 (parameters, moments and the reference log-probabilities),
    resumed: step 2 equals the uninterrupted run's bit for bit; without the checkpoint's
    reference (recomputed from step 1's weights) it differs, and a checkpoint without one or of
    another file's pairs is refused."""
    from mpi4py import MPI

    from mpipar.checkpoint import reader, writer
    from mpipar.runtime.comm import Group, Ledger
    checkpoint, pairs = files
    whole = dpo_rank(checkpoint, pairs)
    want = [trainer.train_step(whole, k) for k in range(2)]
    want_params = trainer.gather_params(whole)
    first = dpo_rank(checkpoint, pairs)
    trainer.train_step(first, 0)
    path = writer.save(first.state, trainer.run_position(first, 1), tmp_path,
                       Group(MPI.COMM_SELF, "world", Ledger()))
    stored = reader.read_dpo_reference(path)
    np.testing.assert_array_equal(stored, first.data.preference.reference)

    def resumed(reference) -> tuple:
        rank = dpo_rank(checkpoint, pairs)
        assert reader.load(rank.state, path) == 1
        rank.data.preference.load(reference, 1)
        return trainer.train_step(rank, 1), trainer.gather_params(rank)

    got, params = resumed(stored)
    assert (got.loss, got.grad_norm, got.preference) == \
        (want[1].loss, want[1].grad_norm, want[1].preference)
    for n, v in want_params.items():
        np.testing.assert_array_equal(params[n], v)
    rank = dpo_rank(checkpoint, pairs)          # the reference not restored: step 1's policy
    reader.load(rank.state, path)
    assert trainer.train_step(rank, 1).loss != want[1].loss
    with pytest.raises(ValueError, match="holds no DPO reference log-probabilities at step 1"):
        rank.data.preference.load(None, 1)
    with pytest.raises(ValueError, match="dpo_reference holds 8 rows' log-probabilities; "
                                         "--data's 5 pairs have 10"):
        rank.data.preference.load(stored[:8], 1)


@pytest.mark.parametrize("edit, match", [
    (lambda f: f["dpo_reference"].__setitem__(0, np.nan), "dpo_reference must hold finite"),
    (lambda f: (f.__delitem__("dpo_reference"),
                f.create_dataset("dpo_reference", data=np.zeros(3))),
     "two per pair, at most data.num_samples=10"),
    (lambda f: (f.__delitem__("dpo_reference"),
                f.create_dataset("dpo_reference", data=np.zeros(10, np.float32))),
     "two per pair, at most data.num_samples=10"),
    (lambda f: (f.__delitem__("dpo_reference"),
                f.create_dataset("dpo_reference", data=np.zeros(12))),
     "two per pair, at most data.num_samples=10"),
], ids=["nan", "odd", "float32", "long"])
def test_index_refuses_a_bad_reference(files, tmp_path, edit, match):
    """The index's dpo_reference is checked as the schema says (a crafted index is named)."""
    import shutil

    import h5py
    from mpi4py import MPI

    from mpipar.checkpoint.directory import CheckpointError
    from mpipar.checkpoint.index import read_index
    from mpipar.checkpoint import writer
    from mpipar.runtime.comm import Group, Ledger
    checkpoint, pairs = files
    rank = dpo_rank(checkpoint, pairs)
    trainer.train_step(rank, 0)
    path = writer.save(rank.state, trainer.run_position(rank, 1), tmp_path / "ck",
                       Group(MPI.COMM_SELF, "world", Ledger()))
    assert read_index(path).dpo_reference.shape == (10,)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    with h5py.File(bad / "index.h5", "r+") as f:
        edit(f)
    with pytest.raises(CheckpointError, match=match):
        read_index(bad)


def test_a_shrinks_copy_in_memory_keeps_the_reference(files):
    """The copy a shrink restores from (--on-rank-failure shrink) holds the reference
    log-probabilities: a fresh rank loaded from the copy taken before step 2 trains step 2
    exactly as the original did (recomputed from step 1's weights, it would not)."""
    from mpipar.training.recovery import StateCopy
    checkpoint, pairs = files
    rank = dpo_rank(checkpoint, pairs)
    assert StateCopy(rank).dpo_reference is None           # before step 0 computes it
    trainer.train_step(rank, 0)
    copy = StateCopy(rank)
    np.testing.assert_array_equal(copy.dpo_reference, rank.data.preference.reference)
    want = trainer.train_step(rank, 1)
    fresh = dpo_rank(checkpoint, pairs)
    copy.load(fresh)
    got = trainer.train_step(fresh, 1)
    assert (got.loss, got.grad_norm, got.preference) == \
        (want.loss, want.grad_norm, want.preference)
