"""``index.h5``, the description of a checkpoint: written by :func:`write_index`, and accepted only
through :func:`read_index`, which checks every part of it against the schema below.

**Schema.** Root attributes (:data:`ROOT_ATTRS`): ``format`` ("mpipar-checkpoint"),
``format_version`` (1), ``step`` (training steps done), ``optimizer_step``, ``dtype`` (of every
tensor), ``world_size``, ``saved_at``, ``config_toml`` (the resolved config, which must parse).
Groups of attributes: ``layout`` (:data:`LAYOUT_FIELDS`, typed as in
:class:`~mpipar.config.ParallelConfig`), ``lr_schedule`` (the fields of
:class:`.records.LRScheduleState`: the LR schedule is a function of the step), ``data`` (the
fields of :class:`.records.DataCursor`: the sampler is a pure function of (seed, step)), ``rng``
(``seed``, ``note``: initialisation is seeded by (seed, name), so ``seed`` is the whole RNG state),
and ``shards/<file>`` per shard file (``sha256``, ``size``, ``rank``, grid coordinates ``dp tp pp
sp``, ``datasets``: :class:`.records.RankPlace`). Every other root member is a group of tensors of
one kind: ``param``, ``exp_avg``, ``exp_avg_sq`` (required), and with gradient compression and
error feedback the residuals per slot, ``residual_send.<slot>`` and ``residual_gather``
(:mod:`mpipar.parallel.data_parallel`), with top-k's catch-up the wait counts ``idle_steps``
(:func:`mpipar.training.optim.adamw_catch_up`). Auxiliary-loss-free balancing adds the optional
group ``moe_bias`` of attributes, ``layers.<i>`` per sparse block: its routing bias, ``E``
float64 values (:class:`mpipar.model.moe.RoutingBias`; the same on every rank, so recorded once
here rather than in the shards, and any layout reads it whole). A DPO run (``--objective dpo``)
adds the plain dataset ``dpo_reference``: the reference log-probabilities of every row of its
training pairs, two finite float64 values per pair (at most ``data.num_samples``)
(:class:`mpipar.training.objective.Preference`; the same on every rank, so recorded once here).
Every tensor group holds one virtual dataset per parameter, in forward order, of its global shape
(1-D or 2-D) and the index's dtype; every kind holds the same names and shapes.

**Mappings.** A tensor's virtual dataset maps rectangles of it to whole datasets
``<kind>/<name>/<k>`` of the shard files; together they tile it (every element held by exactly one
mapping). Source files are named relative
to the checkpoint directory (a renamed or copied directory still works).

**What is refused** (CheckpointError naming the index and the field or dataset): a missing or
mistyped attribute or group, a group where a tensor belongs (or the reverse), a dataset that is not
virtual, a soft or external link anywhere, a mapping whose source is not one of the shard files
``shards`` records (an absolute path, ``..``, another directory, the index itself), selects part
of its source, is not a rectangle, or names another tensor's dataset, and mappings that do not
tile the tensor. HDF5 reads a virtual dataset's missing source as its fill value, so mpipar
never reads through the virtual datasets: :mod:`.reader` reads each mapping's source dataset from
its shard file, which must exist and be a plain dataset (:func:`.reader.verify`).
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import re
import sys
import time
import typing
from pathlib import Path
from typing import Any

import h5py
import numpy as np

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from mpipar.checkpoint.directory import INDEX, INDEX_SUM, SHARD_FILE, CheckpointError, fsync_dir
from mpipar.checkpoint.directory import fsync_file, require_own_dir, require_own_file, sha256_file
from mpipar.checkpoint.records import AXES, DataCursor, LRScheduleState, RunPosition
from mpipar.checkpoint.shards import RankState, Slices
from mpipar.config import Config, ParallelConfig

FORMAT = "mpipar-checkpoint"
FORMAT_VERSION = 1
KINDS = ("param", "exp_avg", "exp_avg_sq")
"""The tensor kinds every checkpoint holds; residual and wait-count kinds may follow."""
LAYOUT_FIELDS = ("dp", "tp", "pp", "sp", "virtual_stages", "schedule", "zero", "sp_split",
                 "sp_mode", "tp_sequence_parallel", "ranks_per_node", "dp_reduce",
                 "grad_compression")
ROOT_ATTRS = {"format": str, "format_version": int, "step": int, "optimizer_step": int,
              "dtype": str, "world_size": int, "saved_at": str, "config_toml": str}
SHARD_ATTRS = {"sha256": str, "size": int, "rank": int, **{axis: int for axis in AXES},
               "datasets": int}
METADATA = ("layout", "lr_schedule", "data", "rng", "shards", "moe_bias", "dpo_reference")
"""The root members that are not groups of tensors."""
_KIND_NAME = re.compile(r"^[a-z_]+(\.\d+)?$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ACCEPTS = {str: (str,), int: (int, np.integer), bool: (bool, np.bool_),
            float: (int, float, np.integer, np.floating)}
_TYPE_WORDS = {str: "UTF-8 text", int: "an integer", bool: "a boolean", float: "a finite number"}
HDF5_ERRORS = (OSError, RuntimeError, KeyError, TypeError, ValueError)
"""What h5py raises on metadata it cannot read (a damaged or crafted file)."""


def _is_text(value: str) -> bool:
    """Whether ``value`` is UTF-8 text (h5py hands undecodable bytes over as surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _field_types(cls: type, names: tuple[str, ...] | None = None) -> dict[str, type]:
    """The types of the fields ``names`` (default: all, in order) of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return {name: hints[name] for name in names or [f.name for f in dataclasses.fields(cls)]}


GROUP_ATTRS = {"layout": _field_types(ParallelConfig, LAYOUT_FIELDS),
               "lr_schedule": _field_types(LRScheduleState), "data": _field_types(DataCursor),
               "rng": {"seed": int, "note": str}}
"""The attributes, and their types, of each group of attributes but ``shards``."""


@dataclasses.dataclass(frozen=True)
class Mapping:
    """A rectangle of a global tensor and the shard dataset holding it (of the same shape)."""

    region: Slices        # the rectangle, slices with start and stop
    file: str             # a shard file the index records, named inside the checkpoint
    dataset: str          # ``<kind>/<name>/<k>`` in it

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.region)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One global tensor of an index: its shape and the rectangles that tile it."""

    shape: tuple[int, ...]
    mappings: tuple[Mapping, ...]


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """What the index records of one shard file."""

    file: str
    sha256: str
    size: int
    rank: int
    coord: tuple[int, int, int, int]   # (dp, tp, pp, sp)
    datasets: int


@dataclasses.dataclass(frozen=True)
class Index:
    """A checkpoint's index as checked against the schema: plain Python values, no HDF5."""

    file: Path                                   # the index.h5 read
    attrs: dict[str, Any]                        # the :data:`ROOT_ATTRS`
    groups: dict[str, dict[str, Any]]            # the :data:`GROUP_ATTRS`
    config: Config                               # parsed from ``config_toml``
    shards: dict[str, ShardRecord]               # by file name
    tensors: dict[str, dict[str, Tensor]]        # kind -> name -> tensor, forward order
    moe_bias: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # by block
    dpo_reference: np.ndarray | None = None      # a DPO run's reference log-probabilities

    @property
    def step(self) -> int:
        return self.attrs["step"]

    @property
    def optimizer_step(self) -> int:
        return self.attrs["optimizer_step"]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.attrs["dtype"])

    def tensor(self, kind: str, name: str) -> Tensor:
        """The tensor ``kind/name``; CheckpointError when the index has none."""
        tensor = self.tensors.get(kind, {}).get(name)
        if tensor is None:
            raise CheckpointError(f"{self.file}: has no {kind}/{name}; the model needs it")
        return tensor


