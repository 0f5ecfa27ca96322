"""AdamW against an element-by-element float64 reference, clipping, norms and LR schedules."""
import copy
import math

import numpy as np
import pytest

from mpipar.training.optim import (IDLE, AdamW, AdamWConfig, LRSchedule, adamw_catch_up, adamw_update,
                          clip_coefficient, grad_norm_sq)


def reference_adamw(p, grads, lr, beta1, beta2, eps, wd):
    """Element-by-element AdamW in Python floats; `grads` is the list of gradients per step.
    Returns the parameter values after every step (flat lists)."""
    p = [float(x) for x in np.ravel(p)]
    m = [0.0] * len(p)
    v = [0.0] * len(p)
    history = []
    for t, g in enumerate(grads, start=1):
        g = [float(x) for x in np.ravel(g)]
        for i in range(len(p)):
            m[i] = beta1 * m[i] + (1 - beta1) * g[i]
            v[i] = beta2 * v[i] + (1 - beta2) * g[i] ** 2
            m_hat = m[i] / (1 - beta1 ** t)
            v_hat = v[i] / (1 - beta2 ** t)
            p[i] = p[i] - lr * wd * p[i] - lr * m_hat / (math.sqrt(v_hat) + eps)
        history.append(list(p))
    return history


@pytest.mark.parametrize("shape", [(3, 4), (5,), (2, 1, 3)])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_update_matches_reference_float64(shape, wd):
    rng = np.random.default_rng(0)
    p = rng.standard_normal(shape)
    grads = [rng.standard_normal(shape) for _ in range(5)]
    expected = reference_adamw(p, grads, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, wd=wd)
    m, v = np.zeros(shape), np.zeros(shape)
    for t, g in enumerate(grads, start=1):
        adamw_update(p, g, m, v, t, 1e-2, 0.9, 0.95, 1e-8, wd)
        np.testing.assert_allclose(p.ravel(), expected[t - 1], rtol=1e-12, atol=1e-14)


def test_adamw_update_float32_keeps_dtype_and_tracks_reference():
    rng = np.random.default_rng(1)
    p64 = rng.standard_normal((4, 3))
    grads = [rng.standard_normal((4, 3)) for _ in range(4)]
    expected = reference_adamw(p64, grads, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, wd=0.1)
    p = p64.astype(np.float32)
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        adamw_update(p, g.astype(np.float32), m, v, t, 1e-3, 0.9, 0.95, 1e-8, 0.1)
    assert p.dtype == m.dtype == v.dtype == np.float32
    np.testing.assert_allclose(p.ravel(), expected[-1], rtol=1e-5, atol=1e-6)


def test_first_step_is_lr_times_sign():
    """At step 1 the bias corrections cancel: p1 = p0 - lr * g / (|g| + eps) exactly."""
    g = np.array([3.0, -0.5, 1e-3, -20.0])
    p0 = np.array([1.0, 2.0, -1.0, 0.5])
    p = p0.copy()
    adamw_update(p, g, np.zeros(4), np.zeros(4), 1, 0.01, 0.9, 0.95, 1e-8, 0.0)
    np.testing.assert_allclose(p, p0 - 0.01 * g / (np.abs(g) + 1e-8), rtol=1e-13)
    np.testing.assert_allclose(p, p0 - 0.01 * np.sign(g), rtol=1e-7)


def test_update_on_flat_buffer_views_equals_separate_arrays():
    rng = np.random.default_rng(2)
    flat = rng.standard_normal(10)
    g = rng.standard_normal(10)
    m, v = np.zeros(10), np.zeros(10)
    whole = flat.copy()
    mw, vw = np.zeros(10), np.zeros(10)
    for t in (1, 2, 3):
        for lo, hi in ((0, 4), (4, 10)):
            adamw_update(flat[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], t, 0.1, 0.9, 0.95, 1e-8, 0.1)
        adamw_update(whole, g, mw, vw, t, 0.1, 0.9, 0.95, 1e-8, 0.1)
    np.testing.assert_array_equal(flat, whole)
    np.testing.assert_array_equal(m, mw)


