"""``--trace-steps``: the trace.json of a launched 4-rank pp 2 x dp 2 run (with asynchronous
saves) is one Chrome trace with four processes named by their coordinates, each thread's
complete events ordered and non-overlapping, sends matched by receives, the pipeline's op
records of timeline.json folded in, checkpoint I/O on its threads and a memory counter. The
event format on its own: unit/test_trace.py."""
from __future__ import annotations

import collections
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import launch_env, mpirun, needs_mpirun
from layouts import VOCAB

MODEL = ["--hidden", "32", "--layers", "4", "--heads", "4", "--kv-heads", "4", "--seq-len", "16",
         "--global-batch-size", "8", "--micro-batch-size", "1", "--vocab-size", str(VOCAB),
         "--backend", "numpy", "--log-every", "0", "--dtype", "float64"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """3 steps of pp 2 x dp 2, saved asynchronously every step, steps 2-3 traced."""
    tmp = tmp_path_factory.mktemp("trace")
    data = tmp / "samples.npy"
    np.save(data, np.random.default_rng(3).integers(0, VOCAB, size=(64, 17)))
    proc = subprocess.run([*mpirun(4), sys.executable, "-m", "mpipar.train", *MODEL, "--data",
                           str(data), "--run-dir", str(tmp / "run"), "--pp", "2", "--dp", "2",
                           "--steps", "3", "--save-every", "1", "--async-save",
                           "--save-dir", str(tmp / "ck"), "--trace-steps", "2-3"],
                          capture_output=True, text=True, timeout=180, env=launch_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp / "run" / "trace.json") as fh:
        trace = json.load(fh)
    with open(tmp / "run" / "timeline.json") as fh:
        timeline = json.load(fh)
    return trace["traceEvents"], timeline


@needs_mpirun
def test_four_processes_named_by_their_coordinates(traced):
    events, timeline = traced
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    coords = {r["rank"]: r["coord"] for r in timeline["ranks"]}
    assert sorted(names) == [0, 1, 2, 3]
    for pid, name in names.items():
        c = coords[pid]
        assert name == f"rank {pid} (dp {c['dp']}, tp {c['tp']}, pp {c['pp']}, sp {c['sp']})"
    assert sorted((c["dp"], c["pp"]) for c in coords.values()) == [(0, 0), (0, 1), (1, 0),
                                                                   (1, 1)]


@needs_mpirun
def test_each_thread_is_ordered_and_never_overlaps(traced):
    events, _ = traced
    threads = collections.defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            threads[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    assert {pid for pid, _ in threads} == {0, 1, 2, 3}
    for key, spans in threads.items():
        assert spans == sorted(spans), key
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:])), key


@needs_mpirun
def test_sends_match_receives_and_the_timeline_is_folded_in(traced):
    """The ledger's sends and receives (thread 2) and the pipeline's message ops (thread 1)
    pair up in count; each rank's pipeline ops of the last traced step are timeline.json's;
    collectives name their group; two steps, their checkpoint I/O and memory counters."""
    events, timeline = traced
    count = collections.Counter((e["tid"], e["name"]) for e in events if e["ph"] == "X")
    assert count[(2, "send")] == count[(2, "recv")] == 2 * 2 * 2 * 4  # steps x ranks x fwd/bwd x mb
    assert count[(1, "send_fwd")] == count[(1, "recv_fwd")] == 2 * 2 * 4
    assert count[(1, "send_bwd")] == count[(1, "recv_bwd")] == 2 * 2 * 4
    assert {e["args"]["group"] for e in events if e["name"] == "allreduce"} >= {"dp_sp"}
    for row in timeline["ranks"]:
        mine = [e for e in events if e["pid"] == row["rank"]]
        step3 = next(e for e in mine if e["name"] == "step 3")
        ops = [[e["name"], e["args"]["microbatch"], e["args"]["chunk"]] for e in mine
               if e["ph"] == "X" and e["tid"] == 1 and e["ts"] >= step3["ts"]]
        assert ops == [op[:3] for op in row["ops"]]
        assert [e["name"] for e in mine if e["ph"] == "X" and e["tid"] == 0] == ["step 2",
                                                                                 "step 3"]
        memory = [e for e in mine if e["ph"] == "C"]
        assert len(memory) == 2 and all(e["args"]["resident_bytes"] > 0 for e in memory)
        io = [e["name"].split()[1] for e in mine if e["ph"] == "X" and e["tid"] == 3]
        assert "copy" in io and "commit" in io
    assert count[(4, "checkpoint write step_00000002")] >= 1  # on some writing rank
