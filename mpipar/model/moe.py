"""A sparse block's feed-forward: Mixtral's mixture of experts with DeepSeek-V3's sequence-wise
balance loss, forward and backward by hand. No MPI: what crosses ranks goes through the
:class:`ExpertExchange` seam.

Forward on the normed stream ``h`` ``[B, S, H]`` (``N = B*S`` tokens of this rank):

- router (:mod:`mpipar.model.router`; here Mixtral's softmax, ``moe_router softmax``):
  ``p = softmax(h W_r^T)`` ``[N, E]``; the top ``K`` experts of each token and their
  probabilities renormalised to sum to 1 (``w`` ``[N, K]``); with ``moe_norm_topk`` off
  (Qwen2-MoE's ``norm_topk_prob: false``) ``w`` is the K probabilities as they are (then the
  capacity's renormalisation remark below does not apply: a dropped slot's probability gets
  no gradient from the output);
- the ``A = N*K`` assignments are sorted by expert (the backend's ``routing.permutation``:
  :func:`mpipar.kernels.expert_routing.permutation`), the tokens gathered in that order,
  handed to the exchange (which, under expert parallelism, sends each to the rank holding its
  expert and returns what this rank's experts must compute), each local expert's SwiGLU FFN
  runs on its rows (one GEMM per weight, expert and part: this rank's own rows while the
  others travel, then those; :func:`experts_fwd`), the exchange brings the outputs home, and
  each token's output is ``sum_k w_k y_k``.

Balance loss (DeepSeek-V3, sequence-wise): for each sequence ``b`` (a row of ``T`` tokens)
``sum_e f_be P_be`` with ``f_be = E / (K T) * (assignments of row b to e)`` (no gradient) and
``P_be`` the mean over the row's ``T`` tokens of ``p_te``. A row's counts are summed over the
ranks holding its tokens (``exchange.sequence_sum``: the sp group) and ``T = counts.sum() / K``,
so each rank's share ``sum_e f_be * (sum of its p_te) / T`` adds up to the row's loss whatever
the sequence split. The stage sums those shares (:attr:`MoeSaved.aux`); backward adds
``aux_weight * f_be / T`` to each ``dp_te`` (``aux_weight = alpha / rows of the global batch``:
the step's loss is the mean over its rows of the sum over layers).

Auxiliary-loss-free balancing (DeepSeek-V3, ``--moe-bias-update-rate``): a per-expert bias
``b`` ``[E]`` of the block is added to ``p`` for the top-K *choice* only; the chosen experts'
weights stay ``p``'s, renormalised over the K. The bias has no gradient (the choice is
piecewise constant): backward is unchanged. Its update after each step, from the global batch's
loads, is the training step's (:func:`mpipar.training.step.train_step`).

Expert capacity (``--moe-capacity-factor C``; 0, the default: dropless). Per *sequence*, not
per rank as Megatron-LM's ``moe_expert_capacity_factor`` (so the result does not depend on how
sp, dp or microbatching cut the tokens): in each row of ``T`` tokens each expert takes at most
``cap = ceil(C T K / E)`` (>= 1 for any C > 0) of the row's assignments to it, in order of
position (within a token, of slot: the final top-K order, biased or not), and drops the rest.
A dropped assignment is not sent to its expert (before the ep all-to-all) and adds nothing: its
weight is *not* given to the token's other experts (as Megatron and Switch), the residual and
the token's kept experts carry the token. The weights were renormalised over all K before the
drop, so the dropped slot's probability still gets the gradient through that sum; its expert
gets none. The balance loss and the loads (metrics, the routing biases' update) count the
router's choice *before* drops (DeepSeek-V3 and Switch count loads before capacity). Under sp a
rank needs, per row and expert, the assignments at earlier positions on the other ranks: the
rows' counts per position block (``exchange.blocks``) are summed over sp, replacing the
balance loss's per-row sum (one all-reduce of ``G x B x E`` counts per sparse block and
forward; none without sp), and each rank takes the prefix over the blocks before its own.
Incremental decoding (no whole rows) routes dropless.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mpipar.model.mtp import all_blocks
from mpipar.model.params import ROUTER, expert_names
from mpipar.model.router import SOFTMAX

Array = Any


@dataclass
class Plan:
    """Where one dispatch's rows go and come from. This rank computes its local experts' rows
    ``[A', H]``, expert ``j``'s at ``bounds[j]:bounds[j+1]`` (``bounds`` ``[E_local + 1]``);
    their first ``own[j]`` rows are this rank's own tokens, which need no message (in the sorted
    ``xs`` ``[A, H]`` they are ``own[j]`` rows from ``own_start + sum(own[:j])`` on);
    ``handle``: the exchange's record of the routes."""

    bounds: list
    own: list
    own_start: int = 0
    handle: Any = None

    def own_src(self, j: int) -> slice:
        """Local expert ``j``'s own rows in the dispatched ``xs``."""
        start = self.own_start + sum(self.own[:j])
        return slice(start, start + self.own[j])

    def own_dst(self, j: int) -> slice:
        """Local expert ``j``'s own rows in the local layout ``[A', H]``."""
        return slice(self.bounds[j], self.bounds[j] + self.own[j])

    def rest(self, j: int) -> slice:
        """Local expert ``j``'s rows from the other ranks in the local layout."""
        return slice(self.bounds[j] + self.own[j], self.bounds[j + 1])


