"""One array seam: every array a training step allocates outside the kernels and the optimizer
math (both array-module generic: they allocate in the module of their inputs) comes from the
kernel backend's ``xp``. One process: a step run under the guard of :mod:`xp_guard` must still
equal the single-process run. Every layout and the compressed reductions: mpi/test_array_seam.py."""
from __future__ import annotations

from layouts import compare, reference, small_config
from xp_guard import guarded_step


def test_one_process_step_allocates_through_xp(monkeypatch):
    from mpi4py import MPI

    got, recording = guarded_step(monkeypatch, small_config(), MPI.COMM_SELF)
    assert compare(got, reference("float64"), 1e-12) == []
    # The microbatches cross once each; the loss weight, the loss and norm buffers are xp's.
    assert recording.calls.get("asarray", 0) >= 2 * 2 * 8 and recording.calls.get("full") == 2
    assert recording.calls.get("array", 0) >= 4
