"""Mixture of experts: every layout equals the single-process run in float64 (<= 1e-10), the
balance loss included (its value each step, and its gradient through the parameters).

Under ``mpirun -n 8``: the small model of ``layouts.py`` with blocks 1-3 sparse (4 experts,
top 2, alpha 0.05), two AdamW steps, on dp, tp (experts unsplit: replicated over tp), pp (each
schedule), sp (ring contiguous and zigzag, Ulysses: a sequence's balance statistics summed over
sp), ZeRO-1/2/3 and recompute; and expert parallelism (ep 2, 4, 8; 8 experts for ep 8) with each
of them."""
from __future__ import annotations

import functools

import pytest

from conftest import check_in_groups, rank_failures, shared_tmpdir
from layouts import compare, layout_name, layout_size, small_config, token_source
from mpipar.rules import validate

LAYOUTS = [
    dict(dp=8), dict(dp=4, tp=2), dict(dp=2, pp=4, schedule="zb-h1"),
    dict(dp=2, pp=2, schedule="interleaved", virtual_stages=2),
    dict(dp=2, sp=4, sp_split="zigzag"), dict(dp=4, sp=2, sp_mode="ulysses"),
    dict(dp=2, tp=2, sp=2), dict(dp=2, sp=2, pp=2, zero=1, bucket_mb=0.002),
    dict(dp=4, sp=2, zero=2), dict(dp=2, sp=2, tp=2, zero=3),
]
RECOMPUTE = [dict(dp=2, sp=2, pp=2), dict(dp=4, tp=2)]
EP = [  # expert parallelism: the ep group carved out of dp x sp
    dict(dp=8, ep=8, model="moe8"), dict(dp=2, sp=4, ep=8, sp_split="zigzag", model="moe8"),
    dict(dp=4, sp=2, ep=4, sp_mode="ulysses"), dict(dp=2, tp=2, pp=2, ep=2, schedule="zb-h1"),
    dict(dp=2, sp=2, tp=2, ep=4, zero=3), dict(dp=2, sp=2, pp=2, ep=2, zero=1, bucket_mb=0.002),
    dict(dp=4, pp=2, ep=4, zero=2, schedule="interleaved", virtual_stages=2),
]
EP_RECOMPUTE = [dict(dp=4, sp=2, ep=4)]
DEEPSEEK = [dict(model="deepseek", **v) for v in (   # latent attention, grouped sigmoid router
    dict(tp=2, pp=2, dp=2), dict(dp=4, sp=2, ep=2, zero=3),
    dict(sp=2, tp=2, dp=2, sp_split="zigzag"))]


def run(cfg, comm, steps: int = 2):
    """(losses, grad norms, gathered params, balance losses, loads) of ``steps`` steps."""
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    eng = build_rank(validate(cfg, comm.Get_size()), comm, source=token_source(cfg.train.seq_len))
    try:
        res = [trainer.train_step(eng, k) for k in range(steps)]
        return ([r.loss for r in res], [r.grad_norm for r in res], trainer.gather_params(eng),
                [r.moe["moe_aux_loss"] for r in res],
                [r.moe["moe_load_max_over_mean"] for r in res])
    finally:
        trainer.close(eng)


@functools.lru_cache(maxsize=None)
def reference(recompute: str = "none", model: str = "moe"):
    from mpi4py import MPI
    cfg = small_config("float64", model)
    cfg.train.recompute = recompute
    return run(cfg, MPI.COMM_SELF)


def _check(world, layout: dict, recompute: str = "none") -> None:
    size = layout_size(layout)
    layout = dict(layout)
    model = layout.pop("model", "moe")

    def check(comm) -> list[str]:
        cfg = small_config("float64", model, **layout)
        cfg.train.recompute = recompute
        got, ref = run(cfg, comm), reference(model=model)
        fails = compare(got[:3], ref[:3], 1e-10)
        for i, (a, b) in enumerate(zip(got[3], ref[3])):
            if not abs(a - b) <= 1e-10 * abs(b):
                fails.append(f"moe_aux_loss[{i}] {a!r} vs {b!r}")
        if got[4] != ref[4]:
            fails.append(f"loads {got[4]} vs {ref[4]}")
        return fails

    check_in_groups(world, size, check)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout_name(v) for v in LAYOUTS])
