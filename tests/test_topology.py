"""The 4D process grid: every factorisation of 8 ranks into (dp, tp, pp, sp)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_all_ranks, factorisations


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,tp,pp,sp", factorisations(8))
def test_grid_every_factorisation(world, dp, tp, pp, sp):
    from mpipar.topology import ProcessGrid

    comm = world.Split(0 if world.rank < 8 else 1, world.rank)
    if world.rank >= 8:
        comm.Free()
        return
    grid = ProcessGrid(comm, dp, tp, pp, sp)
    me, c = comm.rank, grid.coord
    fails: list[str] = []

    def check(ok, msg):
        if not ok:
            fails.append(msg)

    # docs/architecture.md's formula, and every rank's coordinates known to every rank.
    def rank_of(dp_r, tp_r, pp_r, sp_r):
        return ((pp_r * dp + dp_r) * sp + sp_r % sp) * tp + tp_r

    check(me == rank_of(c.dp, c.tp, c.pp, c.sp), f"formula for {c}")
    # rank_coord (no communicator: the memory check before the grid exists) agrees with MPI's.
    from mpipar.topology import rank_coord
    check(rank_coord(me, dp, tp, pp, sp) == c, f"rank_coord({me}) = "
                                               f"{rank_coord(me, dp, tp, pp, sp)} != {c}")
    coords = comm.allgather(c)
    for r in range(8):
        check(rank_of(*coords[r]) == r, f"coordinates of rank {r}")

    # Every sub-communicator holds exactly the ranks that agree on the other coordinates.
    same = {"tp": ("dp", "pp", "sp"), "pp": ("dp", "tp", "sp"), "dp": ("tp", "pp", "sp"),
            "sp": ("dp", "tp", "pp"), "dp_sp": ("tp", "pp"), "tp_pp": ("dp", "sp")}
    for name, fixed in same.items():
        members = sorted(grid.comms[name].allgather(me))
        expected = sorted(r for r in range(8)
                          if all(getattr(coords[r], a) == getattr(c, a) for a in fixed))
        check(members == expected, f"{name} members {members} != {expected}")
    sizes = {"tp": tp, "pp": pp, "dp": dp, "sp": sp, "dp_sp": dp * sp, "tp_pp": tp * pp}
    for name, size in sizes.items():
        check(grid.comms[name].Get_size() == size, f"{name} size")
    # pp_ends: the first and last pipeline rank of my (dp, sp, tp) position; alone elsewhere.
    ends = {0, pp - 1}
    members = sorted(grid.comms["pp_ends"].allgather(me))
    expected = sorted(r for r in range(8) if coords[r].pp in ends and c.pp in ends
                      and all(getattr(coords[r], a) == getattr(c, a) for a in ("dp", "sp", "tp")))
    check(members == (expected or [me]), f"pp_ends members {members} != {expected or [me]}")
    check(grid.comms["pp_ends"].Get_rank() == (c.pp == pp - 1 and pp > 1), "pp_ends rank order")
    # Ranks inside an axis communicator are ordered by that axis' coordinate.
    for axis in ("tp", "pp", "dp", "sp"):
        check(grid.comms[axis].Get_rank() == getattr(c, axis), f"{axis} rank order")

    # SP ring (periodic): pass my world rank to the right, receive the left neighbour's.
    src, dst = grid.cart.Shift(2, 1)
    got = np.empty(1, dtype=np.int64)
    grid.comms["sp"].Sendrecv(np.array([me], dtype=np.int64), (c.sp + 1) % sp, 0, got,
                              (c.sp - 1) % sp, 0)
    check(got[0] == rank_of(c.dp, c.tp, c.pp, c.sp - 1) == src, "sp ring left")
    check(dst == rank_of(c.dp, c.tp, c.pp, c.sp + 1), "sp ring right")

    assert_all_ranks(comm, fails)
    grid.free()
    comm.Free()


def test_grid_rejects_wrong_size():
    from mpi4py import MPI
    from mpipar.topology import ProcessGrid

    with pytest.raises(ValueError, match=r"dp\*tp\*pp\*sp = 2\*1\*1\*1 = 2 must equal"):
        ProcessGrid(MPI.COMM_SELF, 2, 1, 1, 1)
