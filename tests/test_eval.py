"""Validation loss: a held-out split training never draws, fixed validation batches, a forward-only
pass under the training layout equal to a forward-only single-process reference on every layout
(float64 <= 1e-10), and the run's metrics, TensorBoard events, report and resume."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from conftest import MPIRUN, assert_all_ranks, needs_mpirun
from layouts import (EVAL_BATCHES, EVAL_FRACTION, eval_config, layout_name, layout_size,
                     small_config, token_source)
from mpipar.config import ConfigError, TrainConfig
from mpipar.data.sources import DataError, EvalSet, Sampler, validation
from mpipar.training.engine import Engine
from mpipar.kernels import get_backend
from mpipar.model.attention import LocalAttention
from mpipar.model.llama import LlamaStage
from mpipar.parallel.placement import PlacementTable
from mpipar.parallel.tensor import TensorParallel
from mpipar.rules import validate
from mpipar.layout import resolve_model

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
    engine = Engine(cfg, MPI.COMM_SELF, source=token_source())
    engine.train_step(0)
    before = ({n: v.copy() for n, v in engine.params.items()},
              {n: v.copy() for n, v in engine.grads.items()},
              [(k, n, v.copy()) for k, n, _, _, v in engine.optimizer.state()])
    first, again = engine.evaluate(), engine.evaluate()
    want = reference_eval(cfg, engine.gather_params())
    assert abs(first.loss - want) <= 1e-12 * want and first.loss == again.loss
    assert first.perplexity == pytest.approx(np.exp(want), rel=1e-12)
    assert first.tokens == EVAL_BATCHES * 8 * 16
    for name in before[0]:
        np.testing.assert_array_equal(engine.params[name], before[0][name])
        np.testing.assert_array_equal(engine.grads[name], before[1][name])
    for (kind, name, value), (_, _, _, _, now) in zip(before[2], engine.optimizer.state()):
        np.testing.assert_array_equal(now, value, err_msg=f"{kind}/{name}")
    # The training continues as if no evaluation had run.
    plain = Engine(cfg, MPI.COMM_SELF, source=token_source())
    plain.train_step(0)
    assert engine.train_step(1).loss == plain.train_step(1).loss


# ---------------------------------------------------------------- every layout (8 ranks)
LAYOUTS = [dict(dp=2, tp=2, pp=2), dict(sp=4, tp=2, sp_split="zigzag"),
           dict(pp=4, dp=2, schedule="zb-h1"), dict(pp=2, dp=2, sp=2, schedule="interleaved",
                                                    virtual_stages=2),
           dict(sp=2, sp_mode="ulysses", dp=4), dict(tp=2, pp=2, sp=2, sp_overlap=True),
           dict(dp=4, tp=2, tp_sequence_parallel=True, zero=1), dict(pp=4, tp=2, schedule="gpipe"),
           dict(dp=2, pp=2), dict(tp=2)]


@functools.lru_cache(maxsize=None)
def _single_process(recompute: str = "none") -> tuple[float, float, float]:
    """(validation loss after one step, after two, and the second step's training loss) on one
    process, with a validation pass between the steps."""
    cfg = eval_config()
    cfg.train.recompute = recompute
    engine = Engine(validate(cfg, 1), MPI.COMM_SELF, source=token_source())
    engine.train_step(0)
    first = engine.evaluate().loss
    second_loss = engine.train_step(1).loss
    return first, engine.evaluate().loss, second_loss


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_validation_loss_is_the_same_on_every_layout(world, layout):
    size = layout_size(layout)
    comm = world.Split(world.rank // size, world.rank)
    fails: list[str] = []
    try:
        recompute = "offload" if layout.get("pp") == 4 and layout.get("tp") else "none"
        cfg = eval_config(**layout)
        cfg.train.recompute = recompute
        cfg.train.run_dir = f"/tmp/mpipar-test-eval-{os.getpid()}"
        engine = Engine(validate(cfg, size), comm, source=token_source())
        engine.train_step(0)
        got = (engine.evaluate().loss, engine.train_step(1).loss, engine.evaluate().loss)
        engine.close()
        want = _single_process()
        diffs = [abs(a - b) / abs(b) for a, b in zip(got, (want[0], want[2], want[1]))]
        if world.rank == 0:
            print(f"\n{layout_name(layout)}: validation rel diffs {diffs[0]:.1e}, {diffs[2]:.1e}")
        for what, a, b in zip(("eval after 1 step", "step 2 loss", "eval after 2 steps"), got,
                              (want[0], want[2], want[1])):
            if not abs(a - b) <= 1e-10 * abs(b):
                fails.append(f"{what}: {a!r} vs one process {b!r} (rel {abs(a - b) / b:.2e})")
    except Exception as exc:  # a rank's error must reach every rank, never hang them
        fails = [f"{type(exc).__name__}: {exc}"]
    finally:
        comm.Free()
    assert_all_ranks(world, fails)


# -------------------------------------------------------------------- the run (CLI)
TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "2", "--seq-len", "16",
        "--global-batch-size", "4", "--backend", "numpy", "--log-every", "0", "--dtype",
        "float64"]


def _train(*args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    launch = [MPIRUN, "-n", str(ranks)] if ranks > 1 else []
    return subprocess.run([*launch, sys.executable, "-m", "mpipar.train", *TINY, *args],
                          capture_output=True, text=True, timeout=300)


def _records(run) -> list[dict]:
    with open(run / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


@needs_mpirun
def test_a_run_logs_plots_and_resumes_its_validation(tmp_path):
    """--eval-every 2 over 5 steps validates after steps 2, 4 and 5 (the last): metrics.jsonl,
    TensorBoard and the report have it; 4 ranks (tp=2, pp=2) give the single-process numbers; a
    resumed run holds out the same samples and validates to the same numbers, and refuses another
    --eval-fraction."""
    from mpipar import report
    evaluation = ["--eval-fraction", "0.02", "--eval-every", "2", "--eval-batches", "2"]
    one, four = tmp_path / "one", tmp_path / "four"
    proc = _train("--steps", "5", *evaluation, "--run-dir", str(one))
    assert proc.returncode == 0, proc.stderr
    records = _records(one)
    assert [r["step"] for r in records if "eval" in r] == [2, 4, 5]
    for r in records:
        if "eval" in r:
            assert r["eval"]["perplexity"] == pytest.approx(np.exp(r["eval"]["loss"]), rel=1e-12)
            assert r["eval"]["tokens"] == 2 * 4 * 16
    proc = _train("--steps", "5", *evaluation, "--tp", "2", "--pp", "2", "--run-dir", str(four),
                  ranks=4)
    assert proc.returncode == 0, proc.stderr
    for a, b in zip(records, _records(four)):
        if "eval" in a:
            assert abs(a["eval"]["loss"] - b["eval"]["loss"]) <= 1e-10 * a["eval"]["loss"]
            assert b["eval"]["comm_bytes"]["tp"] > 0 and b["eval"]["comm_bytes"]["pp"] > 0

    written, text = report.write_report(str(one))
    assert f"validation loss: {records[-1]['eval']['loss']:.4f}" in text
    assert any(p.endswith("loss.png") for p in written)
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(one / "tensorboard"),
                                             size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [
        (r["step"], float(np.float32(r["eval"]["loss"]))) for r in records if "eval" in r]

    resumed = tmp_path / "resumed"
    assert _train("--steps", "3", *evaluation, "--run-dir", str(resumed)).returncode == 0
    proc = _train("--steps", "5", "--resume", "auto", "--eval-every", "2", "--eval-batches", "2",
                  "--run-dir", str(resumed))
    assert proc.returncode == 0, proc.stderr
    again = _records(resumed)
    assert [(r["step"], r["eval"]["loss"]) for r in again if "eval" in r and r["step"] > 3] == [
        (r["step"], r["eval"]["loss"]) for r in records if "eval" in r and r["step"] > 3]
    proc = _train("--steps", "6", "--resume", "auto", "--eval-fraction", "0.05",
                  "--run-dir", str(resumed))
    assert proc.returncode == 2
    assert "train.eval_fraction=0.05" in proc.stderr and "eval_fraction=0.02" in proc.stderr
