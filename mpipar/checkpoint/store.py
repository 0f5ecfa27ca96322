"""HDF5 sharded checkpoints: save with an atomic commit, verify, load under any layout, consolidate.

A save directory holds one directory per checkpoint and a pointer to the newest::

    SAVE_DIR/
      latest                  "step_00000200\\n": the newest committed checkpoint
      step_00000200/
        shard_00000.h5        one file per world rank that owns unique state
        shard_00002.h5
        index.h5              global tensors as virtual datasets + config, layout, positions
        index.sha256          sha256 of index.h5
      .step_00000300.tmp/     a save in progress, or one a crash interrupted: never read

**Shards.** Each rank writes its share of the unique state (:meth:`.shards.RankState.pieces`):
parameters once per (tp, pp) position (by dp = sp = 0), replicated tensors (the norm weights)
only by TP rank 0; AdamW moments from the same ranks without ZeRO, and under ZeRO-1 from every
rank of dp x sp for the slices it owns. A piece is a flat range of a local shard ``[rows,
cols]``; it is stored as rectangles of the global tensor (a partial first row, the full rows, a
partial last row), and vocabulary padding rows are dropped. A shard file holds
``/<kind>/<name>/<k>`` datasets (kind ``param``, ``exp_avg`` or ``exp_avg_sq``; ``k`` counts the
rectangles of that tensor in the file), chunked with the ``fletcher32`` filter, each with a
``global_start`` attribute.

**Index.** ``index.h5`` presents every tensor as its global shape through virtual datasets
(``param/<name>``, ``exp_avg/<name>``, ``exp_avg_sq/<name>``, and with gradient compression and
error feedback the residuals per slot, ``residual_send.<slot>/<name>`` and
``residual_gather/<name>``: :mod:`mpipar.parallel.data_parallel`; with top-k's catch-up the optimizer's
wait counts, ``idle_steps/<name>``: :func:`mpipar.training.optim.adamw_catch_up`) whose mappings are
rectangle-to-rectangle and whose source files are named relative to the checkpoint directory
(a renamed or copied directory still works). A missing source reads as the fill value (NaN) in
HDF5, so nothing is read before :func:`verify` has checked that every shard is present and
matches its sha256. Root attributes: ``format``, ``format_version``, ``step`` (training steps
done), ``optimizer_step``, ``dtype``, ``world_size``, ``config_toml`` (the resolved config);
groups ``layout`` (dp, tp, pp, sp, virtual_stages, schedule, zero, sp_split, sp_mode,
tp_sequence_parallel, ranks_per_node, dp_reduce, grad_compression),
``lr_schedule`` (the fields of :class:`.records.LRScheduleState`: its settings and
``next_step``/``next_lr``, the LR schedule is a function of the step), ``data`` (the fields of
:class:`.records.DataCursor`: the sampler is a pure function of (seed, step): ``seed``,
``shuffle``, ``global_batch_size``, ``next_step``, ``samples_consumed``, and the held-out
validation split: ``eval_fraction``, ``train_samples``, the samples training draws from;
initialisation is seeded by (seed, name), so ``seed`` is the whole RNG state), and
``shards/<file>`` (sha256, size, rank, grid coordinates: :class:`.records.RankPlace`).

**Commit.** Every writing rank writes and fsyncs its shard into ``.step_N.tmp/`` and hashes it;
rank 0 gathers what each rank wrote, builds the index (the gather is the barrier: every shard is
complete), fsyncs it, renames the directory to ``step_N`` and then replaces ``latest`` through a
temporary file. ``keep_last`` prunes older checkpoints afterwards, and leftover temporary
directories are removed. A crash at any point leaves the previous checkpoint intact and
``latest`` naming it. (Saving a step that already has a checkpoint moves the old one aside
first; a crash between the two renames leaves ``latest`` naming a missing directory, and
``--resume auto`` takes the newest other checkpoint.)

**Resume.** :func:`verify` checks presence, size and sha256 of every file before anything is
read; :func:`resolve_resume` with "auto" tries the checkpoint ``latest`` names, then the others
newest first, and takes the first that verifies. :func:`load` reads, for each tensor, the region
of the global tensor this rank's shard covers, so any layout loads any checkpoint.

"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from mpipar.checkpoint.records import AXES, RankPlace, RunPosition
from mpipar.checkpoint.shards import Piece, RankState, Reader, Slices
from mpipar.config import Config, ConfigError, ModelConfig
from mpipar.runtime.comm import Group

FORMAT = "mpipar-checkpoint"
FORMAT_VERSION = 1
INDEX = "index.h5"
INDEX_SUM = "index.sha256"
LATEST = "latest"
KINDS = ("param", "exp_avg", "exp_avg_sq")
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_HASH_BLOCK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit the model."""


