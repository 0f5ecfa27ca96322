"""The 4D process grid: every factorisation of 8 ranks into (dp, tp, pp, sp)."""
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


def test_grid_rejects_wrong_size():
    from mpi4py import MPI
    from mpipar.runtime.topology import ProcessGrid

    with pytest.raises(ValueError, match=r"dp\*tp\*pp\*sp = 2\*1\*1\*1 = 2 must equal"):
        ProcessGrid(MPI.COMM_SELF, 2, 1, 1, 1)


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


def test_node_split_and_crossing_by_hand():
    """dp=4 tp=2 on nodes of 4: each node holds 2 ranks of each dp group (every 2nd rank), the
    inter group pairs node 0's and node 1's; nodes of 3 cannot split; tp stays inside."""
    from mpipar.runtime.topology import GridShape, NodeMap

    shape = GridShape(dp=4, tp=2, pp=1, sp=1)
    nodes = NodeMap.blocks(8, 4)
    assert shape.members("dp_sp", 1) == [1, 3, 5, 7]
    assert shape.node_split(3, nodes) == ([1, 3], [3, 7])
    assert shape.crosses("dp_sp", nodes) and not shape.crosses("tp", nodes)
    assert shape.node_split_problem(nodes) is None
    assert "hold [1, 2] ranks of one dp x sp group" in shape.node_split_problem(
        NodeMap((0, 0, 0, 1, 1, 1, 2, 2)))
    assert NodeMap.blocks(8, 4).describe() == "2 nodes x 4 ranks (--ranks-per-node)"
    hybrid = GridShape(dp=1, tp=1, pp=1, sp=8)
    assert hybrid.members("sp_ulysses", 5, ulysses=2) == [4, 5]
    assert hybrid.members("sp_ring", 5, ulysses=2) == [1, 3, 5, 7]
