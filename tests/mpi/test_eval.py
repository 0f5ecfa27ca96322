"""Validation loss on 8 ranks: the forward-only pass under each training layout equals the
single-process run's (float64 <= 1e-10), before and after a training step."""
from __future__ import annotations

import functools
import os

import pytest
from mpi4py import MPI

from conftest import check_in_groups
from layouts import eval_config, layout_name, layout_size, token_source
from mpipar.rules import validate
from mpipar.training import step as trainer
from mpipar.training.rank import build_rank


# ---------------------------------------------------------------- every layout (8 ranks)
LAYOUTS = [dict(dp=2, tp=2, pp=2), dict(sp=4, tp=2, sp_split="zigzag"),
           dict(pp=4, dp=2, schedule="zb-h1"), dict(pp=2, dp=2, sp=2, schedule="interleaved",
                                                    virtual_stages=2),
           dict(sp=2, sp_mode="ulysses", dp=4), dict(tp=2, pp=2, sp=2, sp_overlap=True),
           dict(dp=4, tp=2, tp_sequence_parallel=True, zero=1), dict(pp=4, tp=2, schedule="gpipe"),
           dict(dp=2, pp=2), dict(tp=2)]


@functools.lru_cache(maxsize=None)
def _single_process(recompute: str = "none") -> tuple[float, float, float]:
    """(validation loss after one step, after two, and the second step's training loss) on one
    process, with a validation pass between the steps."""
    cfg = eval_config()
    cfg.train.recompute = recompute
    rank = build_rank(validate(cfg, 1), MPI.COMM_SELF, source=token_source())
    trainer.train_step(rank, 0)
    first = trainer.evaluate(rank).loss
    second_loss = trainer.train_step(rank, 1).loss
    return first, trainer.evaluate(rank).loss, second_loss


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_validation_loss_is_the_same_on_every_layout(world, layout):
    size = layout_size(layout)

    def check(comm) -> list[str]:
        recompute = "offload" if layout.get("pp") == 4 and layout.get("tp") else "none"
        cfg = eval_config(**layout)
        cfg.train.recompute = recompute
        cfg.train.run_dir = f"/tmp/mpipar-test-eval-{os.getpid()}"
        rank = build_rank(validate(cfg, size), comm, source=token_source())
        trainer.train_step(rank, 0)
        got = (trainer.evaluate(rank).loss, trainer.train_step(rank, 1).loss, trainer.evaluate(rank).loss)
        trainer.close(rank)
        want = _single_process()
        diffs = [abs(a - b) / abs(b) for a, b in zip(got, (want[0], want[2], want[1]))]
        if world.rank == 0:
            print(f"\n{layout_name(layout)}: validation rel diffs {diffs[0]:.1e}, {diffs[2]:.1e}")
        return [f"{what}: {a!r} vs one process {b!r} (rel {abs(a - b) / b:.2e})"
                for what, a, b in zip(("eval after 1 step", "step 2 loss", "eval after 2 steps"),
                                      got, (want[0], want[2], want[1]))
                if not abs(a - b) <= 1e-10 * abs(b)]

    check_in_groups(world, size, check)
