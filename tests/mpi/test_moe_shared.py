"""A mixture of experts with a shared expert (``--moe-shared-ffn-hidden``, DeepSeek-V3's) under
``mpirun -n 8``: every layout equals the single-process run in float64 (<= 1e-10 in the losses,
gradient norms, parameters and balance losses of two AdamW steps; the loads exactly).

The model is ``layouts.py``'s ``moe_shared``: blocks 1-3 sparse (4 experts, top 2, alpha 0.05),
each with a shared expert of width 24. The shared expert is a dense FFN: split by tp (gate/up
rows, down columns), replicated over dp x sp whatever ep (not an expert), reduced with the dense
gradients, sharded with its block's unit under ZeRO-3. ``moe_gated`` adds Qwen2-MoE's sigmoid
gate (``[1, H]``, replicated over tp). Also: a rank's weights, gradients and AdamW moments
(the shared expert split by tp beside experts sharded over ep) equal the planner's; a checkpoint
saved under tp 2, ep 4, ZeRO-3 loads under tp 1, pp 2, ep 2, ZeRO-1 and the next step equals
the one-process run's."""
from __future__ import annotations

import pytest

from layouts import layout_name
from tests.mpi import test_moe as moe   # its checks, called here on the shared-expert models
from tests.mpi.test_moe import _check

LAYOUTS = [
    dict(dp=4, tp=2),                                            # the shared expert split by tp
    dict(dp=2, tp=2, pp=2, ep=2, schedule="zb-h1"),              # deferred weight gradients
    dict(dp=2, sp=2, tp=2, ep=4, zero=3),                        # sharded in its block's unit
    dict(dp=2, sp=2, pp=2, ep=2, zero=1, bucket_mb=0.002),       # ZeRO-1, several buckets
    dict(dp=4, sp=2, ep=4, sp_mode="ulysses"),
]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_shared_expert_layout_equals_single_process_float64(world, layout):
    _check(world, {**layout, "model": "moe_shared"})

GATED = [dict(dp=4, tp=2), dict(dp=2, sp=2, tp=2, ep=4, zero=3),
         dict(dp=2, tp=2, pp=2, ep=2, schedule="zb-h1")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", GATED, ids=[layout_name(v) for v in GATED])
def test_gated_shared_expert_layout_equals_single_process_float64(world, layout):
    _check(world, {**layout, "model": "moe_gated"})


@pytest.mark.mpi(min_size=8)
def test_gated_shared_expert_with_capacity_equals_single_process_float64(world):
    """Expert capacity drops routed assignments; the shared expert still takes every token."""
    _check(world, {"dp": 2, "sp": 2, "tp": 2, "ep": 4, "model": "moe_gated_cap"})


@pytest.mark.mpi(min_size=8)
def test_shared_expert_selective_recompute_equals_single_process_float64(world):
    _check(world, {"dp": 4, "tp": 2, "model": "moe_shared"}, "selective")


@pytest.mark.mpi(min_size=8)
def test_state_bytes_equal_the_planner(world):
    moe.test_a_rank_holds_its_experts_only(world, dict(dp=2, sp=2, tp=2, ep=4, zero=1,
                                                       bucket_mb=0.002, model="moe_shared"))


@pytest.mark.mpi(min_size=8)
def test_checkpoint_moves_across_tp_ep_and_zero(world):
    moe.test_checkpoint_moves_across_ep_sizes(
        world, dict(model="moe_gated", dp=2, sp=2, tp=2, ep=4, zero=3),
        dict(dp=2, sp=2, pp=2, ep=2, zero=1))