def test_moe_layout_equals_single_process_float64(world, layout):
    _check(world, layout)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("layout", RECOMPUTE, ids=[layout_name(v) for v in RECOMPUTE])
def test_moe_recompute_equals_single_process_float64(world, layout, mode):
    _check(world, layout, mode)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", EP, ids=[layout_name(v) for v in EP])
def test_expert_parallel_equals_single_process_float64(world, layout):
    _check(world, layout)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout,recompute", zip(DEEPSEEK, ("none", "none", "selective")),
                         ids=[layout_name(v) for v in DEEPSEEK])
def test_latent_attention_and_grouped_router_equal_single_process_float64(world, layout,
                                                                           recompute):
    """DeepSeek-V3's latent attention (heads split by tp, the latents whole on each tp rank)
    and grouped sigmoid router with its selection bias and a shared expert: tp x pp, ep with
    ZeRO-3, sp x tp recomputing the latents (selective) equal one process."""
    _check(world, layout, recompute)


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", EP_RECOMPUTE, ids=[layout_name(v) for v in EP_RECOMPUTE])
def test_expert_parallel_recompute_full_equals_single_process_float64(world, layout):
    _check(world, layout, "full")


def test_balance_loss_is_on_and_moves():
    """The reference itself: a positive balance loss near alpha (uniform routing gives
    alpha x sparse layers), loads above 1 (max over mean)."""
    losses, _, _, aux, loads = reference()
    assert 0.05 * 3 * 0.9 < aux[0] < 0.05 * 3 * 2
    assert all(v >= 1.0 for v in loads[0].values()) and len(loads[0]) == 3


def uniform_route(probs, k, xp, bias=None, normalize=True):
    """A router forced uniform: token n's choices are experts (nK, ..., nK+K-1) mod E, so each
    expert gets the same count whenever E divides a rank's N*K (weights from the probabilities
    there, renormalised unless ``normalize`` is False)."""
    n, e = probs.shape
    experts = (xp.arange(n)[:, None] * k + xp.arange(k)[None, :]) % e
    chosen = xp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        chosen = chosen / chosen.sum(axis=-1, keepdims=True)
    return experts.astype(xp.int64), chosen


LEDGER = [dict(dp=8, ep=8, model="moe8"), dict(dp=2, sp=4, ep=4, recompute="full"),
          dict(dp=2, sp=2, tp=2, pp=1, ep=2), dict(dp=4, pp=2, ep=4, sp_mode="ring"),
          dict(dp=4, sp=2, ep=2, zero=1, bucket_mb=0.002),   # experts' ZeRO-1 over ep_dp
          dict(dp=2, sp=2, tp=2, ep=2, model="moe_shared"),    # a shared expert's tp calls
          dict(dp=4, tp=2, model="moe_gated", recompute="full")]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", LEDGER, ids=[layout_name(v) for v in LEDGER])
def test_ep_bytes_equal_planner_with_a_uniform_router(world, case, monkeypatch):
    """With the router forced uniform, every group's bytes in the ledger (ep, ep_dp and sp
    included) equal the planner's prediction for a step, and the validation pass's for its own;
    and so do a step's wire bytes per group and link."""
    from mpipar.plan.traffic import predict_link_bytes
    case = dict(case)
    recompute, model = case.pop("recompute", "none"), case.pop("model", "moe")
    cfg = small_config("float64", model, **case)
    cfg.train.recompute = recompute

    def ep_and_links(eng, layout, res) -> list[str]:
        fails = [] if case.get("ep", 1) == 1 or eng.ledger.bytes_by_group().get("ep") else \
            ["no ep bytes booked"]
        got, want = eng.ledger.bytes_by_link(), predict_link_bytes(layout, eng.coord)
        return fails + ([] if got == want else [f"{eng.coord}: links {got} vs {want}"])

    bytes_equal_planner_with_a_uniform_router(world, cfg, monkeypatch, ep_and_links)


