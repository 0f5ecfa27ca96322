"""Expert capacity (``--moe-capacity-factor C``) on one process: which assignments a hand-built
routing drops (counted by hand, whole rows and split over two sp ranks, zigzag), the sparse FFN
against a token loop with the dropped weights zeroed (not renormalised), the stage's gradient
against float64 finite differences with drops active, a capacity that drops nothing bit for bit
the dropless run, and the rules."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from mpipar.config import ConfigError, ModelConfig
from mpipar.kernels import get_backend
from mpipar.kernels import expert_routing as routing
from mpipar.layout import resolve_model
from mpipar.model.moe import LocalExperts, capacity, moe_forward
from mpipar.model.params import init_params
from tests.unit.test_model import make_stage
from tests.unit.test_moe import assert_gradient_matches_differences, expert_ffn, route_token

MOE = resolve_model(ModelConfig(vocab_size=11, hidden=16, layers=2, heads=4, kv_heads=2,
                                ffn_hidden=24, rope_theta=500.0, init_std=0.3, moe_experts=4,
                                moe_top_k=2, moe_ffn_hidden=8, moe_aux_loss_coef=0.1,
                                moe_capacity_factor=0.5))

# Two rows of 4 tokens, 3 experts, top 2: C = 0.75 gives cap = ceil(0.75 x 4 x 2 / 3) = 2.
CHOICES = np.array([[[0, 1], [0, 2], [0, 1], [2, 0]],
                    [[1, 2], [2, 1], [1, 0], [2, 1]]])
# Row 0: expert 0 gets t0, t1, t2, t3(slot 1): the last two drop. Row 1: expert 1 gets t0,
# t1(slot 1), t2, t3(slot 1): the last two drop; expert 2 gets t0(slot 1), t1, t3: t3 drops.
KEPT = np.array([[[1, 1], [1, 1], [0, 1], [1, 0]],
                 [[1, 1], [1, 1], [0, 1], [0, 0]]], dtype=bool)


def test_hand_built_routing_drops_the_counted_assignments():
    cfg = dataclasses.replace(MOE, moe_experts=3, moe_capacity_factor=0.75)
    assert math.ceil(0.75 * 4 * 2 / 3) == 2
    keep, counts = capacity(get_backend("numpy"), CHOICES.reshape(-1, 2), np.arange(4), 2, cfg,
                            LocalExperts(3), np.float64)
    np.testing.assert_array_equal(keep.reshape(2, 4, 2), KEPT)
    np.testing.assert_array_equal(counts, [[4, 2, 2], [1, 4, 3]])   # before drops


@pytest.mark.parametrize("held", [([0, 3], [1, 2]), ([3, 0], [2, 1])], ids=["zigzag", "reversed"])
def test_a_split_sequence_drops_what_the_whole_one_does(held):
    """Two sp ranks holding positions {0, 3} and {1, 2} (zigzag, blocks of 1; also listed in
    reverse): each rank's keep, from its own choices and the block counts summed over both,
    is the whole row's; without the other rank's counts it is not (the exchange matters)."""
    blocks, cap, E = 4, 2, 3
    local = [routing.block_counts(CHOICES[:, p], np.array(p), blocks, E, np) for p in held]
    whole = local[0] + local[1]
    for p, own in zip(held, local):
        keep = routing.capacity_keep(CHOICES[:, p], np.array(p), np.array(p), own, whole, cap, np)
        np.testing.assert_array_equal(keep, KEPT[:, p])
    alone = [routing.capacity_keep(CHOICES[:, p], np.array(p), np.array(p), own, own, cap, np)
             for p, own in zip(held, local)]
    assert any(not np.array_equal(a, KEPT[:, p]) for a, p in zip(alone, held))


def naive_moe(p: dict, i: int, h: np.ndarray, c: ModelConfig) -> tuple[np.ndarray, int]:
    """Block ``i``'s sparse FFN token by token with capacity: each row's assignments in order of
    position and slot, an expert's beyond ``cap`` dropped (weight zeroed, the others'
    unchanged); and the assignments dropped."""
    B, S, H = h.shape
    E, K = c.moe_experts, c.moe_top_k
    cap = math.ceil(c.moe_capacity_factor * S * K / E)
    out, dropped = np.zeros_like(h), 0
    for b in range(B):
        taken = np.zeros(E, int)
        for t in range(S):
            x = h[b, t]
            pr, top = route_token(p, i, x, K)
            for e in top:
                taken[e] += 1
                if taken[e] > cap:
                    dropped += 1
                    continue
                out[b, t] += pr[e] / pr[top].sum() * expert_ffn(p, i, e, x)
    return out, dropped


def test_sparse_ffn_with_drops_matches_a_token_loop():
    k = get_backend("numpy")
    p = init_params(MOE, 3, np.float64)
    h = np.random.default_rng(1).normal(size=(2, 9, MOE.hidden))
    out, saved = moe_forward(k, p, 1, MOE, h, LocalExperts(MOE.moe_experts), None, np.arange(9))
    ref, dropped = naive_moe(p, 1, h, MOE)
    assert saved.dropped == dropped > 0
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-14)
    assert int(saved.counts.sum()) == 2 * 9 * MOE.moe_top_k       # loads: before drops
    assert len(saved.order) == 2 * 9 * MOE.moe_top_k - dropped     # dropped ones not sent


def test_gradient_with_drops_matches_finite_differences():
    dropped, _ = assert_gradient_matches_differences(MOE, seq=8)
    assert all(d > 0 for d in dropped.values()) and len(dropped) == 2


def _step(cfg):
    stage = make_stage(cfg=cfg)
    p = init_params(cfg, 5, np.float64)
    tokens = np.random.default_rng(3).integers(0, 11, (2, 8))
    grads = {n: np.zeros_like(v) for n, v in p.items()}
    stage.moe_aux_weight = 0.05
    loss, cache = stage.forward(p, tokens, np.arange(8), tokens)
    stage.backward(p, grads, np.full(loss.shape, 1 / loss.size), cache)
    return loss, stage.moe_aux, stage.moe_dropped, grads


def test_a_capacity_that_drops_nothing_is_the_dropless_run_bit_for_bit():
    """C = E / K gives cap = T: nothing can drop, and the capacity path (block counts, keep
    mask, permutation of the kept) reproduces C = 0's loss, balance loss and gradients exactly;
    a capacity that does drop changes them."""
    runs = [_step(dataclasses.replace(MOE, moe_capacity_factor=c)) for c in (0.0, 2.0, 0.5)]
    (l0, a0, d0, g0), (l1, a1, d1, g1), (l2, _, d2, _) = runs
    assert d0 == d1 == {0: 0, 1: 0} and sum(d2.values()) > 0
    np.testing.assert_array_equal(l0, l1)
    assert a0 == a1
    for n in g0:
        np.testing.assert_array_equal(g0[n], g1[n])
    assert not np.array_equal(l0, l2)


@pytest.mark.parametrize("value, words", [
    (-0.5, "model.moe_capacity_factor=-0.5: must be >= 0"),
    (float("inf"), "model.moe_capacity_factor=inf: must be a finite number"),
    (float("nan"), "model.moe_capacity_factor=nan: must be a finite number"),
])
def test_bad_capacity_factors_are_config_errors(value, words):
    from mpipar.config import Config, TrainConfig
    from mpipar.rules import validate
    cfg = Config(ModelConfig(hidden=16, heads=2, kv_heads=2, layers=2, moe_experts=4,
                             moe_capacity_factor=value), train=TrainConfig(seq_len=8))
    with pytest.raises(ConfigError, match=words):
        validate(cfg, 1)


def test_a_capacity_without_experts_exits_2_with_one_message(tmp_path):
    from untrusted import TINY, run_train
    code, err = run_train([*TINY, "--moe-capacity-factor", "1.25", "--run-dir", str(tmp_path)])
    assert code == 2
    assert err.count("model.moe_capacity_factor=1.25: needs a mixture of experts") == 1, err


@pytest.mark.parametrize("seq_len, sp, split, min_chunk", [
    (16, 2, "contiguous", 64), (16, 4, "zigzag", 64), (24, 3, "zigzag", 64),
    (64, 2, "balanced", 1), (96, 4, "balanced", 1), (96, 4, "balanced", 3),
    (2048, 4, "balanced", 64)])
def test_every_rank_holds_whole_position_blocks(seq_len, sp, split, min_chunk):
    """The capacity's counts travel per block of ``block_length`` positions: every sp rank's
    runs (zigzag's middle rank holds two adjacent chunks; balanced's split changes with each
    microbatch's documents, its chunk count too) are whole blocks, so each block has one
    holder."""
    from mpipar.parallel.sequence_split import SeqLayout, balanced_layout
    from mpipar.parallel.experts.exchange import block_length
    L = block_length(SeqLayout(seq_len, sp, split, min_chunk=min_chunk))
    rng = np.random.default_rng(sp)
    layouts = [SeqLayout(seq_len, sp, split)]
    if split == "balanced":
        layouts += [balanced_layout(seq_len, sp, np.cumsum(rng.random((2, seq_len)) < p,
                                                           axis=1), min_chunk)
                    for p in (0.1, 0.1, 0.1, 0.01, 0.3)]
    for lay in layouts:
        held = np.concatenate([lay.positions(r) // L for r in range(sp)])
        assert sorted(held.tolist()) == sorted(np.arange(seq_len) // L)
        owner = {}
        for r in range(sp):
            for blk in lay.positions(r) // L:
                assert owner.setdefault(int(blk), r) == r
    assert L == {"contiguous": seq_len // sp, "zigzag": seq_len // (2 * sp)}.get(split, L)


def test_the_command_line_reports_drops_and_may_change_c_on_resume(tmp_path):
    """``--moe-capacity-factor`` from the command line: metrics carry ``moe_dropped`` per
    sparse layer (> 0 at C = 0.25); a resume keeps the checkpoint's C unless given, and may
    change it (a training setting): dropless, it reports zeros."""
    import json

    from tests.unit.test_moe_bias import _train
    from untrusted import TINY
    moe = ["--moe-experts", "4", "--save-dir", str(tmp_path / "ckpt"), "--run-dir",
           str(tmp_path / "run")]
    code, out, err = _train([*TINY, *moe, "--moe-capacity-factor", "0.25", "--steps", "2"])
    assert code == 0, err[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(sorted(r["moe_dropped"]) == ["0", "1"] and min(r["moe_dropped"].values()) > 0
               for r in rows), rows
    code, out, err = _train([*TINY, *moe, "--steps", "3", "--resume", "auto"])   # C kept
    assert code == 0, err[-2000:]
    code, out, err = _train([*TINY, *moe, "--steps", "4", "--resume", "auto",
                             "--moe-capacity-factor", "0"])                    # C changed
    assert code == 0, err[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[-2:]] == [3, 4] and min(rows[-2]["moe_dropped"].values()) > 0
    assert rows[-1]["moe_dropped"] == {"0": 0, "1": 0}


def test_the_capacity_may_change_on_a_checkpoint():
    from mpipar.layout import model_from_checkpoint
    saved = ModelConfig(moe_experts=4, moe_capacity_factor=1.25)
    assert model_from_checkpoint(saved, {"moe_capacity_factor": 0.0},
                                 "ckpt").moe_capacity_factor == 0.0


def test_the_summary_totals_the_drops():
    """``summarize`` adds the run's dropped assignments and their share of the sparse layers'
    (tokens x K x layers per step); a dropless run says nothing."""
    from mpipar.observe import summary as run_summary
    from report_records import record
    records = [record(s, 3.0, compute=0.5) for s in (1, 2)]
    for r, drops in zip(records, ({"1": 6, "3": 2}, {"1": 0, "3": 4})):
        r["moe_dropped"], r["tokens"] = drops, 64
    s = run_summary.summarize(records, None, {"model": {"moe_top_k": 2}})
    assert s["moe_dropped"] == 12 and s["moe_dropped_fraction"] == 12 / (2 * 64 * 2 * 2)
    assert "expert capacity: 12 assignments dropped (2.34% of" in run_summary.summary_text(s)
    for r in records:
        r["moe_dropped"] = {"1": 0, "3": 0}
    assert "moe_dropped" not in run_summary.summarize(records, None, {"model": {}})
