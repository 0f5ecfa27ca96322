"""The cuDNN attention backend on the host: the mask mapping (numpy_ref's offsets, causal and
window onto cuDNN's trimmed diagonal band) equals numpy_ref.visible_mask on every small case, the
ring/zigzag blocks take the forms expected of them, `supports` gives its reasons, and, where the
frontend imports, the graphs validate and lower without a device (sm_90)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from mpipar.kernels import cudnn_attention as ca
from mpipar.kernels import numpy_ref as ref


def _reference(sq, sk, q_off, k_off, causal, window):
    if not causal:
        return np.ones((sq, sk), dtype=bool)
    return np.asarray(ref.visible_mask(np, sq, sk, q_off, k_off, window), dtype=bool)


def _check_plan(sq, sk, q_off, k_off, causal, window):
    """The plan's mask equals numpy_ref's; its bounds are ones cuDNN accepts; the trimmed block
    is tight (every row sees a key, every key is seen). Returns the plan."""
    plan = ca.mask_plan(sq, sk, q_off, k_off, causal, window)
    want = _reference(sq, sk, q_off, k_off, causal, window)
    case = (sq, sk, q_off, k_off, causal, window, plan)
    if plan.refused:
        rows, keys = plan.rows[1] - plan.rows[0], plan.cols[1] - plan.cols[0]
        assert (plan.left is not None and rows > keys) or rows == keys == 1, case
        return plan
    assert np.array_equal(ca.plan_visible(plan, sq, sk), want), case
    if plan.empty:
        assert not want.any(), case
        return plan
    (r0, r1), (c0, c1) = plan.rows, plan.cols
    block = want[r0:r1, c0:c1]
    assert block.any(axis=1).all() and block.any(axis=0).all(), case
    assert plan.right is None or plan.right >= 0, case
    assert plan.left is None or plan.left >= 1, case
    assert plan.alignment == ca.TOP_LEFT or r1 - r0 <= c1 - c0, case
    return plan


def test_mask_plan_equals_visible_mask_exhaustively():
    """Every block up to 7 x 7 at every relative offset in [-9, 9], causal with windows 0..5 and
    not causal: the cuDNN mapping's mask is numpy_ref's (thousands of cases)."""
    count = 0
    for sq, sk in itertools.product(range(1, 8), repeat=2):
        for d in range(-9, 10):
            for window in range(0, 6):
                _check_plan(sq, sk, 100 + d, 100, True, window)
                count += 1
            _check_plan(sq, sk, 100 + d, 100, False, 0)
    assert count == 7 * 7 * 19 * 6


@pytest.mark.parametrize("seed", range(4))
def test_mask_plan_random_large(seed):
    """Random ragged blocks (up to 300) with random offsets and windows."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        sq, sk = (int(x) for x in rng.integers(1, 300, 2))
        q_off, k_off = (int(x) for x in rng.integers(0, 700, 2))
        window = int(rng.choice([0, 0, 1, 2, 17, 64, 255, 1000]))
        _check_plan(sq, sk, q_off, k_off, True, window)


@pytest.mark.parametrize("sq,sk,q_off,k_off,window,form", [
    (64, 64, 0, 0, 0, ("top_left", 0, None)),             # one block / ring diagonal
    (64, 64, 128, 128, 0, ("top_left", 0, None)),         # ring: the diagonal block
    (64, 64, 128, 0, 0, ("top_left", None, None)),        # ring: an earlier block, all visible
    (16, 48, 40, 8, 0, ("bottom_right", 0, None)),        # zigzag: partly visible
    (24, 24, 0, 48, 0, None),                             # nothing visible
    (150, 150, 0, 0, 16, ("top_left", 0, 16)),            # sliding window
    (150, 150, 0, 0, 1, ("top_left", 0, 1)),              # each query sees itself
    (32, 32, 64, 32, 40, ("top_left", None, 8)),          # earlier block, partly in the window
    (40, 40, 600, 0, 100, None),                          # earlier block, out of the window
    (16, 48, 40, 8, 20, ("bottom_right", 0, 20)),         # zigzag offsets with a window
    (10, 12, 5, 0, 0, ("top_left", 5, None)),             # rows 7.. see every key: a band
])
def test_ring_forms(sq, sk, q_off, k_off, window, form):
    """The blocks ring attention and zigzag produce take cuDNN's plainest forms."""
    plan = _check_plan(sq, sk, q_off, k_off, True, window)
    assert plan.refused is None
    if form is None:
        assert plan.empty
    else:
        assert (plan.alignment, plan.right, plan.left) == form


