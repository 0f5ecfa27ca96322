"""Mixed precision (``--dtype bfloat16``) on 8 ranks: layouts track the one-process bf16 run,
the same layout repeats itself bit for bit, the ledger books the bytes the planner predicts,
and the state the engine holds is the planner's, byte for byte.

Run with ``mpirun -n 8 python -m pytest -q --only-mpi tests/mpi/test_mixed_precision.py``.

Tolerance. A bf16 layout cannot equal the one-process bf16 run bit for bit: each layout rounds
at other points (a tp rank's partial output is rounded to bf16 before the sum over tp, ring
attention merges blocks the whole-sequence kernel never splits, sums run in other orders), and
bf16 keeps 8 significant bits, so each such value moves by up to 2**-8 = 0.39 % of itself.
Those differences do not cancel; they feed 20 optimizer steps. The test holds the loss of every
step within 1 % (2.56 x 2**-8) of the one-process run's; measured, the largest difference over
20 steps is 0.66 % (dp 2 x tp 2 x pp 2, ZeRO-1), the float32 layouts of the same model agree to
1e-7. AdamW's eps is 1e-4 here for the reason ``layouts.small_config`` gives for float32: with
1e-8 an update of an element whose gradient is at round-off level is lr * sign(g), which
turns round-off into parameter differences of 2 lr.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import check_in_groups, rank_failures
from layouts import layout_name, layout_size, run, small_config, token_source
from mpipar.rules import validate
from mpipar.training import step as trainer

pytest.importorskip("ml_dtypes")

LOSS_TOLERANCE = 0.01
"""Relative difference of a step's loss from the one-process bf16 run (module docstring)."""


def bf16_config(steps: int = 20, recompute: str = "none", cuda_aware_mpi: str = "auto",
                **parallel):
    """The test model in bf16, AdamW eps 1e-4 (module docstring)."""
    cfg = small_config("bfloat16", **parallel)
    cfg.train.eps, cfg.train.steps, cfg.train.recompute = 1e-4, steps, recompute
    cfg.train.cuda_aware_mpi = cuda_aware_mpi
    return cfg


_REFERENCE: dict[tuple[int, str], tuple] = {}


def reference(steps: int, model: str = "llama") -> tuple:
    """The one-process bf16 run of ``steps`` steps of the test model ``model`` (losses, norms,
    params; once per process)."""
    from mpi4py import MPI
    if (steps, model) not in _REFERENCE:
        got = run(bf16_config(steps, model=model), MPI.COMM_SELF, steps)
        trainer.close(got[3])
        _REFERENCE[steps, model] = got[:3]
    return _REFERENCE[steps, model]


def _on_slice(world, layout: dict, steps: int, check) -> None:
    """Run ``layout`` (bf16) for ``steps`` steps on each slice of the world that fits it; every
    rank asserts on ``check(got)``'s failures of all ranks."""
    def on(comm) -> list[str]:
        got = run(bf16_config(steps, **layout), comm, steps)
        trainer.close(got[3])
        return check(got)

    check_in_groups(world, layout_size(layout), on)


def _loss_differences(got, ref) -> list[str]:
    return [f"step {k + 1}: loss {a!r} vs one process {b!r} ({abs(a - b) / abs(b):.2%})"
            for k, (a, b) in enumerate(zip(got[0], ref[0]))
            if not abs(a - b) <= LOSS_TOLERANCE * abs(b)]


@pytest.mark.mpi(min_size=8)
def test_dp2_tp2_pp2_zero1_tracks_one_process_for_20_steps(world):
    _on_slice(world, dict(dp=2, tp=2, pp=2, zero=1, bucket_mb=0.002), 20,
              lambda got: _loss_differences(got, reference(20)))


