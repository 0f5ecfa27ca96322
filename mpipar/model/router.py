"""The routers of a sparse block (``model.moe_router``): how a token's router logits become
expert scores, which experts it is sent to and with which weights, and the gradients back.

- ``softmax`` (Mixtral's, Qwen-MoE's): scores ``p = softmax(logits)``; the top ``K`` of
  ``p (+ bias)``; weights the chosen ``p`` renormalised to sum to 1 (``moe_norm_topk``) or as
  they are.
- ``grouped_sigmoid`` (DeepSeek-V3's ``DeepseekV3TopkRouter``): scores ``s = sigmoid(logits)``;
  the ``E`` experts cut into ``moe_groups`` groups, each scored by the sum of the two largest
  ``s + bias`` in it; a token's ``K`` experts are the largest ``s + bias`` within its
  ``moe_topk_groups`` best groups; weights the chosen ``s`` (never the bias: it only selects)
  divided by their sum ``+ 1e-20`` when ``moe_norm_topk``. The sequence-wise balance loss reads
  the scores normalised over the experts, ``s / sum_e s`` (DeepSeek-V3 report, eq. 18).

Both multiply the weights by ``moe_routed_scale`` (``routed_scaling_factor``). The selection
bias is auxiliary-loss-free balancing's (:class:`mpipar.model.moe.RoutingBias`, moved after each
step by ``--moe-bias-update-rate``), and, imported from DeepSeek-V3, its
``e_score_correction_bias``. The array work is the backend's ``routing``
(:mod:`mpipar.kernels.expert_routing`); routers compute in the upcast dtype (float32 under bf16).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpipar.config.schema import require

Array = Any

GROUPED_EPS = 1e-20
"""What DeepSeek-V3's router adds to the chosen scores' sum before dividing by it."""


@dataclass(frozen=True)
class Router:
    """One router kind (module docstring): ``grouped`` chooses within groups of experts by
    sigmoid scores; else softmax over every expert."""

    name: str
    grouped: bool = False

    @staticmethod
    def named(name: str) -> "Router":
        if name not in _ROUTERS:
            raise ValueError(f"moe_router={name!r}: must be one of {', '.join(ROUTERS)}")
        return _ROUTERS[name]

    def __str__(self) -> str:
        return self.name

    def check(self, m) -> None:
        """The rules of ``m``'s (a ModelConfig with experts) router fields."""
        if not self.grouped:
            require(m.moe_groups == 1 and m.moe_topk_groups == 1,
                    f"model.moe_groups={m.moe_groups}, moe_topk_groups={m.moe_topk_groups}: "
                    f"expert groups need model.moe_router grouped_sigmoid (both must be 1)")
            return
        g, tg, E, k = m.moe_groups, m.moe_topk_groups, m.moe_experts, m.moe_top_k
        require(g >= 1 and E % g == 0 and E // g >= 2,
                f"model.moe_groups={g}: must divide moe_experts={E} into groups of at least 2 "
                f"experts (a group is scored by its two best)")
        require(1 <= tg <= g and tg * (E // g) >= k,
                f"model.moe_topk_groups={tg}: must be in [1, moe_groups={g}] and hold at least "
                f"moe_top_k={k} experts ({E // g} a group)")

    def scores(self, route, logits: Array, xp) -> Array:
        """The experts' scores ``[N, E]`` of router logits (upcast)."""
        return route.sigmoid(logits, xp) if self.grouped else route.softmax(logits, xp)

    def scores_bwd(self, route, dscores: Array, scores: Array) -> Array:
        """The logits' gradient from the scores'."""
        if self.grouped:
            return route.sigmoid_bwd(dscores, scores)
        return route.softmax_bwd(dscores, scores)

    def choose(self, route, scores: Array, m, bias: Array | None, xp
               ) -> tuple[Array, Array, Array | None]:
        """(experts ``[N, K]``, weights ``[N, K]``, the chosen scores' sum ``[N, 1]`` the
        weights were divided by, or None) for the model ``m``'s fields; ``bias`` ``[E]``
        selects only."""
        k, scale = m.moe_top_k, m.moe_routed_scale
        if not self.grouped:
            experts, weights = route.route_topk(scores, k, xp, bias, m.moe_norm_topk)
            chosen_sum = (xp.take_along_axis(scores, experts, axis=-1).sum(axis=-1,
                                                                          keepdims=True)
                          if m.moe_norm_topk else None)
        else:
            choice = scores if bias is None else scores + bias
            experts = route.grouped_choice(choice, k, m.moe_groups, m.moe_topk_groups, xp)
            weights, chosen_sum = xp.take_along_axis(scores, experts, axis=-1), None
            if m.moe_norm_topk:
                chosen_sum = weights.sum(axis=-1, keepdims=True) + GROUPED_EPS
                weights = weights / chosen_sum
        return experts, (weights * scale if scale != 1.0 else weights), chosen_sum

    def balance_scores(self, scores: Array) -> Array:
        """What the sequence-wise balance loss averages per token ``[N, E]``: the softmax
        probabilities, or the sigmoid scores normalised over the experts."""
        return scores / scores.sum(axis=-1, keepdims=True) if self.grouped else scores

    def balance_bwd(self, dbalance: Array, scores: Array) -> Array:
        """The scores' gradient from that of :meth:`balance_scores`' output."""
        if not self.grouped:
            return dbalance
        total = scores.sum(axis=-1, keepdims=True)
        return (dbalance - (dbalance * scores).sum(axis=-1, keepdims=True) / total) / total


SOFTMAX = Router("softmax")
GROUPED_SIGMOID = Router("grouped_sigmoid", grouped=True)
_ROUTERS = {r.name: r for r in (SOFTMAX, GROUPED_SIGMOID)}
ROUTERS = tuple(_ROUTERS)
"""The names ``model.moe_router`` accepts."""
