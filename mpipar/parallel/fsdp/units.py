"""ZeRO-2/3's storage pieces: a :class:`Unit` (one unit's flat buffers on a rank, laid out by
:func:`make_unit`) and the :class:`BufferPool` of whole-unit buffers that gathers and gradients
reuse."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from mpipar.parallel.data_parallel.buckets import padded_size
from mpipar.runtime.comm import Group, Request


@dataclass
class Unit:
    """One unit's flat storage on this rank. ``offsets``: name -> (start, stop) in the flat
    buffer of ``size`` elements (a multiple of the group size)."""

    name: str
    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    offsets: dict[str, tuple[int, int]]
    size: int
    owned: Any                    # [size / n] this rank's master parameters (a view of full
                                  # at ZeRO-2 and in node shared memory, unless mixed)
    owned_grad: Any               # [size / n] this rank's summed gradients
    full: Any = None              # [size] the whole compute copies (ZeRO-3: only while
                                  # gathered)
    owned_compute: Any = None     # ZeRO-3 gathered: the compute copy of ``owned`` it sends
    gathering: Request | None = None
    users: int = 0                # scopes reading ``full`` now
    grad: Any = None              # [size] this microbatch's gradients while backward runs
    grad_users: int = 0           # backward passes still writing ``grad``
    lo: int = 0                   # [lo, hi): the slice of the unit this rank owns
    hi: int = 0

    def owned_names(self) -> Iterator[tuple[str, int, int]]:
        """(name, lo, hi) of every parameter range inside the owned slice, relative to it."""
        for name, (s, e) in self.offsets.items():
            lo, hi = max(s, self.lo), min(e, self.hi)
            if lo < hi:
                yield name, lo - self.lo, hi - self.lo

    def refresh(self, gather: bool) -> None:
        """The compute copy of the owned slice from its master (mixed precision; one cast):
        ZeRO-3's ``owned_compute`` (``gather``), else the slice of the whole parameters."""
        if gather:
            self.owned_compute[...] = self.owned
        else:
            self.full[self.lo:self.hi] = self.owned

    def load(self, name: str, flat: Any, mixed: bool, gather: bool) -> None:
        """The owned part of parameter ``name`` from its whole flat tensor ``flat`` (master
        dtype), and its compute copy when ``mixed`` (rounded once)."""
        s, e = self.offsets[name]
        lo, hi = max(s, self.lo), min(e, self.hi)
        if lo < hi:
            self.owned[lo - self.lo:hi - self.lo] = flat[lo - s:hi - s]
            if mixed:
                (self.owned_compute[lo - self.lo:hi - self.lo] if gather else
                 self.full[lo:hi])[...] = flat[lo - s:hi - s]


class BufferPool:
    """Reusable flat buffers by length and dtype: a released buffer serves the next request of
    its size and dtype."""

    def __init__(self, xp: ModuleType) -> None:
        self.xp = xp
        self.free: dict[tuple[int, Any], list[Any]] = {}

    def take(self, size: int, dtype: Any) -> Any:
        stack = self.free.get((size, dtype))
        return stack.pop() if stack else self.xp.empty(size, dtype)

    def give(self, buf: Any) -> None:
        self.free.setdefault((buf.size, buf.dtype), []).append(buf)


def make_unit(unit: str, names: list[str], values: dict[str, Any], group: Group,
              xp: ModuleType, *, compute_dtype: Any, gather: bool, frozen: bool,
              node: Any = None) -> Unit:
    """The unit of parameters ``names`` (``values``: their master tensors), laid out flat in
    that order and padded to a multiple of ``group``'s size: this rank keeps its slice of the
    masters (``gather``: ZeRO-3) or the whole (ZeRO-2, or in ``node``'s copy, a
    :class:`mpipar.parallel.fsdp.node_copy.NodeCopy`), the whole parameters as compute copies
    in ``compute_dtype``; no gradient slice when ``frozen``."""
    offsets, at = {}, 0
    for n in names:
        offsets[n] = (at, at + values[n].size)
        at += values[n].size
    size = padded_size(at, group.size)
    master = xp.zeros(size, values[names[0]].dtype)
    for n in names:
        s, e = offsets[n]
        master[s:e] = xp.asarray(values[n]).reshape(-1)
    mixed = compute_dtype != master.dtype
    full = master.astype(compute_dtype) if mixed else master
    k = size // group.size
    lo, hi = group.rank * k, (group.rank + 1) * k
    if node is not None:         # this rank writes its slice of the node's copy
        full = node.hold(full, lo, hi)
    owned = master[lo:hi].copy() if gather or mixed else full[lo:hi]
    u = Unit(unit, list(names), {n: tuple(values[n].shape) for n in names}, offsets, size,
             owned, None if frozen else xp.zeros(hi - lo, master.dtype),
             None if gather else full, lo=lo, hi=hi)
    if gather:
        u.owned_compute = full[lo:hi].copy() if mixed else owned
    return u
