"""Pipeline schedules as data: validity, deadlock freedom, bubbles and memory against analytic values."""
from __future__ import annotations

from collections import Counter

import pytest

from mpipar.parallel.pipeline.schedule import (
    SCHEDULES,
    Op,
    ScheduleError,
    build_schedule,
    dry_run,
    forward_only,
    interleaved_groups,
    message_key,
    message_tag,
)

PS = (1, 2, 4, 8)
MS = range(1, 17)
CASES = [(name, p, v) for name in SCHEDULES for p in PS for v in ((2, 3) if name == "interleaved" else (1,))]


def _one_f_one_b_bubble(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def _interleaved_makespan(p: int, m: int, v: int) -> int:
    return 3 * (v * m + p - 1) if m >= p else 3 * (v * p + m - 1)


def _zb_h1_makespan(p: int, m: int) -> int:
    return 3 * m + p - 1 if m >= p else 2 * m + 2 * p - 1


@pytest.mark.parametrize("name,p,v", CASES)
def test_every_schedule_completes_and_has_the_expected_ops(name: str, p: int, v: int) -> None:
    for m in MS:
        schedule = build_schedule(name, p, m, v)
        result = dry_run(schedule, p, m, v)
        kinds = Counter(op.kind for ops in schedule for op in ops)
        stages = v * p
        assert kinds["fwd"] == m * stages
        if name == "zb-h1":
            assert kinds["bwd_input"] == kinds["bwd_weight"] == m * stages and kinds["bwd"] == 0
        else:
            assert kinds["bwd"] == m * stages and kinds["bwd_input"] == kinds["bwd_weight"] == 0
        messages = m * (stages - 1) if p > 1 else 0
        for kind in ("send_fwd", "recv_fwd", "send_bwd", "recv_bwd"):
            assert kinds[kind] == messages
        assert [len(ops) for ops in result.timeline] == [len(ops) for ops in schedule]
        for rank, entries in enumerate(result.timeline):
            assert [op for _, _, op in entries] == schedule[rank]
            for (s0, e0, _), (s1, _, _) in zip(entries, entries[1:]):
                assert s0 <= e0 == s1


@pytest.mark.parametrize("name,p,v", CASES)
def test_message_tags_are_unique_per_rank_pair_and_match(name: str, p: int, v: int) -> None:
    m = 7
    schedule = build_schedule(name, p, m, v)
    sent: dict[tuple[int, int, int], tuple] = {}
    received: dict[tuple[int, int, int], tuple] = {}
    for rank, ops in enumerate(schedule):
        for op in ops:
            if op.kind.startswith("send"):
                tag = message_tag(op, rank, p, v)
                assert 0 <= tag < 2 * m * v
                assert (rank, op.peer, tag) not in sent
                sent[(rank, op.peer, tag)] = message_key(op, rank, p)
            elif op.kind.startswith("recv"):
                tag = message_tag(op, rank, p, v)
                assert (op.peer, rank, tag) not in received
                received[(op.peer, rank, tag)] = message_key(op, rank, p)
    assert sent == received


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", PS)
def test_gpipe_and_1f1b_bubble_is_analytic(name: str, p: int) -> None:
    for m in MS:
        result = dry_run(build_schedule(name, p, m), p, m)
        assert result.makespan == 3 * (m + p - 1)
        assert result.bubble_fraction == _one_f_one_b_bubble(p, m)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_is_analytic_and_below_1f1b(p: int, v: int) -> None:
    for m in MS:
        result = dry_run(build_schedule("interleaved", p, m, v), p, m, v)
        makespan = _interleaved_makespan(p, m, v)
        assert result.makespan == makespan
        assert result.bubble_fraction == pytest.approx(1 - 3 * v * m / makespan, rel=1e-14, abs=1e-15)
        if m >= p:
            assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-14, abs=1e-15)
        if p > 1 and m > 1:
            assert result.bubble_fraction < _one_f_one_b_bubble(p, m)


@pytest.mark.parametrize("p", PS)
def test_zb_h1_bubble_is_analytic_and_below_1f1b(p: int) -> None:
    for m in MS:
        result = dry_run(build_schedule("zb-h1", p, m), p, m)
        makespan = _zb_h1_makespan(p, m)
        assert result.makespan == makespan
        assert result.bubble_fraction == pytest.approx(1 - 3 * m / makespan, rel=1e-14, abs=1e-15)
        if m >= p:
            assert result.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), rel=1e-14, abs=1e-15)
        if p > 1:
            assert result.bubble_fraction < _one_f_one_b_bubble(p, m)


