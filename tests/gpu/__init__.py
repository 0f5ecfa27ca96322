"""Tests that need a CUDA device and CuPy (marked ``gpu``; skipped, with the reason, where there
is none)."""