class Transfer(Protocol):
    """Rows on their way (a non-blocking all-to-all-v) or arrived."""

    def test(self) -> bool:
        """Whether they arrived (moves MPI's progress engine along; never blocks)."""

    def wait(self) -> Array:
        """The rows, once arrived."""


class Done:
    """A :class:`Transfer` already complete: ``rows``."""

    def __init__(self, rows: Array) -> None:
        self.rows = rows

    def test(self) -> bool:
        return True

    def wait(self) -> Array:
        return self.rows


class ExpertExchange(Protocol):
    """What a sparse block needs from other ranks: the experts this rank computes, the sum of a
    sequence's statistics over the ranks holding its tokens, and the token dispatch."""

    local_experts: range

    def sequence_sum(self, a: Array) -> Array:
        """``a`` ``[..., B, E]`` of this rank's tokens of each row, summed over the ranks holding
        the other tokens of the same rows (a new array)."""

    def blocks(self, positions: np.ndarray) -> tuple[int, int]:
        """(``L``, ``G``): the rows cut into ``G`` blocks of ``L`` positions, each held whole by
        one of the ranks sharing the rows (the same on each); this rank holds ``positions``."""

    def plan(self, counts: Array) -> Plan:
        """The routes of tokens sorted by expert with ``counts`` ``[E]`` (agreed with the other
        ranks: the counts' all-to-all)."""

    def send(self, xs: Array, plan: Plan) -> Transfer:
        """Start sending rows ``[A, H]`` sorted by expert (the tokens, or in backward their
        outputs' gradients) to their experts' ranks: -> the local rows ``[A', H]`` (``plan``'s
        layout) once they arrive."""

    def send_back(self, ys: Array, plan: Plan) -> Transfer:
        """The inverse of :meth:`send`: local rows ``[A', H]`` -> ``[A, H]`` in ``xs``'s order."""


class LocalExperts:
    """Every expert on this rank, the sequences whole (no sp, no ep): nothing crosses ranks."""

    def __init__(self, num_experts: int) -> None:
        self.local_experts = range(num_experts)

    def sequence_sum(self, a: Array) -> Array:
        return a.copy()

    def blocks(self, positions: np.ndarray) -> tuple[int, int]:
        return int(np.max(positions)) + 1, 1          # whole rows: one block

    def plan(self, counts: Array) -> Plan:
        return own_plan(counts)

    def send(self, xs: Array, plan: Plan) -> Transfer:
        return Done(xs)

    def send_back(self, ys: Array, plan: Plan) -> Transfer:
        return Done(ys)


def own_plan(counts: Array) -> Plan:
    """The plan of an exchange holding every expert: all rows are this rank's own."""
    sizes = [int(c) for c in counts.tolist()]
    return Plan([0] + list(itertools.accumulate(sizes)), sizes)


