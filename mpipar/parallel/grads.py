"""Data-parallel gradient reduction over the dp x sp group: buckets, overlap, ZeRO-1.

Parameters and gradients live in flat per-bucket buffers; the ``params`` and ``grads`` dicts hold
views into them, so the model writes straight into the buffers MPI reduces. Buckets are filled in
backward order (the LM head first, the embedding last) up to ``bucket_mb`` each.

- Without ZeRO a bucket's non-blocking all-reduce starts as soon as every gradient in it is
  final (``ready(names)`` from the backward pass), overlapping the rest of the backward.
- With ZeRO-1 each rank of the group owns a contiguous 1/n of every bucket: the gradients are
  reduce-scattered, AdamW updates the owned slice only (its moments are 1/n of the full size),
  and the parameters are all-gathered back.

Both sum over the group; the global mean comes from the loss weight ``1 / tokens``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mpipar.comm import Group, Request
from mpipar.optim import AdamWConfig, adamw_update


def plan_buckets(sizes: list[int], limit_bytes: int) -> list[list[int]]:
    """Group consecutive parameters (``sizes`` in bytes, in backward order) into buckets: a
    bucket closes once it holds at least ``limit_bytes``. Returns the indices of each bucket."""
    buckets: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
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
    params: np.ndarray                   # flat, padded to a multiple of the group size
    grads: np.ndarray
    pending: set[str] = field(default_factory=set)
    request: Request | None = None
    owned_grad: np.ndarray | None = None  # ZeRO-1: this rank's slice of the summed gradients


class GradReducer:
    """Owns the flat buffers and reduces gradients over ``group`` (optionally ZeRO-1 sharded)."""

    def __init__(self, params: dict[str, np.ndarray], order: list[str], group: Group,
                 bucket_mb: float, zero: bool) -> None:
        self.group, self.zero = group, zero
        limit = max(1, int(bucket_mb * 2**20))
        self.buckets = [self._make_bucket(params, [order[i] for i in idx])
                        for idx in plan_buckets([params[n].nbytes for n in order], limit)]
        self.params = {n: b.params[s:e].reshape(params[n].shape)
                       for b in self.buckets for n, (s, e) in b.offsets.items()}
        self.grads = {n: b.grads[s:e].reshape(params[n].shape)
                      for b in self.buckets for n, (s, e) in b.offsets.items()}
        self._bucket_of = {n: b for b in self.buckets for n in b.names}

    def _make_bucket(self, params: dict[str, np.ndarray], names: list[str]) -> Bucket:
        offsets, at = {}, 0
        for n in names:
            offsets[n] = (at, at + params[n].size)
            at += params[n].size
        at = padded_size(at, self.group.size)
        dtype = params[names[0]].dtype
        flat = np.zeros(at, dtype)
        for n in names:
            s, e = offsets[n]
            flat[s:e] = params[n].reshape(-1)
        return Bucket(list(names), offsets, flat, np.zeros(at, dtype))

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
            if not b.pending and not self.zero:
                b.request = self.group.iallreduce_(b.grads)

    def finish(self) -> None:
        """Complete the reduction: every gradient summed (or, with ZeRO, this rank's slice)."""
        for b in self.buckets:
            if self.zero:
                n = self.group.size
                owned = np.empty(b.grads.size // n, b.grads.dtype)
                self.group.reduce_scatter_(b.grads, owned)
                b.owned_grad = owned
            else:
                if b.request is None:
                    b.request = self.group.iallreduce_(b.grads)
                b.request.wait()

    # ------------------------------------------------------------ ZeRO-1
    def owned_pieces(self):
        """(bucket, name, lo, hi) of every parameter range inside this rank's owned slices,
        with ``lo, hi`` relative to the bucket's owned slice."""
        r, n = self.group.rank, self.group.size
        for b in self.buckets:
            L = b.grads.size // n
            a0, a1 = r * L, (r + 1) * L
            for name, (s, e) in b.offsets.items():
                lo, hi = max(s, a0), min(e, a1)
                if lo < hi:
                    yield b, name, lo - a0, hi - a0


class ZeroAdamW:
    """AdamW over the owned slices of a ZeRO-1 :class:`GradReducer` (moments are 1/n sized)."""

    def __init__(self, reducer: GradReducer, cfg: AdamWConfig, decay: dict[str, bool]) -> None:
        self.reducer, self.cfg, self.decay = reducer, cfg, decay
        n = reducer.group.size
        self.m = [np.zeros(b.grads.size // n, b.grads.dtype) for b in reducer.buckets]
        self.v = [np.zeros(b.grads.size // n, b.grads.dtype) for b in reducer.buckets]
        self.step_count = 0

    def norm_sq(self, counted) -> float:
        """Sum of squares of the owned gradient slices of the parameters ``counted`` accepts."""
        total = 0.0
        for b, name, lo, hi in self.reducer.owned_pieces():
            if counted(name):
                g = b.owned_grad[lo:hi]
                total += float(np.dot(g.astype(np.float64), g.astype(np.float64)))
        return total

    def owned_grads(self) -> dict[int, np.ndarray]:
        """This rank's slices of the summed gradients (what clipping scales)."""
        return dict(enumerate(b.owned_grad for b in self.reducer.buckets))

    def step(self, lr: float) -> None:
        self.step_count += 1
        red, c = self.reducer, self.cfg
        n, r = red.group.size, red.group.rank
        index = {id(b): i for i, b in enumerate(red.buckets)}
        for b, name, lo, hi in red.owned_pieces():
            i = index[id(b)]
            L = b.grads.size // n
            p = b.params[r * L + lo: r * L + hi]
            adamw_update(p, b.owned_grad[lo:hi], self.m[i][lo:hi], self.v[i][lo:hi],
                         self.step_count, lr, c.beta1, c.beta2, c.eps,
                         c.weight_decay if self.decay[name] else 0.0)
        for b in red.buckets:
            L = b.grads.size // n
            mine = b.params[r * L:(r + 1) * L].copy()
            red.group.allgather(mine, b.params)
