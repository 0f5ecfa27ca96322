"""Validation loss in one process: a held-out split training never draws, fixed validation batches,
the configuration rules, and a forward-only pass equal to a forward-only single-process
reference that touches no training state. Every layout: mpi/test_eval.py; a launched run's
metrics, TensorBoard events, report and resume: e2e/test_eval.py."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from layouts import EVAL_BATCHES, EVAL_FRACTION, eval_config, small_config, token_source
from mpipar.config import ConfigError, TrainConfig
from mpipar.data.sources import DataError, EvalSet, Sampler, validation
from mpipar.kernels import get_backend
from mpipar.layout import resolve_model
from mpipar.model.attention import LocalAttention
from mpipar.model.llama import LlamaStage
from mpipar.parallel.placement import PlacementTable
from mpipar.parallel.tensor.ops import TensorParallel
from mpipar.rules import validate
from mpipar.training import step as trainer
from mpipar.training.rank import build_rank


# ------------------------------------------------------------------------------ the split
def test_held_out_samples_are_never_drawn_and_the_split_is_fixed():
    source = token_source()
    train = TrainConfig(seq_len=16, global_batch_size=8, eval_fraction=EVAL_FRACTION,
                        eval_batches=EVAL_BATCHES)
    keep, evals = validation(source, train, 13)
    assert (keep, evals.indices.tolist()) == (48, list(range(48, 64)))
    assert validation(source, train, 13)[1].indices.tolist() == evals.indices.tolist()
    for shuffle in (True, False):
        sampler = Sampler(source, 8, seed=5, shuffle=shuffle, samples=keep)
        drawn = np.concatenate([sampler.indices(k) for k in range(30)])  # 5 epochs
        assert drawn.max() == 47 and set(drawn.tolist()) == set(range(48))
        epoch = np.concatenate([sampler.indices(k) for k in range(6)])   # exactly one epoch
        assert sorted(epoch.tolist()) == list(range(48))
    rows = source.sample(np.arange(56, 64))
    inputs, targets = evals.batch(1)
    np.testing.assert_array_equal(inputs, rows[:, :-1])
    np.testing.assert_array_equal(targets, rows[:, 1:])


def test_validation_batches_are_evenly_spaced():
    evals = EvalSet(token_source(), 40, 50, batches=2, batch=3)   # 10 samples, 6 taken
    assert evals.indices.tolist() == [40 + (j * 10) // 6 for j in range(6)]
    assert evals.batch(1, slice(1, 3))[0].shape == (2, 16)
    with pytest.raises(DataError, match="holds 10 samples .* fewer than --eval-batches 3 x "
                                        "--global-batch-size 4 = 12"):
        EvalSet(token_source(), 40, 50, batches=3, batch=4)


def test_a_validation_file(tmp_path):
    path = tmp_path / "valid.npy"
    np.save(path, np.random.default_rng(9).integers(0, 13, size=(20, 17)))
    keep, evals = validation(token_source(), TrainConfig(seq_len=16, global_batch_size=8,
                                                         eval_data=str(path), eval_batches=2), 13)
    assert keep == 64 and evals.indices.tolist() == [(j * 20) // 16 for j in range(16)]
    with pytest.raises(DataError, match="leaves none to train on"):
        validation(token_source(), TrainConfig(seq_len=16, eval_fraction=0.999), 13)


@pytest.mark.parametrize("fields,rule", [
    (dict(eval_fraction=1.0), "train.eval_fraction=1.0: must be in \\[0, 1\\)"),
    (dict(eval_fraction=0.1, eval_data="v.h5"), "give --eval-data or --eval-fraction, not both"),
    (dict(eval_every=5), "train.eval_every=5: needs a validation set"),
    (dict(eval_fraction=0.1, eval_batches=0), "train.eval_batches=0: must be >= 1"),
    (dict(eval_fraction=0.1, eval_every=-1), "train.eval_every=-1: must be >= 0"),
])
def test_configuration_rules(fields, rule):
    cfg = small_config()
    for name, value in fields.items():
        setattr(cfg.train, name, value)
    with pytest.raises(ConfigError, match=rule):
        validate(cfg, 1)


# ---------------------------------------------------------------- the pass, one process
def reference_eval(cfg, params: dict) -> float:
    """Mean token loss of the validation batches: one stage holding the whole model, forward
    only, one process."""
    k = get_backend("numpy")
    model = resolve_model(cfg.model)
    stage = LlamaStage(cfg=model, kernels=k, layers=range(model.layers), first=True, last=True,
                       tp=TensorParallel(kernels=k, table=PlacementTable(model=model)),
                       attention=LocalAttention(k))
    _, evals = validation(token_source(), cfg.train, model.vocab_size)
    total = 0.0
    for b in range(evals.batches):
        inputs, targets = evals.batch(b)
        total += float(stage.forward_only(params, inputs, np.arange(inputs.shape[1]),
                                          targets).sum())
    return total / (evals.batches * evals.batch_size * inputs.shape[1])


def test_evaluate_equals_the_reference_and_touches_no_training_state():
    cfg = validate(eval_config(), 1)
    rank = build_rank(cfg, MPI.COMM_SELF, source=token_source())
    trainer.train_step(rank, 0)
    before = ({n: v.copy() for n, v in rank.params.items()},
              {n: v.copy() for n, v in rank.grads.items()},
              [(k, n, v.copy()) for k, n, _, _, v in rank.weights.optimizer.state()])
    first, again = trainer.evaluate(rank), trainer.evaluate(rank)
    want = reference_eval(cfg, trainer.gather_params(rank))
    assert abs(first.loss - want) <= 1e-12 * want and first.loss == again.loss
    assert first.perplexity == pytest.approx(np.exp(want), rel=1e-12)
    assert first.tokens == EVAL_BATCHES * 8 * 16
    for name in before[0]:
        np.testing.assert_array_equal(rank.params[name], before[0][name])
        np.testing.assert_array_equal(rank.grads[name], before[1][name])
    for (kind, name, value), (_, _, _, _, now) in zip(before[2], rank.weights.optimizer.state()):
        np.testing.assert_array_equal(now, value, err_msg=f"{kind}/{name}")
    # The training continues as if no evaluation had run.
    plain = build_rank(cfg, MPI.COMM_SELF, source=token_source())
    trainer.train_step(plain, 0)
    assert trainer.train_step(rank, 1).loss == trainer.train_step(plain, 1).loss
