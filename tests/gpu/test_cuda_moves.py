"""kernels/cuda_moves.py on the device: the column copies move the same bytes as NumPy's slices
and concatenate (every element written: the pool is poisoned first), and the compile gate sees
every launch. The sum of squares is held to NumPy in tests/gpu/test_optim_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("poisoned_pool")   # tests/gpu/conftest.py


def _bf(rng, shape):
    import ml_dtypes
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("shape, widths", [((2, 64, 2560), (2048, 256, 256)),
                                            ((5, 3, 11264), (5632, 5632)),
                                            ((7, 13), (5, 1, 7)), ((4, 10), (3, 0, 7)),
                                            ((0, 12), (4, 8))])
def test_split_columns_and_concat_move_the_same_bits_as_numpy(shape, widths):
    """A stacked linear's output cut per weight (aligned widths: 16-byte vectors; odd ones: one
    element a thread) and joined back, and weights joined along their first axis."""
    import cupy
    from mpipar.kernels import cuda_moves as cm
    rng = np.random.default_rng(sum(shape) + len(widths))
    y = _bf(rng, shape)
    pieces = cm.split_columns(cupy.asarray(y), widths)
    at = 0
    for w, got in zip(widths, pieces):
        want = np.ascontiguousarray(y[..., at:at + w])
        assert got.shape == want.shape and cupy.asnumpy(got).tobytes() == want.tobytes()
        at += w
    assert cupy.asnumpy(cm.concat(pieces, axis=-1)).tobytes() == y.tobytes()
    ws = [_bf(rng, (r, 6)) for r in (3, 1, 4)]
    stacked = cm.concat([cupy.asarray(w) for w in ws], axis=0)
    assert cupy.asnumpy(stacked).tobytes() == np.concatenate(ws).tobytes()


def test_cuda_sources_list_every_launch():
    from mpipar.kernels import cuda_moves as cm
    (src,) = cm.cuda_sources()
    assert sorted(src["names"]) == sorted(
        [f"mpipar_copy_cols<{v}>" for v in (8, 4, 2, 1)]
        + ["mpipar_sum_squares<float>", "mpipar_sum_squares<double>"])
    assert all(n.split("<")[0] in src["code"] for n in src["names"])
