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
from types import ModuleType
from typing import Any

from mpipar.layout import Layout
from mpipar.parallel.compression import Codec, Int8Codec
from mpipar.parallel.data_parallel import residuals
from mpipar.parallel.data_parallel.buckets import Bucket, FlatBuffers, ReduceGroups
from mpipar.parallel.data_parallel.chain import ReductionChain
from mpipar.parallel.data_parallel.modes import reduction_of
from mpipar.runtime.comm import Group


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
        self.hierarchical = groups.intra is not None
        if groups.intra is not None and groups.intra.size == 1:   # one rank a node: no step inside
            groups = ReduceGroups(groups.full, groups.inter)
        compressed = codec if groups.inter.size > 1 else None
        self.flat = FlatBuffers(
            params, order, groups, bucket_mb=bucket_mb, sharded=sharded, xp=xp,
            align=compressed.block if isinstance(compressed, Int8Codec) else 1, tied=tied,
            compute_dtype=master if compute_dtype is None else compute_dtype,
            reduce_dtype=master if reduce_dtype is None else reduce_dtype)
        self.chain = ReductionChain(self.flat, codec, feedback, dense_steps)
        self.tied_group = tied_group
        self.tied_buckets = [b for b in self.flat.buckets if set(b.names) <= set(tied)]
        # what the model, the optimizer and the checkpoints read of the buffers
        self.buckets, self.params, self.grads = self.flat.buckets, self.flat.params, self.flat.grads
        self.masters = self.flat.masters

    # ------------------------------------------------------------ what the reduction is
    groups = property(lambda self: self.flat.groups)
    group = property(lambda self: self.flat.groups.full, doc="dp x sp: the whole group")
    sharded = property(lambda self: self.flat.sharded, doc="ZeRO-1")
    xp = property(lambda self: self.flat.xp)
    mixed = property(lambda self: self.flat.mixed)
    compute_dtype = property(lambda self: self.flat.compute_dtype)
    reduce_dtype = property(lambda self: self.flat.reduce_dtype)
    shapes = property(lambda self: self.flat.shapes)
    codec = property(lambda self: self.chain.codec, doc="None where nothing is compressed")
    feedback = property(lambda self: self.chain.feedback)
    dense_steps = property(lambda self: self.chain.dense_steps)

    def close(self) -> None:
        """Free the duplicate communicators of the chain (MPI has a few thousand per process)."""
        self.chain.close()

    @property
    def sends_sparse(self) -> bool:
        """Whether this reducer's compressed steps give sums of top-k selections with error
        feedback: a zero is then a coordinate no rank sent, whose gradient waits in the
        residuals, not a zero gradient (the optimizer's :func:`mpipar.training.optim.adamw_catch_up`)."""
        return self.chain.sends_sparse

    @property
    def sparse_sums(self) -> bool:
        """Whether this step's gradients are such sums (:attr:`sends_sparse`, past the
        warm-up)."""
        return self.sends_sparse and self.chain.compress

    # ------------------------------------------------------------ per step
    def start_step(self, step: int = 0) -> None:
        """Before optimizer step ``step`` (0-based): its reduction is compressed unless the
        step is one of the ``dense_steps`` first."""
        self.chain.start_step(step)
        for b in self.buckets:
            b.grads.fill(0)
            b.pending = set(b.names)
            b.chain, b.request, b.started = None, None, 0

    def ready(self, names: list[str]) -> None:
        """Gradients of ``names`` are final: launch each bucket whose gradients are all final,
        and advance the reductions in flight as far as they go without waiting."""
        for n in names:
            b = self.flat.bucket_of.get(n)
            if b is None or n not in b.pending:
                continue
            b.pending.discard(n)
            if not b.pending:
                self.chain.launch(b)
        self.chain.progress(block=False)

    def finish(self) -> None:
        """Complete the reduction: every gradient summed (or, with ZeRO, this rank's slice), the
        tied ones then over the tied group too."""
        self.chain.finish()
        for b in self.tied_buckets:
            self.tied_group.allreduce_(b.owned_grad if self.sharded else b.grads)

    # ------------------------------------------------------------ ZeRO-1, the masters
    def owned_range(self, b: Bucket) -> tuple[int, int]:
        """``[lo, hi)`` of the flat buffer this rank owns under ZeRO-1."""
        return self.flat.owned_range(b)

    def owned_pieces(self) -> Iterator[tuple[Bucket, str, int, int]]:
        """ZeRO-1: (bucket, name, lo, hi) of every parameter range inside this rank's owned
        slices (:meth:`FlatBuffers.owned_pieces`)."""
        return self.flat.owned_pieces()

    def gather_params(self) -> None:
        """After an update: the compute copies from the masters (ZeRO-1: every rank's owned
        slices gathered back; :meth:`FlatBuffers.gather_params`)."""
        self.flat.gather_params()

    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every local tensor this reducer holds."""
        return self.flat.shapes

    def master_tensors(self) -> dict[str, Any]:
        """Every whole local master tensor of this rank (:meth:`FlatBuffers.master_tensors`)."""
        return self.flat.master_tensors()

    def param_pieces(self) -> Iterator[tuple[str, int, int, Any]]:
        """``(name, lo, hi, values)``: the ranges of the local master tensors this rank reports
        (:meth:`FlatBuffers.param_pieces`)."""
        return self.flat.param_pieces()

    def load_local(self, name: str, value: Any) -> None:
        """Set parameter ``name`` from its whole local tensor ``value`` (collective-free)."""
        self.flat.load_local(name, value)

    # ------------------------------------------------------------ residuals (checkpoints)
    def residual_kinds(self) -> list[str]:
        """Every residual kind the ranks of this reducer's group save (each slot's sends, the
        owners' second direction): what tiles each of its parameters in a checkpoint."""
        return residuals.residual_kinds(self.flat)

    def residual_pieces(self) -> Iterator[tuple[str, str, int, int, Any]]:
        """``(kind, name, lo, hi, values)``: this rank's residuals as flat ranges ``[lo, hi)``
        of its local shards (see the module docstring for the kinds)."""
        return residuals.residual_pieces(self.flat)

    def load_residuals(self, local: Callable[[str, str], Any], kinds: set[str]) -> None:
        """Set the residuals from ``local(kind, name)`` given the residual ``kinds`` a
        checkpoint holds: slot by slot when it has this run's slots and codec, else their sum
        into slot 0 (module docstring); nothing without error feedback."""
        if self.feedback:
            residuals.load_residuals(self.flat, local, kinds)

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


def warmup_steps(layout: Layout) -> int:
    """Steps reduced uncompressed before compression starts: ``--compression-warmup``, or for
    -1 the compression's share of ``--steps`` (rounded;
    :attr:`mpipar.parallel.data_parallel.modes.Compression.warmup_share`)."""
    p = layout.parallel
    if p.compression_warmup >= 0:
        return p.compression_warmup
    return round(reduction_of(p).compression.warmup_share * layout.train.steps)
