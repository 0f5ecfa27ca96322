"""DeepSeek-V3's auxiliary-loss-free balancing (``--moe-bias-update-rate``) on one process: the
bias update by hand, the biased top-K choice with the unbiased renormalised weights against a
NumPy reference written here (float64), the sparse FFN with a bias against a token loop and its
gradient against finite differences, the rules, the HF export's note, and a run resumed from
its checkpoint equal bit for bit to the uninterrupted one (the bias restored)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mpipar.config import ConfigError
from mpipar.kernels import get_backend
from mpipar.kernels import expert_routing
from mpipar.model.moe import LocalExperts, RoutingBias, moe_forward
from mpipar.model.params import ROUTER, expert_names, init_params
from tests.unit.test_model import make_stage
from tests.unit.test_moe import MOE
from mpipar.training import step as trainer


def test_update_moves_each_bias_by_exactly_rate_against_its_load():
    """Load above the mean: -rate; below: +rate; equal to it: 0 (the sign), per block, from the
    loads handed in; repeated steps add up."""
    rb = RoutingBias(sparse=[1, 3], num_experts=4, rate=0.25, xp=np)
    rb.update({1: np.array([5.0, 1.0, 3.0, 3.0]), 3: np.array([2.0, 2.0, 2.0, 2.0])})
    assert rb.biases[1].tolist() == [-0.25, 0.25, 0.0, 0.0]
    assert rb.biases[3].tolist() == [0.0, 0.0, 0.0, 0.0]
    rb.update({1: np.array([0.0, 7.0, 1.0, 4.0]), 3: np.array([1.0, 2.0, 3.0, 2.0])})
    assert rb.biases[1].tolist() == [0.0, 0.0, 0.25, -0.25]     # mean 3
    assert rb.biases[3].tolist() == [0.25, 0.0, -0.25, 0.0]
    assert rb.max_abs() == {"1": 0.25, "3": 0.25}
    assert RoutingBias(sparse=[1], num_experts=4, rate=0.0, xp=np).biases == {}


def reference_route(probs: np.ndarray, bias: np.ndarray, k: int):
    """NumPy reference: per token, the k largest p + b (ties: the lower index) and the chosen
    experts' *unbiased* probabilities divided by their sum."""
    experts, weights = [], []
    for p in probs:
        score = p + bias
        top = sorted(range(len(p)), key=lambda e: (-score[e], e))[:k]
        experts.append(top)
        weights.append([p[e] / sum(p[j] for j in top) for e in top])
    return np.array(experts), np.array(weights)


def test_bias_changes_the_choice_not_the_weights():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 6))
    probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    bias = np.array([0.3, -0.2, 0.0, 0.15, -0.05, 0.1])
    experts, weights = expert_routing.route_topk(probs, 2, np, bias)
    ref_e, ref_w = reference_route(probs, bias, 2)
    np.testing.assert_array_equal(experts, ref_e)
    np.testing.assert_allclose(weights, ref_w, rtol=1e-15, atol=0)
    plain, _ = expert_routing.route_topk(probs, 2, np)
    changed = (np.sort(plain, axis=1) != np.sort(experts, axis=1)).any(axis=1)
    assert changed.sum() > 10          # the bias does move the choice ...
    chosen = np.take_along_axis(probs, experts, axis=1)
    np.testing.assert_allclose(weights, chosen / chosen.sum(1, keepdims=True), rtol=1e-15)
    with_bias_w = np.take_along_axis(probs + bias, experts, axis=1)
    assert not np.allclose(weights, with_bias_w / with_bias_w.sum(1, keepdims=True))


