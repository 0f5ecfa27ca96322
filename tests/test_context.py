"""Sequence parallelism in isolation: layouts, skipped blocks, and ring/Ulysses attention equal
to attention over the whole sequence (forward and backward), under 8 ranks."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_all_ranks


def test_zigzag_positions():
    from mpipar.parallel.context import SeqLayout

    lay = SeqLayout(16, 4, "zigzag")
    assert lay.positions(0).tolist() == [0, 1, 14, 15]
    assert lay.positions(3).tolist() == [6, 7, 8, 9]
    every = np.sort(np.concatenate([lay.positions(r) for r in range(4)]))
    assert every.tolist() == list(range(16))
    with pytest.raises(ValueError, match="seq_len=12: must be divisible by 8"):
        SeqLayout(12, 4, "zigzag")


class CountingKernels:
    """The real numpy kernels, counting attention calls (to see which blocks were computed)."""

    def __init__(self):
        from mpipar.kernels import get_backend
        self.k = get_backend("numpy")
        self.fwd_calls = 0

    def __getattr__(self, name):
        return getattr(self.k, name)

    def attention_fwd(self, *args):
        self.fwd_calls += 1
        return self.k.attention_fwd(*args)


def _full_attention(q, k, v, dout):
    from mpipar.kernels import get_backend
    kk = get_backend("numpy")
    out, lse = kk.attention_fwd(q, k, v, 0, 0, True)
    return (out,) + tuple(kk.attention_bwd(q, k, v, out, lse, dout, 0, 0, True))


def _differences(got: tuple, want: tuple, pos: np.ndarray) -> list[str]:
    """out, dq, dk, dv of this rank's positions against the whole sequence's, above 1e-12."""
    fails = []
    for name, mine, ref in zip(("out", "dq", "dk", "dv"), got, want):
        err = np.abs(mine - ref[:, pos]).max() / np.abs(ref).max()
        if err > 1e-12:
            fails.append(f"{name} rel err {err:.2e}")
    return fails


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("mode,split,overlap", [("ring", "contiguous", False),
                                                ("ring", "zigzag", False),
                                                ("ring", "contiguous", True),
                                                ("ulysses", "zigzag", False)])
def test_sp_attention_equals_full_attention(world, mode, split, overlap):
    from mpipar.comm import Group, Ledger
    from mpipar.parallel.context import RingAttention, SeqLayout, UlyssesAttention

    sp = 8 if mode == "ring" else 4  # Ulysses: 8 query / 4 kv heads split over 4 ranks
    comm = world.Split(world.rank // sp, world.rank)
    rng = np.random.default_rng(0)
    B, S, hq, hkv, D = 2, 32, 8, 4, 6
    q, k, v, dout = (rng.normal(size=(B, S, h, D)) for h in (hq, hkv, hkv, hq))
    want = _full_attention(q, k, v, dout)
    lay = SeqLayout(S, sp, split)
    pos = lay.positions(comm.rank)
    kern = CountingKernels()
    group = Group(comm, "sp", Ledger())
    attn = (RingAttention(kern, group, lay, overlap) if mode == "ring"
            else UlyssesAttention(kern, group, lay))
    out, saved = attn.forward(q[:, pos], k[:, pos], v[:, pos], pos)
    dq, dk, dv = attn.backward(dout[:, pos], q[:, pos], k[:, pos], v[:, pos], out, saved)
    fails = _differences((out, dq, dk, dv), want, pos)
    if mode == "ring":
        # Causally empty blocks are skipped: contiguous rank r computes r+1 blocks; zigzag gives
        # every rank the same 2*sp+1 (query chunk, key chunk) pairs.
        expect = comm.rank + 1 if split == "contiguous" else 2 * sp + 1
        if kern.fwd_calls != expect:
            fails.append(f"{kern.fwd_calls} attention blocks computed, expected {expect}")
    comm.Free()
    assert_all_ranks(world, fails)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("split,overlap,ulysses", [("contiguous", False, 2), ("zigzag", True, 2),
                                                   ("zigzag", False, 4)])
def test_hybrid_attention_equals_full_attention(world, split, overlap, ulysses):
    """Ulysses over groups of ``ulysses`` consecutive sp ranks, ring over the 8 / ulysses groups:
    out, dq, dk, dv equal attention over the whole sequence (8 query / 4 kv heads)."""
    from mpipar.comm import Group, Ledger
    from mpipar.kernels import get_backend
    from mpipar.parallel.context import HybridAttention, SeqLayout

    rng = np.random.default_rng(0)
    B, S, hq, hkv, D = 2, 32, 8, 4, 6
    q, k, v, dout = (rng.normal(size=(B, S, h, D)) for h in (hq, hkv, hkv, hq))
    want = _full_attention(q, k, v, dout)
    lay = SeqLayout(S, 8, split)
    pos = lay.positions(world.rank)
    ledger = Ledger()
    uly = world.Split(world.rank // ulysses, world.rank)
    ring = world.Split(world.rank % ulysses, world.rank)
    attn = HybridAttention(get_backend("numpy"), Group(uly, "sp_ulysses", ledger),
                           Group(ring, "sp_ring", ledger), lay, overlap)
    out, saved = attn.forward(q[:, pos], k[:, pos], v[:, pos], pos)
    dq, dk, dv = attn.backward(dout[:, pos], None, None, None, out, saved)
    fails = _differences((out, dq, dk, dv), want, pos)
    uly.Free()
    ring.Free()
    assert_all_ranks(world, fails)