def test_adamw_update_rejects_bad_input():
    a = np.zeros(3)
    with pytest.raises(ValueError, match=r"step must be >= 1.*got 0"):
        adamw_update(a, a.copy(), a.copy(), a.copy(), 0, 0.1, 0.9, 0.95, 1e-8, 0.0)
    with pytest.raises(ValueError, match=r"g \(4,\)"):
        adamw_update(a, np.zeros(4), a.copy(), a.copy(), 1, 0.1, 0.9, 0.95, 1e-8, 0.0)


def test_default_decay_mask_skips_1d_params():
    """With zero gradients the Adam term is 0 / (0 + eps) = 0, so only decay moves params."""
    params = {"w": np.full((2, 3), 2.0), "gain": np.full(3, 2.0)}
    grads = {name: np.zeros_like(p) for name, p in params.items()}
    opt = AdamW(params, grads, AdamWConfig(lr=0.1, weight_decay=0.5))
    assert opt.decay == {"w": True, "gain": False}
    opt.step(lr=0.1)
    opt.step(lr=0.1)
    np.testing.assert_array_equal(params["w"], 2.0 * (1 - 0.1 * 0.5) ** 2)
    np.testing.assert_array_equal(params["gain"], 2.0)
    assert opt.step_count == 2


def test_explicit_decay_mask_overrides_shapes():
    """A shard of a 2-D weight may be 1-D locally: the caller's mask wins."""
    params = {"shard": np.full(4, 1.0), "bias": np.full((2, 2), 1.0)}
    grads = {n: np.zeros_like(p) for n, p in params.items()}
    opt = AdamW(params, grads, AdamWConfig(lr=0.2, weight_decay=0.25),
                decay={"shard": True, "bias": False})
    opt.step(lr=0.2)
    np.testing.assert_array_equal(params["shard"], 1.0 - 0.2 * 0.25)
    np.testing.assert_array_equal(params["bias"], 1.0)
    with pytest.raises(ValueError, match=r"missing \['bias'\]"):
        AdamW(params, grads, AdamWConfig(lr=0.1), decay={"shard": True})


def test_adamw_class_matches_reference_and_uses_given_lr():
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((2, 2)), "b": rng.standard_normal(3)}
    start = copy.deepcopy(params)
    grads = [{"w": rng.standard_normal((2, 2)), "b": rng.standard_normal(3)} for _ in range(3)]
    live = {n: np.zeros_like(p) for n, p in params.items()}
    opt = AdamW(params, live, AdamWConfig(lr=123.0, beta1=0.8, beta2=0.99, eps=1e-6,
                                          weight_decay=0.2))
    for g in grads:
        for n in live:
            live[n][...] = g[n]
        opt.step(lr=0.05)
    for name, wd in (("w", 0.2), ("b", 0.0)):
        expected = reference_adamw(start[name], [g[name] for g in grads], 0.05, 0.8, 0.99, 1e-6, wd)
        np.testing.assert_allclose(params[name].ravel(), expected[-1], rtol=1e-12)


def _moments(opt: AdamW) -> dict[tuple[str, str], np.ndarray]:
    """The optimizer's state() as whole local tensors (copies)."""
    out = {}
    for kind, name, lo, hi, values in opt.state():
        assert (lo, hi) == (0, opt.m[name].size)
        out[(kind, name)] = values.reshape(opt.m[name].shape).copy()
    return out


