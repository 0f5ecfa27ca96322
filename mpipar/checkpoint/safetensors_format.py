"""The safetensors file format itself, for what safetensors' NumPy API cannot do: read a file's
header (where bfloat16 tensors' bytes lie, which :mod:`mpipar.checkpoint.huggingface` widens to
float32) and write a file holding ``ml_dtypes.bfloat16`` arrays.

A file is 8 bytes little-endian header length N, N bytes of JSON (per tensor its ``dtype`` code,
``shape`` and ``data_offsets`` relative to the start of the data; ``__metadata__``), then the
tensors' little-endian bytes back to back.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

SAFETENSORS_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}
"""The dtype code of each NumPy dtype an export writes."""


def read_header(file: Path) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header of ``file`` and the byte offset where tensor data begins.

    Layout: 8 bytes little-endian header length N, N bytes of JSON, then the data; each entry's
    ``data_offsets`` are relative to the start of the data.
    """
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), 8 + n


def header_bytes(entries: Iterable[tuple[str, np.dtype, tuple[int, ...], int]],
                 metadata: Mapping[str, str]) -> bytes:
    """A safetensors header for ``entries`` (name, dtype, shape, bytes) stored back to back:
    8 bytes little-endian length N, then N bytes of JSON (per tensor its ``dtype`` code,
    ``shape`` and ``data_offsets`` relative to the data; ``__metadata__``) padded with spaces
    to a multiple of 8."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    at = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": SAFETENSORS_DTYPES[np.dtype(dtype).name], "shape": list(shape),
                        "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(tensors: Mapping[str, np.ndarray], file: Path,
                      metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` as safetensors ``file`` directly (what bfloat16 needs): the header of
    :func:`header_bytes`, then the tensors' little-endian bytes back to back."""
    text = header_bytes(((n, a.dtype, a.shape, a.nbytes) for n, a in tensors.items()), metadata)
    with open(file, "wb") as fh:
        fh.write(text)
        for a in tensors.values():
            fh.write(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False)
                     .tobytes())
