"""The Chrome trace events of ``--trace-steps`` (:mod:`mpipar.observe.trace`) without a launch:
a ledger records its calls only while traced, and rank rows become one timeline (metadata,
microseconds from the earliest event, threads ordered and never overlapping). A launched
4-rank run: e2e/test_trace.py."""
from __future__ import annotations

from mpipar.observe.trace import chrome_trace
from mpipar.runtime.comm import Ledger


def test_a_ledger_records_calls_only_while_traced():
    ledger = Ledger()
    ledger.add("dp_sp", "allreduce", 64, 0.5)
    calls = ledger.trace = []
    ledger.add("pp", "send", 32, 0.25)
    ledger.trace = None
    ledger.add("pp", "recv", 0, 0.1)
    assert len(calls) == 1
    group, op, start, end, nbytes = calls[0]
    assert (group, op, nbytes) == ("pp", "send", 32) and abs(end - start - 0.25) < 1e-9
    assert ledger.entries[("dp_sp", "allreduce")].messages == 1  # the books are unchanged


def test_rank_rows_become_one_timeline():
    """Two ranks whose perf_counter clocks differ by their offsets: times in microseconds from
    the earliest event on the shared wall clock; a later event starting inside an earlier one
    of its thread starts where that one ends; counters keep their place."""
    rows = [
        {"rank": 1, "coord": {"dp": 1, "pp": 0}, "offset": 100.0,
         "events": [{"ph": "X", "name": "fwd", "tid": 1, "ts": 2.0, "dur": 0.5, "args": {}},
                    {"ph": "C", "name": "memory", "ts": 2.5, "args": {"resident_bytes": 7}}]},
        {"rank": 0, "coord": {"dp": 0, "pp": 0}, "offset": 50.0,
         "events": [{"ph": "X", "name": "recv", "tid": 2, "ts": 51.0, "dur": 1.0, "args": {}},
                    {"ph": "X", "name": "send", "tid": 2, "ts": 51.5, "dur": 1.0, "args": {}},
                    {"ph": "X", "name": "fwd", "tid": 1, "ts": 51.2, "dur": 0.1, "args": {}}]},
    ]
    events = chrome_trace(rows)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "rank 1 (dp 1, pp 0)", 0: "rank 0 (dp 0, pp 0)"}
    x = {(e["pid"], e["name"]): (e["ts"], e["dur"]) for e in events if e["ph"] == "X"}
    assert x[(0, "recv")] == (0.0, 1e6)                      # the earliest event: 101 s
    assert x[(0, "send")] == (1e6, 0.5e6)                    # clipped to the recv's end
    assert abs(x[(1, "fwd")][0] - 1e6) < 1e-3 and abs(x[(0, "fwd")][0] - 0.2e6) < 1e-3
    counter = next(e for e in events if e["ph"] == "C")
    assert counter["pid"] == 1 and abs(counter["ts"] - 1.5e6) < 1e-3
    threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert len(threads) == 10
