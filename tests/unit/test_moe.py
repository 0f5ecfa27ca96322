"""Mixture of experts on one process: the sparse FFN against a per-token loop, the balance loss
against DeepSeek-V3's formula, the whole stage's gradient (cross-entropy + balance loss) against
float64 finite differences, and the recompute modes against each other."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mpipar.config import ConfigError, ModelConfig
from mpipar.kernels import get_backend
from mpipar.layout import resolve_model
from mpipar.model.moe import LocalExperts, moe_forward
from mpipar.model.params import ROUTER, expert_names, init_params, param_specs
from tests.unit.test_model import make_stage

MOE = resolve_model(ModelConfig(vocab_size=11, hidden=16, layers=2, heads=4, kv_heads=2,
                                ffn_hidden=24, rope_theta=500.0, init_std=0.3, moe_experts=4,
                                moe_top_k=2, moe_ffn_hidden=8, moe_aux_loss_coef=0.1))
HALF = dataclasses.replace(MOE, moe_layers="1")   # block 0 dense, block 1 sparse


def route_token(p: dict, i: int, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Block ``i``'s router on one token ``x [H]``: (softmax probabilities ``[E]``, the ``k``
    experts chosen, highest first, ties to the lower index)."""
    z = p[f"layers.{i}." + ROUTER] @ x
    pr = np.exp(z - z.max())
    pr /= pr.sum()
    return pr, np.argsort(-pr, kind="stable")[:k]


def expert_ffn(p: dict, i: int, e: int, x: np.ndarray) -> np.ndarray:
    """Expert ``e`` of block ``i`` on one token: ``w2 (silu(w1 x) * w3 x)`` ``[H]``."""
    w1, w3, w2 = (p[n] for n in expert_names(i, e))
    g, u = w1 @ x, w3 @ x
    return w2 @ (g / (1 + np.exp(-g)) * u)


def naive_moe(p: dict, i: int, h: np.ndarray, c: ModelConfig) -> tuple[np.ndarray, float]:
    """Block ``i``'s sparse FFN token by token, and the rows' balance losses summed."""
    B, S, H = h.shape
    E, K = c.moe_experts, c.moe_top_k
    out = np.zeros_like(h)
    aux = 0.0
    for b in range(B):
        load, psum = np.zeros(E), np.zeros(E)
        for t in range(S):
            x = h[b, t]
            pr, top = route_token(p, i, x, K)
            for e in top:
                weight = pr[e] / pr[top].sum() if c.moe_norm_topk else pr[e]
                out[b, t] += weight * expert_ffn(p, i, e, x)
                load[e] += 1
            psum += pr
        aux += float((E / (K * S) * load * psum / S).sum())
    return out, aux


def test_sparse_ffn_matches_a_token_loop():
    k = get_backend("numpy")
    p = init_params(MOE, 3, np.float64)
    h = np.random.default_rng(1).normal(size=(2, 5, MOE.hidden))
    out, saved = moe_forward(k, p, 1, MOE, h, LocalExperts(MOE.moe_experts))
    ref, aux = naive_moe(p, 1, h, MOE)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    assert saved.aux == pytest.approx(aux, rel=1e-13)
    assert int(saved.counts.sum()) == 2 * 5 * MOE.moe_top_k


def objective(stage, p: dict, tokens, targets, alpha: float) -> float:
    """Mean token cross-entropy + alpha * mean over rows of the balance losses summed over
    layers (the optimised objective)."""
    stage.moe_aux = 0.0
    loss, _ = stage.forward(p, tokens, np.arange(tokens.shape[1]), targets)
    return float(loss.sum()) / loss.size + alpha / tokens.shape[0] * stage.moe_aux


def assert_matches_differences(stage, p: dict, grads: dict, tokens, targets, alpha: float,
                               specs, rng, per: int = 4) -> list[str]:
    """Each of ``per`` random elements of every parameter of ``specs``: its gradient in
    ``grads`` equals the central difference of :func:`objective` (eps 1e-6, float64); the names
    of the elements checked, one entry each."""
    eps, checked = 1e-6, []
    for spec in specs:
        flat = p[spec.name].reshape(-1)
        for j in rng.choice(flat.size, size=min(per, flat.size), replace=False):
            old = flat[j]
            flat[j] = old + eps
            up = objective(stage, p, tokens, targets, alpha)
            flat[j] = old - eps
            down = objective(stage, p, tokens, targets, alpha)
            flat[j] = old
            fd = (up - down) / (2 * eps)
            assert grads[spec.name].reshape(-1)[j] == pytest.approx(fd, rel=1e-5, abs=1e-9), \
                spec.name
            checked.append(spec.name)
    return checked


