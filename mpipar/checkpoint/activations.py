"""Per-rank HDF5 activation dumps, their reader, and the offload store for saved activations.

Dumps (``--dump-activations STEPS``): at each listed step every rank writes
``RUN_DIR/activations/step_N/rank_R.h5`` (written as ``rank_R.h5.tmp`` and renamed once
complete) holding, for every block it runs, a group ``layer_{i}`` with the datasets of
:data:`mpipar.model.llama.ACTIVATION_NAMES`, each the concatenation over this rank's microbatches
in global batch-row order:

- ``input``, ``attention_out``, ``mlp``, ``output``: ``[rows, S_loc, hidden]``, replicated over TP
  (every TP rank writes the same values);
- ``attention``: ``[rows, S_loc, heads/tp * head_dim]``, the attention output *before* o_proj,
  i.e. this TP rank's heads ``[heads_lo, heads_hi)`` = columns ``[columns_lo, columns_hi)``.

Attributes of the file: ``world_rank``, ``world_size``, ``grid`` (sizes dp, tp, pp, sp), ``dp``,
``tp``, ``pp``, ``sp`` (this rank's coordinates), ``step``, ``positions`` (global token positions
of the sequence chunk, in local order: one range contiguous, two for zigzag), ``segments``
(``[start, length]`` per range), ``rows`` (global batch rows, in order), ``samples`` (the data
source's sample index of each row), ``global_batch``, ``seq_len``, ``hidden``, ``heads``,
``head_dim``, ``layers``, ``names``. Every dataset carries ``columns`` (``[lo, hi)`` of the global
last axis) and ``heads`` (``[lo, hi)``, attention only) and ``tp_sharded``. Datasets are chunked
with ``fletcher32``, so corruption fails the read. :func:`dump_step` writes a rank's file from
what the engine hands it: the recorder, the rank's :class:`~mpipar.checkpoint.records.RankPlace`
and the :class:`ActivationRegion` of the step.

:func:`load_global` reassembles a global ``[global_batch, seq_len, width]`` tensor from every
rank's file; a missing file, a file of another run, or a region no file covers is an error.

:class:`OffloadStore` keeps the per-microbatch activation caches of ``--recompute offload`` in a
per-rank HDF5 scratch file between forward and backward.
"""
from __future__ import annotations

import dataclasses
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpipar.checkpoint.records import RankPlace
from mpipar.config import Config
from mpipar.model.llama import ACTIVATION_NAMES
from mpipar.runtime.device import to_host
from mpipar.runtime.precision import is_bf16

TP_SHARDED = ("attention",)
_RANK_FILE = re.compile(r"rank_(\d+)\.h5$")


def _dataset(group: h5py.Group, name: str, data: np.ndarray) -> h5py.Dataset:
    """A dataset of ``data``: chunked with fletcher32 when it has elements and dimensions;
    bfloat16 (which HDF5 has no type for) as its float32 values (exact)."""
    if is_bf16(data.dtype):
        data = data.astype(np.float32)
    if data.ndim and data.size:
        return group.create_dataset(name, data=data, chunks=True, fletcher32=True)
    return group.create_dataset(name, data=data)


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """``RUN_DIR/activations/step_N`` (``step`` 1-based)."""
    return Path(run_dir) / "activations" / f"step_{int(step)}"


# --------------------------------------------------------------------------------- dumps


