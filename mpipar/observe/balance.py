"""How evenly a step's work fell: the attention work over the sp ranks, the tokens over the
experts. Plain data in, the step record's numbers out; the sums over the world are the
caller's (:mod:`mpipar.training.step`).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from mpipar.parallel.sequence_split import SeqLayout, rank_work


def attention_imbalance(docs: np.ndarray | None, seq: SeqLayout, windows: list[int],
                        ulysses: int, dp: int, rows_per_dp: int, microbatches: int,
                        micro_batch_size: int) -> float | None:
    """Max/mean of the sp ranks' attention work (causal pairs inside documents, within each
    layer's sliding window ``windows``; a Ulysses group of ``ulysses`` ranks shares its work)
    in a step whose global batch has documents ``docs [rows, S]``, the worst of the ``dp``
    replicas (each ``rows_per_dp`` rows, ``microbatches`` microbatches of ``micro_batch_size``
    rows, each split by
    :meth:`SeqLayout.for_microbatch`); None without documents or sequence parallelism."""
    if docs is None or seq.sp == 1:
        return None
    counts, worst = Counter(windows), 1.0
    for replica in range(dp):
        work = 0
        for i in range(microbatches):
            first = replica * rows_per_dp + i * micro_batch_size
            rows = docs[first:first + micro_batch_size]
            split = seq.for_microbatch(rows)
            work = work + sum(n * rank_work(split, rows, w, ulysses) for w, n in counts.items())
        worst = max(worst, float(work.max() / work.mean()))
    return worst


def moe_load_stats(sums: np.ndarray, sparse: list[int], experts: int, aux_loss_coef: float,
                   rows: int) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """The step's mixture-of-experts record and the loads themselves, from ``sums`` (host,
    summed over the world, tp counted once): ``[0]`` the balance losses' sum over rows and
    sparse layers, then each sparse layer's tokens routed to each expert ``[len(sparse) x
    experts]``, then each one's dropped assignments ``[len(sparse)]``. The record: the balance
    loss (``aux_loss_coef`` x the mean over the global batch's ``rows``), each sparse layer's
    load max over mean and its drops; the loads ``{layer: [experts]}`` (the routing biases'
    update)."""
    n, E = len(sparse), experts
    loads = sums[1:1 + n * E].reshape(n, E)
    return ({"moe_aux_loss": aux_loss_coef * float(sums[0]) / rows,
             "moe_load_max_over_mean": {str(i): float(ld.max() / ld.mean())
                                        for i, ld in zip(sparse, loads)},
             "moe_dropped": {str(i): int(d) for i, d in zip(sparse, sums[1 + n * E:])}},
            dict(zip(sparse, loads)))
