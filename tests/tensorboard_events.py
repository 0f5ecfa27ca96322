"""Reading TensorBoard event files back with TensorBoard's own reader, and what they must hold
for metrics records: shared by the TensorBoard tests of the writer and of a run."""
from __future__ import annotations

import numpy as np
import pytest

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="reading event files back needs the tensorboard package "
           "(pip install 'mpipar[tensorboard]')")


def leaves(value, path: str = "") -> dict[str, float]:
    """Every number of a JSON value by its path (the reference for the tags), 'step' aside."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in leaves(item, path + key + "/").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value)
                for k, v in leaves(item, f"{path}rank_{i}/").items()}
    tag = path.rstrip("/")
    return {} if tag == "step" or isinstance(value, str) else {tag: float(value)}


def read_events(log_dir) -> event_accumulator.EventAccumulator:
    """The scalars of the event files in ``log_dir``, read by TensorBoard's own reader."""
    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def assert_events_hold(records: list[dict], acc) -> None:
    """Every number of every record is a scalar of ``acc`` at the record's step, as the float32
    TensorBoard stores."""
    tags = set(acc.Tags()["scalars"])
    for record in records:
        want = leaves(record)
        assert set(want) <= tags, sorted(set(want) - tags)
        for tag, value in want.items():
            got = [e.value for e in acc.Scalars(tag) if e.step == record["step"]]
            assert got == [float(np.float32(value))], (tag, record["step"], got, value)
