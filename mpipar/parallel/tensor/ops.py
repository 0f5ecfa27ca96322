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

from mpipar.runtime.comm import Group
from mpipar.model.attention import accumulator
from mpipar.model.lora import Adapters
from mpipar.model.params import bias_name
from mpipar.model.tensor_ops import LinearBackward
from mpipar.parallel.placement import PlacementTable, padded_vocab

Array = Any
ENTERS = ("column", "vocab", "heads_replicated")
"""The roles whose linears read the whole input: it enters the tp region
(:meth:`TensorParallel.enter`). A ``heads_replicated`` linear (latent attention's down-
projections) is whole on every rank and feeds that rank's heads: its input enters as a
column-parallel one's, and its input gradient, partial over the heads, is summed over tp."""


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
            cols = self._columns(names, x_in)
            ys = [self.adapters.forward(params, n, x_in, y, cols) for n, y in zip(names, ys)]
        return [self.leave(y) for y in ys] if self.role(names) == "row" else ys

    def _columns(self, names: Sequence[str], x_in: Array) -> tuple[int, int]:
        """(first, whole width) of the input columns ``x_in`` holds: this rank's contiguous
        share of a row-parallel linear's input, else all of it."""
        f = x_in.shape[-1]
        return (self.rank * f, self.size * f) if self.role(names) == "row" else (0, f)

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
                        linear_backward: LinearBackward, summed: bool = True) -> Array:
        """Input gradient of :meth:`linear` (weight gradients through ``linear_backward``),
        in the shape of the ``x`` whose :meth:`linear_input` was ``x_in``: a row-parallel
        output's gradient is first made whole (:meth:`leave_backward`); the partial input
        gradients are summed (in float32 under bf16 compute, rounded once), and over tp
        (:meth:`enter_backward`) where the input entered. ``summed`` False: this rank's partial
        input gradient of a column-parallel linear whose input every rank computed whole
        (latent attention's latents), in the dtype the GEMMs gave it, not summed over tp here."""
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
            cols = self._columns(names, x_in)
            for dy, name in zip(dys, names):
                dx = _accumulate(dx, self.adapters.backward(linear_backward.params,
                                                            linear_backward.grads, name, dy,
                                                            x_in, cols))
        if not summed:
            return dx
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
