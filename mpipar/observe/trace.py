"""``--trace-steps``: the chosen steps of every rank as one timeline, ``RUN_DIR/trace.json`` in
the Chrome trace event format (ui.perfetto.dev, chrome://tracing).

Nothing is timed twice: the events come from where the run already takes its times.

- **pipeline** (thread 1): the step's op records of the pipeline executor (compute ops ``fwd``,
  ``bwd``, ``bwd_input``, ``bwd_weight`` and the message ops ``send_fwd``, ``recv_fwd``,
  ``send_bwd``, ``recv_bwd``): what ``timeline.json`` holds for the last step;
- **communication** (thread 2): every call the groups' ledgers book (:class:`~mpipar.runtime.
  ledger.Ledger` with a ``trace`` list): collectives, sends and receives, object collectives,
  named ``op`` with ``args.group`` and ``args.bytes``. A blocking call is the time it blocked;
  a non-blocking one (``iallgather``, the ``send`` and ``recv`` of the pipeline) the time its
  ``wait`` and ``test`` calls blocked, ending when it completed (and starting no earlier than
  the call before it ended);
- **checkpoint** (thread 3: the main thread's copy, wait, commit or synchronous save) and
  **checkpoint writer** (thread 4: ``--async-save``'s background write);
- **steps** (thread 0): each traced step from its start to the start of the next (its record,
  the all-gather of metrics, its save included);
- a **memory** counter per rank (resident and peak bytes) at the end of each traced step;
- **recovery** (thread 0, ``--on-rank-failure shrink``): each rank failure the survivors went
  through, from its detection to the rebuilt rank, its args the ``recovered`` record of
  ``metrics.jsonl`` (failed ranks, step, layouts, seconds, steps redone, the state's source).
  The trace is written (again) with it after the last traced step, or after the next step once
  that is past (the steps redone traced again when chosen), without the events of the ranks
  lost.

Every rank is a process (``pid`` = world rank) named with its coordinates. Each rank converts
its ``time.perf_counter()`` times to the wall clock; rank 0 puts zero at the earliest event
(ranks of one node share the clock; across nodes the offset is as good as their clock
synchronisation). The events stay on their rank until the last traced step; then one
``gather_object`` over the control group brings them to rank 0, which writes the file.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from mpipar.config import StepRanges
from mpipar.runtime.comm import Group, Ledger

THREADS = {0: "steps", 1: "pipeline", 2: "communication", 3: "checkpoint",
           4: "checkpoint writer"}
SPAN_THREADS = {"main": 3, "checkpoint": 4}
"""The thread a checkpoint span ``(what, thread, start, end)`` goes to."""
TRACE_FILE = "trace.json"


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Tracer:
    """One rank's events of the ``steps`` it traces (see the module docstring): ``ledgers`` are
    the ledgers whose calls it records, ``spans`` the list the checkpoint code appends its
    ``(what, thread, start, end)`` spans to."""

    def __init__(self, *, steps: StepRanges, group: Group, coord: dict[str, int],
                 ledgers: list[Ledger], spans: list, run_dir: str) -> None:
        self.steps, self.group, self.coord, self.run_dir = steps, group, coord, run_dir
        self.ledgers, self.spans = ledgers, spans
        self.last = steps.last
        self.events: list[dict[str, Any]] = []
        self.written, self.traced = not steps, False
        self._step, self._start, self._calls = 0, 0.0, []

    def begin(self, step: int) -> None:
        """Step ``step`` (1-based) is about to run: record its calls when it is traced."""
        self._close(time.perf_counter())
        if step in self.steps and not self.written:
            self._step, self._start, self._calls = step, time.perf_counter(), []
            self.traced = True
            for ledger in self.ledgers:
                ledger.trace = self._calls

    def pipeline(self, executor) -> None:
        """The traced step's op records (call after the engine's step)."""
        if self._step:
            for r in executor.timeline:
                self._add(r.kind, 1, executor.started + r.start, executor.started + r.end,
                          {"microbatch": r.microbatch, "chunk": r.chunk})

    def end(self, step: int) -> None:
        """After step ``step``'s record and save: write the trace after the last traced step
        (collective over the group: every rank calls it at the same step)."""
        if not self.written and step >= self.last:
            self._close(time.perf_counter())
            if self.traced:  # the same on every rank: they run the same steps
                self.write()
            self.written = True

    def recovered(self, group: Group, ledgers: list[Ledger], coord: dict[str, int],
                  start: float, end: float, record: dict[str, Any]) -> None:
        """The survivors of a rank failure go on over ``group`` with the rebuilt rank's
        ``ledgers`` and ``coord``: the recovery becomes a span (``start``..``end``,
        ``time.perf_counter()`` seconds; ``record`` its args), and the trace is written (again)
        at the end of the last traced step, or of the next step once that is past. No
        collective."""
        self._close(time.perf_counter())
        self.group, self.ledgers, self.coord = group, ledgers, coord
        self._add(f"recovery: rank(s) {record['failed_ranks']} lost", 0, start, end,
                  dict(record))
        self.traced, self.written = True, False

    def _close(self, now: float) -> None:
        """Finish the step being traced: its span, calls, checkpoint spans and memory."""
        if not self._step:
            return
        for ledger in self.ledgers:
            ledger.trace = None
        n = len(self.spans)  # the writer thread may append meanwhile: keep what comes later
        spans = self.spans[:n]
        del self.spans[:n]
        self._add(f"step {self._step}", 0, self._start, now, {"step": self._step})
        for group, op, start, end, nbytes in self._calls:
            self._add(op, 2, start, end, {"group": group, "bytes": nbytes})
        for what, thread, start, end in spans:
            if end >= self._start:  # overlapping the step: a write begun before it too
                self._add(what, SPAN_THREADS.get(thread, 3), start, end, {})
        self.events.append({"ph": "C", "name": "memory", "ts": now,
                            "args": {"resident_bytes": resident_bytes(),
                                     "peak_bytes": _peak_bytes()}})
        self._step = 0

    def _add(self, name: str, tid: int, start: float, end: float, args: dict) -> None:
        self.events.append({"ph": "X", "name": name, "tid": tid, "ts": start,
                            "dur": max(0.0, end - start), "args": args})

    def write(self) -> None:
        """Gather every rank's events to rank 0 (collective), which writes ``trace.json``."""
        self.written = True
        offset = time.time() - time.perf_counter()
        mine = {"rank": self.group.rank, "coord": self.coord, "offset": offset,
                "events": self.events}
        rows = self.group.gather_object(mine, root=0)
        if rows is not None:
            write_trace(os.path.join(self.run_dir, TRACE_FILE), chrome_trace(rows))


