"""The 4D process grid without ranks: a grid of the wrong size is refused; the node split and which
groups cross nodes, by hand. Every factorisation of 8 ranks: mpi/test_topology.py."""
from __future__ import annotations

import pytest


def test_grid_rejects_wrong_size():
    from mpi4py import MPI
    from mpipar.runtime.topology import ProcessGrid

    with pytest.raises(ValueError, match=r"dp\*tp\*pp\*sp = 2\*1\*1\*1 = 2 must equal"):
        ProcessGrid(MPI.COMM_SELF, 2, 1, 1, 1)


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
