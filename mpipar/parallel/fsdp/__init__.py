"""ZeRO-2/3 (FSDP): the parameters as units sharded over dp x sp, gathered around their use and
their gradients reduce-scattered.

``sharded.py``: :class:`~mpipar.parallel.fsdp.sharded.ShardedParams` (units, the buffer pool,
node shared memory); ``rule.py``: its configuration rule; ``cost.py``: its units' lengths,
passes, calls and buffer pool for the planner; ``axis.py``: the ZeRO axis
(:class:`mpipar.parallel.axis.Axis`).
"""