@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 0.5, 1.5), (0.3, 0.7, 0.0)])
@pytest.mark.parametrize("p", [2, 4])
def test_makespan_with_general_costs(costs: tuple[float, float, float], p: int) -> None:
    fwd, bwd_input, bwd_weight = costs
    step = fwd + bwd_input + bwd_weight
    for m in (1, 3, 8):
        for comm in (0.0, 0.25):
            gpipe = dry_run(build_schedule("gpipe", p, m), p, m, 1, fwd, bwd_input, bwd_weight, comm)
            assert gpipe.makespan == pytest.approx((m + p - 1) * step + 2 * (p - 1) * comm)
        one_f_one_b = dry_run(build_schedule("1f1b", p, m), p, m, 1, fwd, bwd_input, bwd_weight)
        assert one_f_one_b.makespan == pytest.approx((m + p - 1) * step)
        single = dry_run(build_schedule("zb-h1", 1, m), 1, m, 1, fwd, bwd_input, bwd_weight, 5.0)
        assert single.makespan == pytest.approx(m * step) and single.bubble_fraction == pytest.approx(0.0)


def test_timeline_of_two_ranks_one_microbatch_with_latency() -> None:
    result = dry_run(build_schedule("1f1b", 2, 1), 2, 1, cost_comm=0.5)
    assert [(start, end, op.kind) for start, end, op in result.timeline[0]] == [
        (0.0, 1.0, "fwd"), (1.0, 1.0, "send_fwd"), (1.0, 5.0, "recv_bwd"), (5.0, 7.0, "bwd")]
    assert [(start, end, op.kind) for start, end, op in result.timeline[1]] == [
        (0.0, 1.5, "recv_fwd"), (1.5, 2.5, "fwd"), (2.5, 4.5, "bwd"), (4.5, 4.5, "send_bwd")]
    assert result.makespan == 7.0
    assert result.bubble_fraction == (2 * 7.0 - 6.0) / (2 * 7.0)
    assert result.timeline[1][-1][2] == Op("send_bwd", 0, 0, 0)


@pytest.mark.parametrize("p", PS)
def test_peak_activations(p: int) -> None:
    for m in MS:
        gpipe = dry_run(build_schedule("gpipe", p, m), p, m).peak_activations
        one_f_one_b = dry_run(build_schedule("1f1b", p, m), p, m).peak_activations
        zb_h1 = dry_run(build_schedule("zb-h1", p, m), p, m).peak_activations
        assert gpipe == [m] * p
        assert one_f_one_b == [min(m, p - r) for r in range(p)]
        # ZB-H1 keeps the 1F1B peak (reached on rank 0) on every rank.
        assert zb_h1 == [min(m, p)] * p and max(zb_h1) == max(one_f_one_b)
        for v in (2, 3):
            interleaved = dry_run(build_schedule("interleaved", p, m, v), p, m, v).peak_activations
            first_group = interleaved_groups(p, m)[0]
            assert interleaved == [min(m * v, (v - 1) * first_group + 2 * (p - r - 1) + 1) for r in range(p)]


