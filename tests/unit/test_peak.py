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
    from mpipar.plan import cli
    from mpipar.runtime import nodes, peak
    asked = []

    def fake(dtype, threads=None, **_):
        asked.append(threads)
        return PeakProbe(10e9, 9e9, 11e9, 7, threads)
    monkeypatch.setattr(peak, "probe_peak", fake)
    monkeypatch.setattr(nodes, "cpu_count", lambda: 2)
    flops, note = cli.rank_peak("float32", 8)           # 8 ranks on 2 cores: 1 thread each,
    assert asked == [1] and flops == pytest.approx(10e9 * 2 / 8)  # a quarter of a core
    assert note.startswith("a GEMM probe here as 8 rank(s) on 2 core(s) run it: median of 7")
    assert note.endswith("; x 0.25 for cores shared")
    flops, note = cli.rank_peak("float32", 1)            # one rank: every core
    assert asked[-1] == 2 and flops == 10e9 and "shared" not in note
