"""ZeRO-3's gathered parameters: each unit all-gathered into a pooled buffer when the model
enters it, the next units of its chunk prefetched, the buffer given back when the model leaves
it (except the units the backward enters first) (:mod:`mpipar.parallel.fsdp.sharded`'s module
docstring)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mpipar.parallel.fsdp.units import BufferPool, Unit
from mpipar.runtime.comm import Group


class Gathers:
    """The gathers of ``units`` (name -> :class:`Unit`) over ``group`` into buffers of
    ``pool`` in ``compute_dtype``, bound into ``params`` while a scope reads them; ``order``:
    each unit's chunk in forward order; ``prefetch``: gathers posted ahead; ``kept``: the units
    whose forward gather stays for their backward."""

    def __init__(self, units: dict[str, Unit], order: dict[str, list[str]], group: Group,
                 pool: BufferPool, compute_dtype: Any, params: dict[str, Any], *,
                 prefetch: int, kept: set[str]) -> None:
        self.units, self.order, self.group, self.pool = units, order, group, pool
        self.compute_dtype, self.params = compute_dtype, params
        self.prefetch, self.kept = prefetch, kept
        self.keeping = True   # off for forward-only passes (:meth:`forward_only`)
        self.in_use = 0       # units gathered and entered now

    def enter(self, unit: str, backward: bool) -> None:
        """``unit`` gathered (waited for) and bound, the next units' gathers posted. A unit
        entered inside another (the tied embedding the head reads) posts none: the units after
        it are not the ones to come."""
        u = self.units[unit]
        nested = self.in_use > 0
        self.start(u)
        u.gathering.wait()
        if u.users == 0:
            bind(self.params, u, u.full)
            self.in_use += 1
        u.users += 1
        order = self.order[unit][::-1] if backward else self.order[unit]
        at = order.index(unit)
        for nxt in ([] if nested else order[at + 1:at + 1 + self.prefetch]):
            self.start(self.units[nxt])

    def leave(self, unit: str, backward: bool) -> None:
        """The gathered parameters of ``unit`` go back to the pool once no scope reads them,
        except after the forward of a unit the backward enters first."""
        u = self.units[unit]
        u.users -= 1
        if u.users == 0 and u.full is not None:
            self.in_use -= 1
            unbind(self.params, u)
            if backward or not self.keeping or unit not in self.kept:
                self.pool.give(u.full)
                u.full, u.gathering = None, None

    def start(self, u: Unit) -> None:
        if u.full is None:
            u.full = self.pool.take(u.size, self.compute_dtype)
            u.gathering = self.group.iallgather(u.owned_compute, u.full)

    def progress(self) -> None:
        for u in self.units.values():
            if u.gathering is not None:
                u.gathering.test()

    @contextmanager
    def forward_only(self) -> Iterator[None]:
        self.keeping = False
        try:
            yield
        finally:
            self.keeping = True

    def release(self) -> None:
        """Give back every gathered buffer no scope is reading, its gather completed first."""
        for u in self.units.values():
            if u.full is not None and u.users == 0:
                u.gathering.wait()
                self.pool.give(u.full)
                u.full, u.gathering = None, None


def bind(into: dict[str, Any], u: Unit, flat: Any) -> None:
    """The views of ``u``'s parameters into ``flat`` (its flat buffer), by name into ``into``."""
    for n, (s, e) in u.offsets.items():
        into[n] = flat[s:e].reshape(u.shapes[n])


def unbind(into: dict[str, Any], u: Unit) -> None:
    for n in u.names:
        into.pop(n, None)