def test_state_round_trip_continues_identically():
    rng = np.random.default_rng(4)
    shapes = {"w": (3, 2), "b": (2,)}
    grads = [{n: rng.standard_normal(s) for n, s in shapes.items()} for _ in range(6)]
    lrs = [0.01, 0.02, 0.03, 0.02, 0.01, 0.005]
    init = {n: rng.standard_normal(s) for n, s in shapes.items()}

    def run(opt, live, steps):
        for k in steps:
            for n in live:
                live[n][...] = grads[k][n]
            opt.step(lrs[k])

    params = copy.deepcopy(init)
    live = {n: np.zeros(s) for n, s in shapes.items()}
    opt = AdamW(params, live, AdamWConfig(lr=0.03))
    run(opt, live, range(3))
    saved_params, saved_state, saved_step = copy.deepcopy(params), _moments(opt), opt.step_count
    run(opt, live, range(3, 6))

    resumed = copy.deepcopy(saved_params)
    live2 = {n: np.zeros(s) for n, s in shapes.items()}
    opt2 = AdamW(resumed, live2, AdamWConfig(lr=0.03))
    opt2.load_state(lambda kind, name: saved_state[(kind, name)], saved_step)
    assert opt2.step_count == 3
    run(opt2, live2, range(3, 6))
    for name in shapes:
        np.testing.assert_array_equal(resumed[name], params[name])
        np.testing.assert_array_equal(opt2.m[name], opt.m[name])
        np.testing.assert_array_equal(opt2.v[name], opt.v[name])


def test_load_state_keeps_dtype():
    params = {"w": np.zeros((2, 2), np.float32)}
    opt = AdamW(params, {"w": np.zeros((2, 2), np.float32)}, AdamWConfig(lr=0.1))
    state = {"exp_avg": np.full((2, 2), 0.5), "exp_avg_sq": np.full((2, 2), 2.0)}
    opt.load_state(lambda kind, name: state[kind], 7)
    assert opt.m["w"].dtype == np.float32 and opt.step_count == 7
    np.testing.assert_array_equal(opt.v["w"], 2.0)


@pytest.mark.parametrize("state, step, pattern", [
    ({"exp_avg": np.zeros((2, 2)), "exp_avg_sq": np.zeros((2, 2))}, -1,
     r"optimizer step=-1: must be an integer >= 0"),
    ({"exp_avg": np.zeros((2, 3)), "exp_avg_sq": np.zeros((2, 2))}, 1,
     r"exp_avg of w has shape \(2, 3\), the parameter \(2, 2\)"),
])
def test_load_state_errors(state, step, pattern):
    opt = AdamW({"w": np.zeros((2, 2))}, {"w": np.zeros((2, 2))}, AdamWConfig(lr=0.1))
    with pytest.raises(ValueError, match=pattern):
        opt.load_state(lambda kind, name: state[kind], step)


def test_replicas_report_state_once():
    """The moments are replicated over dp x sp like the parameters: only replica 0 reports."""
    from mpi4py import MPI
    from mpipar.runtime.comm import Group, Ledger

    opt = AdamW({"w": np.zeros(3)}, {"w": np.zeros(3)}, AdamWConfig(lr=0.1),
                replica=Group(MPI.COMM_SELF, "dp_sp", Ledger()))
    assert [p[:4] for p in opt.state()] == [("exp_avg", "w", 0, 3), ("exp_avg_sq", "w", 0, 3)]


@pytest.mark.parametrize("kwargs, pattern", [
    ({"lr": -1.0}, r"lr=-1.0: must be >= 0"),
    ({"lr": 0.1, "beta1": 1.0}, r"beta1=1.0: must be in \[0, 1\)"),
    ({"lr": 0.1, "beta2": -0.1}, r"beta2=-0.1: must be in \[0, 1\)"),
    ({"lr": 0.1, "eps": 0.0}, r"eps=0.0: must be > 0"),
    ({"lr": 0.1, "weight_decay": -0.5}, r"weight_decay=-0.5: must be >= 0"),
])
def test_adamw_config_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        AdamWConfig(**kwargs)


