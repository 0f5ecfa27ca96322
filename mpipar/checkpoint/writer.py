"""Writing a checkpoint: every rank's shard, then (rank 0) the index, committed atomically.

**Shards.** Each rank writes its share of the unique state (:meth:`.shards.RankState.pieces`):
parameters once per (tp, pp) position (by dp = sp = 0), replicated tensors (the norm weights)
only by TP rank 0; AdamW moments from the same ranks without ZeRO, and under ZeRO-1 from every
rank of dp x sp for the slices it owns. A piece is a flat range of a local shard ``[rows,
cols]``; it is stored as rectangles of the global tensor (a partial first row, the full rows, a
partial last row), and vocabulary padding rows are dropped. A shard file holds
``/<kind>/<name>/<k>`` datasets (kind ``param``, ``exp_avg`` or ``exp_avg_sq``, or a residual
kind; ``k`` counts the rectangles of that tensor in the file), chunked with the ``fletcher32``
filter, each with a ``global_start`` attribute. The index over them: :mod:`.index`.

**Commit.** Every writing rank writes and fsyncs its shard into ``.step_N.tmp/`` and hashes it;
rank 0 gathers what each rank wrote, builds the index (the gather is the barrier: every shard is
complete), fsyncs it, renames the directory to ``step_N`` and then replaces ``latest`` through a
temporary file. ``keep_last`` prunes older checkpoints afterwards, and leftover temporary
directories are removed. A crash at any point leaves the previous checkpoint intact and
``latest`` naming it. (Saving a step that already has a checkpoint moves the old one aside
first; a crash between the two renames leaves ``latest`` naming a missing directory, and
``--resume auto`` takes the newest other checkpoint.)

**A full disk.** Before writing its shard a rank compares the bytes it will write (plus a margin
for HDF5's metadata) with what the save directory's filesystem has free, then reserves them
(:mod:`mpipar.runtime.hdf5_sink`: the file HDF5 writes through, which keeps a failed write
from the library), and a write that fails with ``ENOSPC`` all the same is recognised as such;
either way the partial shard is removed and every rank raises :class:`SaveError` naming the path, the bytes
needed and free, and that ``latest`` still names the previous checkpoint, intact. An
asynchronous save reports it at the first step boundary after its write ended
(:mod:`.background`).
"""
from __future__ import annotations

import errno
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpipar.checkpoint.directory import (CheckpointError, fsync_dir, latest, prune,
                                         sha256_file, shard_file_name, step_dir_name,
                                         write_latest)
from mpipar.checkpoint.index import FORMAT, write_index
from mpipar.checkpoint.records import RankPlace, RunPosition
from mpipar.checkpoint.shards import Piece, RankState, Slices
from mpipar.runtime.comm import Group
from mpipar.runtime.hdf5_sink import FULL, HDF5Sink


# ------------------------------------------------------------------------ pieces -> rectangles
def flat_rectangles(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[Slices, int]]:
    """Rectangles covering ``[lo, hi)`` of a row-major array of ``shape`` (1-D or 2-D), in order.

    Returns ``(index, flat start)`` pairs: for 2-D at most a partial first row, a block of full
    rows and a partial last row, each a contiguous flat range starting at ``flat start``.
    """
    size = math.prod(shape)
    if not 0 <= lo <= hi <= size:
        raise ValueError(f"flat range [{lo}, {hi}) must lie inside [0, {size}] of shape {shape}")
    if lo == hi:
        return []
    if len(shape) == 1:
        return [((slice(lo, hi),), lo)]
    if len(shape) != 2:
        raise ValueError(f"shape {shape}: checkpoints hold 1-D and 2-D tensors only")
    cols = shape[1]
    r0, c0 = divmod(lo, cols)
    r1, c1 = divmod(hi, cols)
    if r0 == r1:
        return [((slice(r0, r0 + 1), slice(c0, c1)), lo)]
    out = []
    if c0:
        out.append(((slice(r0, r0 + 1), slice(c0, cols)), lo))
        r0 += 1
    if r0 < r1:
        out.append(((slice(r0, r1), slice(0, cols)), r0 * cols))
    if c1:
        out.append(((slice(r1, r1 + 1), slice(0, c1)), r1 * cols))
    return out


def piece_blocks(local_shape: tuple[int, ...], valid: Slices, region: Slices, lo: int, hi: int,
                 values: np.ndarray) -> list[tuple[Slices, np.ndarray]]:
    """Split a flat range of a local shard into rectangles of the global tensor.

    ``local_shape`` is the shard's shape (padding rows included); ``valid`` and ``region`` come
    from :meth:`.shards.RankState.region` (the part of the shard that holds real values, and
    the global region it maps to); ``[lo, hi)`` is a range of the row-major flattened shard and
    ``values`` its ``hi - lo`` values. Returns ``(global index, block)`` pairs that cover
    exactly the valid elements of the range, each block a view of ``values``.
    """
    if values.shape != (hi - lo,):
        raise ValueError(f"values has shape {values.shape}, the range [{lo}, {hi}) needs "
                         f"({hi - lo},)")
    out = []
    for rect, start in flat_rectangles(local_shape, lo, hi):
        shape = tuple(s.stop - s.start for s in rect)
        block = values[start - lo:start - lo + math.prod(shape)].reshape(shape)
        sub, glob = [], []
        for r, v, g in zip(rect, valid, region):
            a, b = max(r.start, v.start), min(r.stop, v.stop)
            if a >= b:
                break
            sub.append(slice(a - r.start, b - r.start))
            glob.append(slice(g.start + a - v.start, g.start + b - v.start))
        else:
            out.append((tuple(glob), block[tuple(sub)]))
    return out


