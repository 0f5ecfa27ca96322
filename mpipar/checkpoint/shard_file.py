"""The file a checkpoint shard is written through: its space reserved first, and an I/O error
kept from HDF5.

HDF5 handles a failed write badly: the library leaves the file half-closed, h5py reports the
error again from every object destructor (through ``sys.excepthook``, which a run turns into an
abort of every rank), and the process crashes at exit when the library shuts down with the
file still open. So a shard is written through :class:`ShardFile`, a file object for h5py's
``fileobj`` driver that never raises to HDF5: the first failed write (a full disk, a quota, a
file-size limit) is kept in :attr:`ShardFile.error`, later writes are dropped, and the writer
raises the error once the file is closed, then removes the worthless file.

Before HDF5 writes anything, :meth:`ShardFile.reserve` asks the filesystem for the shard's
blocks (``fallocate`` without changing the size): on a disk without room the save fails there,
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


class ShardFile(io.RawIOBase):
    """A new file at ``path`` for h5py's ``fileobj`` driver (module docstring)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._raw = open(path, "w+b", buffering=0)
        self.error: OSError | None = None

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

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._raw.seek(pos, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def readinto(self, buffer) -> int:
        return self._raw.readinto(buffer)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._kept(self._write_all, view)
        return len(view)

    def _write_all(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            done += self._raw.write(view[done:])

    def truncate(self, size: int | None = None) -> int:
        return self._kept(self._raw.truncate, size, default=size or 0)

    def flush(self) -> None:
        if not self._raw.closed:
            self._kept(self._raw.flush)

    def close(self) -> None:
        """Close the file; the first error of its writes stays in :attr:`error`."""
        if not self.closed:
            self._kept(os.fsync, self._raw.fileno())
            self._raw.close()
        super().close()