def test_grad_norm_sq_with_include():
    grads = {"a": np.array([3.0, 4.0]), "b": np.array([[1.0, 2.0], [2.0, 0.0]]), "c": np.array([10.0])}
    assert grad_norm_sq(grads) == 25.0 + 9.0 + 100.0
    assert grad_norm_sq(grads, include=lambda n: n != "c") == 34.0
    assert grad_norm_sq(grads, include=lambda n: False) == 0.0


def test_grad_norm_sq_accumulates_float32_in_float64():
    rng = np.random.default_rng(5)
    g = rng.standard_normal(100_000).astype(np.float32) * 3
    exact = math.fsum(float(x) ** 2 for x in g)
    got = grad_norm_sq({"g": g})
    assert isinstance(got, float)
    assert abs(got - exact) / exact < 1e-12


def test_clip_coefficient_below_the_norm_is_one():
    assert clip_coefficient(max_norm=1.0, total_norm=0.5) == 1.0


def test_clip_coefficient_above_the_norm_scales_to_max_norm():
    g = {"a": np.array([3.0, 4.0]), "b": np.array([[12.0]])}
    total = math.sqrt(grad_norm_sq(g))
    assert total == 13.0
    coef = clip_coefficient(max_norm=1.0, total_norm=total)
    assert coef == 1.0 / (13.0 + 1e-6)
    scaled = {k: a * coef for k, a in g.items()}
    np.testing.assert_allclose(math.sqrt(grad_norm_sq(scaled)), 13.0 / (13.0 + 1e-6), rtol=1e-14)


@pytest.mark.parametrize("max_norm", [0.0, -1.0])
def test_clip_off(max_norm):
    assert clip_coefficient(max_norm=max_norm, total_norm=500.0) == 1.0


@pytest.mark.parametrize("total", [float("nan"), float("inf"), -1.0])
def test_clip_rejects_non_finite_norm(total):
    with pytest.raises(ValueError, match="total_norm must be finite and >= 0"):
        clip_coefficient(max_norm=1.0, total_norm=total)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("catch_up", [False, True])
def test_clip_folded_into_the_step_equals_scaling_the_gradients_first(dtype, catch_up):
    """AdamW.clip + step (the coefficient applied as the update reads each gradient) gives the
    same bits as scaling the gradients in place and stepping unclipped, and leaves the
    gradient buffers as they were; the next step is unclipped again."""
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((5, 7)).astype(dtype), "b": rng.standard_normal(7).astype(dtype)}
    grads = {k: rng.standard_normal(p.shape).astype(dtype) * 10 for k, p in params.items()}
    if catch_up:
        grads["w"][1] = 0      # coordinates no rank sent
    kept = {k: g.copy() for k, g in grads.items()}
    cfg = AdamWConfig(lr=1e-2, weight_decay=0.1)
    sparse = (lambda: True) if catch_up else None
    folded = AdamW(copy.deepcopy(params), grads, cfg, catch_up=sparse)
    first = AdamW(copy.deepcopy(params), {k: g.copy() for k, g in grads.items()}, cfg,
                  catch_up=sparse)
    total = math.sqrt(grad_norm_sq(grads))
    coef = folded.clip(1.0, total)
    assert coef == clip_coefficient(1.0, total) < 0.5
    folded.step(1e-2)
    for g in first.grads.values():
        g *= coef
    first.step(1e-2)
    for k in params:
        assert np.array_equal(folded.params[k], first.params[k]), k
        assert np.array_equal(folded.m[k], first.m[k]) and np.array_equal(folded.v[k], first.v[k])
        assert np.array_equal(grads[k], kept[k])            # the buffers were not scaled
        assert not np.array_equal(folded.params[k], params[k])
    assert folded.grad_scale == 1.0
    folded.step(1e-2)                                       # unclipped: the coefficient is spent
    for g, k in ((first.grads[k], k) for k in params):
        g[...] = kept[k]
    first.step(1e-2)
    for k in params:
        assert np.array_equal(folded.params[k], first.params[k]), k