def assert_gradient_matches_differences(cfg: ModelConfig, seq: int = 6,
                                        per: int = 4) -> tuple[dict, list[str]]:
    """One forward and backward of a stage of ``cfg`` (float64, 2 rows of ``seq`` random
    tokens) through cross-entropy + the balance loss, its gradient checked against central
    differences by :func:`assert_matches_differences`: (the first forward's dropped counts per
    sparse block, the names of the elements checked)."""
    stage = make_stage(cfg=cfg)
    rng = np.random.default_rng(0)
    p = init_params(cfg, 5, np.float64)
    tokens, targets = rng.integers(0, 11, (2, seq)), rng.integers(0, 11, (2, seq))
    alpha = cfg.moe_aux_loss_coef
    grads = {n: np.zeros_like(v) for n, v in p.items()}
    stage.moe_aux = 0.0
    loss, cache = stage.forward(p, tokens, np.arange(seq), targets)
    dropped = dict(stage.moe_dropped)
    stage.moe_aux_weight = alpha / 2
    stage.backward(p, grads, np.full(loss.shape, 1.0 / loss.size), cache)
    return dropped, assert_matches_differences(stage, p, grads, tokens, targets, alpha,
                                               param_specs(cfg), rng, per)


@pytest.mark.parametrize("cfg", [MOE, HALF], ids=["all-sparse", "one-sparse"])
def test_gradient_matches_finite_differences(cfg):
    assert_gradient_matches_differences(cfg)


def test_balance_loss_gradient_alone():
    """With the cross-entropy's weight 0, the router's gradient is the balance loss's alone
    (finite differences of alpha * mean_rows sum_layers sum_e f P)."""
    stage = make_stage(cfg=MOE)
    p = init_params(MOE, 7, np.float64)
    tokens = np.random.default_rng(2).integers(0, 11, (2, 6))
    grads = {n: np.zeros_like(v) for n, v in p.items()}
    loss, cache = stage.forward(p, tokens, np.arange(6), tokens)
    stage.moe_aux_weight = 1.0 / 2
    stage.backward(p, grads, np.zeros(loss.shape), cache)
    name = "layers.0." + ROUTER
    eps, g = 1e-6, np.zeros_like(p[name])
    for j in range(p[name].size):
        for sign in (1, -1):
            p[name].reshape(-1)[j] += sign * eps
            stage.moe_aux = 0.0
            stage.forward(p, tokens, np.arange(6), tokens)
            g.reshape(-1)[j] += sign * stage.moe_aux / 2 / (2 * eps)
            p[name].reshape(-1)[j] -= sign * eps
    np.testing.assert_allclose(grads[name], g, rtol=1e-6, atol=1e-10)
    assert np.abs(g).max() > 1e-4   # the balance loss does move the router


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_is_bit_identical(mode):
    p = init_params(MOE, 5, np.float64)
    tokens = np.random.default_rng(3).integers(0, 11, (2, 6))
    out = []
    for m in ("none", mode):
        stage = make_stage(cfg=MOE, recompute=m)
        stage.moe_aux_weight = 0.05
        grads = {n: np.zeros_like(v) for n, v in p.items()}
        loss, cache = stage.forward(p, tokens, np.arange(6), tokens)
        stage.backward(p, grads, np.full(loss.shape, 1 / loss.size), cache)
        out.append((stage.moe_aux, grads))
    assert out[0][0] == out[1][0]
    for n in p:
        np.testing.assert_array_equal(out[0][1][n], out[1][1][n])


@pytest.mark.parametrize("change, words", [
    (dict(moe_top_k=5), "moe_top_k=5"),
    (dict(moe_experts=-1), "moe_experts=-1"),
    (dict(moe_layers="7"), "moe_layers='7'"),
    (dict(moe_aux_loss_coef=-1.0), "moe_aux_loss_coef=-1.0"),
])
def test_bad_moe_fields_are_config_errors(change, words):
    from mpipar.config import Config, check_fields
    m = dataclasses.replace(MOE, **change)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_fields(Config(model=m), resolve_model(m))


@pytest.mark.parametrize("model, parallel, words", [
    (dict(moe_experts=4), dict(ep=3, dp=6), "parallel.ep=3: must divide model.moe_experts=4"),
    (dict(moe_experts=4), dict(ep=4, dp=2), r"parallel.ep=4: must divide dp x sp = 2 x 1"),
    (dict(), dict(ep=2, dp=2), r"parallel.ep=2: needs a mixture of experts"),
    (dict(moe_experts=4), dict(ep=0), r"parallel.ep=0: must be >= 1"),
    (dict(moe_experts=4), dict(tp=2, dp=1, tp_sequence_parallel=True), "tp_sequence_parallel"),
    (dict(moe_experts=2, moe_top_k=3), dict(), "moe_top_k=3"),
])
def test_bad_layouts_are_config_errors(model, parallel, words):
    """Each rule raises one ConfigError naming the value (the programs exit 2 on it)."""
    from mpipar.config import Config, ParallelConfig, TrainConfig
    from mpipar.rules import validate
    cfg = Config(ModelConfig(hidden=16, heads=2, kv_heads=2, layers=2, **model),
                 ParallelConfig(**parallel), TrainConfig(global_batch_size=12, seq_len=8))
    world = parallel.get("dp", 1) * parallel.get("tp", 1)
    with pytest.raises(ConfigError, match=words):
        validate(cfg, world)