def test_equal_ring_blocks_never_refused():
    """Equal-length blocks at block-multiple offsets (ring and zigzag chunks), any window: cuDNN
    takes every one."""
    for s, k_blocks, window in itertools.product((5, 16), range(-3, 4), (0, 1, 3, 16, 40)):
        plan = _check_plan(s, s, 10 * 16, 10 * 16 - k_blocks * s, True, window)
        assert plan.refused is None, (s, k_blocks, window)


@pytest.mark.parametrize("sq, sk, q_off, k_off, causal, window", [
    (1, 1, 0, 0, True, 0), (1, 1, 0, 0, False, 0), (1, 1, 7, 3, True, 0),
    (2, 2, 1, 2, True, 0),      # row 1 alone sees key 0 alone: trimmed to one pair
    (5, 5, 160, 155, True, 2),  # a window leaving row 0 with key 4 only
])
def test_refused_single_query_and_key(sq, sk, q_off, k_off, causal, window):
    """A block trimmed to one query and one key goes to mpipar's kernel: cuDNN's sdpa_backward
    refuses s_q = s_kv = 1 (a one-token document on the device)."""
    plan = _check_plan(sq, sk, q_off, k_off, causal, window)
    assert plan.refused and "one query and one key" in plan.refused
    assert (plan.rows[1] - plan.rows[0], plan.cols[1] - plan.cols[0]) == (1, 1)


def test_refused_window_with_more_rows_than_keys():
    """A window over a short key block that leaves more rows than keys is refused, with a
    reason, and supports() passes the reason on."""
    plan = ca.mask_plan(64, 16, 0, 0, True, 4)
    assert plan.refused and "sliding window" in plan.refused


def test_trimmed_rows_and_keys():
    """Rows before the first visible key and keys after the last row's diagonal are cut."""
    plan = ca.mask_plan(16, 48, 0, 8, True, 0)  # rows 0..7 see nothing; keys past row 15 unseen
    assert plan.rows == (8, 16) and plan.cols == (0, 8)
    assert (plan.alignment, plan.right) == ("top_left", 0)


def test_empty_and_noncausal_plans():
    assert ca.mask_plan(0, 5).empty and ca.mask_plan(5, 0, causal=False).empty
    plan = ca.mask_plan(7, 9, 3, 50, causal=False)
    assert plan.covers(7, 9) and plan.right is None and plan.left is None
    with pytest.raises(ValueError, match="needs causal"):
        ca.mask_plan(4, 4, causal=False, window=2)


def _usable(monkeypatch):
    """Pretend the frontend imports (supports' other rules do not need it)."""
    monkeypatch.setattr(ca, "_frontend", lambda: (object(), None))


def test_supports_reasons(monkeypatch):
    _usable(monkeypatch)
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    assert ca.supports(bf16, 128) is None
    assert ca.supports(bf16, 64, 40, 8, True, 0, 16, 48) is None
    assert "bfloat16 only" in ca.supports(np.float64, 128)
    assert "bfloat16 only" in ca.supports(np.float32, 128)
    assert "multiple of 8" in ca.supports(bf16, 12)
    assert "multiple of 8" in ca.supports(bf16, 264)
    assert "sliding window" in ca.supports(bf16, 64, 0, 0, True, 4, 64, 16)