@dataclass
class MoeSaved:
    """What a sparse FFN keeps for backward (shapes in the module docstring): the router's input
    ``x`` ``[N, H]``, ``probs`` ``[N, E]``, the chosen ``experts`` and ``weights`` ``[N, K]``
    and the chosen probabilities' sum ``[N, 1]`` (None: not renormalised), the permutation
    ``order`` ``[A]``, the local rows ``xs`` and their ``plan``, each local expert's (g, u, m),
    the outputs per assignment ``per`` ``[N, K, H]`` (0 where dropped), ``f_over_t`` ``[B, E]``
    (``f / T``), this rank's share of the balance loss ``aux``, its load ``counts`` ``[E]`` (the
    router's choice, before drops) and the assignments capacity ``dropped``."""

    x: Array
    probs: Array
    experts: Array
    weights: Array
    chosen_sum: Array | None
    order: Array
    xs: Array
    plan: Plan
    inner: list
    per: Array
    f_over_t: Array
    aux: float
    counts: Array
    dropped: int = 0
    router: Any = None   # the model's Router (mpipar.model.router); None: softmax
    scale: float = 1.0   # moe_routed_scale, which the weights include
    lora: Any = None     # the experts' LoRA adapters (mpipar.model.lora.ExpertAdapters)


def moe_forward(kernels, params: dict, i: int, cfg, h: Array, exchange: ExpertExchange,
                bias: Array | None = None, positions: np.ndarray | None = None,
                aside: Callable[[], Any] | None = None, lora: Any = None
                ) -> tuple[Array, MoeSaved]:
    """Block ``i``'s sparse FFN on ``h`` ``[B, S, H]`` -> (output ``[B, S, H]``, record).
    ``bias`` ``[E]`` (auxiliary-loss-free balancing, module docstring): added to the
    probabilities for the top-K choice only; None routes on the probabilities. ``positions``
    ``[S]``: the tokens' global positions in their rows, for ``cfg.moe_capacity_factor``
    (module docstring); None (incremental decoding) routes dropless. ``aside``: work that needs
    no routed rows (the shared expert), run while the outputs travel back. ``lora``: the
    experts' adapters (:class:`mpipar.model.lora.ExpertAdapters`) or None."""
    xp, E, k, route = kernels.xp, cfg.moe_experts, cfg.moe_top_k, kernels.routing
    B = h.shape[0]
    x = h.reshape(-1, h.shape[-1])
    logits = kernels.linear_fwd(x, params[f"layers.{i}." + ROUTER])
    router = cfg.router
    probs = router.scores(route, kernels.upcast(logits), xp)
    experts, weights, chosen_sum = router.choose(route, probs, cfg, bias, xp)
    keep = row_counts = None
    if cfg.moe_capacity_factor and positions is not None:
        keep, row_counts = capacity(kernels, experts, positions, B, cfg, exchange, probs.dtype)
    order, counts = route.permutation(experts, E, xp, keep)
    xs = route.permute(x, order, k)
    plan = exchange.plan(counts)
    weights_e = [tuple(params[n] for n in expert_names(i, e)) for e in exchange.local_experts]
    adapted = None if lora is None else [(lora, params, lora.names(i, e))
                                         for e in exchange.local_experts]
    xs_local, ys, inner = experts_fwd(kernels, xs, plan, exchange.send(xs, plan), weights_e,
                                      adapted)
    back = exchange.send_back(ys, plan)
    f_over_t, aux = _balance(router.balance_scores(probs), experts, B, E, k, exchange, xp,
                             row_counts)
    if aside is not None:
        back.test()
        aside()
    out, per = route.unpermute_combine(back.wait(), order, weights, xp)
    # under bf16 the router's softmax, top-K weights and the combine's weighted sum are float32
    # (the kernels' upcast: as Mixtral computes its router; CuPy cannot sort bf16), the output
    # rounded once
    out = out.astype(h.dtype, copy=False)
    dropped = 0
    if keep is not None:       # the loads are the router's choice, before drops
        counts, dropped = xp.bincount(experts.reshape(-1), minlength=E), int((~keep).sum())
    saved = MoeSaved(x, probs, experts, weights, chosen_sum, order, xs_local, plan, inner, per,
                     f_over_t, aux, counts, dropped, router, cfg.moe_routed_scale, lora)
    return out.reshape(h.shape), saved


