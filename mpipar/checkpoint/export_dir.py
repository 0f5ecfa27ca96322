"""An export directory that appears complete or not at all.

:func:`publish` has the files written into a temporary directory beside the target, gives them
the modes the umask allows, syncs them, and renames the directory into place. An existing target
(which the caller has checked may be replaced) is renamed to ``.NAME.old-PID`` beside it first
and removed once the new one is in place: a crash between the two renames leaves the old export
under that hidden name.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def publish(dst: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` to fill a temporary directory beside ``dst``, then make it ``dst``
    (module docstring); on any failure the temporary directory is removed and ``dst`` is as
    it was."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.resolve().parent))
    try:
        write(tmp)
        mask = _umask()  # mkdtemp makes 0700 and safetensors 0600: give what the umask allows
        os.chmod(tmp, 0o777 & ~mask)
        for name in sorted(os.listdir(tmp)):
            os.chmod(tmp / name, 0o666 & ~mask)
            with open(tmp / name, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.rename(dst, old)
        os.rename(tmp, dst)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    """The process's file-mode creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