class ActivationRecorder:
    """Collects one step's block activations of one rank, one forward call at a time.

    ``forward_order[layer]``: the microbatch index of each forward call of the chunk holding
    ``layer``, in the order the schedule runs them. Install it as ``stage.recorder``.
    """

    def __init__(self, forward_order: dict[int, list[int]]) -> None:
        self.forward_order = forward_order
        self.values: dict[tuple[int, str], list[np.ndarray]] = {}

    @classmethod
    def for_schedule(cls, ops, chunks) -> "ActivationRecorder":
        """A recorder for a pipeline rank running ``ops`` (its schedule's op list, with
        ``kind``, ``chunk`` and ``microbatch``) over ``chunks`` (stages with ``layers``)."""
        order: dict[int, list[int]] = {}
        for c, ch in enumerate(chunks):
            mbs = [op.microbatch for op in ops if op.kind == "fwd" and op.chunk == c]
            order.update({layer: mbs for layer in ch.layers})
        return cls(order)

    def __call__(self, layer: int, name: str, value: Any) -> None:
        """Keep a host copy of ``value`` ``[B, S_loc, width]`` for block ``layer``."""
        if layer not in self.forward_order:
            raise ValueError(f"layer={layer}: not among this rank's layers "
                             f"{sorted(self.forward_order)}")
        self.values.setdefault((layer, name), []).append(np.array(to_host(value), copy=True))

    def stacked(self, layer: int, name: str) -> np.ndarray:
        """``[rows, S_loc, width]``: every microbatch of ``layer``/``name`` in microbatch order."""
        got, order = self.values.get((layer, name), []), self.forward_order[layer]
        if len(got) != len(order):
            raise ValueError(f"layer {layer} {name}: recorded {len(got)} forward calls, the "
                             f"schedule runs {len(order)}")
        return np.concatenate([got[j] for j in np.argsort(order, kind="stable")], axis=0)


def write_rank_dump(path: str | os.PathLike, recorder: ActivationRecorder,
                    attrs: dict[str, Any], columns: dict[str, tuple[int, int]],
                    heads: tuple[int, int]) -> Path:
    """Write one rank's dump file atomically (``.tmp`` then rename); returns its path.

    ``attrs``: the file attributes of the module docstring. ``columns[name]``: ``[lo, hi)`` of
    the global last axis this rank holds; ``heads``: ``[lo, hi)`` of the attention heads.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    layers = sorted(recorder.forward_order)
    with h5py.File(tmp, "w") as f:
        for key, value in attrs.items():
            f.attrs[key] = value
        f.attrs["layers"] = np.asarray(layers, dtype=np.int64)
        f.attrs["names"] = list(ACTIVATION_NAMES)
        for layer in layers:
            g = f.create_group(f"layer_{layer}")
            g.attrs["layer"] = layer
            for name in ACTIVATION_NAMES:
                d = _dataset(g, name, recorder.stacked(layer, name))
                d.attrs["columns"] = np.asarray(columns[name], dtype=np.int64)
                d.attrs["tp_sharded"] = name in TP_SHARDED
                if name in TP_SHARDED:
                    d.attrs["heads"] = np.asarray(heads, dtype=np.int64)
    os.replace(tmp, path)
    return path


@dataclass(frozen=True, eq=False)  # arrays: no element-wise equality
class ActivationRegion:
    """The part of one step's global activations a rank holds (built by the engine, recorded in
    its dump file's attributes)."""

    step: int                  # 1-based
    rows: np.ndarray           # int64 [rows]: global batch rows, in order
    samples: np.ndarray        # int64 [rows]: the data source's sample index of each row
    positions: np.ndarray      # int64 [S_loc]: global token positions of the chunk, local order
    segments: np.ndarray       # int64 [ranges, 2]: [start, length] of each contiguous range
    heads: tuple[int, int]     # [lo, hi) of the attention heads of this tp rank


def dump_step(recorder: ActivationRecorder, place: RankPlace, region: ActivationRegion,
              cfg: Config) -> Path:
    """Write the dump file of the rank at ``place`` for ``region.step`` under
    ``cfg.train.run_dir``: ``recorder``'s activations, covering ``region`` of the global ones
    (sizes from ``cfg``, the resolved configuration)."""
    m, tr = cfg.model, cfg.train
    c = place.coord
    attrs = dict(
        world_rank=place.rank, world_size=place.world_size,
        grid=np.asarray(place.sizes, dtype=np.int64),
        dp=c.dp, tp=c.tp, pp=c.pp, sp=c.sp, step=int(region.step),
        positions=np.asarray(region.positions, dtype=np.int64),
        segments=np.asarray(region.segments, dtype=np.int64),
        rows=region.rows, samples=region.samples,
        global_batch=tr.global_batch_size, seq_len=tr.seq_len, hidden=m.hidden, heads=m.heads,
        head_dim=m.head_dim, dtype=tr.dtype)
    columns = {n: (0, m.hidden) for n in ACTIVATION_NAMES}
    columns["attention"] = tuple(h * m.head_dim for h in region.heads)
    return write_rank_dump(step_dir(tr.run_dir, region.step) / f"rank_{place.rank}.h5", recorder,
                           attrs, columns, region.heads)