def experts_fwd(kernels, xs: Array, plan: Plan, arriving: Transfer, weights: list,
                adapted: list | None = None) -> tuple[Array, Array, list]:
    """The local experts' SwiGLU FFNs (``weights[j]`` = (w1 gate ``[F, H]``, w3 up ``[F, H]``,
    w2 down ``[H, F]``)): first on this rank's own rows of ``xs`` ``[A, H]`` while the others'
    are ``arriving`` (polled between GEMMs: an MPI on the CPU moves a non-blocking collective
    only inside MPI calls), then on those. One GEMM per weight, expert and part, the same
    whether the rows travelled blocking or not (so both give the same bits). Returns (the local
    rows ``[A', H]``, their outputs ``[A', H]``, per local expert (g, u, m) ``[rows_j, F]``).
    ``adapted[j]``: local expert ``j``'s LoRA adapters (:class:`mpipar.model.lora.ExpertAdapters`,
    the parameters, its factors' names), or None."""
    adapted = adapted or [None] * len(weights)
    parts: list[list] = [[_swiglu(kernels, xs[plan.own_src(j)], w, arriving.test, adapted[j])]
                         for j, w in enumerate(weights)]
    xs_local = arriving.wait()
    for j, w in enumerate(weights):
        rest = plan.rest(j)
        if rest.stop > rest.start:
            parts[j].append(_swiglu(kernels, xs_local[rest], w, _idle, adapted[j]))
    ys, inner = kernels.xp.empty_like(xs_local), []
    for j, segments in enumerate(parts):
        g, u, m, y = (_joined(kernels.xp, [s[t] for s in segments]) for t in range(4))
        ys[plan.bounds[j]:plan.bounds[j + 1]] = y
        inner.append((g, u, m))
    return xs_local, ys, inner


def _swiglu(kernels, x: Array, w: tuple, poll: Callable[[], Any],
            adapted: tuple | None = None) -> tuple:
    """One expert's SwiGLU on rows ``x`` ``[n, H]`` -> (g, u, m, y), ``poll`` after each GEMM;
    ``adapted``: (ExpertAdapters, parameters, factor names) whose shares are added."""
    w1, w3, w2 = w
    g = kernels.linear_fwd(x, w1)
    poll()
    u = kernels.linear_fwd(x, w3)
    poll()
    if adapted is not None:
        lora, params, (gate_up, down) = adapted
        g, u = lora.gate_up(kernels, params, gate_up, x, g, u)
    m = kernels.swiglu_fwd(g, u)
    y = kernels.linear_fwd(m, w2)
    poll()
    if adapted is not None:
        y = lora.down(kernels, params, down, m, y)
    return g, u, m, y


def _idle() -> None:
    """Nothing to poll."""


def _joined(xp, parts: list) -> Array:
    """``parts`` stacked by rows (the one part itself when alone)."""
    return parts[0] if len(parts) == 1 else xp.concatenate(parts)


