"""The planner in process: analytic state memory and parameter counts, activation memory by
recompute mode, the time model's ranking, rejection reasons, the default run's layout choice,
measured nodes. Exact memory and messages against the engine on 8 ranks: mpi/test_planner.py;
the CLI: e2e/test_planner.py."""
from __future__ import annotations

import dataclasses

import numpy as np

import pytest

from mpipar.config import Config, ConfigError, ModelConfig, ParallelConfig, TrainConfig
from mpipar.layout import resolve_model, vary
from mpipar.model.flops import model_flops_per_step
from mpipar.plan.memory import predict_memory
from mpipar.plan.search import auto_layout, plan_layouts
from mpipar.plan.step_time import Hardware, predict_step_time
from mpipar.plan.traffic import predict_step_bytes, predict_step_messages
from mpipar.rules import validate
from mpipar.runtime.topology import Coord


# ------------------------------------------------------------------------ analytic counts
def _params(m: ModelConfig) -> int:
    """Parameters of a Llama by hand: embedding, per block 2 norms + q, k, v, o + gate, up,
    down, final norm, untied head."""
    m = resolve_model(m)
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    block = 2 * m.hidden + m.hidden * q * 2 + m.hidden * kv * 2 + 3 * m.hidden * m.ffn_hidden
    return 2 * m.vocab_size * m.hidden + m.layers * block + m.hidden


def test_default_model_state_by_hand():
    cfg = validate(Config(), 1)
    assert _params(cfg.model) == 803_968
    mem = predict_memory(cfg, Coord(0, 0, 0, 0))
    assert mem.weights == mem.grads == 803_968 * 4
    assert mem.optimizer == 2 * 803_968 * 4                      # AdamW m and v


def test_parameter_count_is_the_tensors_of_every_attention_and_norm_form():
    """The analytic count (generation's lower bound; a LoRA merge's bytes) equals the sum
    over the tensors for latent attention with and without a query latent, Gemma 3's four
    norms a block with q/k norms, and q/k/v biases."""
    import math
    from mpipar.model.params import param_specs
    from mpipar.plan.memory import parameter_count
    small = dict(vocab_size=16, hidden=16, layers=2, heads=4, kv_heads=4, ffn_hidden=24)
    latent = dict(head_dim=6, latent_kv_rank=5, rope_head_dim=2, v_head_dim=4)
    for fields in (dict(latent, latent_q_rank=7), latent, dict(
            norm_placement="sandwich", qk_norm=True, head_dim=8, kv_heads=2),
            dict(attention_bias=True, kv_heads=2)):
        m = resolve_model(ModelConfig(**{**small, **fields}))
        assert parameter_count(m) == sum(math.prod(s.shape) for s in param_specs(m)), fields


def test_muon_and_lora_state_by_hand():
    """Muon keeps one momentum buffer for each block matrix and AdamW's two moments for the
    rest (as the one-process engine holds them); LoRA of rank 2 on every linear: the frozen
    base's compute copy, and gradients and moments of the adapters alone."""
    from mpi4py import MPI
    from mpipar.training.rank import build_rank
    m = resolve_model(Config().model)
    n, q, kv = _params(m), m.heads * m.head_dim, m.kv_heads * m.head_dim
    matrices = m.layers * (2 * m.hidden * q + 2 * m.hidden * kv + 3 * m.hidden * m.ffn_hidden)
    cfg = validate(Config(train=TrainConfig(optimizer="muon")), 1)
    mem = predict_memory(cfg, Coord(0, 0, 0, 0))
    assert mem.optimizer == (2 * (n - matrices) + matrices) * 4
    rank = build_rank(cfg, MPI.COMM_SELF)
    opt = rank.weights.optimizer
    held = sum(a.nbytes for a in (*opt.rest.m.values(), *opt.rest.v.values(),
                                  *(p.buf for p in opt.pieces.values())))
    assert held == mem.optimizer
    r = 2
    adapters = m.layers * r * (2 * m.hidden + q + m.hidden + 2 * (m.hidden + kv)
                               + 2 * (m.hidden + m.ffn_hidden) + m.ffn_hidden + m.hidden)
    cfg = validate(Config(train=TrainConfig(lora_rank=r)), 1)
    mem = predict_memory(cfg, Coord(0, 0, 0, 0))
    assert (mem.weights, mem.grads, mem.optimizer) == ((n + adapters) * 4, adapters * 4,
                                                       2 * adapters * 4)