def test_supports_without_frontend(monkeypatch):
    monkeypatch.setattr(ca, "_frontend", lambda: (None, "the cuDNN frontend is not usable (x)"))
    assert ca.supports(np.float32, 128) == "the cuDNN frontend is not usable (x)"
    assert ca.frontend_unavailable() == "the cuDNN frontend is not usable (x)"


# ----------------------------------------------------------------------------------------------
# Graphs, defined and validated on the host (needs the frontend and libcudnn, no device)
# ----------------------------------------------------------------------------------------------


def _frontend_or_skip():
    reason = ca.frontend_unavailable()
    if reason is not None:
        pytest.skip(reason)


def _specs(b, sq, sk, hq, hkv, d, q_off, k_off, causal, window):
    """The forward and backward GraphSpecs attention_fwd/bwd would build for this case (host
    arrays stand in for the device ones: only shapes and strides matter)."""
    plan = ca.mask_plan(sq, sk, q_off, k_off, causal, window)
    (r0, r1), (c0, c1) = plan.rows, plan.cols
    q = np.empty((b, sq, hq, d), np.float16)[:, r0:r1]
    k = np.empty((b, sk, hkv, d), np.float16)[:, c0:c1]
    stats = np.empty((b, hq, r1 - r0), np.float32)
    fwd = ca.forward_spec(plan, 0.125, {"q": q, "k": k, "v": k, "o": q, "stats": stats})
    gq = np.empty((b, r1 - r0, hq, d), np.float16)
    gk = np.empty((b, c1 - c0, hkv, d), np.float16)
    bwd = ca.backward_spec(plan, 0.125, {"q": q, "k": k, "v": k, "o": q, "do": q, "stats": stats,
                                         "dq": gq, "dk": gk, "dv": gk}, ca.GRAD_DTYPE)
    return plan, fwd, bwd


@pytest.mark.parametrize("case", [
    (2, 64, 64, 4, 4, 64, 0, 0, True, 0),       # causal, top-left
    (2, 64, 64, 8, 2, 128, 128, 0, True, 0),    # earlier block, no mask; GQA 4
    (1, 16, 48, 4, 2, 64, 40, 8, True, 0),      # zigzag: bottom-right
    (1, 10, 12, 4, 1, 64, 5, 0, True, 0),       # shifted diagonal: right bound 5
    (1, 150, 150, 4, 2, 128, 0, 0, True, 16),   # sliding window
    (1, 32, 32, 4, 2, 64, 64, 32, True, 40),    # window without a right bound
    (1, 16, 48, 4, 2, 64, 40, 8, True, 20),     # bottom-right with a window
    (2, 29, 53, 4, 4, 256, 0, 0, False, 0),     # not causal, ragged, head dim 256
    (1, 37, 37, 2, 2, 8, 0, 0, True, 0),        # the engine's test model: head dim 8
])
def test_graphs_validate_on_host(case):
    """Forward and backward graphs of each mask form, GQA, head dims 8..256 validate and lower to
    cuDNN's operation graph for sm_90 with no device."""
    _frontend_or_skip()
    plan, fwd, bwd = _specs(*case)
    assert not plan.empty and plan.refused is None
    ca.check_graph(fwd)
    ca.check_graph(bwd)


@pytest.mark.parametrize("d,hq,hkv", [(12, 4, 4), (264, 4, 4), (64, 6, 4)])
def test_graphs_refused_on_host(d, hq, hkv):
    """The frontend's own table refuses what supports() refuses (head dims) and what the shape
    checks refuse (query heads not a multiple of kv heads): the host check can fail."""
    _frontend_or_skip()
    _, fwd, bwd = _specs(1, 32, 32, hq, hkv, d, 0, 0, True, 0)
    with pytest.raises(Exception):
        ca.check_graph(bwd)
    if d != 264:  # cuDNN's forward table lets d > 256 through on the host; the backward does not
        with pytest.raises(Exception):
            ca.check_graph(fwd)
