"""The expert axis: the sparse blocks' exchange over the grid (:class:`mpipar.model.moe.
ExpertExchange`), the experts' weights sharded over ep, and the mixture of experts' rules.

Expert parallelism (``--ep N``): groups of N consecutive ranks of dp x sp split the experts,
E/N each (:class:`ExpertParallel`); tokens travel to their experts' ranks and back by
all-to-all(v) over the ``ep`` group. As Megatron and DeepSpeed do, a rank *holds* only the E/N
experts it computes (:func:`expert_shards`, :meth:`mpipar.parallel.placement.PlacementTable.holds`):
their weights, gradients and AdamW moments; the dense weights as without ep. The ranks holding
the same experts are those at the same position of their ep group, ``dp_sp.rank % N`` equal:
the ``ep_dp`` group (Megatron's expert data parallel group, dp x sp / N ranks). The experts'
gradients are reduced over ``ep_dp`` only, by a store of their own beside the dense one
(:class:`ExpertSplitReducer`), each ZeRO stage over its own replica group:

- ZeRO-0/1: a flat, uncompressed reducer over ``ep_dp`` (ZeRO-1 reduce-scatters them and the
  optimizer keeps ``1/|ep_dp|`` of their moments);
- ZeRO-2/3 (:class:`ExpertSplitUnits`): the experts of each sparse block are a unit of their
  own (:func:`expert_units`) sharded over ``ep_dp`` as :mod:`mpipar.parallel.fsdp` shards the
  dense units over dp x sp: gradients reduce-scattered over ``ep_dp``, ``1/|ep_dp|`` of their
  masters and moments a rank, and at ZeRO-3 ``1/|ep_dp|`` of their weights, the unit gathered
  over ``ep_dp`` around its block's forward and backward (beside the dense unit's gather over
  dp x sp; in node shared memory the dense units only, the experts' still gathered).

Under ``--grad-compression`` (ZeRO-0/1) the dense gradients are compressed over dp x sp as
without ep, the experts' reduced exactly over ``ep_dp`` beside them (their residuals zero in
checkpoints; a checkpoint's expert residuals from a run that compressed them are not carried).

The sum over the replicas is the sum over every token of the global batch routed to the
expert, so the update equals the one-process run. The global gradient norm adds the experts'
share summed over ep (each expert on one ep position). Checkpoints stay global tensors: an
expert is reported by the rank 0 of its ``ep_dp`` group (sharded stages: the owners of its
slices), and every rank reads only its own experts, whatever ep and ZeRO stage wrote them.

A sequence split over sp has its balance-loss statistics summed over the sp group (the ranks
holding the other tokens of the same rows), so the loss and its gradient do not depend on the
split. Experts are unsplit by tp: each tp rank holds its experts whole (role ``replicated`` in
the placement table) and computes the sparse FFN on the whole stream it holds, as the tp ranks
do for the norms; its gradients are the same on every tp rank and counted once (tp rank 0).

``exchange.py``: :class:`~mpipar.parallel.experts.exchange.ExpertParallel` (the ep all-to-all(v))
and the statistics' sum over sp; ``split.py``: the experts sharded over ep
(:func:`~mpipar.parallel.experts.split.expert_shards`, ``expert_units``,
:class:`~mpipar.parallel.experts.split.ExpertSplitReducer`, ``ExpertSplitUnits``); ``rule.py``:
the mixture of experts' rules with the layout; ``cost.py``: the calls, buckets and the expert
record's memory for the planner; ``axis.py``: the expert axis
(:class:`mpipar.parallel.axis.Axis`).
"""