def test_model_flops_count_the_router_and_k_experts():
    """A sparse block's FFN: 2HE (router) + K x 6HF_moe per token forward, in place of the dense
    6HF; the step's FLOPs are 3 x forward over the global batch's tokens."""
    from mpipar.config import Config, TrainConfig
    from mpipar.model.flops import model_flops_per_step
    train = TrainConfig(seq_len=8, global_batch_size=2)
    dense, half = (model_flops_per_step(Config(model=dataclasses.replace(m, moe_experts=e),
                                               train=train))
                   for m, e in ((MOE, 0), (HALF, 4)))
    H = MOE.hidden
    extra = 2 * H * 4 + 6 * H * (2 * 8 - 24)     # one sparse block (block 1)
    assert half - dense == pytest.approx(3 * extra * 16)


def test_bf16_routes_in_float32_and_rounds_the_output_once():
    """Under bf16 compute the router's softmax, the top-K weights and the combine's weighted sum
    are float32 (as Mixtral's router; CuPy cannot sort bf16): the output, rounded to bf16 once,
    is within a few bf16 units of the float64 layer on the same bf16-rounded inputs, and the
    routing picks the same experts."""
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    k = get_backend("numpy")
    p64 = {n: a.astype(bf16).astype(np.float64) for n, a in init_params(MOE, 3, np.float64).items()}
    h64 = np.random.default_rng(1).normal(size=(2, 5, MOE.hidden)).astype(bf16).astype(np.float64)
    out, saved = moe_forward(k, {n: a.astype(bf16) for n, a in p64.items()}, 1, MOE,
                             h64.astype(bf16), LocalExperts(MOE.moe_experts))
    ref, saved64 = moe_forward(k, p64, 1, MOE, h64, LocalExperts(MOE.moe_experts))
    assert out.dtype == bf16 and saved.probs.dtype == saved.weights.dtype == np.float32
    assert np.array_equal(saved.experts, saved64.experts)
    err = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err < 4 * 2.0 ** -8, err


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_planner_divides_expert_state_by_ep(zero):
    """The memory planner: under --ep 8 (dp 8: an ``ep_dp`` of one rank) a rank holds 1/8 of
    the experts at every ZeRO stage, so its whole weights (ZeRO-0/1/2), gradients (ZeRO-0/1)
    and moments (ZeRO-0) shrink by 7/8 of the experts' bytes; what ZeRO already held as 1/8 of
    every expert under ep 1 (ZeRO-1's moments, ZeRO-2's gradients and moments, ZeRO-3's
    slices) stays the same, 1/(dp x sp / ep) of 1/8; ZeRO-3's gathered units shrink, each
    block's experts' unit 1/8 of the experts."""
    from mpipar.config import Config, ParallelConfig, TrainConfig
    from mpipar.plan.memory import predict_memory
    from mpipar.rules import validate
    from mpipar.runtime.topology import Coord

    model = ModelConfig(moe_experts=8, moe_top_k=2)

    def state(ep: int, stage: int = zero):
        cfg = validate(Config(model, ParallelConfig(dp=8, ep=ep, zero=stage),
                              TrainConfig(dtype="float32")), 8)
        mem = predict_memory(cfg, Coord(0, 0, 0, 0))
        return mem.weights, mem.grads, mem.optimizer, cfg.model, mem.buffers

    one, eight = state(1), state(8)
    m = one[3]
    experts = 4 * 3 * m.moe_ffn_hidden * m.hidden * m.moe_experts * m.layers   # float32 bytes
    assert one[0] - eight[0] == (experts * 7 // 8 if zero < 3 else 0)
    assert one[1] - eight[1] == (experts * 7 // 8 if zero < 2 else 0)
    assert one[2] - eight[2] == (0 if zero else 2 * experts * 7 // 8)
    if zero == 3:
        assert eight[4] < one[4]


def test_expert_units_split_each_block_into_dense_and_its_experts():
    """ZeRO-2/3 under --ep 2 (4 experts, 2 blocks, pp 1): every unit keeps its dense weights
    (the router and norms included) and loses its experts; each block's unit of experts holds
    exactly the ep position's 2 experts (three weights each), under the block's name; ep 1
    changes nothing."""
    from mpipar.parallel.experts.split import expert_units
    from mpipar.parallel.placement import PlacementTable, expert_of
    model = dataclasses.replace(MOE, moe_experts=4, moe_top_k=2)
    chunks = PlacementTable(model=model).units(0)
    assert expert_units(chunks, PlacementTable(model=model), 0) == (chunks, [[]])
    dense, experts = expert_units(chunks, PlacementTable(model=model, ep=2), 1)
    assert [u for u, _ in dense[0]] == [u for u, _ in chunks[0]]
    for (u, names), (_, whole) in zip(dense[0], chunks[0]):
        assert names == [n for n in whole if expert_of(n) is None]
    sparse = [f"layers.{i}" for i in range(model.layers) if model.is_sparse(i)]
    assert [u for u, _ in experts[0]] == sparse
    for u, names in experts[0]:
        assert sorted({expert_of(n) for n in names}) == [2, 3] and len(names) == 6
        assert all(n.startswith(u + ".") for n in names)
