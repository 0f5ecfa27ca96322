"""The save directory: what its files are called, how they are made durable, which one is latest.

A save directory holds one directory per checkpoint and a pointer to the newest::

    SAVE_DIR/
      latest                  "step_00000200\\n": the newest committed checkpoint
      step_00000200/
        shard_00000.h5        one file per world rank that owns unique state
        shard_00002.h5
        index.h5              global tensors as virtual datasets + config, layout, positions
        index.sha256          sha256 of index.h5
      .step_00000300.tmp/     a save in progress, or one a crash interrupted: never read

:mod:`.writer` fills it, :mod:`.index` defines ``index.h5``, :mod:`.reader` verifies and reads a
checkpoint. Everything here is plain file handling: no HDF5, no collective.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

INDEX = "index.h5"
INDEX_SUM = "index.sha256"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{8,})$")
SHARD_FILE = re.compile(r"^shard_\d{5,}\.h5$")
"""The only names a shard may have: plain names inside the checkpoint directory."""
_HASH_BLOCK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, malformed, or does not fit the model; the
    message names the file and the field or dataset at fault."""


def step_dir_name(step: int) -> str:
    """``step_NNNNNNNN`` (8 digits, more when needed)."""
    return f"step_{step:08d}"


def shard_file_name(rank: int) -> str:
    """``shard_NNNNN.h5``: the shard world rank ``rank`` writes."""
    return f"shard_{rank:05d}.h5"


# ------------------------------------------------------------------------------ files
def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    """Flush a written file to the disk."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, new files) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def require_own_file(file: Path) -> None:
    """Refuse a checkpoint file that is a symbolic link: what a checkpoint makes mpipar read lies
    inside its directory, whatever its files claim."""
    if file.is_symlink():
        raise CheckpointError(f"{file}: a symbolic link (to {os.readlink(file)}); a checkpoint's "
                              f"files must lie inside its directory")


# ------------------------------------------------------------------------------ the directory
def require_own_dir(path: Path) -> Path:
    """Refuse a checkpoint directory that is a symbolic link: a checkpoint is read, resumed,
    pruned only where its save directory keeps it, like the files inside it."""
    if path.is_symlink():
        raise CheckpointError(f"{path}: a symbolic link (to {os.readlink(path)}); a checkpoint "
                              f"directory must lie inside its save directory, not be a link")
    return path


def list_checkpoints(save_dir: str | os.PathLike) -> list[Path]:
    """Committed checkpoint directories of ``save_dir``, newest (highest step) first; a
    ``step_N`` that is a symbolic link is none (never followed, never pruned)."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()]
    return [p for _, p in sorted(found, reverse=True)]


def latest(save_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``save_dir/latest`` names, or None when there is no such file. A pointer
    that is not a checkpoint name (binary, not UTF-8, empty) raises CheckpointError naming it."""
    pointer = Path(save_dir) / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer}: unreadable ({exc}); it should hold the name of a "
                              f"checkpoint directory such as step_00000001") from None
    if not STEP_DIR.match(name):
        raise CheckpointError(f"{pointer}: holds {name[:40]!r}, not the name of a checkpoint "
                              f"directory such as step_00000001")
    return Path(save_dir) / name


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at ``name``, atomically (a temporary file renamed over it)."""
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def prune(root: Path, keep_last: int, keep: str) -> None:
    """Remove what interrupted saves left behind and all but the newest ``keep_last`` committed
    checkpoints (never ``keep``, the one just committed)."""
    for p in root.iterdir():
        if p.name.startswith(".step_") and p.name.endswith((".tmp", ".old")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(f".{LATEST}.tmp-") and p.is_file():
            p.unlink(missing_ok=True)
    if keep_last > 0:
        for p in list_checkpoints(root)[keep_last:]:
            if p.name != keep:
                shutil.rmtree(p)


def resolve_path(spec: str | os.PathLike) -> Path:
    """A checkpoint directory from ``spec``: the directory itself, a save directory (its
    ``latest``) or a save directory's ``latest`` file; CheckpointError when that checkpoint
    directory is a symbolic link (:func:`require_own_dir`)."""
    p = Path(spec)
    if p.name == LATEST and p.is_file():
        return require_own_dir(latest(p.parent) or p)
    if not (p / INDEX).exists() and not STEP_DIR.match(p.name):
        target = latest(p)
        if target is not None:
            return require_own_dir(target)
    return require_own_dir(p)


def require_outside(out: Path) -> None:
    """Refuse an output path inside a checkpoint directory (or a save directory's ``latest``):
    writing there would change, and break, what the index and its checksums describe."""
    target = out.resolve()
    inside = next((d for d in target.parents if (d / INDEX).is_file() or STEP_DIR.match(d.name)),
                  None)
    if inside is None and (target / INDEX).is_file():
        inside = target
    if inside is not None:
        raise CheckpointError(f"{out}: inside the checkpoint {inside}; writing there would "
                              f"change what its index records; choose a path outside it")
    if target.name == LATEST and list_checkpoints(target.parent):
        raise CheckpointError(f"{out}: the 'latest' pointer of the save directory "
                              f"{target.parent}; choose another path")
