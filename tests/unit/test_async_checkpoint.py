"""Asynchronous checkpoints on one rank, in process (COMM_SELF): the background write holds the
state of its step while training changes the live one, equals a synchronous save, commits only
at finish(), and failure reports name a write in flight. Launched runs (a SIGKILL during the
write, sync against async bit for bit): e2e/test_async_checkpoint.py."""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest

from layouts import small_config, token_source
from mpipar.checkpoint import directory, reader, writer
from mpipar.checkpoint.background import AsyncSaver
from mpipar.checkpoint.index import KINDS
from mpipar.config import ConfigError, trace_step_set
from mpipar.rules import validate
from mpipar.runtime.comm import Group, Ledger, Watchdog
from mpipar.runtime.device import host_copy
from mpipar.training import step as trainer


def _rank():
    from mpi4py import MPI


    from mpipar.training.rank import build_rank
    cfg = validate(small_config(), 1)
    return build_rank(cfg, MPI.COMM_SELF, source=token_source())


def test_background_write_holds_its_step_while_training_goes_on(tmp_path, monkeypatch):
    """Save step 1 asynchronously, with the shard writer held until step 2 has trained (the
    live parameters and moments have changed): the committed checkpoint equals a synchronous
    save of step 1 tensor for tensor, `latest` moves only at finish(), and the blocking wait of
    finish() is in the ledger while it lasts, where the collective watchdog names it."""
    rank = _rank()
    group = Group(rank.comms.grid.comm, "world", Ledger())
    trainer.train_step(rank, 0)
    writer.save(rank.state, trainer.run_position(rank, 1), tmp_path / "sync", group)
    release, real = threading.Event(), writer._write_shard
    monkeypatch.setattr(writer, "_write_shard",
                        lambda *a: (release.wait(30), real(*a))[1])
    saver = AsyncSaver(group=group, save_dir=str(tmp_path / "async"), keep_last=0,
                       copy=host_copy)
    saver.start(rank.state, trainer.run_position(rank, 1))
    before = {n: p.copy() for n, p in rank.params.items()}
    trainer.train_step(rank, 1)  # changes every parameter while the write waits
    assert any(not np.array_equal(before[n], p) for n, p in rank.params.items())
    assert saver.writing() and directory.latest(tmp_path / "async") is None
    assert "step 1 was in flight" in saver.describe() and "still being written" in saver.describe()
    seen, watchdog = [], Watchdog([group.ledger], 5.0, 0, lambda message: None)
    threading.Timer(0.3, lambda: (seen.append(group.ledger.in_flight),
                                  seen.append(watchdog.stuck(time.monotonic() + 60)),
                                  release.set())).start()
    path = saver.finish()
    assert seen[0][:2] == ("checkpoint", "wait for the background write of step_00000001")
    assert "wait for the background write of step_00000001 on group 'checkpoint'" in seen[1]
    assert group.ledger.in_flight is None and saver.describe() is None
    assert path == tmp_path / "async" / "step_00000001" == directory.latest(tmp_path / "async")
    assert reader.verify(path) == []
    for kind in KINDS:
        want = reader.read_tensors(tmp_path / "sync" / "step_00000001", kind)
        got = reader.read_tensors(path, kind)
        assert set(got) == set(want)
        for name in want:
            assert np.array_equal(got[name], want[name]), (kind, name)
    assert [s[0].split()[1] for s in saver.spans] == ["copy", "write", "wait", "commit"]


def test_failure_report_names_the_write_in_flight(tmp_path):
    from mpi4py import MPI

    from mpipar.training.failure import FailureReport
    report = FailureReport(MPI.COMM_SELF)
    report.attach(str(tmp_path), fresh=True)
    report.record("exception", "first", 1)
    report.in_flight = lambda: "an asynchronous checkpoint save of step 4 was in flight"
    lines = report.record("watchdog", "second", 4)
    assert "in_flight" not in lines[0]
    assert lines[1]["in_flight"] == "an asynchronous checkpoint save of step 4 was in flight"
    assert json.load(open(os.path.join(tmp_path, "summary.json")))["failures"][1] == lines[1]


def test_host_copy_is_a_copy():
    a = np.arange(6.0)
    b = host_copy(a[2:5])
    a[:] = -1
    assert b.tolist() == [2.0, 3.0, 4.0] and b.flags.c_contiguous


@pytest.mark.parametrize("spec,steps", [("", set()), ("0", set()), ("3", {1, 2, 3}),
                                        ("4-6", {4, 5, 6}), ("2,5-6,9", {2, 5, 6, 9})])
def test_trace_steps(spec, steps):
    assert {s for s in range(20) if s in trace_step_set(spec)} == steps


@pytest.mark.parametrize("spec", ["x", "3-1", "0-2", "1,,2", "-2", "2-"])
def test_bad_trace_steps_are_refused_naming_the_value(spec):
    cfg = small_config()
    cfg.train.trace_steps = spec
    with pytest.raises(ConfigError, match=f"train.trace_steps={spec!r}"):
        validate(cfg, 1)