# ------------------------------------------------------------------------------ writing
def kinds_of(records: list[dict]) -> tuple[str, ...]:
    """:data:`KINDS`, then the other kinds (residuals) the shards' ``records`` hold, sorted."""
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
    for kind in kinds_of(records):
        for name, shape in shapes.items():
            got, want = covered.get((kind, name), 0), math.prod(shape)
            if got != want:
                raise CheckpointError(f"{kind}/{name}: the shards hold {got} of its {want} "
                                      f"elements; the ranks' state pieces do not tile it")
    return layouts


def write_index(tmp: Path, state: RankState, position: RunPosition, records: list[dict]) -> None:
    """Build ``index.h5`` (virtual datasets over the shards of ``records``, the metadata of
    ``position``) and ``index.sha256`` in ``tmp``. ``records``: per shard file its ``file``,
    ``sha256``, ``size``, ``rank``, ``coord`` and ``blocks`` ``(kind, name, dataset, global
    start, shape)``."""
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
        for key in LAYOUT_FIELDS:
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
        if position.moe_bias:
            bias = f.create_group("moe_bias").attrs
            for i, value in position.moe_bias.items():
                bias[f"layers.{i}"] = np.asarray(value, dtype=np.float64)
        if position.dpo_reference is not None:
            f.create_dataset("dpo_reference", data=np.asarray(position.dpo_reference, np.float64))
        for kind in kinds_of(records):
            group = f.create_group(kind, track_order=True)  # forward order, as param_specs
            for name in state.shapes:
                group.create_virtual_dataset(name, layouts[(kind, name)], fillvalue=np.nan)
    fsync_file(index)
    summary = tmp / INDEX_SUM
    summary.write_text(f"{sha256_file(index)}  {INDEX}\n")
    fsync_file(summary)
    fsync_dir(tmp)


