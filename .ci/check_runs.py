"""Assertions on the output of the CI's Slurm jobs (.ci/slurm.sh, .ci/cluster.sh).

    check_runs.py JOBS run NAME --steps N [--first S] [--layout L] [--nodes K --per-node R]
                                 [--ref REF]
    check_runs.py JOBS preempted NAME --steps N --ref REF [--nodes K --per-node R] [--moved]

JOBS holds one directory per job (``job.out``, ``run/metrics.jsonl``). ``run`` checks that the job
printed its layout, its node shape (``mpipar: K node(s) x R rank(s) per node``, from ``python -m
mpipar.runtime.nodes`` inside the job) and its final step, that metrics.jsonl holds steps S..N once
each, that the loss falls (a run from step 1), and that every loss equals job REF's at the same
step to <= 1e-10 relative (float64: every layout computes the same numbers). ``preempted`` checks
the round trip of a preempted job: SIGUSR1, a checkpoint, exit 0, a requeue, ``--resume auto`` at
the step it stopped, the final step, and losses equal to REF's; ``--moved``: the requeued run
ran on other nodes than the first.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

TOLERANCE = 1e-10


def losses(jobs: pathlib.Path, name: str) -> dict[int, float]:
    """step -> loss of job ``name``'s metrics.jsonl (each step must appear once)."""
    records = [json.loads(line) for line in (jobs / name / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"{name}: steps repeat in metrics.jsonl: {steps}"
    return {r["step"]: r["loss"] for r in records}


def compare(name: str, got: dict[int, float], ref_name: str, ref: dict[int, float]) -> float:
    """The largest relative difference of ``got`` from ``ref`` (every step of ``got``)."""
    missing = sorted(set(got) - set(ref))
    assert not missing, f"{name}: steps {missing} missing from {ref_name}"
    worst = max(abs(loss - ref[s]) / abs(ref[s]) for s, loss in got.items())
    assert worst <= TOLERANCE, (f"{name}: losses differ from {ref_name} by {worst:.2e} relative "
                                f"(> {TOLERANCE:g})")
    return worst


def hostnames(nodelist: str) -> set[str]:
    """Slurm's compact node list (``node[1-2,4],head``) as names."""
    out = set()
    for prefix, ranges, single in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if single:
            out.add(single)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            out |= {f"{prefix}{i}" for i in range(int(lo), int(hi or lo) + 1)}
    return out


def check_shape(name: str, out: str, nodes: int, per_node: int) -> None:
    """Every run of the job printed the node shape MPI saw inside it."""
    shape = f"mpipar: {nodes} node(s) x {per_node} rank(s) per node"
    assert shape in out, f"{name}: '{shape}' missing:\n{out}"


def check_run(jobs: pathlib.Path, a: argparse.Namespace) -> str:
    out = (jobs / a.name / "job.out").read_text()
    if a.layout:
        assert f"mpipar: layout {a.layout}" in out, f"{a.name}: layout '{a.layout}' missing:\n{out}"
    if a.nodes:
        check_shape(a.name, out, a.nodes, a.per_node)
    assert re.search(rf"^step +{a.steps}/{a.steps} ", out, re.M), f"{a.name}: no final step:\n{out}"
    got = losses(jobs, a.name)
    assert sorted(got) == list(range(a.first, a.steps + 1)), f"{a.name}: steps {sorted(got)}"
    text = f"{a.name}: steps {a.first}..{a.steps}"
    if a.first == 1:
        head, tail = sum(got[s] for s in range(1, 6)) / 5, sum(list(got.values())[-5:]) / 5
        assert tail < head - 1.0, f"{a.name}: loss not falling: {head:.3f} -> {tail:.3f}"
        text += f", loss {got[1]:.3f} -> {got[a.steps]:.3f}"
    if a.ref:
        text += f", equal to {a.ref} (<= {compare(a.name, got, a.ref, losses(jobs, a.ref)):.1e})"
    return text


def check_preempted(jobs: pathlib.Path, a: argparse.Namespace) -> str:
    name, out = a.name, (jobs / a.name / "job.out").read_text()

    def at(pattern: str, after: int = 0) -> re.Match:
        m = re.compile(pattern, re.M).search(out, after)
        assert m, f"{name}: no line matching {pattern!r} after offset {after} in:\n{out}"
        return m

    m = at(r"received SIGUSR1")
    m = at(r"preempted after step (\d+)", m.end())
    stopped = int(m.group(1))
    m = at(r"training exited with status 0$", m.end())
    m = at(r"requeueing job", m.end())
    m = at(r"run 2 \(restarts: 1\) on (\S+):", m.end())
    second = m.group(1)
    m = at(r"mpipar: resumed from (\S+) at step (\d+)", m.end())
    ckpt = pathlib.Path(m.group(1))
    assert int(m.group(2)) == stopped, \
        f"{name}: preempted after step {stopped}, resumed at {m.group(2)}"
    assert 5 <= stopped < a.steps, f"{name}: stopped at step {stopped}"
    assert ckpt.name == f"step_{stopped:08d}", f"{name}: resumed from {ckpt}"
    m = at(rf"^step +{a.steps}/{a.steps} ", m.end())
    at(r"training exited with status 0$", m.end())
    assert "requeueing" not in out[m.end():], f"{name}: requeued again after finishing"
    got = losses(jobs, name)
    assert sorted(got) == list(range(1, a.steps + 1)), f"{name}: steps {sorted(got)}"
    worst = compare(name, got, a.ref, losses(jobs, a.ref))
    ckpts = sorted(p.name for p in ckpt.parent.iterdir() if p.name.startswith("step_"))
    assert ckpts == [f"step_{stopped:08d}", f"step_{a.steps:08d}"], f"{name}: checkpoints {ckpts}"
    first = re.search(r"run 1 \(restarts: 0\) on (\S+):", out).group(1)
    if a.nodes:
        assert out.count(f"mpipar: {a.nodes} node(s) x {a.per_node} rank(s) per node") == 2, \
            f"{name}: the node shape is not in both runs' output:\n{out}"
    if a.moved:
        assert not hostnames(first) & hostnames(second), f"{name}: ran on {first}, then {second}"
    return (f"{name}: preempted after step {stopped} on {first}, checkpointed, requeued, resumed "
            f"on {second}, finished {a.steps} steps equal to {a.ref} (<= {worst:.1e}); "
            f"checkpoints {ckpts}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jobs", type=pathlib.Path)
    sub = parser.add_subparsers(dest="check", required=True)
    run = sub.add_parser("run")
    run.add_argument("name")
    run.add_argument("--steps", type=int, required=True)
    run.add_argument("--first", type=int, default=1)
    run.add_argument("--layout", default="")
    run.add_argument("--nodes", type=int, default=0)
    run.add_argument("--per-node", type=int, default=0)
    run.add_argument("--ref", default="")
    pre = sub.add_parser("preempted")
    pre.add_argument("name")
    pre.add_argument("--steps", type=int, required=True)
    pre.add_argument("--ref", required=True)
    pre.add_argument("--nodes", type=int, default=0)
    pre.add_argument("--per-node", type=int, default=0)
    pre.add_argument("--moved", action="store_true")
    a = parser.parse_args(argv)
    try:
        text = (check_run if a.check == "run" else check_preempted)(a.jobs, a)
    except AssertionError as exc:
        print(f"check_runs: FAIL: {exc}", file=sys.stderr)
        return 1
    print(f"check_runs: ok: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