def _peak_bytes() -> int:
    from mpipar.observe.metrics import peak_memory_bytes
    return peak_memory_bytes()


def chrome_trace(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome trace of every rank's ``rows`` (``rank``, ``coord``, ``offset`` from its
    perf_counter to the wall clock, ``events`` in perf_counter seconds): microseconds from the
    earliest event, one process per rank with named threads, and each thread's complete events
    in order, none starting before the previous one ended."""
    stamped = [(r, [dict(e, ts=e["ts"] + r["offset"]) for e in r["events"]]) for r in rows]
    zero = min((e["ts"] for _, events in stamped for e in events), default=0.0)
    out: list[dict[str, Any]] = []
    for row, events in stamped:
        pid = row["rank"]
        where = ", ".join(f"{k} {v}" for k, v in row["coord"].items())
        out.append({"ph": "M", "name": "process_name", "pid": pid,
                    "args": {"name": f"rank {pid} ({where})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid,
                    "args": {"sort_index": pid}})
        for tid, name in THREADS.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                        "args": {"name": name}})
        ends: dict[int, float] = {}
        for e in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
            e = dict(e, pid=pid, ts=(e["ts"] - zero) * 1e6)
            if e["ph"] == "X":
                end = e["ts"] + e["dur"] * 1e6
                e["ts"] = max(e["ts"], ends.get(e["tid"], 0.0))
                e["dur"] = max(0.0, end - e["ts"])
                ends[e["tid"]] = e["ts"] + e["dur"]
            out.append(e)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_trace(path: str, trace: dict[str, Any]) -> None:
    """Write ``trace`` through a temporary file and a rename."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(trace, fh)
    os.replace(tmp, path)