def naive_biased_moe(p: dict, i: int, h: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Block ``i``'s sparse FFN token by token, the choice on p + bias, weights from p."""
    out = np.zeros_like(h)
    for b in range(h.shape[0]):
        for t in range(h.shape[1]):
            x = h[b, t]
            z = p[f"layers.{i}." + ROUTER] @ x
            pr = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            top = np.argsort(-(pr + bias), kind="stable")[:MOE.moe_top_k]
            for e in top:
                w1, w3, w2 = (p[n] for n in expert_names(i, e))
                g, u = w1 @ x, w3 @ x
                out[b, t] += pr[e] / pr[top].sum() * (w2 @ (g / (1 + np.exp(-g)) * u))
    return out


def test_sparse_ffn_with_a_bias_matches_a_token_loop():
    k = get_backend("numpy")
    p = init_params(MOE, 3, np.float64)
    h = np.random.default_rng(1).normal(size=(2, 5, MOE.hidden))
    bias = np.array([0.2, -0.1, 0.05, 0.0])
    out, saved = moe_forward(k, p, 1, MOE, h, LocalExperts(MOE.moe_experts), bias)
    np.testing.assert_allclose(out, naive_biased_moe(p, 1, h, bias), rtol=1e-12, atol=1e-14)
    plain, _ = moe_forward(k, p, 1, MOE, h, LocalExperts(MOE.moe_experts))
    assert np.abs(out - plain).max() > 1e-3     # the bias matters here


def test_gradient_with_a_bias_matches_finite_differences():
    """The bias fixes the choice; the gradient of cross-entropy + balance loss through the
    unbiased weights is still exact (router and one expert, central differences)."""
    stage = make_stage(cfg=MOE)
    stage.moe_bias = {0: np.array([0.1, -0.1, 0.0, 0.05]), 1: np.array([-0.05, 0.0, 0.1, 0.0])}
    rng = np.random.default_rng(0)
    p = init_params(MOE, 5, np.float64)
    tokens, targets = rng.integers(0, 11, (2, 6)), rng.integers(0, 11, (2, 6))
    alpha = MOE.moe_aux_loss_coef

    def objective() -> float:
        stage.moe_aux = 0.0
        loss, _ = stage.forward(p, tokens, np.arange(6), targets)
        return float(loss.sum()) / loss.size + alpha / 2 * stage.moe_aux

    grads = {n: np.zeros_like(v) for n, v in p.items()}
    stage.moe_aux = 0.0
    loss, cache = stage.forward(p, tokens, np.arange(6), targets)
    stage.moe_aux_weight = alpha / 2
    stage.backward(p, grads, np.full(loss.shape, 1.0 / loss.size), cache)
    for name in ("layers.1." + ROUTER, expert_names(1, 2)[0]):
        flat = p[name].reshape(-1)
        for j in rng.choice(flat.size, size=4, replace=False):
            old = flat[j]
            flat[j] = old + 1e-6
            up = objective()
            flat[j] = old - 1e-6
            down = objective()
            flat[j] = old
            assert grads[name].reshape(-1)[j] == pytest.approx((up - down) / 2e-6, rel=1e-5,
                                                               abs=1e-9), name


@pytest.mark.parametrize("model, words", [
    (dict(moe_experts=4, moe_bias_update_rate=-0.01),
     r"model.moe_bias_update_rate=-0.01: must be >= 0"),
    (dict(moe_bias_update_rate=0.001),
     r"model.moe_bias_update_rate=0.001: needs a mixture of experts \(--moe-experts > 0\)"),
    (dict(moe_experts=4, moe_bias_update_rate=float("inf")),
     r"model.moe_bias_update_rate=inf: must be a finite number"),
])
def test_bad_rates_are_config_errors(model, words):
    """One ConfigError naming the value and the rule (the programs exit 2 on it)."""
    from mpipar.config import Config, ModelConfig, TrainConfig
    from mpipar.rules import validate
    cfg = Config(ModelConfig(hidden=16, heads=2, kv_heads=2, layers=2, **model),
                 train=TrainConfig(global_batch_size=2, seq_len=8))
    with pytest.raises(ConfigError, match=words):
        validate(cfg, 1)


def test_the_flag_reaches_the_config():
    import argparse

    from mpipar.config.cli import add_arguments, from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = from_args(parser.parse_args(["--moe-experts", "4", "--moe-bias-update-rate", "0.002"]))
    assert cfg.model.moe_bias_update_rate == 0.002


def test_export_notes_name_the_dropped_biases_and_capacity():
    from mpipar.checkpoint.hf_moe import export_notes
    from mpipar.config import ModelConfig
    plain = ModelConfig(moe_experts=3, moe_top_k=2)
    assert export_notes(plain, {}) == []
    (note,) = export_notes(plain, {1: np.array([0.0, -0.003, 0.001]), 2: np.zeros(3)})
    assert "2 sparse blocks" in note and "0.003" in note and "not part of Mixtral" in note
    capped = ModelConfig(moe_experts=3, moe_top_k=2, moe_capacity_factor=1.25)
    (note,) = export_notes(capped, {})
    assert "--moe-capacity-factor 1.25" in note and "its 2 experts (dropless)" in note


def _rank(tmp_path, rate: float = 0.02):
    from mpi4py import MPI

    from layouts import small_config, token_source
    from mpipar.rules import validate
    from mpipar.training.rank import build_rank
    cfg = small_config("float64", "moe")
    cfg.model.moe_bias_update_rate = rate
    return build_rank(validate(cfg, 1), MPI.COMM_SELF, source=token_source())


def _snapshot(rank, res) -> tuple:
    return (res.loss, res.grad_norm, res.moe["moe_aux_loss"], rank.model.routing.host(),
            trainer.gather_params(rank))


def _same(a: tuple, b: tuple) -> None:
    assert a[:3] == b[:3]
    assert a[3].keys() == b[3].keys() and all((a[3][i] == b[3][i]).all() for i in a[3])
    assert all((a[4][n] == b[4][n]).all() for n in a[4])


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Stopped after step 2 (checkpoint: parameters, moments, biases), resumed: steps 3 and 4
    equal the uninterrupted run's bit for bit, biases included; without the biases restored
    step 3 differs (the check can fail)."""
    from mpipar.checkpoint import reader, writer
    from mpipar.runtime.comm import Group, Ledger
    from mpi4py import MPI
    whole = _rank(tmp_path)
    ref = [_snapshot(whole, trainer.train_step(whole, k)) for k in range(4)]
    trainer.close(whole)
    assert max(ref[1][3][i].max() for i in ref[1][3]) > 0     # the biases moved
    first = _rank(tmp_path)
    for k in range(2):
        trainer.train_step(first, k)
    path = writer.save(first.state, trainer.run_position(first, 2), tmp_path,
                       Group(MPI.COMM_SELF, "world", Ledger()))
    trainer.close(first)
    assert reader.read_moe_bias(path).keys() == ref[1][3].keys()
    import json

    from mpipar.checkpoint.tools import inspect
    shown = json.loads(json.dumps(inspect(path)))["moe_bias"]     # python -m mpipar.ckpt
    assert shown == {f"layers.{i}": b.tolist() for i, b in ref[1][3].items()}
    import h5py

    from mpipar.checkpoint.tools import consolidate
    with h5py.File(consolidate(path, tmp_path / "one.h5"), "r") as f:
        assert all((f["moe_bias"].attrs[f"layers.{i}"] == b).all() for i, b in ref[1][3].items())
    resumed = _rank(tmp_path)
    assert reader.load(resumed.state, path) == 2
    resumed.model.routing.load(reader.read_moe_bias(path))
    for k in (2, 3):
        _same(_snapshot(resumed, trainer.train_step(resumed, k)), ref[k])
    trainer.close(resumed)
    forgot = _rank(tmp_path)                       # the biases not restored: zeros
    reader.load(forgot.state, path)
    got = _snapshot(forgot, trainer.train_step(forgot, 2))
    trainer.close(forgot)
    assert any((got[3][i] != ref[2][3][i]).any() for i in got[3])


def test_a_zero_rate_routes_as_before(tmp_path):
    """Rate 0: no bias at all (the plain top-K), no metric, nothing recorded."""
    rank = _rank(tmp_path, rate=0.0)
    res = trainer.train_step(rank, 0)
    assert rank.model.routing.biases == {} and "moe_bias_max_abs" not in res.moe
    assert trainer.run_position(rank, 1).moe_bias == {}
    trainer.close(rank)


def test_index_refuses_a_bias_of_the_wrong_length(tmp_path):
    import h5py

    from mpipar.checkpoint import writer
    from mpipar.checkpoint.directory import CheckpointError
    from mpipar.checkpoint.index import read_index
    from mpipar.runtime.comm import Group, Ledger
    from mpi4py import MPI
    rank = _rank(tmp_path)
    trainer.train_step(rank, 0)
    pos = dataclasses.replace(trainer.run_position(rank, 1), moe_bias={1: np.zeros(3)})
    path = writer.save(rank.state, pos, tmp_path, Group(MPI.COMM_SELF, "world", Ledger()))
    trainer.close(rank)
    with pytest.raises(CheckpointError, match="moe_bias.layers.1 must be 4 finite float64"):
        read_index(path)
    assert h5py.is_hdf5(path / "index.h5")


def _train(argv: list[str]) -> tuple[int, str, str]:
    """``python -m mpipar.train ARGV`` on one rank in this process: (status, stdout, stderr)."""
    import contextlib
    import io
    import signal
    import sys

    from mpi4py import MPI

    from mpipar import train
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    hook, out, err = sys.excepthook, io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = train.main(argv, MPI.COMM_SELF)
            except SystemExit as exc:
                code = exc.code
    finally:      # the abort hook and signal handlers the program installs put back
        sys.excepthook = hook
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return code, out.getvalue(), err.getvalue()


def test_the_command_line_trains_resumes_and_exports(tmp_path):
    """``--moe-bias-update-rate`` from the command line: metrics carry ``moe_bias_max_abs``
    (a multiple of the rate, at most steps x rate), ``--resume auto`` restores the biases from
    the checkpoint's index, ``--export-hf`` writes Mixtral and says the biases are dropped."""
    import json

    from untrusted import TINY
    moe = ["--moe-experts", "4", "--moe-bias-update-rate", "0.01", "--save-dir",
           str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run")]
    code, out, err = _train([*TINY, *moe, "--steps", "2", "--export-hf", str(tmp_path / "hf")])
    assert code == 0, err[-2000:]
    assert "not part of Mixtral and are not exported" in out
    assert (tmp_path / "hf" / "config.json").exists()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert sorted(r["moe_bias_max_abs"]) == ["0", "1"]
        assert all(round(v / 0.01) * 0.01 == pytest.approx(v) and v <= r["step"] * 0.01 + 1e-12
                   for v in r["moe_bias_max_abs"].values())
    assert max(rows[0]["moe_bias_max_abs"].values()) == 0.01
    from mpipar.checkpoint import reader
    saved = reader.read_moe_bias(tmp_path / "ckpt" / "step_00000002")
    assert max(float(abs(b).max()) for b in saved.values()) == max(
        rows[1]["moe_bias_max_abs"].values())
    code, out, err = _train([*TINY, *moe, "--steps", "3", "--resume", "auto"])
    assert code == 0, err[-2000:]
    assert "resumed from" in out
    whole = ["--moe-experts", "4", "--moe-bias-update-rate", "0.01", "--save-dir",
             str(tmp_path / "whole"), "--run-dir", str(tmp_path / "run2"), "--steps", "3"]
    assert _train([*TINY, *whole])[0] == 0
    got, want = (reader.read_moe_bias(tmp_path / d / "step_00000003") for d in ("ckpt", "whole"))
    assert got.keys() == want.keys() and all((got[i] == want[i]).all() for i in got)
    last = [json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[-1])
            for d in ("run", "run2")]
    assert last[0]["step"] == last[1]["step"] == 3 and last[0]["loss"] == last[1]["loss"]


def test_a_rate_without_experts_exits_2_with_one_message(tmp_path):
    from untrusted import TINY, run_train
    code, err = run_train([*TINY, "--moe-bias-update-rate", "0.01", "--run-dir", str(tmp_path)])
    assert code == 2
    assert err.count("model.moe_bias_update_rate=0.01: needs a mixture of experts") == 1, err


def test_generation_from_a_checkpoint_routes_with_its_biases(tmp_path):
    """``Generator.load_checkpoint`` takes the checkpoint's biases: its stage holds them, and
    the greedy logits differ from those of the same weights routed without them."""
    from mpi4py import MPI

    from generation import build_generator
    from mpipar.checkpoint import reader, writer
    from mpipar.inference.sampling import Sampling
    from mpipar.runtime.comm import Group, Ledger
    rank = _rank(tmp_path, rate=0.3)            # large: the bias outweighs the probabilities
    for k in range(2):
        trainer.train_step(rank, k)
    path = writer.save(rank.state, trainer.run_position(rank, 2), tmp_path,
                       Group(MPI.COMM_SELF, "world", Ledger()))
    model = rank.cfg.model
    trainer.close(rank)
    biases, logits = reader.read_moe_bias(path), []
    for given in (biases, None):
        gen = build_generator(model, MPI.COMM_SELF)
        with reader.open_reader(path) as read:
            gen.load_checkpoint(read, given)
        out = gen.generate([1, 2, 3, 4], 3, Sampling(temperature=0.0), keep_logits=True)
        logits.append(np.stack([np.asarray(x) for x in out.logits]))
        if given:
            assert all((gen.stage.moe_bias[i] == b).all() for i, b in biases.items())
    assert np.abs(logits[0] - logits[1]).max() > 1e-6


def test_the_rate_may_change_on_a_checkpoint():
    """A resumed run (DeepSeek-V3 turns the rate to 0 for its last tokens) or one initialised
    from a Mixtral (which has no rate) takes the rate of the command line; other model fields
    still come from the checkpoint."""
    from mpipar.config import ModelConfig
    from mpipar.layout import model_from_checkpoint
    saved = ModelConfig(moe_experts=4, moe_bias_update_rate=0.001)
    assert model_from_checkpoint(saved, {"moe_bias_update_rate": 0.0},
                                 "ckpt").moe_bias_update_rate == 0.0
    assert model_from_checkpoint(ModelConfig(moe_experts=4), {"moe_bias_update_rate": 0.01},
                                 "ckpt").moe_bias_update_rate == 0.01
    with pytest.raises(ConfigError, match="moe_top_k=3"):
        model_from_checkpoint(saved, {"moe_top_k": 3}, "ckpt")


def test_the_balance_loss_coefficient_may_change_on_a_checkpoint():
    """``--init-from-hf <mixtral> --moe-aux-loss-coef 0.01`` (or a resume with another
    coefficient) takes the command line's: the coefficient weighs a loss, it shapes no tensor
    of the checkpoint (it was refused as contradicting the checkpoint)."""
    from mpipar.config import ModelConfig
    from mpipar.layout import model_from_checkpoint
    saved = ModelConfig(moe_experts=4)
    assert model_from_checkpoint(saved, {"moe_aux_loss_coef": 0.01},
                                 "ckpt").moe_aux_loss_coef == 0.01
    assert model_from_checkpoint(saved, {}, "ckpt").moe_aux_loss_coef == saved.moe_aux_loss_coef
