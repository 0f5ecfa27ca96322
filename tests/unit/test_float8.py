"""FP8 numerics (kernels/float8.py) against ml_dtypes and float64: the formats' limits, casts that
saturate and round to nearest, scales that map each tile's amax onto the format's largest value,
and the scaled GEMM's model equal to the float64 product of the dequantized operands within
float32 accumulation."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mpipar.kernels import float8 as f8


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_formats_are_ml_dtypes_float8():
    for fmt, dtype in ((f8.E4M3, ml_dtypes.float8_e4m3fn), (f8.E5M2, ml_dtypes.float8_e5m2)):
        assert fmt.dtype == np.dtype(dtype) and fmt.max == float(ml_dtypes.finfo(dtype).max)


@pytest.mark.parametrize("fmt", [f8.E4M3, f8.E5M2], ids=["e4m3", "e5m2"])
def test_cast_saturates_and_rounds_to_nearest(fmt):
    """Beyond the largest value the cast gives it (ml_dtypes' own cast: NaN for e4m3, inf for
    e5m2); within range it is ml_dtypes' round to nearest even."""
    x = np.array([2 * fmt.max, -3 * fmt.max, fmt.max, 1.0, -0.3, 1e-9], np.float32)
    got = f8.cast(x, np.float32(1.0), fmt).astype(np.float64)
    assert got[0] == fmt.max and got[1] == -fmt.max
    assert not np.isfinite(x[:2].astype(fmt.dtype).astype(np.float64)).all()
    assert np.array_equal(got[2:], x[2:].astype(fmt.dtype).astype(np.float64))


@pytest.mark.parametrize("scaling", list(f8.SCALINGS.values()), ids=list(f8.SCALINGS))
@pytest.mark.parametrize("operand", ["activation", "weight"])
def test_each_tile_s_amax_maps_onto_the_largest_value(rng, scaling, operand):
    """Every tile's largest magnitude becomes the format's largest value (e4m3: 448), each value
    within half a unit in the last place of its float8 value (relative 2^-4 for e4m3's normal
    range), and an all-zero tile is zero with the scale 1."""
    x = rng.standard_normal((256, 384)) * np.exp(rng.uniform(-4, 4, (256, 1)))
    x[:128, :128] = 0.0
    q = f8.quantize(x, f8.E4M3, scaling, operand)
    tm, tk = q.tile
    data = q.data.astype(np.float64).reshape(256 // tm, tm, 384 // tk, tk)
    amax = np.abs(data).max(axis=(1, 3))
    zero = np.abs(x).reshape(data.shape).max(axis=(1, 3)) == 0
    assert np.all(amax[~zero] == f8.E4M3.max) and np.all(q.inverse[zero] == 1.0)
    deq = q.dequantized()
    inverse = np.repeat(np.repeat(q.inverse.astype(np.float64), tm, 0), tk, 1)
    normal = np.abs(x) / inverse >= 2.0 ** -6        # x * s in e4m3's normal range
    assert np.all(np.abs(deq - x)[normal] <= 2.0 ** -4 * np.abs(x)[normal])
    assert np.all(deq[:128, :128] == 0)


def test_power_of_two_scales_are_exact_and_never_saturate(rng):
    x = rng.standard_normal((128, 256)) * 37.0
    q = f8.quantize(x, f8.E4M3, f8.BLOCKWISE, "activation", power_of_two=True)
    exponents = np.log2(q.inverse.astype(np.float64))
    assert np.array_equal(exponents, np.round(exponents))
    assert np.abs(q.data.astype(np.float64)).max() <= f8.E4M3.max
    plain = f8.quantize(x, f8.E4M3, f8.BLOCKWISE, "activation")
    assert np.all(q.inverse >= plain.inverse)     # rounded down: at most the exact scale


@pytest.mark.parametrize("a_scaling,b_scaling", [
    (f8.TENSORWISE, f8.TENSORWISE), (f8.ROWWISE, f8.ROWWISE), (f8.BLOCKWISE, f8.BLOCKWISE),
    (f8.TENSORWISE, f8.BLOCKWISE)], ids=["tensorwise", "rowwise", "blockwise", "mixed"])
def test_scaled_matmul_is_the_product_of_the_dequantized_operands(rng, a_scaling, b_scaling):
    """The GEMM's model equals float64's product of the dequantized operands within float32
    accumulation over k (k * 2^-24 of the sum of |a||b|)."""
    a = rng.standard_normal((128, 384))
    b = rng.standard_normal((256, 384)) * 0.02
    qa = f8.quantize(a, f8.E4M3, a_scaling, "activation")
    qb = f8.quantize(b, f8.E4M3, b_scaling, "weight")
    got = f8.scaled_matmul(qa, qb).astype(np.float64)
    da, db = qa.dequantized(), qb.dequantized()
    want = da @ db.T
    bound = 384 * 2.0 ** -24 * (np.abs(da) @ np.abs(db).T)
    assert np.all(np.abs(got - want) <= bound)
    assert np.abs(got - a @ b.T).max() < 0.1 * np.abs(a @ b.T).max()   # and near the true one


def test_block_scales_keep_an_outlier_to_its_block(rng):
    """One outlier of 10^6 flattens a tensorwise scale (the other values fall below e4m3's
    smallest subnormal, to zero), while blockwise scaling keeps them: the other rows' product
    is lost to one and within a few % of float64 with the other."""
    a = rng.standard_normal((128, 512))
    a[0, 0] = 1e6
    b = rng.standard_normal((128, 512))
    want = a @ b.T

    def error(scaling):
        got = f8.scaled_matmul(f8.quantize(a, f8.E4M3, scaling, "activation"),
                               f8.quantize(b, f8.E4M3, scaling, "weight"))
        return np.abs(got[1:] - want[1:]).max() / np.abs(want[1:]).max()
    assert error(f8.BLOCKWISE) < 0.1 and error(f8.TENSORWISE) > 0.9


def test_shapes_that_do_not_tile_are_refused():
    with pytest.raises(ValueError, match=r"shape \[128, 200\].*multiples of 128"):
        f8.quantize(np.ones((128, 200)), f8.E4M3, f8.BLOCKWISE, "activation")
    with pytest.raises(ValueError, match=r"\[rows, k\]"):
        f8.quantize(np.ones(8), f8.E4M3, f8.TENSORWISE)
    with pytest.raises(ValueError, match="must share k"):
        f8.scaled_matmul(f8.quantize(np.ones((2, 4)), f8.E4M3, f8.TENSORWISE),
                         f8.quantize(np.ones((2, 8)), f8.E4M3, f8.TENSORWISE))
