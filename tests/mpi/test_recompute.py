"""Activation recomputation and offload under ``mpirun -n 8``: tp2+sp2+pp2 (1F1B and zb-h1, ring
attention), dp2+pp4 zb-h1, Ulysses and interleaved+ZeRO layouts equal their ``none`` run bit for
bit in every mode (:mod:`recompute_runs`)."""
from __future__ import annotations

import tempfile

import pytest

from conftest import check_in_groups
from layouts import compare, layout_name, layout_size, reference
from recompute_runs import MODES, identical, run_mode

LAYOUTS = [dict(tp=2, sp=2, pp=2),
           dict(tp=2, sp=2, pp=2, schedule="zb-h1", sp_split="zigzag"),
           dict(dp=2, pp=4, schedule="zb-h1"),
           dict(dp=2, sp=2, pp=2, sp_mode="ulysses"),
           dict(pp=2, virtual_stages=2, schedule="interleaved", tp=2, dp=2, zero=1,
                bucket_mb=0.002),
           dict(dp=2, sp=2, pp=2, schedule="zb-h1", zero=3),
           dict(dp=4, tp=2, zero=2),
           dict(model="qwen3", tp=2, sp=2, pp=2), dict(model="qwen3", dp=2, sp=2, pp=2,
                                                       sp_mode="ulysses")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_modes_equal_none_under_mpi(world, layout):
    run_dir = world.bcast(tempfile.mkdtemp(prefix="mpipar-rc-") if world.rank == 0 else None)

    def check(comm) -> list[str]:
        ref = run_mode(layout, "none", comm, run_dir)
        fails = compare(ref, reference("float64", model=layout.get("model", "llama")), 1e-10)
        for mode in MODES:
            fails += [f"{mode}: {f}" for f in identical(run_mode(layout, mode, comm, run_dir), ref)]
        return fails

    check_in_groups(world, layout_size(layout), check)