def capacity(kernels, experts: Array, positions: np.ndarray, B: int, cfg,
             exchange: ExpertExchange, dtype) -> tuple[Array, Array]:
    """Which of the choices ``experts`` ``[N, K]`` (``B`` rows of this rank's tokens at
    ``positions`` ``[S]``) the expert capacity keeps ``[N, K]`` (module docstring), and each
    whole row's assignments per expert ``[B, E]`` (before drops: the balance loss's counts).
    The rows' counts per position block are summed over the exchange (sp): one message."""
    E, k, xp, route = cfg.moe_experts, cfg.moe_top_k, kernels.xp, kernels.routing
    L, G = exchange.blocks(positions)
    pos = np.asarray(positions, dtype=np.int64)
    blocks = xp.asarray(pos // L)
    rows = experts.reshape(B, len(pos), k)
    local = route.block_counts(rows, blocks, G, E, xp).astype(dtype)
    whole = exchange.sequence_sum(local)                      # [G, B, E], whole rows
    cap = math.ceil(cfg.moe_capacity_factor * G * L * k / E)
    keep = route.capacity_keep(rows, xp.asarray(pos), blocks, local, whole, cap, xp)
    return keep.reshape(-1, k), whole.sum(axis=0)


def _balance(probs: Array, experts: Array, B: int, E: int, k: int, exchange: ExpertExchange,
             xp, counts: Array | None = None) -> tuple[Array, float]:
    """(``f / T`` ``[B, E]``, this rank's share of the rows' balance losses summed);
    ``counts`` ``[B, E]``: the whole rows' assignments if already summed (capacity)."""
    if counts is None:
        rows = experts.reshape(B, -1)
        local = xp.zeros((B, E), dtype=probs.dtype)
        for b in range(B):
            local[b] = xp.bincount(rows[b], minlength=E)
        counts = exchange.sequence_sum(local)                 # [B, E], whole rows
    T = counts.sum(axis=-1, keepdims=True) / k
    f_over_t = E * counts / (k * T) / T
    p_sum = probs.reshape(B, -1, E).sum(axis=1)               # this rank's tokens of each row
    return f_over_t, float((f_over_t * p_sum).sum())


def moe_backward(kernels, i: int, dy: Array, c: MoeSaved, exchange: ExpertExchange, lin,
                 aux_weight: float, aside: Callable[[], Any] | None = None) -> Array:
    """The gradient of the sparse FFN's input ``[B, S, H]`` from its output's ``dy``; weight
    gradients through ``lin`` (:class:`mpipar.model.llama.LinearGrads`); ``aux_weight``: the
    balance loss's weight per row (module docstring); ``aside``: work that needs no routed rows
    (the shared expert's backward), run while the gradients travel to the experts. The experts'
    weight gradients and the router's backward run while their input gradients travel back."""
    xp, E, (N, k), upcast = kernels.xp, c.probs.shape[1], c.weights.shape, kernels.upcast
    route = kernels.routing
    d = dy.reshape(N, -1)
    dweights = (upcast(c.per) * upcast(d)[:, None, :]).sum(axis=-1)
    dys = ((c.weights[..., None] * d[:, None, :]).astype(dy.dtype, copy=False)
           .reshape(N * k, -1)[c.order])
    names = [expert_names(i, e) for e in exchange.local_experts]
    adapters = [None if c.lora is None else c.lora.names(i, e) for e in exchange.local_experts]
    arriving = exchange.send(dys, c.plan)
    dys_local, dxs, dgu = experts_input_bwd(kernels, dys, c, arriving, names, lin, aside,
                                            adapters)
    back = exchange.send_back(dxs, c.plan)
    for j, (w1, w3, w2) in enumerate(names):          # the weights' gradients, whole rows
        rows = slice(c.plan.bounds[j], c.plan.bounds[j + 1])
        (dg, du), (_, _, m) = dgu[j], c.inner[j]
        lin.weight(dys_local[rows], m, w2)
        back.test()
        lin.weight(dg, c.xs[rows], w1)
        lin.weight(du, c.xs[rows], w3)
        if adapters[j] is not None:
            c.lora.weights(lin, adapters[j], c.xs[rows], m, dys_local[rows], dg, du)
        back.test()
    router = c.router or SOFTMAX
    dprobs = route.route_topk_bwd(dweights, c.weights, c.chosen_sum, c.experts, E, xp, c.scale)
    if aux_weight:
        B = c.f_over_t.shape[0]
        daux = xp.broadcast_to(aux_weight * c.f_over_t[:, None, :], (B, N // B, E))
        dprobs = dprobs + router.balance_bwd(daux.reshape(N, E), c.probs)
    dlogits = router.scores_bwd(route, dprobs, c.probs).astype(dy.dtype, copy=False)
    dx_router = lin(dlogits, c.x, f"layers.{i}." + ROUTER)
    dx = route.unpermute_sum(back.wait(), c.order, N, k, xp)
    dx += dx_router
    return dx.reshape(dy.shape)


def experts_input_bwd(kernels, dys: Array, c: MoeSaved, arriving: Transfer, names: list, lin,
                      aside: Callable[[], Any] | None, adapters: list | None = None
                      ) -> tuple[Array, Array, list]:
    """The local experts' input gradients: first for this rank's own rows of ``dys`` ``[A, H]``
    (the outputs' gradients sorted by expert) while the others' are ``arriving``, then
    ``aside``, then for the arrived rows; the same GEMMs whether they travelled blocking or
    not. Returns (the local rows' output gradients ``[A', H]``, their input gradients
    ``[A', H]``, per local expert (dg, du) ``[rows_j, F]`` of its whole rows). ``adapters[j]``:
    local expert ``j``'s LoRA factor names (:meth:`mpipar.model.lora.ExpertAdapters.names`) or
    None."""
    plan, parts = c.plan, []
    adapters = adapters or [None] * len(names)
    lora = [None if a is None else (c.lora, a) for a in adapters]
    for j, w in enumerate(names):
        parts.append([_swiglu_bwd(kernels, dys[plan.own_src(j)], c.inner[j], w, lin,
                                  slice(0, plan.own[j]), arriving.test, lora[j])])
    if aside is not None:
        aside()
    dys_local = arriving.wait()
    dxs = kernels.xp.empty_like(c.xs)
    for j, w in enumerate(names):
        rest = plan.rest(j)
        if rest.stop > rest.start:
            local = slice(plan.own[j], rest.stop - plan.bounds[j])
            parts[j].append(_swiglu_bwd(kernels, dys_local[rest], c.inner[j], w, lin, local,
                                        _idle, lora[j]))
        dxs[plan.own_dst(j)] = parts[j][0][0]
        if len(parts[j]) > 1:
            dxs[rest] = parts[j][1][0]
    dgu = [tuple(_joined(kernels.xp, [s[t] for s in p]) for t in (1, 2)) for p in parts]
    return dys_local, dxs, dgu


def _swiglu_bwd(kernels, dy: Array, inner: tuple, names: tuple, lin, rows: slice,
                poll: Callable[[], Any], lora: tuple | None = None) -> tuple:
    """One expert's input gradient for output gradients ``dy`` ``[n, H]`` of its saved
    (g, u, m) rows ``rows`` -> (dx ``[n, H]``, dg, du ``[n, F]``), ``poll`` after each GEMM;
    ``lora``: (ExpertAdapters, its factor names), whose shares are added."""
    (w1, w3, w2), (g, u, _) = names, inner
    dm = lin.input(dy, w2)
    poll()
    if lora is not None:
        dm = lora[0].down_input(lin, lora[1][1], dy, dm)
    dg, du = kernels.swiglu_bwd(dm, g[rows], u[rows])
    dx = lin.input(dg, w1)
    poll()
    dx += lin.input(du, w3)
    poll()
    if lora is not None:
        dx = lora[0].gate_up_input(lin, lora[1][0], dg, du, dx)
    return dx, dg, du


class RoutingBias:
    """DeepSeek-V3's auxiliary-loss-free balancing: one bias ``[E]`` per sparse block
    (``biases``, by block index, float64 arrays of ``xp``), the same on every rank. After each
    step :meth:`update` moves block ``i``'s bias by ``rate * sign(mean(load) - load)`` from
    ``load`` ``[E]``, the tokens of the step's *global* batch routed to each expert of the block
    (every rank passes the same loads, so every rank's biases stay identical). The biases are
    state (checkpoints record them, :meth:`host`), not parameters: no gradient, no AdamW."""

    def __init__(self, *, sparse: list[int], num_experts: int, rate: float, xp) -> None:
        self.rate, self.xp, self.num_experts = rate, xp, num_experts
        self.biases: dict[int, Array] = ({i: xp.zeros(num_experts) for i in sparse}
                                         if rate else {})
        self.sparse = list(sparse)

    @classmethod
    def of(cls, model, xp) -> "RoutingBias":
        """The biases of ``model``'s sparse blocks (a resolved ModelConfig), zero; none when its
        ``moe_bias_update_rate`` is 0 (a checkpoint's may still be loaded)."""
        return cls(sparse=[i for i in all_blocks(model) if model.is_sparse(i)],
                   num_experts=model.moe_experts, rate=model.moe_bias_update_rate, xp=xp)

    def update(self, loads: dict[int, Any]) -> None:
        """One step's move of each block's bias; ``loads`` ``{block: [E]}`` (host arrays)."""
        for i, load in loads.items():
            load = np.asarray(load, dtype=np.float64)
            self.biases[i] += self.rate * self.xp.asarray(np.sign(load.mean() - load))

    def max_abs(self) -> dict[str, float]:
        """Each block's largest ``|bias|`` (metrics), by block index as text."""
        return {str(i): float(abs(b).max()) for i, b in sorted(self.biases.items())}

    def host(self) -> dict[int, Any]:
        """Host copies of the biases (what a checkpoint records)."""
        return {i: np.array(b.get() if hasattr(b, "get") else b, dtype=np.float64)
                for i, b in sorted(self.biases.items())}

    def load(self, biases: dict[int, Any]) -> None:
        """Set the biases from ``biases`` ``{block: [E]}`` (a checkpoint's; the blocks must be
        this model's sparse ones, each ``[E]``); an empty mapping leaves them as they are."""
        if not biases:
            return
        wrong = sorted(set(biases) ^ set(self.sparse))
        bad = [i for i, b in biases.items() if len(b) != self.num_experts]
        if wrong or bad:
            raise ValueError(f"routing biases for blocks {sorted(biases)} of "
                             f"{[len(b) for b in biases.values()]} experts: the model's sparse "
                             f"blocks are {self.sparse}, of {self.num_experts} experts")
        self.biases.clear()
        self.biases.update({i: self.xp.asarray(b, dtype="float64") for i, b in biases.items()})
