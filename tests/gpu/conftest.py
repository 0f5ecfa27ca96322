"""Fixtures of the device tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def poisoned_pool():
    """Fill the free memory of CuPy's pool with 0xFF bytes (NaN as bf16 and as float32), so an
    output element a kernel forgets to write shows as NaN (or as bytes no input had)."""
    import cupy
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    block = cupy.empty(64 << 20, cupy.uint8)
    block.fill(255)
    del block
    yield