LAYOUTS = [dict(dp=2, tp=2, pp=2, zero=2), dict(dp=2, sp=2, pp=2, zero=3),
           dict(dp=4, tp=2, zero=3, zero_prefetch=2, reduce_dtype="bfloat16"),
           dict(dp=2, tp=2, pp=2, zero=1, reduce_dtype="bfloat16", bucket_mb=0.002),
           dict(dp=2, sp=2, tp=2, dp_reduce="hierarchical", ranks_per_node=4, zero=1),
           dict(sp=4, dp=2), dict(sp=4, tp=2, sp_split="zigzag", sp_overlap=True),
           dict(sp=2, sp_mode="ulysses", dp=2, pp=2), dict(sp=8, sp_mode="hybrid", ulysses_size=2),
           dict(tp=2, pp=2, dp=2, tp_sequence_parallel=True, schedule="zb-h1"),
           dict(pp=2, dp=2, tp=2, schedule="interleaved", virtual_stages=2,
                tp_sequence_parallel=True, recompute="selective"),
           dict(dp=2, tp=2, sp=2, zero=1, reduce_dtype="bfloat16", cuda_aware_mpi="off")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_layouts_track_one_process(world, layout):
    """ZeRO-2/3 (bf16 gathers), a bf16 dp x sp reduction, ring, zigzag, overlapped, Ulysses and
    hybrid attention, tp sequence parallelism, zb-h1's deferred weight gradients, interleaving
    with selective recomputation, and every axis staged through host buffers: 5 steps."""
    _on_slice(world, layout, 5, lambda got: _loss_differences(got, reference(5)))


# Latent attention's ring: the latents and RoPE keys travel in bf16, their gradients in float32.
LATENT_RING = [dict(model="latent", sp=2, dp=2, sp_split="zigzag", sp_overlap=True)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LATENT_RING, ids=[layout_name(v) for v in LATENT_RING])
def test_the_latent_ring_tracks_one_process(world, layout):
    """DeepSeek-V3's latent attention on the sp ring in bf16: 5 steps within the bound of the
    one-process bf16 run of the same model."""
    _on_slice(world, layout, 5,
              lambda got: _loss_differences(got, reference(5, layout["model"])))


def _mkl_missing() -> str | None:
    from mpipar.kernels import mkl_bf16
    reason = mkl_bf16.unavailable_reason()
    return None if reason is None else f"{reason}; {mkl_bf16.INSTALL}"


@pytest.mark.mpi(min_size=8)
@pytest.mark.skipif(_mkl_missing() is not None, reason=str(_mkl_missing()))
def test_bf16_gemms_through_mkl_track_one_process(world):
    """oneMKL's bf16 GEMMs (--cpu-bf16-gemm mkl: tp's split linears, pp, ZeRO-1) track the
    one-process run of the default choice (on a CPU without a bf16 unit, the float32 GEMMs):
    5 steps."""
    layout = dict(dp=2, tp=2, pp=2, zero=1, bucket_mb=0.002)

    def on(comm) -> list[str]:
        cfg = bf16_config(5, **layout)
        cfg.train.cpu_bf16_gemm = "mkl"
        got = run(cfg, comm, 5)
        used = got[3].compute.kernels.describe()
        trainer.close(got[3])
        return _loss_differences(got, reference(5)) + (
            [] if "oneMKL" in used else [f"kernels {used}: not MKL's"])

    check_in_groups(world, layout_size(layout), on)


@pytest.mark.mpi(min_size=8)
def test_the_same_layout_twice_is_bit_identical(world):
    """Mixed precision is deterministic: a layout run twice gives the same losses, norms and
    master weights, bit for bit."""
    layout = dict(dp=2, tp=2, pp=2, zero=1, bucket_mb=0.002, reduce_dtype="bfloat16")
    with rank_failures(world) as fails:
        first = run(bf16_config(4, **layout), world, 4)
        trainer.close(first[3])
        second = run(bf16_config(4, **layout), world, 4)
        trainer.close(second[3])
        if first[0] != second[0] or first[1] != second[1]:
            fails.append(f"losses {first[0]} then {second[0]}")
        fails += [f"{n} differs" for n in first[2]
                  if not np.array_equal(first[2][n], second[2][n])]


# ------------------------------------------------------------------ the planner knows the bytes
LEDGER = [dict(dp=2, tp=2, pp=2, zero=1, bucket_mb=0.003),
          dict(dp=2, tp=2, pp=2, zero=1, bucket_mb=0.003, reduce_dtype="bfloat16"),
          dict(dp=4, tp=2, tp_sequence_parallel=True, reduce_dtype="bfloat16"),
          dict(dp=2, sp=2, tp=2, dp_reduce="hierarchical", ranks_per_node=4,
               reduce_dtype="bfloat16"),
          dict(sp=4, tp=2), dict(sp=4, dp=2, sp_overlap=True, sp_split="zigzag"),
          dict(sp=2, sp_mode="ulysses", dp=2, pp=2), dict(dp=8, zero=3),
          dict(dp=4, tp=2, zero=3, reduce_dtype="bfloat16"),
          dict(dp=2, tp=2, pp=2, zero=2, schedule="zb-h1", tp_sequence_parallel=True),
          dict(dp=2, tp=2, pp=2, zero=3, zero_shared="node", reduce_dtype="bfloat16"),
          dict(model="tied", pp=2, dp=2, sp=2, zero=1, bucket_mb=0.003),
          dict(model="window", sp=8, sp_mode="halo", sp_split="zigzag"),
          dict(dp=4, pp=2, grad_compression="int8", bucket_mb=0.003)]


def _weights_state(w, zero: int) -> tuple[int, int, int, int]:
    """(compute copies, masters, gradients, moments) bytes of a rank's weights ``w`` (its
    reducer or sharded units, and optimizer) under ZeRO stage ``zero``."""
    buckets, opt = w.reducer.buckets, w.optimizer
    moments = (sum(a.nbytes for a in opt.m) + sum(a.nbytes for a in opt.v)
               if zero else
               sum(a.nbytes for a in opt.m.values()) + sum(a.nbytes for a in opt.v.values()))
    if w.sharded is not None:
        s = w.sharded
        weights = (s.shared_bytes if s.shared else
                   sum((b.owned_compute if s.gather else b.full).nbytes for b in buckets))
        return weights, sum(b.owned.nbytes for b in buckets), \
            sum(b.owned_grad.nbytes for b in buckets), moments
    masters = sum((b.owned if zero else b.master).nbytes for b in buckets)
    return (sum(b.params.nbytes for b in buckets), masters, sum(b.grads.nbytes for b in buckets),
            moments)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", LEDGER, ids=[layout_name(v) for v in LEDGER])
def test_ledger_and_state_equal_the_planner(world, case):
    """Per group the bytes and calls of a bf16 step are the planner's (activations and
    parameters gathered in bf16; the dp x sp reduction in float32, or bf16 with
    --reduce-dtype; the ring's dK/dV and halos' in float32); compute copies, float32 masters,
    gradients and moments are the planner's bytes."""
    from mpipar.plan.memory import predict_memory
    from mpipar.plan.traffic import predict_step_bytes, predict_step_messages
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank

    case = dict(case)
    model = case.pop("model", "llama")
    cfg = small_config("bfloat16", model, **case)
    layout = validate(cfg, 8)
    with rank_failures(world) as fails:
        eng = build_rank(layout, world, source=token_source())
        mem = predict_memory(layout, eng.coord)
        got = _weights_state(eng.weights, layout.parallel.zero)
        want = (mem.weights, mem.masters, mem.grads, mem.optimizer)
        if got != want:
            fails.append(f"{eng.coord}: engine state {got} != predicted {want}")
        eng.ledger.reset()
        trainer.train_step(eng, 0)
        messages: dict[str, int] = {}
        for (group, _), entry in eng.ledger.entries.items():
            messages[group] = messages.get(group, 0) + entry.messages
        if eng.ledger.bytes_by_group() != predict_step_bytes(layout, eng.coord):
            fails.append(f"{eng.coord}: ledger bytes {eng.ledger.bytes_by_group()} != "
                         f"predicted {predict_step_bytes(layout, eng.coord)}")
        if messages != predict_step_messages(layout, eng.coord):
            fails.append(f"{eng.coord}: ledger calls {messages} != predicted "
                         f"{predict_step_messages(layout, eng.coord)}")
        if eng.weights.sharded is not None:   # the buffers a step needed at once stay in the pool
            pooled = sum(b.nbytes for bufs in eng.weights.sharded.pool.free.values() for b in bufs)
            if not 0 < pooled <= mem.buffers:
                fails.append(f"{eng.coord}: pool {pooled} B, bound {mem.buffers} B")
        trainer.close(eng)
