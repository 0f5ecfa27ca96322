"""The tensor-parallel seam a block calls: its linears, the embedding and the cross-entropy,
each carried out as the placement table places its weight.

The block names the weights it applies and says nothing of how they are split. Which linear is
column-, row- or vocabulary-parallel, or replicated, is one column of the placement table
(:mod:`mpipar.parallel.placement`); the implementation (:class:`mpipar.parallel.tensor.ops.
TensorParallel`) reads the role there and chooses the communication around the GEMMs: the
whole input of a column-parallel linear (identity, or the all-gather of token shards), the sum
over tp of a row-parallel one's output (all-reduce, or reduce-scatter), nothing around a
replicated one. One declaration so drives both the split of the weights (sharding,
checkpoints) and the traffic of the activations, as torchtitan's ColwiseParallel /
RowwiseParallel plan does.

Linears come in *groups* that share one input (q/k/v, gate/up; the others alone), and so one
role and one collective. A group is applied in two calls, so that backward can enter an input
once and use it twice (selective recomputation of q/k/v, then their weight gradients):

- ``linear_input(x, names)``: ``x`` as the group's GEMMs read it (``x_in``);
- ``linear(params, names, x_in)``: the outputs ``x_in @ w.T (+ b)``, one per name, each
  as the group's role leaves it (this rank's columns, or summed over tp);
- ``linear_backward(dys, x_in, names, linear_backward)``: the gradient of ``x`` (the
  weight gradients through ``linear_backward``).

Shapes: ``x`` in the stream's shape (``[B, S, H]``, or ``[B*S/tp, H]`` token shards) or, for
the input of a row-parallel linear, this rank's columns; ``logits`` ``[N, V/tp]``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

Array = Any
class LinearBackward(Protocol):
    """The model's weight-gradient bookkeeping (accumulated now, or deferred for zero-bubble
    schedules) for the linears ``y = x @ w.T (+ b)``, over the stage's ``params`` and the
    ``grads`` it writes (a LoRA adapter's factors are booked there at once)."""

    params: Any
    grads: Any

    def __call__(self, dy: Array, x: Array, name: str) -> Array:
        """``dx`` of parameter ``name``'s linear, its weight gradient booked."""

    def group(self, dys: Sequence[Array], x: Array, names: Sequence[str]) -> Array:
        """``dx`` of linears ``names`` sharing the input ``x``: one GEMM of the outputs'
        gradients against the stacked weights (float32 accumulation under bf16, one
        rounding); each weight gradient booked."""


class TensorOps(Protocol):
    """The model's operations on weights split over the tensor-parallel group."""

    def linear_input(self, x: Array, names: Sequence[str]) -> Array:
        """``x`` as the linears ``names`` (one input, so one role) read it."""

    def linear(self, params: dict[str, Array], names: Sequence[str], x_in: Array) -> list[Array]:
        """``x_in @ w.T`` (plus the bias, where the model has one) for each weight of ``names``."""

    def linear_backward(self, dys: Sequence[Array], x_in: Array, names: Sequence[str],
                        linear_backward: LinearBackward, summed: bool = True) -> Array:
        """The gradient of the ``x`` whose :meth:`linear_input` was ``x_in``, from the outputs'
        gradients ``dys`` (``summed`` False: this rank's partial share, not summed over tp)."""

    def embed(self, params: dict[str, Array], name: str, ids: Array) -> Array:
        """The stream of token ids ``[B, S]``: rows of the embedding ``name``."""

    def embed_backward(self, grads: dict[str, Array], name: str, dx: Array, ids: Array) -> None:
        """Accumulate into ``grads[name]`` the embedding's gradient (``dx`` in the stream's
        shape)."""

    def cross_entropy(self, logits: Array, targets: Array) -> tuple[Array, Array]:
        """(per-token loss ``[N]`` float64, log-sum-exp ``[N]``) of ``logits`` ``[N, V/tp]``, the
        output of the vocabulary-parallel LM head, against ``targets`` ``[N]``."""

    def cross_entropy_backward(self, logits: Array, targets: Array, lse: Array,
                               dloss: Array) -> Array:
        """The gradient of this rank's logits from the per-token loss weights ``dloss`` ``[N]``."""


def apply_linears(tp: TensorOps, params, names: Sequence[str], x: Array) -> list[Array]:
    """The linears ``names`` (one input ``x``, in the stream's shape) through the seam."""
    return tp.linear(params, names, tp.linear_input(x, names))


def apply_linears_backward(tp: TensorOps, dys: Sequence[Array], x: Array, names: Sequence[str],
                           lin: LinearBackward) -> Array:
    """The gradient of ``x`` from those of :func:`apply_linears`'s outputs ``dys``."""
    return tp.linear_backward(dys, tp.linear_input(x, names), names, lin)
