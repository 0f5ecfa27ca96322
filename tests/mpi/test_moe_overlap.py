"""The expert-parallel all-to-all-v overlapped with compute (``parallel.ep_overlap``, the default)
gives the same bits as the blocking exchange (``--no-ep-overlap``) in float64, and books the
same bytes: the same GEMMs on the same rows in the same order, only the wait moved
(:func:`mpipar.model.moe.experts_fwd`). Under ``mpirun -n 8``: two AdamW steps of the small
model of ``layouts.py`` on ep 8, ep 4 with sp (zigzag), ep 2 with sp and pp (a shared expert
computed while the rows travel) and ep 2 with tp and pp under zero-bubble (deferred weight
gradients); losses, gradient norms, every parameter and the balance losses compared exactly,
and the ``ep`` group's ledger (the rows' calls non-blocking under overlap only)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_in_groups
from layouts import layout_name, layout_size, small_config, token_source
from mpipar.rules import validate

LAYOUTS = [
    dict(dp=8, ep=8, model="moe8"),
    dict(dp=2, sp=4, ep=4, sp_split="zigzag"),
    dict(dp=2, sp=2, pp=2, ep=2, model="moe_shared"),
    dict(dp=2, tp=2, pp=2, ep=2, schedule="zb-h1"),
]


def _run(layout: dict, overlap: bool, comm) -> tuple:
    """(losses, grad norms, balance losses, gathered params, the ep group's ledger entries
    ``{op: (bytes, messages)}``) of two steps."""
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    layout = dict(layout)
    cfg = small_config("float64", layout.pop("model", "moe"), ep_overlap=overlap, **layout)
    rank = build_rank(validate(cfg, comm.Get_size()), comm, source=token_source(cfg.train.seq_len))
    try:
        res = [trainer.train_step(rank, k) for k in range(2)]
        ep = {op: (e.bytes, e.messages) for (g, op), e in rank.ledger.entries.items()
              if g == "ep"}
        return ([r.loss for r in res], [r.grad_norm for r in res],
                [r.moe["moe_aux_loss"] for r in res], trainer.gather_params(rank), ep)
    finally:
        trainer.close(rank)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_overlapped_exchange_equals_blocking_bitwise(world, layout):
    def check(comm) -> list[str]:
        (*got, params, ledger), (*want, ref, ledger_b) = (_run(layout, o, comm)
                                                          for o in (True, False))
        fails = [f"{name}: {a!r} vs {b!r}" for name, a, b in
                 zip(("losses", "grad norms", "balance losses"), got, want) if a != b]
        fails += [f"{n} differs" for n in ref if not np.array_equal(params[n], ref[n])]
        if "ialltoallv" not in ledger or "alltoallv" in ledger:
            fails.append(f"overlap did not post non-blocking all-to-all-v: {ledger}")
        if ledger.pop("ialltoallv", None) != ledger_b.pop("alltoallv", None) or ledger != ledger_b:
            fails.append(f"ep ledger {ledger} vs blocking {ledger_b}")
        return fails

    check_in_groups(world, layout_size(layout), check)
