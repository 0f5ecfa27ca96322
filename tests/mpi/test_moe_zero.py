"""Experts sharded over their own replica group under ZeRO-2 and ZeRO-3 (``--ep N`` with
``--zero 2/3``, :mod:`mpipar.parallel.experts`), under ``mpirun -n 8``: a rank holds only the
E/N experts of its ep position, as one unit per sparse block sharded over ``ep_dp`` (the
ranks of dp x sp at its ep position), beside the dense units over dp x sp.

- every layout (ep 2 and 4 with dp, sp, tp, pp; ZeRO-2 and ZeRO-3, in node shared memory too;
  zb-h1's deferred weight gradients, interleaving, recompute) equals the one-process run in
  float64 (<= 1e-10: losses, gradient norms, parameters and balance losses of two AdamW steps;
  the loads exactly);
- a rank's expert weights, gradients and moments are the analytic count (ZeRO-2: the whole
  units, ``1/|ep_dp|`` of gradients and moments; ZeRO-3: ``1/|ep_dp|`` of all three), and its
  whole state equals the planner's;
- the ledger's bytes per group and link (``ep_dp`` included) and calls equal the planner's,
  with the router forced uniform, and the unit pool is within the planner's bound;
- a checkpoint saved under ep 4 ZeRO-3 resumes under ep 1 and ep 2 ZeRO-1 equal to the
  uninterrupted run (``test_moe.py``: one loads into ep 2 ZeRO-2's expert units);
- with ``--grad-compression`` (ZeRO-0/1) the experts stay sharded, reduced exactly over
  ``ep_dp`` beside the compressed dense gradients: equal to one process after a step where
  the dense weights are not, bytes and state as the planner's, an error-feedback checkpoint
  (the experts' residuals zero) resumed bit for bit."""
from __future__ import annotations

import pytest

from conftest import rank_failures, shared_tmpdir
from layouts import layout_name, small_config, token_source
from mpipar.rules import validate
from tests.mpi import test_moe as moe
from tests.mpi.test_moe import _check

LAYOUTS = [   # ep_dp of 2 or 4 ranks: the experts' units really sharded
    dict(dp=4, sp=2, ep=2, zero=2),
    dict(dp=2, sp=2, tp=2, ep=2, zero=2, sp_split="zigzag"),
    dict(dp=4, sp=2, ep=4, zero=3),
    dict(dp=2, sp=2, pp=2, ep=2, zero=3, schedule="zb-h1"),
    dict(dp=2, pp=2, sp=2, ep=2, zero=3, schedule="interleaved", virtual_stages=2,
         zero_prefetch=2),
    dict(dp=4, sp=2, ep=2, zero=3, zero_shared="node"),
    dict(model="qwen3_moe", dp=2, sp=2, tp=2, ep=2, zero=3, sp_split="zigzag"),   # Qwen3-MoE
    dict(model="qwen3_moe", dp=4, pp=2, ep=4, zero=3),
]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_sharded_experts_equal_single_process_float64(world, layout):
    _check(world, layout)


@pytest.mark.mpi(min_size=8)
def test_sharded_experts_recompute_full_equal_single_process_float64(world):
    _check(world, dict(dp=2, sp=2, tp=2, ep=2, zero=3), "full")


