"""The file HDF5 writes through (h5py's ``fileobj`` driver): its space reserved first, and an
I/O error kept from the library.

HDF5 handles a failed write badly: the library leaves the file half-closed (its close flushes
the caches again and fails again), h5py reports the error again from every object destructor
(through ``sys.excepthook``, which a run turns into an abort of every rank), and the process
crashes at exit when the library shuts down with the file still open. So every HDF5 file mpipar
writes (a checkpoint shard, a prepared token file) goes through :class:`HDF5Sink`, a file object
that never raises to HDF5: the first failed write (a full disk, a quota, a file-size limit) is
kept in :attr:`HDF5Sink.error`, later writes are dropped, HDF5 closes the file normally, and the
writer raises the error once the sink is closed, then removes the worthless file.

Before HDF5 writes anything, :meth:`HDF5Sink.reserve` can ask the filesystem for the file's
blocks (``fallocate`` without changing the size): on a disk without room the write fails there,
cleanly, and ranks that write to one filesystem at once cannot each see room that only one of
them gets. Where the filesystem cannot reserve, the writes find out, as above.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import io
import os
from pathlib import Path

FALLOC_FL_KEEP_SIZE = 1
"""Linux ``fallocate`` mode: allocate blocks past the end without changing the file's size."""

FULL = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a filesystem without room (for this user)."""


def _fallocate():
    """libc's ``fallocate`` (Linux), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


_FALLOCATE = _fallocate()


class HDF5Sink(io.RawIOBase):
    """A file for h5py's ``fileobj`` driver that keeps its first OSError (module docstring).
    ``raw``: the file, unbuffered, open for reading and writing; ``path``: its name, for
    errors. :meth:`create` opens a new file by name."""

    def __init__(self, raw: io.FileIO, path: str | os.PathLike) -> None:
        super().__init__()
        self._raw = raw
        self.path = Path(path)
        self.error: OSError | None = None

    @classmethod
    def create(cls, path: str | os.PathLike) -> HDF5Sink:
        """A new (or emptied) file at ``path``."""
        return cls(open(path, "w+b", buffering=0), path)

    def reserve(self, nbytes: int) -> None:
        """Allocate ``nbytes`` for the file before it is written (the size stays 0). Raises
        OSError (ENOSPC) when the filesystem has not the room; a filesystem that cannot
        reserve is left to the writes."""
        if _FALLOCATE is None or nbytes <= 0:
            return
        if _FALLOCATE(self._raw.fileno(), FALLOC_FL_KEEP_SIZE, 0, nbytes) != 0:
            code = ctypes.get_errno()
            if code in FULL:
                raise OSError(code, os.strerror(code), str(self.path))

    def _kept(self, call, *args, default=None):
        """``call(*args)``, its OSError kept as :attr:`error` (the first), ``default`` then."""
        if self.error is not None:
            return default
        try:
            return call(*args)
        except OSError as exc:
            self.error = exc
            return default

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        return self._raw.seek(pos, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def readinto(self, buffer) -> int:
        return self._raw.readinto(buffer)

    def write(self, data) -> int:
        """Write all of ``data``; after a failure, reported as written (the position moves on)
        and dropped."""
        view = memoryview(data).cast("B")
        if self.error is not None or self._kept(self._write_all, view, default=False) is False:
            self._raw.seek(len(view), os.SEEK_CUR)
        return len(view)

    def _write_all(self, view: memoryview) -> bool:
        done = 0
        while done < len(view):  # FileIO writes may be partial
            done += self._raw.write(view[done:])
        return True

    def truncate(self, size: int | None = None) -> int:
        return self._kept(self._raw.truncate, size,
                          default=self.tell() if size is None else size)

    def flush(self) -> None:
        pass  # the file is unbuffered

    def close(self) -> None:
        """fsync and close the file; the first error of its writes (or of the fsync) stays in
        :attr:`error`."""
        if not self.closed:
            self._kept(os.fsync, self._raw.fileno())
            self._raw.close()
        super().close()