# ------------------------------------------------------------------------------ reading
def read_index(path: Path) -> Index:
    """The index of the checkpoint directory ``path``, checked against the schema (module
    docstring); CheckpointError naming the file and the field or dataset otherwise. Reads
    metadata only: no shard is opened, no checksum computed."""
    require_own_dir(path)
    index = path / INDEX
    require_own_file(index)
    try:
        f = h5py.File(index, "r")
    except HDF5_ERRORS as exc:
        raise CheckpointError(f"{index}: cannot be opened as HDF5 ({exc})") from None
    try:
        with f:
            return _Schema(index, f).read()
    except CheckpointError:
        raise
    except HDF5_ERRORS as exc:
        raise CheckpointError(f"{index}: unreadable HDF5 metadata ({type(exc).__name__}: "
                              f"{exc})") from None


class _Schema:
    """One pass over an open index, raising CheckpointError at the first departure."""

    def __init__(self, index: Path, f: h5py.File) -> None:
        self.index, self.f = index, f

    def fail(self, what: str) -> typing.NoReturn:
        raise CheckpointError(f"{self.index}: {what}")

    def read(self) -> Index:
        attrs = self.attrs(self.f, ROOT_ATTRS, "")
        if attrs["format"] != FORMAT:
            self.fail(f"format is {attrs['format']!r:.60}: not an mpipar checkpoint index")
        if attrs["format_version"] != FORMAT_VERSION:
            self.fail(f"format_version is {attrs['format_version']}; this mpipar reads version "
                      f"{FORMAT_VERSION}")
        for key, least in (("step", 0), ("optimizer_step", 0), ("world_size", 1)):
            if attrs[key] < least:
                self.fail(f"{key} is {attrs[key]}, must be >= {least}")
        try:
            dtype = np.dtype(attrs["dtype"])
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind != "f":
            self.fail(f"dtype is {attrs['dtype']!r:.60}, must name a floating-point dtype")
        config = self.config(attrs["config_toml"])
        groups = {name: self.attrs(self.member(self.f, name, h5py.Group, name), fields,
                                   f"{name}.")
                  for name, fields in GROUP_ATTRS.items()}
        shards = self.shards(attrs["world_size"])
        tensors = self.tensors(dtype, shards)
        return Index(self.index, attrs, groups, config, shards, tensors, self.moe_bias(config),
                     self.dpo_reference(config, groups["data"]["num_samples"]))

    def moe_bias(self, config: Config) -> dict[int, np.ndarray]:
        """The optional ``moe_bias`` group: per sparse block of the model, ``E`` finite
        float64 values (module docstring)."""
        if "moe_bias" not in self.f:
            return {}
        group, m, out = self.member(self.f, "moe_bias", h5py.Group, "moe_bias"), config.model, {}
        for key in group.attrs:
            where = f"moe_bias.{key}"
            block = re.fullmatch(r"layers\.(\d+)", key)
            if block is None or not m.is_sparse(int(block[1])):
                self.fail(f"attribute {where}: not a sparse block of the model (layers.<i>)")
            value = np.asarray(group.attrs[key])
            if (value.dtype != np.float64 or value.shape != (m.moe_experts,)
                    or not np.isfinite(value).all()):
                self.fail(f"attribute {where} must be {m.moe_experts} finite float64 values")
            out[int(block[1])] = value
        return out

    def dpo_reference(self, config: Config, rows: int) -> np.ndarray | None:
        """The optional ``dpo_reference`` dataset of a DPO run: a plain 1-D dataset of finite
        float64 values, one per row of its pairs, two per pair, at most ``rows`` (the ``data``
        group's ``num_samples``; module docstring)."""
        if "dpo_reference" not in self.f:
            return None
        where = "dpo_reference"
        data = self.member(self.f, where, h5py.Dataset, where)
        if config.train.objective != "dpo":
            self.fail(f"{where}: a DPO run's, but the run's train.objective is "
                      f"{config.train.objective!r}")
        if (data.is_virtual or data.dtype != np.float64 or data.ndim != 1 or data.size % 2
                or data.size > rows):
            self.fail(f"{where} must be a plain 1-D dataset of float64 values, two per pair, "
                      f"at most data.num_samples={rows}")
        value = np.asarray(data[()])
        if not np.isfinite(value).all():
            self.fail(f"{where} must hold finite values")
        return value

    def member(self, group: h5py.Group, name: str, want: type, where: str) -> Any:
        """``group[name]``, which must be reached by a hard link and be a ``want``."""
        link = group.get(name, getlink=True)
        if link is None:
            self.fail(f"{where} is missing")
        if not isinstance(link, h5py.HardLink):
            what = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
            self.fail(f"{where} is {what}; an index holds only its own objects")
        obj = group[name]
        if not isinstance(obj, want):
            self.fail(f"{where} is a {type(obj).__name__.lower()}, must be a "
                      f"{want.__name__.lower()}")
        return obj

    def attrs(self, obj: Any, fields: dict[str, type], prefix: str) -> dict[str, Any]:
        """The attributes ``fields`` of ``obj``, each of its type, as Python values."""
        out = {}
        for key, kind in fields.items():
            where = f"{prefix}{key}"
            try:
                value = obj.attrs[key] if key in obj.attrs else None
            except HDF5_ERRORS as exc:
                self.fail(f"attribute {where} cannot be read ({type(exc).__name__}: {exc})")
            if value is None:
                self.fail(f"attribute {where} is missing")
            ok = isinstance(value, _ACCEPTS[kind]) and (
                kind is bool or not isinstance(value, (bool, np.bool_)))
            if ok and kind is float:
                ok = math.isfinite(value)
            if ok and kind is str:
                ok = _is_text(value)
            if not ok:
                self.fail(f"attribute {where} is {value!r:.60}, must be {_TYPE_WORDS[kind]}")
            out[key] = kind(value)
        return out

    def config(self, text: str) -> Config:
        try:
            return Config.from_dict(tomllib.loads(text), source=f"{self.index} (config_toml)")
        except (ValueError, TypeError) as exc:  # TOMLDecodeError, ConfigError and the like
            self.fail(f"attribute config_toml is not an mpipar configuration ({exc})")

    def shards(self, world_size: int) -> dict[str, ShardRecord]:
        group = self.member(self.f, "shards", h5py.Group, "shards")
        out = {}
        for file in group:
            where = f"shards/{file}"
            if not SHARD_FILE.match(file):
                self.fail(f"{where}: a shard must be a file of the checkpoint directory named "
                          f"like shard_00000.h5")
            a = self.attrs(self.member(group, file, h5py.Group, where), SHARD_ATTRS, f"{where}.")
            if not _SHA256.match(a["sha256"]):
                self.fail(f"attribute {where}.sha256 is {a['sha256']!r:.70}, not a sha256")
            bad = next((k for k in SHARD_ATTRS if k not in ("sha256", "rank") and a[k] < 0),
                       None)
            if bad or not 0 <= a["rank"] < world_size:
                key = bad or "rank"
                self.fail(f"attribute {where}.{key} is {a[key]}, out of range")
            out[file] = ShardRecord(file, a["sha256"], a["size"], a["rank"],
                                    tuple(a[axis] for axis in AXES), a["datasets"])
        return out

    def tensors(self, dtype: np.dtype, shards: dict[str, ShardRecord]
                ) -> dict[str, dict[str, Tensor]]:
        """Every tensor group's tensors, checked; the shards' dataset counts against them."""
        kinds = [k for k in self.f if k not in METADATA]
        missing = [k for k in KINDS if k not in kinds]
        if missing:
            self.fail(f"{missing[0]} is missing")
        out = {}
        for kind in kinds:
            if not _KIND_NAME.match(kind):
                self.fail(f"{kind!r:.60}: not a tensor kind (lower-case letters, '_', an "
                          f"optional .<slot>)")
            group = self.member(self.f, kind, h5py.Group, kind)
            out[kind] = {name: self.tensor(group, kind, name, dtype, shards) for name in group}
        want = {name: t.shape for name, t in out["param"].items()}
        for kind, tensors in out.items():
            if {name: t.shape for name, t in tensors.items()} != want:
                self.fail(f"{kind} holds other tensors or shapes than param")
        counts = {file: 0 for file in shards}
        for tensors in out.values():
            for tensor in tensors.values():
                for m in tensor.mappings:
                    counts[m.file] += 1
        for file, record in shards.items():
            if counts[file] != record.datasets:
                self.fail(f"attribute shards/{file}.datasets is {record.datasets}, but "
                          f"{counts[file]} mappings name the file")
        return out

    def tensor(self, group: h5py.Group, kind: str, name: str, dtype: np.dtype,
               shards: dict[str, ShardRecord]) -> Tensor:
        where = f"{kind}/{name}"
        ds = self.member(group, name, h5py.Dataset, where)
        shape = ds.shape
        if shape is None or len(shape) not in (1, 2) or 0 in shape:
            self.fail(f"{where} has shape {shape}; a tensor is 1-D or 2-D and not empty")
        if ds.dtype != dtype:
            self.fail(f"{where} has dtype {ds.dtype}, the index's dtype is {dtype}")
        if not ds.is_virtual:
            self.fail(f"{where} is not a virtual dataset; the index holds no tensor data")
        mappings = tuple(self.mapping(vds, where, shape, shards)
                         for vds in ds.virtual_sources())
        covered = sum(math.prod(m.shape) for m in mappings)
        if covered != math.prod(shape):
            self.fail(f"{where}: its mappings cover {covered} elements, the tensor has "
                      f"{math.prod(shape)}")
        twice = overlap([m.region for m in mappings])
        if twice is not None:
            self.fail(f"{where}: two mappings hold the same elements ({twice[0]} and "
                      f"{twice[1]}), so others hold none")
        return Tensor(tuple(shape), mappings)

    def mapping(self, vds: Any, where: str, shape: tuple[int, ...],
                shards: dict[str, ShardRecord]) -> Mapping:
        """One mapping of ``where`` (an h5py VDSmap), checked (module docstring)."""
        file, dataset, vspace, source = vds.file_name, vds.dset_name, vds.vspace, vds.src_space
        if file not in shards:
            self.fail(f"{where} maps a region to {file!r:.80}, which is not one of the shard "
                      f"files the index records; a checkpoint is read only from its own shards")
        if not re.fullmatch(re.escape(where) + r"/\d+", dataset):
            self.fail(f"{where} maps a region to dataset {dataset!r:.80} of {file}; its "
                      f"datasets are {where}/<k>")
        if source.get_select_type() != h5py.h5s.SEL_ALL:
            self.fail(f"{where}: its mapping from {file} {dataset} selects part of the source; "
                      f"a mapping takes a whole dataset")
        if vspace.shape != shape or vspace.get_select_type() != h5py.h5s.SEL_HYPERSLABS:
            self.fail(f"{where}: its mapping from {file} {dataset} is not a region of it")
        lo, hi = vspace.get_select_bounds()
        region = tuple(slice(a, b + 1) for a, b in zip(lo, hi))
        if not all(0 <= s.start < s.stop <= n for s, n in zip(region, shape)) or (
                vspace.get_select_npoints() != math.prod(s.stop - s.start for s in region)):
            self.fail(f"{where}: its mapping from {file} {dataset} is not a rectangle")
        return Mapping(region, file, dataset)