def bytes_equal_planner_with_a_uniform_router(world, cfg, monkeypatch, more) -> None:
    """With the router forced uniform (:func:`uniform_route`), a step and a validation pass (a
    quarter of the data, 2 batches) of ``cfg`` on the 8 ranks: every group's bytes in the
    ledgers equal the planner's prediction for each, and ``more(engine, layout, the step's
    result)`` (failure messages) finds nothing; asserted on every rank."""
    from mpipar.kernels import expert_routing
    from mpipar.plan.traffic import predict_eval_bytes, predict_step_bytes
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    monkeypatch.setattr(expert_routing, "route_topk", uniform_route)
    cfg.train.eval_fraction, cfg.train.eval_batches = 0.25, 2
    with rank_failures(world) as fails:
        layout = validate(cfg, 8)
        eng = build_rank(layout, world, source=token_source())
        want, want_eval = (predict_step_bytes(layout, eng.coord),
                           predict_eval_bytes(layout, eng.coord))
        eng.ledger.reset()
        res = trainer.train_step(eng, 0)
        trainer.evaluate(eng)
        got, got_eval = eng.ledger.bytes_by_group(), eng.eval_ledger.bytes_by_group()
        if got != want or got_eval != want_eval:
            fails.append(f"{eng.coord}: step {got} vs {want}; eval {got_eval} vs "
                         f"{want_eval}")
        fails += more(eng, layout, res)
        trainer.close(eng)


RESHARD = [(dict(model="moe8", dp=8, ep=8, zero=1), dict(model="moe8", dp=2, tp=2, pp=2)),
           (dict(dp=4, sp=2, ep=4, zero=3), dict(dp=8, ep=2, zero=2)),
           (dict(dp=4, sp=2, ep=4), dict(dp=2, sp=2, pp=2, ep=2, zero=1))]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("before,after", RESHARD, ids=["ep8-to-ep1", "ep4-zero3-to-ep2-zero2",
                                                       "ep4-sharded-to-ep2-zero1-pp2"])
def test_checkpoint_moves_across_ep_sizes(world, before, after):
    """A step trained and saved under one ep (and ZeRO stage) loads under another and the next
    step equals the one-process run's second step; the checkpoint of a run whose experts are
    sharded over ep (ep 8, ZeRO-1) exports to Mixtral's files with every expert (equal to
    ``gather_params``)."""
    from mpipar.checkpoint import reader, writer
    from mpipar.runtime.comm import Group, Ledger
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    before, after = dict(before), dict(after)
    model = before.pop("model", "moe")
    after.pop("model", None)
    with rank_failures(world) as fails, shared_tmpdir(world, "mpipar-moe-") as root:
        a = build_rank(validate(small_config("float64", model, **before), 8), world,
                   source=token_source())
        trainer.train_step(a, 0)
        path = writer.save(a.state, trainer.run_position(a, 1), root, Group(world, "world", Ledger()))
        trained = trainer.gather_params(a)
        trainer.close(a)
        if world.rank == 0 and model == "moe8":   # Mixtral's layout: every block sparse
            fails += _exported_differs(path, root / "hf", trained)
        b = build_rank(validate(small_config("float64", model, **after), 8), world,
                   source=token_source())
        if reader.load(b.state, path) != 1:
            fails.append("load did not return step 1")
        r2 = trainer.train_step(b, 1)
        ref = reference(model=model)
        fails += compare(([ref[0][0], r2.loss], [ref[1][0], r2.grad_norm], trainer.gather_params(b)),
                         ref[:3], 1e-10)
        if abs(r2.moe["moe_aux_loss"] - ref[3][1]) > 1e-10 * ref[3][1]:
            fails.append(f"moe_aux_loss {r2.moe['moe_aux_loss']} vs {ref[3][1]}")
        trainer.close(b)


HOLDS = [dict(dp=8, ep=8, model="moe8"), dict(dp=2, sp=2, pp=2, ep=2, zero=1, bucket_mb=0.002),
         dict(dp=4, sp=2, ep=4, zero=2)]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("case", HOLDS, ids=[layout_name(v) for v in HOLDS])
