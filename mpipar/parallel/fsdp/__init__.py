"""ZeRO-2/3 (FSDP): the parameters as units sharded over dp x sp, gathered around their use and
their gradients reduce-scattered.

``sharded.py``: :class:`~mpipar.parallel.fsdp.sharded.ShardedParams` (the units and the model's
scope); ``units.py``: a unit's storage and the buffer pool; ``gather.py``: ZeRO-3's gathers and
prefetch; ``scatter.py``: the gradients' reduce-scatters; ``node_copy.py``: node shared memory;
``modes.py``: ``--zero-shared``; ``rule.py``: its configuration rule; ``cost.py``: its units'
lengths, passes, calls and buffer pool for the planner; ``axis.py``: the ZeRO axis
(:class:`mpipar.parallel.axis.Axis`).
"""
