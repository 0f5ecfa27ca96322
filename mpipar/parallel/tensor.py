"""Tensor parallelism (Megatron-LM): column- and row-parallel linears, the vocabulary-parallel
embedding and cross-entropy, and sequence parallelism inside the tp group.

Which parameter is split how is the placement table's business (:mod:`mpipar.parallel.placement`,
its tensor-parallel role per parameter: ``column``, ``row``, ``vocab`` or ``replicated``); this
module is what the split means for the activations. A :class:`TensorParallel` is the tp group as
a block sees it (:class:`mpipar.model.tensor_ops.TensorOps`): the block applies its linears by
name, and the role the table gives each decides the communication around it, so the weight
split and the activations' traffic follow one declaration:

- A *column-parallel* linear (q/k/v, gate/up: whole heads or FFN columns per rank) needs the
  whole input on every rank and produces this rank's output columns; a *row-parallel* linear
  (o, down) takes this rank's columns and produces a partial sum of the whole output. Between
  them every op is local (attention over this rank's heads, SwiGLU over its FFN columns). A
  *replicated* linear (every rank holds the whole weight) is local on whatever it is given.
- Entering the region (:meth:`TensorParallel.enter`, Megatron's ``f``): identity forward,
  all-reduce of the input gradient backward. Leaving it (:meth:`TensorParallel.leave`, ``g``):
  all-reduce forward, identity backward.
- With ``sequence_parallel`` (Megatron's ``--sequence-parallel``, mpipar's
  ``--tp-sequence-parallel``) the residual stream between regions, and so the norms, residual
  adds and pipeline messages, hold only this rank's shard of the tokens: ``[N/tp, H]`` with
  ``N = B * S`` tokens in row-major order. Entering all-gathers the shards (backward:
  reduce-scatter of the input gradient); leaving reduce-scatters the partial sums (backward:
  all-gather). The bytes sent equal those of the all-reduces; the stream's memory falls by tp.
  Norm weights then see token shards: their gradients are partial over tp
  (:meth:`TensorParallel.reduce_partial_grads`).
- The embedding and the LM head are vocabulary-parallel: each rank holds a slice of the (padded)
  vocabulary; the embedding's partial rows are summed on leaving, and the cross-entropy reduces
  three numbers a token (max, sum of exponentials, target logit) instead of gathering logits.

Stream shapes: ``[B, S, H]`` without sequence parallelism, ``[B*S/tp, H]`` with it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpipar.parallel.axis import AxisUnit, StepRank
from mpipar.parallel.calls import Call
from mpipar.runtime.comm import Group
from mpipar.runtime.precision import Precision
from mpipar.config import require
from mpipar.layout import Layout
from mpipar.model.attention import accumulator
from mpipar.model.lora import Adapters
from mpipar.model.params import bias_name
from mpipar.model.tensor_ops import LinearBackward
from mpipar.parallel.placement import PlacementTable, padded_vocab

Array = Any
ENTERS = ("column", "vocab")
"""The roles whose linears read the whole input: it enters the tp region
(:meth:`TensorParallel.enter`)."""


def _accumulate(total: Array | None, part: Array | None) -> Array | None:
    """``total + part`` (either may be None), summed in float32 under bf16 compute."""
    if total is None or part is None:
        return part if total is None else total
    total = total.astype(accumulator(part.dtype), copy=False)
    total += part
    return total


@dataclass(frozen=True)
class VocabShard:
    """The rows ``[start, start + local)`` of the (padded) vocabulary held by one tp rank."""

    start: int
    local: int
    size: int  # true vocabulary size (ids >= size are padding)

    @classmethod
    def of(cls, vocab_size: int, tp_rank: int, tp_size: int) -> "VocabShard":
        local = padded_vocab(vocab_size, tp_size) // tp_size
        return cls(tp_rank * local, local, vocab_size)


class TensorParallel:
    """The tp group as a block sees it (see the module docstring): each linear, the embedding
    and the cross-entropy as ``table`` (:class:`mpipar.parallel.placement.PlacementTable`)
    places their weights, with its sequence parallelism. ``group=None`` is a tp size of 1:
    every op is local. ``kernels`` is the backend whose ops and array module are used.
    ``adapters``: the LoRA adapters the linears add (:class:`mpipar.model.lora.Adapters`; their
    factors split as :func:`mpipar.parallel.placement.adapter_roles` says), or None."""

    def __init__(self, *, kernels, table: PlacementTable, group: Group | None = None,
                 adapters: Adapters | None = None) -> None:
        self.kernels, self.xp = kernels, kernels.xp
        self.table, self.group, self.adapters = table, group, adapters
        self.size = group.size if group is not None else 1
        self.rank = group.rank if group is not None else 0
        self.sequence_parallel = table.tp_sequence_parallel and self.size > 1
        self.vocab = VocabShard.of(table.model.vocab_size, self.rank, self.size)
        for row in table:
            if row.tp == "row" and bias_name(row.name) in table.rows:
                raise ValueError(f"{row.name}: a row-parallel linear with a bias (added after "
                                 f"the sum over tp) is not supported")

    def role(self, names: Sequence[str]) -> str:
        """The role the placement table gives the linears ``names``, which share one input."""
        roles = set()
        for name in names:
            if name not in self.table.rows:
                raise KeyError(f"{name}: the model applies it, but the placement table has no "
                               f"row for it")
            roles.add(self.table[name].tp)
        if len(roles) != 1:
            raise ValueError(f"linears {list(names)} share one input, but the placement table "
                             f"gives them the roles {sorted(roles)}")
        return roles.pop()

    # ------------------------------------------------------------------ the stream
    def stream_shape(self, batch: int, seq: int, hidden: int) -> tuple[int, ...]:
        """Shape of the residual stream of a ``[batch, seq]`` microbatch on this rank."""
        if self.sequence_parallel:
            return (batch * seq // self.size, hidden)
        return (batch, seq, hidden)

    def enter(self, x: Array) -> Array:
        """Input of a column-parallel region: the whole ``x`` (all-gathered token shards under
        sequence parallelism: ``[N/tp, H]`` -> ``[N, H]``)."""
        if not self.sequence_parallel:
            return x
        out = self.xp.empty((self.size * x.shape[0],) + x.shape[1:], x.dtype)
        return self.group.allgather(self.xp.ascontiguousarray(x), out)

    def enter_backward(self, dx: Array) -> Array:
        """Gradient of :meth:`enter`: the sum over tp of the partial input gradients (all-reduce,
        or reduce-scatter to this rank's token shard)."""
        if self.size == 1:
            return dx
        if not self.sequence_parallel:
            return self.group.allreduce_(dx)
        flat = self.xp.ascontiguousarray(dx.reshape(-1, dx.shape[-1]))
        out = self.xp.empty((flat.shape[0] // self.size, flat.shape[1]), dx.dtype)
        return self.group.reduce_scatter_(flat, out)

    def leave(self, y: Array) -> Array:
        """Output of a row-parallel region: the sum over tp of the partial outputs (all-reduce,
        or reduce-scatter to this rank's token shard)."""
        return self.enter_backward(y)

    def leave_backward(self, dy: Array) -> Array:
        """Gradient of :meth:`leave`: identity, or the all-gather of the token shards."""
        return self.enter(dy)

    # ------------------------------------------------------------------ linears
    def linear_input(self, x: Array, names: Sequence[str]) -> Array:
        """``x`` as the linears ``names`` read it: entered into the region (column- and
        vocabulary-parallel), else as it is (row-parallel: this rank's columns; replicated)."""
        return self.enter(x) if self.role(names) in ENTERS else x

    def linear(self, params: dict[str, Array], names: Sequence[str], x_in: Array) -> list[Array]:
        """``x_in @ w.T (+ b)`` for each weight of ``names``: this rank's output columns
        (column-, vocabulary-parallel), the sum over tp of the partial outputs (row-parallel:
        :meth:`leave`), or the whole output (replicated)."""
        if len(names) > 1:
            ys = self._stacked_linear(params, names, x_in)
        else:
            ys = [self.kernels.linear_fwd(x_in, params[n], params.get(bias_name(n)))
                  for n in names]
        if self.adapters is not None:   # before the sum over tp: one collective
            ys = [self.adapters.forward(params, n, x_in, y) for n, y in zip(names, ys)]
        return [self.leave(y) for y in ys] if self.role(names) == "row" else ys

    def _stacked_linear(self, params: dict[str, Array], names: Sequence[str], x_in: Array
                        ) -> list[Array]:
        """Linears sharing an input (q/k/v, gate/up: column-parallel) as one GEMM of ``x_in``
        against their weights stacked along the outputs, the output cut back into one
        contiguous array per weight. Stacking copies the weights (``out x in``), which is
        ``1 / tokens`` of the GEMM's work."""
        xp = self.xp
        ws = [params[n] for n in names]
        bs = [params.get(bias_name(n)) for n in names]
        bias = None
        if any(b is not None for b in bs):
            bias = xp.concatenate([xp.zeros(w.shape[0], w.dtype) if b is None else b
                                   for w, b in zip(ws, bs)])
        y = self.kernels.linear_fwd(x_in, self.kernels.concat(ws, axis=0), bias)
        return self.kernels.split_columns(y, [w.shape[0] for w in ws])

    def linear_backward(self, dys: Sequence[Array], x_in: Array, names: Sequence[str],
                        linear_backward: LinearBackward) -> Array:
        """Input gradient of :meth:`linear` (weight gradients through ``linear_backward``),
        in the shape of the ``x`` whose :meth:`linear_input` was ``x_in``: a row-parallel
        output's gradient is first made whole (:meth:`leave_backward`); the partial input
        gradients are summed (in float32 under bf16 compute, rounded once), and over tp
        (:meth:`enter_backward`) where the input entered."""
        role = self.role(names)
        lead = x_in.shape[:-1]
        if role == "row":
            dys = [self.leave_backward(dy) for dy in dys]
        dys = [dy.reshape(lead + (-1,)) for dy in dys]
        if len(names) > 1:     # column-parallel: one GEMM against the stacked weights
            dx = linear_backward.group(dys, x_in, names)
        else:
            dx = None
            for dy, name in zip(dys, names):
                dx = _accumulate(dx, linear_backward(dy, x_in, name))
        if self.adapters is not None:
            for dy, name in zip(dys, names):
                dx = _accumulate(dx, self.adapters.backward(linear_backward.params,
                                                            linear_backward.grads, name, dy,
                                                            x_in))
        dx = dx.astype(x_in.dtype, copy=False)
        return self.enter_backward(dx) if role in ENTERS else dx

    # ------------------------------------------------------------------ vocabulary parallel
    def embed(self, params: dict[str, Array], name: str, ids: Array) -> Array:
        """Stream ``x`` of token ids ``[B, S]``: this rank's rows of the vocabulary-parallel
        embedding ``params[name]`` ``[V/tp, H]``, summed over tp (ids held by another rank give
        zero rows here)."""
        x = self.kernels.embedding_fwd(params[self._vocabulary(name)], ids, self.vocab.start)
        return self.leave(x) if self.size > 1 else x

    def embed_backward(self, grads: dict[str, Array], name: str, dx: Array, ids: Array) -> None:
        """Accumulate into ``grads[name]`` the gradient of this rank's embedding rows (``dx`` in
        the stream's shape)."""
        if name not in grads:           # frozen (LoRA)
            return
        full = self.leave_backward(dx).reshape(ids.shape + (dx.shape[-1],))
        self.kernels.embedding_bwd(grads[self._vocabulary(name)], full, ids, self.vocab.start)

    def _vocabulary(self, name: str) -> str:
        """``name``, which the placement table must place vocabulary-parallel."""
        if self.role([name]) != "vocab":
            raise ValueError(f"{name}: an embedding must be vocabulary-parallel, the placement "
                             f"table says {self.role([name])!r}")
        return name

    def cross_entropy(self, logits: Array, targets: Array) -> tuple[Array, Array]:
        """(per-token loss ``[N]``, log-sum-exp ``[N]``) of vocabulary-parallel ``logits``
        ``[N, V/tp]`` against ``targets`` ``[N]``: never gathers the logits, reduces three
        numbers a token. The loss is float64, the lse in the statistics dtype."""
        xp = self.xp
        m, s, target_logit = self.kernels.cross_entropy_stats(logits, targets, self.vocab.start,
                                                        self.vocab.size)
        if self.size > 1:
            gmax = self.group.allreduce_max_(xp.array(m, copy=True))  # keep the local max
            packed = self.group.allreduce_(xp.stack([s * xp.exp(m - gmax), target_logit]))
            m, s, target_logit = gmax, packed[0], packed[1]
        lse = m + xp.log(s)
        return (lse - target_logit).astype(xp.float64), lse

    def gather_vocab(self, logits: Array) -> Array:
        """The whole vocabulary's logits ``[N, V]`` from every rank's shard ``[N, V/tp]`` (an
        all-gather; the padding columns dropped): what sampling a next token needs."""
        if self.size == 1:
            return logits[:, :self.vocab.size]
        pieces = self.xp.empty((self.size,) + logits.shape, logits.dtype)
        self.group.allgather(self.xp.ascontiguousarray(logits), pieces)
        return pieces.transpose(1, 0, 2).reshape(logits.shape[0], -1)[:, :self.vocab.size]

    def cross_entropy_backward(self, logits: Array, targets: Array, lse: Array,
                               dloss: Array) -> Array:
        """Gradient of :meth:`cross_entropy` for this rank's logit columns (no communication)."""
        return self.kernels.cross_entropy_bwd(logits, targets, lse, dloss.astype(lse.dtype),
                                        self.vocab.start, self.vocab.size)

    # ------------------------------------------------------------------ gradients
    def reduce_partial_grads(self, grads: Sequence[Array]) -> None:
        """Sum over tp, in place, gradients that are partial per rank (replicated weights that
        saw token shards or this rank's heads, the whole factor of a LoRA adapter:
        :attr:`mpipar.parallel.placement.Placement.grad_partial_over_tp`), packed in one
        all-reduce."""
        if not grads or self.size == 1:
            return
        xp = self.xp
        packed = self.group.allreduce_(xp.concatenate([g.reshape(-1) for g in grads]))
        at = 0
        for g in grads:
            g.reshape(-1)[...] = packed[at:at + g.size]
            at += g.size


def check_config(layout: Layout) -> None:
    """The tensor-parallel split must divide the heads and the FFN; sequence parallelism inside
    tp must divide each microbatch's tokens."""
    m, p, t = layout.model, layout.parallel, layout.train
    require(m.heads % p.tp == 0, f"parallel.tp={p.tp}: must divide model.heads={m.heads}")
    require(m.kv_heads % p.tp == 0,
             f"parallel.tp={p.tp}: must divide model.kv_heads={m.kv_heads}")
    require(m.ffn_hidden % p.tp == 0,
             f"parallel.tp={p.tp}: must divide model.ffn_hidden={m.ffn_hidden}")
    if p.tp_sequence_parallel and p.tp > 1:
        micro = layout.micro_batch_size
        tokens = micro * (t.seq_len // p.sp)
        require(tokens % p.tp == 0,
                 f"parallel.tp_sequence_parallel: the tokens of a microbatch on one rank, "
                 f"micro_batch_size*seq_len/sp = {micro}*{t.seq_len}/{p.sp} = {tokens}, must be "
                 f"divisible by parallel.tp={p.tp}")


# ------------------------------------------------------------------------------------ traffic
def tensor_calls(layout: Layout, stages: Sequence[int], passes: int, backward: bool,
                 unit_passes: Sequence[tuple[str, int]]) -> list[Call]:
    """The tp group's calls of a rank whose chunks are the global virtual ``stages``, in
    ``passes`` forwards of a microbatch through each chunk, each with its backward
    (``backward``: a training step) or without (a validation pass). ``unit_passes``: at
    ZeRO-2/3, ``(unit, reduce-scatters in a step)`` of each unit the rank's passes enter
    (:func:`mpipar.parallel.fsdp.cost.unit_passes`); otherwise unread.

    Without sequence parallelism each block all-reduces the stream twice forward (after o and
    down) and twice backward (the inputs of q/k/v and gate/up); ``recompute="full"`` runs each
    forward twice in a step. With it, forward all-gathers the two normed inputs and
    reduce-scatters the two outputs; backward all-gathers the two output gradients and, again,
    the two normed inputs (kept as shards), and reduce-scatters the two input gradients. The
    partial gradients (the norm weights' under sequence parallelism, the query and key norms'
    with ``qk_norm``: :func:`_partial_grad_elements`) are all-reduced once a step, packed per
    gradient-ready call (a block, the head; a whole chunk under zb-h1's deferred weights), or
    at ZeRO-2/3 once a microbatch, per unit before its reduce-scatter. The first stage reduces the embedding
    (forward); the last all-reduces the cross-entropy's max and then its (sum-exp, target
    logit) per token, and the head's input gradient. Stream ``[B, S/sp, H]``."""
    m, par, tr = layout.model, layout.parallel, layout.train
    prec = Precision.of(tr, par)
    e, se = prec.compute_bytes, prec.stat_bytes      # activations, softmax statistics
    n_tok = layout.micro_batch_size * (tr.seq_len // par.sp)
    full = n_tok * m.hidden * e
    blocks = m.layers // layout.stages * len(stages)
    first, last, bw = 0 in stages, layout.stages - 1 in stages, int(backward)
    reruns = tr.recompute_mode.forward_runs(backward)   # backward may re-run each forward
    stats = [Call("tp", "allreduce_max", n_tok * se, passes),
             Call("tp", "allreduce", 2 * n_tok * se, passes)]
    per = m.layers // layout.stages     # a sparse block's FFN (experts unsplit): no tp calls,
    sparse = 0 if m.moe_shared_ffn_hidden else sum(   # but its shared expert's (a dense FFN's)
        m.is_sparse(i) for s in stages for i in range(s * per, (s + 1) * per))
    grads = [Call("tp", "allreduce", n * prec.master_bytes)   # partial gradients, summed
             for n in _partial_grad_elements(layout, stages, unit_passes) if n] if bw else []
    if not par.tp_sequence_parallel:     # per block: leave o, down | enter q/k/v, gate/up
        calls = [Call("tp", "allreduce", full, passes * ((2 * reruns + 2 * bw) * blocks
                                                         - (reruns + bw) * sparse
                                                         + int(first) + bw * int(last)))]
        return calls + (stats if last else []) + grads
    shard = full // par.tp
    calls = [Call("tp", "allgather", shard, passes * ((2 * reruns + 4 * bw) * blocks
                                                      + bw * int(first) + (1 + bw) * int(last))),
             Call("tp", "reduce_scatter", full, passes * ((2 * reruns + 2 * bw) * blocks
                                                          + int(first) + bw * int(last)))]
    return calls + (stats if last else []) + grads


def _partial_grad_elements(layout: Layout, stages: Sequence[int],
                           unit_passes: Sequence[tuple[str, int]]) -> list[int]:
    """Elements in each all-reduce of the partial gradients over tp in a step (0: none made):
    under sequence parallelism a block's two norms and the head's final norm (``hidden``
    each), and with ``qk_norm`` a block's query and key norms (``head_dim`` each, applied to
    this rank's heads); at ZeRO-2/3 one per unit reduce-scattered, under zb-h1 one per chunk
    with all its norms, else one per block and one for the head."""
    m, sp = layout.model, layout.parallel.tp_sequence_parallel
    block, head = 2 * m.hidden * sp + 2 * m.head_dim * m.qk_norm, m.hidden * sp
    per, last = m.layers // layout.stages, layout.stages - 1
    if layout.parallel.zero >= 2:
        return [block if u.startswith("layers.") else head for u, k in unit_passes
                if u != "embed" for _ in range(k)]
    if layout.parallel.schedule == "zb-h1":
        return [per * block + head * (s == last) for s in stages]
    return [block] * (per * len(stages)) + ([head] if last in stages else [])


def _tensor_traffic(rank: StepRank) -> list[Call]:
    if rank.layout.parallel.tp == 1:
        return []
    return tensor_calls(rank.layout, rank.stages, rank.passes, rank.train, rank.entered)


TENSOR = AxisUnit("tensor", check_config, _tensor_traffic)
"""The tensor axis: heads, FFN and tokens split over tp; its collectives."""
