"""``--state-copies 1`` on 4 ranks: the copy's bytes a step and its memory are the planner's,
and the shares pooled from every rank load into a fresh rank as the state they were taken from."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_in_groups
from layouts import small_config, token_source
from mpipar.plan.memory import predict_memory
from mpipar.plan.traffic import predict_step_bytes
from mpipar.rules import validate

CASES = [dict(dp=2, tp=2, zero=1, bucket_mb=0.003), dict(dp=2, pp=2, zero=3), dict(dp=2, pp=2)]


def _pieces(eng) -> dict:
    return {(k, n, lo): np.array(v) for k, n, lo, _, v in eng.state.pieces()}


def _check(comm, case: dict) -> list[str]:
    from mpipar.runtime.comm import Group
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    from mpipar.training.recovery import COPIES_KEPT, StateCopy
    from mpipar.training.state_copies import GROUP, StateCopies, assemble

    cfg = small_config(**case)
    cfg.train.on_rank_failure, cfg.train.state_copies = "shrink", 1
    cfg = validate(cfg, comm.size)
    eng = build_rank(cfg, comm, source=token_source())
    copies = StateCopies(Group(comm, GROUP, eng.ledger), [0] * comm.size, COPIES_KEPT)
    fails = []
    eng.ledger.reset()
    copies.refresh(eng, 0)
    trainer.train_step(eng, 0)
    got, want = eng.ledger.bytes_by_group(), predict_step_bytes(cfg, eng.coord)
    if got != want or GROUP not in got:   # ZeRO-0: the replicas of dp rank 0 send 0 bytes
        fails.append(f"{eng.coord}: ledger bytes {got} != predicted {want}")
    copies.refresh(eng, 1)
    held = sum(s.values.nbytes for s in (*copies.own.values(), *copies.partner.values()))
    if held != predict_memory(cfg, eng.coord).copies:
        fails.append(f"{eng.coord}: copies hold {held} B != predicted "
                     f"{predict_memory(cfg, eng.coord).copies}")
    # the lost rank's copy stands in for it: rank 1's share from its holder's copy
    pool: dict = {}
    for part in comm.allgather(copies.contribution(1, [1]) if comm.rank != 1 else {}):
        pool.update(part)
    tensors, kinds, bias = assemble(pool, eng.state.shapes)
    fresh = build_rank(cfg, comm, source=token_source())
    StateCopy.pooled(tensors, kinds, 1, bias, None).load(fresh)
    mine, theirs = _pieces(eng), _pieces(fresh)
    if mine.keys() != theirs.keys() or any(not np.array_equal(mine[k], theirs[k])
                                           for k in mine):
        fails.append(f"{eng.coord}: the pooled state differs from the rank's")
    trainer.close(fresh)
    trainer.close(eng)
    return fails


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("case", CASES, ids=["dp2-tp2-zero1", "dp2-pp2-zero3", "dp2-pp2-zero0"])
def test_copies_cost_what_the_planner_says_and_restore_the_state(world, case):
    check_in_groups(world, 4, lambda comm: _check(comm, case))
