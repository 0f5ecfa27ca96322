"""The planner's traffic prediction of hand-counted layouts (a step, a validation pass). The
ledger against the prediction on 8 ranks: mpi/test_ledger.py."""
from __future__ import annotations

from mpipar.rules import validate


def test_prediction_of_a_hand_counted_layout():
    """tp=2 on one block: 4 all-reduces of [tokens, hidden] per microbatch, plus embedding/head."""
    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from mpipar.plan.traffic import predict_step_bytes
    from mpipar.runtime.topology import Coord

    cfg = validate(Config(ModelConfig(vocab_size=16, hidden=8, layers=1, heads=2, kv_heads=2, ffn_hidden=16),
                 ParallelConfig(tp=2), TrainConfig(seq_len=4, global_batch_size=2,
                                                   micro_batch_size=1, dtype="float64")), 2)
    got = predict_step_bytes(cfg, Coord(dp=0, tp=0, pp=0, sp=0))
    tokens = 4  # one microbatch of 1 x 4 tokens, 2 microbatches
    per_mb = 4 * tokens * 8 * 8 + tokens * 8 * 8 + 3 * tokens * 8 + tokens * 8 * 8
    assert got == {"tp": 2 * per_mb, "tp_pp": 8}


def test_prediction_of_a_hand_counted_validation_pass():
    """The same layout, 3 validation batches forward only: per microbatch the two all-reduces of
    the block's outputs, the embedding's and the cross-entropy statistics; no backward, no norm."""
    from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from mpipar.plan.traffic import predict_eval_bytes
    from mpipar.runtime.topology import Coord

    cfg = validate(Config(ModelConfig(vocab_size=16, hidden=8, layers=1, heads=2, kv_heads=2, ffn_hidden=16),
                 ParallelConfig(tp=2), TrainConfig(seq_len=4, global_batch_size=2,
                                                   micro_batch_size=1, dtype="float64",
                                                   eval_fraction=0.5, eval_batches=3)), 2)
    tokens = 4
    per_mb = 2 * tokens * 8 * 8 + tokens * 8 * 8 + 3 * tokens * 8
    assert predict_eval_bytes(cfg, Coord(dp=0, tp=0, pp=0, sp=0)) == {"tp": 3 * 2 * per_mb}