def step_dir_name(step: int) -> str:
    """``step_NNNNNNNN`` (8 digits, more when needed)."""
    return f"step_{step:08d}"


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


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_shard(path: Path, pieces: list[Piece], state: RankState,
                 place: RankPlace) -> dict[str, Any]:
    """Write this rank's rectangles of ``pieces`` (of ``state``) to ``path`` (fsynced); return
    its record for the index: file, sha256, size, ``place``'s rank and coordinates, and the
    datasets ``(kind, name, dataset, global start, shape)``."""
    blocks, counts = [], {}
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT + "-shard"
        for kind, name, lo, hi, values in pieces:
            region, valid = state.region(name)
            for glob, block in piece_blocks(state.local_shape(name), valid, region, lo, hi,
                                            values):
                k = counts.get((kind, name), 0)
                counts[(kind, name)] = k + 1
                dataset = f"{kind}/{name}/{k}"
                ds = f.create_dataset(dataset, data=np.ascontiguousarray(block), chunks=True,
                                      fletcher32=True)
                start = tuple(s.start for s in glob)
                ds.attrs["global_start"] = np.array(start, np.int64)
                blocks.append((kind, name, dataset, start, block.shape))
    _fsync_file(path)
    return {"file": path.name, "sha256": sha256_file(path), "size": path.stat().st_size,
            "rank": place.rank, "coord": tuple(place.coord), "blocks": blocks}


def _kinds(records: list[dict]) -> tuple[str, ...]:
    """:data:`KINDS`, then the other kinds (residuals) the shards hold, sorted."""
    extra = {kind for rec in records for kind, *_ in rec["blocks"]} - set(KINDS)
    return KINDS + tuple(sorted(extra))


def _virtual_layouts(state: RankState, records: list[dict]
                     ) -> dict[tuple[str, str], h5py.VirtualLayout]:
    """Every ``(kind, name)`` of the shards' ``records`` as a virtual layout of its global shape
    over the shard datasets; CheckpointError when the pieces do not tile each tensor."""
    shapes, dtype = state.shapes, state.dtype
    layouts: dict[tuple[str, str], h5py.VirtualLayout] = {}
    covered: dict[tuple[str, str], int] = {}
    for rec in records:
        for kind, name, dataset, start, shape in rec["blocks"]:
            key = (kind, name)
            if key not in layouts:
                layouts[key] = h5py.VirtualLayout(shape=shapes[name], dtype=dtype)
                covered[key] = 0
            source = h5py.VirtualSource(rec["file"], dataset, shape=shape, dtype=dtype)
            layouts[key][tuple(slice(a, a + n) for a, n in zip(start, shape))] = source
            covered[key] += math.prod(shape)
    for kind in _kinds(records):
        for name, shape in shapes.items():
            got, want = covered.get((kind, name), 0), math.prod(shape)
            if got != want:
                raise CheckpointError(f"{kind}/{name}: the shards hold {got} of its {want} "
                                      f"elements; the ranks' state pieces do not tile it")
    return layouts