def _rank_files(directory: Path) -> dict[int, Path]:
    found = {}
    for p in directory.iterdir():
        match = _RANK_FILE.fullmatch(p.name)
        if match:
            found[int(match.group(1))] = p
    return found


def load_global(run_dir: str | os.PathLike, step: int, layer: int, name: str) -> np.ndarray:
    """The global activation ``name`` of block ``layer`` at ``step`` (1-based), reassembled from
    every rank's dump: ``[global_batch, seq_len, hidden]``, or ``[global_batch, seq_len,
    heads*head_dim]`` for ``attention``.

    Raises FileNotFoundError if the step was not dumped or a rank's file is missing, and
    ValueError if a file belongs to another run or layout, or no file holds part of the tensor.
    """
    if name not in ACTIVATION_NAMES:
        raise ValueError(f"name={name!r}: must be one of {', '.join(ACTIVATION_NAMES)}")
    directory = step_dir(run_dir, step)
    if not directory.is_dir():
        raise FileNotFoundError(f"no activation dump for step {step}: {directory} does not exist")
    files = _rank_files(directory)
    if 0 not in files:
        raise FileNotFoundError(f"{directory / 'rank_0.h5'} is missing (found "
                                f"{sorted(p.name for p in files.values()) or 'no rank files'})")
    with h5py.File(files[0], "r") as f:
        ref = {k: f.attrs[k] for k in ("world_size", "grid", "step", "global_batch", "seq_len",
                                        "hidden", "heads", "head_dim")}
    world = int(ref["world_size"])
    missing = [f"rank_{r}.h5" for r in range(world) if r not in files]
    if missing:
        raise FileNotFoundError(f"{directory}: the dump of a {world}-rank run lacks "
                                f"{', '.join(missing)}")
    extra = sorted(files[r].name for r in files if r >= world)
    if extra:
        raise ValueError(f"{directory}: {', '.join(extra)} do not belong to the {world}-rank "
                         f"dump of rank_0.h5 (left from another run?); remove them")
    width = int(ref["hidden"]) if name != "attention" else int(ref["heads"] * ref["head_dim"])
    shape = (int(ref["global_batch"]), int(ref["seq_len"]), width)
    out: np.ndarray | None = None
    covered = np.zeros(shape, dtype=bool)
    for r in range(world):
        with h5py.File(files[r], "r") as f:
            for key, want in ref.items():
                if not np.array_equal(f.attrs[key], want):
                    raise ValueError(f"{files[r]}: attribute {key}={f.attrs[key]!r} differs "
                                     f"from rank_0.h5's {want!r} (mixed runs in {directory})")
            group = f.get(f"layer_{int(layer)}")
            if group is None:
                continue
            d = group[name]
            data = d[...]
            rows, pos = f.attrs["rows"], f.attrs["positions"]
            lo, hi = (int(x) for x in d.attrs["columns"])
            if data.shape != (len(rows), len(pos), hi - lo):
                raise ValueError(f"{files[r]}: layer_{layer}/{name} has shape {data.shape}, its "
                                 f"attributes say {(len(rows), len(pos), hi - lo)}")
            if out is None:
                out = np.empty(shape, dtype=data.dtype)
            out[rows[:, None], pos[None, :], lo:hi] = data
            covered[rows[:, None], pos[None, :], lo:hi] = True
    if out is None:
        raise ValueError(f"{directory}: no rank dumped layer {layer}")
    if not covered.all():
        gaps = np.argwhere(~covered)
        raise ValueError(f"{directory}: layer {layer} {name} is incomplete: {len(gaps)} of "
                         f"{covered.size} values are in no rank's file (first at [batch, seq, "
                         f"column] = {gaps[0].tolist()})")
    return out


# ------------------------------------------------------------------------------- offload


