"""The 4D process grid: world = pp x dp x sp x tp, TP fastest-varying, PP slowest, and the nodes
its ranks live on.

``rank = ((pp_r * dp + dp_r) * sp + sp_r) * tp + tp_r`` — the row-major order of a Cartesian
communicator with dims ``[pp, dp, sp, tp]``. The SP axis is periodic (it is the attention ring).
Sub-communicators:

- ``tp``, ``pp``, ``dp``, ``sp``: one per axis;
- ``dp_sp``: the ranks that hold the same parameter shard (gradients are summed over it);
- ``tp_pp``: the ranks that together hold one model replica (the gradient norm is summed over it);
- ``pp_ends``: the first and the last pipeline rank of each (dp, sp, tp) position, which hold the
  two copies of a tied embedding (Megatron's embedding group: their gradients are summed over
  it); every other rank is alone in its ``pp_ends`` group, as is every rank when pp = 1;
- on request, the node split of ``dp_sp`` for hierarchical reduction (``dp_sp_intra``: its ranks
  on this rank's node; ``dp_sp_inter``: its ranks at the same place on every other node), and
  the split of ``sp`` for hybrid attention (``sp_ulysses``: ``U`` consecutive sp ranks;
  ``sp_ring``: one rank of each of those groups).

**Nodes.** :class:`NodeMap` says which node each rank is on: ``--ranks-per-node K`` makes each
``K`` consecutive ranks one node (one machine standing in for a cluster); ``K = 0`` asks MPI
(:func:`mpipar.runtime.nodes.shared_memory_nodes`: the ranks that can share memory). Group membership and node
crossing are pure functions of the grid's sizes and the node map (:class:`GridShape`), so the
planner predicts exactly what the engine's ledger records.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from mpipar.runtime.mpi_init import MPI

from mpipar.runtime.nodes import shared_memory_nodes
from mpipar.config import ConfigError

AXES = ("pp", "dp", "sp", "tp")  # slowest to fastest
GROUP_AXES = {"pp": ("pp",), "dp": ("dp",), "sp": ("sp",), "tp": ("tp",),
              "dp_sp": ("dp", "sp"), "tp_pp": ("pp", "tp")}
"""The axes each base group spans (its members differ only in these coordinates)."""


class Coord(NamedTuple):
    """A rank's position on each axis."""

    dp: int
    tp: int
    pp: int
    sp: int