def test_cosine_schedule_values():
    lr, min_lr = 6e-4, 6e-5
    s = LRSchedule("cosine", lr=lr, min_lr=min_lr, warmup_steps=10, total_steps=110)
    assert s(0) == pytest.approx(lr / 10, rel=1e-15)
    assert s(4) == pytest.approx(lr * 5 / 10, rel=1e-15)
    assert s(9) == pytest.approx(lr, rel=1e-15)          # last warm-up step reaches the peak
    assert s(10) == pytest.approx(lr, rel=1e-15)         # progress 0
    assert s(60) == pytest.approx((lr + min_lr) / 2, rel=1e-14)   # progress 1/2
    assert s(35) == pytest.approx(min_lr + 0.5 * (lr - min_lr) * (1 + math.sqrt(0.5)), rel=1e-14)
    assert s(110) == pytest.approx(min_lr, rel=1e-14)
    assert s(1000) == pytest.approx(min_lr, rel=1e-14)


def test_cosine_without_warmup_and_constant_schedule():
    s = LRSchedule("cosine", lr=1.0, min_lr=0.0, total_steps=4)
    assert [s(k) for k in range(5)] == pytest.approx([1.0, (1 + math.sqrt(0.5)) / 2, 0.5,
                                                      (1 - math.sqrt(0.5)) / 2, 0.0], abs=1e-15)
    c = LRSchedule("constant", lr=0.3, warmup_steps=4)
    assert [c(k) for k in (0, 1, 3, 4, 100)] == pytest.approx([0.075, 0.15, 0.3, 0.3, 0.3], rel=1e-15)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"kind": "linear", "lr": 1.0}, r"kind='linear': must be 'constant' or 'cosine'"),
    ({"kind": "cosine", "lr": -1.0}, r"lr=-1.0: must be >= 0"),
    ({"kind": "cosine", "lr": 1.0, "min_lr": 2.0}, r"min_lr=2.0: must be in \[0, lr=1.0\]"),
    ({"kind": "cosine", "lr": 1.0, "min_lr": -0.1}, r"min_lr=-0.1: must be in"),
    ({"kind": "cosine", "lr": 1.0, "warmup_steps": -2}, r"warmup_steps=-2: must be >= 0"),
    ({"kind": "cosine", "lr": 1.0, "total_steps": 0}, r"total_steps=0: must be >= 1"),
])
def test_schedule_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        LRSchedule(**kwargs)


# --------------------------------------------------------------- top-k catch-up (adamw_catch_up)

