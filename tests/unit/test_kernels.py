"""Kernels: reference vs finite differences and naive maths, numba vs reference, dispatcher, bench CLI.

No MPI. Shapes are tiny; the numba kernels compile once (cached on disk afterwards).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mpipar import kernels
from mpipar.kernels import numpy_ref as ref
from mpipar.kernels import rope_frequencies as freq

numba_cpu = pytest.importorskip("mpipar.kernels.numba_cpu")

MODULES = {"numpy": ref, "numba": numba_cpu}
TOL = {np.float64: 1e-12, np.float32: 2e-5}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """Normwise relative error max|a - b| / max|b| (0 for two empty or all-zero arrays)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    scale = np.abs(b).max(initial=0.0)
    diff = np.abs(a - b).max(initial=0.0)
    return diff / scale if scale > 0 else diff


def num_grad(f, x: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central finite differences of the scalar f() w.r.t. every entry of x (x is perturbed in place)."""
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        up = f()
        flat[i] = old - h
        down = f()
        flat[i] = old
        gflat[i] = (up - down) / (2 * h)
    return g


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# ----------------------------------------------------------------------------------------------
# finite differences (float64), for the reference and the numba kernels
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_linear_grad(mod, rng):
    x, w = rng.standard_normal((2, 3, 5)), rng.standard_normal((4, 5))
    r = rng.standard_normal((2, 3, 4))
    dx, dw = mod.linear_bwd(r, x, w)
    loss = lambda: float(np.sum(mod.linear_fwd(x, w) * r))  # noqa: E731
    assert rel_err(dx, num_grad(loss, x)) < 1e-6
    assert rel_err(dw, num_grad(loss, w)) < 1e-6
    assert rel_err(mod.linear_fwd(x, w), np.einsum("bsi,oi->bso", x, w)) < 1e-13


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_linear_with_bias_grad(mod, rng):
    x, w, b = rng.standard_normal((2, 3, 5)), rng.standard_normal((4, 5)), rng.standard_normal(4)
    r = rng.standard_normal((2, 3, 4))
    loss = lambda: float(np.sum(mod.linear_fwd(x, w, b) * r))  # noqa: E731
    assert rel_err(kernels.get_backend("numpy").linear_bias_bwd(r), num_grad(loss, b)) < 1e-6
    assert rel_err(mod.linear_fwd(x, w, b), np.einsum("bsi,oi->bso", x, w) + b) < 1e-13
    assert rel_err(mod.linear_bwd(r, x, w)[1], num_grad(loss, w)) < 1e-6  # the bias changes no dw
    with pytest.raises(ValueError, match=r"linear_fwd: b must be \[out\] = \(4,\)"):
        mod.linear_fwd(x, w, b[:3])


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_rmsnorm_grad(mod, rng):
    x, w, r = rng.standard_normal((2, 3, 7)), rng.standard_normal(7), rng.standard_normal((2, 3, 7))
    y, rstd = mod.rmsnorm_fwd(x, w, 1e-5)
    expect = x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + 1e-5) * w
    assert rel_err(y, expect) < 1e-13
    assert rel_err(rstd, 1 / np.sqrt(np.mean(x ** 2, axis=-1) + 1e-5)) < 1e-13
    dx, dw = mod.rmsnorm_bwd(r, x, w, rstd)
    loss = lambda: float(np.sum(mod.rmsnorm_fwd(x, w, 1e-5)[0] * r))  # noqa: E731
    assert rel_err(dx, num_grad(loss, x)) < 1e-6
    assert rel_err(dw, num_grad(loss, w)) < 1e-6


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_add_rmsnorm_is_add_then_rmsnorm(mod, rng):
    """The fused residual add + RMSNorm equals the two ops (float64) and its finite differences."""
    x, r, w = rng.standard_normal((2, 3, 7)), rng.standard_normal((2, 3, 7)), rng.standard_normal(7)
    dy, ds = rng.standard_normal((2, 3, 7)), rng.standard_normal((2, 3, 7))
    s, y, rstd = mod.add_rmsnorm_fwd(x, r, w, 1e-5)
    y_ref, rstd_ref = ref.rmsnorm_fwd(x + r, w, 1e-5)
    assert rel_err(s, x + r) < 1e-15 and rel_err(y, y_ref) < 1e-13 and rel_err(rstd, rstd_ref) < 1e-13
    dsum, dw = mod.add_rmsnorm_bwd(dy, ds, s, w, rstd)
    dx_ref, dw_ref = ref.rmsnorm_bwd(dy, x + r, w, rstd_ref)
    assert rel_err(dsum, dx_ref + ds) < 1e-13 and rel_err(dw, dw_ref) < 1e-13

    def loss() -> float:  # y feeds dy, s (the residual stream) feeds ds
        s_, y_, _ = mod.add_rmsnorm_fwd(x, r, w, 1e-5)
        return float(np.sum(y_ * dy) + np.sum(s_ * ds))

    assert rel_err(dsum, num_grad(loss, x)) < 1e-6 and rel_err(dsum, num_grad(loss, r)) < 1e-6
    assert rel_err(dw, num_grad(loss, w)) < 1e-6


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numba_add_rmsnorm_is_bitwise_add_then_rmsnorm(rng, dtype):
    """The fused Numba norm gives the bits of the add followed by the plain norm (rows long enough
    to vectorise), which recomputing a block's norms from the kept sum relies on."""
    nb = pytest.importorskip("mpipar.kernels.numba_cpu")
    x, r = (rng.standard_normal((3, 5, 520)).astype(dtype) for _ in range(2))
    w = rng.standard_normal(520).astype(dtype)
    s, y, rstd = nb.add_rmsnorm_fwd(x, r, w, 1e-5)
    y_ref, rstd_ref = nb.rmsnorm_fwd(x + r, w, 1e-5)
    assert np.array_equal(s, x + r) and np.array_equal(y, y_ref) and np.array_equal(rstd, rstd_ref)


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_rope_grad(mod, rng):
    x, r = rng.standard_normal((2, 3, 2, 6)), rng.standard_normal((2, 3, 2, 6))
    cos, sin = ref.rope_cos_sin(np.array([5, 6, 7]), 6, 10000.0, np.float64)
    dx = mod.rope_bwd(r, cos, sin)
    loss = lambda: float(np.sum(mod.rope_fwd(x, cos, sin) * r))  # noqa: E731
    assert rel_err(dx, num_grad(loss, x)) < 1e-6


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_swiglu_grad(mod, rng):
    gate, up, r = rng.standard_normal((3, 5)) * 3, rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    dgate, dup = mod.swiglu_bwd(r, gate, up)
    loss = lambda: float(np.sum(mod.swiglu_fwd(gate, up) * r))  # noqa: E731
    assert rel_err(dgate, num_grad(loss, gate)) < 1e-6
    assert rel_err(dup, num_grad(loss, up)) < 1e-6


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_geglu_equals_torch_gelu_tanh_and_its_gradient(mod, rng):
    """GeGLU's forward is torch's ``gelu(approximate="tanh")`` times up (float64), and its
    backward the numerical gradient."""
    torch = pytest.importorskip("torch")
    gate, up, r = rng.standard_normal((3, 5)) * 3, rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    want = torch.nn.functional.gelu(torch.from_numpy(gate), approximate="tanh").numpy() * up
    assert rel_err(mod.geglu_fwd(gate, up), want) < 1e-14
    dgate, dup = mod.geglu_bwd(r, gate, up)
    loss = lambda: float(np.sum(mod.geglu_fwd(gate, up) * r))  # noqa: E731
    assert rel_err(dgate, num_grad(loss, gate)) < 1e-6
    assert rel_err(dup, num_grad(loss, up)) < 1e-6


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_swiglu_large_inputs_are_finite(mod):
    gate = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0])
    up = np.full(5, 2.0)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        h = mod.swiglu_fwd(gate, up)
        dgate, dup = mod.swiglu_bwd(np.ones(5), gate, up)
    assert rel_err(h, [0.0, -50 * 2 / (1 + math.exp(50)), 0.0, 2 * 50 / (1 + math.exp(-50)), 2000.0]) < 1e-14
    assert np.all(np.isfinite(dgate)) and np.all(np.isfinite(dup))
    assert rel_err(dgate[[0, 2, 4]], [0.0, 1.0, 2.0]) < 1e-14  # silu'(0) = 1/2, silu'(+-inf) = 1, 0