def rank_coord(rank: int, dp: int, tp: int, pp: int, sp: int) -> Coord:
    """Coordinates of ``rank`` in a grid of these sizes (the inverse of the rank formula above);
    no communicator needed."""
    if not 0 <= rank < dp * tp * pp * sp:
        raise ValueError(f"rank {rank} out of range [0, {dp * tp * pp * sp})")
    return Coord(dp=(rank // (tp * sp)) % dp, tp=rank % tp, pp=rank // (tp * sp * dp),
                 sp=(rank // tp) % sp)


@dataclass(frozen=True)
class NodeMap:
    """The node of every rank of the grid (``nodes[rank]``: small integers, in order of first
    appearance)."""

    nodes: tuple[int, ...]
    given: bool = False    # from --ranks-per-node (else detected)

    @classmethod
    def blocks(cls, world: int, ranks_per_node: int) -> "NodeMap":
        """Each ``ranks_per_node`` consecutive ranks one node (0: all ranks on one node)."""
        k = ranks_per_node or world
        return cls(tuple(r // k for r in range(world)), given=ranks_per_node > 0)

    @classmethod
    def detect(cls, comm: MPI.Comm) -> "NodeMap":
        """The nodes MPI sees (:func:`mpipar.runtime.nodes.shared_memory_nodes`); a collective."""
        return cls(tuple(shared_memory_nodes(comm)))

    @property
    def count(self) -> int:
        return len(set(self.nodes))

    def sizes(self) -> list[int]:
        """Ranks on each node, by node id."""
        return np.bincount(np.asarray(self.nodes, dtype=np.int64)).tolist()

    def describe(self) -> str:
        """E.g. ``"2 nodes x 4 ranks (--ranks-per-node)"``."""
        sizes = self.sizes()
        per = str(sizes[0]) if len(set(sizes)) == 1 else "/".join(map(str, sizes))
        how = "--ranks-per-node" if self.given else "detected"
        return f"{len(sizes)} node{'s' * (len(sizes) > 1)} x {per} ranks ({how})"


@dataclass(frozen=True)
class GridShape:
    """The grid's sizes, and everything about its groups that needs no communicator."""

    dp: int
    tp: int
    pp: int
    sp: int

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.sp

    def rank_of(self, c: Coord) -> int:
        return ((c.pp * self.dp + c.dp) * self.sp + c.sp % self.sp) * self.tp + c.tp

    def coord_of(self, rank: int) -> Coord:
        return rank_coord(rank, self.dp, self.tp, self.pp, self.sp)

    def members(self, name: str, rank: int, nodes: NodeMap | None = None,
                ulysses: int = 1) -> list[int]:
        """Grid ranks of ``rank``'s instance of group ``name``, in group-rank order. The node
        split of dp_sp needs ``nodes``; the split of sp needs ``ulysses`` (its group size)."""
        c = self.coord_of(rank)
        if name in ("dp_sp_intra", "dp_sp_inter"):
            intra, inter = self.node_split(rank, nodes)
            return intra if name == "dp_sp_intra" else inter
        if name in ("sp_ulysses", "sp_ring"):
            if name == "sp_ring":
                group = range(c.sp % ulysses, self.sp, ulysses)
            else:
                group = range(c.sp - c.sp % ulysses, c.sp - c.sp % ulysses + ulysses)
            return [self.rank_of(c._replace(sp=s)) for s in group]
        if name == "pp_ends":
            ends = sorted({0, self.pp - 1})
            return [self.rank_of(c._replace(pp=p)) for p in ends] if c.pp in ends else [rank]
        axes = GROUP_AXES[name]
        out = [c]
        for axis in AXES:   # row-major over the kept axes, as MPI_Cart_sub orders them
            if axis in axes:
                out = [x._replace(**{axis: i}) for x in out
                       for i in range(getattr(self, axis))]
        return [self.rank_of(x) for x in out]

    def node_split(self, rank: int, nodes: NodeMap) -> tuple[list[int], list[int]]:
        """(dp_sp ranks on ``rank``'s node, dp_sp ranks with the same index on their node as
        ``rank`` has on its own), each in dp_sp order."""
        group = self.members("dp_sp", rank)
        index, seen = {}, {}
        for m in group:             # a rank's index among its group's ranks on its node
            index[m] = seen.get(nodes.nodes[m], 0)
            seen[nodes.nodes[m]] = index[m] + 1
        intra = [m for m in group if nodes.nodes[m] == nodes.nodes[rank]]
        inter = [m for m in group if index[m] == index[rank]]
        return intra, inter

    def instances(self, name: str, nodes: NodeMap | None = None,
                  ulysses: int = 1) -> list[list[int]]:
        """Every instance of group ``name`` (its members, as :meth:`members`), once each."""
        seen: set[int] = set()
        out = []
        for r in range(self.world):
            if r not in seen:
                group = self.members(name, r, nodes, ulysses)
                seen.update(group)
                out.append(group)
        return out

    def crosses(self, name: str, nodes: NodeMap, ulysses: int = 1) -> bool:
        """Whether any instance of group ``name`` spans more than one node."""
        return any(len({nodes.nodes[m] for m in group}) > 1
                   for group in self.instances(name, nodes, ulysses))

    def node_split_problem(self, nodes: NodeMap) -> str | None:
        """Why dp_sp cannot be reduced hierarchically on ``nodes`` (None: it can): every node
        must hold the same number of ranks of every dp x sp group it holds any of."""
        counts = {c for group in self.instances("dp_sp")
                  for c in np.unique([nodes.nodes[m] for m in group], return_counts=True)[1]}
        if len(counts) > 1:
            return (f"the nodes ({nodes.describe()}) hold {sorted(map(int, counts))} ranks of "
                    f"one dp x sp group (dp*sp = {self.dp * self.sp} ranks, every "
                    f"tp = {self.tp}-th): hierarchical reduction needs the same number on "
                    f"every node")
        return None


@dataclass
class ProcessGrid:
    """Cartesian 4D grid over ``comm`` with one sub-communicator per axis and the combined groups.

    Build it over any communicator whose size is ``dp * tp * pp * sp``, so tests can make small
    grids inside a larger world (split COMM_WORLD first). ``ranks_per_node``: 0 detects the
    nodes (a collective), K > 0 makes each K consecutive ranks a node.
    """

    comm: MPI.Comm
    dp: int
    tp: int
    pp: int
    sp: int
    ranks_per_node: int = 0

    def __post_init__(self) -> None:
        size = self.dp * self.tp * self.pp * self.sp
        if min(self.dp, self.tp, self.pp, self.sp) < 1:
            raise ValueError(f"grid sizes must be >= 1, got dp={self.dp} tp={self.tp} "
                             f"pp={self.pp} sp={self.sp}")
        if size != self.comm.Get_size():
            raise ValueError(f"dp*tp*pp*sp = {self.dp}*{self.tp}*{self.pp}*{self.sp} = {size} must "
                             f"equal the communicator size {self.comm.Get_size()}")
        self.shape = GridShape(self.dp, self.tp, self.pp, self.sp)
        self.dims = [self.pp, self.dp, self.sp, self.tp]
        self.cart = self.comm.Create_cart(self.dims, periods=[False, False, True, False],
                                          reorder=False)
        self.rank = self.cart.Get_rank()
        pp_r, dp_r, sp_r, tp_r = self.cart.Get_coords(self.rank)
        self.coord = Coord(dp=dp_r, tp=tp_r, pp=pp_r, sp=sp_r)
        self.nodes = (NodeMap.blocks(size, self.ranks_per_node) if self.ranks_per_node
                      else NodeMap.detect(self.cart))
        self.ulysses = 1
        self.comms: dict[str, MPI.Comm] = {}
        for name, keep in (("pp", "pp"), ("dp", "dp"), ("sp", "sp"), ("tp", "tp"),
                           ("dp_sp", "dp sp"), ("tp_pp", "tp pp")):
            remain = [axis in keep.split() for axis in AXES]
            self.comms[name] = self.cart.Sub(remain)
        self.comms["pp_ends"] = self._pp_ends()

    def _pp_ends(self) -> MPI.Comm:
        """The ``pp_ends`` communicator (module docstring): one per (dp, sp, tp) position on the
        first and last pipeline ranks, ordered by pipeline rank; a singleton elsewhere."""
        c = self.coord
        position = (c.dp * self.sp + c.sp) * self.tp + c.tp
        end = c.pp in (0, self.pp - 1)
        color = position if end else self.dp * self.sp * self.tp + self.rank
        return self.cart.Split(color, c.pp)

    def split_dp_sp_by_node(self) -> None:
        """Add ``dp_sp_intra`` and ``dp_sp_inter`` (hierarchical reduction); ConfigError when the
        nodes do not split dp x sp evenly (the same answer on every rank: the node map is).
        Asked again, it keeps the groups it made."""
        if "dp_sp_intra" in self.comms:
            return
        problem = self.shape.node_split_problem(self.nodes)
        if problem:
            raise ConfigError(f"parallel.dp_reduce='hierarchical': {problem}")
        intra, _ = self.shape.node_split(self.rank, self.nodes)
        parent = self.comms["dp_sp"]
        key = parent.Get_rank()
        self.comms["dp_sp_intra"] = parent.Split(self.nodes.nodes[self.rank], key)
        self.comms["dp_sp_inter"] = parent.Split(intra.index(self.rank), key)

    def split_sp(self, ulysses: int) -> None:
        """Add ``sp_ulysses`` (``ulysses`` consecutive sp ranks) and ``sp_ring`` (hybrid SP)."""
        self.ulysses = ulysses
        parent, s = self.comms["sp"], self.coord.sp
        self.comms["sp_ulysses"] = parent.Split(s // ulysses, s)
        self.comms["sp_ring"] = parent.Split(s % ulysses, s)

    def group_nodes(self, name: str) -> list[int]:
        """The node of each rank of this rank's instance of group ``name``, by group rank."""
        return [self.nodes.nodes[m] for m in
                self.shape.members(name, self.rank, self.nodes, self.ulysses)]

    def crossing(self) -> list[str]:
        """Names of the groups of more than one rank some instance of which spans nodes."""
        return [name for name, c in self.comms.items()
                if c.Get_size() > 1 and self.shape.crosses(name, self.nodes, self.ulysses)]

    def describe(self) -> str:
        text = (f"world={self.comm.Get_size()} dp={self.dp} tp={self.tp} pp={self.pp} "
                f"sp={self.sp} | {self.nodes.describe()}")
        if self.nodes.count > 1:
            text += f", across nodes: {', '.join(self.crossing()) or 'none'}"
        return text

    def free(self) -> None:
        for c in self.comms.values():
            c.Free()
        self.cart.Free()
