"""TensorBoard event files, written directly: no TensorFlow, PyTorch or protobuf at run time.

An event file is a sequence of TFRecords (length, masked CRC-32C of the length, data, masked
CRC-32C of the data), each holding one serialized ``tensorflow.Event`` protocol buffer. The first
event names the format (``file_version: "brain.Event:2"``); each later one carries a step, a wall
time and a ``Summary`` of ``simple_value`` scalars (float32, as TensorBoard stores scalars).
The few fields used are encoded by hand below (proto field numbers from TensorBoard's
``event.proto`` and ``summary.proto``).

:class:`EventWriter` takes any flat ``{tag: number}`` dict per step; :func:`scalars` flattens a
``metrics.jsonl`` record into one (``time/compute``, ``comm_bytes/tp``, ``memory_bytes/rank_3``).
``--tensorboard DIR`` picks the directory (:func:`log_dir`); view it with
``tensorboard --logdir DIR`` (``pip install 'mpipar[tensorboard]'``). Each step's event is
flushed to the file before :meth:`EventWriter.add_scalars` returns.

Why not a maintained writer (measured with a 51-number metrics record, one a step): tensorboardX
imports PyTorch whenever it is importable (its ``writer`` module tries ``import torch``): rank 0
of every run where PyTorch is installed (the tests' environment) starts 1.6-6.6 s later with
190 MiB more, PyTorch in the run; without PyTorch its import takes 150-330 ms, this one 8-28 ms.
Its ``add_scalar`` per number costs 4-10 ms a step, this writer 0.3-0.8 ms, and its ``flush()``
does not wait for its queue (no step's event was in the file when it returned). TensorBoard's
own ``EventFileWriter`` costs the same per step as this one but imports TensorFlow when that is
installed (``tensorboard.compat.tf``). The tests read these files with TensorBoard's reader.
"""
from __future__ import annotations

import importlib.util
import math
import os
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

OFF = "off"
"""The ``--tensorboard`` value that writes no events."""


# ---------------------------------------------------------------------------------------------
# framing: TFRecord with masked CRC-32C

def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `data`."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 bits, add 0xA282EAD8 (mod 2**32)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """`data` framed as one TFRecord."""
    header = struct.pack("<Q", len(data))
    return (header + struct.pack("<I", masked_crc32c(header)) + data
            + struct.pack("<I", masked_crc32c(data)))


# ---------------------------------------------------------------------------------------------
# protocol buffers: Event { double wall_time = 1; int64 step = 2; string file_version = 3;
# Summary summary = 5; }  Summary { repeated Value value = 1; }
# Summary.Value { string tag = 1; float simple_value = 2; }

def _varint(n: int) -> bytes:
    out = bytearray()
    n &= 0xFFFFFFFFFFFFFFFF  # int64 two's complement
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


_FLOAT32_MAX = 3.4028234663852886e38


def _scalar_value(tag: str, value: float) -> bytes:
    """A Summary.Value; magnitudes beyond float32 become +-inf (as a float32 cast does)."""
    value = float(value)
    if abs(value) > _FLOAT32_MAX and math.isfinite(value):
        value = math.copysign(math.inf, value)
    return _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value)


def event(wall_time: float, step: int = 0, file_version: str | None = None,
          values: Mapping[str, float] | None = None) -> bytes:
    """One serialized Event: the file version, or a step's scalar summary."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    if step:
        out += _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if values is not None:
        summary = b"".join(_bytes_field(1, _scalar_value(t, v)) for t, v in values.items())
        out += _bytes_field(5, summary)
    return out


# ---------------------------------------------------------------------------------------------
# the writer

def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a (nested) record as ``{tag: value}``: dict keys and list indices join
    with '/' (lists as ``rank_I``: the per-rank lists of metrics.jsonl); booleans count as 0/1;
    ``step`` and non-numbers are left out."""
    out: dict[str, float] = {}
    items = (record.items() if isinstance(record, Mapping)
             else ((f"rank_{i}", v) for i, v in enumerate(record)))
    for key, value in items:
        tag = f"{prefix}{key}"
        if isinstance(value, (Mapping, list, tuple)):
            out.update(scalars(value, tag + "/"))
        elif isinstance(value, (int, float)) and tag != "step":
            out[tag] = float(value)
    return out


class EventWriter:
    """Appends scalar summaries to a new event file in `log_dir` (created if needed)."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.0"
        self.path = os.path.join(log_dir, name)
        self._fh = open(self.path, "ab")
        self._fh.write(record(event(now, file_version="brain.Event:2")))
        self._fh.flush()

    def add_scalars(self, step: int, values: Mapping[str, float],
                    wall_time: float | None = None) -> None:
        """Write `values` (a flat ``{tag: number}``) as the scalars of `step`; flushed."""
        self._fh.write(record(event(time.time() if wall_time is None else wall_time, step,
                                    values=values)))
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def installed() -> bool:
    """Whether the ``tensorboard`` package (the ``[tensorboard]`` extra) is importable."""
    return importlib.util.find_spec("tensorboard") is not None


def log_dir(setting: str, run_dir: str) -> str | None:
    """The event directory of ``--tensorboard setting``: the directory given; '' means
    ``RUN_DIR/tensorboard`` when the ``[tensorboard]`` extra is installed, else none; 'off'
    means none."""
    if setting == OFF:
        return None
    if setting:
        return setting
    return os.path.join(run_dir, "tensorboard") if installed() else None
