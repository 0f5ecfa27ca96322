"""Sequence (context) parallelism: attention across a sequence split over SP, one module per mode.

The attention cores implement :class:`mpipar.model.attention.AttentionCore` for a block that
holds only this rank's chunk of the sequence. How the sequence is cut (:class:`mpipar.parallel.
sequence_split.SeqLayout`: contiguous, zigzag, balanced) and the attention work each rank gets
live in :mod:`mpipar.parallel.sequence_split`.

- ``mode.py``: :class:`~mpipar.parallel.sequence.mode.SequenceMode`, what differs by
  ``--sp-mode`` (its rule, core, calls, memory and time terms); ``registry.py``: ``SP_MODES``.
- ``ring.py`` (K/V along the ring), ``halo.py`` (only the window's K/V), ``ulysses.py``
  (sequence chunks traded for head groups by all-to-all), ``hybrid.py`` (Ulysses inside groups,
  the ring across them): one mode each, its core and its messages.
- ``common.py``: what the modes share; ``rule.py``: the split's rule, then the mode's;
  ``cost.py``: the mode's calls, what its core keeps and its time terms for the planner.

Precision: K/V travel in the activations' dtype (bf16 under mixed precision); a core sums
partial results in :func:`mpipar.model.attention.accumulator` dtype (float32 for bf16): the
output merged over blocks, dQ over blocks, dK/dV over the ring's hops (they travel as float32
with their K/V, one byte message a hop) and halos (sent home as float32), and rounds each once at
the end. Ulysses' all-to-alls carry the rounded gradients.

Shapes: q ``[B, S_loc, hq, D]``, k/v ``[B, S_loc, hkv, D]``, lse ``[B, hq, S_loc]``.
Every buffer is allocated from the kernel backend's array module (``kernels.xp``).
"""
