"""Sequence parallelism in isolation, under 8 ranks: ring, halo, Ulysses and hybrid attention equal
attention over the whole sequence (forward and backward), skipped blocks counted."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_all_ranks


class CountingKernels:
    """The real numpy kernels, counting attention calls (to see which blocks were computed)."""

    def __init__(self):
        from mpipar.kernels import get_backend
        self.k = get_backend("numpy")
        self.fwd_calls = 0

    def __getattr__(self, name):
        return getattr(self.k, name)

    def attention_fwd(self, *args, **kw):
        self.fwd_calls += 1
        return self.k.attention_fwd(*args, **kw)


def _full_attention(q, k, v, dout, window=0):
    from mpipar.kernels import get_backend
    kk = get_backend("numpy")
    out, lse = kk.attention_fwd(q, k, v, 0, 0, True, window=window)
    return (out,) + tuple(kk.attention_bwd(q, k, v, out, lse, dout, 0, 0, True, window=window))


def _visible_pairs(lay, rank: int, window: int, own_only: bool = False) -> int:
    """(query run, key run) pairs of ``rank`` with a visible entry, over every rank's runs (or
    only its own): counted by brute force on the positions."""
    count = 0
    for qs, qn in lay.segments(rank):
        qp = np.arange(qs, qs + qn)[:, None]
        for src in ([rank] if own_only else range(lay.sp)):
            for ks, kn in lay.segments(src):
                kp = np.arange(ks, ks + kn)[None, :]
                seen = (kp <= qp) & ((qp - kp < window) if window else True)
                count += bool(seen.any())
    return count


CASES = [("ring", "contiguous", False, 0), ("ring", "zigzag", False, 0),
         ("ring", "contiguous", True, 0), ("ulysses", "zigzag", False, 0),
         ("ring", "contiguous", False, 3), ("ring", "contiguous", True, 9),
         ("ring", "zigzag", False, 5), ("ring", "zigzag", True, 3), ("ring", "zigzag", False, 17),
         ("halo", "contiguous", False, 3), ("halo", "contiguous", False, 9),
         ("halo", "zigzag", False, 5), ("halo", "zigzag", False, 0),
         ("ulysses", "contiguous", False, 5)]


def _differences(got: tuple, want: tuple, pos: np.ndarray) -> list[str]:
    """out, dq, dk, dv of this rank's positions against the whole sequence's, above 1e-12."""
    fails = []
    for name, mine, ref in zip(("out", "dq", "dk", "dv"), got, want):
        err = np.abs(mine - ref[:, pos]).max() / np.abs(ref).max()
        if err > 1e-12:
            fails.append(f"{name} rel err {err:.2e}")
    return fails


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("mode,split,overlap,window", CASES)
def test_sp_attention_equals_full_attention(world, mode, split, overlap, window):
    """Ring, halo and Ulysses attention with and without a sliding window equal attention over
    the whole sequence (float64, 1e-12); ring and halo compute exactly the visible blocks and
    hand MPI the bytes the planner's formulas say."""
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.model.attention import runs_visible
    from mpipar.parallel.sequence.halo import HaloAttention, halo_messages, halo_plan
    from mpipar.parallel.sequence.ring import RingAttention, ring_hops, ring_messages
    from mpipar.parallel.sequence.ulysses import UlyssesAttention
    from mpipar.parallel.sequence_split import SeqLayout

    sp = 4 if mode == "ulysses" else 8  # Ulysses: 8 query / 4 kv heads split over 4 ranks
    comm = world.Split(world.rank // sp, world.rank)
    rng = np.random.default_rng(0)
    B, S, hq, hkv, D = 2, 32, 8, 4, 6
    q, k, v, dout = (rng.normal(size=(B, S, h, D)) for h in (hq, hkv, hkv, hq))
    want = _full_attention(q, k, v, dout, window)
    lay = SeqLayout(S, sp, split)
    pos = lay.positions(comm.rank)
    kern = CountingKernels()
    ledger = Ledger()
    group = Group(comm, "sp", ledger)
    attn = {"ring": lambda: RingAttention(kern, group, lay, overlap),
            "halo": lambda: HaloAttention(kern, group, lay),
            "ulysses": lambda: UlyssesAttention(kern, group, lay)}[mode]()
    out, saved = attn.forward(q[:, pos], k[:, pos], v[:, pos], pos, window)
    dq, dk, dv = attn.backward(dout[:, pos], q[:, pos], k[:, pos], v[:, pos], out, saved, window)
    fails = _differences((out, dq, dk, dv), want, pos)
    if mode != "ulysses":
        # Blocks emptied by the causal mask or the window are skipped: exactly the visible
        # (query run, key run) pairs are computed (zigzag, full causal: 2*sp+1 on every rank).
        expect = _visible_pairs(lay, comm.rank, window)
        if mode == "halo":  # the rows from one rank arrive as contiguous runs, one block each
            plan = halo_plan(lay, comm.rank, window)
            expect = _visible_pairs(lay, comm.rank, window, own_only=True) + sum(
                runs_visible(qs, qn, ks, sl.stop - sl.start, window)
                for qs, qn in lay.segments(comm.rank) for src in plan.recv
                for sl, ks in plan.runs(src))
        if kern.fwd_calls != expect:
            fails.append(f"{kern.fwd_calls} attention blocks computed, expected {expect}")
        row = B * hkv * D * 8
        block = 2 * row * len(pos)         # a ring block's K and V (and their gradient)
        fwd, bwd = (ring_messages(ring_hops(lay, window), block, block, overlap)
                    if mode == "ring" else halo_messages(halo_plan(lay, comm.rank, window),
                                                         comm.rank, sp, row, row))
        want_bytes = sum(nbytes * count for _, nbytes, count, _ in fwd + bwd)
        if ledger.bytes_by_group().get("sp", 0) != want_bytes:
            fails.append(f"ledger {ledger.bytes_by_group()} != predicted {want_bytes}")
    comm.Free()
    assert_all_ranks(world, fails)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("split,overlap,ulysses,window", [
    ("contiguous", False, 2, 0), ("zigzag", True, 2, 0), ("zigzag", False, 4, 0),
    ("contiguous", False, 2, 9), ("zigzag", True, 2, 5)])
def test_hybrid_attention_equals_full_attention(world, split, overlap, ulysses, window):
    """Ulysses over groups of ``ulysses`` consecutive sp ranks, ring over the 8 / ulysses groups:
    out, dq, dk, dv equal attention over the whole sequence (8 query / 4 kv heads)."""
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.kernels import get_backend
    from mpipar.parallel.sequence.hybrid import HybridAttention
    from mpipar.parallel.sequence_split import SeqLayout

    rng = np.random.default_rng(0)
    B, S, hq, hkv, D = 2, 32, 8, 4, 6
    q, k, v, dout = (rng.normal(size=(B, S, h, D)) for h in (hq, hkv, hkv, hq))
    want = _full_attention(q, k, v, dout, window)
    lay = SeqLayout(S, 8, split)
    pos = lay.positions(world.rank)
    ledger = Ledger()
    uly = world.Split(world.rank // ulysses, world.rank)
    ring = world.Split(world.rank % ulysses, world.rank)
    attn = HybridAttention(get_backend("numpy"), Group(uly, "sp_ulysses", ledger),
                           Group(ring, "sp_ring", ledger), lay, overlap)
    out, saved = attn.forward(q[:, pos], k[:, pos], v[:, pos], pos, window)
    dq, dk, dv = attn.backward(dout[:, pos], None, None, None, out, saved, window)
    fails = _differences((out, dq, dk, dv), want, pos)
    uly.Free()
    ring.Free()
    assert_all_ranks(world, fails)
