"""Data parallelism: gradients reduced over dp x sp as backward produces them.

``reducer.py``: :class:`~mpipar.parallel.data_parallel.reducer.GradReducer` (buckets, flat or
hierarchical, dense or compressed; ZeRO-1's reduce-scatter) and when compression starts;
``rule.py``: its configuration rule; ``cost.py``: its buckets, calls, buffers and codec work
for the planner; ``axis.py``: the data axis (:class:`mpipar.parallel.axis.Axis`).
"""