HOLDS = [dict(dp=4, sp=2, ep=2, zero=2), dict(dp=2, sp=2, tp=2, ep=2, zero=3),
         dict(dp=4, sp=2, ep=4, zero=3, zero_shared="node")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", HOLDS, ids=[layout_name(v) for v in HOLDS])
def test_a_rank_holds_its_share_of_its_experts(world, case):
    moe.test_a_rank_holds_its_experts_only(world, case)


LEDGER = [dict(dp=4, sp=2, ep=2, zero=2), dict(dp=2, sp=2, pp=2, ep=2, zero=3, schedule="zb-h1"),
          dict(dp=2, pp=2, sp=2, ep=2, zero=3, schedule="interleaved", virtual_stages=2,
               zero_prefetch=2),
          dict(dp=4, sp=2, ep=2, zero=3, zero_shared="node"),
          dict(dp=8, ep=8, zero=3, model="moe8")]           # ep_dp of one rank: no calls


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", LEDGER, ids=[layout_name(v) for v in LEDGER])
def test_sharded_expert_traffic_and_buffers_equal_planner(world, case, monkeypatch):
    """With the router forced uniform, the ledger's bytes per group and link (``ep_dp``
    included) of a step and of a validation pass, and its calls per group, equal the
    planner's; the unit pool the step left (dense and experts' units) is within the planner's
    bound."""
    from mpipar.kernels import expert_routing
    from mpipar.plan.memory import predict_memory
    from mpipar.plan.traffic import (predict_eval_bytes, predict_link_bytes, predict_step_bytes,
                                     predict_step_messages)
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    monkeypatch.setattr(expert_routing, "route_topk", moe.uniform_route)
    case = dict(case)
    cfg = small_config("float64", case.pop("model", "moe"), **case)
    cfg.train.eval_fraction, cfg.train.eval_batches = 0.25, 2
    with rank_failures(world) as fails:
        layout = validate(cfg, 8)
        eng = build_rank(layout, world, source=token_source())
        coord = eng.coord
        eng.ledger.reset()
        trainer.train_step(eng, 0)
        messages: dict[str, int] = {}
        for (group, _), entry in eng.ledger.entries.items():
            messages[group] = messages.get(group, 0) + entry.messages
        got = (eng.ledger.bytes_by_group(), messages, eng.ledger.bytes_by_link())
        want = (predict_step_bytes(layout, coord), predict_step_messages(layout, coord),
                predict_link_bytes(layout, coord))
        if got != want:
            fails.append(f"{coord}: step bytes, calls, links {got} vs {want}")
        if layout.parallel.ep < 8 and not got[0].get("ep_dp"):
            fails.append("no ep_dp bytes booked")
        pooled = sum(b.nbytes for bufs in eng.weights.sharded.pool.free.values() for b in bufs)
        bound = predict_memory(layout, coord).buffers
        if not 0 < pooled <= bound:
            fails.append(f"{coord}: pool {pooled} B, bound {bound} B")
        trainer.evaluate(eng)
        if eng.eval_ledger.bytes_by_group() != predict_eval_bytes(layout, coord):
            fails.append(f"{coord}: eval {eng.eval_ledger.bytes_by_group()} vs "
                         f"{predict_eval_bytes(layout, coord)}")
        trainer.close(eng)


RESHARD = [(dict(dp=4, sp=2, ep=4, zero=3), dict(dp=4, tp=2, zero=1)),
           (dict(dp=4, sp=2, ep=4, zero=3), dict(dp=2, sp=2, pp=2, ep=2, zero=1))]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("before,after", RESHARD, ids=["ep4-zero3-to-ep1-zero1",
                                                       "ep4-zero3-to-ep2-zero1-pp2"])
def test_checkpoint_reshards_sharded_experts(world, before, after):
    moe.test_checkpoint_moves_across_ep_sizes(world, before, after)


COMPRESSED = [dict(dp=4, sp=2, ep=2, grad_compression="int8"),
              dict(dp=2, sp=2, pp=2, ep=2, zero=1, grad_compression="topk", bucket_mb=0.002)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", COMPRESSED, ids=[layout_name(v) for v in COMPRESSED])
def test_compressed_bytes_and_state_equal_planner(world, case, monkeypatch):
    """--grad-compression beside experts sharded over ep: the ledger's bytes per group (the
    dense compressed over dp x sp, the experts' exact over ep_dp) equal the planner's, and a
    rank holds E/ep experts (its state the planner's)."""
    moe.test_ep_bytes_equal_planner_with_a_uniform_router(world, case, monkeypatch)
    moe.test_a_rank_holds_its_experts_only(world, case)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_compressed_dense_beside_exact_experts(world, codec):
    """--grad-compression with --ep 2 (dp 4 x sp 2, gradient clipping off): after the first
    AdamW step every expert equals the one-process run's (<= 1e-10: reduced exactly over
    ep_dp), while the dense weights, compressed over dp x sp, differ from it."""
    from mpi4py import MPI

    from layouts import compare

    def config(**parallel):
        cfg = small_config("float64", "moe", **parallel)
        cfg.train.clip_grad = 0.0
        return cfg

    with rank_failures(world) as fails:
        ref = moe.run(config(), MPI.COMM_SELF, steps=1)[2]
        got = moe.run(config(dp=4, sp=2, ep=2, grad_compression=codec), world, steps=1)[2]
        experts = [n for n in ref if ".experts." in n]
        fails += compare(((), (), {n: got[n] for n in experts}),
                         ((), (), {n: ref[n] for n in experts}), 1e-10)
        q = "layers.0.self_attn.q_proj.weight"
        if not compare(((), (), {q: got[q]}), ((), (), {q: ref[q]}), 1e-8):
            fails.append("the dense weights equal the exact run's: nothing was compressed")


@pytest.mark.mpi(min_size=8)
def test_compressed_checkpoint_with_sharded_experts_resumes_bit_exact(world):
    """int8 compression with error feedback under ep 2: a checkpoint after step 1 (the experts'
    residuals saved as zeros, so each kind tiles every tensor) resumes under the same layout
    bit for bit equal to the uninterrupted run, and loads under ep 1 with the experts'
    residuals zero and the dense ones as saved."""

    import numpy as np

    from mpipar.checkpoint import reader, writer
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank

    def rank(**parallel):
        return build_rank(validate(small_config("float64", "moe", grad_compression="int8",
                                            **parallel), 8), world, source=token_source())

    with rank_failures(world) as fails, shared_tmpdir(world, "mpipar-ez-") as root:
        a = rank(dp=2, sp=2, pp=2, ep=2)
        trainer.train_step(a, 0)
        path = writer.save(a.state, trainer.run_position(a, 1), root, Group(world, "world", Ledger()))
        saved = {(k, n, lo): np.array(v) for k, n, lo, hi, v in a.state.pieces()
                 if k.startswith("residual")}
        want = trainer.train_step(a, 1)
        trainer.close(a)
        b = rank(dp=2, sp=2, pp=2, ep=2)
        reader.load(b.state, path)
        got = trainer.train_step(b, 1)
        if (got.loss, got.grad_norm) != (want.loss, want.grad_norm):
            fails.append(f"resumed step 2 {(got.loss, got.grad_norm)} != "
                         f"{(want.loss, want.grad_norm)}")
        trainer.close(b)
        c = rank(dp=4, pp=2)                # ep 1: every expert compressed, slot by slot
        reader.load(c.state, path)
        for k, n, lo, hi, v in c.state.pieces():
            if k.startswith("residual") and ".experts." in n and np.any(np.asarray(v)):
                fails.append(f"{k}/{n}: expert residual not zero")
        if not any(np.any(v) for (k, n, _), v in saved.items() if ".experts." not in n):
            fails.append("no dense residual saved")
        trainer.close(c)


BF16 = [dict(dp=4, sp=2, ep=2, zero=3, reduce_dtype="bfloat16"),
        dict(dp=2, sp=2, pp=2, ep=2, zero=2)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", BF16, ids=[layout_name(v) for v in BF16])
def test_bf16_sharded_experts_state_and_bytes_equal_planner(world, case, monkeypatch):
    """bf16 compute: the dense and the experts' units' compute copies, float32 master slices,
    gradients and moments together are the planner's bytes, and a step's bytes per group
    (the experts' gathered in bf16 over ep_dp, reduced in the reduce dtype) the ledger's, the
    router forced uniform."""
    from types import SimpleNamespace

    from mpipar.kernels import expert_routing
    from mpipar.plan.memory import predict_memory
    from mpipar.plan.traffic import predict_step_bytes
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    from tests.mpi.test_mixed_precision import _weights_state
    monkeypatch.setattr(expert_routing, "route_topk", moe.uniform_route)
    layout = validate(small_config("bfloat16", "moe", **case), 8)
    with rank_failures(world) as fails:
        eng = build_rank(layout, world, source=token_source())
        red, opt = eng.weights.reducer, eng.weights.optimizer
        parts = [SimpleNamespace(reducer=r, optimizer=o, sharded=r)
                 for r, o in ((red.dense, opt.dense), (red.experts, opt.experts))]
        got = tuple(map(sum, zip(*(_weights_state(p, layout.parallel.zero) for p in parts))))
        mem = predict_memory(layout, eng.coord)
        if got != (mem.weights, mem.masters, mem.grads, mem.optimizer):
            fails.append(f"{eng.coord}: state {got} != planner "
                         f"{(mem.weights, mem.masters, mem.grads, mem.optimizer)}")
        eng.ledger.reset()
        trainer.train_step(eng, 0)
        # sp too: the balance statistics' sum over sp is float32 in bf16 runs (the router's
        # dtype), as the planner books it
        want = predict_step_bytes(layout, eng.coord)
        got_bytes = eng.ledger.bytes_by_group()
        if got_bytes != want:
            fails.append(f"{eng.coord}: bytes {got_bytes} != planner {want}")
        trainer.close(eng)
