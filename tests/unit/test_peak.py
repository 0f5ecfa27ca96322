"""The CPU peak probe: a median over windows with its spread, on the threads asked for, and the
planner's per-rank peak measured as ``train`` runs (a rank's share of the node's cores)."""
from __future__ import annotations

import pytest

from mpipar.runtime.peak import PeakProbe, probe_peak


def test_the_probe_is_a_median_over_windows_on_the_threads_asked_for():
    probe = probe_peak("float32", threads=1, repeats=5, seconds=0.05, n=64)
    assert probe.threads == 1 and probe.repeats == 5
    assert 0 < probe.low <= probe.flops <= probe.high
    assert probe.spread == pytest.approx((probe.high - probe.low) / probe.flops)
    assert "median of 5 GEMM probes on 1 thread(s)" in probe.describe()
    with pytest.raises(ValueError, match="repeats=0 >= 1"):
        probe_peak("float32", repeats=0)


def test_a_probe_describes_its_spread():
    probe = PeakProbe(flops=10e9, low=8e9, high=12e9, repeats=7, threads=2)
    assert probe.describe() == ("median of 7 GEMM probes on 2 thread(s), 8.0-12.0 GFLOP/s, "
                                "spread 40%")


def test_the_planner_probes_a_ranks_share_of_the_node(monkeypatch):
    from mpipar.config import Config
    from mpipar.plan import cli, probe
    from mpipar.runtime import nodes
    asked = []

    def fake(cfg, threads=None, **_):
        asked.append(threads)
        r = probe.Rate(1.0, 1.0, 1.0)
        return probe.RankProbe(probe.Rate(40e9, 30e9, 50e9), probe.Rate(20e-6, 10e-6, 30e-6),
                               probe.Rate(4e9, 3e9, 5e9),
                               probe.ModelFit(r, 128, 2, 10e9), (128, 128, 128), 2**14,
                               threads, 7)
    monkeypatch.setattr(probe, "probe_rank", fake)
    monkeypatch.setattr(nodes, "cpu_count", lambda: 2)
    flops, call, passes, note = cli.rank_rates(Config(), 8)  # 8 ranks on 2 cores: 1 thread each,
    assert asked == [1] and flops == pytest.approx(10e9 * 2 / 8)  # a quarter of a core: the
    assert call == pytest.approx(20e-6 * 8 / 2)                   # model's rate, not the GEMM's
    assert passes == pytest.approx(4e9 * 2 / 8)
    assert note.startswith("probed here as 8 rank(s) on 2 core(s) run it: median of 7 windows")
    assert note.endswith("; x 0.25 for cores shared")
    flops, call, passes, note = cli.rank_rates(Config(), 1)     # one rank: every core
    assert asked[-1] == 2 and flops == 10e9 and call == 20e-6 and "shared" not in note


def test_the_model_probe_splits_calls_from_flops():
    from mpipar.plan.probe import ModelFit, Rate
    fit = ModelFit.of(Rate(10e-3, 9e-3, 12e-3), 128, 2, flops=1e8, calls=50, call=40e-6)
    assert fit.rate == pytest.approx(3 * 1e8 / (10e-3 - 50 * 40e-6))
    slow_calls = ModelFit.of(Rate(10e-3, 9e-3, 12e-3), 128, 2, flops=1e8, calls=50, call=1e-3)
    assert slow_calls.rate == pytest.approx(3 * 1e8 / 5e-3)   # the calls' part at most half


def test_load_slows_the_ranks_by_the_cores_they_share(monkeypatch):
    from mpipar.runtime import nodes
    monkeypatch.setattr(nodes, "cpu_count", lambda: 2)
    monkeypatch.setattr(nodes, "ranks_sharing_cores", lambda n: n)
    assert nodes.load_slowdown(1, 8, load=0.0) == (0.0, 1.0)    # quiet: as the plan shows
    assert nodes.load_slowdown(1, 8, load=8.0) == (8.0, 2.0)    # 8 others: half the cores
    assert nodes.load_slowdown(1, 1, load=0.5) == (0.5, 1.0)    # a spare core absorbs them
    assert nodes.load_slowdown(1, 1, load=3.0) == (3.0, 2.0)    # 4 threads on 2 cores


def test_the_model_probe_runs_the_models_own_step():
    """On a tiny model: the forward+backward probe runs (one block, the NumPy kernels) and its
    rate is that of its median time after the calls' part."""
    from mpipar.config import Config, ModelConfig, TrainConfig
    from mpipar.plan.probe import probe_rank
    cfg = Config(ModelConfig(vocab_size=32, hidden=16, layers=2, heads=2, kv_heads=1),
                 train=TrainConfig(seq_len=16, global_batch_size=2))
    probe = probe_rank(cfg, threads=1, repeats=2, seconds=0.02)
    fit = probe.model
    assert fit is not None and (fit.rows, fit.tokens) == (2, 16)
    assert 0 < fit.seconds.low <= fit.seconds.median <= fit.seconds.high
    assert probe.flops == fit.rate > 0 and probe.op_seconds == probe.call.median > 0
    assert "the model's forward+backward (one block, NumPy kernels) on 2 x 16 tokens" in (
        probe.describe())
