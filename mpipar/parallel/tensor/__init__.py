"""Tensor parallelism (Megatron-LM): heads, FFN columns, the vocabulary and (with tp sequence
parallelism) tokens split over tp.

``ops.py``: :class:`~mpipar.parallel.tensor.ops.TensorParallel` (the
:class:`mpipar.model.tensor_ops.TensorOps` seam: column- and row-parallel linears, the
vocabulary-parallel embedding and cross-entropy); ``rule.py``: what tp must divide;
``cost.py``: the tp group's calls and the split's memory and time terms for the planner;
``axis.py``: the tensor axis (:class:`mpipar.parallel.axis.Axis`).
"""
