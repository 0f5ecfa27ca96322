"""The reduction of each bucket as a chain of non-blocking collectives (inside the node, across
nodes dense or compressed, back inside the node), launched when the bucket's gradients are final
and advanced in launch order (:mod:`mpipar.parallel.data_parallel.reducer`'s module docstring)."""
from __future__ import annotations

from collections.abc import Iterator

from typing import Any

from mpipar.parallel.compression import Codec, Int8Codec, TopKCodec
from mpipar.parallel.data_parallel.buckets import Bucket, FlatBuffers
from mpipar.parallel.data_parallel.residuals import RESIDUAL_GATHER, RESIDUAL_SEND
from mpipar.runtime.comm import Group, Request


class ReductionChain:
    """The collectives of the buckets of ``flat``: dense, or compressed across
    ``flat.groups.inter`` by ``codec`` (with residuals when ``feedback``) once the first
    ``dense_steps`` steps are done. Makes the chain's buffers (and residuals) in each bucket and
    the duplicate communicators its steps need (a collective, at construction)."""

    def __init__(self, flat: FlatBuffers, codec: Codec | None, feedback: bool,
                 dense_steps: int) -> None:
        self.flat, self.groups, self.sharded = flat, flat.groups, flat.sharded
        self.codec = codec if flat.groups.inter.size > 1 else None
        self.feedback = feedback and self.codec is not None
        self.dense_steps, self.compress = dense_steps, True
        for b in flat.buckets:
            self._allocate(b)
        self.stages = self._stage_groups()
        self.launched: list[Bucket] = []

    @property
    def int8(self) -> bool:
        return isinstance(self.codec, Int8Codec)

    def _allocate(self, b: Bucket) -> None:
        """The encoded messages and the residuals of ``b``'s chain."""
        if self.codec is None:
            return
        xp, dtype = self.flat.xp, b.grads.dtype
        c = self.groups.inter.size
        m = b.grads.size // self.groups.per_node          # the buffer reduced across nodes
        if self.int8:
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
            kinds += [g.inter] * (2 if self.int8 and not self.sharded else 1)
        if g.intra is not None and not self.sharded:
            kinds.append(g.intra)                                   # all-gather
        out, used = [], set()
        self.duplicates: list[Group] = []
        for group in kinds:
            if id(group) in used:
                group = Group(group.comm.Dup(), group.name, group.ledger, group.nodes,
                              allreduce_algorithm=group.allreduce_algorithm)
                self.duplicates.append(group)
            used.add(id(group))
            out.append(group)
        return out

    def close(self) -> None:
        """Free the duplicate communicators (MPI has a few thousand per process)."""
        for group in self.duplicates:
            group.comm.Free()
        self.duplicates = []

    @property
    def sends_sparse(self) -> bool:
        """Compressed steps give sums of top-k selections with error feedback."""
        return self.feedback and isinstance(self.codec, TopKCodec)

    # ------------------------------------------------------------ per step
    def start_step(self, step: int) -> None:
        """Before optimizer step ``step`` (0-based): compressed unless one of the first
        ``dense_steps``; nothing launched."""
        self.compress = step >= self.dense_steps
        self.launched = []

    def launch(self, b: Bucket) -> None:
        if b.wire is not None:
            b.wire[...] = b.grads
        b.chain, b.request, b.started = self._reduce(b), None, 0
        self.launched.append(b)

    def finish(self) -> None:
        """Launch every bucket not launched yet and complete every chain."""
        launched = {id(b) for b in self.launched}
        for b in self.flat.buckets:
            if id(b) not in launched:
                self.launch(b)
                if self.codec is None and self.stages:
                    # A staging path starts copying it now, overlapping the reductions before it.
                    self.stages[0].stage_ahead(reduced(b))
        self.progress(block=True)

    def progress(self, block: bool) -> None:
        """Advance every launched chain, in launch order; none may start a step before the
        chain launched before it has started that step (collective order per communicator)."""
        limit = len(self.stages)
        for b in self.launched:
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
            if limit <= b.started < len(self.stages):
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
        stages = iter(self.stages)
        full = x = reduced(b)
        owned = b.scratch.get("owned", b.owned_grad)
        if self.groups.intra is not None:
            x = b.scratch["shard"]
            yield next(stages).ireduce_scatter_(full, x)
        if self.groups.inter.size == 1:
            if self.sharded:
                owned[...] = x
        elif self.codec is None or not self.compress:
            group = next(stages)
            yield (group.ireduce_scatter_(x, owned) if self.sharded
                   else group.iallreduce_(x))
            if self.int8 and not self.sharded:
                skipped = next(stages)                       # int8's all-gather: not this step
                yield Request(None, skipped.ledger, skipped.name, "skipped", 0)
        elif self.int8:
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


def reduced(b: Bucket) -> Any:
    """The flat buffer bucket ``b``'s reduction sends: the gradients, or their copy in the
    reduce dtype."""
    return b.grads if b.wire is None else b.wire
