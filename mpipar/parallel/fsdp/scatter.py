"""ZeRO-2/3's gradients: a unit's full-size gradient buffer while its backward runs, then a
non-blocking reduce-scatter to the owners, at most :data:`MAX_IN_FLIGHT` outstanding, each
received slice added to the owned gradient (:mod:`mpipar.parallel.fsdp.sharded`'s module
docstring)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from mpipar.parallel.fsdp.gather import bind, unbind
from mpipar.parallel.fsdp.units import BufferPool, Unit
from mpipar.runtime.comm import Group, Request

MAX_IN_FLIGHT = 2
"""Reduce-scatters of gradients outstanding at once (each holds one unit's full gradients)."""


class GradScatter:
    """The reduce-scatters of the units' gradients over ``group`` in ``reduce_dtype``, buffers
    from ``pool``; ``before_reduce(names)`` runs before a unit's gradients leave (sums the
    tp-partial ones over tp); ``tied``: the units whose owned gradients are then summed over
    ``tied_group``."""

    def __init__(self, group: Group, pool: BufferPool, reduce_dtype: Any,
                 before_reduce: Callable[[list[str]], None], tied: list[Unit],
                 tied_group: Group | None) -> None:
        self.group, self.pool, self.reduce_dtype = group, pool, reduce_dtype
        self.before_reduce, self.tied, self.tied_group = before_reduce, tied, tied_group
        self.grads: dict[str, Any] = {}
        self.reducing: deque[tuple[Request, Any, Unit, Any]] = deque()

    def bind(self, u: Unit) -> None:
        """A backward pass of ``u`` starts: its gradient buffer, zeroed on first use."""
        if u.grad is None:
            u.grad = self.pool.take(u.size, u.owned_grad.dtype)
            u.grad.fill(0)
            bind(self.grads, u, u.grad)
        u.grad_users += 1

    def done(self, u: Unit) -> None:
        """A backward pass of ``u`` is done: after the last, its gradients are reduce-scattered."""
        u.grad_users -= 1
        if u.grad_users:
            return
        self.before_reduce(u.names)
        unbind(self.grads, u)
        send = u.grad
        if self.reduce_dtype != send.dtype:          # --reduce-dtype: sent rounded
            send = self.pool.take(u.size, self.reduce_dtype)
            send[...] = u.grad
            self.pool.give(u.grad)
        recv = self.pool.take(u.size // self.group.size, self.reduce_dtype)
        self.reducing.append((self.group.ireduce_scatter_(send, recv), recv, u, send))
        u.grad = None
        while len(self.reducing) > MAX_IN_FLIGHT:
            self._complete_one()

    def _complete_one(self) -> None:
        req, recv, u, sent = self.reducing.popleft()
        req.wait()
        u.owned_grad += recv
        self.pool.give(recv)
        self.pool.give(sent)

    def progress(self) -> None:
        for request, *_ in self.reducing:
            request.test()

    def finish(self) -> None:
        """Every reduce-scatter completed; the tied units' owned gradients summed."""
        while self.reducing:
            self._complete_one()
        for u in self.tied:
            self.tied_group.allreduce_(u.owned_grad)
