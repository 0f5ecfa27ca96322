"""The planner's activation memory of sparse blocks against what the model keeps: for each
recompute mode, a block's predicted bytes (``plan.memory._block_activation_bytes``) equal the
bytes of the distinct arrays its :class:`BlockSaved` holds after a real forward, dense and
sparse blocks alike: routed experts (renormalised or not), a shared expert, gated or not; with
an expert capacity the prediction is the dropless bound, above the record by exactly the dropped
assignments' rows. A rank's whole prediction moves by the sparse blocks' difference."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mpipar.config import Config, ModelConfig, ParallelConfig, TrainConfig
from mpipar.model.recompute import NONE
from mpipar.plan.memory import _block_activation_bytes, predict_memory
from mpipar.rules import validate
from mpipar.runtime.topology import Coord
from tests.unit.test_moe import HALF
from tests.unit.test_recompute import _kept_bytes, _stage

B, S = 2, 8
MODELS = {
    "routed": HALF,
    "unnormalised": dataclasses.replace(HALF, moe_norm_topk=False),
    "shared": dataclasses.replace(HALF, moe_shared_ffn_hidden=12),
    "gated": dataclasses.replace(HALF, moe_shared_ffn_hidden=12, moe_shared_gate=True),
    # DeepSeek-V3's latent attention (its latents' record: before and after their norms)
    "latent": dataclasses.replace(HALF, kv_heads=4, head_dim=6, latent_kv_rank=5,
                                  latent_q_rank=7, rope_head_dim=2, v_head_dim=4),
}


def layout(cfg: ModelConfig, mode: str):
    model = ModelConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    return validate(Config(model, ParallelConfig(),
                           TrainConfig(seq_len=S, global_batch_size=B, micro_batch_size=B,
                                       dtype="float64", recompute=mode)), 1)


def kept(cfg: ModelConfig, mode: str) -> tuple[list[int], list[int]]:
    """(bytes each block keeps after one forward, assignments capacity dropped per block)."""
    stage = _stage(mode, cfg=cfg)
    stage.moe_aux = 0.0
    from mpipar.model.params import init_params
    params = init_params(cfg, 4, np.float64)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, S))
    _, cache = stage.forward(params, tokens, np.arange(S), tokens)
    full = _stage("none", cfg=cfg)
    full.moe_aux = 0.0
    _, record = full.forward(params, tokens, np.arange(S), tokens)
    dropped = [b.moe.dropped if b.moe is not None else 0 for b in record.blocks]
    return [_kept_bytes(b) for b in cache.blocks], dropped


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("name", list(MODELS))
def test_block_prediction_is_what_the_model_keeps(name, mode):
    cfg = MODELS[name]
    measured, _ = kept(cfg, mode)
    plan = layout(cfg, mode)
    predicted = [_block_activation_bytes(plan, plan.train.recompute_mode, cfg.is_sparse(i))
                 for i in range(cfg.layers)]
    assert predicted == measured, (predicted, measured)
    if mode != "full":
        assert predicted[1] > predicted[0]           # 2 experts of 8 per token > one FFN of 24


def test_capacity_is_bounded_by_the_dropless_prediction():
    """Each dropped assignment takes its token's row and its expert's g, u, m out of the record
    (the permutation is a view of the whole one); the prediction counts them all (dropless)."""
    cfg = dataclasses.replace(HALF, moe_capacity_factor=0.5)
    (dense, sparse), (_, dropped) = kept(cfg, "none")
    plan = layout(cfg, "none")
    assert dropped > 0
    assert _block_activation_bytes(plan, NONE) == dense
    assert _block_activation_bytes(plan, NONE, True) - sparse == \
        dropped * (cfg.hidden + 3 * cfg.moe_ffn_hidden) * 8


def test_a_ranks_activations_count_the_sparse_blocks():
    """The rank's saved activations move from the dense model's by the sparse block's
    difference, twice for the working set when the sparse block is the larger."""
    cfg = MODELS["gated"]
    dense = dataclasses.replace(cfg, moe_experts=0, moe_shared_ffn_hidden=0,
                                moe_shared_gate=False, moe_layers="all")
    got = {n: predict_memory(layout(c, "none"), Coord(0, 0, 0, 0)).activations
           for n, c in (("moe", cfg), ("dense", dense))}
    plan = layout(cfg, "none")
    step = _block_activation_bytes(plan, NONE, True) - _block_activation_bytes(plan, NONE)
    assert got["moe"] - got["dense"] == 2 * step


@pytest.mark.parametrize("norm", [True, False])
def test_bf16_record_is_the_prediction(norm):
    """Under bf16 the router's probabilities, weights, chosen sum and f / T are float32 (the
    planner's statistic bytes), the rows and the experts' g, u, m bf16: the sparse FFN's record
    (with its input ``h``) is the prediction to the byte."""
    import ml_dtypes

    from mpipar.kernels import get_backend
    from mpipar.model.moe import LocalExperts, moe_forward
    from mpipar.model.params import init_params
    from mpipar.plan.memory import _sparse_ffn_bytes
    bf16, cfg = ml_dtypes.bfloat16, dataclasses.replace(HALF, moe_norm_topk=norm)
    p = {n: a.astype(bf16) for n, a in init_params(cfg, 3, np.float64).items()}
    h = np.random.default_rng(1).normal(size=(B, S, cfg.hidden)).astype(bf16)
    _, saved = moe_forward(get_backend("numpy"), p, 1, cfg, h, LocalExperts(cfg.moe_experts))
    plan = layout(cfg, "none")
    plan = dataclasses.replace(plan, config=dataclasses.replace(
        plan.config, train=dataclasses.replace(plan.config.train, dtype="bfloat16")))
    assert _sparse_ffn_bytes(plan, NONE) + h.nbytes == _kept_bytes(saved)


@pytest.mark.parametrize("spec", ["all", "even", "odd", "1,2,5,9"])
def test_sparse_blocks_per_stage_without_a_layer_walk(spec):
    """The count of a stage's sparse blocks is ``is_sparse``'s, and instant for 10^8 layers."""
    import time
    import types

    from mpipar.plan.memory import _sparse_in
    for layers, per in ((12, 3), (12, 4), (10, 5), (10, 10)):
        m = ModelConfig(layers=layers, moe_experts=4, moe_layers=spec)
        plan = types.SimpleNamespace(model=m)
        assert [_sparse_in(plan, s, per) for s in range(layers // per)] == \
            [sum(map(m.is_sparse, range(s * per, (s + 1) * per))) for s in range(layers // per)]
    huge = types.SimpleNamespace(model=ModelConfig(layers=10 ** 8, moe_experts=4, moe_layers=spec))
    start = time.perf_counter()
    _sparse_in(huge, 1, 10 ** 8 // 2)
    assert time.perf_counter() - start < 0.1