def overlap(regions: list[Slices]) -> tuple[Slices, Slices] | None:
    """Two of ``regions`` (rectangles of one 1-D or 2-D tensor) that share an element, or None.

    A sweep over the first axis: the rectangles that span one row hold disjoint column ranges,
    kept sorted, so each new one is checked against its two neighbours; O(n log n) for n
    rectangles (a ZeRO checkpoint of many ranks maps thousands per tensor)."""
    if regions and len(regions[0]) == 1:
        regions = [(r[0], slice(0, 1)) for r in regions]
    active: list[tuple[int, int, int]] = []         # (column start, stop, id), sorted
    ending: list[tuple[int, int, int, int]] = []    # heap of (row stop, column start, stop, id)
    order = sorted(range(len(regions)), key=lambda i: (regions[i][0].start, regions[i][1].start))
    for i in order:
        rows, cols = regions[i]
        while ending and ending[0][0] <= rows.start:
            _, c0, c1, j = heapq.heappop(ending)
            active.pop(bisect.bisect_left(active, (c0, c1, j)))
        k = bisect.bisect_left(active, (cols.start, cols.stop, i))
        for n in (k - 1, k):
            if 0 <= n < len(active) and active[n][0] < cols.stop and cols.start < active[n][1]:
                j = active[n][2]
                return regions[j], regions[i]
        active.insert(k, (cols.start, cols.stop, i))
        heapq.heappush(ending, (rows.stop, cols.start, cols.stop, i))
    return None
