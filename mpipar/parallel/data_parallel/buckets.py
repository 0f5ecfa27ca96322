"""The flat buffers of the data-parallel reduction: parameters, gradients and masters laid out
in buckets (:func:`plan_buckets`, padded by :func:`padded_size`), the per-name views the model
reads and writes (:class:`FlatBuffers`), and ZeRO-1's owned slices of them: the ranges a rank
updates, gathers back after an update and reports in checkpoints. The reduction of the buckets
is :mod:`mpipar.parallel.data_parallel.chain`; the whole is
:class:`mpipar.parallel.data_parallel.reducer.GradReducer`."""
from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mpipar.runtime.comm import Group, Request

def plan_buckets(sizes: list[int], limit_bytes: int, alone: Collection[int] = ()
                 ) -> list[list[int]]:
    """Group consecutive parameters (``sizes`` in bytes, in backward order) into buckets: a
    bucket closes once it holds at least ``limit_bytes``; the indices in ``alone`` get a bucket
    of their own. Returns the indices of each bucket."""
    buckets: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if i in alone:
            buckets += [[i], []]
            continue
        buckets[-1].append(i)
        total += size
        if total >= limit_bytes:
            buckets.append([])
            total = 0
    return [b for b in buckets if b]


def padded_size(elements: int, group_size: int, align: int = 1) -> int:
    """Bucket length rounded up so every rank of the group owns an equal slice of whole
    ``align``-element blocks."""
    unit = group_size * align
    return -(-elements // unit) * unit


@dataclass
class ReduceGroups:
    """The groups one bucket's reduction runs over: ``full`` is dp x sp; ``inter`` the group
    across nodes (flat: ``full`` itself); ``intra`` this node's ranks of it (flat: None)."""

    full: Group
    inter: Group
    intra: Group | None = None

    @property
    def per_node(self) -> int:
        """L: ranks of the group on this node (1 when flat)."""
        return self.intra.size if self.intra is not None else 1


@dataclass
class Bucket:
    names: list[str]
    offsets: dict[str, tuple[int, int]]  # name -> (start, stop) in the flat buffer
    params: Any                          # flat compute copies, padded to a multiple of the group
    grads: Any                           # flat, in the master dtype
    master: Any = None                   # ZeRO-0: flat master weights (``params`` unless mixed)
    wire: Any = None                     # --reduce-dtype bfloat16: the gradients as reduced
    pending: set[str] = field(default_factory=set)
    owned_grad: Any = None               # ZeRO-1: this rank's slice of the summed gradients
    owned: Any = None                    # ZeRO-1: the master slice this rank updates (a view
                                         # of ``params`` unless mixed)
    scratch: dict[str, Any] = field(default_factory=dict)    # the chain's buffers
    residual: dict[str, Any] = field(default_factory=dict)   # kind -> this rank's residual
    chain: Iterator[Request] | None = None
    request: Request | None = None
    started: int = 0                      # collectives of the chain started this step


class FlatBuffers:
    """The buckets of ``params`` (the initial master tensors, host, any order) in backward
    ``order``, up to ``bucket_mb`` each (the names in ``tied`` a bucket each), padded so each
    rank of ``groups.full`` owns an equal slice of whole ``align``-element blocks; ``sharded``:
    ZeRO-1, a rank keeps the owned slices of the reduced gradients (and, mixed, of the masters).
    Dtypes as :class:`mpipar.parallel.data_parallel.reducer.GradReducer` gives them."""

    def __init__(self, params: dict[str, Any], order: list[str], groups: ReduceGroups, *,
                 bucket_mb: float, sharded: bool, xp: ModuleType, align: int,
                 tied: Collection[str], compute_dtype: Any, reduce_dtype: Any) -> None:
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        self.mixed = compute_dtype != params[order[0]].dtype
        self.groups, self.sharded, self.xp, self.align = groups, sharded, xp, align
        limit = max(1, int(bucket_mb * 2**20))
        alone = {i for i, n in enumerate(order) if n in tied}
        self.buckets = [self._make_bucket(params, [order[i] for i in idx])
                        for idx in plan_buckets([params[n].nbytes for n in order], limit, alone)]
        self.shapes = {n: tuple(params[n].shape) for n in order}
        self.params = self._views("params")
        self.grads = self._views("grads")
        self.masters = None if sharded and self.mixed else self._views("master")
        """name -> the whole local master tensor (ZeRO-0's optimizer updates them); None at
        ZeRO-1 with mixed precision, whose owned slices are the only masters."""
        self.bucket_of = {n: b for b in self.buckets for n in b.names}

    def _views(self, field_name: str) -> dict[str, Any]:
        """name -> the tensor's view into each bucket's flat buffer ``field_name``."""
        return {n: getattr(b, field_name)[s:e].reshape(self.shapes[n])
                for b in self.buckets for n, (s, e) in b.offsets.items()}

    def _make_bucket(self, params: dict[str, Any], names: list[str]) -> Bucket:
        offsets, at = {}, 0
        for n in names:
            offsets[n] = (at, at + params[n].size)
            at += params[n].size
        at = padded_size(at, self.groups.full.size, self.align)
        dtype = params[names[0]].dtype
        master = self.xp.zeros(at, dtype)
        for n in names:
            s, e = offsets[n]
            master[s:e] = self.xp.asarray(params[n]).reshape(-1)
        compute = master.astype(self.compute_dtype) if self.mixed else master
        b = Bucket(list(names), offsets, compute, self.xp.zeros(at, dtype), master=master)
        if self.reduce_dtype != dtype and self.groups.full.size > 1:   # one rank reduces nothing
            b.wire = self.xp.empty(at, self.reduce_dtype)
        self._allocate(b)
        if self.sharded and self.mixed:   # the owned slice is all a rank keeps of the masters
            b.master = None
        return b

    def _allocate(self, b: Bucket) -> None:
        """The node shard ``b``'s reduction sends across nodes, and ZeRO's owned slices."""
        xp, dtype, length = self.xp, b.grads.dtype, b.grads.size
        m = length // self.groups.per_node              # the buffer reduced across nodes
        if self.groups.intra is not None:
            b.scratch["shard"] = xp.empty(m, self.reduce_dtype)
        if self.sharded:
            b.owned_grad = xp.empty(m // self.groups.inter.size, dtype)
            if b.wire is not None:
                b.scratch["owned"] = xp.empty(m // self.groups.inter.size, self.reduce_dtype)
            lo, hi = self.owned_range(b)
            b.owned = b.master[lo:hi].copy() if self.mixed else b.params[lo:hi]

    # ------------------------------------------------------------ ZeRO-1's owned slices
    def node_range(self, b: Bucket) -> tuple[int, int]:
        """``[lo, hi)`` of the bucket this rank's node shard covers (all of it when flat)."""
        m = b.grads.size // self.groups.per_node
        a = self.groups.intra.rank if self.groups.intra is not None else 0
        return a * m, (a + 1) * m

    def owned_range(self, b: Bucket) -> tuple[int, int]:
        """``[lo, hi)`` of the flat buffer this rank owns under ZeRO-1 (and whose second-way
        int8 residual it keeps)."""
        lo, hi = self.node_range(b)
        m = (hi - lo) // self.groups.inter.size
        lo += self.groups.inter.rank * m
        return lo, lo + m

    def owned_pieces(self) -> Iterator[tuple[Bucket, str, int, int]]:
        """ZeRO-1: (bucket, name, lo, hi) of every parameter range inside this rank's owned
        slices, with ``lo, hi`` relative to the bucket's owned slice."""
        for b in self.buckets:
            a0, a1 = self.owned_range(b)
            for name, p_lo, p_hi, lo, hi in param_ranges(b, a0, a1):
                yield b, name, lo, hi

    def gather_params(self) -> None:
        """After an update: the compute copies from the masters. ZeRO-1: every rank's updated
        owned slices (rounded to the compute dtype first, when mixed) back into every rank's
        parameters, across nodes into the node shard, then inside the node; ZeRO-0: one cast
        per bucket when mixed, else nothing."""
        for b in self.buckets:
            if not self.sharded:
                if self.mixed:
                    b.params[...] = b.master
                continue
            lo, hi = self.owned_range(b)
            if self.mixed:
                b.params[lo:hi] = b.owned
            self._gather_slices(b, b.params)

    def _gather_slices(self, b: Bucket, flat: Any) -> None:
        """ZeRO-1: fill the flat ``flat`` (of bucket ``b``'s length, this rank's owned slice in
        place) with every rank's owned slice (collective over the reduction's groups)."""
        g = self.groups
        lo, hi = self.owned_range(b)
        n0, n1 = self.node_range(b)
        if g.inter.size > 1:
            g.inter.allgather(flat[lo:hi].copy(), flat[n0:n1])
        if g.intra is not None:
            g.intra.allgather(flat[n0:n1].copy(), flat)

    # ------------------------------------------------------------ the masters (checkpoints)
    def master_tensors(self) -> dict[str, Any]:
        """Every whole local master tensor of this rank (ZeRO-1 mixed: assembled from the owned
        slices, a collective over the reduction's groups; else no collective)."""
        if self.masters is not None:
            return self.masters
        out = {}
        for b in self.buckets:
            flat = self.xp.zeros(b.grads.size, b.grads.dtype)
            lo, hi = self.owned_range(b)
            flat[lo:hi] = b.owned
            self._gather_slices(b, flat)
            out.update({n: flat[s:e].reshape(self.shapes[n]) for n, (s, e) in b.offsets.items()})
        return out

    def param_pieces(self) -> Iterator[tuple[str, int, int, Any]]:
        """``(name, lo, hi, values)``: the ranges of the flattened local master tensors this
        rank reports (each element once over the group): its owned slices where the masters
        are held only as them (ZeRO-1 mixed), else the whole tensors on the group's rank 0."""
        if self.masters is not None:
            if self.groups.full.rank == 0:
                for name, t in self.masters.items():
                    yield name, 0, t.size, t.reshape(-1)
            return
        for b in self.buckets:
            a0, a1 = self.owned_range(b)
            for name, p_lo, p_hi, lo, hi in param_ranges(b, a0, a1):
                yield name, p_lo, p_hi, b.owned[lo:hi]

    def load_local(self, name: str, value: Any) -> None:
        """Set parameter ``name`` from its whole local tensor ``value`` (host, master dtype):
        its master (whole, or this rank's owned part of it) and its compute copy
        (collective-free)."""
        b = self.bucket_of[name]
        s, e = b.offsets[name]
        flat = self.xp.asarray(value).reshape(-1)
        b.params[s:e] = flat
        if b.master is not None and self.mixed:
            b.master[s:e] = flat
        if self.sharded and self.mixed:
            a0, a1 = self.owned_range(b)
            for n, p_lo, p_hi, lo, hi in param_ranges(b, a0, a1):
                if n == name:
                    b.owned[lo:hi] = flat[p_lo:p_hi]


def param_ranges(b: Bucket, start: int, stop: int) -> Iterator[tuple[str, int, int, int, int]]:
    """(name, lo, hi in the parameter's flat shard, lo, hi relative to ``start``) of every
    parameter range of bucket ``b`` inside ``[start, stop)``."""
    for name, (s, e) in b.offsets.items():
        lo, hi = max(s, start), min(e, stop)
        if lo < hi:
            yield name, lo - s, hi - s, lo - start, hi - start