def test_catch_up_with_every_coordinate_sent_is_adamw():
    rng = np.random.default_rng(5)
    p, g, m = rng.normal(size=(3, 4, 5))
    v = rng.random((4, 5))
    a = [p.copy(), m.copy(), v.copy()]
    b = [p.copy(), m.copy(), v.copy()]
    idle = np.zeros((4, 5))
    adamw_update(a[0], g, a[1], a[2], 7, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    adamw_catch_up(b[0], g, b[1], b[2], idle, 7, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    for x, y in zip(a, b):
        np.testing.assert_allclose(y, x, rtol=1e-14, atol=0)
    assert not idle.any()


@pytest.mark.parametrize("d", [1, 2, 7, 40])
def test_a_sum_of_d_steps_moves_like_d_steps_of_its_mean(d):
    """A coordinate held back d - 1 steps, then sent with the sum d * c of d equal gradients c:
    its moments equal AdamW's after d steps of c, and it moves d times the step those moments
    give; while it waits it does not move (weight decay aside) and counts the steps."""
    lr, b1, b2, eps, wd, step = 1e-2, 0.9, 0.95, 1e-8, 0.1, 50
    c = np.array([0.3, -2.0])
    p0, m0, v0 = np.array([1.0, -0.5]), np.array([0.05, 0.1]), np.array([0.02, 0.3])
    p, m, v, idle = p0.copy(), m0.copy(), v0.copy(), np.zeros(2)
    for _ in range(d - 1):                       # held back: zeros arrive
        adamw_catch_up(p, np.zeros(2), m, v, idle, step, lr, b1, b2, eps, wd)
    np.testing.assert_array_equal(idle, [d - 1, d - 1])
    np.testing.assert_array_equal((m, v), (m0, v0))
    np.testing.assert_allclose(p, p0 * (1 - lr * wd) ** (d - 1), rtol=1e-15)
    before = p.copy()
    adamw_catch_up(p, d * c, m, v, idle, step, lr, b1, b2, eps, wd)
    mm, vv = m0.copy(), v0.copy()
    for _ in range(d):                           # AdamW's moment recurrences, d steps of c
        mm, vv = b1 * mm + (1 - b1) * c, b2 * vv + (1 - b2) * c * c
    np.testing.assert_allclose(m, mm, rtol=1e-13)
    np.testing.assert_allclose(v, vv, rtol=1e-13)
    move = d * lr / (1 - b1 ** step) * mm / (np.sqrt(vv) / math.sqrt(1 - b2 ** step) + eps)
    np.testing.assert_allclose(before * (1 - lr * wd) - p, move, rtol=1e-12)
    np.testing.assert_array_equal(idle, [0, 0])


def test_catch_up_counts_each_coordinate_apart():
    p, m, v, idle = np.ones(4), np.zeros(4), np.zeros(4), np.array([0.0, 3.0, 5.0, 0.0])
    g = np.array([1.0, 0.0, 2.0, 0.0])
    adamw_catch_up(p, g, m, v, idle, 1, 0.1, 0.9, 0.95, 1e-8, 0.0)
    np.testing.assert_array_equal(idle, [0, 4, 0, 1])
    assert p[1] == p[3] == 1.0 and m[1] == m[3] == v[1] == v[3] == 0.0
    # the third waited 6 steps: gradient 2 / 6 a step, moments six steps from zero
    np.testing.assert_allclose(m[2], (1 - 0.9 ** 6) * (2 / 6), rtol=1e-15)
    np.testing.assert_allclose(v[2], (1 - 0.95 ** 6) * (2 / 6) ** 2, rtol=1e-15)


def test_adamw_catches_up_only_on_sparse_steps_and_keeps_its_waits_in_state():
    """AdamW with ``catch_up``: the steps it says are sparse use the catch-up, the others
    AdamW; the wait counts are state (kind idle_steps) and load back, zero when absent."""
    params = {"w": np.ones((2, 3)), "b": np.ones(3)}
    grads = {"w": np.zeros((2, 3)), "b": np.ones(3)}
    sparse = [True]
    opt = AdamW(params, grads, AdamWConfig(lr=0.1), catch_up=lambda: sparse[0])
    opt.step(0.1)
    np.testing.assert_array_equal(opt.idle["w"], np.ones((2, 3)))
    np.testing.assert_array_equal(params["w"], np.full((2, 3), 1 - 0.1 * 0.1))  # decay only
    sparse[0] = False
    opt.step(0.1)          # a dense step: zeros are zero gradients, AdamW moves by momentum 0
    np.testing.assert_array_equal(opt.idle["w"], np.ones((2, 3)))
    saved = {(k, n): np.array(x) for k, n, _, _, x in opt.state()}
    assert {k for k, _ in saved} == {"exp_avg", "exp_avg_sq", IDLE}
    fresh = AdamW({k: x.copy() for k, x in params.items()}, grads, AdamWConfig(lr=0.1),
                  catch_up=lambda: True)
    fresh.load_state(lambda k, n: saved[(k, n)].reshape(params[n].shape), 2, {IDLE})
    np.testing.assert_array_equal(fresh.idle["w"], np.ones((2, 3)))
    fresh.load_state(lambda k, n: saved[(k, n)].reshape(params[n].shape), 2, set())
    assert not fresh.idle["w"].any()
    plain = AdamW(params, grads, AdamWConfig(lr=0.1))
    assert IDLE not in {k for k, *_ in plain.state()}
