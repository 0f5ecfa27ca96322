"""Data parallelism: the batch split over dp, and gradient reduction over the dp x sp group in
buckets overlapped with backward — flat or hierarchical over the nodes, dense or compressed, and
reduce-scattered for ZeRO-1.

Parameters and gradients live in flat per-bucket buffers; the ``params`` and ``grads`` dicts hold
views into them, so the model writes straight into the buffers MPI reduces. Buckets are filled in
backward order (the LM head first, the embedding last) up to ``bucket_mb`` each, and padded so
every rank's share is equal (and, for int8, whole scale blocks).

A bucket's reduction starts as soon as every gradient in it is final (``ready(names)`` from the
backward pass) and runs as a chain of non-blocking collectives, advanced whenever backward hands
over more gradients, so it overlaps the rest of the backward (:meth:`GradReducer.finish` waits
for the rest):

- ``flat``: one all-reduce over dp x sp (ZeRO-1: a reduce-scatter).
- ``hierarchical`` (Horovod's hierarchical all-reduce): reduce-scatter over the node's ranks of
  the group (``intra``, L of them), all-reduce of this rank's 1/L shard over the ranks holding
  the same shard on the other nodes (``inter``), all-gather inside the node. Inter-node bytes
  fall by L. With ZeRO-1 the shard is reduce-scattered across nodes instead, so the optimizer's
  owned slice follows the node split: ``lo = a * len / L + j * len / (L * N)`` for intra rank
  ``a`` and inter rank ``j`` (:meth:`GradReducer.owned_range`; flat is ``L = 1``).
- ``--grad-compression int8|topk`` (:mod:`mpipar.parallel.compression`) replaces the step across
  nodes (hierarchical) or over the whole group (flat): int8 all-to-alls every rank's encoded
  pieces to their owners, which sum them, re-encode and all-gather (ZeRO-1 keeps the owner's
  sum); top-k all-gathers every rank's values and indices and adds them up (ZeRO-1 keeps its
  slice). With error feedback each rank keeps the residual of each direction it encodes.
  ``dense_steps`` (``--compression-warmup``; by default a share of the steps, :func:`warmup_steps`): the first steps reduce uncompressed, as Deep
  Gradient Compression's warm-up and 1-bit Adam's ``freeze_step`` do; their residuals stay
  zero. A step skips the chain's second compressed collective (int8's all-gather) by a request
  that is already complete, so the chain's order of steps is the same every step.

The collectives of successive buckets on one communicator must start in the same order on every
rank, whatever order their requests complete in: each step of the chain that reuses a group gets
a duplicate communicator of its own, and a bucket never starts a step before the bucket launched
before it has. Both sum over the group; the global mean comes from the loss weight
``1 / tokens``. Buffers come from the kernel backend's array module (``xp``).

**Residuals in checkpoints.** A residual is per rank, not a global tensor, but it has one index
beyond the parameter element: its *slot*, the rank's place in the compressed group (its rank in
dp x sp when flat, across nodes when hierarchical). For each slot ``s`` the residuals of the
ranks in that slot tile every parameter exactly once (``residual_send.<s>``), and the owners'
second-direction residuals (int8) tile it once more (``residual_gather``), so they are saved as
global tensors like the moments (:meth:`residual_pieces`). On resume with the same number of
slots and the same codec they load slot by slot — bit-exact on the same layout; otherwise their
sum, the gradient the reduction still owes, goes into slot 0 and nothing owed is lost
(:meth:`load_residuals`); a run without error feedback ignores them.

A tied embedding's two copies (first and last pipeline stage, :mod:`mpipar.parallel.placement`) are then
summed over the ``tied`` group (Megatron's embedding group), after the dp x sp reduction as
Megatron does it: the whole gradient, or under ZeRO-1 the owned slice. Each tied parameter has a
bucket of its own, so the buffer is the same on both copies (same length, same values, same
owned slice) and the sum of two is exact: both copies see bit-identical gradients and stay
bit-identical through identical updates. The sum waits for :meth:`GradReducer.finish` rather than
blocking in backward, where the two pipeline ranks reach their final gradients at different
points of the schedule.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mpipar.runtime.comm import Group, Request
from mpipar.layout import Layout
from mpipar.parallel.compression import Codec, Int8Codec, TopKCodec
from mpipar.parallel.data_parallel.modes import reduction_of

RESIDUAL_SEND = "residual_send"
RESIDUAL_GATHER = "residual_gather"


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


class GradReducer:
    """Owns the flat buffers and reduces gradients over ``groups`` (``sharded``: ZeRO-1's
    reduce-scatter instead of the all-reduce; ``codec``: compressed across ``groups.inter``,
    with residuals when ``feedback``). ``params``: the initial master tensors (host) in any
    order; ``order``: the names in backward order (the bucket order); ``tied``: the names whose
    gradients are then summed over ``tied_group`` (the module docstring).

    Precision (:mod:`mpipar.runtime.precision`): gradients and master weights are in the dtype
    of ``params``; ``compute_dtype`` (default the same) is that of the flat compute copies the
    model reads (``self.params``): with bf16 compute the masters are held apart, whole (ZeRO-0:
    ``self.masters``) or only this rank's owned slices (ZeRO-1: ``Bucket.owned``, as Megatron's
    distributed optimizer), and :meth:`gather_params` refreshes the compute copies after an
    update (ZeRO-1: the all-gather carries them). ``reduce_dtype`` (default the gradients') is
    what the dp x sp reduction sends: the gradients are cast into a buffer of it when a bucket
    launches and cast back when its reduction ends."""

    def __init__(self, params: dict[str, Any], order: list[str], groups: ReduceGroups, *,
                 bucket_mb: float, sharded: bool, xp: ModuleType, codec: Codec | None = None,
                 feedback: bool = True, tied: Collection[str] = (),
                 tied_group: Group | None = None, dense_steps: int = 0,
                 compute_dtype: Any = None, reduce_dtype: Any = None) -> None:
        master = params[order[0]].dtype
        self.compute_dtype = master if compute_dtype is None else compute_dtype
        self.reduce_dtype = master if reduce_dtype is None else reduce_dtype
        self.mixed = self.compute_dtype != master
        self.hierarchical = groups.intra is not None
        self.dense_steps, self._compress = dense_steps, True
        if groups.intra is not None and groups.intra.size == 1:   # one rank a node: no step inside
            groups = ReduceGroups(groups.full, groups.inter)
        self.groups, self.group, self.sharded, self.xp = groups, groups.full, sharded, xp
        self.codec = codec if groups.inter.size > 1 else None
        self.feedback = feedback and self.codec is not None
        self.align = self.codec.block if isinstance(self.codec, Int8Codec) else 1
        limit = max(1, int(bucket_mb * 2**20))
        alone = {i for i, n in enumerate(order) if n in tied}
        self.buckets = [self._make_bucket(params, [order[i] for i in idx])
                        for idx in plan_buckets([params[n].nbytes for n in order], limit, alone)]
        self.tied_group = tied_group
        self.tied_buckets = [b for b in self.buckets if set(b.names) <= set(tied)]
        self.shapes = {n: tuple(params[n].shape) for n in order}
        self.params = self._views("params")
        self.grads = self._views("grads")
        self.masters = None if sharded and self.mixed else self._views("master")
        """name -> the whole local master tensor (ZeRO-0's optimizer updates them); None at
        ZeRO-1 with mixed precision, whose owned slices are the only masters."""
        self._bucket_of = {n: b for b in self.buckets for n in b.names}
        self._stages = self._stage_groups()
        self._launched: list[Bucket] = []

    def _views(self, field_name: str) -> dict[str, Any]:
        """name -> the tensor's view into each bucket's flat buffer ``field_name``."""
        return {n: getattr(b, field_name)[s:e].reshape(self.shapes[n])
                for b in self.buckets for n, (s, e) in b.offsets.items()}

    def _make_bucket(self, params: dict[str, Any], names: list[str]) -> Bucket:
        offsets, at = {}, 0
        for n in names:
            offsets[n] = (at, at + params[n].size)
            at += params[n].size
        at = padded_size(at, self.group.size, self.align)
        dtype = params[names[0]].dtype
        master = self.xp.zeros(at, dtype)
        for n in names:
            s, e = offsets[n]
            master[s:e] = self.xp.asarray(params[n]).reshape(-1)
        compute = master.astype(self.compute_dtype) if self.mixed else master
        b = Bucket(list(names), offsets, compute, self.xp.zeros(at, dtype), master=master)
        if self.reduce_dtype != dtype and self.group.size > 1:    # one rank reduces nothing
            b.wire = self.xp.empty(at, self.reduce_dtype)
        self._allocate(b)
        if self.sharded and self.mixed:   # the owned slice is all a rank keeps of the masters
            b.master = None
        return b

    def _allocate(self, b: Bucket) -> None:
        """The buffers of ``b``'s chain: the node shard, ZeRO's owned slice, the encoded
        messages and the residuals."""
        xp, dtype, length = self.xp, b.grads.dtype, b.grads.size
        L, c = self.groups.per_node, self.groups.inter.size
        m = length // L                               # the buffer reduced across nodes
        if self.groups.intra is not None:
            b.scratch["shard"] = xp.empty(m, self.reduce_dtype)
        if self.sharded:
            b.owned_grad = xp.empty(m // c, dtype)
            if b.wire is not None:
                b.scratch["owned"] = xp.empty(m // c, self.reduce_dtype)
            lo, hi = self.owned_range(b)
            b.owned = b.master[lo:hi].copy() if self.mixed else b.params[lo:hi]
        if self.codec is None:
            return
        if isinstance(self.codec, Int8Codec):
            piece = self.codec.packed_bytes(m // c, dtype.itemsize)
            b.scratch.update(send=xp.empty((c, piece), xp.uint8),
                             recv=xp.empty((c, piece), xp.uint8))
            if not self.sharded:
                b.scratch.update(sum=xp.empty(m // c, dtype), send2=xp.empty((1, piece), xp.uint8),
                                 gathered=xp.empty((c, piece), xp.uint8))
                if self.feedback:
                    b.residual[RESIDUAL_GATHER] = xp.zeros(m // c, dtype)
        else:
            piece = self.codec.packed_bytes(m, dtype.itemsize)
            b.scratch.update(send=xp.empty((1, piece), xp.uint8),
                             gathered=xp.empty((c, piece), xp.uint8))
        if self.feedback:
            b.residual[RESIDUAL_SEND] = xp.zeros(m, dtype)

    def _stage_groups(self) -> list[Group]:
        """The group of each collective of a bucket's chain, in order: a group that an earlier
        step already uses gets a duplicate communicator (a collective, at construction)."""
        g, kinds = self.groups, []
        if g.intra is not None:
            kinds.append(g.intra)                                   # reduce-scatter
        if g.inter.size > 1:
            int8 = isinstance(self.codec, Int8Codec)
            kinds += [g.inter] * (2 if int8 and not self.sharded else 1)
        if g.intra is not None and not self.sharded:
            kinds.append(g.intra)                                   # all-gather
        out, used = [], set()
        self._duplicates: list[Group] = []
        for group in kinds:
            if id(group) in used:
                group = Group(group.comm.Dup(), group.name, group.ledger, group.nodes,
                              allreduce_algorithm=group.allreduce_algorithm)
                self._duplicates.append(group)
            used.add(id(group))
            out.append(group)
        return out

    def close(self) -> None:
        """Free the duplicate communicators of the chain (MPI has a few thousand per process)."""
        for group in self._duplicates:
            group.comm.Free()
        self._duplicates = []

    @property
    def sends_sparse(self) -> bool:
        """Whether this reducer's compressed steps give sums of top-k selections with error
        feedback: a zero is then a coordinate no rank sent, whose gradient waits in the
        residuals, not a zero gradient (the optimizer's :func:`mpipar.training.optim.adamw_catch_up`)."""
        return self.feedback and isinstance(self.codec, TopKCodec)

    @property
    def sparse_sums(self) -> bool:
        """Whether this step's gradients are such sums (:attr:`sends_sparse`, past the
        warm-up)."""
        return self.sends_sparse and self._compress

    # ------------------------------------------------------------ per step
    def start_step(self, step: int = 0) -> None:
        """Before optimizer step ``step`` (0-based): its reduction is compressed unless the
        step is one of the ``dense_steps`` first."""
        self._compress = step >= self.dense_steps
        for b in self.buckets:
            b.grads.fill(0)
            b.pending = set(b.names)
            b.chain, b.request, b.started = None, None, 0
        self._launched = []

    def ready(self, names: list[str]) -> None:
        """Gradients of ``names`` are final: launch each bucket whose gradients are all final,
        and advance the reductions in flight as far as they go without waiting."""
        for n in names:
            b = self._bucket_of.get(n)
            if b is None or n not in b.pending:
                continue
            b.pending.discard(n)
            if not b.pending:
                self._launch(b)
        self._progress(block=False)

    def finish(self) -> None:
        """Complete the reduction: every gradient summed (or, with ZeRO, this rank's slice), the
        tied ones then over the tied group too."""
        launched = {id(b) for b in self._launched}
        for b in self.buckets:
            if id(b) not in launched:
                self._launch(b)
                if self.codec is None and self._stages:
                    # A staging path starts copying it now, overlapping the reductions before it.
                    self._stages[0].stage_ahead(self._reduced(b))
        self._progress(block=True)
        for b in self.tied_buckets:
            self.tied_group.allreduce_(b.owned_grad if self.sharded else b.grads)

    @staticmethod
    def _reduced(b: Bucket) -> Any:
        """The flat buffer bucket ``b``'s reduction sends: the gradients, or their copy in the
        reduce dtype."""
        return b.grads if b.wire is None else b.wire

    def _launch(self, b: Bucket) -> None:
        if b.wire is not None:
            b.wire[...] = b.grads
        b.chain, b.request, b.started = self._reduce(b), None, 0
        self._launched.append(b)

    def _progress(self, block: bool) -> None:
        """Advance every launched chain, in launch order; none may start a step before the
        chain launched before it has started that step (collective order per communicator)."""
        limit = len(self._stages)
        for b in self._launched:
            self._advance(b, limit, block)
            limit = b.started

    def _advance(self, b: Bucket, limit: int, block: bool) -> None:
        while b.chain is not None:
            if b.request is not None:
                if block:
                    b.request.wait()
                elif not b.request.test():
                    return
                b.request = None
            if limit <= b.started < len(self._stages):
                return
            try:
                b.request = next(b.chain)
                b.started += 1
            except StopIteration:
                b.chain = None

    # ------------------------------------------------------------ the chain of one bucket
    def _reduce(self, b: Bucket) -> Iterator[Request]:
        """Bucket ``b``'s reduction: yields each collective's request once started; the code
        between the yields is local work (encoding, decoding, copies)."""
        stages = iter(self._stages)
        full = x = self._reduced(b)
        owned = b.scratch.get("owned", b.owned_grad)
        if self.groups.intra is not None:
            x = b.scratch["shard"]
            yield next(stages).ireduce_scatter_(full, x)
        if self.groups.inter.size == 1:
            if self.sharded:
                owned[...] = x
        elif self.codec is None or not self._compress:
            group = next(stages)
            yield (group.ireduce_scatter_(x, owned) if self.sharded
                   else group.iallreduce_(x))
            if isinstance(self.codec, Int8Codec) and not self.sharded:
                skipped = next(stages)                       # int8's all-gather: not this step
                yield Request(None, skipped.ledger, skipped.name, "skipped", 0)
        elif isinstance(self.codec, Int8Codec):
            yield from self._int8(b, x, stages)
        else:
            yield from self._topk(b, x, stages)
        if self.groups.intra is not None and not self.sharded:
            yield next(stages).iallgather(x, full)
        if b.wire is not None:                   # back into the gradients' dtype
            if self.sharded:
                b.owned_grad[...] = owned
            else:
                b.grads[...] = b.wire

    def _int8(self, b: Bucket, x: Any, stages: Iterator[Group]) -> Iterator[Request]:
        """int8 across ``inter``: all-to-all of the encoded pieces, sum at the owner; then (not
        sharded) re-encode the sum and all-gather it back into ``x``."""
        c, s = self.groups.inter.size, b.scratch
        self.codec.encode_feedback(x.reshape(c, -1), b.residual.get(RESIDUAL_SEND), s["send"])
        yield next(stages).ialltoall(s["send"], s["recv"])
        if self.sharded:
            self.codec.decode_sum(s["recv"], b.owned_grad)
            return
        total = self.codec.decode_sum(s["recv"], s["sum"])
        self.codec.encode_feedback(total.reshape(1, -1), b.residual.get(RESIDUAL_GATHER),
                                   s["send2"])
        yield next(stages).iallgather(s["send2"], s["gathered"])
        self.codec.decode(s["gathered"], x.reshape(c, -1))

    def _topk(self, b: Bucket, x: Any, stages: Iterator[Group]) -> Iterator[Request]:
        """top-k across ``inter``: all-gather every rank's values and indices, add them up."""
        s = b.scratch
        self.codec.encode_feedback(x.reshape(1, -1), b.residual.get(RESIDUAL_SEND), s["send"])
        yield next(stages).iallgather(s["send"], s["gathered"])
        self.codec.decode_sum(s["gathered"], x)
        if self.sharded:
            j, m = self.groups.inter.rank, b.owned_grad.size
            b.owned_grad[...] = x[j * m:(j + 1) * m]

    # ------------------------------------------------------------ ZeRO-1
    def _node_range(self, b: Bucket) -> tuple[int, int]:
        """``[lo, hi)`` of the bucket this rank's node shard covers (all of it when flat)."""
        m = b.grads.size // self.groups.per_node
        a = self.groups.intra.rank if self.groups.intra is not None else 0
        return a * m, (a + 1) * m

    def owned_range(self, b: Bucket) -> tuple[int, int]:
        """``[lo, hi)`` of the flat buffer this rank owns under ZeRO-1 (and whose second-way
        int8 residual it keeps)."""
        lo, hi = self._node_range(b)
        m = (hi - lo) // self.groups.inter.size
        lo += self.groups.inter.rank * m
        return lo, lo + m

    def owned_pieces(self) -> Iterator[tuple[Bucket, str, int, int]]:
        """ZeRO-1: (bucket, name, lo, hi) of every parameter range inside this rank's owned
        slices, with ``lo, hi`` relative to the bucket's owned slice."""
        for b in self.buckets:
            a0, a1 = self.owned_range(b)
            for name, p_lo, p_hi, lo, hi in _param_ranges(b, a0, a1):
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
        n0, n1 = self._node_range(b)
        if g.inter.size > 1:
            g.inter.allgather(flat[lo:hi].copy(), flat[n0:n1])
        if g.intra is not None:
            g.intra.allgather(flat[n0:n1].copy(), flat)

    # ------------------------------------------------------------ the masters (checkpoints)
    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every local tensor this reducer holds."""
        return self.shapes

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
            if self.group.rank == 0:
                for name, t in self.masters.items():
                    yield name, 0, t.size, t.reshape(-1)
            return
        for b in self.buckets:
            a0, a1 = self.owned_range(b)
            for name, p_lo, p_hi, lo, hi in _param_ranges(b, a0, a1):
                yield name, p_lo, p_hi, b.owned[lo:hi]

    def load_local(self, name: str, value: Any) -> None:
        """Set parameter ``name`` from its whole local tensor ``value`` (host, master dtype):
        its master (whole, or this rank's owned part of it) and its compute copy
        (collective-free)."""
        b = self._bucket_of[name]
        s, e = b.offsets[name]
        flat = self.xp.asarray(value).reshape(-1)
        b.params[s:e] = flat
        if b.master is not None and self.mixed:
            b.master[s:e] = flat
        if self.sharded and self.mixed:
            a0, a1 = self.owned_range(b)
            for n, p_lo, p_hi, lo, hi in _param_ranges(b, a0, a1):
                if n == name:
                    b.owned[lo:hi] = flat[p_lo:p_hi]

    # ------------------------------------------------------------ residuals (checkpoints)
    def _residual_ranges(self, b: Bucket) -> Iterator[tuple[str, Any, int]]:
        """(kind, residual buffer, its start in the bucket) of this rank's residuals."""
        slot = self.groups.inter.rank
        if RESIDUAL_SEND in b.residual:
            yield f"{RESIDUAL_SEND}.{slot}", b.residual[RESIDUAL_SEND], self._node_range(b)[0]
        if RESIDUAL_GATHER in b.residual:
            yield RESIDUAL_GATHER, b.residual[RESIDUAL_GATHER], self.owned_range(b)[0]

    def residual_kinds(self) -> list[str]:
        """Every residual kind the ranks of this reducer's group save (each slot's sends, the
        owners' second direction): what tiles each of its parameters in a checkpoint."""
        held = self.buckets[0].residual if self.buckets else {}
        sends = ([f"{RESIDUAL_SEND}.{s}" for s in range(self.groups.inter.size)]
                 if RESIDUAL_SEND in held else [])
        return sends + ([RESIDUAL_GATHER] if RESIDUAL_GATHER in held else [])

    def residual_pieces(self) -> Iterator[tuple[str, str, int, int, Any]]:
        """``(kind, name, lo, hi, values)``: this rank's residuals as flat ranges ``[lo, hi)``
        of its local shards (see the module docstring for the kinds)."""
        for b in self.buckets:
            for kind, buf, start in self._residual_ranges(b):
                for name, p_lo, p_hi, lo, hi in _param_ranges(b, start, start + buf.size):
                    yield kind, name, p_lo, p_hi, buf[lo:hi]

    def load_residuals(self, local: Callable[[str, str], Any], kinds: set[str]) -> None:
        """Set the residuals from ``local(kind, name)`` (this rank's whole local shard of a
        saved residual) given the residual ``kinds`` a checkpoint holds: slot by slot when it
        has this run's slots and codec, else their sum into slot 0 (module docstring)."""
        if not self.feedback:
            return
        slots = sorted(k for k in kinds if k.startswith(RESIDUAL_SEND + "."))
        mine = {k for b in self.buckets[:1] for k, _, _ in self._residual_ranges(b)}
        exact = len(slots) == self.groups.inter.size and \
            (RESIDUAL_GATHER in kinds) == (RESIDUAL_GATHER in mine)
        owed = slots + sorted(kinds & {RESIDUAL_GATHER})
        for b in self.buckets:
            for kind, buf, start in self._residual_ranges(b):
                buf.fill(0)
                if not exact and (kind == RESIDUAL_GATHER or self.groups.inter.rank != 0):
                    continue
                for name, p_lo, p_hi, lo, hi in _param_ranges(b, start, start + buf.size):
                    for saved in ([kind] if exact else owed):
                        buf[lo:hi] += self.xp.asarray(local(saved, name).reshape(-1)[p_lo:p_hi])

    def describe(self) -> str:
        """The reduction in words, for the startup line."""
        g = self.groups
        how = (f"hierarchical ({g.per_node} per node x {g.inter.size} across)"
               if self.hierarchical else "flat")
        if self.codec is not None:
            how += f", {self.codec.name} compression"
            how += " with error feedback" if self.feedback else " without error feedback"
            if self.dense_steps:
                how += f" after {self.dense_steps} uncompressed steps"
        return f"dp x sp reduce {how}"


def _param_ranges(b: Bucket, start: int, stop: int) -> Iterator[tuple[str, int, int, int, int]]:
    """(name, lo, hi in the parameter's flat shard, lo, hi relative to ``start``) of every
    parameter range of bucket ``b`` inside ``[start, stop)``."""
    for name, (s, e) in b.offsets.items():
        lo, hi = max(s, start), min(e, stop)
        if lo < hi:
            yield name, lo - s, hi - s, lo - start, hi - start


def warmup_steps(layout: Layout) -> int:
    """Steps reduced uncompressed before compression starts: ``--compression-warmup``, or for
    -1 the compression's share of ``--steps`` (rounded;
    :attr:`mpipar.parallel.data_parallel.modes.Compression.warmup_share`)."""
    p = layout.parallel
    if p.compression_warmup >= 0:
        return p.compression_warmup
    return round(reduction_of(p).compression.warmup_share * layout.train.steps)
