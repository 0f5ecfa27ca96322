"""Auxiliary-loss-free balancing (``--moe-bias-update-rate``) under ``mpirun -n 8``: the routing
biases move from the loads of the step's *global* batch (summed over dp x sp, every microbatch,
every pipeline stage), so every layout equals the one-process run in float64 (<= 1e-10 in loss,
gradient norm and parameters over 3 steps, the balance loss on) and holds the same biases on
every rank, exactly (ep with dp, sp ring, pp x tp, ZeRO-1/3, interleaved with full recompute);
and a run stopped after step 2 and resumed (in its own layout, bit for bit;
in another, <= 1e-10) reproduces steps 3-4, its biases restored from the checkpoint."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from conftest import check_in_groups, rank_failures, shared_tmpdir
from layouts import compare, layout_name, layout_size, small_config, token_source
from mpipar.rules import validate
from mpipar.training import step as trainer

RATE = 0.02
LAYOUTS = [
    dict(dp=4, ep=2), dict(dp=2, sp=2, ep=4, sp_mode="ring"),
    dict(dp=2, tp=2, pp=2, ep=2, schedule="1f1b"),
    dict(dp=2, sp=2, pp=2, ep=2, zero=1, bucket_mb=0.002),
    dict(dp=2, sp=2, tp=2, ep=4, zero=3),
    dict(dp=4, pp=2, ep=4, schedule="interleaved", virtual_stages=2, recompute="full"),
]


def config(recompute: str = "none", **layout):
    cfg = small_config("float64", "moe", **layout)
    cfg.model.moe_bias_update_rate = RATE
    cfg.train.recompute = recompute
    return cfg


def rank(comm, **layout):
    from mpipar.training.rank import build_rank
    return build_rank(validate(config(**layout), comm.Get_size()), comm,
                  source=token_source(16))


def run(comm, steps: int = 3, **layout):
    """(losses, grad norms, gathered params, balance losses, biases after each step)."""
    eng = rank(comm, **layout)
    try:
        res = [trainer.train_step(eng, k) for k in range(steps)]
        return ([r.loss for r in res], [r.grad_norm for r in res], trainer.gather_params(eng),
                [r.moe["moe_aux_loss"] for r in res], eng.model.routing.host(),
                [r.moe["moe_bias_max_abs"] for r in res])
    finally:
        trainer.close(eng)


@functools.lru_cache(maxsize=None)
def reference():
    from mpi4py import MPI
    return run(MPI.COMM_SELF)


def bias_fails(comm, got: dict, want: dict) -> list[str]:
    """This rank's biases against the reference's, and against every other rank's: exactly."""
    fails = [f"bias of block {i}: {got.get(i)} vs {want[i]}" for i in want
             if i not in got or not np.array_equal(got[i], want[i])]
    everyone = comm.allgather({i: b.tobytes() for i, b in got.items()})
    if any(other != everyone[0] for other in everyone):
        fails.append("the biases differ between ranks")
    return fails


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_biased_routing_equals_single_process_float64(world, layout):
    def check(comm) -> list[str]:
        got, ref = run(comm, **layout), reference()
        fails = compare(got[:3], ref[:3], 1e-10)
        fails += [f"moe_aux_loss[{i}] {a!r} vs {b!r}" for i, (a, b) in
                  enumerate(zip(got[3], ref[3])) if not abs(a - b) <= 1e-10 * abs(b)]
        if got[5] != ref[5]:
            fails.append(f"moe_bias_max_abs {got[5]} vs {ref[5]}")
        return fails + bias_fails(comm, got[4], ref[4])

    check_in_groups(world, layout_size(layout), check)


@pytest.mark.mpi(min_size=8)
def test_the_bias_moves_and_changes_the_run():
    """The reference itself: after step 1 each sparse block's bias is +-rate or 0 per expert,
    and by step 3 the run differs from the unbiased one (the bias changed routing)."""
    from mpi4py import MPI


    from mpipar.training.rank import build_rank
    ref = reference()
    assert set(ref[5][0].values()) == {RATE} and len(ref[5][0]) == 3
    cfg = config()
    cfg.model.moe_bias_update_rate = 0.0
    eng = build_rank(validate(cfg, 1), MPI.COMM_SELF, source=token_source(16))
    plain = [trainer.train_step(eng, k).loss for k in range(3)]
    trainer.close(eng)
    assert plain[0] == ref[0][0] and abs(plain[2] - ref[0][2]) > 1e-8


RESUME = [(dict(dp=8, ep=2), dict(dp=8, ep=2)),
          (dict(dp=4, sp=2, ep=4, sp_mode="ring"),
           dict(dp=2, sp=2, pp=2, ep=2, zero=1, bucket_mb=0.002))]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("before,after", RESUME, ids=["same-layout", "ep4-sp2-to-pp2-ep2-zero1"])
def test_resume_reproduces_steps_3_and_4(world, before, after):
    """Stopped after step 2 (a checkpoint: parameters, moments and the biases in its index) and
    resumed: steps 3-4 equal the uninterrupted 4-step run of ``before`` (bit for bit in the same
    layout; <= 1e-10 in another), and the biases equal exactly."""
    from mpipar.checkpoint import reader, writer
    from mpipar.runtime.comm import Group, Ledger
    with rank_failures(world) as fails, shared_tmpdir(world, "mpipar-bias-") as root:
        whole = run(world, steps=4, **before)
        a = rank(world, **before)
        trainer.train_step(a, 0)
        trainer.train_step(a, 1)
        path = writer.save(a.state, trainer.run_position(a, 2), root, Group(world, "world", Ledger()))
        trainer.close(a)
        b = rank(world, **after)
        if reader.load(b.state, path) != 2:
            fails.append("load did not return step 2")
        b.model.routing.load(reader.read_moe_bias(path))
        res = [trainer.train_step(b, k) for k in (2, 3)]
        got = ([*whole[0][:2], *(r.loss for r in res)],
               [*whole[1][:2], *(r.grad_norm for r in res)], trainer.gather_params(b))
        tol = 0.0 if before == after else 1e-10
        fails += compare(got, whole[:3], tol)
        fails += bias_fails(world, b.model.routing.host(), whole[4])
        trainer.close(b)
