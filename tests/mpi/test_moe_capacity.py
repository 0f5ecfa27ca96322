"""Expert capacity (``--moe-capacity-factor``) under ``mpirun -n 8``: capacity is per sequence,
so every layout drops the same assignments as the one-process run and equals it in float64
(<= 1e-10 in loss, gradient norm, parameters and balance loss over 3 AdamW steps; the dropped
counts per step and sparse layer exactly): sp ring (contiguous), zigzag, Ulysses and hybrid
(each rank needs the earlier positions' counts of the other sp ranks), the balanced split of
packed documents, ep with dp and sp, pp x tp, tp x sp, ZeRO-1, full recompute. And with the
router forced uniform (nothing drops), every group's bytes equal the planner's (a step's and a
validation pass's), the sp all-reduce carrying the counts per position block."""
from __future__ import annotations

import functools

import pytest

from conftest import check_in_groups
from layouts import compare, layout_name, layout_size, small_config, token_source
from mpipar.rules import validate
# test_moe's uniform router gives each expert the same count from each rank's row share, a
# whole row 8 = cap at C = 1 (nothing drops)
from tests.mpi.test_moe import bytes_equal_planner_with_a_uniform_router

CAPACITY = 0.75    # seq_len 16, 4 experts, top 2: cap = ceil(0.75 x 16 x 2 / 4) = 6 of ~8
LAYOUTS = [
    dict(dp=4, sp=2, sp_mode="ring"), dict(dp=2, sp=4, sp_split="zigzag", ep=4),
    dict(dp=4, sp=2, sp_mode="ulysses", ep=4),
    dict(dp=2, sp=4, sp_mode="hybrid", ulysses_size=2, sp_split="zigzag"),
    dict(dp=8, ep=2), dict(dp=2, tp=2, pp=2, ep=2, schedule="1f1b"),
    dict(dp=2, tp=2, sp=2, ep=2),
    dict(dp=2, sp=2, pp=2, ep=2, zero=1, bucket_mb=0.002),
    dict(dp=4, sp=2, ep=4, recompute="full"),
    # packed documents (EOS = 3: one to four a row): --sp-split balanced's split changes with
    # each microbatch; capacity stays per row, not per document
    dict(dp=2, sp=4, sp_split="balanced", ep=4, docs=True),
]


def config(docs: bool = False, recompute: str = "none", **layout):
    cfg = small_config("float64", "moe", **layout)
    cfg.model.moe_capacity_factor = CAPACITY
    cfg.train.recompute = recompute
    if docs:
        cfg.train.document_masking, cfg.train.eos_token_id = True, 3
    return cfg


def run(comm, steps: int = 3, **layout):
    """(losses, grad norms, gathered params, balance losses, dropped per step and layer)."""
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    rank = build_rank(validate(config(**layout), comm.Get_size()), comm, source=token_source(16))
    try:
        res = [trainer.train_step(rank, k) for k in range(steps)]
        return ([r.loss for r in res], [r.grad_norm for r in res], trainer.gather_params(rank),
                [r.moe["moe_aux_loss"] for r in res], [r.moe["moe_dropped"] for r in res])
    finally:
        trainer.close(rank)


@functools.lru_cache(maxsize=None)
def reference(docs: bool = False):
    from mpi4py import MPI
    return run(MPI.COMM_SELF, docs=docs)


@pytest.mark.mpi(min_size=8)
def test_the_reference_drops_and_differs_from_dropless():
    """The capacity bites: every sparse layer drops assignments every step, and the run is not
    the dropless one."""
    from mpi4py import MPI

    from mpipar.training import step as trainer

    from mpipar.training.rank import build_rank
    ref = reference()
    for r in (ref, reference(True)):
        assert all(sorted(d) == ["1", "2", "3"] and min(d.values()) > 0 for d in r[4]), r[4]
    cfg = config()
    cfg.model.moe_capacity_factor = 0.0
    rank = build_rank(validate(cfg, 1), MPI.COMM_SELF, source=token_source(16))
    plain = trainer.train_step(rank, 0)
    trainer.close(rank)
    assert plain.moe["moe_dropped"] == {"1": 0, "2": 0, "3": 0}
    assert abs(plain.loss - ref[0][0]) > 1e-6


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_capacity_equals_single_process_float64(world, layout):
    def check(comm) -> list[str]:
        got, ref = run(comm, **layout), reference(layout.get("docs", False))
        fails = compare(got[:3], ref[:3], 1e-10)
        fails += [f"moe_aux_loss[{i}] {a!r} vs {b!r}" for i, (a, b) in
                  enumerate(zip(got[3], ref[3])) if not abs(a - b) <= 1e-10 * abs(b)]
        if got[4] != ref[4]:
            fails.append(f"moe_dropped {got[4]} vs {ref[4]}")
        return fails

    check_in_groups(world, layout_size(layout), check)


LEDGER = [dict(dp=2, sp=4, ep=4, sp_split="zigzag"), dict(dp=4, sp=2, pp=1, ep=2)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", LEDGER, ids=[layout_name(v) for v in LEDGER])
def test_bytes_equal_planner_with_a_uniform_router(world, case, monkeypatch):
    """Capacity 1 under the uniform router: nothing drops, and a step's and a validation
    pass's (validation drops too) bytes per group are the planner's."""
    cfg = config(**case)
    cfg.model.moe_capacity_factor = 1.0

    def nothing_dropped(rank, layout, res) -> list[str]:
        dropped = res.moe["moe_dropped"]
        return [] if set(dropped.values()) == {0} else [f"dropped {dropped} under a uniform router"]

    bytes_equal_planner_with_a_uniform_router(world, cfg, monkeypatch, nothing_dropped)
