"""What tensor parallelism costs a rank: the tp group's calls in a step, and the split's memory
and time terms (what a block and the LM head keep on a tp rank; their FLOPs on it)."""
from __future__ import annotations

import math
from collections.abc import Sequence

from mpipar.layout import Layout
from mpipar.model.flops import block_flops_per_token
from mpipar.model.lora import Lora, factor_of
from mpipar.model.mtp import mtp_param_shapes
from mpipar.model.params import block_param_specs
from mpipar.model.recompute import Recompute
from mpipar.parallel.axis import Footprint
from mpipar.parallel.calls import Call
from mpipar.parallel.pipeline.schedule import schedule_of
from mpipar.parallel.placement import (TENSOR_PARALLEL_PLAN, adapter_grad_partial, padded_vocab,
                                      plan_key)
from mpipar.runtime.precision import Precision


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
    partial gradients (the norm weights' under sequence parallelism, the ``heads_replicated``
    weights': :func:`_partial_grad_elements`) are all-reduced once a step, packed per
    gradient-ready call (a block, the head; a whole chunk under zb-h1's deferred weights), or
    at ZeRO-2/3 once a microbatch, per unit before its reduce-scatter. The first stage reduces the embedding
    (forward); the last all-reduces the cross-entropy's max and then its (sum-exp, target
    logit) per token, and the head's input gradient. In a training step the last stage's
    multi-token prediction modules add, each, a block's calls, an embedding's and a head's
    (their replicated projection's and norms' gradients are partial under sequence
    parallelism, reduced with the head's). Stream ``[B, S/sp, H]``."""
    m, par, tr = layout.model, layout.parallel, layout.train
    prec = Precision.of(tr, par)
    e, se = prec.compute_bytes, prec.stat_bytes      # activations, softmax statistics
    n_tok = layout.micro_rows * (tr.seq_len // par.sp)
    full = n_tok * m.hidden * e
    first, last, bw = 0 in stages, layout.stages - 1 in stages, int(backward)
    mtp = m.mtp_depth * bw * int(last)   # a step's modules: a block, an embedding, a head each
    blocks = m.layers // layout.stages * len(stages) + mtp
    reruns = tr.recompute_mode.forward_runs(backward)   # backward may re-run each forward
    heads = int(last) + mtp
    stats = [Call("tp", "allreduce_max", n_tok * se, passes * heads),
             Call("tp", "allreduce", 2 * n_tok * se, passes * heads)]
    per = m.layers // layout.stages     # a sparse block's FFN (experts unsplit): no tp calls,
    sparse = 0 if m.moe_shared_ffn_hidden else sum(   # but its shared expert's (a dense FFN's)
        m.is_sparse(i) for s in stages for i in range(s * per, (s + 1) * per)) + sum(
        m.is_sparse(m.layers) for _ in range(mtp))
    grads = [Call("tp", "allreduce", n * prec.master_bytes)   # partial gradients, summed
             for n in _partial_grad_elements(layout, stages, unit_passes) if n] if bw else []
    if not par.tp_sequence_parallel:     # per block: leave o, down | enter q/k/v, gate/up
        calls = [Call("tp", "allreduce", full, passes * ((2 * reruns + 2 * bw) * blocks
                                                         - (reruns + bw) * sparse
                                                         + int(first) + mtp + bw * heads))]
        return calls + (stats if last else []) + grads
    shard = full // par.tp
    calls = [Call("tp", "allgather", shard, passes * ((2 * reruns + 4 * bw) * blocks
                                                      + bw * (int(first) + mtp)
                                                      + (1 + bw) * heads)),
             Call("tp", "reduce_scatter", full, passes * ((2 * reruns + 2 * bw) * blocks
                                                          + int(first) + mtp + bw * heads))]
    return calls + (stats if last else []) + grads


def _partial_grad_elements(layout: Layout, stages: Sequence[int],
                           unit_passes: Sequence[tuple[str, int]]) -> list[int]:
    """Elements in each all-reduce of the partial gradients over tp in a step (0: none made):
    under sequence parallelism a block's norms (two, four with the ``sandwich`` placement)
    and the head's final norm (``hidden`` each), and a block's ``heads_replicated`` weights
    (applied to this rank's heads: with ``qk_norm`` the query and key norms, under latent
    attention the down-projections and the latents' norms), under LoRA a block's replicated
    adapter factors instead (the norms frozen); at ZeRO-2/3 one per unit reduce-scattered,
    under zb-h1 one per chunk with all its norms, else one per block and one for the head."""
    m, sp = layout.model, layout.parallel.tp_sequence_parallel
    block = m.norms.per_block * m.hidden * sp + sum(
        math.prod(spec.shape) for spec in block_param_specs(m, 0)
        if TENSOR_PARALLEL_PLAN[plan_key(spec.name)] == "heads_replicated")
    head = m.hidden * sp
    module = sum(math.prod(s) for _, s in mtp_param_shapes(m)) * sp + m.hidden * sp
    lora = Lora.of(layout.train)
    if lora is not None:   # the norms are frozen; the adapters' replicated factors are partial
        block, head, module = _replicated_adapter_elements(layout, lora), 0, 0
    per, last = m.layers // layout.stages, layout.stages - 1
    if layout.parallel.zero >= 2:    # a module's unit: its block, norms and projection
        return [block + module * (int(u.split(".")[1]) >= m.layers) if u.startswith("layers.")
                else head for u, k in unit_passes if u != "embed" for _ in range(k)]
    head += m.mtp_depth * (block + module)     # the modules' gradients leave with the head's
    if schedule_of(layout.parallel).defers_weights:
        return [per * block + head * (s == last) for s in stages]
    return [block] * (per * len(stages)) + ([head] if last in stages else [])


def _replicated_adapter_elements(layout: Layout, lora: Lora) -> int:
    """Elements of a block's LoRA factors whose gradients are partial over tp
    (:func:`mpipar.parallel.placement.adapter_grad_partial`)."""
    return sum(math.prod(a.shape) for spec in block_param_specs(layout.model, 0)
               for a in lora.specs(spec)
               if adapter_grad_partial(TENSOR_PARALLEL_PLAN[plan_key(spec.name)],
                                       factor_of(a.name)))


# ------------------------------------------------------------------------- memory and time
def block_record_bytes(layout: Layout, sparse: bool = False) -> dict[str, int]:
    """Bytes of the fields of a block's :class:`mpipar.model.llama.BlockSaved` that the tp split
    shapes, one microbatch on one rank: the stream (``x``, ``h1``, ``rstd1``, ``x2``, ``h2``,
    ``rstd2``: token shards under tp sequence parallelism), the attention output and its lse
    over this rank's heads, the FFN's ``g``, ``u``, ``m`` over its columns (``sparse``: the
    shared expert's, split as the dense FFN), with ``qk_norm`` the ``qk`` record (this
    rank's queries and keys before their norms, their rstds; under latent attention the query
    and kv latents before and after their norms and their rstds, every tp rank's whole), and
    with ``sandwich`` norms the ``post_norms`` record (the attention's and the FFN's outputs in
    the stream's shape, their rstds)."""
    m, par, tr = layout.model, layout.parallel, layout.train
    prec = Precision.of(tr, par)
    e, se = prec.compute_bytes, prec.stat_bytes
    n = layout.micro_rows * (tr.seq_len // par.sp)
    ns = n // (par.tp if par.tp_sequence_parallel else 1)    # the stream's tokens
    H, q = m.hidden, m.heads // par.tp * m.head_dim
    F = (m.moe_shared_ffn_hidden if sparse else m.ffn_hidden) // par.tp
    heads = (m.heads + m.kv_heads) // par.tp      # qk_norm: q, k before their norms, the rstds
    qk = n * heads * (m.head_dim * e + se) if m.qk_norm else 0
    if m.latent:     # the latents before and after their norms, their rstds (whole on a rank)
        qk = n * (2 * (m.latent_q_rank + m.latent_kv_rank) * e + (1 + bool(m.latent_q_rank)) * se)
    return {"x": H * ns * e, "h1": H * ns * e, "rstd1": ns * se,
            "attention_out": q * n * e, "attention_saved": n * (m.heads // par.tp) * se,
            "x2": H * ns * e, "h2": H * ns * e, "rstd2": ns * se,
            "g": F * n * e, "u": F * n * e, "m": F * n * e, "qk": qk,
            "post_norms": 2 * (H * ns * e + ns * se) if m.norms.sandwich else 0}


def head_record_bytes(layout: Layout) -> int:
    """Bytes the LM head keeps for one microbatch on a tp rank: x, normed x, rstd (stream),
    logits over its vocabulary slice, targets, lse."""
    m, par, tr = layout.model, layout.parallel, layout.train
    prec = Precision.of(tr, par)
    e, se = prec.compute_bytes, prec.stat_bytes
    n = layout.micro_rows * (tr.seq_len // par.sp)
    ns = n // (par.tp if par.tp_sequence_parallel else 1)
    vl = padded_vocab(m.vocab_size, par.tp) // par.tp
    return 2 * m.hidden * ns * e + ns * se + vl * n * e + n * (8 + se)


def tensor_footprint(layout: Layout, mode: Recompute) -> Footprint:
    """The tensor axis's :class:`mpipar.parallel.axis.Footprint`: a block's and the head's
    records on a tp rank (the same under every recompute mode: the mode picks the fields)."""
    return Footprint(block_record_bytes(layout), block_record_bytes(layout, sparse=True),
                     head_record_bytes(layout))


def block_flops(layout: Layout, context: float) -> float:
    """FLOPs of one microbatch's forward through one block on a tp rank, its queries attending
    to ``context`` keys each (:func:`mpipar.model.flops.block_flops_per_token`)."""
    m, par, tr = layout.model, layout.parallel, layout.train
    n = layout.micro_rows * (tr.seq_len // par.sp)
    return block_flops_per_token(m, par.tp, context) * n


def head_flops(layout: Layout) -> float:
    """FLOPs of one microbatch's forward through the LM head on a tp rank (its vocabulary
    slice)."""
    m, par, tr = layout.model, layout.parallel, layout.train
    n = layout.micro_rows * (tr.seq_len // par.sp)
    vl = padded_vocab(m.vocab_size, par.tp) // par.tp
    return 2 * m.hidden * vl * n


def mtp_flops(layout: Layout, contexts: Sequence[float]) -> float:
    """FLOPs of one microbatch's forward through the multi-token prediction modules on a tp
    rank, module ``k``'s queries attending to ``contexts[k]`` keys each: its projection
    ``[H, 2H]`` (whole on every tp rank, over the tokens of the stream it holds), its block and
    the shared LM head (:func:`mpipar.model.flops.mtp_module_flops_per_token` on one rank)."""
    m, par, tr = layout.model, layout.parallel, layout.train
    n = layout.micro_rows * (tr.seq_len // par.sp)
    ns = n // (par.tp if par.tp_sequence_parallel else 1)
    return sum(4 * m.hidden * m.hidden * ns + block_flops(layout, c) + head_flops(layout)
               for c in contexts)


def qkv_flops(layout: Layout, blocks: int) -> int:
    """FLOPs of the q/k/v projections of one microbatch through ``blocks`` blocks on a tp rank
    (what selective recompute repeats)."""
    m, par, tr = layout.model, layout.parallel, layout.train
    n = layout.micro_rows * (tr.seq_len // par.sp)
    return 2 * m.hidden * (m.heads + 2 * m.kv_heads) // par.tp * m.head_dim * n * blocks
