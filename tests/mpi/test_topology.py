"""The 4D process grid on 8 ranks: every factorisation into (dp, tp, pp, sp), the node groups, and
the nodes detected here."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_all_ranks, factorisations


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,tp,pp,sp", factorisations(8))
def test_grid_every_factorisation(world, dp, tp, pp, sp):
    from mpipar.runtime.topology import ProcessGrid

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
    from mpipar.runtime.topology import rank_coord
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


# ------------------------------------------------------------------------------------ nodes
NODE_CASES = [(8, 1, 1, 1, 4, 1), (2, 2, 1, 2, 4, 2), (2, 1, 2, 2, 2, 1), (1, 1, 1, 8, 2, 2),
              (2, 1, 1, 4, 4, 2), (1, 2, 2, 2, 2, 1)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,tp,pp,sp,k,u", NODE_CASES,
                         ids=[f"dp{a}tp{b}pp{c}sp{d}-k{k}-u{u}" for a, b, c, d, k, u in NODE_CASES])
def test_node_groups_are_the_pure_ones(world, dp, tp, pp, sp, k, u):
    """With --ranks-per-node K: the node split of dp x sp and the hybrid split of sp hold
    exactly the ranks GridShape.members says, in that order, and every group's node ids, its
    crossing and its point-to-point links follow rank // K."""
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.runtime.topology import ProcessGrid

    comm = world.Split(0 if world.rank < 8 else 1, world.rank)
    fails: list[str] = []
    grid = ProcessGrid(comm, dp, tp, pp, sp, ranks_per_node=k)
    grid.split_dp_sp_by_node()
    grid.split_sp(u)
    for name, c in grid.comms.items():
        members = c.allgather(comm.rank)
        want = grid.shape.members(name, comm.rank, grid.nodes, u)
        if members != want:
            fails.append(f"{name}: members {members} != {want}")
        group = Group(c, name, Ledger(), grid.group_nodes(name))
        if group.nodes != [r // k for r in members]:
            fails.append(f"{name}: nodes {group.nodes}")
        right = (group.rank + 1) % group.size
        if group.link_to(right) != ("intra" if members[right] // k == comm.rank // k else "inter"):
            fails.append(f"{name}: link to {members[right]}")
    if grid.nodes.nodes != tuple(r // k for r in range(8)):
        fails.append(f"node map {grid.nodes.nodes}")
    assert_all_ranks(comm, fails)
    grid.free()
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_nodes_detected_here_are_one(world):
    """This machine is one node to MPI (COMM_TYPE_SHARED): every rank on node 0."""
    from mpipar.runtime.topology import ProcessGrid

    grid = ProcessGrid(world, world.size, 1, 1, 1)
    fails = [] if grid.nodes.nodes == (0,) * world.size and not grid.crossing() else \
        [f"detected {grid.nodes.nodes}, crossing {grid.crossing()}"]
    assert "1 node x" in grid.describe() and "(detected)" in grid.describe()
    assert_all_ranks(world, fails)
    grid.free()
