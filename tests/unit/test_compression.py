"""Gradient compression in one process: the int8 and top-k codecs against direct computations, and
error feedback's bookkeeping. The compressed reductions on 8 ranks: mpi/test_compression.py;
launched runs: e2e/test_compression.py."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mpipar.parallel.compression import BLOCK, Int8Codec, TopKCodec


def _gradient(rng, pieces: int, n: int, dtype) -> np.ndarray:
    """Rows of blocks at very different magnitudes, one block all zero."""
    x = rng.normal(size=(pieces, n)) * np.repeat(10.0 ** rng.uniform(-6, 2, (pieces, n // BLOCK)),
                                                  BLOCK, axis=1)
    x[0, :BLOCK] = 0
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_int8_is_rint_of_per_block_scale(dtype):
    """Each block: int8 values rint(x / s) with s = max|x| / 127 (float32), decoded as q * s, so
    every element is within half a step of the input; 1 + 4/BLOCK bytes an element."""
    rng = np.random.default_rng(0)
    x = _gradient(rng, 3, 4 * BLOCK, dtype)
    codec = Int8Codec(np)
    packed = np.empty((3, codec.packed_bytes(4 * BLOCK)), np.uint8)
    assert packed.shape[1] == 4 * BLOCK * (1 + 4 / BLOCK)
    codec.encode(x, packed)
    blocks = x.astype(np.float64).reshape(3, 4, BLOCK)
    scale = (np.abs(blocks).max(axis=2) / 127).astype(np.float32).astype(np.float64)
    q = np.rint(blocks / np.where(scale > 0, scale, 1)[:, :, None])
    want = (q * scale[:, :, None]).reshape(3, -1)
    got = codec.decode(packed, np.empty_like(x))
    assert np.allclose(got, want, rtol=1e-6 if dtype == "float32" else 1e-15, atol=0)
    step = np.repeat(scale, BLOCK, axis=1).reshape(3, -1)
    assert np.all(np.abs(got - x) <= 0.5 * step * (1 + 1e-5) + 1e-30)
    assert not got[0, :BLOCK].any()
    parts = codec.decode(packed, np.empty_like(x))
    assert np.array_equal(codec.decode_sum(packed, np.empty(4 * BLOCK, x.dtype)),
                          parts[0] + parts[1] + parts[2])


def test_topk_sends_the_largest_magnitudes():
    """k = ceil(ratio * n) values and their indices; the decoded sum of pieces is the dense sum
    of each piece's k largest-magnitude elements."""
    rng = np.random.default_rng(1)
    n, ratio = 1000, 0.013
    codec = TopKCodec(np, ratio)
    k = math.ceil(ratio * n)
    xs = rng.normal(size=(3, n))
    packed = np.empty((3, codec.packed_bytes(n, 8)), np.uint8)
    assert packed.shape[1] == k * 12
    want = np.zeros(n)
    for i, x in enumerate(xs):
        sent = codec.encode(x[None].copy(), packed[i:i + 1])
        top = np.argsort(-np.abs(x))[:k]
        assert sorted(sent.tolist()) == sorted(top.tolist())
        want[top] += x[top]
    assert np.array_equal(codec.decode_sum(packed, np.empty(n)), want)


@pytest.mark.parametrize("codec", [Int8Codec(np), TopKCodec(np, 0.05)], ids=["int8", "topk"])
def test_error_feedback_sends_everything_over_steps(codec):
    """With a residual kept and added back, what was sent over T steps plus the last residual
    is the sum of the T inputs (float64 rounding only)."""
    rng = np.random.default_rng(2)
    n = 2 * BLOCK
    residual = np.zeros(n)
    sent_total, true_total = np.zeros(n), np.zeros(n)
    for _ in range(20):
        g = rng.normal(size=n) * 10.0 ** rng.uniform(-3, 1)
        true_total += g
        packed = np.empty((1, codec.packed_bytes(n, 8)), np.uint8)
        codec.encode_feedback(g.reshape(1, n).copy(), residual, packed)
        sent_total += codec.decode_sum(packed, np.empty(n))
    assert np.allclose(sent_total + residual, true_total, rtol=0, atol=1e-12 * np.abs(
        true_total).max())


def test_the_default_warm_up_is_the_codecs_share_of_the_steps():
    """--compression-warmup -1 (the default): int8 reduces a tenth of --steps uncompressed,
    top-k a third; an explicit count is kept, and 0 compresses from the first step."""
    from mpipar.config import Config, ParallelConfig, TrainConfig
    from mpipar.parallel.data_parallel.reducer import warmup_steps
    from mpipar.rules import validate

    def steps(codec: str, warm: int = -1, total: int = 120) -> int:
        cfg = Config(parallel=ParallelConfig(grad_compression=codec, compression_warmup=warm),
                     train=TrainConfig(steps=total))
        return warmup_steps(validate(cfg, 8))

    assert ParallelConfig().compression_warmup == -1
    assert (steps("int8"), steps("topk"), steps("none")) == (12, 40, 0)
    assert (steps("int8", total=300), steps("topk", total=300)) == (30, 100)
    assert (steps("topk", 7), steps("int8", 0)) == (7, 0)
