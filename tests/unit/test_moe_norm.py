"""The router without renormalisation (``--no-moe-norm-topk``, Qwen2-MoE's ``norm_topk_prob:
false``: the top-K weights are the softmax probabilities as they are) on one process: the sparse
FFN against a per-token loop on each CPU backend, the router's gradient and the whole stage's
against float64 finite differences, the rule and the flag, and the export's refusal of a model
that neither Mixtral nor Qwen2-MoE can hold. Against transformers: test_hf_qwen2_moe.py; on 8
ranks: tests/mpi/test_moe_norm.py."""
from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

from mpipar.checkpoint.hf_moe import export_problem
from mpipar.config import Config, ConfigError, ModelConfig, TrainConfig
from mpipar.config.cli import add_arguments, from_args
from mpipar.kernels import get_backend
from mpipar.kernels import expert_routing
from mpipar.layout import resolve_model
from mpipar.model.moe import LocalExperts, moe_forward
from mpipar.model.params import ROUTER, init_params, param_specs
from mpipar.rules import validate
from tests.unit.test_model import make_stage
from tests.unit.test_moe import MOE, assert_matches_differences, naive_moe

PLAIN = dataclasses.replace(MOE, moe_norm_topk=False)
PLAIN_HALF = dataclasses.replace(PLAIN, moe_layers="1")
PLAIN_CAP = dataclasses.replace(PLAIN, moe_capacity_factor=0.5)    # drops active


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_sparse_ffn_weights_are_the_probabilities(backend):
    """Each token's output is sum_k p_k y_k (not renormalised), and differs from Mixtral's."""
    k = get_backend(backend)
    p = init_params(PLAIN, 3, np.float64)
    h = np.random.default_rng(1).normal(size=(2, 5, PLAIN.hidden))
    out, saved = moe_forward(k, p, 1, PLAIN, h, LocalExperts(PLAIN.moe_experts))
    ref, aux = naive_moe(p, 1, h, PLAIN)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    assert saved.aux == pytest.approx(aux, rel=1e-13) and saved.chosen_sum is None
    chosen = np.take_along_axis(saved.probs, saved.experts, axis=-1)
    np.testing.assert_array_equal(saved.weights, chosen)
    assert saved.weights.sum(axis=-1).max() < 1 - 1e-3        # really not renormalised
    renormalised, _ = moe_forward(k, p, 1, MOE, h, LocalExperts(MOE.moe_experts))
    assert np.abs(renormalised - out).max() > 1e-3


def test_route_topk_bwd_without_renormalisation_is_the_identity_on_the_chosen():
    probs = expert_routing.softmax(np.random.default_rng(0).normal(size=(6, 5)), np)
    experts, weights = expert_routing.route_topk(probs, 2, np, normalize=False)
    dweights = np.random.default_rng(1).normal(size=weights.shape)
    dp = expert_routing.route_topk_bwd(dweights, weights, None, experts, 5, np)
    np.testing.assert_array_equal(np.take_along_axis(dp, experts, axis=-1), dweights)
    assert np.count_nonzero(dp) == dweights.size


def stage_gradient(cfg: ModelConfig, ce_weight: float, seed: int = 5):
    stage = make_stage(cfg=cfg)
    rng = np.random.default_rng(0)
    p = init_params(cfg, seed, np.float64)
    tokens, targets = rng.integers(0, 11, (2, 6)), rng.integers(0, 11, (2, 6))
    grads = {n: np.zeros_like(v) for n, v in p.items()}
    stage.moe_aux = 0.0
    loss, cache = stage.forward(p, tokens, np.arange(6), targets)
    stage.moe_aux_weight = cfg.moe_aux_loss_coef / 2
    stage.backward(p, grads, np.full(loss.shape, ce_weight / loss.size), cache)
    return stage, p, grads, tokens, targets, rng


@pytest.mark.parametrize("cfg", [PLAIN, PLAIN_HALF, PLAIN_CAP],
                         ids=["all-sparse", "one-sparse", "capacity"])
def test_router_gradient_matches_finite_differences(cfg):
    """Every element of each sparse block's router (the cross-entropy through the weights p_k
    plus the balance loss) against central differences."""
    stage, p, grads, tokens, targets, rng = stage_gradient(cfg, 1.0)
    sparse = [i for i in range(cfg.layers) if cfg.is_sparse(i)]
    specs = [s for s in param_specs(cfg) if s.name in {f"layers.{i}." + ROUTER for i in sparse}]
    n = specs[0].shape[0] * specs[0].shape[1]
    checked = assert_matches_differences(stage, p, grads, tokens, targets,
                                         cfg.moe_aux_loss_coef, specs, rng, per=n)
    assert len(checked) == n * len(sparse)


def test_stage_gradient_matches_finite_differences():
    """Every parameter (3 random elements each) with the router unnormalised."""
    stage, p, grads, tokens, targets, rng = stage_gradient(PLAIN, 1.0)
    assert_matches_differences(stage, p, grads, tokens, targets, PLAIN.moe_aux_loss_coef,
                               param_specs(PLAIN), rng, per=3)


def test_flag_and_rule():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--moe-experts", "4", "--no-moe-norm-topk"])
    assert from_args(args).model.moe_norm_topk is False
    assert from_args(parser.parse_args(["--moe-experts", "4"])).model.moe_norm_topk
    with pytest.raises(ConfigError, match=r"model.moe_norm_topk=False: needs a mixture of "
                                          r"experts \(--moe-experts > 0\)"):
        validate(Config(ModelConfig(hidden=16, heads=2, kv_heads=2, layers=2,
                                    moe_norm_topk=False),
                        train=TrainConfig(global_batch_size=12, seq_len=8)), 1)


def test_export_needs_a_gated_shared_expert():
    assert "model.moe_norm_topk=False (--no-moe-norm-topk) without a shared expert" in \
        export_problem(resolve_model(PLAIN))
    gated = resolve_model(dataclasses.replace(PLAIN, moe_shared_ffn_hidden=8,
                                              moe_shared_gate=True))
    assert export_problem(gated) == ""
