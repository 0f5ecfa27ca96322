"""The engine's state API (what checkpoints build on): state saved from one layout and loaded
into another continues exactly like the uninterrupted single-process run."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import rank_failures
from layouts import compare, global_state, reference, small_config, token_source
from mpipar.rules import validate

CASES = [(dict(dp=2, tp=2, pp=2), dict(tp=2, pp=4)),
         (dict(pp=2, sp=2, tp=2), dict(dp=8)),
         (dict(dp=8, zero=1, bucket_mb=0.002), dict(dp=4, tp=2, zero=0)),
         (dict(pp=2, schedule="interleaved", virtual_stages=2, dp=4), dict(pp=2, dp=2, sp=2, zero=1)),
         (dict(dp=8, zero=3), dict(dp=4, tp=2, zero=0)),
         (dict(dp=2, tp=2, pp=2), dict(dp=4, sp=2, zero=3, zero_prefetch=2)),
         (dict(dp=2, sp=2, pp=2, zero=2), dict(dp=2, tp=2, sp=2, zero=3)),
         (dict(dp=4, tp=2, zero=3, zero_shared="node"), dict(dp=2, tp=2, pp=2)),
         (dict(dp=2, tp=2, pp=2), dict(dp=8, zero=3, zero_shared="node")),
         (dict(dp=4, sp=2, zero=1), dict(dp=4, tp=2, zero=3, zero_shared="node",
                                         ranks_per_node=4))]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("before,after", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_state_moves_between_layouts(world, before, after):
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank

    with rank_failures(world) as fails:
        a = build_rank(validate(small_config(**before), 8), world, source=token_source())
        trainer.train_step(a, 0)
        state = global_state(a, world)
        if any(np.isnan(v).any() for v in state.values()):
            fails.append("some global state was not held by any rank")
        b = build_rank(validate(small_config(**after), 8), world, source=token_source())
        b.state.load(lambda kind, name, region: state[(kind, name)][region], a.state.step)
        r2 = trainer.train_step(b, 1)
        got = ([None, r2.loss], [None, r2.grad_norm], trainer.gather_params(b))
        ref = reference()
        fails += compare(([ref[0][0], r2.loss], [ref[1][0], r2.grad_norm], got[2]), ref, 1e-10)
