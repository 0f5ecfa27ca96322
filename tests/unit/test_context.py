"""Sequence parallelism in isolation, without ranks: zigzag layouts, and the ring's hops and the
halo's plans. Ring, Ulysses and hybrid attention on 8 ranks: mpi/test_context.py."""
from __future__ import annotations

import numpy as np
import pytest


def test_zigzag_positions():
    from mpipar.parallel.sequence_split import SeqLayout

    lay = SeqLayout(16, 4, "zigzag")
    assert lay.positions(0).tolist() == [0, 1, 14, 15]
    assert lay.positions(3).tolist() == [6, 7, 8, 9]
    every = np.sort(np.concatenate([lay.positions(r) for r in range(4)]))
    assert every.tolist() == list(range(16))
    with pytest.raises(ValueError, match="seq_len=12: must be divisible by 8"):
        SeqLayout(12, 4, "zigzag")


def test_ring_hops_and_halo_plans():
    """Ring hops: ceil((W-1)/S_loc) for a contiguous split, both ways for zigzag, the whole ring
    (one way) for full causal attention; the halo is the W-1 positions before a rank's run."""
    from mpipar.parallel.sequence.halo import halo_plan
    from mpipar.parallel.sequence.ring import RingHops, ring_hops
    from mpipar.parallel.sequence_split import SeqLayout

    for W in (1, 2, 4, 5, 8, 9, 13, 17, 40):
        assert ring_hops(SeqLayout(32, 8, "contiguous"), W) == RingHops(min(7, -(-(W - 1) // 4)), 0)
    assert ring_hops(SeqLayout(32, 8, "contiguous"), 0) == RingHops(7, 0)
    assert ring_hops(SeqLayout(32, 8, "zigzag"), 0) == RingHops(7, 0)
    # zigzag chunks of 2: W = 3 reaches one chunk back, i.e. one rank each way.
    assert ring_hops(SeqLayout(32, 8, "zigzag"), 3) == RingHops(1, 1)
    assert ring_hops(SeqLayout(32, 8, "zigzag"), 5) == RingHops(2, 2)
    assert ring_hops(SeqLayout(32, 8, "zigzag"), 9) == RingHops(7, 0)   # 4 + 4 > 7 hops
    plan = halo_plan(SeqLayout(32, 8, "contiguous"), 3, 3)
    assert {s: p.tolist() for s, p in plan.recv.items()} == {2: [10, 11]}
    assert {d: i.tolist() for d, i in plan.send.items()} == {4: [2, 3]}
    plan = halo_plan(SeqLayout(32, 8, "contiguous"), 3, 7)      # 6 positions: two ranks back
    assert {s: p.tolist() for s, p in plan.recv.items()} == {1: [6, 7], 2: [8, 9, 10, 11]}
    plan = halo_plan(SeqLayout(32, 4, "zigzag"), 1, 3)          # chunks 1 and 6 of 4 positions
    assert {s: p.tolist() for s, p in plan.recv.items()} == {0: [2, 3], 2: [22, 23]}


def test_the_sp_modes_are_the_configs_and_no_mode_name_is_compared_elsewhere():
    """``--sp-mode`` accepts exactly the registry's modes, and no module outside a mode's own
    compares ``sp_mode`` with a name (it asks the mode object)."""
    import dataclasses
    import re
    from pathlib import Path

    from mpipar.config import ParallelConfig
    from mpipar.parallel.sequence.registry import SP_MODES

    field = next(f for f in dataclasses.fields(ParallelConfig) if f.name == "sp_mode")
    assert tuple(field.metadata["choices"]) == tuple(SP_MODES)
    root = Path(__file__).resolve().parents[2] / "mpipar"
    compare = re.compile(r"""sp_mode["')\]]*\s*(==|!=|\bin\b|\bnot in\b)|\.get\(\s*par\.sp_mode""")
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
            if "sequence" not in p.relative_to(root).parts[:2]
            for i, line in enumerate(p.read_text().splitlines(), 1) if compare.search(line)]
    assert not hits, hits
