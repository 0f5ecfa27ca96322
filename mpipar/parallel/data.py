"""Data parallelism: the batch split over dp, and gradient reduction over the dp x sp group in
buckets overlapped with backward (reduce-scattered for ZeRO-1).

Parameters and gradients live in flat per-bucket buffers; the ``params`` and ``grads`` dicts hold
views into them, so the model writes straight into the buffers MPI reduces. Buckets are filled in
backward order (the LM head first, the embedding last) up to ``bucket_mb`` each.

- Without ZeRO a bucket's non-blocking all-reduce starts as soon as every gradient in it is
  final (``ready(names)`` from the backward pass), overlapping the rest of the backward.
- With ZeRO-1 (``sharded``) each rank of the group owns a contiguous 1/n of every bucket: the
  gradients are reduce-scattered, and the sharded optimizer (:class:`mpipar.optim.ZeroAdamW`)
  updates the owned slices and all-gathers the parameters back.

Both sum over the group; the global mean comes from the loss weight ``1 / tokens``. Buffers come
from the kernel backend's array module (``xp``).

A tied embedding's two copies (first and last pipeline stage, :mod:`mpipar.placement`) are then
summed over the ``tied`` group (Megatron's embedding group), after the dp x sp reduction as
Megatron does it: the whole gradient, or under ZeRO-1 the owned slice. Each tied parameter has a
bucket of its own, so the buffer is the same on both copies (same length, same values, same
owned slice) and the sum of two is exact: both copies see bit-identical gradients and stay
bit-identical through identical updates. The sum waits for :meth:`GradReducer.finish` rather than
blocking in backward, where the two pipeline ranks reach their final gradients at different
points of the schedule.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mpipar.comm import Group, Request
from mpipar.config import Config, require, rules


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


def padded_size(elements: int, group_size: int) -> int:
    """Bucket length rounded up so every rank of the group owns an equal slice."""
    return -(-elements // group_size) * group_size


@dataclass
class Bucket:
    names: list[str]
    offsets: dict[str, tuple[int, int]]  # name -> (start, stop) in the flat buffer
    params: Any                          # flat, padded to a multiple of the group size
    grads: Any
    pending: set[str] = field(default_factory=set)
    request: Request | None = None
    owned_grad: Any = None               # ZeRO-1: this rank's slice of the summed gradients

    def owned_range(self, rank: int, size: int) -> tuple[int, int]:
        """``[lo, hi)`` of the flat buffer that rank ``rank`` of ``size`` owns (ZeRO-1)."""
        n = self.grads.size // size
        return rank * n, (rank + 1) * n


class GradReducer:
    """Owns the flat buffers and reduces gradients over ``group`` (``sharded``: ZeRO-1's
    reduce-scatter instead of the all-reduce). ``params``: host tensors in any order; ``order``:
    the names in backward order (the bucket order); ``tied``: the names whose gradients are then
    summed over ``tied_group`` (the module docstring)."""

    def __init__(self, params: dict[str, Any], order: list[str], group: Group,
                 bucket_mb: float, sharded: bool, xp: ModuleType, tied: Collection[str] = (),
                 tied_group: Group | None = None) -> None:
        self.group, self.sharded, self.xp = group, sharded, xp
        limit = max(1, int(bucket_mb * 2**20))
        alone = {i for i, n in enumerate(order) if n in tied}
        self.buckets = [self._make_bucket(params, [order[i] for i in idx])
                        for idx in plan_buckets([params[n].nbytes for n in order], limit, alone)]
        self.tied_group = tied_group
        self.tied_buckets = [b for b in self.buckets if set(b.names) <= set(tied)]
        self.params = {n: b.params[s:e].reshape(params[n].shape)
                       for b in self.buckets for n, (s, e) in b.offsets.items()}
        self.grads = {n: b.grads[s:e].reshape(params[n].shape)
                      for b in self.buckets for n, (s, e) in b.offsets.items()}
        self._bucket_of = {n: b for b in self.buckets for n in b.names}

    def _make_bucket(self, params: dict[str, Any], names: list[str]) -> Bucket:
        offsets, at = {}, 0
        for n in names:
            offsets[n] = (at, at + params[n].size)
            at += params[n].size
        at = padded_size(at, self.group.size)
        dtype = params[names[0]].dtype
        flat = self.xp.zeros(at, dtype)
        for n in names:
            s, e = offsets[n]
            flat[s:e] = self.xp.asarray(params[n]).reshape(-1)
        return Bucket(list(names), offsets, flat, self.xp.zeros(at, dtype))

    # ------------------------------------------------------------ per step
    def start_step(self) -> None:
        for b in self.buckets:
            b.grads.fill(0)
            b.pending = set(b.names)
            b.request = None

    def ready(self, names: list[str]) -> None:
        """Gradients of ``names`` are final: launch each bucket whose gradients are all final."""
        for n in names:
            b = self._bucket_of.get(n)
            if b is None or n not in b.pending:
                continue
            b.pending.discard(n)
            if not b.pending and not self.sharded:
                b.request = self.group.iallreduce_(b.grads)

    def finish(self) -> None:
        """Complete the reduction: every gradient summed (or, with ZeRO, this rank's slice), the
        tied ones then over the tied group too."""
        for b in self.buckets:
            if self.sharded:
                owned = self.xp.empty(b.grads.size // self.group.size, b.grads.dtype)
                self.group.reduce_scatter_(b.grads, owned)
                b.owned_grad = owned
            else:
                if b.request is None:
                    b.request = self.group.iallreduce_(b.grads)
                b.request.wait()
        for b in self.tied_buckets:
            self.tied_group.allreduce_(b.owned_grad if self.sharded else b.grads)

    def owned_pieces(self):
        """ZeRO-1: (bucket, name, lo, hi) of every parameter range inside this rank's owned
        slices, with ``lo, hi`` relative to the bucket's owned slice."""
        r, n = self.group.rank, self.group.size
        for b in self.buckets:
            a0, a1 = b.owned_range(r, n)
            for name, (s, e) in b.offsets.items():
                lo, hi = max(s, a0), min(e, a1)
                if lo < hi:
                    yield b, name, lo - a0, hi - a0


@rules("data")
def check_config(cfg: Config, world: int) -> None:
    """The global batch must split evenly over dp and into microbatches; buckets need a size."""
    p, t = cfg.parallel, cfg.train
    require(p.bucket_mb > 0, f"parallel.bucket_mb={p.bucket_mb}: must be > 0")
    dp = p.dp or world // (p.tp * p.pp * p.sp)
    require(t.global_batch_size % dp == 0,
            f"train.global_batch_size={t.global_batch_size}: must be divisible by dp={dp}")
    if t.micro_batch_size:
        require(t.global_batch_size % (dp * t.micro_batch_size) == 0,
                f"train.global_batch_size={t.global_batch_size}: must be divisible by "
                f"dp*micro_batch_size = {dp}*{t.micro_batch_size}")
