"""AdamW's fused CuPy pass (:func:`mpipar.training.optim.adamw_update` on device arrays) gives the
same bits as the NumPy sequence on the host: the same operations in the same order, no
multiply-add contracted. Inputs are normal numbers whose moments stay clear of float32's
subnormal range (CuPy flushes float32 subnormals to zero, NumPy does not)."""
from __future__ import annotations

import numpy as np
import pytest

from mpipar.training.optim import adamw_update


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fused_adamw_equals_the_numpy_sequence_bit_for_bit(dtype, weight_decay, scale):
    """... with the clipping coefficient ``scale`` folded in (NumPy: ``g * scale`` first)."""
    import cupy
    rng = np.random.default_rng(7)
    # a strided view into a flat buffer, as the reducer's buckets hand parameters out
    host = {k: rng.standard_normal(2 * 64 * 33).astype(dtype) for k in ("p", "m")}
    host["v"] = (rng.random(2 * 64 * 33) + 0.1).astype(dtype)
    dev = {k: cupy.asarray(a) for k, a in host.items()}
    p0 = host["p"].copy()
    view = lambda a: a.reshape(2, 64, 33)[1, :, 1:]   # noqa: E731
    for step in range(1, 6):
        g = rng.standard_normal((64, 32)).astype(dtype)
        adamw_update(view(host["p"]), g, view(host["m"]), view(host["v"]), step, 3e-3, 0.9,
                     0.95, 1e-8, weight_decay, scale)
        adamw_update(view(dev["p"]), cupy.asarray(g), view(dev["m"]), view(dev["v"]), step,
                     3e-3, 0.9, 0.95, 1e-8, weight_decay, scale)
    for k in host:
        got = dev[k].get()
        assert np.array_equal(got, host[k]), (k, np.abs(got - host[k]).max())
    assert np.abs(view(host["p"]) - view(p0)).min() > 0   # every element of the view moved
    assert np.array_equal(host["p"].reshape(2, 64, 33)[0], p0.reshape(2, 64, 33)[0])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradient_sum_of_squares_on_the_device_equals_the_host(dtype):
    """:func:`mpipar.training.optim.sum_squares` (the fused kernel: float64 partials per
    block, one synchronisation) against NumPy's float64 dot products, to summation-order
    rounding: both sum positive float64 terms, each order within (chain length) x 2**-53 of
    the exact sum; the device's longest chain is a thread's few terms, the warp and block trees
    and its 1,024 block partials, NumPy's pairwise blocks: 1e-12 relative bounds both (measured
    on an H200: 7e-14 at 3M float32 elements)."""
    import cupy
    from mpipar.training.optim import sum_squares
    rng = np.random.default_rng(5)
    host = [rng.standard_normal(shape).astype(dtype) for shape in ((300, 7), (1,), (4096,),
                                                                     (3_000_001,), (0,))]
    flat = rng.standard_normal(10_001).astype(dtype)       # a view at an odd offset of a buffer
    host.append(flat[1:])
    want = sum_squares(host)
    dev = [cupy.asarray(a) for a in host[:-1]] + [cupy.asarray(flat)[1:]]
    got = sum_squares(dev)
    assert abs(got - want) <= 1e-12 * want, (got, want)
    assert sum_squares(dev) == got                          # the same bits every run
    assert want == pytest.approx(sum(float((a.astype(np.float64) ** 2).sum()) for a in host),
                                 rel=1e-12)
