"""One array seam on 8 ranks: every layout's step, and the compressed reductions (encoding,
decoding, residuals, their messages), allocate through the kernel backend's ``xp`` under the
guard of :mod:`xp_guard`, and still equal the single-process (or the same layout's unguarded)
run."""
from __future__ import annotations

import pytest

from conftest import check_in_groups, rank_failures
from layouts import compare, layout_name, layout_size, reference, small_config
from xp_guard import guarded_step

LAYOUTS = [dict(tp=2, sp=2, pp=2), dict(dp=2, sp=2, sp_mode="ulysses", zero=1, bucket_mb=0.002),
           dict(tp=2, pp=2, dp=2, tp_sequence_parallel=True),
           dict(sp=4, sp_overlap=True, tp=2, sp_split="zigzag"),
           dict(dp=2, sp=4, sp_mode="hybrid", ulysses_size=2, sp_split="zigzag",
                ranks_per_node=4, dp_reduce="hierarchical", bucket_mb=0.002)]
COMPRESSED = [dict(dp=4, sp=2, ranks_per_node=4, dp_reduce="hierarchical",
                   grad_compression="int8", bucket_mb=0.002),
              dict(dp=8, grad_compression="topk", zero=1)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_every_layout_allocates_through_xp(world, layout):
    def check(comm) -> list[str]:
        with pytest.MonkeyPatch.context() as patch:
            got, recording = guarded_step(patch, small_config(**layout), comm)
            fails = compare(got, reference("float64"), 1e-10)
            if not recording.calls.get("empty"):
                fails.append(f"no receive or ring buffer came from xp: {recording.calls}")
            return fails

    check_in_groups(world, layout_size(layout), check)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", COMPRESSED, ids=[layout_name(v) for v in COMPRESSED])
def test_compressed_reduction_allocates_through_xp(world, layout):
    """Compressed reductions (encoding, decoding, residuals, their messages) allocate from xp
    too; the guarded steps equal the same layout's unguarded ones bit for bit."""
    from layouts import run

    with rank_failures(world) as fails, pytest.MonkeyPatch.context() as patch:
        want = run(small_config(**layout), world)[:3]
        got, recording = guarded_step(patch, small_config(**layout), world)
        fails += compare(got, want, 0.0)
        if not recording.calls.get("rint" if "int8" in layout.values() else "argpartition"):
            fails.append(f"the codec did not run through xp: {recording.calls}")
