"""ZeRO-3 in node shared memory: each unit one MPI-3 shared window over the group's ranks on the
node (``intra``), each rank allocating and writing its slice; across nodes each node holds a
copy, the updated slices all-gathered over ``inter`` (:mod:`mpipar.parallel.fsdp.sharded`'s
module docstring)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mpipar.parallel.fsdp.units import Unit
from mpipar.runtime.comm import Group, SharedArray


class NodeCopy:
    """The node's copy of the units of a rank at ``position`` in the dp x sp group of ``size``
    ranks: its windows over ``intra``, and ``across``, the position of each rank of ``inter``
    whose slices it gathers into the node's copy (None on one node)."""

    def __init__(self, position: int, size: int, intra: Group, inter: Group | None) -> None:
        self.size, self.intra, self.inter = size, intra, inter
        self.windows: list[SharedArray] = []
        self.across = (inter.allgather_object(position)
                       if inter is not None and inter.size > 1 else None)
        self.stale = False        # a rank wrote its slices and has not published them yet

    def hold(self, full: Any, lo: int, hi: int) -> Any:
        """A window for a unit whose compute copy is ``full``: this rank's slice ``[lo, hi)``
        written into it; returns the node's whole array."""
        window = self.intra.shared_array(full.size // self.intra.size, full.dtype)
        self.windows.append(window)
        window.array[lo:hi] = full[lo:hi]
        return window.array

    def publish(self, units: Iterable[Unit]) -> None:
        """Every rank's writes to its slices become visible to all (across nodes, each rank
        first all-gathers the slices of the ranks in its place on the other nodes into its
        node's copy)."""
        if self.across is not None:
            for u in units:
                k = u.size // self.size
                self.inter.allgather_in_place(u.full, k, [p * k for p in self.across])
        self.intra.sync_shared(self.windows)
        self.stale = False

    def describe(self) -> str:
        copies = ("" if self.across is None else
                  f", a copy on each of {len(self.across)} nodes, the updated slices "
                  f"all-gathered across them")
        return (f"ZeRO-3 (parameters in node shared memory{copies}: each rank holds "
                f"1/{self.intra.size} of them and reads the rest in place)")

    @property
    def shared_bytes(self) -> int:
        """Bytes of node shared memory this rank allocated (its part of the node's copy)."""
        return sum(w.array.nbytes for w in self.windows) // self.intra.size

    def free(self) -> None:
        """Free the windows (a collective)."""
        for w in self.windows:
            w.free()
        self.windows = []