def _write_index(tmp: Path, state: RankState, position: RunPosition, records: list[dict]) -> None:
    """Build ``index.h5`` (virtual datasets over the shards of ``records``, the metadata of
    ``position``) and ``index.sha256`` in ``tmp``."""
    layouts = _virtual_layouts(state, records)
    cfg = position.config
    index = tmp / INDEX
    with h5py.File(index, "w") as f:
        a = f.attrs
        a["format"], a["format_version"] = FORMAT, FORMAT_VERSION
        a["step"], a["optimizer_step"] = position.step, int(state.step)
        a["dtype"], a["world_size"] = state.dtype.name, position.place.world_size
        a["saved_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        a["config_toml"] = cfg.to_toml()
        lay = f.create_group("layout").attrs
        for key in ("dp", "tp", "pp", "sp", "virtual_stages", "schedule", "zero", "sp_split",
                    "sp_mode", "tp_sequence_parallel", "ranks_per_node", "dp_reduce",
                    "grad_compression"):
            lay[key] = getattr(cfg.parallel, key)
        for group, record in (("lr_schedule", position.lr_schedule), ("data", position.data)):
            attrs = f.create_group(group).attrs
            for key, value in dataclasses.asdict(record).items():
                attrs[key] = value
        rng = f.create_group("rng").attrs
        rng["seed"] = position.data.seed
        rng["note"] = ("parameters initialise from default_rng([seed, crc32(name)]); the sampler "
                       "orders epoch e by default_rng([seed, e]): no other random state exists")
        shards = f.create_group("shards")
        for rec in sorted(records, key=lambda r: r["file"]):
            g = shards.create_group(rec["file"]).attrs
            g["sha256"], g["size"], g["rank"] = rec["sha256"], rec["size"], rec["rank"]
            for axis, value in zip(AXES, rec["coord"]):
                g[axis] = value
            g["datasets"] = len(rec["blocks"])
        for kind in _kinds(records):
            group = f.create_group(kind, track_order=True)  # forward order, as param_specs
            for name in state.shapes:
                group.create_virtual_dataset(name, layouts[(kind, name)], fillvalue=np.nan)
    _fsync_file(index)
    summary = tmp / INDEX_SUM
    summary.write_text(f"{sha256_file(index)}  {INDEX}\n")
    _fsync_file(summary)
    _fsync_dir(tmp)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _commit(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (replacing an older save of the same step), then ``latest``."""
    root = final.parent
    old = None
    if final.exists():
        old = root / f".{final.name}.old"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_latest(root, final.name)
    if old is not None:
        shutil.rmtree(old)


def list_checkpoints(save_dir: str | os.PathLike) -> list[Path]:
    """Committed checkpoint directories of ``save_dir``, newest (highest step) first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
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
    if not _STEP_DIR.match(name):
        raise CheckpointError(f"{pointer}: holds {name[:40]!r}, not the name of a checkpoint "
                              f"directory such as step_00000001")
    return Path(save_dir) / name


def _prune(root: Path, keep_last: int, keep: str) -> None:
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


# ------------------------------------------------------------------------------ save
def save(state: RankState, position: RunPosition, save_dir: str | os.PathLike, group: Group,
         keep_last: int = 0) -> Path:
    """Write and commit the checkpoint of ``position.step``: this rank's pieces of ``state``,
    and (rank 0) the index recording ``position``. Collective over ``group``, a
    :class:`~mpipar.runtime.comm.Group` over the world whose rank is ``position.place.rank``
    (training passes its control group, which the collective watchdog watches).

    Returns ``save_dir/step_NNNNNNNN``. A failure on any rank raises CheckpointError on every
    rank and leaves the previous checkpoints and ``latest`` untouched.
    """
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
        raise CheckpointError(problem)

    pieces = list(state.pieces())
    outcome: list = [None, None]  # (record, error)

    def write() -> None:
        if not pieces:
            return
        path = tmp / f"shard_{rank:05d}.h5"
        try:
            outcome[0] = _write_shard(path, pieces, state, position.place)
        except Exception as exc:  # reported by rank 0 on every rank, never a hang
            outcome[1] = f"rank {rank} writing {path}: {type(exc).__name__}: {exc}"

    write()
    gathered = group.gather_object(tuple(outcome), root=0)

    result, error = None, None
    if rank == 0:
        try:
            errors = [e for _, e in gathered if e]
            if errors:
                raise CheckpointError("; ".join(errors))
            _write_index(tmp, state, position, [r for r, _ in gathered if r])
            _commit(tmp, final)
            _prune(root, keep_last, final.name)
            result = ""
        except Exception as exc:
            error = exc
            result = f"{type(exc).__name__}: {exc}"
    result = group.bcast_object(result, root=0)
    if result:
        raise CheckpointError(f"saving {final} failed: {result}") from error
    return final


# ------------------------------------------------------------------------------ verify
_VERIFIED: dict[tuple, tuple[str, ...]] = {}


def _signature(path: Path) -> tuple:
    """What changes when any file of the directory changes (name, size, mtime, inode)."""
    out = []
    for entry in os.scandir(path):
        if entry.is_file():
            st = entry.stat()
            out.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(out))


def verify(path: str | os.PathLike) -> list[str]:
    """Problems that make the checkpoint at ``path`` unusable (empty list: it is sound).

    Checks that ``index.h5`` exists and matches ``index.sha256``, and that every shard the index
    records is present, has its recorded size and sha256. A shard that fails is named, with the
    datasets whose fletcher32 checksums fail when they can be found. The answer is cached per
    directory state (names, sizes, mtimes), so repeating it costs one ``stat`` per file.
    """
    path = Path(path)
    if not path.is_dir():
        return [f"{path}: no such checkpoint directory"]
    key = (str(path.resolve()), _signature(path))
    if key not in _VERIFIED:
        _VERIFIED[key] = tuple(_verify(path))
    return list(_VERIFIED[key])


def _verify(path: Path) -> list[str]:
    index, summary = path / INDEX, path / INDEX_SUM
    if not index.is_file():
        return [f"{index}: missing (the checkpoint was never committed)"]
    if not summary.is_file():
        return [f"{summary}: missing"]
    recorded = summary.read_text().split()
    if not recorded or recorded[0] != sha256_file(index):
        return [f"{index}: sha256 does not match {INDEX_SUM} (the index is corrupted)"]
    try:
        with h5py.File(index, "r") as f:
            if f.attrs.get("format") != FORMAT:
                return [f"{index}: not an mpipar checkpoint index"]
            shards = {name: (str(g.attrs["sha256"]), int(g.attrs["size"]))
                      for name, g in f["shards"].items()}
    except (OSError, KeyError) as exc:
        return [f"{index}: unreadable ({exc})"]
    problems = []
    for name, (digest, size) in sorted(shards.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{file}: missing shard")
            continue
        actual = file.stat().st_size
        if actual != size:
            how = "truncated" if actual < size else "longer than written"
            problems.append(f"{file}: {actual} bytes, the index records {size} ({how})"
                            + _damage(file))
            continue
        found = sha256_file(file)
        if found != digest:
            problems.append(f"{file}: sha256 {found[:16]}... does not match the recorded "
                            f"{digest[:16]}... (corrupted)" + _damage(file))
    return problems


def _damage(file: Path) -> str:
    """Which datasets of a damaged shard fail to read (fletcher32), as a message suffix."""
    bad: list[str] = []
    try:
        with h5py.File(file, "r") as f:
            def check(name: str, obj: Any) -> None:
                if isinstance(obj, h5py.Dataset):
                    try:
                        obj[()]
                    except OSError:
                        bad.append(name)
            f.visititems(check)
    except Exception as exc:  # h5py raises OSError, KeyError or RuntimeError on broken metadata
        return f"; it cannot be opened as HDF5 ({type(exc).__name__}: {exc})"
    if bad:
        return f"; dataset(s) {', '.join(bad)} fail their fletcher32 checksum"
    return "; every dataset passes its fletcher32 checksum (the damage is in HDF5 metadata)"


# ------------------------------------------------------------------------------ resume
def resolve_path(spec: str | os.PathLike) -> Path:
    """A checkpoint directory from ``spec``: the directory itself, a save directory (its
    ``latest``) or a save directory's ``latest`` file."""
    p = Path(spec)
    if p.name == LATEST and p.is_file():
        return latest(p.parent) or p
    if not (p / INDEX).exists() and not _STEP_DIR.match(p.name):
        target = latest(p)
        if target is not None:
            return target
    return p


def resolve_resume(spec: str, save_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and notes for the log.

    ``spec`` "" means no resume (None). "auto": the checkpoint ``save_dir/latest`` names, then the
    other committed ones newest first; the first that verifies wins, each one skipped gets a note
    saying why; None (start fresh) when none verifies or none exists. A path (a checkpoint or a
    save directory) must verify, else ConfigError names the problems. No collective: every rank
    gets the same answer from the same files.
    """
    if not spec:
        return None, []
    if spec != "auto":
        path = resolve_path(spec)
        problems = verify(path)
        if problems:
            raise ConfigError(f"--resume {spec}: checkpoint {path} failed verification: "
                              + "; ".join(problems))
        return path, []
    root = Path(save_dir)
    candidates = list_checkpoints(root)
    try:
        pointed = latest(root)
    except CheckpointError as exc:
        pointed, notes = None, [f"{exc}; taking the newest checkpoint that verifies"]
    else:
        notes = []
    if pointed is not None and pointed in candidates:
        candidates.remove(pointed)
        candidates.insert(0, pointed)
    failed = []
    for path in candidates:
        problems = verify(path)
        if not problems:
            return path, notes + [f"checkpoint {p} failed verification ({'; '.join(why)}); "
                                  f"falling back to {path}" for p, why in failed]
        failed.append((path, problems))
    if not failed:
        return None, notes + [f"no checkpoint in {root}; starting fresh"]
    return None, notes + [f"checkpoint {p} failed verification ({'; '.join(why)}); no other "
                          f"checkpoint verifies, starting fresh" for p, why in failed]


def _require_sound(path: Path) -> None:
    problems = verify(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} failed verification: " + "; ".join(problems))


def _index_attrs(path: Path) -> dict[str, Any]:
    index = path / INDEX
    try:
        with h5py.File(index, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{index}: not an mpipar checkpoint index")
            return {k: f.attrs[k] for k in f.attrs}
    except OSError as exc:
        raise CheckpointError(f"{index}: cannot be read ({exc})") from None


def read_config(path: str | os.PathLike) -> Config:
    """The resolved configuration the checkpoint at ``path`` was saved with."""
    path = resolve_path(path)
    text = str(_index_attrs(path)["config_toml"])
    return Config.from_dict(tomllib.loads(text), source=f"{path / INDEX} (config_toml)")


_RESUME_FIELDS = {
    "data": "later steps read other samples than the checkpoint's run would have",
    "seq_len": "later steps read other samples than the checkpoint's run would have",
    "global_batch_size": "later steps read other samples than the checkpoint's run would have",
    "seed": "later steps read other samples than the checkpoint's run would have",
    "shuffle": "later steps read other samples than the checkpoint's run would have",
    "steps": "the learning rate of later steps differs from the checkpoint's run",
    "lr": "the learning rate of later steps differs from the checkpoint's run",
    "min_lr": "the learning rate of later steps differs from the checkpoint's run",
    "lr_schedule": "the learning rate of later steps differs from the checkpoint's run",
    "warmup_steps": "the learning rate of later steps differs from the checkpoint's run",
    "dtype": "the saved state is cast to the new dtype",
}
"""Training settings whose change on resume is reported, with what the change means."""


def resume_changes(path: str | os.PathLike, position: RunPosition) -> list[str]:
    """What a run resuming from the checkpoint at ``path`` at ``position`` (its configuration
    and data cursor) does differently from the run that saved it (one line per change of
    :data:`_RESUME_FIELDS`, or a data source of another size); empty when nothing changed and
    the resumed run continues as the uninterrupted one would."""
    path = resolve_path(path)
    then, now, data = read_config(path).train, position.config.train, position.data
    with h5py.File(path / INDEX, "r") as f:
        samples = int(f["data"].attrs["num_samples"])
    out = [f"train.{name} is {getattr(now, name)!r}, the checkpoint's run used "
           f"{getattr(then, name)!r}: {meaning}" for name, meaning in _RESUME_FIELDS.items()
           if getattr(now, name) != getattr(then, name)]
    if samples != data.num_samples and (then.data, then.seq_len) == (now.data, now.seq_len):
        out.append(f"the data {data.path} holds {data.num_samples} samples of "
                   f"{now.seq_len} tokens, the checkpoint's run saw {samples}: "
                   f"{_RESUME_FIELDS['data']}")
    return out


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The checkpoint's model configuration (from its stored TOML)."""
    return read_config(path).model


def _read_region(f: h5py.File, path: Path, kind: str, name: str, region: Slices) -> np.ndarray:
    """``region`` of the global tensor ``kind/name``; a read failure names the shard files."""
    ds = f[f"{kind}/{name}"]
    shape = tuple(len(range(*s.indices(n))) for s, n in zip(region, ds.shape))
    if 0 in shape:
        return np.empty(shape, ds.dtype)
    try:
        return ds[region]
    except OSError as exc:
        files = sorted({m.file_name for m in ds.virtual_sources()
                        if _overlaps(m.vspace.get_select_bounds(), region)})
        raise CheckpointError(f"{path / INDEX}: reading {kind}/{name} from "
                              f"{', '.join(str(path / x) for x in files)} failed: {exc}") from None


def _overlaps(bounds: tuple, region: Slices) -> bool:
    (lo, hi) = bounds  # inclusive corners of the mapping in the virtual dataset
    return all(s.start < b + 1 and a < s.stop for a, b, s in zip(lo, hi, region))


@contextlib.contextmanager
def open_reader(path: str | os.PathLike) -> Iterator[Reader]:
    """Verify the checkpoint at ``path`` (or a save directory's ``latest``), then yield
    ``read(kind, name, region)``: a region of a global tensor, read from the shards that hold it.
    Any layout reads any checkpoint this way (:func:`.shards.read_shard`), e.g. generation under
    its own tp x pp. No collective."""
    path = resolve_path(path)
    _require_sound(path)
    with h5py.File(path / INDEX, "r") as f:
        yield lambda kind, name, region: _read_region(f, path, kind, name, region)


def load(state: RankState, path: str | os.PathLike) -> int:
    """Load parameters, AdamW moments, the other state kinds the checkpoint holds and the
    optimizer step into ``state`` (this rank's, any layout) from the checkpoint at ``path``;
    return the training step it holds. Verifies the checkpoint first (cached when
    :func:`resolve_resume` already did) and checks every tensor's shape against the model;
    raises CheckpointError naming the file (and dataset) at fault. No collective."""
    path = resolve_path(path)
    _require_sound(path)
    with h5py.File(path / INDEX, "r") as f:
        extra = set(_held_kinds(f)) - set(KINDS)
        for kind in (*KINDS, *sorted(extra)):
            for name, shape in state.shapes.items():
                key = f"{kind}/{name}"
                if key not in f:
                    raise CheckpointError(f"{path / INDEX}: has no {key}; the model needs it")
                if f[key].shape != shape:
                    raise CheckpointError(f"{path / INDEX}: {key} has shape {f[key].shape}, the "
                                          f"model needs {shape}")
        state.load(lambda kind, name, region: _read_region(f, path, kind, name, region),
                   int(f.attrs["optimizer_step"]), extra)
        return int(f.attrs["step"])


def _held_kinds(f: h5py.File) -> list[str]:
    """The tensor kinds an index holds (its groups but the metadata ones)."""
    return [k for k in f if k not in ("layout", "lr_schedule", "data", "rng", "shards")]


def read_tensors(path: str | os.PathLike, kind: str = "param") -> dict[str, np.ndarray]:
    """Every global tensor of ``kind`` ("param", "exp_avg", "exp_avg_sq" or a residual kind the
    checkpoint holds), verified first."""
    path = resolve_path(path)
    _require_sound(path)
    with h5py.File(path / INDEX, "r") as f:
        if kind not in _held_kinds(f):
            raise ValueError(f"kind={kind!r}: must be one of {', '.join(_held_kinds(f))}")
        return {name: _read_region(f, path, kind, name, tuple(slice(0, n) for n in ds.shape))
                for name, ds in f[kind].items()}


# ------------------------------------------------------------------------------ tools
def inspect(path: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint holds: metadata, layout, schedule and data positions, shards, tensors.

    Returns a JSON-ready dict: ``path, step, optimizer_step, dtype, world_size, saved_at,
    layout, lr_schedule, data, rng, model`` (dicts), ``shards`` (file, rank, dp, tp, pp, sp, size,
    sha256, datasets) and ``tensors`` (name ``kind/name``, shape, dtype, number of source
    rectangles). Reads metadata only; does not verify.
    """
    path = resolve_path(path)
    _index_attrs(path)
    with h5py.File(path / INDEX, "r") as f:
        out: dict[str, Any] = {"path": str(path)}
        for key in ("step", "optimizer_step", "dtype", "world_size", "saved_at"):
            out[key] = _plain(f.attrs[key])
        for group in ("layout", "lr_schedule", "data", "rng"):
            out[group] = {k: _plain(v) for k, v in f[group].attrs.items()}
        out["model"] = dataclasses.asdict(read_model_config(path))
        out["shards"] = [{"file": name, **{k: _plain(v) for k, v in g.attrs.items()}}
                         for name, g in f["shards"].items()]
        out["tensors"] = [{"name": f"{kind}/{name}", "shape": list(ds.shape),
                           "dtype": ds.dtype.name, "sources": len(ds.virtual_sources())}
                          for kind in _held_kinds(f) for name, ds in f[kind].items()]
    return out


def _plain(value: Any) -> Any:
    """An HDF5 attribute value as a JSON-ready Python value."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _require_outside(out: Path) -> None:
    """Refuse an output path inside a checkpoint directory (or a save directory's ``latest``):
    writing there would change, and break, what the index and its checksums describe."""
    target = out.resolve()
    inside = next((d for d in target.parents if (d / INDEX).is_file() or _STEP_DIR.match(d.name)),
                  None)
    if inside is None and (target / INDEX).is_file():
        inside = target
    if inside is not None:
        raise CheckpointError(f"{out}: inside the checkpoint {inside}; writing there would "
                              f"change what its index records; choose a path outside it")
    if target.name == LATEST and list_checkpoints(target.parent):
        raise CheckpointError(f"{out}: the 'latest' pointer of the save directory "
                              f"{target.parent}; choose another path")


def consolidate(path: str | os.PathLike, out: str | os.PathLike,
                kinds: tuple[str, ...] = KINDS) -> Path:
    """Write the checkpoint as one HDF5 file of plain datasets ``<kind>/<name>`` (global shapes,
    chunked with fletcher32) with the index's attributes; written beside ``out`` and renamed in.
    Verifies the checkpoint first."""
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: must be one of {', '.join(KINDS)}")
    path, out = resolve_path(path), Path(out)
    _require_outside(out)
    _require_sound(path)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(path / INDEX, "r") as src, h5py.File(tmp, "w") as dst:
            for key, value in src.attrs.items():
                dst.attrs[key] = value
            for group in ("layout", "lr_schedule", "data", "rng"):
                g = dst.create_group(group)
                for key, value in src[group].attrs.items():
                    g.attrs[key] = value
            for kind in kinds:
                for name, ds in src[kind].items():
                    value = _read_region(src, path, kind, name,
                                         tuple(slice(0, n) for n in ds.shape))
                    dst.create_dataset(f"{kind}/{name}", data=value, chunks=True, fletcher32=True)
        _fsync_file(tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out


def export_hf(path: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None) -> Path:
    """Write the checkpoint's parameters as a Hugging Face directory (config.json +
    model.safetensors: :func:`mpipar.checkpoint.huggingface.save_hf`) in ``dtype`` (default:
    the training dtype). Verifies first."""
    from mpipar.checkpoint import huggingface as hf

    _require_outside(Path(out))
    cfg = read_config(path)
    params = read_tensors(path, "param")
    hf.save_hf(out, cfg.model, params, dtype=dtype or cfg.train.dtype,
               extra_config={"max_position_embeddings": max(hf.DEFAULT_MAX_POSITIONS,
                                                            cfg.train.seq_len)})
    return Path(out)
