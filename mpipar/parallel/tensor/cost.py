"""What tensor parallelism costs a rank: the tp group's calls in a step."""
from __future__ import annotations

from collections.abc import Sequence

from mpipar.layout import Layout
from mpipar.parallel.calls import Call
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
    the two normed inputs (kept as shards), and reduce-scatters the two input gradients; once a
    step the norm weights' partial gradients are all-reduced, packed per gradient-ready call (a
    block, the head; a whole chunk under zb-h1's deferred weights), or at ZeRO-2/3 once a
    microbatch, per unit before its reduce-scatter. The first stage reduces the embedding
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
    if not par.tp_sequence_parallel:     # per block: leave o, down | enter q/k/v, gate/up
        calls = [Call("tp", "allreduce", full, passes * ((2 * reruns + 2 * bw) * blocks
                                                         - (reruns + bw) * sparse
                                                         + int(first) + bw * int(last)))]
        return calls + (stats if last else [])
    shard = full // par.tp
    calls = [Call("tp", "allgather", shard, passes * ((2 * reruns + 4 * bw) * blocks
                                                      + bw * int(first) + (1 + bw) * int(last))),
             Call("tp", "reduce_scatter", full, passes * ((2 * reruns + 2 * bw) * blocks
                                                          + int(first) + bw * int(last)))]
    calls += stats if last else []
    if not backward:
        return calls
    return calls + [Call("tp", "allreduce", n * m.hidden * prec.master_bytes)   # gradients
                    for n in _norm_reductions(layout, stages, unit_passes)]


def _norm_reductions(layout: Layout, stages: Sequence[int],
                     unit_passes: Sequence[tuple[str, int]]) -> list[int]:
    """Norm weights (of ``hidden`` elements each) in each all-reduce of their partial gradients
    in a step, under sequence parallelism: at ZeRO-2/3 one per unit reduce-scattered (a block's
    two, the head's final norm), under zb-h1 one per chunk with all its norms, else one per
    block and one for the head."""
    per, last = layout.model.layers // layout.stages, layout.stages - 1
    if layout.parallel.zero >= 2:
        return [2 if u.startswith("layers.") else 1 for u, k in unit_passes if u != "embed"
                for _ in range(k)]
    if layout.parallel.schedule == "zb-h1":
        return [2 * per + int(s == last) for s in stages]
    return [2] * (per * len(stages)) + ([1] if last in stages else [])
