"""A sparse block's shared expert (``--moe-shared-ffn-hidden``: DeepSeek-V3's, ungated; with
``--moe-shared-gate`` Qwen2-MoE's, scaled by a per-token sigmoid gate) on one process: the
block's FFN output against NumPy (the routed experts' token loop plus SwiGLU of the shared
weights, times the gate), the stage's gradient against float64 finite differences, the recompute
modes bit-identical, a zero shared expert changing nothing bit for bit, and the counts that must
see it (FLOPs, parameters, the planner's memory, the placement's tp split) against analytic
ones."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from mpipar.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from mpipar.layout import resolve_model
from mpipar.model.params import (SHARED_DOWN, SHARED_GATE, SHARED_GATE_UP, init_params,
                                 param_specs)
from tests.unit.test_model import make_stage
from tests.unit.test_moe import MOE, assert_gradient_matches_differences, naive_moe

FS = 12
SHARED = dataclasses.replace(MOE, moe_shared_ffn_hidden=FS)
SHARED_HALF = dataclasses.replace(SHARED, moe_layers="1")   # block 0 dense, block 1 sparse
GATED = dataclasses.replace(SHARED, moe_shared_gate=True)
GATED_HALF = dataclasses.replace(SHARED_HALF, moe_shared_gate=True)
NAMES = (*SHARED_GATE_UP, *SHARED_DOWN)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("cfg", [SHARED, GATED], ids=["ungated", "gated"])
def test_sparse_block_output_is_routed_plus_shared_swiglu(cfg):
    """Each sparse block's FFN output (the recorder's ``mlp``) = the routed experts' token loop
    + ``down @ (silu(gate @ h) * (up @ h))`` of the shared weights (times
    ``sigmoid(w_g @ h)`` when gated), float64."""
    stage = make_stage(cfg=cfg)
    p = init_params(cfg, 3, np.float64)
    seen: dict = {}
    stage.recorder = lambda i, name, a: seen.__setitem__((i, name), np.array(a))
    tokens = np.random.default_rng(1).integers(0, 11, (2, 5))
    stage.moe_aux = 0.0
    stage.forward(p, tokens, np.arange(5), tokens)
    for i in range(cfg.layers):
        n = f"layers.{i}."
        x2 = seen[i, "input"] + seen[i, "attention_out"]
        h = rmsnorm(x2, p[n + "post_attention_layernorm.weight"], cfg.norm_eps)
        routed, _ = naive_moe(p, i, h, cfg)
        gate, up, down = (p[n + w] for w in NAMES)
        g, u = h @ gate.T, h @ up.T
        shared = (g / (1 + np.exp(-g)) * u) @ down.T
        if cfg.moe_shared_gate:
            z = h @ p[n + SHARED_GATE[0]].T                          # [B, S, 1]
            assert np.ptp(z) > 0.1                                  # a gate that varies
            shared = shared / (1 + np.exp(-z))
        np.testing.assert_allclose(seen[i, "mlp"], routed + shared, rtol=1e-12, atol=1e-14)
        assert np.abs(shared).max() > 1e-3   # it does add


@pytest.mark.parametrize("cfg", [SHARED, SHARED_HALF, GATED_HALF],
                         ids=["all-sparse", "one-sparse", "gated-one-sparse"])
def test_gradient_matches_finite_differences(cfg):
    """Cross-entropy + balance loss through a stage with shared experts: every parameter's
    gradient (3 random elements each, all of the shared expert's) against central
    differences."""
    _, names = assert_gradient_matches_differences(cfg, per=3)
    checked = sum("shared_expert" in name for name in names)
    assert checked == (9 + 3 * cfg.moe_shared_gate) * sum(map(cfg.is_sparse, range(cfg.layers)))


def step(cfg: ModelConfig, p: dict, recompute: str = "none"):
    """(balance loss share, per-token loss, gradients) of one forward and backward."""
    stage = make_stage(cfg=cfg, recompute=recompute)
    stage.moe_aux_weight = 0.05
    stage.moe_aux = 0.0
    tokens = np.random.default_rng(3).integers(0, 11, (2, 6))
    grads = {n: np.zeros_like(v) for n, v in p.items()}
    loss, cache = stage.forward(p, tokens, np.arange(6), tokens)
    stage.backward(p, grads, np.full(loss.shape, 1 / loss.size), cache)
    return stage.moe_aux, loss, grads


@pytest.mark.parametrize("cfg", [SHARED, GATED], ids=["ungated", "gated"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_is_bit_identical(mode, cfg):
    p = init_params(cfg, 5, np.float64)
    (aux0, loss0, g0), (aux1, loss1, g1) = step(cfg, p), step(cfg, p, mode)
    assert aux0 == aux1 and np.array_equal(loss0, loss1)
    for n in p:
        np.testing.assert_array_equal(g0[n], g1[n])


def test_no_shared_expert_is_todays_model_bit_for_bit():
    """``moe_shared_ffn_hidden`` 0 adds no parameter; a shared expert whose down projection is
    zero changes neither the loss nor any other gradient, bit for bit (its branch adds exact
    zeros forward and backward), and only its down projection gets a gradient."""
    assert not any("shared_expert" in s.name for s in param_specs(MOE))
    p = init_params(MOE, 5, np.float64)
    ps = init_params(SHARED, 5, np.float64)
    for i in (0, 1):
        ps[f"layers.{i}.{SHARED_DOWN[0]}"][:] = 0.0
    assert all(np.array_equal(p[n], ps[n]) for n in p)
    (aux0, loss0, g0), (aux1, loss1, g1) = step(MOE, p), step(SHARED, ps)
    assert aux0 == aux1 and np.array_equal(loss0, loss1)
    for n in p:
        np.testing.assert_array_equal(g0[n], g1[n])
    for w in SHARED_GATE_UP:
        assert not np.any(g1[f"layers.1.{w}"])
    assert np.any(g1[f"layers.1.{SHARED_DOWN[0]}"])


@pytest.mark.parametrize("model, parallel, words", [
    (dict(moe_experts=4, moe_shared_ffn_hidden=-8), dict(),
     r"model.moe_shared_ffn_hidden=-8: must be >= 0 \(0: no shared expert\)"),
    (dict(moe_shared_ffn_hidden=8), dict(),
     r"model.moe_shared_ffn_hidden=8: needs a mixture of experts \(--moe-experts > 0\)"),
    (dict(moe_experts=4, moe_shared_ffn_hidden=9), dict(tp=2),
     r"parallel.tp=2: must divide model.moe_shared_ffn_hidden=9"),
    (dict(moe_experts=4, moe_shared_gate=True), dict(),
     r"model.moe_shared_gate=True: needs a shared expert \(--moe-shared-ffn-hidden > 0\)"),
])
def test_bad_values_are_config_errors(model, parallel, words):
    """Each rule raises one ConfigError naming the value and the rule (the programs exit 2)."""
    from mpipar.rules import validate
    cfg = Config(ModelConfig(hidden=16, heads=2, kv_heads=2, layers=2, **model),
                 ParallelConfig(**parallel), TrainConfig(global_batch_size=12, seq_len=8))
    with pytest.raises(ConfigError, match=words):
        validate(cfg, parallel.get("tp", 1))


def test_cli_flag_sets_the_field():
    import argparse

    from mpipar.config.cli import add_arguments, from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--moe-experts", "4", "--moe-shared-ffn-hidden", "64",
                              "--moe-shared-gate"])
    m = from_args(args).model
    assert m.moe_shared_ffn_hidden == 64 and m.moe_shared_gate


def test_flops_and_parameters_count_the_shared_expert():
    """Model FLOPs: 6 H F_s per token forward per sparse block (3 x over the step); parameters:
    3 H F_s per sparse block, the analytic count equal to the tensors'."""
    from mpipar.model.flops import model_flops_per_step
    from mpipar.plan.memory import parameter_count
    train = TrainConfig(seq_len=8, global_batch_size=2)
    without, with_ = (model_flops_per_step(Config(model=m, train=train))
                      for m in (dataclasses.replace(SHARED_HALF, moe_shared_ffn_hidden=0),
                                SHARED_HALF))
    assert with_ - without == pytest.approx(3 * 6 * MOE.hidden * FS * 16)   # one sparse block
    gated = model_flops_per_step(Config(model=GATED_HALF, train=train))
    assert gated - with_ == pytest.approx(3 * 2 * MOE.hidden * 16)          # its gate, H x 1
    for m in (SHARED, SHARED_HALF, MOE, GATED, dataclasses.replace(SHARED, moe_layers="even")):
        assert parameter_count(m) == sum(math.prod(s.shape) for s in param_specs(m)), m
    assert parameter_count(SHARED) - parameter_count(MOE) == 2 * 3 * MOE.hidden * FS
    assert parameter_count(GATED) - parameter_count(SHARED) == 2 * MOE.hidden


@pytest.mark.parametrize("tp, ep, zero", [(1, 1, 0), (2, 1, 1), (2, 2, 0), (1, 4, 0)])
def test_placement_and_planned_memory(tp, ep, zero):
    """The shared expert is split by tp as the dense FFN (gate/up rows, down columns), is not an
    expert (every ep position holds all of it), and the planner's weights, gradients and AdamW
    moments per rank grow by its 3 H F_s / tp elements a sparse block (float32 bytes; the
    moments 1/(dp x sp) of them under ZeRO-1)."""
    from mpipar.plan.memory import predict_memory
    from mpipar.plan.rank import placement_table
    from mpipar.rules import validate
    from mpipar.runtime.topology import Coord
    model = ModelConfig(hidden=32, heads=4, kv_heads=2, layers=2, ffn_hidden=48, moe_experts=4,
                        moe_top_k=2, moe_ffn_hidden=16)
    dp = 4

    def layout(fs):
        return validate(Config(dataclasses.replace(model, moe_shared_ffn_hidden=fs),
                               ParallelConfig(dp=dp, tp=tp, ep=ep, zero=zero),
                               TrainConfig(dtype="float32", seq_len=8, global_batch_size=8)),
                        dp * tp)
    big = layout(64)
    table = placement_table(big)
    n = "layers.1.mlp.shared_expert."
    assert [table[n + w].tp for w in ("gate_proj.weight", "up_proj.weight",
                                      "down_proj.weight")] == ["column", "column", "row"]
    assert table[n + "gate_proj.weight"].local_shape(tp) == (64 // tp, 32)
    assert table[n + "down_proj.weight"].local_shape(tp) == (32, 64 // tp)
    assert all(table.holds(n + "up_proj.weight", r) for r in range(ep))
    gated = placement_table(validate(Config(
        dataclasses.replace(model, moe_shared_ffn_hidden=64, moe_shared_gate=True),
        ParallelConfig(dp=dp, tp=tp, ep=ep, zero=zero),
        TrainConfig(dtype="float32", seq_len=8, global_batch_size=8)), dp * tp))
    gate = gated["layers.1." + SHARED_GATE[0]]
    assert gate.tp == "replicated" and gate.local_shape(tp) == (1, 32)
    a, b = (predict_memory(c, Coord(0, 0, 0, 0)) for c in (layout(0), big))
    extra = 4 * 2 * 3 * 32 * 64 // tp                     # float32 bytes of 2 sparse blocks
    assert b.weights - a.weights == extra
    assert b.grads - a.grads == extra
    assert b.optimizer - a.optimizer == 2 * extra // (dp if zero else 1)


def test_export_kind_follows_the_shared_expert():
    """A gated shared expert exports as Qwen2-MoE (tests/unit/test_hf_qwen2_moe.py), none as
    Mixtral; an ungated one has no transformers form."""
    from mpipar.checkpoint.hf_moe import export_kind, export_notes, export_problem
    assert "gated (--moe-shared-gate)" in export_problem(resolve_model(SHARED))
    assert export_problem(resolve_model(GATED)) == "" and export_kind(GATED) == "qwen2_moe"
    assert export_problem(resolve_model(MOE)) == "" and export_kind(MOE) == "mixtral"
    (note,) = export_notes(dataclasses.replace(GATED, moe_capacity_factor=1.5), {})
    assert "not part of Qwen2-MoE" in note


def test_bf16_gated_shared_expert_tracks_float64():
    """Under bf16 compute the gate runs in float32 (as the router) and the stream stays bf16:
    two AdamW steps of the gated model on one process track the float64 run's losses."""
    from mpi4py import MPI

    from mpipar.rules import validate
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    from tests.layouts import small_config, token_source
    losses = {}
    for dtype in ("float64", "bfloat16"):
        cfg = small_config(dtype, "moe_gated")
        rank = build_rank(validate(cfg, 1), MPI.COMM_SELF, source=token_source(cfg.train.seq_len))
        try:
            losses[dtype] = [trainer.train_step(rank, k).loss for k in range(2)]
        finally:
            trainer.close(rank)
    np.testing.assert_allclose(losses["bfloat16"], losses["float64"], rtol=5e-3)
