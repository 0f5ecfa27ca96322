"""Mixture of experts on a CUDA device: every expert-parallel layout of up to 8 ranks sharing
the GPU equals the CPU's single-process run in float64 (<= 1e-10: losses, gradient norms,
parameters and balance losses of two AdamW steps; the loads exactly), with CuPy's kernels and
the engine's MoE paths that the CPU tests cover: the all-to-all-v overlapped with the experts'
GEMMs and not (``--no-ep-overlap``), experts sharded over ``ep_dp`` under ZeRO-2/3, a shared
expert with Qwen2-MoE's gate, the router without renormalisation (``--no-moe-norm-topk``), and
an expert capacity that drops assignments.

Run at every world size: ``mpiexec -n N python -m pytest --only-mpi tests/gpu`` for N = 1, 2, 4,
8 runs every layout of at most N ranks (on each slice of the world that fits it)."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import check_in_groups
from layouts import compare, layout_name, layout_size, small_config

LAYOUTS = [dict(), dict(dp=2, ep=2), dict(dp=2, ep=2, ep_overlap=False),
           dict(dp=2, ep=2, model="moe_qwen"), dict(dp=2, ep=2, model="moe_gated_cap"),
           # 4 ranks: experts sharded over ep_dp (2 ranks) under ZeRO-2 and ZeRO-3
           dict(dp=4, ep=2, zero=2), dict(dp=2, sp=2, ep=2, zero=3),
           dict(dp=2, tp=2, ep=2, zero=3, ep_overlap=False),
           # 8 ranks
           dict(dp=8, ep=8, model="moe8"), dict(dp=4, sp=2, ep=4, zero=3),
           dict(dp=2, sp=2, tp=2, ep=2, zero=2, sp_split="zigzag"),
           dict(dp=2, sp=2, pp=2, ep=2, zero=3, schedule="zb-h1", model="moe_qwen")]


def _cfg(layout: dict, device: str):
    """The MoE test model of ``layout`` (its ``model`` key, default ``moe``) in float64 on
    ``device`` (CuPy's kernels on cuda, NumPy's on the CPU)."""
    layout = dict(layout)
    cfg = small_config("float64", layout.pop("model", "moe"), **layout)
    backend = "cupy" if device == "cuda" else "numpy"
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device=device,
                                                              backend=backend))


def check_layout(world, layout: dict, device: str = "cuda") -> None:
    """``layout`` on ``device`` against the CPU's one process of the same model, asserted on
    every rank (each group of the layout's size runs it; world sizes are powers of two)."""
    from tests.mpi.test_moe import reference, run
    size = layout_size(layout)
    if size > world.size:
        pytest.skip(f"layout of {size} ranks, world of {world.size}")

    def check(comm) -> list[str]:
        got = run(_cfg(layout, device), comm)
        ref = reference(model=layout.get("model", "moe"))
        fails = compare(got[:3], ref[:3], 1e-10)
        fails += [f"moe_aux_loss[{i}] {a!r} vs {b!r}" for i, (a, b)
                  in enumerate(zip(got[3], ref[3])) if not abs(a - b) <= 1e-10 * abs(b)]
        return fails + ([f"loads {got[4]} vs {ref[4]}"] if got[4] != ref[4] else [])

    check_in_groups(world, size, check)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) or "single" for v in LAYOUTS])
def test_moe_layouts_on_the_device_equal_the_cpu(world, layout):
    check_layout(world, layout)
