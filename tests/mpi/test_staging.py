"""The staging path on every axis: with ``--cuda-aware-mpi off`` on the CPU
every buffer call of every group (dp x sp buckets, ZeRO-1, ZeRO-2/3's units, tp, pp send/recv,
ring Sendrecv and Isend/Irecv, Ulysses all-to-all, the tied embedding's pp_ends) goes through
reusable host buffers, through the same code a device run uses with pinned buffers. Each layout
must equal the single-process run in float64 (<= 1e-10), book exactly the MPI traffic of the
direct path, and keep its host buffers bounded by what can be in flight at once."""
from __future__ import annotations

import dataclasses

import pytest

from conftest import check_in_groups
from layouts import compare, layout_name, layout_size, reference, small_config, token_source
from mpipar.rules import validate
from mpipar.training import step as trainer

LAYOUTS = [
    dict(dp=2, tp=2, pp=2, zero=1, bucket_mb=0.002),
    dict(sp=4, tp=2, sp_overlap=True, sp_split="zigzag"),
    dict(dp=2, sp=2, pp=2, sp_mode="ulysses", schedule="interleaved", virtual_stages=2),
    dict(tp=2, pp=2, dp=2, tp_sequence_parallel=True, schedule="zb-h1", bucket_mb=0.002),
    dict(model="tied", dp=2, sp=2, pp=2),
    # ZeRO-2/3: prefetched all-gathers and reduce-scatters, non-blocking, staged
    dict(dp=2, tp=2, pp=2, zero=3, zero_prefetch=2), dict(dp=4, sp=2, zero=2),
    dict(dp=2, sp=2, pp=2, zero=3, schedule="interleaved", virtual_stages=2),
]


def _rank(layout: dict, comm, path: str):
    from mpipar.training.rank import build_rank
    layout = dict(layout)
    cfg = small_config(model=layout.pop("model", "llama"), **layout)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cuda_aware_mpi=path))
    return build_rank(validate(cfg, comm.Get_size()), comm, source=token_source())


def _check(layout: dict, comm) -> list[str]:
    staged, direct = _rank(layout, comm, "off"), _rank(layout, comm, "auto")
    paths = staged.comms.mpi_path, direct.comms.mpi_path
    fails = [] if paths[0].staging and not paths[1].staging else ["paths"]
    runs = []
    for rank in (staged, direct):
        results = [trainer.train_step(rank, k) for k in range(2)]
        runs.append(([r.loss for r in results], [r.grad_norm for r in results],
                     trainer.gather_params(rank)))
        rank.ledger.reset()
    fails += compare(runs[0], reference("float64", model=layout.get("model", "llama")), 1e-10)
    pool = staged.comms.mpi_path.allocated
    for rank in (staged, direct):
        trainer.train_step(rank, 2)
    # Buckets reduce as their gradients become final and progress when MPI says a step is done,
    # so how many are in flight at once (each holding a send and a receive buffer) depends on
    # timing: a later step may add buffers, never more than every bucket in flight at once.
    bound = 2 * len(staged.weights.reducer.buckets) + 2
    if staged.comms.mpi_path.allocated - pool > bound:
        fails.append(f"staging allocated {staged.comms.mpi_path.allocated - pool} buffers in "
                     f"step 3, more than {bound} (every bucket in flight)")
    mine = {k: (e.bytes, e.messages) for k, e in staged.ledger.entries.items()}
    theirs = {k: (e.bytes, e.messages) for k, e in direct.ledger.entries.items()}
    if mine != theirs:
        fails.append(f"staged ledger {mine} != direct {theirs}")
    if mine and not staged.ledger.staging.bytes:
        fails.append("no staging copies booked")
    if direct.ledger.staging.bytes:
        fails.append(f"the direct path staged {direct.ledger.staging.bytes} bytes")
    return fails


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_staged_layouts_equal_one_process(world, layout):
    check_in_groups(world, layout_size(layout), lambda comm: _check(layout, comm))