class OffloadStore:
    """Saved activations kept in a per-rank HDF5 scratch file between forward and backward.

    :meth:`put` writes every array of a nested structure (dataclasses, dicts, lists, tuples of
    arrays and scalars) as a dataset of group ``/<key>`` and keeps only the structure in memory;
    :meth:`take` reads them back (into NumPy, or CuPy for arrays that were CuPy) and deletes the
    group, so the file holds only what is in flight (HDF5 reuses the freed space). The file is
    created on the first put, removed (with its folder, once empty) by :meth:`close` or when the
    store is garbage-collected.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file: h5py.File | None = None
        self._skeletons: dict[int, Any] = {}
        self._next = 0
        self._finalizer: weakref.finalize | None = None

    def _open(self) -> h5py.File:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = h5py.File(self.path, "w")
            self._finalizer = weakref.finalize(self, _close_and_remove, self._file, self.path)
        return self._file

    def put(self, tree: Any) -> int:
        """Write the arrays of ``tree`` to the scratch file; returns the key for :meth:`take`."""
        key, self._next = self._next, self._next + 1
        group = self._open().create_group(str(key))
        count = [0]

        def encode(node: Any) -> Any:
            if dataclasses.is_dataclass(node):
                return _Record(type(node), {f.name: encode(getattr(node, f.name))
                                            for f in dataclasses.fields(node)})
            if isinstance(node, dict):
                return {k: encode(v) for k, v in node.items()}
            if isinstance(node, (list, tuple)):
                return type(node)(encode(v) for v in node)
            if hasattr(node, "shape") and hasattr(node, "dtype"):
                name = str(count[0])
                count[0] += 1
                _dataset(group, name, to_host(node))
                kind = ("scalar" if isinstance(node, np.generic) else
                        "cupy" if type(node).__module__.startswith("cupy") else "numpy")
                return _Slot(name, kind, node.dtype)
            return node

        self._skeletons[key] = encode(tree)
        return key

    def take(self, key: int) -> Any:
        """The structure stored under ``key``, read back; the scratch copy is deleted."""
        if key not in self._skeletons:
            raise ValueError(f"offload key {key!r}: nothing stored under it (taken already?)")
        group = self._file[str(key)]

        def decode(node: Any) -> Any:
            if isinstance(node, _Record):
                return node.cls(**{k: decode(v) for k, v in node.fields.items()})
            if isinstance(node, dict):
                return {k: decode(v) for k, v in node.items()}
            if isinstance(node, (list, tuple)):
                return type(node)(decode(v) for v in node)
            if isinstance(node, _Slot):
                value = np.asarray(group[node.name][()]).astype(node.dtype, copy=False)
                if node.kind == "cupy":
                    import cupy
                    return cupy.asarray(value)
                return value[()] if node.kind == "scalar" else value
            return node

        tree = decode(self._skeletons.pop(key))
        del self._file[str(key)]
        return tree

    @property
    def in_flight(self) -> int:
        """How many stored structures have not been taken back."""
        return len(self._skeletons)

    def close(self) -> None:
        """Close and remove the scratch file."""
        if self._finalizer is not None:
            self._finalizer()
        self._file, self._finalizer = None, None
        self._skeletons.clear()


class _Record:
    """A dataclass instance of an offloaded structure: its class and encoded fields."""

    __slots__ = ("cls", "fields")

    def __init__(self, cls: type, fields: dict[str, Any]) -> None:
        self.cls, self.fields = cls, fields


class _Slot:
    """Where an array of an offloaded structure went: dataset ``name``; ``kind``: what it was
    ("numpy" array, NumPy "scalar" or "cupy" array); ``dtype``: its dtype (bf16 is stored as
    float32)."""

    __slots__ = ("name", "kind", "dtype")

    def __init__(self, name: str, kind: str, dtype: np.dtype) -> None:
        self.name, self.kind, self.dtype = name, kind, dtype


def _close_and_remove(f: h5py.File, path: Path) -> None:
    """Close and delete the scratch file, and its folder once no rank's file is left in it."""
    try:
        f.close()
    finally:
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()
        except OSError:  # other ranks' scratch files are still there
            pass


def offload_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """The scratch file of ``rank``: ``RUN_DIR/scratch/offload_rank_R_<pid>.h5``."""
    return Path(run_dir) / "scratch" / f"offload_rank_{rank}_{os.getpid()}.h5"