def test_a_rank_holds_its_experts_only(world, case):
    """Under --ep N a rank holds exactly the E/N experts of its ep position
    (``dp_sp.rank % N``), of its pipeline stage's sparse blocks: their weights and gradients
    ``3 F H`` elements an expert a block, float64, and AdamW's two moments of them, each
    sharded over ``ep_dp`` as the ZeRO stage shards (ZeRO-1: 1/|ep_dp| of the moments;
    ZeRO-2: of the gradients and moments, in one unit a block padded to a multiple of
    |ep_dp|; ZeRO-3: of the weights too); the dense weights as without ep; the planner's
    state bytes equal the engine's."""
    from mpipar.parallel.data_parallel.buckets import padded_size
    from mpipar.parallel.placement import expert_of
    from mpipar.plan.memory import predict_memory
    from mpipar.training import step as trainer
    from mpipar.training.rank import build_rank
    case = dict(case)
    model = case.pop("model", "moe")
    layout = validate(small_config("float64", model, **case), 8)
    m, p = layout.config.model, layout.config.parallel
    with rank_failures(world) as fails:
        eng = build_rank(layout, world, source=token_source())
        stage_layers = [i for ch in eng.model.chunks for i in ch.layers if m.is_sparse(i)]
        position = eng.comms.groups["dp_sp"].rank % p.ep
        per = m.moe_experts // p.ep
        want = {(i, e) for i in stage_layers for e in range(per * position, per * (position + 1))}
        held = {(int(n.split(".")[1]), expert_of(n)) for n in eng.weights.reducer.local_shapes()
                if expert_of(n) is not None}
        if held != want:
            fails.append(f"experts held {sorted(held)} != {sorted(want)}")
        r = eng.comms.groups["ep_dp"].size
        block = 3 * m.moe_ffn_hidden * m.hidden * per            # a block's experts
        whole = len(stage_layers) * (padded_size(block, r) if p.zero >= 2 else block)
        share = whole // (r if p.zero else 1)
        expect = (8 * (share if p.zero == 3 else whole), 8 * (share if p.zero >= 2 else whole),
                  2 * 8 * share)
        weights, grads = _store_bytes(eng.weights.reducer.experts, p.zero)
        moments = _moment_bytes(eng.weights.optimizer.experts, p.zero)
        if (weights, grads, moments) != expect:
            fails.append(f"expert weights, grads, moments {(weights, grads, moments)} B != "
                         f"{expect} B")
        dense = _store_bytes(eng.weights.reducer.dense, p.zero)
        mem = predict_memory(layout, eng.coord)
        total = (weights + dense[0], grads + dense[1],
                 moments + _moment_bytes(eng.weights.optimizer.dense, p.zero))
        if total != (mem.weights, mem.grads, mem.optimizer):
            fails.append(f"state {total} != planner {(mem.weights, mem.grads, mem.optimizer)}")
        trainer.close(eng)


def _store_bytes(store, zero: int) -> tuple[int, int]:
    """Bytes of the weights and gradients a store holds (ZeRO-0/1: its flat buckets; ZeRO-2:
    its whole units and owned gradient slices; ZeRO-3: its owned slices of both)."""
    if zero >= 2:
        units = store.units.values()
        return (sum((u.full if zero == 2 else u.owned).nbytes for u in units),
                sum(u.owned_grad.nbytes for u in units))
    return (sum(b.params.nbytes for b in store.buckets), sum(b.grads.nbytes for b in store.buckets))


def _moment_bytes(opt, zero: int) -> int:
    """Bytes of AdamW's two moments in optimizer ``opt`` (ZeRO-1: per bucket slice)."""
    if zero:
        return sum(a.nbytes for a in (*opt.m, *opt.v))
    return sum(a.nbytes for a in (*opt.m.values(), *opt.v.values()))


def _exported_differs(path, out, params) -> list[str]:
    """Export checkpoint ``path`` to Hugging Face files in ``out`` and read them back: what
    differs from ``params`` (every tensor, every expert)."""
    import numpy as np

    from mpipar.checkpoint.huggingface import load_hf
    from mpipar.checkpoint.tools import export_hf
    try:
        export_hf(path, out, dtype="float64")
        _, back = load_hf(out)
    except Exception as exc:       # reported, not raised: the other ranks go on collectively
        return [f"export: {type(exc).__name__}: {exc}"]
    if set(back) != set(params):
        return [f"exported names differ: {sorted(set(back) ^ set(params))[:4]}"]
    return [f"exported {n} differs" for n in params if not np.array_equal(back[n], params[n])]
