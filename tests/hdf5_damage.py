"""Damage to an HDF5 file's stored data, as a failing disk or a bad copy leaves it: shared by the
checkpoint and token data tests."""
from __future__ import annotations

import h5py


def invert_chunk_bytes(path, dataset: str, chunk: int = 0, skip: int = 8, count: int = 8) -> None:
    """Invert ``count`` bytes, ``skip`` bytes into stored chunk ``chunk`` of ``dataset`` of the
    HDF5 file ``path``: the file still opens, the chunk's checksum no longer matches."""
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_chunk_info(chunk).byte_offset
    with open(path, "r+b") as fh:
        fh.seek(offset + skip)
        data = fh.read(count)
        fh.seek(offset + skip)
        fh.write(bytes(b ^ 0xFF for b in data))
