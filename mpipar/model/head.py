"""The last stage's head: the final norm, the LM head and the vocabulary-parallel
cross-entropy, forward (the per-token loss, or this rank's logits) and backward, with the
record it keeps between them (:class:`HeadSaved`; in the store under an offloading recompute
mode). The LM head multiplies by ``lm_head.weight``, or by the embedding matrix with
``tie_embeddings`` (:func:`mpipar.model.params.head_weight_name`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpipar.config import ModelConfig
from mpipar.model.norms import norm_weight
from mpipar.model.params import EMBED, head_weight_name
from mpipar.model.recompute import Recompute
from mpipar.model.tensor_ops import (LinearBackward, TensorOps, apply_linears,
                                     apply_linears_backward)

Array = Any


@dataclass
class HeadSaved:
    """What the final norm, LM head and cross-entropy keep for backward: the stream ``x``, its
    norm ``hn`` and ``rstd``, the logits ``[N, V]``, the targets ``[N]`` and the lse ``[N]``."""

    x: Array
    hn: Array
    rstd: Array
    logits: Array
    targets: Array
    lse: Array


class LmHead:
    """The final norm, LM head (``weight``: its weight's name) and loss of a last stage;
    ``units``: the units it reads, its own and the embedding's when tied."""

    def __init__(self, cfg: ModelConfig, kernels, tp: TensorOps, recompute: Recompute,
                 store: Any) -> None:
        self.cfg, self.kernels, self.tp = cfg, kernels, tp
        self.recompute, self.store = recompute, store
        self.weight = head_weight_name(cfg)
        self.units = ["head", "embed"] if self.weight == EMBED else ["head"]

    def logits(self, params, x: Array) -> tuple[tuple[Array, Array], Array]:
        """((final norm of the stream ``hn``, its ``rstd``), this rank's logits ``[N, V/tp]``)."""
        norm = norm_weight(params, "norm.weight", self.cfg.norm_unit_offset)
        hn, rstd = self.kernels.rmsnorm_fwd(x, norm, self.cfg.norm_eps)
        logits, = apply_linears(self.tp, params, [self.weight], hn)
        return (hn, rstd), logits.reshape(-1, logits.shape[-1])

    def forward(self, params, x: Array, targets: Array) -> tuple[Array, HeadSaved]:
        (hn, rstd), logits = self.logits(params, x)
        t = targets.reshape(-1)
        loss, lse = self.tp.cross_entropy(logits, t)
        return loss.reshape(targets.shape), HeadSaved(x, hn, rstd, logits, t, lse)

    def keep(self, saved: HeadSaved) -> Any:
        """What the head keeps for backward: its record, in the store when the mode offloads."""
        return self.store.put(saved) if self.recompute.offloads else saved

    def backward(self, params, grads, dloss: Array, kept: Any, lin: LinearBackward) -> Array:
        c = self.store.take(kept) if self.recompute.offloads else kept
        dlogits = self.tp.cross_entropy_backward(c.logits, c.targets, c.lse,
                                                 dloss.reshape(-1)).astype(c.x.dtype, copy=False)
        dhn = apply_linears_backward(self.tp, [dlogits], c.hn, [self.weight], lin)
        norm = norm_weight(params, "norm.weight", self.cfg.norm_unit_offset)
        dx, dwn = self.kernels.rmsnorm_bwd(dhn, c.x, norm, c.rstd)
        grads["norm.weight"] += dwn
        return dx
