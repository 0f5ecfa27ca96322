"""One rank built from its layout and a communicator (:func:`mpipar.training.rank.build_rank`):
frozen, built again from the same arguments to the same numbers (nothing hidden outside its
arguments), and a step that reads its global batch once (:mod:`mpipar.training.batches`)."""
from __future__ import annotations

import dataclasses

import pytest
from mpi4py import MPI

from layouts import small_config, token_source
from mpipar.rules import validate
from mpipar.training import step as trainer
from mpipar.training.rank import build_rank


def _packed():
    """The test model with packed documents, their EOS loss mask and 2 dp-free microbatches."""
    cfg = small_config("float64")
    cfg.train.document_masking, cfg.train.eod_mask_loss, cfg.train.eos_token_id = True, True, 3
    return validate(cfg, 1)


def test_a_rank_is_frozen_and_built_again_to_the_same_step():
    layout = _packed()
    first = build_rank(layout, MPI.COMM_SELF, source=token_source(16))
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.weights = None
    want = trainer.train_step(first, 0)
    trainer.close(first)
    again = build_rank(layout, MPI.COMM_SELF, source=token_source(16))
    got = trainer.train_step(again, 0)
    trainer.close(again)
    assert (got.loss, got.grad_norm, got.flops) == (want.loss, want.grad_norm, want.flops)


def test_a_step_reads_its_global_batch_once():
    """Documents, the EOS loss mask, the loss divisor, the attention imbalance and the model
    FLOPs all come from one read of the step's samples."""
    layout = _packed()
    rank = build_rank(layout, MPI.COMM_SELF, source=token_source(16))
    source, reads = rank.data.source, []
    read = source.sample

    def counted(idx):
        reads.append(len(idx))
        return read(idx)

    source.sample = counted
    try:
        result = trainer.train_step(rank, 0)
    finally:
        del source.sample
        trainer.close(rank)
    assert reads == [layout.train.global_batch_size]
    assert result.flops is not None
