"""`python -m mpipar.data prepare`'s output: an HDF5 token file, complete under its name or not
there at all; and the byte-token prepare (:func:`prepare_tokens`; the tokenizer's is
:func:`mpipar.data.tokenizer.prepare_tokenized`).

:func:`hdf5_output` writes through a temporary file of a unique name beside the output
(`.NAME.XXXXXXXX.tmp`), renamed over the output once complete and fsynced. Two prepares with the
same `--out` each write their own temporary file and remove only their own: the later rename
wins, and neither loses its work to the other.

A write that fails (a full disk, an I/O error) is an error naming `--out`. HDF5 cannot close a
file whose last writes failed (its close flushes the caches again and fails again; the file then
stays open, and a later teardown of the library crashes). So the file is written through
:class:`mpipar.runtime.hdf5_sink.HDF5Sink`, which takes over the descriptor: after the first
failed write it drops every later one, HDF5 closes the file normally, and the temporary file is
removed after it is closed.
"""
from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import h5py
import numpy as np

from mpipar.data.sources import H5_SUFFIXES, DataError
from mpipar.runtime.hdf5_sink import HDF5Sink


def output_file(out: str | os.PathLike) -> Path:
    """The output of a prepare: an HDF5 name (suffix `.h5` or `.hdf5`, which selects the
    reader) that is not a directory or other non-file, its directory created when missing.
    Raises DataError naming `--out`."""
    out = Path(out)
    if out.suffix.lower() not in H5_SUFFIXES:
        raise DataError(f"--out {out}: must end in .h5 or .hdf5 (the suffix selects the HDF5 "
                        f"reader)")
    if out.exists() and not out.is_file():
        raise DataError(f"--out {out}: exists and is not a regular file (a directory?); name the "
                        f"file to write")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        blocker = next((p for p in (out.parent, *out.parent.parents)
                        if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is not a directory" if blocker else err.strerror or err
        raise DataError(f"--out {out}: cannot be written ({why})") from None
    return out


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def hdf5_output(out: Path, **options) -> Iterator[tuple[h5py.File, HDF5Sink]]:
    """Yield (a new HDF5 file written in place of `out`, its sink) (module docstring): `out` is
    replaced by the complete file when the block ends without an error; otherwise nothing of
    this call remains (its own temporary file is closed, then removed). The writer checks
    :func:`check_written` after large writes to stop early on a full disk. `options` go to
    `h5py.File`. Raises DataError naming `--out` when the file cannot be created or written."""
    try:
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as err:
        raise DataError(f"--out {out}: cannot be written in {out.parent} "
                        f"({err.strerror or err})") from None
    sink = HDF5Sink(io.FileIO(fd, "r+"), name)
    try:
        try:
            with h5py.File(sink, "w", **options) as f:
                yield f, sink
        finally:
            sink.close()  # fsynced first
        check_written(sink, out)
        os.chmod(name, 0o666 & ~_umask())  # mkstemp creates 0600
        os.replace(name, out)
    except BaseException as exc:
        Path(name).unlink(missing_ok=True)
        if sink.error is not None and not isinstance(exc, DataError):
            raise DataError(f"--out {out}: cannot be written "
                            f"({sink.error.strerror or sink.error})") from None
        raise


def check_written(sink: HDF5Sink, out: Path) -> None:
    """Raise DataError naming `--out` when a write to `sink` has failed."""
    if sink.error is not None:
        raise DataError(f"--out {out}: cannot be written ({sink.error.strerror or sink.error})")


PREPARE_CHUNK_TOKENS = 1 << 20
"""HDF5 chunk length (tokens) of a prepared stream; shorter streams use one chunk."""


def prepare_tokens(paths: Sequence[str | os.PathLike], out: str | os.PathLike,
                   chunk_tokens: int = PREPARE_CHUNK_TOKENS) -> int:
    """Write the bytes of the files `paths`, concatenated in order, as byte tokens (vocabulary
    256) to the HDF5 file `out`: a 1-D uint8 dataset `tokens` `[num_bytes]`, chunked
    (`chunk_tokens` per chunk) with the fletcher32 checksum, and attributes `files` (the paths)
    and `offsets` (int64 `[len(paths) + 1]`: file i is `tokens[offsets[i]:offsets[i + 1]]`).

    Files are streamed a chunk at a time into a temporary file of a unique name, renamed to
    `out` once complete (:func:`hdf5_output`), so `out` is either complete or
    untouched; its directory is created when missing. Returns the number of tokens. Raises
    DataError for no input, a path that is not a readable regular file (naming it), an output
    name the loader would not read as HDF5 (suffix `.h5` or `.hdf5`) or that is a directory, no
    bytes at all, or an output that cannot be written (naming `--out`).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise DataError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
    if not paths:
        raise DataError("prepare needs at least one text file")
    out = output_file(out)
    sizes = [_readable_size(path) for path in paths]
    total = sum(sizes)
    if total == 0:
        raise DataError(f"the inputs {', '.join(map(str, paths))} hold no bytes")
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    with hdf5_output(out) as (f, sink):
        d = f.create_dataset("tokens", shape=(total,), dtype=np.uint8,
                             chunks=(min(chunk_tokens, total),), fletcher32=True)
        for path, start in zip(paths, offsets):
            for at, block in _blocks(path, chunk_tokens):
                d[start + at:start + at + len(block)] = np.frombuffer(block, dtype=np.uint8)
                check_written(sink, out)
        f.attrs["files"] = [os.fspath(p) for p in paths]
        f.attrs["offsets"] = offsets
    return total


def _readable_size(path: str | os.PathLike) -> int:
    """The size of the input `path`, a regular file this process can open for reading."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"{path} is a directory; pass its files")
    if not p.exists():
        raise DataError(f"{path} does not exist")
    if not p.is_file():
        raise DataError(f"{path} is not a regular file")
    try:
        with open(p, "rb"):
            return p.stat().st_size
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None


def _blocks(path: str | os.PathLike, size: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of the file `path`, `size` bytes at a time; a read error names it."""
    at = 0
    try:
        with open(path, "rb") as fh:
            while block := fh.read(size):
                yield at, block
                at += len(block)
    except OSError as err:
        raise DataError(f"{path}: cannot be read at byte {at} ({err.strerror or err})") from None
