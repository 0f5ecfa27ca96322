"""The 4D process grid: world = pp x dp x sp x tp, TP fastest-varying, PP slowest.

``rank = ((pp_r * dp + dp_r) * sp + sp_r) * tp + tp_r`` — the row-major order of a Cartesian
communicator with dims ``[pp, dp, sp, tp]``. The SP axis is periodic (it is the attention ring).
Sub-communicators:

- ``tp``, ``pp``, ``dp``, ``sp``: one per axis;
- ``dp_sp``: the ranks that hold the same parameter shard (gradients are summed over it);
- ``tp_pp``: the ranks that together hold one model replica (the gradient norm is summed over it);
- ``pp_ends``: the first and the last pipeline rank of each (dp, sp, tp) position, which hold the
  two copies of a tied embedding (Megatron's embedding group: their gradients are summed over
  it); every other rank is alone in its ``pp_ends`` group, as is every rank when pp = 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from mpi4py import MPI

from mpipar.config import Config, require, rules

AXES = ("pp", "dp", "sp", "tp")  # slowest to fastest


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


@dataclass
class ProcessGrid:
    """Cartesian 4D grid over ``comm`` with one sub-communicator per axis and the combined groups.

    Build it over any communicator whose size is ``dp * tp * pp * sp``, so tests can make small
    grids inside a larger world (split COMM_WORLD first).
    """

    comm: MPI.Comm
    dp: int
    tp: int
    pp: int
    sp: int

    def __post_init__(self) -> None:
        size = self.dp * self.tp * self.pp * self.sp
        if min(self.dp, self.tp, self.pp, self.sp) < 1:
            raise ValueError(f"grid sizes must be >= 1, got dp={self.dp} tp={self.tp} "
                             f"pp={self.pp} sp={self.sp}")
        if size != self.comm.Get_size():
            raise ValueError(f"dp*tp*pp*sp = {self.dp}*{self.tp}*{self.pp}*{self.sp} = {size} must "
                             f"equal the communicator size {self.comm.Get_size()}")
        self.dims = [self.pp, self.dp, self.sp, self.tp]
        self.cart = self.comm.Create_cart(self.dims, periods=[False, False, True, False],
                                          reorder=False)
        self.rank = self.cart.Get_rank()
        pp_r, dp_r, sp_r, tp_r = self.cart.Get_coords(self.rank)
        self.coord = Coord(dp=dp_r, tp=tp_r, pp=pp_r, sp=sp_r)
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

    def describe(self) -> str:
        return (f"world={self.comm.Get_size()} dp={self.dp} tp={self.tp} pp={self.pp} sp={self.sp}")

    def free(self) -> None:
        for c in self.comms.values():
            c.Free()
        self.cart.Free()


@rules("grid")
def check_config(cfg: Config, world: int) -> None:
    """The grid's sizes must multiply to the world (dp = 0 fills it)."""
    p = cfg.parallel
    mp = p.tp * p.pp * p.sp
    if p.dp == 0:
        require(world % mp == 0, f"parallel: tp*pp*sp = {p.tp}*{p.pp}*{p.sp} = {mp} must divide "
                                 f"the world size {world}")
    else:
        require(p.dp * mp == world, f"parallel: dp*tp*pp*sp = {p.dp}*{p.tp}*{p.pp}*{p.sp} = "
                                    f"{p.dp * mp} must equal the world size {world}")
