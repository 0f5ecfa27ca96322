"""bfloat16 kernels: numpy_ref's mixed-precision recipe (the table in its module docstring) on the
numpy and numba backends, op by op.

Checked for every op of the dispatcher, on both CPU backends:
  * the dtype of every output (activations bf16; statistics, parameter and attention gradients
    float32);
  * the rounding points, exactly: a backend's bf16 result is, bit for bit, its own float32
    result on the upcast inputs with exactly the contract's outputs rounded to bf16 (round to
    nearest even); where the contract composes ops (add_rmsnorm_fwd) the
    composition, and a rounding point elsewhere (twice instead of once) would fail;
  * accuracy against float64 on the same bf16 inputs (bf16 values are exact in float64), element
    by element, within a bound derived from the two formats:
      |out - exact| <= (1 + 2**-8) * E32 + 2**-8 * |exact|   for outputs rounded to bf16,
      |out - exact| <= E32                                  for float32 outputs,
    2**-8 being bf16's unit roundoff (8 significant bits: RNE moves v by at most 2**-8 |v|, the
    maximum reached just above a power of two; 2**-9 holds only near the top of a binade) and E32
    the float32 computation's own error, a count of roundings times 2**-24 times the magnitude of
    the terms (stated per op below; a GEMM over K terms: (K + 2) 2**-24 (|a| |b|));
  * numpy vs numba on bf16: bit-identical where both run the same float32 code (the linear ops,
    which the numba backend takes from NumPy's BLAS, and rope); elsewhere their float32 kernels
    round differently (other summation orders, exps), so a bf16 output differs where the two
    float32 values straddle a rounding boundary: by one bf16 ulp where the float32 formula has
    no cancellation (norm, swiglu forward), by more where it cancels (an attention output near
    0 is a small difference of large terms: both backends are then within the bounds above, which
    is the guarantee; measured at 4096 x 1024 tokens: rmsnorm y 24 of 4.2M elements 1 ulp apart,
    attention out 306 of 1M, up to 213 ulps on outputs near 0).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpipar import kernels
from mpipar.kernels import numpy_ref as ref

BF16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
pytest.importorskip("mpipar.kernels.numba_cpu")

U16, U32 = 2.0 ** -8, 2.0 ** -24  # unit roundoffs of bf16 and float32
BACKENDS = {name: kernels.get_backend(name) for name in ("numpy", "numba")}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(2024)


def bf(rng: np.random.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> np.ndarray:
    """Normal samples (times scale, plus shift) rounded to bf16."""
    return (rng.standard_normal(shape) * scale + shift).astype(BF16)


def f64(a):
    """A float array (bf16, float32, float64) in float64; anything else unchanged."""
    if isinstance(a, np.ndarray) and (a.dtype == BF16 or a.dtype.kind == "f"):
        return a.astype(np.float64)
    return a


def f32(a):
    """A bf16 array upcast to float32 (exact); anything else unchanged."""
    return a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == BF16 else a


def as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def identical(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bits (every NaN alike)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == BF16:
        return np.array_equal(a.view(np.uint16), b.view(np.uint16))
    return np.array_equal(a, b, equal_nan=True)


def order_key(a: np.ndarray) -> np.ndarray:
    """bf16 values as integers in their order, consecutive for neighbouring values (+0 = -0)."""
    bits = a.view(np.uint16).astype(np.int64)
    return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)


def within(out: np.ndarray, exact: np.ndarray, e32, rounded: bool) -> None:
    """Assert |out - exact| <= the bound of the module docstring, elementwise; infinities equal."""
    assert out.dtype == (BF16 if rounded else np.float32)
    out, exact = f64(out), np.asarray(exact, np.float64)
    assert np.array_equal(np.isinf(out), np.isinf(exact)) and not np.isnan(out).any()
    fin = np.isfinite(exact)
    tol = np.broadcast_to((1 + U16) * np.asarray(e32, np.float64) + (U16 * np.abs(exact) if rounded else 0),
                          exact.shape)
    err = np.abs(out[fin] - exact[fin])
    worst = np.max(err / np.maximum(tol[fin], 1e-300), initial=0.0)
    assert worst <= 1.0, f"error {worst:.3g} times the bound"


# ----------------------------------------------------------------------------------------------
# Inputs: bf16 activations and weights, float32 statistics
# ----------------------------------------------------------------------------------------------

ATTN = dict(q_offset=8, k_offset=0, causal=True)


def attention_case(rng):
    """q `[2, 37, 4, 16]`, k, v `[2, 45, 2, 16]` in bf16 (GQA, causal with an offset)."""
    return bf(rng, 2, 37, 4, 16), bf(rng, 2, 45, 2, 16), bf(rng, 2, 45, 2, 16)


def cases(rng) -> list[tuple[str, tuple]]:
    """(op, args) for every op of OPS but the embedding ones (they write in place)."""
    x, w, dy = bf(rng, 4, 33, 48), bf(rng, 40, 48, scale=0.2), bf(rng, 4, 33, 40)
    nw = bf(rng, 48, scale=0.1, shift=1.0)
    _, rstd = ref.rmsnorm_fwd(x, nw, 1e-5)
    xr = bf(rng, 2, 9, 4, 16)
    cos, sin = ref.rope_cos_sin(np.arange(9) + 5, 16, 10000.0, np.float32)
    q, k, v = attention_case(rng)
    out, lse = ref.attention_fwd(q, k, v, **ATTN)
    la, lb = rng.standard_normal((2, 2, 3, 5)).astype(np.float32) * 2
    la[0, 0, :2] = -np.inf
    lb[0, 0, 1:3] = -np.inf
    logits, tg = bf(rng, 30, 50, scale=3.0), rng.integers(0, 55, 30)
    _, ce_lse = ref.cross_entropy_fwd(logits[:, :45], tg % 45)
    return [
        ("linear_fwd", (x, w)),
        ("linear_fwd", (x, w, bf(rng, 40))),
        ("linear_bwd", (dy, x, w)),
        ("linear_bias_bwd", (dy,)),
        ("rmsnorm_fwd", (x, nw, 1e-5)),
        ("rmsnorm_bwd", (bf(rng, 4, 33, 48), x, nw, rstd)),
        ("add_rmsnorm_fwd", (x, bf(rng, 4, 33, 48), nw, 1e-5)),
        ("add_rmsnorm_bwd", (bf(rng, 4, 33, 48), bf(rng, 4, 33, 48), x, nw, rstd)),
        ("rope_cos_sin", (np.arange(9), 16, 10000.0, BF16)),
        ("rope_fwd", (xr, cos, sin)),
        ("rope_bwd", (xr, cos, sin)),
        ("swiglu_fwd", (bf(rng, 5, 64, scale=3.0), bf(rng, 5, 64))),
        ("swiglu_bwd", (bf(rng, 5, 64), bf(rng, 5, 64, scale=3.0), bf(rng, 5, 64))),
        ("geglu_fwd", (bf(rng, 5, 64, scale=3.0), bf(rng, 5, 64))),
        ("geglu_bwd", (bf(rng, 5, 64), bf(rng, 5, 64, scale=3.0), bf(rng, 5, 64))),
        ("attention_fwd", (q, k, v, 8, 0, True)),
        ("attention_bwd", (q, k, v, out, lse, bf(rng, *q.shape), 8, 0, True)),
        ("attention_merge", (bf(rng, 2, 5, 3, 4), la, bf(rng, 2, 5, 3, 4), lb)),
        ("cross_entropy_stats", (logits, tg, 10, 55)),
        ("cross_entropy_bwd", (logits, tg, ce_lse, rng.standard_normal(30).astype(np.float32), 10, 55)),
    ]


# The contract: which outputs of each op are rounded to bf16 (positions), for the ops whose bf16
# form is "upcast, the float32 op, round these". The composed ops are checked on their own.
ROUNDED = {
    "linear_fwd": (0,), "linear_bwd": (0,), "linear_bias_bwd": (), "rmsnorm_fwd": (0,),
    "rmsnorm_bwd": (0,), "add_rmsnorm_bwd": (0,), "rope_fwd": (0,), "rope_bwd": (0,),
    "swiglu_fwd": (0,), "swiglu_bwd": (0, 1), "geglu_fwd": (0,), "geglu_bwd": (0, 1),
    "attention_fwd": (0,), "attention_bwd": (),
    "attention_merge": (0,), "cross_entropy_stats": (),
    "cross_entropy_bwd": (0,),
}
COMPOSED = {"add_rmsnorm_fwd", "rope_cos_sin", "embedding_fwd", "embedding_bwd"}
# ops whose float32 code is the same on both backends (the numba backend takes the linear ops
# from NumPy's BLAS; rope and the embedding do the same float32 operations in the same order)
SAME_CODE = {"linear_fwd", "linear_bwd", "linear_bias_bwd", "rope_fwd", "rope_bwd"}
# ops whose float32 formula has no cancellation (products, and sums of positive terms): a bf16
# output of the two backends is the same value or its neighbour
NO_CANCELLATION = {"rmsnorm_fwd", "add_rmsnorm_fwd", "swiglu_fwd"}


def test_the_tables_cover_every_op():
    assert set(ROUNDED) | COMPOSED == set(kernels.OPS)
    assert {op for op, _ in cases(np.random.default_rng(0))} | {"embedding_fwd", "embedding_bwd"} == set(kernels.OPS)


# ----------------------------------------------------------------------------------------------
# dtypes and rounding points
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
def test_output_dtypes_follow_the_contract(name, rng):
    kb = BACKENDS[name]
    for op, args in cases(rng):
        if op == "rope_cos_sin":
            assert all(t.dtype == BF16 for t in kb.rope_cos_sin(*args))
            assert all(t.dtype == np.float32 for t in kb.rope_cos_sin(*args[:3], np.float32))
            continue
        got = [o.dtype for o in as_tuple(getattr(kb, op)(*args))]
        if op in ROUNDED:
            want = [BF16 if i in ROUNDED[op] else np.float32 for i in range(len(got))]
        else:  # add_rmsnorm_fwd: s, y, rstd
            want = {"add_rmsnorm_fwd": [BF16, BF16, np.float32]}[op]
        assert got == want, op


@pytest.mark.parametrize("name", BACKENDS)
def test_bf16_is_the_float32_op_rounded_at_the_contract_outputs(name, rng):
    """Bit for bit: op(bf16 inputs) == round(op(float32 upcasts)) at exactly ROUNDED[op]."""
    kb = BACKENDS[name]
    for op, args in cases(rng):
        if op not in ROUNDED:
            continue
        got = as_tuple(getattr(kb, op)(*args))
        want = as_tuple(getattr(kb, op)(*map(f32, args)))
        for i, (g, w) in enumerate(zip(got, want)):
            assert w.dtype == np.float32, (op, i)
            assert identical(g, w.astype(BF16) if i in ROUNDED[op] else w), (op, i)


@pytest.mark.parametrize("name", BACKENDS)
def test_composed_ops_round_their_parts(name, rng):
    """add_rmsnorm_fwd rounds s = x + r first and normalises that s, which differs from
    rounding the float32 composition once, so these checks see where the rounding is."""
    kb = BACKENDS[name]
    x = bf(rng, 6, 40, 48)
    r, w = bf(rng, 6, 40, 48, scale=1e-2), bf(rng, 48, shift=1.0, scale=0.1)
    s, y, rstd = kb.add_rmsnorm_fwd(x, r, w, 1e-5)
    assert identical(s, (f32(x) + f32(r)).astype(BF16))
    y_s, rstd_s = kb.rmsnorm_fwd(s, w, 1e-5)
    assert identical(y, y_s) and identical(rstd, rstd_s)
    assert not identical(y, kb.rmsnorm_fwd(f32(x) + f32(r), f32(w), 1e-5)[0].astype(BF16))


@pytest.mark.parametrize("name", BACKENDS)
def test_outputs_are_rounded_once_not_twice(name, rng):
    """Each output equals its float32 formula rounded once; storing an intermediate in bf16
    (rounding twice) gives other bits on some elements, so the checks see the difference."""
    kb = BACKENDS[name]

    def once_not_twice(got, single, double):
        assert identical(got, single.astype(BF16)) and not identical(got, double.astype(BF16))

    def r(a):  # an intermediate stored in bf16, read back
        return a.astype(BF16).astype(np.float32)

    x, w, b = bf(rng, 64, 96), bf(rng, 80, 96, scale=0.2), bf(rng, 80)
    prod = f32(x) @ f32(w).T
    once_not_twice(kb.linear_fwd(x, w, b), prod + f32(b), r(prod) + f32(b))
    g, u = bf(rng, 64, 96, scale=3.0), bf(rng, 64, 96)
    silu = kb.swiglu_fwd(f32(g), np.ones_like(f32(u)))  # g sigmoid(g) in float32
    once_not_twice(kb.swiglu_fwd(g, u), silu * f32(u), r(silu) * f32(u))
    nw = bf(rng, 96, shift=1.0, scale=0.1)
    y, rstd = kb.rmsnorm_fwd(x, nw, 1e-5)
    once_not_twice(y, f32(x) * rstd[:, None] * f32(nw), r(f32(x) * rstd[:, None]) * f32(nw))
    dy, ds = bf(rng, 64, 96), bf(rng, 64, 96)
    dx32, _ = kb.rmsnorm_bwd(f32(dy), f32(x), f32(nw), rstd)
    once_not_twice(kb.add_rmsnorm_bwd(dy, ds, x, nw, rstd)[0], dx32 + f32(ds), r(dx32) + f32(ds))


def test_rounding_is_to_nearest_even():
    """1.5 + 3 * 2**-8 lies halfway between bf16 neighbours 1.5 + 2**-7 (odd) and 1.5 + 2**-6
    (even): the product is rounded to the even one (truncation would keep the odd one)."""
    for kb in BACKENDS.values():
        tie = kb.linear_fwd(np.array([[1 + 2 ** -7]], BF16), np.array([[1.5]], BF16))
        assert float(tie[0, 0]) == 1.5 + 2 ** -6
        above = kb.linear_fwd(np.array([[1 + 2 ** -7]], BF16), np.array([[1.5 + 2 ** -7]], BF16))
        assert float(above[0, 0]) == 1.5 + 3 * 2 ** -7  # 1.5 + 2**-6 + 2**-8 + 2**-14: up, to nearest


def test_float32_accumulators_and_mixed_storage(rng):
    """A float32 first argument is the float32 op (attention_merge of a float32 running out
    with a bf16 block stays float32, merged from the block's exact upcast)."""
    oa, ob = bf(rng, 2, 5, 3, 4), bf(rng, 2, 5, 3, 4)
    la, lb = rng.standard_normal((2, 2, 3, 5)).astype(np.float32)
    for name, kb in BACKENDS.items():
        out, lse = kb.attention_merge(f32(oa), la, ob, lb)
        want = kb.attention_merge(f32(oa), la, f32(ob), lb)
        assert identical(out, want[0]) and identical(lse, want[1]), name


# ----------------------------------------------------------------------------------------------
# Linear: weight gradients into a float32 buffer, the deferred weight half
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
def test_linear_bwd_accumulates_into_a_buffer(name, rng):
    kb = BACKENDS[name]
    dy, x, w = bf(rng, 3, 7, 10), bf(rng, 3, 7, 12), bf(rng, 10, 12)
    dx, dw = kb.linear_bwd(dy, x, w)
    start = rng.standard_normal((10, 12)).astype(np.float32)
    buf = start.copy()
    dx2, dw2 = kb.linear_bwd(dy, x, w, dw=buf)
    assert dw2 is buf and identical(dx2, dx) and identical(buf, start + dw)
    none, dw3 = kb.linear_bwd(dy, x, None, dw=buf)  # the weight half alone
    assert none is None and dw3 is buf and identical(buf, start + dw + dw)
    assert identical(kb.linear_fwd(dy, w.T), dx)  # the input half alone, as linear_bwd's dx
    with pytest.raises(ValueError, match="needs w"):
        kb.linear_bwd(dy, x, None)
    with pytest.raises(ValueError, match="dw"):
        kb.linear_bwd(dy, x, w, dw=np.zeros((12, 10), np.float32))
    for dt in (np.float32, np.float64):  # the same interface without bf16
        d, xx, ww = f64(dy).astype(dt), f64(x).astype(dt), f64(w).astype(dt)
        acc = np.ones((10, 12), dt)
        kb.linear_bwd(d, xx, None, dw=acc)
        assert acc.dtype == dt and identical(acc, 1 + kb.linear_bwd(d, xx, ww)[1])


def test_numba_module_linear_matches_the_interface(rng):
    """numba_cpu's own matmul linear ops (kept for the benchmark) take the same arguments."""
    from mpipar.kernels import numba_cpu

    dy, x, w = bf(rng, 3, 7, 10), bf(rng, 3, 7, 12), bf(rng, 10, 12)
    y = numba_cpu.linear_fwd(x, w)
    exact, magnitude = f64(x) @ f64(w).T, np.abs(f64(x)) @ np.abs(f64(w)).T
    assert y.dtype == BF16 and np.all(np.abs(f64(y) - exact) <= U16 * np.abs(exact) + 14 * U32 * magnitude)
    buf = np.zeros((10, 12), np.float32)
    dx, dw = numba_cpu.linear_bwd(dy, x, w, dw=buf)
    assert dx.dtype == BF16 and dw is buf
    assert np.allclose(buf, f64(dy).reshape(-1, 10).T @ f64(x).reshape(-1, 12), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Embedding
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
def test_embedding_copies_rows_and_accumulates_float32(name, rng):
    kb = BACKENDS[name]
    w = bf(rng, 6, 8)
    ids = np.array([[3, 9, 5], [0, 3, 7]])
    x = kb.embedding_fwd(w, ids, row_start=2)  # this shard holds ids 2..7
    held = (ids >= 2) & (ids < 8)
    assert x.dtype == BF16 and identical(x[held], w[ids[held] - 2])
    assert np.all(f64(x[~held]) == 0)
    dx = bf(rng, 2, 3, 8)
    dw = rng.standard_normal((6, 8)).astype(np.float32)
    want = dw.copy()
    np.add.at(want, ids[held] - 2, f32(dx[held]))
    assert kb.embedding_bwd(dw, dx, ids, row_start=2) is dw and identical(dw, want)


# ----------------------------------------------------------------------------------------------
# Accuracy against float64 on the same bf16 inputs (bounds: module docstring)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BACKENDS)
def test_linear_against_float64(name, rng):
    """E32 of a GEMM over K terms: (K + 2) 2**-24 (|a| |b|) (the bias: one more term)."""
    kb = BACKENDS[name]
    x, w, b, dy = bf(rng, 4, 33, 300), bf(rng, 40, 300, scale=0.2), bf(rng, 40), bf(rng, 4, 33, 40)
    ab = [np.abs(f64(a)) for a in (x, w, b, dy)]
    within(kb.linear_fwd(x, w, b), ref.linear_fwd(f64(x), f64(w), f64(b)),
           (300 + 3) * U32 * ref.linear_fwd(ab[0], ab[1], ab[2]), True)
    dx, dw = kb.linear_bwd(dy, x, w)
    dx64, dw64 = ref.linear_bwd(f64(dy), f64(x), f64(w))
    mag_dx, mag_dw = ref.linear_bwd(ab[3], ab[0], ab[1])
    within(dx, dx64, (40 + 2) * U32 * mag_dx, True)
    within(dw, dw64, (4 * 33 + 2) * U32 * mag_dw, False)
    within(kb.linear_bias_bwd(dy), ref.linear_bias_bwd(f64(dy)), (4 * 33 + 2) * U32 * ref.linear_bias_bwd(ab[3]),
           False)


@pytest.mark.parametrize("name", BACKENDS)
def test_rmsnorm_against_float64(name, rng):
    """rstd: mean of H squares (H 2**-24 relative), sqrt halving it, + 4 roundings; y: + 2.
    dx = r dy w - r^3 x mean(dy w x): (H + 8) 2**-24 on the second term's magnitude, 3 on the
    first, 1 for the difference; dw: a sum over N rows, (N + 3) 2**-24 sum |dy x r|."""
    kb = BACKENDS[name]
    h, n = 256, 4 * 33
    x, w, dy, ds = bf(rng, 4, 33, h), bf(rng, h, scale=0.1, shift=1.0), bf(rng, 4, 33, h), bf(rng, 4, 33, h)
    y, rstd = kb.rmsnorm_fwd(x, w, 1e-5)
    y64, rstd64 = ref.rmsnorm_fwd(f64(x), f64(w), 1e-5)
    within(rstd, rstd64, (h / 2 + 4) * U32 * rstd64, False)
    within(y, y64, (h / 2 + 6) * U32 * np.abs(y64), True)
    r = f64(rstd)[..., None]
    dyw_abs = np.abs(f64(dy) * f64(w))
    mag = 3 * r * dyw_abs + (h + 8) * r ** 3 * np.abs(f64(x)) * np.mean(dyw_abs * np.abs(f64(x)), -1, keepdims=True)
    dx64, dw64 = ref.rmsnorm_bwd(f64(dy), f64(x), f64(w), f64(rstd))
    mag_dw = (n + 3) * (np.abs(f64(dy) * f64(x)) * r).reshape(-1, h).sum(0)
    dx, dw = kb.rmsnorm_bwd(dy, x, w, rstd)
    within(dx, dx64, U32 * (mag + np.abs(dx64)), True)
    within(dw, dw64, U32 * mag_dw, False)
    dsum, dw2 = kb.add_rmsnorm_bwd(dy, ds, x, w, rstd)
    within(dsum, dx64 + f64(ds), U32 * (mag + 2 * np.abs(dx64 + f64(ds)) + np.abs(f64(ds))), True)
    within(dw2, dw64, U32 * mag_dw, False)


@pytest.mark.parametrize("name", BACKENDS)
def test_rope_and_swiglu_against_float64(name, rng):
    """rope: two products and a sum, 2 2**-24 (|x1 c| + |x2 s|). swiglu: exp (<= 4 ulp), sigmoid's
    add and division, the products: 16 2**-24 |h|; dgate = dh u sig (1 + g (1 - sig)) cancels
    in its last factor: 16 2**-24 |dh u| sig (1 + 2 |g|)."""
    kb = BACKENDS[name]
    x = bf(rng, 2, 9, 4, 16)
    cos, sin = ref.rope_cos_sin(np.arange(9) + 5, 16, 10000.0, np.float32)
    c, s = f64(cos)[None, :, None], f64(sin)[None, :, None]
    x1, x2 = np.abs(f64(x)[..., :8]), np.abs(f64(x)[..., 8:])
    mag = 2 * U32 * np.concatenate([x1 * np.abs(c) + x2 * np.abs(s)] * 2, axis=-1)
    within(kb.rope_fwd(x, cos, sin), ref.rope_fwd(f64(x), f64(cos), f64(sin)), mag, True)
    within(kb.rope_bwd(x, cos, sin), ref.rope_bwd(f64(x), f64(cos), f64(sin)), mag, True)
    g, u, dh = bf(rng, 7, 64, scale=4.0), bf(rng, 7, 64), bf(rng, 7, 64)
    h64 = ref.swiglu_fwd(f64(g), f64(u))
    within(kb.swiglu_fwd(g, u), h64, 16 * U32 * np.abs(h64), True)
    dg, du = kb.swiglu_bwd(dh, g, u)
    dg64, du64 = ref.swiglu_bwd(f64(dh), f64(g), f64(u))
    sig = 1 / (1 + np.exp(-f64(g)))
    within(dg, dg64, 16 * U32 * np.abs(f64(dh) * f64(u)) * sig * (1 + 2 * np.abs(f64(g))), True)
    within(du, du64, 16 * U32 * np.abs(du64), True)


def attention_terms(q, k, v, q_offset, k_offset, causal):
    """float64 pieces of the bounds: scores s, |q||k| products, the visibility mask, all
    `[B, Hq, Sq, Sk]`, and k, v repeated per query head `[B, Sk, Hq, D]`."""
    group = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    sc = 1 / math.sqrt(q.shape[3])
    s = sc * np.einsum("bihd,bjhd->bhij", q, kk)
    sabs = sc * np.einsum("bihd,bjhd->bhij", np.abs(q), np.abs(kk))
    mask = ref.visible_mask(np, q.shape[1], k.shape[1], q_offset, k_offset) if causal else np.ones(s.shape[2:], bool)
    return s, sabs, mask, kk, vv


@pytest.mark.parametrize("name", BACKENDS)
def test_attention_fwd_against_float64(name, rng):
    """Scores over D terms and the max's subtraction: eps_s = (D + 4) 2**-24 max_j |q||k_j| scale
    (absolute, per row); a weight exp(s - m) then has relative error 2 eps_s + 4 2**-24, the
    row sum and P V (Sk terms each) add 2 Sk + 12: E32(out) = (2 eps_s + (2 Sk + 16) 2**-24) A,
    A = sum_j p_j |v_j| / sum_j p_j. lse = m + log l: eps_s + (Sk + 8 + 2 (|lse| + 2 ln(1e12 Sk)))
    2**-24 (m is a score or the row max; l < 1e12 Sk in the numba kernel)."""
    kb = BACKENDS[name]
    q, k, v = attention_case(rng)
    q64, k64, v64 = f64(q), f64(k), f64(v)
    out64, lse64 = ref.attention_fwd(q64, k64, v64, **ATTN)
    s, sabs, mask, kk, vv = attention_terms(q64, k64, v64, **ATTN)
    d, sk = q.shape[3], k.shape[1]
    eps_s = (d + 4) * U32 * np.where(mask, sabs, 0).max(-1)  # [B, Hq, Sq]
    amean = ref.attention_fwd(q64, k64, np.abs(v64), **ATTN)[0]  # A: the same weights on |v|
    out, lse = kb.attention_fwd(q, k, v, **ATTN)
    e_out = (2 * eps_s + (2 * sk + 16) * U32).transpose(0, 2, 1)[..., None] * amean
    within(out, out64, e_out, True)
    fin = np.isfinite(lse64)
    e_lse = eps_s + U32 * (sk + 8 + 2 * (np.abs(np.where(fin, lse64, 0)) + 2 * math.log(1e12 * sk)))
    within(lse, lse64, e_lse, False)


@pytest.mark.parametrize("name", BACKENDS)
def test_attention_bwd_against_float64(name, rng):
    """Float32 gradients from exact (bf16) q, k, v, out, dout and the float32 lse, first-order:
    dP = p (2 eps_s + 8 u); dP's product and delta over D terms: (D + 2) u of their magnitudes;
    dS = P (dP - delta): dP |dP - delta| + P (d(dP) + d(delta)) + 2 u |dS|; then dv = P^T dout,
    dq = scale dS K, dk = scale dS^T Q over Sq G (or Sk) terms: (n + 2) u |.||.| plus the
    propagated errors (u = 2**-24)."""
    kb = BACKENDS[name]
    q, k, v = attention_case(rng)
    out, lse = kb.attention_fwd(q, k, v, **ATTN)
    dout = bf(rng, *q.shape)
    q64, k64, v64, o64, do64, lse64 = map(f64, (q, k, v, out, dout, lse))
    s, sabs, mask, kk, vv = attention_terms(q64, k64, v64, **ATTN)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g, sc = hq // hkv, 1 / math.sqrt(d)
    eps_s = (d + 4) * U32 * np.where(mask, sabs, 0).max(-1, keepdims=True)
    lse_b = np.where(np.isfinite(lse64), lse64, np.inf)[..., None]
    p = np.where(mask, np.exp(s - lse_b), 0.0)
    dp = np.einsum("bihd,bjhd->bhij", do64, vv)
    e_dp = (d + 2) * U32 * np.einsum("bihd,bjhd->bhij", np.abs(do64), np.abs(vv))
    delta = (do64 * o64).sum(-1).transpose(0, 2, 1)[..., None]
    e_delta = (d + 2) * U32 * np.abs(do64 * o64).sum(-1).transpose(0, 2, 1)[..., None]
    e_p = (2 * eps_s + 8 * U32) * p
    ds = p * (dp - delta)
    e_ds = e_p * np.abs(dp - delta) + p * (e_dp + e_delta) + 2 * U32 * np.abs(ds)

    def per_kv(a):  # [B, Sk, Hq, D] -> summed over each kv head's query heads [B, Sk, Hkv, D]
        return a.reshape(b, sk, hkv, g, d).sum(3)

    e_dv = per_kv((sq * g + 2) * U32 * np.einsum("bhij,bihd->bjhd", p, np.abs(do64))
                  + np.einsum("bhij,bihd->bjhd", e_p, np.abs(do64)))
    e_dq = sc * ((sk + 2) * U32 * np.einsum("bhij,bjhd->bihd", np.abs(ds), np.abs(kk))
                 + np.einsum("bhij,bjhd->bihd", e_ds, np.abs(kk)))
    e_dk = sc * per_kv((sq * g + 2) * U32 * np.einsum("bhij,bihd->bjhd", np.abs(ds), np.abs(q64))
                       + np.einsum("bhij,bihd->bjhd", e_ds, np.abs(q64)))
    grads = kb.attention_bwd(q, k, v, out, lse, dout, **ATTN)
    exact = ref.attention_bwd(q64, k64, v64, o64, lse64, do64, **ATTN)
    for got, want, e32 in zip(grads, exact, (e_dq, e_dk, e_dv)):
        within(got, want, e32, False)


@pytest.mark.parametrize("name", BACKENDS)
def test_attention_bwd_in_the_activations_dtype_is_the_float32_gradients_rounded(name, rng):
    """``grad_dtype`` bf16 (the seam's request where it keeps the gradients as they are): dq, dk,
    dv come back in bf16 (C-contiguous), bit for bit the float32 gradients rounded once, with and
    without packed documents; ``grad_dtype`` float32 is the default itself; a dtype that is
    neither is refused with the value and the rule, for bf16 and for float64 inputs. The local
    attention core asks for it under bf16 only, and its gradients keep their bits."""
    from mpipar.model.attention import LocalAttention, grads_as_activations

    kb = BACKENDS[name]
    q, k, v = attention_case(rng)
    dout = bf(rng, *q.shape)
    ids = np.repeat(np.arange(9), 5)[None].repeat(2, 0)       # documents of 5 keys, [2, 45]
    for docs in ({}, {"q_docs": ids[:, 8:], "k_docs": ids}):
        out, lse = kb.attention_fwd(q, k, v, **ATTN, **docs)
        wide = kb.attention_bwd(q, k, v, out, lse, dout, **ATTN, **docs)
        same = kb.attention_bwd(q, k, v, out, lse, dout, **ATTN, **docs, grad_dtype=np.float32)
        narrow = kb.attention_bwd(q, k, v, out, lse, dout, **ATTN, **docs, grad_dtype=BF16)
        for w, s_, n in zip(wide, same, narrow):
            assert identical(s_, w) and w.dtype == np.float32
            assert identical(n, w.astype(BF16)) and n.flags.c_contiguous
    with pytest.raises(ValueError, match="grad_dtype=float64 must be float32 or bfloat16"):
        kb.attention_bwd(q, k, v, out, lse, dout, **ATTN, grad_dtype=np.float64)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    o64, l64 = kb.attention_fwd(q64, k64, v64, **ATTN)
    with pytest.raises(ValueError, match="grad_dtype=bfloat16 must be float64 for float64 inputs"):
        kb.attention_bwd(q64, k64, v64, o64, l64, dout.astype(np.float64), **ATTN,
                         grad_dtype=BF16)
    assert grads_as_activations(q) == BF16 and grads_as_activations(q64) is None
    core = LocalAttention(kb)
    qs, ks, vs = q[:, :37], k[:, :37], v[:, :37]               # one local sequence, positions 0..
    o, saved = core.forward(qs, ks, vs, np.arange(37))
    got = core.backward(dout, qs, ks, vs, o, saved)
    want = kb.attention_bwd(qs, ks, vs, o, saved[0], dout, 0, 0, True)
    for g, w in zip(got, want):
        assert identical(g, w.astype(BF16))


def merge_terms(la, lb, lse):
    """The merge's weights `[B, S, H, 1]` of each side and |la - lb| `[B, H, S]` (0 unless both
    sides see keys)."""
    wa = np.where(np.isfinite(la), np.exp(la - lse), 0).transpose(0, 2, 1)[..., None]
    wb = np.where(np.isfinite(lb), np.exp(lb - lse), 0).transpose(0, 2, 1)[..., None]
    return wa, wb, np.where(np.isfinite(la) & np.isfinite(lb), np.abs(la - lb), 0)


@pytest.mark.parametrize("name", BACKENDS)
def test_attention_merge_against_float64(name, rng):
    """Weights exp(l - max) / total: (|la - lb| + 10) 2**-24 relative, on wa |oa| + wb |ob|;
    lse = max + log total: (|max| + |lse| + |la - lb| + 4) 2**-24."""
    kb = BACKENDS[name]
    oa, ob = bf(rng, 2, 5, 3, 4), bf(rng, 2, 5, 3, 4)
    la, lb = rng.standard_normal((2, 2, 3, 5)).astype(np.float32) * 3
    la[0, 0, :2] = -np.inf
    lb[0, 0, 1:3] = -np.inf
    out64, lse64 = ref.attention_merge(f64(oa), f64(la), f64(ob), f64(lb))
    with np.errstate(invalid="ignore"):  # -inf - -inf where a side or both are empty: masked
        wa, wb, gap = merge_terms(f64(la), f64(lb), lse64)
    top = np.where(np.isfinite(lse64), np.maximum(f64(la), f64(lb)), 0)
    out, lse = kb.attention_merge(oa, la, ob, lb)
    magnitude = wa * np.abs(f64(oa)) + wb * np.abs(f64(ob))
    within(out, out64, U32 * (gap.transpose(0, 2, 1)[..., None] + 10) * magnitude, True)
    within(lse, lse64, U32 * (np.abs(top) + np.abs(np.where(np.isfinite(lse64), lse64, 0)) + gap + 4), False)


@pytest.mark.parametrize("name", BACKENDS)
def test_cross_entropy_against_float64(name, rng):
    """s = sum exp(l - m): (V + 8 + 2 max|l - m|) 2**-24 relative (the sum, exp, its argument);
    lse = m + log s adds (|m| + |log s| + |lse|) 2**-24, loss = lse - t adds |loss| 2**-24;
    dlogits = (exp(l - lse) - onehot) dloss: |dloss| (p (|l - lse| + 8) + 2 (p + 1)) 2**-24."""
    kb = BACKENDS[name]
    n, vocab = 30, 200
    logits, tg = bf(rng, n, vocab, scale=3.0), rng.integers(0, vocab, n)
    l64 = f64(logits)
    m, s, t = kb.cross_entropy_stats(logits, tg)
    m64, s64, t64 = ref.cross_entropy_stats(l64, tg)
    spread = np.abs(l64 - m64[:, None]).max(1)
    rel_s = (vocab + 8 + 2 * spread) * U32
    within(m, m64, 0.0, False)
    within(t, t64, 0.0, False)
    within(s, s64, rel_s * s64, False)
    lse = m + np.log(s)           # the unsharded loss from the statistics, as the model's
    loss = lse - t                # vocabulary-parallel cross-entropy combines them
    loss64, lse64 = ref.cross_entropy_fwd(l64, tg)
    e_lse = rel_s + U32 * (np.abs(m64) + np.abs(np.log(s64)) + np.abs(lse64))
    within(lse, lse64, e_lse, False)
    within(loss, loss64, e_lse + U32 * np.abs(loss64), False)
    dloss = rng.standard_normal(n).astype(np.float32)
    grad64 = ref.cross_entropy_bwd(l64, tg, f64(lse), f64(dloss))
    p = np.exp(l64 - f64(lse)[:, None])
    e_grad = U32 * np.abs(f64(dloss))[:, None] * (p * (np.abs(l64 - f64(lse)[:, None]) + 8) + 2 * (p + 1))
    within(kb.cross_entropy_bwd(logits, tg, lse, dloss), grad64, e_grad, True)


# ----------------------------------------------------------------------------------------------
# numpy vs numba on bf16
# ----------------------------------------------------------------------------------------------

def test_numpy_and_numba_backends_agree_on_bf16(rng):
    """Bit-identical where both run the same float32 code; elsewhere a bf16 output without
    cancellation equals the other backend's or is its neighbour, any bf16 output is within two
    roundings of it normwise (2 * 2**-8 max|out|: both are within 2**-8 |exact| + E32 of the exact
    result, E32 normwise far smaller), and float32 outputs agree to float32 accuracy (2e-5
    normwise, as tests/unit/test_kernels.py)."""
    npb, nbb = BACKENDS["numpy"], BACKENDS["numba"]
    differing = total = 0
    for op, args in cases(rng):
        for i, (a, b) in enumerate(zip(as_tuple(getattr(npb, op)(*args)), as_tuple(getattr(nbb, op)(*args)))):
            assert a.dtype == b.dtype and a.shape == b.shape, (op, i)
            fin = np.isfinite(f64(a))
            assert np.array_equal(fin, np.isfinite(f64(b))) and identical(a[~fin], b[~fin]), (op, i)
            diff = np.abs(f64(a[fin]) - f64(b[fin])).max(initial=0.0)
            scale = np.abs(f64(a[fin])).max(initial=0.0)
            if op in SAME_CODE or op == "rope_cos_sin":
                assert identical(a, b), (op, i)
            elif a.dtype == BF16:
                gap = np.abs(order_key(a) - order_key(b))
                assert op not in NO_CANCELLATION or gap.max(initial=0) <= 1, (op, i)
                assert diff <= 2 * U16 * scale, (op, i)
                differing, total = differing + int(np.count_nonzero(gap)), total + gap.size
            else:
                assert diff <= 2e-5 * scale, (op, i)
    assert differing <= 0.01 * total  # rare: two float32 results straddle a rounding boundary


def test_numba_backend_keeps_its_kernels_for_bf16():
    """bf16 needs no fallback: the numba backend runs its own float32 kernels between the
    recipe's upcast and rounding (the linear ops come from NumPy's BLAS, as for float32)."""
    from mpipar.kernels import numba_cpu

    nbb = BACKENDS["numba"]
    assert all(getattr(nbb, op) is getattr(numba_cpu, op) for op in numba_cpu.IMPLEMENTED
               if op not in numba_cpu.SLOWER_THAN_NUMPY)
    assert nbb.linear_fwd is ref.linear_fwd and nbb.linear_bwd is ref.linear_bwd
