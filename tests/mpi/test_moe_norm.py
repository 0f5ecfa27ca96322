"""The router without renormalisation (``--no-moe-norm-topk``) under ``mpirun -n 8``: layouts
with expert and sequence parallelism equal the single-process run in float64 (<= 1e-10 in the
losses, gradient norms, parameters and balance losses of two AdamW steps; the loads exactly).
The model is ``layouts.py``'s ``moe_qwen``: ``moe_gated`` (a Qwen2-MoE: gated shared expert)
with ``norm_topk_prob: false``, as Qwen1.5-MoE-A2.7B."""
from __future__ import annotations

import pytest

from layouts import layout_name
from tests.mpi.test_moe import _check

LAYOUTS = [
    dict(dp=2, sp=2, tp=2, ep=4),                                # ring sp, experts over 4 ranks
    dict(dp=4, sp=2, ep=4, sp_mode="ulysses"),                   # all-to-all sp, ep over dp x sp
]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_unnormalised_router_layout_equals_single_process_float64(world, layout):
    _check(world, {**layout, "model": "moe_qwen"})
