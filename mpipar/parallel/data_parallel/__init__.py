"""Data parallelism: gradients reduced over dp x sp as backward produces them.

``reducer.py``: :class:`~mpipar.parallel.data_parallel.reducer.GradReducer` (the reduction's
face) and when compression starts; ``buckets.py``: the flat buffers, their views and ZeRO-1's
owned slices; ``chain.py``: each bucket's collectives (flat or hierarchical, dense or
compressed; ZeRO-1's reduce-scatter); ``residuals.py``: error-feedback residuals in
checkpoints; ``modes.py``: ``--dp-reduce``, ``--grad-compression``, ``--error-feedback`` and
``--topk-catch-up`` as one :class:`~mpipar.parallel.data_parallel.modes.Reduction`;
``rule.py``: its configuration rule; ``cost.py``: its buckets, calls, buffers and codec work
for the planner; ``axis.py``: the data axis (:class:`mpipar.parallel.axis.Axis`).
"""