@pytest.mark.parametrize("p", PS)
def test_interleaved_groups(p: int) -> None:
    for m in MS:
        groups = interleaved_groups(p, m)
        assert sum(groups) == m and max(groups) - min(groups) <= 1
        if m % p == 0:
            assert groups == [p] * (m // p)
        elif m > p:
            assert all(p <= g <= 2 * p - 1 for g in groups)
        else:
            assert groups == [m]


def test_interleaved_orders_chunks_in_groups_of_p() -> None:
    computes = [(op.kind, op.microbatch, op.chunk) for op in build_schedule("interleaved", 2, 4, 2)[1]
                if op.kind in ("fwd", "bwd")]
    forwards = [(mb, c) for kind, mb, c in computes if kind == "fwd"]
    backwards = [(mb, c) for kind, mb, c in computes if kind == "bwd"]
    assert forwards == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert backwards == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    # Rank 1 warms up with (v - 1) * p + 2 * (p - 1 - 1) = 2 forwards, then alternates.
    assert computes[:4] == [("fwd", 0, 0), ("fwd", 1, 0), ("fwd", 0, 1), ("bwd", 0, 1)]


def _f(mb: int, peer: int) -> list[Op]:
    return [Op("fwd", mb), Op("send_fwd", mb, 0, peer)]


def _last_f(mb: int, peer: int) -> list[Op]:
    return [Op("recv_fwd", mb, 0, peer), Op("fwd", mb)]


def test_cyclic_wait_is_reported_as_deadlock_with_every_stuck_op() -> None:
    # 1F1B for p=2, m=2 with two blocks swapped on each rank: rank 0 waits for the gradient of
    # microbatch 0 before sending microbatch 1, rank 1 waits for microbatch 1 before sending that
    # gradient. Either swap alone is harmless (checked with rank 1's swap only).
    rank0 = (_f(0, 1) + [Op("recv_bwd", 0, 0, 1), Op("bwd", 0)]
             + _f(1, 1) + [Op("recv_bwd", 1, 0, 1), Op("bwd", 1)])
    rank1 = _last_f(0, 0) + _last_f(1, 0) + [Op("bwd", 0), Op("send_bwd", 0, 0, 0), Op("bwd", 1),
                                             Op("send_bwd", 1, 0, 0)]
    assert dry_run([_f(0, 1) + _f(1, 1) + rank0[2:4] + rank0[6:], rank1], 2, 2).makespan == 9.0
    with pytest.raises(ScheduleError, match="deadlock") as err:
        dry_run([rank0, rank1], 2, 2)
    message = str(err.value)
    assert "rank 0: op #2 recv_bwd(mb=0, chunk=0, peer=1)" in message
    assert "rank 1: op #2 recv_fwd(mb=1, chunk=0, peer=0)" in message


def test_generated_schedule_with_reversed_rank_is_a_deadlock() -> None:
    schedule = build_schedule("gpipe", 4, 3)
    # Rank 2 waits for microbatch 0's gradient before it sends microbatch 2's activation, which rank 3
    # (GPipe: every forward before any backward) needs before it sends a gradient.
    rank2 = schedule[2]
    forwards = [op for op in rank2 if op.kind in ("recv_fwd", "fwd", "send_fwd")]
    backwards = [op for op in rank2 if op.kind in ("recv_bwd", "bwd", "send_bwd")]
    schedule[2] = forwards[:6] + backwards[6:] + forwards[6:] + backwards[:6]
    with pytest.raises(ScheduleError, match="deadlock") as err:
        dry_run(schedule, 4, 3)
    message = str(err.value)
    assert "rank 2: op #6 recv_bwd(mb=0, chunk=0, peer=3)" in message
    assert "rank 3: op #4 recv_fwd(mb=2, chunk=0, peer=2)" in message
    assert "rank 0: op #" in message and "rank 1: op #" in message


def test_missing_backward_is_rejected() -> None:
    schedule = build_schedule("gpipe", 1, 2)
    with pytest.raises(ScheduleError, match="microbatch 0, chunk 0 .* backward is missing"):
        dry_run([[op for op in schedule[0] if op != Op("bwd", 0)]], 1, 2)
    zb = build_schedule("zb-h1", 1, 2)
    with pytest.raises(ScheduleError, match="bwd_weight is missing"):
        dry_run([[op for op in zb[0] if op != Op("bwd_weight", 1)]], 1, 2)
    two = build_schedule("1f1b", 2, 2)
    two[1] = [op for op in two[1] if op.microbatch != 1 or op.kind not in ("bwd", "send_bwd")]
    with pytest.raises(ScheduleError, match="no send matches"):
        dry_run(two, 2, 2)


def _broken(name: str, p: int, m: int, v: int, rank: int, edit) -> list[list[Op]]:
    schedule = build_schedule(name, p, m, v)
    schedule[rank] = edit(list(schedule[rank]))
    return schedule


@pytest.mark.parametrize("schedule,p,m,v,rule", [
    (_broken("1f1b", 2, 2, 1, 0, lambda ops: [Op("fwd", 0, 0, 1) if op == Op("fwd", 0) else op
                                              for op in ops]), 2, 2, 1, "compute op must have peer=None"),
    (_broken("1f1b", 2, 2, 1, 0, lambda ops: [Op("send_fwd", 0, 0, 0) if op == Op("send_fwd", 0, 0, 1) else op
                                              for op in ops]), 2, 2, 1, "peer must be rank 1"),
    (_broken("1f1b", 2, 2, 1, 1, lambda ops: ops[1:2] + ops[:1] + ops[2:]), 2, 2, 1, "right before the fwd"),
    (_broken("1f1b", 2, 2, 1, 0, lambda ops: [ops[1], ops[0]] + ops[2:]), 2, 2, 1, "right after the fwd"),
    (_broken("gpipe", 1, 2, 1, 0, lambda ops: ops[2:3] + ops[:2] + ops[3:]), 1, 2, 1, "before the forward"),
    (_broken("gpipe", 1, 2, 1, 0, lambda ops: ops + [Op("fwd", 0)]), 1, 2, 1, "second forward"),
    (_broken("gpipe", 1, 2, 1, 0, lambda ops: ops + [Op("send_fwd", 0, 0, 0)]), 1, 2, 1, "p=1"),
    (_broken("gpipe", 1, 2, 1, 0, lambda ops: ops + [Op("fwd", 2)]), 1, 2, 1, "microbatch must be"),
    (_broken("interleaved", 1, 2, 2, 0, lambda ops: [ops[1]] + [ops[0]] + ops[2:]), 1, 2, 2,
     "activation from virtual stage 0"),
    (_broken("interleaved", 2, 2, 2, 0, lambda ops: ops + [Op("fwd", 0, 2)]), 2, 2, 2, "chunk must be"),
    (_broken("zb-h1", 1, 2, 1, 0, lambda ops: [ops[0], ops[2], ops[1]] + ops[3:]), 1, 2, 1,
     "needs the bwd_input"),
    (build_schedule("gpipe", 2, 2), 4, 2, 1, "one per rank"),
])
def test_rule_violations_are_named(schedule: list[list[Op]], p: int, m: int, v: int, rule: str) -> None:
    with pytest.raises(ScheduleError, match=rule):
        dry_run(schedule, p, m, v)


@pytest.mark.parametrize("args,rule", [
    (("pipedream", 2, 4, 1), "schedule name 'pipedream' is unknown"),
    (("1f1b", 0, 4, 1), "p=0 is invalid"),
    (("1f1b", 2.0, 4, 1), "p=2.0 is invalid"),
    (("gpipe", 2, 0, 1), "m=0 is invalid"),
    (("gpipe", 2, -3, 1), "m=-3 is invalid"),
    (("interleaved", 2, 4, 0), "v=0 is invalid"),
    (("interleaved", 2, 4, 1), "v=1 is invalid for 'interleaved'"),
    (("zb-h1", 2, 4, 2), "v=2 is invalid for 'zb-h1'"),
    (("1f1b", 2, 4, 3), "v=3 is invalid for '1f1b'"),
])
def test_build_schedule_rejects_bad_arguments(args: tuple, rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        build_schedule(*args)


def test_bad_op_kind_and_cost_are_rejected() -> None:
    with pytest.raises(ValueError, match="kind 'backward' is unknown"):
        Op("backward", 0)
    with pytest.raises(ValueError, match="cost_fwd=-1.0 is invalid"):
        dry_run(build_schedule("gpipe", 1, 1), 1, 1, cost_fwd=-1.0)
    with pytest.raises(ValueError, match="compute op"):
        message_key(Op("fwd", 0), 0, 2)


# ------------------------------------------------------------------ forward-only schedules
@pytest.mark.parametrize("name,p,v", CASES)
def test_forward_only_schedules_complete_without_deadlock(name: str, p: int, v: int) -> None:
    """Evaluation and generation walk a schedule's forwards alone: one forward of every
    (microbatch, stage), each activation sent once, nothing kept; with unit forwards the
    makespan is every rank's forwards back to back after the pipeline fills."""
    for m in MS:
        schedule = forward_only(build_schedule(name, p, m, v))
        result = dry_run(schedule, p, m, v, forward_only=True)
        kinds = Counter(op.kind for ops in schedule for op in ops)
        messages = m * (v * p - 1) if p > 1 else 0
        assert kinds == Counter({"fwd": m * v * p, **({"send_fwd": messages,
                                                          "recv_fwd": messages} if p > 1 else {})})
        assert result.peak_activations == [0] * p
        filling = v * p + m - 1 if name == "interleaved" and m < p else v * m + p - 1
        assert result.makespan == filling


def test_forward_only_dry_run_rejects_backward_ops_and_missing_forwards() -> None:
    with pytest.raises(ScheduleError, match="a forward-only schedule holds only"):
        dry_run(build_schedule("1f1b", 2, 2), 2, 2, forward_only=True)
    schedule = forward_only(build_schedule("gpipe", 2, 2))
    schedule[1] = [op for op in schedule[1] if op.microbatch != 1]
    schedule[0] = [op for op in schedule[0] if op != Op("send_fwd", 1, 0, 1)]
    with pytest.raises(ScheduleError, match="microbatch 1, chunk 0 .* forward is missing"):
        dry_run(schedule, 2, 2, forward_only=True)
    with pytest.raises(ScheduleError, match="backward is missing"):  # a training dry run
        dry_run(forward_only(build_schedule("gpipe", 2, 2)), 2, 2)