class SaveError(CheckpointError):
    """A checkpoint could not be written (a full disk, an I/O error); the previous checkpoints
    and ``latest`` are untouched. Raised on every rank alike."""


_METADATA_MARGIN = (1 << 16, 1 << 12)
"""Bytes a shard file needs beyond its data: per file, and per dataset (HDF5 object headers,
attributes, the chunk index)."""


def latest_note(root: Path) -> str:
    """What ``root/latest`` names after a failed save, for the message."""
    try:
        pointed = latest(root)
    except CheckpointError:
        pointed = None
    if pointed is None or not pointed.is_dir():
        return f"there is no committed checkpoint in {root} yet"
    return f"'latest' in {root} still names {pointed.name}, intact"


def _full_disk(path: Path, need: int) -> str | None:
    """A message when the filesystem holding ``path`` has less than ``need`` bytes free."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if need <= free:
        return None
    return (f"no space left for {path}: it needs about {need / 2**20:,.1f} MiB, the "
            f"filesystem has {free / 2**20:,.1f} MiB free")


def _is_full_disk(exc: BaseException) -> bool:
    """Whether ``exc`` (an OSError, or HDF5's error text, which carries the errno) is ENOSPC."""
    return (isinstance(exc, OSError) and exc.errno in FULL
            or f"errno = {errno.ENOSPC}," in str(exc))


# ------------------------------------------------------------------------------ files
DATASET_OPTIONS = {"chunks": True, "fletcher32": True}
"""How a shard's datasets are stored: chunked, each chunk with its Fletcher-32 checksum."""


def _write_shard(path: Path, pieces: list[Piece], state: RankState, place: RankPlace,
                 reserve: int = 0) -> dict[str, Any]:
    """Write this rank's rectangles of ``pieces`` (of ``state``) to ``path`` (fsynced; its
    ``reserve`` bytes allocated first: :mod:`mpipar.runtime.hdf5_sink`); return its record for
    the index: file, sha256, size, ``place``'s rank and coordinates, and the datasets ``(kind,
    name, dataset, global start, shape)``. An OSError of the file's writes is raised after it is
    closed; HDF5 never meets it."""
    blocks, counts = [], {}
    shard = HDF5Sink.create(path)
    try:
        shard.reserve(reserve)
        _write_blocks(shard, pieces, state, blocks, counts)
    finally:
        shard.close()
    if shard.error is not None:
        raise shard.error
    return {"file": path.name, "sha256": sha256_file(path), "size": path.stat().st_size,
            "rank": place.rank, "coord": tuple(place.coord), "blocks": blocks}


def _write_blocks(shard: HDF5Sink, pieces: list[Piece], state: RankState, blocks: list,
                  counts: dict) -> None:
    """The HDF5 datasets of :func:`_write_shard`, through ``shard``; each one's record into
    ``blocks``."""
    with h5py.File(shard, "w") as f:
        f.attrs["format"] = FORMAT + "-shard"
        for kind, name, lo, hi, values in pieces:
            region, valid = state.region(name)
            for glob, block in piece_blocks(state.local_shape(name), valid, region, lo, hi,
                                            values):
                k = counts.get((kind, name), 0)
                counts[(kind, name)] = k + 1
                dataset = f"{kind}/{name}/{k}"
                ds = f.create_dataset(dataset, data=np.ascontiguousarray(block),
                                      **DATASET_OPTIONS)
                start = tuple(s.start for s in glob)
                ds.attrs["global_start"] = np.array(start, np.int64)
                blocks.append((kind, name, dataset, start, block.shape))


def _commit(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (replacing an older save of the same step, or a link of that
    name, whose target stays), then ``latest``."""
    root = final.parent
    old = None
    if os.path.lexists(final):
        old = root / f".{final.name}.old"
        if os.path.lexists(old):
            _remove(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    write_latest(root, final.name)
    if old is not None:
        _remove(old)


def _remove(path: Path) -> None:
    """Remove a directory, or only the link when it is a symbolic link (its target is not the
    save directory's to remove)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)


# ------------------------------------------------------------------------------ save
class FrozenState:
    """What writing a shard and the index read of a :class:`~.shards.RankState`, fixed at the
    step boundary: the pieces copied to host memory by ``copy`` and the optimizer's update
    count, so training may go on changing the live state while a background thread writes."""

    def __init__(self, state: RankState, copy: Callable[[Any], np.ndarray]) -> None:
        self._state, self.dtype, self.step = state, state.dtype, int(state.step)
        self.shapes = dict(state.shapes)
        self.pieces = list(state.pieces(host=copy))
        self.nbytes = sum(v.nbytes for *_, v in self.pieces)

    def local_shape(self, name: str) -> tuple[int, ...]:
        return self._state.local_shape(name)

    def region(self, name: str) -> tuple[Slices, Slices]:
        return self._state.region(name)


@dataclass
class PendingSave:
    """A save between :func:`begin` and :func:`commit`: where it goes, what this rank writes,
    and (once :meth:`write` ran) this rank's ``(record, error)``."""

    state: Any                   # a RankState, or a FrozenState of it
    pieces: list[Piece]
    position: RunPosition
    rank: int
    final: Path
    tmp: Path
    outcome: tuple = (None, None)

    def write(self) -> None:
        """Write and fsync this rank's shard (no collective: any thread may run it); an error is
        kept for :func:`commit` to report on every rank, never raised."""
        if not self.pieces:
            return
        path = self.tmp / shard_file_name(self.rank)
        need = _METADATA_MARGIN[0] + sum(v.nbytes + _METADATA_MARGIN[1]
                                         for *_, v in self.pieces)
        full = _full_disk(path, need)
        if full:
            self.outcome = (None, f"rank {self.rank}: {full}")
            return
        try:
            self.outcome = (_write_shard(path, self.pieces, self.state, self.position.place,
                                         need), None)
        except Exception as exc:  # reported by rank 0 on every rank, never a hang
            path.unlink(missing_ok=True)  # what it held is worthless, and takes the space
            why = (f"no space left on the device ({need / 2**20:,.1f} MiB to write)"
                   if _is_full_disk(exc) else f"{type(exc).__name__}: {exc}")
            self.outcome = (None, f"rank {self.rank} writing {path}: {why}")


def begin(state: RankState, position: RunPosition, save_dir: str | os.PathLike, group: Group,
          copy: Callable[[Any], np.ndarray] | None = None) -> PendingSave:
    """Start the save of ``position.step`` (collective over ``group``): rank 0 makes the
    temporary directory; with ``copy`` this rank's pieces are copied now (a
    :class:`FrozenState`), so the shard may be written while training goes on."""
    rank = group.rank
    root = Path(save_dir)
    final = root / step_dir_name(position.step)
    tmp = root / f".{final.name}.tmp"
    problem = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as exc:
            problem = f"cannot create {tmp}: {exc}"
    problem = group.bcast_object(problem, root=0)
    if problem:
        raise SaveError(f"{problem}; {latest_note(root)}")
    if copy is not None:
        frozen = FrozenState(state, copy)
        return PendingSave(frozen, frozen.pieces, position, rank, final, tmp)
    return PendingSave(state, list(state.pieces()), position, rank, final, tmp)


def commit(pending: PendingSave, group: Group, keep_last: int = 0) -> Path:
    """Finish a save whose shards every rank has written (collective over ``group``): rank 0
    gathers the records (the barrier: every shard is complete), writes the index, renames the
    directory and replaces ``latest``; prunes to ``keep_last``. A failure on any rank raises
    CheckpointError on every rank and leaves the previous checkpoints and ``latest``
    untouched."""
    gathered = group.gather_object(tuple(pending.outcome), root=0)
    root, final, tmp = pending.final.parent, pending.final, pending.tmp
    result, error = None, None
    if group.rank == 0:
        try:
            errors = [e for _, e in gathered if e]
            if errors:
                raise CheckpointError("; ".join(errors))
            write_index(tmp, pending.state, pending.position, [r for r, _ in gathered if r])
            _commit(tmp, final)
            prune(root, keep_last, final.name)
            result = ""
        except Exception as exc:
            error = exc
            result = (str(exc) if isinstance(exc, CheckpointError)
                      else f"{type(exc).__name__}: {exc}")
    result = group.bcast_object(result, root=0)
    if result:
        raise SaveError(f"saving {final} failed: {result}; {latest_note(root)}") from error
    return final


def save(state: RankState, position: RunPosition, save_dir: str | os.PathLike, group: Group,
         keep_last: int = 0) -> Path:
    """Write and commit the checkpoint of ``position.step``: this rank's pieces of ``state``,
    and (rank 0) the index recording ``position``. Collective over ``group``, a
    :class:`~mpipar.runtime.comm.Group` over the world whose rank is ``position.place.rank``
    (training passes its control group, which the collective watchdog watches).

    Returns ``save_dir/step_NNNNNNNN``. A failure on any rank raises CheckpointError on every
    rank and leaves the previous checkpoints and ``latest`` untouched. (:func:`begin`,
    :meth:`PendingSave.write` and :func:`commit` are its three parts, which
    :mod:`.background` runs apart.)
    """
    pending = begin(state, position, save_dir, group)
    pending.write()
    return commit(pending, group, keep_last)