ATTN_CASES = [  # (q_offset, k_offset, causal)
    (0, 0, True), (4, 1, True), (0, 0, False), (7, 3, False),
    (0, 2, True),  # queries 0 and 1 see no key
]


def attention_inputs(rng, b=1, sq=5, sk=6, hq=4, hkv=2, d=4, dtype=np.float64):
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
@pytest.mark.parametrize("q_offset,k_offset,causal", ATTN_CASES)
def test_attention_grad(mod, rng, q_offset, k_offset, causal):
    q, k, v = attention_inputs(rng)
    r = rng.standard_normal(q.shape)
    kw = dict(q_offset=q_offset, k_offset=k_offset, causal=causal, scale=0.7)
    out, lse = mod.attention_fwd(q, k, v, **kw)
    dq, dk, dv = mod.attention_bwd(q, k, v, out, lse, r, **kw)
    loss = lambda: float(np.sum(mod.attention_fwd(q, k, v, **kw)[0] * r))  # noqa: E731
    for analytic, x in ((dq, q), (dk, k), (dv, v)):
        assert np.all(np.isfinite(analytic))
        assert rel_err(analytic, num_grad(loss, x)) < 1e-6


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_attention_rows_without_keys(mod, rng):
    q, k, v = attention_inputs(rng)
    out, lse = mod.attention_fwd(q, k, v, q_offset=0, k_offset=2)
    blind = slice(0, 2)  # query i sees key j iff 2 + j <= i
    assert np.all(out[:, blind] == 0)
    assert np.all(lse[:, :, blind] == -np.inf)
    assert np.all(np.isfinite(lse[:, :, 2:]))
    dq, dk, dv = mod.attention_bwd(q, k, v, out, lse, np.ones_like(out), q_offset=0, k_offset=2)
    assert np.all(dq[:, blind] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    # keys 3, 4, 5 sit at positions 5, 6, 7, after the last query (position 4): no gradient
    assert np.all(dk[:, 3:] == 0) and np.all(dv[:, 3:] == 0)


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_cross_entropy_grad(mod, rng):
    logits, targets = rng.standard_normal((4, 9)) * 2, np.array([0, 5, 3, 6])
    logits[:, 7:] += 50.0  # padding columns (vocab_size=7 below) must not matter
    dloss = rng.standard_normal(4)
    loss, lse = ref.cross_entropy_fwd(logits, targets, vocab_size=7)
    grad = mod.cross_entropy_bwd(logits, targets, lse, dloss, vocab_size=7)
    f = lambda: float(np.sum(ref.cross_entropy_fwd(logits, targets, vocab_size=7)[0] * dloss))  # noqa: E731
    assert rel_err(grad, num_grad(f, logits)) < 1e-6
    assert np.all(grad[:, 7:] == 0)


# ----------------------------------------------------------------------------------------------
# naive references and composition properties
# ----------------------------------------------------------------------------------------------

def naive_attention(q, k, v, q_offset, k_offset, causal, scale):
    """Loop over batch and heads with an explicit softmax: out, lse."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = np.zeros((b, sq, hq, d))
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(sq):
                vis = [j for j in range(sk) if not causal or k_offset + j <= q_offset + i]
                if not vis:
                    continue
                s = np.array([scale * q[bi, i, h] @ k[bi, j, kh] for j in vis])
                p = np.exp(s - s.max())
                out[bi, i, h] = (p / p.sum()) @ v[bi, vis, kh]
                lse[bi, h, i] = s.max() + math.log(p.sum())
    return out, lse


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
@pytest.mark.parametrize("q_offset,k_offset,causal", ATTN_CASES)
def test_attention_matches_naive(mod, rng, q_offset, k_offset, causal):
    q, k, v = attention_inputs(rng, b=2, sq=6, sk=7, hq=4, hkv=2, d=3)
    out, lse = mod.attention_fwd(q, k, v, q_offset, k_offset, causal)
    n_out, n_lse = naive_attention(q, k, v, q_offset, k_offset, causal, 1 / math.sqrt(3))
    assert rel_err(out, n_out) < 1e-13
    assert np.array_equal(np.isinf(lse), np.isinf(n_lse))
    assert rel_err(lse[np.isfinite(lse)], n_lse[np.isfinite(n_lse)]) < 1e-13


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
@pytest.mark.parametrize("split,q_offset,causal", [(3, 0, True), (5, 0, True), (2, 4, True), (4, 0, False)])
def test_attention_blocks_merge_like_ring(mod, rng, split, q_offset, causal):
    """Keys in two blocks: merged forward equals one call; blockwise backward with the merged
    out/lse, summed, equals the single backward (what ring attention relies on)."""
    q, k, v = attention_inputs(rng, b=2, sq=6, sk=9)
    dout = rng.standard_normal(q.shape)
    kw = dict(q_offset=q_offset, causal=causal)
    out, lse = mod.attention_fwd(q, k, v, k_offset=0, **kw)
    parts = [(0, slice(0, split)), (split, slice(split, None))]
    results = [mod.attention_fwd(q, k[:, s], v[:, s], k_offset=off, **kw) for off, s in parts]
    m_out, m_lse = mod.attention_merge(*results[0], *results[1])
    assert rel_err(m_out, out) < 1e-13
    assert np.array_equal(np.isinf(m_lse), np.isinf(lse))
    assert rel_err(m_lse[np.isfinite(lse)], lse[np.isfinite(lse)]) < 1e-13
    dq, dk, dv = mod.attention_bwd(q, k, v, out, lse, dout, k_offset=0, **kw)
    grads = [mod.attention_bwd(q, k[:, s], v[:, s], m_out, m_lse, dout, k_offset=off, **kw) for off, s in parts]
    assert rel_err(grads[0][0] + grads[1][0], dq) < 1e-12
    assert rel_err(np.concatenate([grads[0][1], grads[1][1]], axis=1), dk) < 1e-12
    assert rel_err(np.concatenate([grads[0][2], grads[1][2]], axis=1), dv) < 1e-12


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_attention_merge_infinities(mod, rng):
    oa, ob = rng.standard_normal((1, 3, 2, 4)), rng.standard_normal((1, 3, 2, 4))
    la, lb = rng.standard_normal((1, 2, 3)), rng.standard_normal((1, 2, 3))
    la[0, :, 0] = lb[0, :, 0] = -np.inf  # both empty
    la[0, :, 1] = -np.inf  # only b
    lb[0, :, 2] = -np.inf  # only a
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out, lse = mod.attention_merge(oa, la, ob, lb)
    assert np.all(out[:, 0] == 0) and np.all(lse[..., 0] == -np.inf)
    assert rel_err(out[:, 1], ob[:, 1]) < 1e-15 and rel_err(lse[..., 1], lb[..., 1]) < 1e-15
    assert rel_err(out[:, 2], oa[:, 2]) < 1e-15 and rel_err(lse[..., 2], la[..., 2]) < 1e-15
    out2, lse2 = mod.attention_merge(oa, np.ones_like(la), ob, np.ones_like(lb))
    assert rel_err(out2, (oa + ob) / 2) < 1e-15 and rel_err(lse2, np.full_like(lse2, 1 + math.log(2))) < 1e-15


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_cross_entropy_vocab_shards(mod, rng):
    """Stats of 3 shards (the last one padded) combine into the unsharded loss; bwd per shard too."""
    n, vocab, vloc = 6, 10, 4
    full = rng.standard_normal((n, 3 * vloc)) * 3
    full[:, vocab:] = 1e4  # padding columns of the last shard
    targets = np.array([0, 3, 4, 7, 9, 8])
    loss, lse = ref.cross_entropy_fwd(full[:, :vocab], targets)
    stats = [mod.cross_entropy_stats(full[:, r * vloc:(r + 1) * vloc], targets, r * vloc, vocab) for r in range(3)]
    m_all = np.max([m for m, _, _ in stats], axis=0)
    s_all = sum(s * np.exp(m - m_all) for m, s, _ in stats)
    t_all = sum(t for _, _, t in stats)
    assert rel_err(m_all + np.log(s_all), lse) < 1e-14
    assert rel_err(m_all + np.log(s_all) - t_all, loss) < 1e-14
    expect = np.log(np.exp(full[:, :vocab]).sum(axis=1)) - full[np.arange(n), targets]
    assert rel_err(loss, expect) < 1e-13
    padded_loss, padded_lse = ref.cross_entropy_fwd(full, targets, vocab_size=vocab)
    assert rel_err(padded_loss, loss) < 1e-15 and rel_err(padded_lse, lse) < 1e-15
    dloss = rng.standard_normal(n)
    grad = mod.cross_entropy_bwd(full[:, :vocab], targets, lse, dloss)
    shards = [mod.cross_entropy_bwd(full[:, r * vloc:(r + 1) * vloc], targets, lse, dloss, r * vloc, vocab)
              for r in range(3)]
    joined = np.concatenate(shards, axis=1)
    assert rel_err(joined[:, :vocab], grad) < 1e-14
    assert np.all(joined[:, vocab:] == 0)


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_cross_entropy_all_padding_shard(mod, rng):
    logits = rng.standard_normal((3, 4))
    m, s, t = mod.cross_entropy_stats(logits, np.array([0, 1, 2]), vocab_start=8, vocab_size=6)
    assert np.all(m == -np.inf) and np.all(s == 0) and np.all(t == 0)
    g = mod.cross_entropy_bwd(logits, np.array([0, 1, 2]), np.zeros(3), np.ones(3), vocab_start=8, vocab_size=6)
    assert np.all(g == 0)


def test_embedding_shards_sum_to_the_table_and_grad_matches_finite_differences(rng):
    """Three vocabulary shards (the last padded) each give their rows and zeros elsewhere; their
    sum is the full lookup. embedding_bwd is the gradient of sum(dx * embedding_fwd(w, ids))."""
    vocab, hid = 7, 4
    full = rng.standard_normal((9, hid))  # 7 ids padded to 3 shards of 3 rows
    ids = rng.integers(0, vocab, (2, 5))
    out = sum(ref.embedding_fwd(full[3 * r:3 * r + 3].copy(), ids, 3 * r) for r in range(3))
    assert np.array_equal(out, full[ids])
    dx = rng.standard_normal((2, 5, hid))
    for r in range(3):
        w = full[3 * r:3 * r + 3].copy()
        want = num_grad(lambda: float(np.sum(dx * ref.embedding_fwd(w, ids, 3 * r))), w)
        got = ref.embedding_bwd(np.zeros_like(w), dx, ids, 3 * r)
        assert rel_err(got, want) <= 1e-9
    with pytest.raises(ValueError, match="embedding_bwd: dx"):
        ref.embedding_bwd(np.zeros((3, hid)), dx[:, :4], ids)


def test_rope_tables_and_relative_positions(rng):
    d, theta = 8, 500.0
    pos = np.array([0, 3, 11])
    cos, sin = ref.rope_cos_sin(pos, d, theta, np.float32)
    assert cos.dtype == np.float32 and cos.shape == (3, 4)
    angle = 11 * theta ** (-2 * 3 / d)
    assert abs(float(cos[2, 3]) - math.cos(angle)) < 1e-7 and abs(float(sin[2, 3]) - math.sin(angle)) < 1e-7
    # <rope(q, m), rope(k, n)> depends only on m - n (HF rotate-half convention)
    q, k = rng.standard_normal((1, 1, 1, d)), rng.standard_normal((1, 1, 1, d))

    def rotated(x, p):
        c, s = ref.rope_cos_sin(np.array([p]), d, theta, np.float64)
        return ref.rope_fwd(x, c, s).ravel()

    assert abs(rotated(q, 9) @ rotated(k, 4) - rotated(q, 105) @ rotated(k, 100)) < 1e-12
    x1, x2 = q[..., :4].ravel(), q[..., 4:].ravel()
    c, s = ref.rope_cos_sin(np.array([9]), d, theta, np.float64)
    assert rel_err(rotated(q, 9), np.concatenate([x1 * c[0] - x2 * s[0], x2 * c[0] + x1 * s[0]])) < 1e-15


def test_rope_scaling_rules():
    """transformers' rules (modeling_rope_utils), checked on their defining properties; the
    float64 comparison with transformers itself is in test_hf.py."""
    d, theta = 16, 10000.0
    base = freq.rope_inv_freq(d, theta)
    assert rel_err(base, theta ** (-np.arange(0, d, 2) / d)) < 1e-15
    # linear: every frequency divided by the factor (positions stretched).
    assert rel_err(freq.rope_inv_freq(d, theta, "linear", 4.0), base / 4) == 0
    # dynamic: plain up to the pretraining context, then theta grows with the sequence length.
    dyn = dict(scaling="dynamic", factor=2.0, original_max_positions=64)
    assert np.array_equal(freq.rope_inv_freq(d, theta, seq_len=64, **dyn), base)
    grown = theta * (2.0 * 100 / 64 - 1.0) ** (d / (d - 2))
    assert rel_err(freq.rope_inv_freq(d, theta, seq_len=100, **dyn),
                   freq.rope_inv_freq(d, grown)) < 1e-15
    # llama3: long wavelengths / factor, short ones kept, between a continuous interpolation.
    old, lo, hi, factor = 64, 1.0, 4.0, 8.0
    got = freq.rope_inv_freq(d, theta, "llama3", factor, lo, hi, old)
    wave = 2 * np.pi / base
    long, short = wave > old / lo, wave < old / hi
    assert long.any() and short.any() and (~long & ~short).any()
    assert np.array_equal(got[long], base[long] / factor) and np.array_equal(got[short], base[short])
    mid = ~long & ~short
    assert np.all((base[mid] / factor < got[mid]) & (got[mid] < base[mid]))
    s = (old / wave[mid] - lo) / (hi - lo)  # 0 at wavelength old/lo, 1 at old/hi: continuous
    assert rel_err(got[mid], (1 - s) * base[mid] / factor + s * base[mid]) < 1e-15
    # the tables use them, for a whole sequence's length given apart from the positions
    cos, _ = ref.rope_cos_sin(np.array([3, 5]), d, theta, np.float64, seq_len=100, **dyn)
    assert rel_err(cos, np.cos(np.array([[3], [5]]) * freq.rope_inv_freq(d, grown))) < 1e-15
    for bad, match in ((dict(scaling="longrope"), "scaling='longrope'"),
                       (dict(scaling="yarn", factor=4.0, original_max_positions=64, beta_fast=1.0),
                        "beta_fast > beta_slow > 0"),
                       (dict(scaling="yarn", factor=4.0), "original_max_positions >= 1"),
                       (dict(scaling="llama3", factor=8.0, low_freq_factor=4.0,
                             original_max_positions=64), "low_freq_factor < high_freq_factor"),
                       (dict(scaling="dynamic", factor=2.0), "original_max_positions=0")):
        with pytest.raises(ValueError, match=match):
            freq.rope_inv_freq(d, theta, **bad)


def test_yarn_rope_rule():
    """yarn: over the correction range [floor(dim(beta_fast)), ceil(dim(beta_slow))] with
    dim(b) = d ln(original / (2 pi b)) / (2 ln theta) (here [0, 3] for d 16, theta 1e4, original
    64), frequency i is base_i / factor blended with base_i by the ramp r = i / 3 clipped to 1;
    the tables are scaled by the attention factor 0.1 ln(factor) + 1, or by the ratio of the two
    mscales' factors when both are set. The float64 comparison with transformers: test_hf.py
    (Qwen3) and test_hf_deepseek.py."""
    d, theta, factor, old = 16, 10000.0, 8.0, 64
    base = freq.rope_inv_freq(d, theta)
    yarn = dict(scaling="yarn", factor=factor, original_max_positions=old)
    got = freq.rope_inv_freq(d, theta, **yarn)
    ramp = np.minimum(np.arange(d // 2) / 3.0, 1.0)
    assert rel_err(got, base / factor * ramp + base * (1 - ramp)) < 1e-15
    assert got[0] == base[0] and np.array_equal(got[3:], base[3:] / factor)
    cos, sin = ref.rope_cos_sin(np.array([0, 5]), d, theta, np.float64, **yarn)
    gain = 0.1 * math.log(factor) + 1
    assert rel_err(np.hypot(cos, sin), np.full(cos.shape, gain)) < 1e-15
    assert rel_err(cos[1], gain * np.cos(5 * got)) < 1e-15
    both = ref.rope_cos_sin(np.array([5]), d, theta, np.float64, mscale=1.0, mscale_all_dim=0.5,
                            **yarn)[0]
    ratio = freq.yarn_mscale(factor, 1.0) / freq.yarn_mscale(factor, 0.5)
    assert ratio > 1.05 and rel_err(both[0], ratio * np.cos(5 * got)) < 1e-15
    assert freq.rope_attention_factor("llama3", factor) == 1.0 and freq.yarn_mscale(0.5) == 1.0


# ----------------------------------------------------------------------------------------------
# numba == numpy_ref (float64 and float32, odd shapes, attention across several tiles)
# ----------------------------------------------------------------------------------------------

def _same(a, b, dtype):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y, dtype)
        return
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.array_equal(np.isinf(a), np.isinf(b))
    fin = np.isfinite(b)
    assert rel_err(a[fin], b[fin]) < TOL[dtype]


def elementwise_cases(rng, dtype):
    """(op, args) for every non-attention op, with odd sizes."""
    r = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    x, w, dy = r(3, 7, 13), r(11, 13), r(3, 7, 11)
    nw = r(13)
    _, rstd = ref.rmsnorm_fwd(x, nw, 1e-6)
    xr = r(2, 9, 3, 10)
    cos, sin = ref.rope_cos_sin(np.arange(9) + 17, 10, 10000.0, dtype)
    logits, tg = r(9, 17) * 4, rng.integers(0, 19, 9)
    _, lse = ref.cross_entropy_fwd(np.concatenate([logits, r(9, 2)], axis=1), tg)
    la, lb = r(2, 3, 5), r(2, 3, 5)
    la[0, 0, :2] = -np.inf
    lb[0, 0, 1:3] = -np.inf
    return [
        ("linear_fwd", (x, w)),
        ("linear_fwd", (x, w, r(11))),
        ("linear_bwd", (dy, x, w)),
        ("rmsnorm_fwd", (x, nw, 1e-6)),
        ("rmsnorm_bwd", (r(3, 7, 13), x, nw, rstd)),
        ("add_rmsnorm_fwd", (x, r(3, 7, 13), nw, 1e-6)),
        ("add_rmsnorm_bwd", (r(3, 7, 13), r(3, 7, 13), x, nw, rstd)),
        ("rope_fwd", (xr, cos, sin)),
        ("rope_bwd", (xr, cos, sin)),
        ("swiglu_fwd", (r(5, 9) * 10, r(5, 9))),
        ("swiglu_bwd", (r(5, 9), r(5, 9) * 10, r(5, 9))),
        ("geglu_fwd", (r(5, 9) * 3, r(5, 9))),
        ("geglu_bwd", (r(5, 9), r(5, 9) * 3, r(5, 9))),
        ("attention_merge", (r(2, 5, 3, 4), la, r(2, 5, 3, 4), lb)),
        ("cross_entropy_stats", (logits, tg, 2, 19)),
        ("cross_entropy_bwd", (logits, tg, lse, r(9), 2, 19)),
    ]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_numba_matches_reference(rng, dtype):
    for op, args in elementwise_cases(rng, dtype):
        _same(getattr(numba_cpu, op)(*args), getattr(ref, op)(*args), dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1, 2), (2, 70, 67, 4, 2, 8), (1, 13, 130, 6, 3, 6)])
@pytest.mark.parametrize("q_offset,k_offset,causal", [(0, 0, True), (60, 0, True), (0, 5, True), (3, 9, False)])
def test_numba_attention_matches_reference(rng, dtype, shape, q_offset, k_offset, causal):
    b, sq, sk, hq, hkv, d = shape
    q, k, v = attention_inputs(rng, b, sq, sk, hq, hkv, d, dtype)
    out, lse = ref.attention_fwd(q, k, v, q_offset, k_offset, causal)
    _same(numba_cpu.attention_fwd(q, k, v, q_offset, k_offset, causal), (out, lse), dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    _same(numba_cpu.attention_bwd(q, k, v, out, lse, dout, q_offset, k_offset, causal),
          ref.attention_bwd(q, k, v, out, lse, dout, q_offset, k_offset, causal), dtype)


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtypes_are_kept(mod, rng, dtype):
    stat = np.float64 if dtype == np.float64 else np.float32
    q, k, v = attention_inputs(rng, dtype=dtype)
    out, lse = mod.attention_fwd(q, k, v)
    assert out.dtype == dtype and lse.dtype == stat
    assert all(g.dtype == dtype for g in mod.attention_bwd(q, k, v, out, lse, out))
    x, w = rng.standard_normal((2, 4)).astype(dtype), np.ones(4, dtype)
    assert all(a.dtype == dtype for a in mod.rmsnorm_fwd(x, w, 1e-5))
    assert all(a.dtype == stat for a in mod.cross_entropy_stats(x, np.array([1, 2])))
    assert mod.swiglu_fwd(x, x).dtype == dtype and mod.linear_fwd(x, w[None]).dtype == dtype


@pytest.mark.parametrize("mod", MODULES.values(), ids=MODULES.keys())
def test_bad_inputs_raise(mod, rng):
    q, k, v = attention_inputs(rng, hq=3, hkv=2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        mod.attention_fwd(q, k, v)
    with pytest.raises(ValueError, match=r"x.shape\[-1\]=5"):
        mod.linear_fwd(np.ones((2, 5)), np.ones((3, 4)))
    with pytest.raises(ValueError, match="target id 7 must be < vocab_size=5"):
        mod.cross_entropy_stats(np.ones((2, 5)), np.array([1, 7]), 0, 5)
    with pytest.raises(ValueError, match="head_dim=5 must be even"):
        mod.rope_fwd(np.ones((1, 2, 1, 5)), np.ones((2, 2)), np.ones((2, 2)))


# ----------------------------------------------------------------------------------------------
# dispatcher and benchmark CLI
# ----------------------------------------------------------------------------------------------

def test_dispatcher_backends():
    assert set(kernels.OPS) >= {"linear_fwd", "attention_bwd", "attention_merge", "cross_entropy_bwd"}
    avail = kernels.available_backends()
    assert set(avail) == {"numpy", "numba", "cupy"} and avail["numpy"] is None and avail["numba"] is None
    np_backend = kernels.get_backend("numpy")
    assert np_backend.name == "numpy" and np_backend.xp is np and np_backend.describe() == "numpy"
    assert all(np_backend.per_op[op] == "numpy" for op in kernels.OPS)
    nb = kernels.get_backend("numba")
    assert nb is kernels.get_backend("numba")
    assert all(callable(getattr(nb, op)) for op in kernels.OPS)
    for op in kernels.OPS:
        expected = "numba" if op in numba_cpu.IMPLEMENTED and op not in numba_cpu.SLOWER_THAN_NUMPY else "numpy"
        assert nb.per_op[op] == expected
        assert getattr(nb, op) is getattr(numba_cpu if expected == "numba" else ref, op)
    assert nb.describe().startswith("numba (linear_fwd, linear_bwd: numpy BLAS")
    assert "\n" not in nb.describe()
    # the array-module generic code every backend carries: the model reaches it through the backend
    from mpipar.kernels import expert_routing
    for backend in (np_backend, nb):
        assert backend.routing is expert_routing
        assert (backend.upcast, backend.sigmoid) == (ref.upcast, ref.sigmoid)
        assert all(backend.per_op[op] == "numpy" for op in kernels.GENERIC_OPS)
    assert "upcast, sigmoid, routing: numpy" in nb.describe()
    auto = kernels.get_backend()
    assert auto.name == ("cupy" if avail["cupy"] is None else "numba")


def test_dispatcher_errors():
    with pytest.raises(ValueError, match="'torch'.*auto, numpy, numba, cupy"):
        kernels.get_backend("torch")
    reason = kernels.available_backends()["cupy"]
    if reason is None:
        pytest.skip("cupy is usable on this machine")
    with pytest.raises(RuntimeError, match="cupy"):
        kernels.get_backend("cupy")
    assert "cupy" in reason


def test_bench_kernels_section(tmp_path, capsys):
    from mpipar.bench.__main__ import main

    path = tmp_path / "bench.json"
    args = ["kernels", "--quick", "--dtypes", "float64", "--backends", "numpy,numba", "--batch", "1", "--seq", "8",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "4", "--ffn", "6", "--vocab", "5",
            "--attn-seqs", "96", "--attn-head-dims", "16", "--attn-heads", "2", "--attn-threads", "1",
            "--json", str(path)]
    assert main(args) == 0
    result = json.loads(path.read_text())["kernels"]
    rows = result["rows"]
    assert len(rows) == len(kernels.OPS) + len(numba_cpu.IMPLEMENTED)  # one per (op, implementation)
    assert all(r["ms"] > 0 for r in rows)
    fused = {r["op"]: r for r in result["fused"]}
    assert set(fused) == {"add_rmsnorm_fwd", "add_rmsnorm_bwd"}
    assert all(r["speedup"] == pytest.approx(r["unfused_ms"] / r["fused_ms"]) for r in fused.values())
    (attn,) = result["attention"]  # measured in a child process with 1 thread
    assert (attn["seq"], attn["head_dim"], attn["threads"], attn["kv_heads"]) == (96, 16, 1, 1)
    fwd_flops, bwd_flops = 2 * 96 * 96 * 16 * 2, 5 * 96 * 96 * 16 * 2  # causal: half of 4 S^2 D per head
    assert attn["fwd_gflops"] == pytest.approx(fwd_flops / attn["fwd_s"] / 1e9)
    assert attn["bwd_gflops"] == pytest.approx(bwd_flops / attn["bwd_s"] / 1e9)
    assert attn["fwd_pct_probe"] == pytest.approx(100 * attn["fwd_gflops"] / attn["probe_gflops"])
    table = capsys.readouterr().out
    assert "attention_bwd" in table and "numba backend uses" in table
    assert "% of the GEMM probe" in table and "add_rmsnorm_bwd" in table


def test_numba_accepts_non_contiguous_inputs(rng):
    q, k, v = attention_inputs(rng, b=2, sq=7, sk=7)
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # same values, strided
    assert not qt.flags.c_contiguous
    _same(numba_cpu.attention_fwd(qt, k, v), ref.attention_fwd(q, k, v), np.float64)
    x = rng.standard_normal((6, 5)).T  # [5, 6], Fortran order
    _same(numba_cpu.rmsnorm_fwd(x, np.ones(6), 1e-6), ref.rmsnorm_fwd(x, np.ones(6), 1e-6), np.float64)
    _same(numba_cpu.swiglu_fwd(x, x), ref.swiglu_fwd(x, x), np.float64)


def test_layout_moves_cut_and_join_without_changing_a_bit():
    """numpy_ref's split_columns / concat (every backend's, bf16 included; the GPU's bf16
    kernels are held to the same bytes in tests/gpu/test_cuda_fused.py)."""
    import ml_dtypes
    rng = np.random.default_rng(2)
    for dtype in (np.float64, np.float32, ml_dtypes.bfloat16):
        y = rng.standard_normal((3, 4, 11)).astype(dtype)
        for name in kernels.BACKENDS:
            if kernels.available_backends()[name] is not None:
                continue
            kb = kernels.get_backend(name)
            pieces = kb.split_columns(y, [5, 0, 6])
            assert [p.shape for p in pieces] == [(3, 4, 5), (3, 4, 0), (3, 4, 6)]
            assert all(p.flags.c_contiguous and p.dtype == y.dtype for p in pieces)
            assert kb.concat(pieces, axis=-1).tobytes() == y.tobytes()
            assert kb.concat([y[:1], y[1:]], axis=0).tobytes() == y.tobytes()
    with pytest.raises(ValueError, match=r"widths \[5, 5\] must be >= 0 and sum to y.shape\[-1\] = 11"):
        ref.split_columns(y, [5, 5])