@pytest.mark.parametrize("zero", [0, 1])
def test_zero_shards_the_moments_over_dp(zero):
    cfg = validate(Config(parallel=ParallelConfig(dp=8, zero=zero)), 8)
    mem = predict_memory(cfg, Coord(3, 0, 0, 0))
    n = _params(cfg.model)
    padded = -(-n // 8) * 8                                        # one bucket, 8 equal slices
    assert mem.weights == padded * 4
    assert mem.optimizer == (2 * padded // 8 * 4 if zero else 2 * n * 4)


def test_zero3_state_is_one_over_dp_sp():
    """ZeRO-3: weights, gradients and moments are 1/(dp*sp) of ZeRO-0's (each unit padded to a
    multiple of dp*sp); ZeRO-2 keeps the whole weights; the step's bytes over dp x sp are per
    microbatch 2 all-gathers of each unit's slice (1 of the head's and the last block's, which
    stay gathered from their forward to their backward at prefetch 1) and a reduce-scatter of
    its gradients."""
    model = ModelConfig(vocab_size=256, hidden=64, layers=4, heads=4, kv_heads=2)
    train = TrainConfig(seq_len=16, global_batch_size=16, micro_batch_size=2)
    full = predict_memory(validate(Config(model, ParallelConfig(dp=1), train), 1), Coord(0, 0, 0, 0))
    n_params = _params(model)
    assert full.state == 4 * n_params * 4
    for dp, sp in ((2, 1), (8, 1), (2, 4)):
        cfg = validate(Config(model, ParallelConfig(dp=dp, sp=sp, zero=3), train), dp * sp)
        mem = predict_memory(cfg, Coord(0, 0, 0, 0))
        n = dp * sp
        units = [resolve_model(model).vocab_size * 64, 64 + 64 * 256] + \
            [(_params(model) - 2 * 256 * 64 - 64) // 4] * 4       # embed, head, blocks
        assert sum(units) == n_params
        padded = sum(-(-u // n) * n for u in units)
        assert mem.state == 4 * padded // n * 4
        assert full.state / n <= mem.state < full.state / n + 4 * 6 * 4   # padding only
        micro = 16 // (dp * 2)
        kept = -(-units[1] // n) * n + -(-units[2] // n) * n
        assert predict_step_bytes(cfg, Coord(0, 0, 0, 0))["dp_sp"] == \
            micro * (padded * 4 + (2 * padded - kept) // n * 4) + 16
        two = predict_memory(vary(cfg, parallel={"zero": 2}), Coord(0, 0, 0, 0))
        assert two.weights == padded * 4 and two.grads == mem.grads


def test_memory_budget_picks_the_zero_stage():
    """With dp = 8 fixed and a budget between the ZeRO-3 and the ZeRO-2 state, the planner ranks
    only ZeRO-3; with no budget every stage is ranked, ZeRO-3 gathering (two all-gathers more)
    last, ZeRO-3 in node shared memory (one node: a reduce-scatter, no all-gather) first and
    smallest (no gathered units)."""
    base = Config(ModelConfig(vocab_size=256, hidden=256, layers=4, heads=4, kv_heads=4),
                  ParallelConfig(dp=8), TrainConfig(seq_len=16, global_batch_size=8,
                                                    micro_batch_size=1, recompute="full"))
    fixed = {"dp", "tp", "pp", "sp", "micro_batch_size", "recompute"}
    free = plan_layouts(base, 8, fixed, hw=Hardware(1e11, 1e9, 1e-5)).ranked
    stages = [(c.cfg.parallel.zero, c.cfg.parallel.zero_shared) for c in free]
    assert stages[0] == (3, "node") and stages[-1] == (3, "off") and len(free) == 5
    mem = {s: c.memory.total for s, c in zip(stages, free)}
    assert mem[(3, "node")] < mem[(3, "off")] < mem[(2, "off")] < mem[(1, "off")] < mem[(0, "off")]
    tight = plan_layouts(base, 8, fixed, memory_bytes=(mem[(3, "off")] + mem[(2, "off")]) / 2)
    assert sorted(c.cfg.parallel.zero_shared for c in tight.ranked) == ["node", "off"]
    assert {c.cfg.parallel.zero for c in tight.ranked} == {3}
    cpu_fixed = plan_layouts(base, 8, fixed | {"zero_shared"}, hw=Hardware(1e11, 1e9, 1e-5))
    assert [c.cfg.parallel.zero for c in cpu_fixed.ranked][-1] == 3 and len(cpu_fixed.ranked) == 4


def test_tensor_parallel_shards_all_but_the_norms():
    """tp=2 with an odd vocabulary: every matrix halves, the vocabulary pads to 258 rows."""
    model = ModelConfig(vocab_size=257)
    cfg = validate(Config(model=model, parallel=ParallelConfig(tp=2)), 2)
    m = cfg.model
    norms = (2 * m.layers + 1) * m.hidden
    matrices = _params(m) - norms - 2 * 257 * m.hidden
    want = matrices // 2 + norms + 2 * 129 * m.hidden
    assert predict_memory(cfg, Coord(0, 1, 0, 0)).weights == want * 4


def test_tied_embedding_and_biases_by_hand():
    """A tied model holds the embedding once on one stage and a copy on each end of a pipeline,
    whose gradient (the whole, or under ZeRO-1 the owned slice) is all-reduced over pp_ends
    once a step; q/k/v biases add q + 2 kv values per block."""
    model = ModelConfig(tie_embeddings=True, attention_bias=True)
    m = resolve_model(model)
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    n = _params(m) - m.vocab_size * m.hidden + m.layers * (q + 2 * kv)
    assert predict_memory(validate(Config(model=model), 1), Coord(0, 0, 0, 0)).weights == n * 4
    for zero, dp in ((0, 1), (1, 2)):
        cfg = validate(Config(model=model, parallel=ParallelConfig(pp=2, dp=dp, zero=zero)), 2 * dp)
        first = predict_memory(cfg, Coord(0, 0, 0, 0)).weights // 4
        last = predict_memory(cfg, Coord(0, 0, 1, 0)).weights // 4
        embed = m.vocab_size * m.hidden          # every bucket is even: no padding for dp = 2
        assert first + last == n + embed
        for r in (0, 1):
            assert predict_step_bytes(cfg, Coord(0, 0, r, 0))["pp_ends"] == embed // dp * 4


def test_pipeline_stages_hold_their_layers():
    cfg = validate(Config(parallel=ParallelConfig(pp=2)), 2)
    m = cfg.model
    block = (_params(m) - 2 * m.vocab_size * m.hidden - m.hidden) // m.layers
    first = predict_memory(cfg, Coord(0, 0, 0, 0)).weights // 4
    last = predict_memory(cfg, Coord(0, 0, 1, 0)).weights // 4
    assert first == m.vocab_size * m.hidden + 2 * block
    assert last == 2 * block + m.hidden + m.vocab_size * m.hidden


def test_activation_memory_by_recompute_mode():
    """One microbatch, one stage: saved = blocks x per-block bytes + LM head + token ids, plus one
    block's working set; full keeps exactly the block inputs; offload keeps none."""
    base = Config(ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2,
                              ffn_hidden=64), ParallelConfig(),
                  TrainConfig(seq_len=16, global_batch_size=2, dtype="float64"))
    sizes = {}
    for mode in ("none", "selective", "full", "offload"):
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, recompute=mode))
        sizes[mode] = predict_memory(validate(cfg, 1), Coord(0, 0, 0, 0)).activations
    n, e, H, F, V = 2 * 16, 8, 32, 64, 64
    q, kv, lse = 32, 16, 4 * 8                                    # per token: q, k/v widths, lse
    head = (2 * H + 1 + V) * n * e + n * (8 + 8)
    none_block = (4 * H + 2 + 3 * F) * n * e + (2 * q + 2 * kv) * n * e + lse * n
    working = none_block + head
    assert sizes["none"] == 2 * none_block + head + 9 * n + working
    assert sizes["selective"] == 2 * ((2 * H + 2 * F + q) * n * e + lse * n) + head + 9 * n + working
    assert sizes["full"] == 2 * H * n * e + head + 9 * n + working
    assert sizes["offload"] == 9 * n + working
    assert sizes["none"] > sizes["selective"] > sizes["full"] > sizes["offload"]


def test_gpipe_holds_every_microbatch_1f1b_only_p():
    def act(schedule):
        cfg = validate(Config(parallel=ParallelConfig(pp=2, schedule=schedule),
                     train=TrainConfig(global_batch_size=8, micro_batch_size=1)), 2)
        return predict_memory(cfg, Coord(0, 0, 0, 0)).activations
    one = validate(Config(parallel=ParallelConfig(pp=2),
                 train=TrainConfig(global_batch_size=8, micro_batch_size=1,
                                   recompute="offload")), 2)
    working = predict_memory(one, Coord(0, 0, 0, 0)).activations - 2 * 9 * 128  # ids of 2 mbs
    per_mb = (act("1f1b") - working) / 2                          # 1F1B: p = 2 in flight on rank 0
    assert act("gpipe") - working == pytest.approx(8 * per_mb)    # GPipe: all 8


def test_model_flops_by_hand():
    cfg = Config(ModelConfig(vocab_size=10, hidden=8, layers=1, heads=2, kv_heads=1,
                             ffn_hidden=16), train=TrainConfig(seq_len=4, global_batch_size=3))
    matmul = 2 * (8 * 8 + 8 * 4 * 2 + 8 * 8) + 2 * 3 * 8 * 16 + 2 * 8 * 10
    attention = 4 * 2 * 4 * (4 + 1) / 2                           # heads x head_dim x mean keys
    assert model_flops_per_step(validate(cfg, 1)) == 3 * (matmul + attention) * 3 * 4


def test_latent_attention_model_flops_by_hand():
    """DeepSeek-V3's latent attention per token: q down 8 -> 5 and up 5 -> 2 heads x 6, kv down
    8 -> 3 latent + 2 rope, kv up 3 -> 2 heads x (4 nope + 4 values), q k^T over 6 and p v
    over the 4 value columns (not the kernels' padded 6) for 2.5 mean keys, o 2 x 4 -> 8."""
    cfg = Config(ModelConfig(vocab_size=10, hidden=8, layers=1, heads=2, kv_heads=2,
                             head_dim=6, latent_kv_rank=3, latent_q_rank=5, rope_head_dim=2,
                             v_head_dim=4, ffn_hidden=16),
                 train=TrainConfig(seq_len=4, global_batch_size=3))
    projections = 2 * (8 * 5 + 5 * 12 + 8 * (3 + 2) + 3 * 2 * (4 + 4) + 2 * 4 * 8)
    attention = 2 * 2 * 6 * 2.5 + 2 * 2 * 4 * 2.5
    per_token = projections + attention + 2 * 3 * 8 * 16 + 2 * 8 * 10   # FFN, LM head
    assert model_flops_per_step(validate(cfg, 1)) == 3 * per_token * 3 * 4 == 55152


# ---------------------------------------------------------------------------- time model
def test_pipeline_bubble_is_the_schedules():
    """Fast links: the predicted bubble of 1F1B is (p-1)/(m+p-1), interleaving lowers it."""
    fast = Hardware(peak_flops=1e9, bandwidth=1e18, latency=0.0)
    t = TrainConfig(global_batch_size=8, micro_batch_size=2)
    one = predict_step_time(validate(Config(parallel=ParallelConfig(pp=4), train=t), 4), fast)
    assert one.bubble == pytest.approx(3 / 7, abs=0.02)
    inter = predict_step_time(validate(Config(ModelConfig(layers=8), ParallelConfig(
        pp=4, schedule="interleaved", virtual_stages=2), t), 4), fast)
    assert inter.bubble < one.bubble


def test_ranking_follows_the_hardware():
    """Compute-bound (fast links): no pipeline bubble wins, dp x sp splits the work evenly.
    Link-bound (slow links, big model, few tokens): no gradient all-reduce wins."""
    base = Config(ModelConfig(hidden=256, layers=4, heads=4, kv_heads=4),
                  train=TrainConfig(seq_len=16, global_batch_size=4))
    fast = plan_layouts(base, 4, hw=Hardware(1e9, 1e18, 0.0))
    times = [c.time.total for c in fast.ranked]
    ties = [c.tie for c in fast.ranked]
    assert all(b >= a or tb == ta != 0 for a, b, ta, tb in zip(times, times[1:], ties, ties[1:]))
    assert fast.ranked[0].cfg.parallel.pp == 1
    slow = plan_layouts(base, 4, hw=Hardware(1e12, 1e6, 0.0)).ranked[0].cfg.parallel
    assert slow.dp * slow.sp == 1


def test_rejections_name_the_rule():
    """A rejected layout names the rule it breaks, whatever the rates and the options (given
    here: the grid's layouts alone, not each with every schedule, ZeRO stage and batch split)."""
    hw = Hardware(5e9, 1e10, 1e-5, 5e9, 1e-6)
    grid = {"schedule", "virtual_stages", "sp_mode", "sp_split", "ulysses_size",
            "micro_batch_size", "zero", "dp_reduce", "grad_compression", "zero_shared"}
    plan = plan_layouts(Config(), 8, grid, hw=hw)
    reasons = {r.layout: r.reason for r in plan.rejected}
    assert reasons["dp=1 tp=8 pp=1 sp=1"] == "parallel.tp=8: must divide model.heads=4"
    assert reasons["dp=1 tp=1 pp=8 sp=1"].startswith("parallel.pp*virtual_stages = 8*1 = 8")
    accepted = {(c.cfg.parallel.dp, c.cfg.parallel.tp, c.cfg.parallel.pp, c.cfg.parallel.sp)
                for c in plan.ranked}
    assert (8, 1, 1, 1) in accepted and (2, 2, 2, 1) in accepted
    assert not accepted & {(1, 8, 1, 1), (1, 1, 8, 1)}
    tight = plan_layouts(Config(), 2, grid, memory_bytes=2**20, hw=hw)
    assert not tight.ranked and all("needs at least" in r.reason and "more than --memory-gb"
                                    in r.reason for r in tight.rejected)


def test_a_tie_is_printed_as_one_and_the_simplest_layout_wins_it():
    """Times within TIE of a tie's fastest are a tie, inside the time model's error: its members
    are marked N=, and the simplest (no ZeRO, no shared memory) ranks first, so the 0.8M-parameter
    default model on 8 ranks is recommended plain dp, not ZeRO-3 in node shared memory a few %
    faster on paper; a layout faster by more than TIE still wins."""
    from mpipar.plan.cli import format_plan
    from mpipar.plan.search import TIE
    base = Config(parallel=ParallelConfig(dp=8))
    hw = Hardware(5e9, 1e10, 1e-5, 5e9, 1e-6)
    plan = plan_layouts(base, 8, {"tp", "pp", "sp"}, hw=hw)
    ranked = plan.ranked
    fastest = min(ranked, key=lambda c: c.time.total)
    assert fastest.cfg.parallel.zero_shared == "node"          # on paper, by a hair
    top = ranked[0]
    assert (top.cfg.parallel.zero, top.cfg.parallel.zero_shared, top.tie) == (0, "off", 1)
    assert top.time.total <= fastest.time.total * (1 + TIE)
    tied = [c for c in ranked if c.tie == 1]
    assert fastest in tied and len(tied) == len(ranked)
    text = format_plan(plan, base, 8, hw, None, 0, "given")
    rows = [line for line in text.splitlines() if " dp=8 tp=1 pp=1 sp=1 " in line]
    assert len(rows) == len(ranked) and all(r.startswith("  1= dp=8") for r in rows), text
    assert rows[0].startswith("  1= dp=8 tp=1 pp=1 sp=1 mbs=2 zero=0 recompute=none "), rows[0]
    assert f"N=: a tie, step times within {100 * TIE:g}% of the tie's fastest" in text
    # the rates a loaded 2-core machine's probes measured: node shared memory 4.5% ahead
    probed = plan_layouts(base, 8, {"tp", "pp", "sp"}, hw=Hardware(1.34e10, 1e10, 1e-5, 6.26e8,
                                                                     1e-6)).ranked
    assert probed[0].cfg.parallel.zero == 0 and probed[0].tie == 1
    slow = plan_layouts(base, 8, {"tp", "pp", "sp"}, hw=Hardware(5e9, 1e6, 1e-5, 1e6, 1e-6))
    # slow links: node shared memory saves the reduction, a real win, not a tie
    assert slow.ranked[0].tie == 0 and slow.ranked[0].cfg.parallel.zero_shared == "node"


def test_memory_limit_turns_recompute_on():
    base = Config(ModelConfig(hidden=256, layers=8, heads=4, kv_heads=4),
                  ParallelConfig(dp=1), TrainConfig(seq_len=512, global_batch_size=8,
                                                    micro_batch_size=8))
    fixed = {"dp", "tp", "pp", "sp", "micro_batch_size", "zero"}
    free = plan_layouts(base, 1, fixed).ranked[0]
    assert free.cfg.train.recompute == "none"
    limit = (free.memory.total + predict_memory(vary(free.cfg, train={"recompute": "full"}),
                                                Coord(0, 0, 0, 0)).total) / 2
    tight = plan_layouts(base, 1, fixed, memory_bytes=limit).ranked[0]
    assert tight.cfg.train.recompute in ("selective", "full") and tight.memory.total <= limit
    assert tight.time.total > free.time.total


# ------------------------------------------------------------------------ default layout
@pytest.mark.parametrize("world,batch", [(1, 16), (2, 16), (3, 18), (4, 16), (5, 20), (6, 18),
                                         (7, 21), (8, 16)])
def test_default_run_layout_fits_every_world(world, batch):
    cfg, note = auto_layout(Config(), world, set())
    cfg = validate(cfg, world)
    assert cfg.train.global_batch_size == batch and cfg.parallel.dp == world
    assert (note is None) == (batch == 16)
    if note:
        assert f"so it is {batch} (dp={world})" in note


def test_given_batch_is_kept_and_the_planner_picks_the_layout():
    cfg = Config(train=TrainConfig(global_batch_size=4))
    out, note = auto_layout(cfg, 8, {"global_batch_size"})
    out = validate(out, 8)
    assert out.train.global_batch_size == 4 and out.parallel.dp <= 4 and "planner" in note
    with pytest.raises(ConfigError, match="must be divisible by dp=3"):
        validate(auto_layout(Config(), 3, {"global_batch_size"})[0], 3)
    same, note = auto_layout(Config(), 3, {"tp"})                # a size given: no choice made
    assert note is None and same.train.global_batch_size == 16


def test_hierarchical_and_compressed_options_ranked_beside_flat():
    """On 2 nodes of 4: a slow link across nodes ranks hierarchical reduction above flat, and
    (compression's work negligible) int8 and top-k above dense; with links as fast inside as
    across and compression's work costed, flat dense ranks first. The wire bytes across nodes
    are what the reduction sends across them."""
    base = Config(parallel=ParallelConfig(dp=8, ranks_per_node=4))
    fixed = {"dp", "tp", "pp", "sp", "micro_batch_size", "zero"}

    def best(hw, **extra):
        cfg = Config(base.model, dataclasses.replace(base.parallel, **extra), base.train)
        plan = plan_layouts(cfg, 8, fixed | set(extra), hw=hw)
        return plan.ranked[0], plan.ranked

    slow = Hardware(1e11, 1e8, 1e-5, 1e11, 1e-6)
    top, ranked = best(slow, grad_compression="none")
    assert top.cfg.parallel.dp_reduce == "hierarchical"
    flat = next(c for c in ranked if c.cfg.parallel.dp_reduce == "flat")
    inter = {c.cfg.parallel.dp_reduce: c.link_bytes["dp_sp_inter" if c is top else "dp_sp"]
             ["inter"] for c in (top, flat)}
    assert inter["flat"] >= 4 * inter["hierarchical"]
    assert best(slow)[0].cfg.parallel.grad_compression in ("int8", "topk")
    even = Hardware(1e11, 1e10, 1e-6, 1e10, 1e-6, int8_seconds=1e-8, topk_seconds=1e-8)
    assert best(even)[0].cfg.parallel.grad_compression == "none"


def test_measured_nodes_place_the_groups():
    """A hardware file's ranks per node (``bench comm``) decides which groups cross nodes when the
    layout names none, and the layout's own ``ranks_per_node`` wins: dp=8 on nodes of 4 is timed
    on the slow link, exactly its wire bytes over that link plus a latency per call."""
    from mpipar.plan.step_time import with_nodes
    from mpipar.plan.traffic import predict_link_bytes

    cfg = validate(Config(parallel=ParallelConfig(dp=8)), 8)
    one_node = Hardware(1e11, 1e8, 1e-5, 1e11, 1e-6)
    measured = dataclasses.replace(one_node, ranks_per_node=4)
    on_nodes = with_nodes(cfg, measured, 8)
    assert on_nodes.parallel.ranks_per_node == 4 and with_nodes(cfg, one_node, 8) is cfg
    given = vary(cfg, parallel={"ranks_per_node": 2})
    assert with_nodes(given, measured, 8).parallel.ranks_per_node == 2
    coord = Coord(dp=0, tp=0, pp=0, sp=0)
    wire = predict_link_bytes(on_nodes, coord)["dp_sp"]
    calls = predict_step_messages(cfg, coord)["dp_sp"]
    assert wire["intra"] == 0 and predict_link_bytes(cfg, coord)["dp_sp"]["inter"] == 0
    assert predict_step_time(cfg, measured).comm["dp_sp"] == pytest.approx(
        wire["inter"] / 1e8 + calls * 1e-5, rel=1e-12)
    assert predict_step_time(cfg, one_node).comm["dp_sp"] == pytest.approx(
        wire["inter"] / 1e11 + calls * 1e-6, rel=1e-12)


def test_model_flops_under_document_masks_count_the_keys_inside_documents():
    """With --document-masking, attention counts each query's keys inside its document
    (min(offset + 1, W) under a window): by hand for documents of 3 and 5 tokens."""
    from mpipar.model.flops import document_context, window_context
    docs = np.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    assert document_context(docs, 0) == (1 + 2 + 3 + 1 + 2 + 3 + 4 + 5) / 8
    assert document_context(docs, 2) == (1 + 2 + 2 + 1 + 2 + 2 + 2 + 2) / 8
    assert document_context(np.zeros((2, 8), int), 0) == window_context(8, 0)   # one document
    assert document_context(np.zeros((2, 8), int), 3) == window_context(8, 3)
    cfg = Config(ModelConfig(vocab_size=10, hidden=8, layers=1, heads=2, kv_heads=1,
                             ffn_hidden=16), train=TrainConfig(seq_len=8, global_batch_size=1))
    matmul = 2 * (8 * 8 + 8 * 4 * 2 + 8 * 8) + 2 * 3 * 8 * 16 + 2 * 8 * 10
    attention = 4 * 2 * 4 * 21 / 8
    assert model_flops_per_step(validate(cfg, 1), docs) == 3 * (matmul + attention) * 1 * 8
    assert model_flops_per_step(validate(cfg, 1), docs) < model_flops_per_step(validate(cfg, 1))


def test_the_planner_ranks_expert_parallel_layouts():
    """A mixture of experts: every ep dividing dp x sp and the experts is a candidate, ep > 1
    pays for its all-to-alls inside forward and backward (and ep = 1 for none), and the ep
    group's wire bytes are its all-to-alls' (n-1)/n."""
    from mpipar.config import ParallelConfig
    from mpipar.plan.search import plan_layouts
    from mpipar.plan.traffic import predict_link_bytes, step_calls
    from mpipar.runtime.ledger import wire_bytes
    from mpipar.runtime.topology import Coord
    base = Config(ModelConfig(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2,
                              ffn_hidden=48, moe_experts=4, moe_top_k=2, moe_ffn_hidden=16),
                  ParallelConfig(dp=4), TrainConfig(seq_len=16, global_batch_size=8))
    plan = plan_layouts(base, 4, fixed={"dp", "tp", "pp", "sp", "zero", "micro_batch_size"})
    by_ep = {c.cfg.parallel.ep: c for c in plan.ranked}
    assert sorted(by_ep) == [1, 2, 4]
    assert "ep=2" in by_ep[2].describe()
    assert "ep" not in by_ep[1].time.comm and by_ep[4].time.comm["ep"] > 0
    assert by_ep[4].time.total > by_ep[1].time.total
    layout = by_ep[4].cfg
    ep_calls = [c for c in step_calls(layout, Coord(0, 0, 0, 0)) if c.group == "ep"]
    # counts, rows; and the experts' share of the gradient norm (sharded over ep: all-reduce)
    assert ep_calls and {c.op for c in ep_calls} == {"alltoall", "ialltoallv", "allreduce"}
    want = sum(c.nbytes * 3 // 4 * c.count for c in ep_calls if c.op == "alltoall") + sum(
        c.nbytes * c.count for c in ep_calls if c.op == "ialltoallv") + sum(
        wire_bytes(c.op, c.nbytes, 4) * c.count for c in ep_calls if c.op == "allreduce")
    assert predict_link_bytes(layout, Coord(0, 0, 0, 0))["ep"]["intra"] == want


def _doc_layout(sp: int, mode: str = "ring", split: str = "contiguous", u: int = 0,
                window: int = 0, seq: int = 64, batch: int = 4, mbs: int = 2):
    model = ModelConfig(vocab_size=16, hidden=16, layers=2, heads=4, kv_heads=4, ffn_hidden=32,
                        sliding_window=window)
    return validate(Config(model, ParallelConfig(sp=sp, sp_mode=mode, sp_split=split,
                                                 ulysses_size=u),
                           TrainConfig(seq_len=seq, global_batch_size=batch,
                                       micro_batch_size=mbs, document_masking=True,
                                       eos_token_id=3)), sp)


@pytest.mark.parametrize("sp,mode,split,u,window", [
    (1, "ring", "contiguous", 0, 0), (4, "ring", "contiguous", 0, 0),
    (4, "ring", "zigzag", 0, 0), (4, "ulysses", "contiguous", 0, 0),
    (4, "hybrid", "contiguous", 2, 0), (4, "ring", "contiguous", 0, 10),
    (4, "halo", "contiguous", 0, 10)])
def test_one_document_a_row_is_the_full_causal_model(sp, mode, split, u, window):
    """With --document-masking and one document a row, the step time model reads the same
    attention context and ring / halo blocks as for full causal attention, so the same time."""
    from mpipar.parallel.sequence.cost import attention_context, extra_key_blocks
    from mpipar.plan.step_time import StepDocuments, _document_sp
    from mpipar.parallel.sequence.registry import SP_MODES
    from mpipar.parallel.sequence_split import SeqLayout
    layout = _doc_layout(sp, mode, split, u, window)
    docs = StepDocuments(np.zeros((4, 64), np.int64))
    context, hops = _document_sp(docs, 64, sp, split, SP_MODES[mode], u, 1, 2, window)
    ring = SeqLayout(64, sp // u, split) if mode == "hybrid" else SeqLayout(64, sp, split)
    assert context == pytest.approx(attention_context(layout, window), rel=1e-12)
    assert hops == extra_key_blocks(SP_MODES[mode], ring, window)
    assert predict_step_time(layout, documents=docs).total == pytest.approx(
        predict_step_time(layout).total, rel=1e-12)


def test_packed_documents_the_busiest_ranks_keys_and_the_rings_hops():
    """Rows of documents of 3, 5 and 8 tokens (the step's two microbatches of two rows): keys
    a query sees on the busiest rank, counted pair by pair, and the ring's hops; Ulysses' ranks
    share the sequence's work; the planner's time falls with the work and its ring bytes are
    the engine's traffic for those documents (:func:`predict_step_bytes`)."""
    from mpipar.plan.step_time import StepDocuments, _document_sp, step_microbatches
    from mpipar.parallel.sequence.registry import SP_MODES
    ring, ulysses = SP_MODES["ring"], SP_MODES["ulysses"]
    row = np.repeat([0, 1, 2], [3, 5, 8])
    ids = np.tile(row, (4, 1))
    docs = StepDocuments(ids)
    pos = np.arange(16)
    same = (row[:, None] == row[None, :]) & (pos[None, :] <= pos[:, None])
    keys = same.sum(axis=1)                       # keys each query sees
    busiest = max(keys[r * 4:(r + 1) * 4].sum() for r in range(4)) / 4
    assert _document_sp(docs, 16, 4, "contiguous", ring, 0, 1, 2, 0) == (busiest, 1.0)
    assert _document_sp(docs, 16, 4, "contiguous", ulysses, 0, 1, 2, 0) == (keys.mean(), 0.0)
    assert _document_sp(docs, 16, 1, "contiguous", ring, 0, 1, 2, 0) == (keys.mean(), 0.0)
    layout = _doc_layout(4, seq=16)
    assert predict_step_time(layout, documents=docs).total < predict_step_time(layout).total
    coord = Coord(dp=0, tp=0, pp=0, sp=0)
    micro = step_microbatches(layout, docs)
    assert [m.docs.tolist() for m in micro] == [ids[:2].tolist(), ids[2:].tolist()]
    assert predict_step_bytes(layout, coord, micro) == predict_step_bytes(layout, coord,
                                                                          [ids[:2], ids[2:]])
    assert predict_step_bytes(layout, coord, micro)["sp"] < predict_step_bytes(layout, coord)["sp"]


def test_plan_with_documents_tries_the_balanced_split_and_reads_them():
    """--document-masking: the plan ranks the balanced split too, and its SP layouts' bytes
    are those of the documents it was given."""
    from mpipar.plan.step_time import StepDocuments
    base = _doc_layout(1, seq=16).config
    ids = np.tile(np.repeat([0, 1, 2], [3, 5, 8]), (4, 1))
    plan = plan_layouts(base, 4, {"global_batch_size"}, documents=StepDocuments(ids))
    splits = {c.cfg.parallel.sp_split for c in plan.ranked if c.cfg.parallel.sp == 4}
    assert "balanced" in splits
    ring = next(c for c in plan.ranked if c.cfg.parallel.sp == 4 and c.cfg.parallel.sp_mode ==
                "ring" and c.cfg.parallel.sp_split == "contiguous")
    full = plan_layouts(base, 4, {"global_batch_size"})
    same = next(c for c in full.ranked if c.describe() == ring.describe())
    assert ring.step_bytes["sp"] < same.step_bytes["sp"]


# ------------------------------------------------ multi-token prediction and Newton-Schulz
def test_time_model_flops_are_the_model_flops_with_mtp():
    """One process, no per-call overhead: the time model's compute is the model's FLOPs (the
    MFU count) at the peak, the multi-token prediction modules' included."""
    hw = Hardware(peak_flops=1e9, bandwidth=1e18, latency=0.0)
    for depth in (0, 2):
        cfg = validate(Config(ModelConfig(vocab_size=16, hidden=8, layers=2, heads=2,
                                          kv_heads=1, ffn_hidden=16, mtp_depth=depth),
                              train=TrainConfig(seq_len=8, global_batch_size=2)), 1)
        flops = model_flops_per_step(cfg)
        assert predict_step_time(cfg, hw).compute * hw.peak_flops == pytest.approx(
            flops, rel=1e-12), depth


def _ns_by_hand(steps: int) -> int:
    """Newton-Schulz FLOPs of the tiny model's block matrices (out x in; X is m x n, m <= n):
    per iteration X X^T 2 m^2 n, A A 2 m^3, B X 2 m^2 n. q, k, v, o 8 x 8; gate, up 16 x 8
    and down 8 x 16 (m 8, n 16)."""
    def one(m: int, n: int) -> int:
        return 2 * m * m * n + 2 * m ** 3 + 2 * m * m * n
    return steps * (4 * one(8, 8) + 3 * one(8, 16))


def test_newton_schulz_flops_by_hand_on_one_process_and_spread():
    """Muon's Newton-Schulz FLOPs in the planner: the analytic count on one process (and its
    seconds at the peak in the step time, beside AdamW's); spread over the owners by tp and
    by ZeRO-1 (each matrix on one rank: the ranks' FLOPs sum to one process's), and at
    ZeRO-0 every dp replica runs them all."""
    from mpipar.plan.optimizer import newton_schulz_flops
    model = ModelConfig(vocab_size=16, hidden=8, layers=1, heads=2, kv_heads=2, ffn_hidden=16)
    hw = Hardware(peak_flops=1e9, bandwidth=1e18, latency=0.0)

    def cfg(world: int, optimizer: str = "muon", **par):
        return validate(Config(model, ParallelConfig(**par), TrainConfig(
            seq_len=8, global_batch_size=4, optimizer=optimizer, muon_ns_steps=3)), world)
    one = cfg(1)
    assert newton_schulz_flops(one, Coord(0, 0, 0, 0)) == _ns_by_hand(3) == 82944
    assert (predict_step_time(one, hw).total - predict_step_time(cfg(1, "adamw"), hw).total
            == pytest.approx(82944 / 1e9, rel=1e-9))
    for par, coords in ((dict(dp=2, tp=2), [Coord(0, t, 0, 0) for t in range(2)]),
                        (dict(dp=4, zero=1), [Coord(d, 0, 0, 0) for d in range(4)])):
        each = [newton_schulz_flops(cfg(4, **par), c) for c in coords]
        assert sum(each) == 82944 and max(each) < 82944, (par, each)
    assert newton_schulz_flops(cfg(4, dp=2, tp=2), Coord(1, 1, 0, 0)) == \
        newton_schulz_flops(cfg(4, dp=2, tp=2), Coord(0, 1, 0, 0))
