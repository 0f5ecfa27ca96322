"""Reading a checkpoint: verify it whole, then read global regions straight from its shard files.

**Verify.** :func:`verify` checks, before anything is read, that ``index.h5`` matches
``index.sha256``, that the index follows its schema (:func:`.index.read_index`: among others,
every mapping's source is one of the shard files it records), that every recorded shard is
present with its recorded size and sha256, and that every dataset a mapping names is a plain
dataset of its shard: reached by hard links, stored in the file (no external storage, not
virtual), of the mapping's shape and the index's dtype. Damage (a missing, truncated or
corrupted file) comes back as problems, the datasets that fail their fletcher32 checksums named;
a malformed index or shard, or a file that is a symbolic link, raises CheckpointError. Ranks
that verify together (:class:`Peers`: ``train`` at its start) each hash and check every
``size``-th shard file and gather their verdicts, so a checkpoint is read once per job, not
once per rank; the answer is the one a rank verifying alone gets (which of several malformed
datasets is named may differ).

**Read.** :class:`ShardFiles` reads a region of a global tensor from the datasets of the mappings
that overlap it, opening the shard files itself. It never reads through the virtual datasets
(HDF5 returns a missing source there as the fill value), so a shard removed after verification
(``--keep-last`` pruning while another process reads) fails the read, naming the file.

**Resume.** :func:`resolve_resume` with "auto" tries the checkpoint ``latest`` names, then the
others newest first, and takes the first that verifies. :func:`load` reads, for each tensor, the
region of the global tensor this rank's shard covers, so any layout loads any checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpipar.checkpoint.directory import (INDEX, INDEX_SUM, CheckpointError, latest,
                                         list_checkpoints, require_own_file, resolve_path,
                                         sha256_file)
from mpipar.checkpoint.index import HDF5_ERRORS, KINDS, Index, Mapping, read_index
from mpipar.checkpoint.records import LRScheduleState, RunPosition
from mpipar.checkpoint.shards import NonFiniteError, RankState, Reader, Slices
from mpipar.config import Config, ConfigError, ModelConfig

_FILTERS = {h5py.h5z.FILTER_FLETCHER32: "fletcher32", h5py.h5z.FILTER_SHUFFLE: "shuffle",
            h5py.h5z.FILTER_DEFLATE: "deflate"}
"""The HDF5 filters a shard dataset may use (built into HDF5: no plugin is loaded)."""
_LAYOUTS = (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED, h5py.h5d.COMPACT)
"""The storage layouts of a dataset whose data lies in its own file."""


# ------------------------------------------------------------------------------ shard files
class ShardFiles:
    """The shard files of a checkpoint whose index is ``index``, opened on first use; reads
    regions of its global tensors (:meth:`read` is a :data:`~.shards.Reader`). Use as a context
    manager: the files are closed at exit."""

    def __init__(self, path: Path, index: Index) -> None:
        self.path, self.index = path, index
        self.files: dict[str, h5py.File] = {}
        self.datasets: dict[tuple[str, str], h5py.Dataset] = {}

    def __enter__(self) -> ShardFiles:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.datasets.clear()
        for f in self.files.values():
            f.close()
        self.files.clear()

    def _file(self, name: str) -> h5py.File:
        if name not in self.files:
            file = self.path / name
            require_own_file(file)
            try:
                f = h5py.File(file, "r")
            except OSError as exc:
                raise CheckpointError(f"{file}: cannot be opened ({exc}); the checkpoint "
                                      f"verified with it, so it was removed or replaced since "
                                      f"(pruned by a run's --keep-last?)") from None
            self.files[name] = f
            size = os.fstat(f.id.get_vfd_handle()).st_size
            if size != self.index.shards[name].size:
                raise CheckpointError(f"{file}: {size} bytes, the index records "
                                      f"{self.index.shards[name].size}: replaced since the "
                                      f"checkpoint verified")
        return self.files[name]

    def dataset(self, m: Mapping) -> h5py.Dataset:
        """The source dataset of ``m``, checked to be a plain dataset of its shard file."""
        key = (m.file, m.dataset)
        if key not in self.datasets:
            try:
                self.datasets[key] = self._plain(m)
            except CheckpointError:
                raise
            except HDF5_ERRORS as exc:
                raise CheckpointError(f"{self.path / m.file}: dataset {m.dataset}: unreadable "
                                      f"HDF5 metadata ({type(exc).__name__}: {exc})") from None
        return self.datasets[key]

    def _plain(self, m: Mapping) -> h5py.Dataset:
        where = f"{self.path / m.file}: dataset {m.dataset}"
        obj: Any = self._file(m.file)
        for part in m.dataset.split("/"):
            link = obj.get(part, getlink=True) if isinstance(obj, h5py.Group) else None
            if link is None:
                raise CheckpointError(f"{where} is missing")
            if not isinstance(link, h5py.HardLink):
                raise CheckpointError(f"{where}: {part} is a soft or external link; a shard "
                                      f"holds only its own objects")
            obj = obj[part]
        if not isinstance(obj, h5py.Dataset):
            raise CheckpointError(f"{where} is a {type(obj).__name__.lower()}, not a dataset")
        if obj.is_virtual or obj.external:
            how = "a virtual dataset" if obj.is_virtual else "stored outside the file"
            raise CheckpointError(f"{where} is {how}; a shard's data lies in the shard file")
        plist = obj.id.get_create_plist()
        filters = {plist.get_filter(i)[0] for i in range(plist.get_nfilters())}
        if plist.get_layout() not in _LAYOUTS or not filters <= set(_FILTERS):
            raise CheckpointError(f"{where}: its storage layout or filters ({sorted(filters)}) "
                                  f"are not plain HDF5 (filters {', '.join(_FILTERS.values())})")
        if obj.dtype != self.index.dtype or obj.shape != m.shape:
            raise CheckpointError(f"{where} is {obj.dtype} {obj.shape}; the index maps it as "
                                  f"{self.index.dtype} {m.shape}")
        return obj

    def check(self, files: set[str] | None = None) -> None:
        """Every mapping's source dataset (of the shard ``files`` only, when given), checked
        (:meth:`dataset`)."""
        for tensors in self.index.tensors.values():
            for tensor in tensors.values():
                for m in tensor.mappings:
                    if files is None or m.file in files:
                        self.dataset(m)

    def read(self, kind: str, name: str, region: Slices) -> np.ndarray:
        """``region`` of the global tensor ``kind/name``, in the index's dtype, from the shard
        datasets of the mappings it overlaps; CheckpointError naming the file and dataset when
        one fails."""
        tensor = self.index.tensor(kind, name)
        where = f"{self.index.file}: {kind}/{name}"
        if len(region) != len(tensor.shape) or not all(
                s.step in (None, 1) and None not in (s.start, s.stop)
                and 0 <= s.start <= s.stop and (s.start == s.stop or s.stop <= n)
                for s, n in zip(region, tensor.shape)):
            raise CheckpointError(f"{where} has shape {tensor.shape}; the model reads "
                                  f"{region} of it")
        out = np.empty(tuple(s.stop - s.start for s in region), self.index.dtype)
        for m in tensor.mappings:  # they tile the tensor (.index.read_index): out is covered
            lo = [max(q.start, r.start) for q, r in zip(region, m.region)]
            hi = [min(q.stop, r.stop) for q, r in zip(region, m.region)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            src = tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, m.region))
            dst = tuple(slice(a - q.start, b - q.start) for a, b, q in zip(lo, hi, region))
            source = self.dataset(m)
            try:
                out[dst] = source[src]
            except OSError as exc:
                raise CheckpointError(f"{self.path / m.file}: reading dataset {m.dataset} "
                                      f"failed: {exc}") from None
        return out


# ------------------------------------------------------------------------------ verify
_VERIFIED: dict[tuple, tuple[tuple[str, ...], Index | None] | CheckpointError] = {}


def forget_verified() -> None:
    """Forget what this process verified: the next check reads and hashes the files again."""
    _VERIFIED.clear()


@dataclasses.dataclass(frozen=True)
class Peers:
    """The ranks that verify a checkpoint together (:func:`verify`): this rank's number, their
    count, and an all-gather among them (every rank's object, in rank order, on every rank:
    ``comm.allgather`` of mpi4py or a group's ``allgather_object``)."""

    rank: int
    size: int
    allgather: Callable[[Any], list[Any]]

    @classmethod
    def of(cls, comm: Any) -> Peers:
        """The ranks of ``comm``, an mpi4py communicator."""
        return cls(comm.Get_rank(), comm.Get_size(), comm.allgather)


def _signature(path: Path) -> tuple:
    """What changes when any entry of the directory changes (name, size, mtime, inode)."""
    out = []
    for entry in os.scandir(path):
        st = entry.stat(follow_symlinks=False)
        out.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(out))


def _cache_key(path: Path) -> tuple:
    """Where :data:`_VERIFIED` keeps ``path``'s answer: the directory and its entries as now."""
    return str(path.resolve()), _signature(path)


def verify(path: str | os.PathLike, peers: Peers | None = None) -> list[str]:
    """Problems that make the checkpoint at ``path`` unusable (empty list: it is sound); raises
    CheckpointError, naming the file and the field or dataset, when its index or a shard is
    malformed or reaches outside the directory (module docstring).

    The answer is cached per directory state (names, sizes, mtimes, inodes), so repeating it
    costs one ``stat`` per file. With ``peers`` (more than one), every one of them must call it
    with the same ``path``: each reads the index and checks every ``size``-th shard file (size,
    sha256, datasets) instead of all of them, and one all-gather gives every rank the same
    answer (the cache is filled, never consulted, so the ranks always meet)."""
    return list(_verified(Path(path), peers)[0])


def _verified(path: Path, peers: Peers | None = None) -> tuple[tuple[str, ...], Index | None]:
    """(:func:`verify`'s problems, the index when there are none), cached; together with more
    than one peer, :func:`_verified_together`."""
    if peers is not None and peers.size > 1:
        return _verified_together(path, peers)
    if not path.is_dir():
        return (f"{path}: no such checkpoint directory",), None
    key = _cache_key(path)
    if key not in _VERIFIED:
        try:
            _VERIFIED[key] = _verify(path)
        except CheckpointError as exc:
            _VERIFIED[key] = exc
    return _answer(_VERIFIED[key])


def _answer(found: tuple[tuple[str, ...], Index | None] | CheckpointError
            ) -> tuple[tuple[str, ...], Index | None]:
    if isinstance(found, CheckpointError):
        raise CheckpointError(str(found))
    return found


def _head(path: Path) -> tuple[tuple[str, ...], Index | None]:
    """The index's problems (missing, its sha256) or the index read against its schema."""
    if not path.is_dir():
        return (f"{path}: no such checkpoint directory",), None
    index, summary = path / INDEX, path / INDEX_SUM
    for file in (index, summary):
        require_own_file(file)
    if not index.is_file():
        return (f"{index}: missing (the checkpoint was never committed)",), None
    if not summary.is_file():
        return (f"{summary}: missing",), None
    recorded = summary.read_bytes().decode("utf-8", errors="replace").split()
    if not recorded or recorded[0] != sha256_file(index):
        return (f"{index}: sha256 does not match {INDEX_SUM} (the index is corrupted)",), None
    return (), read_index(path)


def _shard_problem(path: Path, index: Index, name: str) -> str | None:
    """What is wrong with the shard file ``name`` (missing, its size, its sha256), or None;
    CheckpointError when it is a symbolic link."""
    file, record = path / name, index.shards[name]
    require_own_file(file)
    if not file.is_file():
        return f"{file}: missing shard"
    actual = file.stat().st_size
    if actual != record.size:
        how = "truncated" if actual < record.size else "longer than written"
        return f"{file}: {actual} bytes, the index records {record.size} ({how})" + _damage(file)
    digest = sha256_file(file)
    if digest != record.sha256:
        return (f"{file}: sha256 {digest[:16]}... does not match the recorded "
                f"{record.sha256[:16]}... (corrupted)" + _damage(file))
    return None


def _verify(path: Path) -> tuple[tuple[str, ...], Index | None]:
    problems, found = _head(path)
    if found is None:
        return problems, None
    problems = tuple(p for p in (_shard_problem(path, found, name)
                                 for name in sorted(found.shards)) if p is not None)
    if problems:
        return problems, None
    with ShardFiles(path, found) as files:
        files.check()
    return (), found


def _failure(exc: BaseException, path: Path | None = None) -> str:
    """A CheckpointError's message; another exception named by its type (after ``path``)."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    return f"{path}: " * (path is not None) + f"{type(exc).__name__}: {exc}"


def _my_part(path: Path, peers: Peers) -> tuple[dict[str, Any], Index | None]:
    """This rank's share of :func:`_verify`, as a verdict to gather; it never raises, so every
    rank reaches the all-gather. Shards are dealt by their sorted position."""
    part: dict[str, Any] = {"head": None, "error": None, "problems": [], "check": None}
    try:
        problems, found = _head(path)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the all-gather
        part["head"] = ("error", _failure(exc, path))
        return part, None
    if found is None:
        part["head"] = ("problems", problems)
        return part, None
    mine = sorted(found.shards)[peers.rank::peers.size]
    for i, name in enumerate(mine):
        order = peers.rank + i * peers.size
        try:
            problem = _shard_problem(path, found, name)
        except Exception as exc:  # noqa: BLE001
            part["error"] = (order, _failure(exc, path))
            return part, found
        if problem is not None:
            part["problems"].append((order, problem))
    if not part["problems"]:
        try:
            with ShardFiles(path, found) as files:
                files.check(set(mine))
        except Exception as exc:  # noqa: BLE001
            part["check"] = _failure(exc, path)
    return part, found


def _verified_together(path: Path, peers: Peers) -> tuple[tuple[str, ...], Index | None]:
    """:func:`_verify` shared among ``peers``: the same answer on every rank, in the order one
    rank gives (the index's fault first, then a malformed shard file, then the damaged shards
    in sorted order, then a malformed dataset: the first one a rank found, lowest rank first)."""
    part, found = _my_part(path, peers)
    parts = peers.allgather(part)
    answer: tuple[tuple[str, ...], Index | None] | CheckpointError = ((), found)
    head = next((p["head"] for p in parts if p["head"] is not None), None)
    errors = sorted(p["error"] for p in parts if p["error"] is not None)
    problems = sorted(pr for p in parts for pr in p["problems"])
    checks = [p["check"] for p in parts if p["check"] is not None]
    if head is not None:
        answer = CheckpointError(head[1]) if head[0] == "error" else (tuple(head[1]), None)
    elif errors:
        answer = CheckpointError(errors[0][1])
    elif problems:
        answer = (tuple(msg for _, msg in problems), None)
    elif checks:
        answer = CheckpointError(checks[0])
    with contextlib.suppress(OSError):   # the directory as it is now: cached, for later checks
        _VERIFIED[_cache_key(path)] = answer
    return _answer(answer)


def _damage(file: Path) -> str:
    """Which datasets of a damaged shard fail to read (fletcher32), as a message suffix."""
    bad: list[str] = []
    try:
        with h5py.File(file, "r") as f:
            def check(name: str, obj: Any) -> None:
                if isinstance(obj, h5py.Dataset) and not (obj.is_virtual or obj.external):
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


def require_sound(path: Path, peers: Peers | None = None) -> Index:
    """The index of the checkpoint directory ``path`` once it verifies (together with ``peers``,
    as :func:`verify`); CheckpointError naming what does not."""
    problems, index = _verified(path, peers)
    if problems:
        raise CheckpointError(f"checkpoint {path} failed verification: " + "; ".join(problems))
    return index


def require_config_shapes(path: Path, index: Index) -> None:
    """Every tensor the checkpoint's config implies is stored with that shape, before any is
    read (metadata only): a crafted index declaring a huge tensor over a small model, or a config
    claiming a model its tensors are not, is refused naming the tensor (a LoRA run's: its
    adapters, the frozen base being no state of the run). CheckpointError."""
    from mpipar.layout import resolve_model
    from mpipar.model.lora import Lora
    from mpipar.model.params import param_specs
    stored = index.tensors.get("param", {})
    model = index.config.model
    if model.layers > len(stored):
        raise CheckpointError(f"{path}: its config claims {model.layers:,} layers, but it "
                              f"stores {len(stored)} parameter tensors")
    lora = Lora.of(index.config.train)
    implied = {a.name: a.shape for spec in param_specs(resolve_model(model))
               for a in ([spec] if lora is None else lora.specs(spec))}
    for kind in sorted(index.tensors, key=lambda k: k != "param"):
        for name, tensor in index.tensors[kind].items():
            if implied.get(name) != tuple(tensor.shape):
                want = (f"implies {list(implied[name])}" if name in implied
                        else "implies no such tensor")
                raise CheckpointError(f"{path}: {kind}/{name} has shape {list(tensor.shape)}, "
                                      f"but the checkpoint's config {want}")
    missing = sorted(set(implied) - set(stored))
    if missing:
        raise CheckpointError(f"{path}: param/{missing[0]} is missing, but the checkpoint's "
                              f"config implies {list(implied[missing[0]])}")


def require_memory(need: int, what: str) -> None:
    """Refuse (CheckpointError) reading ``need`` bytes at once for ``what`` when this node has
    less memory available, before anything is allocated."""
    from mpipar.runtime.host_memory import available_memory_bytes
    available = available_memory_bytes()
    if available is not None and need > available:
        raise CheckpointError(f"{what} needs {need / 2**30:,.2f} GiB of memory at once; this "
                              f"node has {available / 2**30:,.2f} GiB available")


# ------------------------------------------------------------------------------ resume
def _problems(path: Path, peers: Peers | None = None) -> list[str]:
    """:func:`verify`'s problems, a malformed checkpoint's one among them."""
    try:
        return verify(path, peers)
    except CheckpointError as exc:
        return [str(exc)]


def _agreed(peers: Peers | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` as rank 0 of ``peers`` found it (its value, or its ConfigError or
    CheckpointError raised), on every rank: the ranks then verify the same checkpoints in the
    same order even when the directory changes while they look."""
    if peers is None or peers.size == 1:
        return fn()
    try:
        mine: tuple = ("value", fn())
    except ConfigError as exc:
        mine = ("ConfigError", str(exc))
    except Exception as exc:  # noqa: BLE001 - every rank must reach the all-gather
        mine = ("CheckpointError", _failure(exc))
    kind, value = peers.allgather(mine)[0]
    if kind == "value":
        return value
    raise (ConfigError if kind == "ConfigError" else CheckpointError)(value)


def _candidates(root: Path) -> tuple[list[Path], list[str]]:
    """The committed checkpoints of ``root``, the one ``latest`` names first, and a note when
    that pointer is unreadable."""
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
    return candidates, notes


def resolve_resume(spec: str, save_dir: str | os.PathLike, peers: Peers | None = None
                   ) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and notes for the log.

    ``spec`` "" means no resume (None). "auto": the checkpoint ``save_dir/latest`` names, then the
    other committed ones newest first; the first that verifies wins, each one skipped gets a note
    saying why; None (start fresh) when none verifies or none exists. A path (a checkpoint or a
    save directory) must verify, else ConfigError names the problems. Without ``peers``, no
    collective: every rank gets the same answer from the same files. With them (every one calls
    it alike), the checkpoints rank 0 lists are verified together (:func:`verify`): each rank
    hashes its share of the shards, not all of them.
    """
    if not spec:
        return None, []
    if spec != "auto":
        path = _agreed(peers, lambda: resolve_path(spec))
        problems = _problems(path, peers)
        if problems:
            raise ConfigError(f"--resume {spec}: checkpoint {path} failed verification: "
                              + "; ".join(problems))
        return path, []
    root = Path(save_dir)
    candidates, notes = _agreed(peers, lambda: _candidates(root))
    failed = []
    for path in candidates:
        problems = _problems(path, peers)
        if not problems:
            return path, notes + [f"checkpoint {p} failed verification ({'; '.join(why)}); "
                                  f"falling back to {path}" for p, why in failed]
        failed.append((path, problems))
    if not failed:
        return None, notes + [f"no checkpoint in {root}; starting fresh"]
    return None, notes + [f"checkpoint {p} failed verification ({'; '.join(why)}); no other "
                          f"checkpoint verifies, starting fresh" for p, why in failed]


@dataclasses.dataclass(frozen=True)
class ResumeStart:
    """Where a run begins against its save directory (:func:`resume_policy`): ``fresh`` at step
    0; ``restart`` when that is because ``--resume auto`` found no committed checkpoint (a run
    stopped before its first save, or during it: requeued, it begins again, and the earlier
    run's metrics are set aside rather than refused)."""
    fresh: bool
    restart: bool = False


def resume_policy(resume: str, save_dir: str | os.PathLike) -> ResumeStart:
    """The resume policy: how a run with ``--resume RESUME`` begins over ``save_dir``, refusing
    (ConfigError) what would overwrite another run's checkpoints. No ``--resume`` over a save
    directory holding checkpoints is refused (saving beside them would overwrite the
    same-numbered ones and point ``latest`` into a mix of two runs); ``auto`` over checkpoints of
    which none verifies is refused (it would start fresh over them); ``auto`` over none (an
    interrupted save's hidden ``.step_N.tmp`` is none) restarts; a path in another save directory
    is refused when this one holds checkpoints. No collective: rank 0 asks."""
    found = list_checkpoints(save_dir)
    if not resume and found:
        raise ConfigError(f"--save-dir {save_dir} holds checkpoints of an earlier run "
                          f"(newest {found[0].name}); a fresh run would overwrite them: use "
                          f"--resume auto to continue it, or a new --run-dir")
    if not resume:
        return ResumeStart(fresh=True)
    if resume == "auto" and not found:
        return ResumeStart(fresh=True, restart=True)
    if resume == "auto":
        path, notes = resolve_resume("auto", save_dir)
        if path is None:
            raise ConfigError(f"--resume auto: no checkpoint of --save-dir {save_dir} "
                              f"verifies ({'; '.join(notes)}); a fresh run would overwrite "
                              f"them: move them aside, or choose a new --run-dir")
    elif found and resolve_path(resume).resolve().parent != Path(save_dir).resolve():
        raise ConfigError(f"--save-dir {save_dir} holds checkpoints of another run "
                          f"(newest {found[0].name}); a run resumed from {resume} would "
                          f"save its steps over them: choose a new --run-dir or --save-dir")
    return ResumeStart(fresh=False)


def read_config(path: str | os.PathLike) -> Config:
    """The resolved configuration the checkpoint at ``path`` was saved with (its index checked
    against the schema; the shards are not verified)."""
    return read_index(resolve_path(path)).config


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The checkpoint's model configuration (from its stored TOML)."""
    return read_config(path).model


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
    "decay_fraction": "the learning rate of later steps differs from the checkpoint's run",
    "decay_shape": "the learning rate of later steps differs from the checkpoint's run",
    "dtype": "the saved master weights and moments are cast to the new run's (float32 "
             "under bfloat16 compute)",
}
"""Training settings whose change on resume is reported, with what the change means (a wsd
run's ``steps``: :func:`_wsd_steps_note`)."""


def _wsd_steps_note(saved: dict[str, Any], now: LRScheduleState) -> str:
    """What a new ``--steps`` means for a run resumed under the wsd schedule at step k, from a
    checkpoint whose ``lr_schedule`` group is ``saved``: before its decay (k <= S, the decay's
    first step in 0-based numbering) the learning rate of every step is that of a run started
    with the new steps, so this is how a wsd run is extended; past it, the learning rate jumps.
    Steps are named as metrics.jsonl numbers them (1-based)."""
    k, n = now.next_step, now.total_steps
    if k <= min(saved["decay_start"], now.decay_start):
        return (f"the checkpoint is in the wsd schedule's stable phase, so every step's learning "
                f"rate is that of a run started with {n} steps: stable to step "
                f"{now.decay_start}, decaying to min_lr over steps {now.decay_start + 1}-{n} "
                f"(the expected way to extend a wsd run)")
    return (f"the checkpoint at step {k} is past the start of a wsd decay (the checkpoint's run "
            f"decays from step {saved['decay_start'] + 1}, this run from step "
            f"{now.decay_start + 1}): the learning rate of step {k + 1} is {now.next_lr:.6g} "
            f"where the checkpoint's run had {saved['next_lr']:.6g}; a wsd run extends exactly "
            f"from a checkpoint of its stable phase (step <= {saved['decay_start']})")


def resume_changes(path: str | os.PathLike, position: RunPosition,
                   extends: Callable[[Any], bool]) -> list[str]:
    """What a run resuming from the checkpoint at ``path`` at ``position`` (its configuration,
    LR schedule and data cursor) does differently from the run that saved it (one line per
    change of :data:`_RESUME_FIELDS`, or a data source of another size); empty when nothing
    changed and the resumed run continues as the uninterrupted one would. A wsd run given more
    ``steps`` is extended: its line says whether the checkpoint lies in the stable phase.
    ``extends(train)``: whether the learning-rate schedule of a train section extends with more
    steps (:func:`mpipar.training.optim.extends_with_steps`)."""
    index = read_index(resolve_path(path))
    then, now, data = index.config.train, position.config.train, position.data
    samples = index.groups["data"]["num_samples"]
    extending = extends(then) and extends(now)
    out = [f"train.{name} is {getattr(now, name)!r}, the checkpoint's run used "
           f"{getattr(then, name)!r}: "
           + (_wsd_steps_note(index.groups["lr_schedule"], position.lr_schedule)
              if name == "steps" and extending else meaning)
           for name, meaning in _RESUME_FIELDS.items() if getattr(now, name) != getattr(then, name)]
    if samples != data.num_samples and (then.data, then.seq_len) == (now.data, now.seq_len):
        out.append(f"the data {data.path} holds {data.num_samples} samples of "
                   f"{now.seq_len} tokens, the checkpoint's run saw {samples}: "
                   f"{_RESUME_FIELDS['data']}")
    return out


# ------------------------------------------------------------------------------ read
@contextlib.contextmanager
def open_reader(path: str | os.PathLike, peers: Peers | None = None) -> Iterator[Reader]:
    """Verify the checkpoint at ``path`` (or a save directory's ``latest``; together with
    ``peers``, each of which calls it alike), then yield ``read(kind, name, region)``: a region
    of a global tensor, read from the shards that hold it. Any layout reads any checkpoint this
    way (:func:`.shards.read_shard`), e.g. generation under its own tp x pp. Without ``peers``,
    no collective."""
    path = _agreed(peers, lambda: resolve_path(path))
    index = require_sound(path, peers)
    with ShardFiles(path, index) as files:
        yield files.read


def load(state: RankState, path: str | os.PathLike) -> int:
    """Load parameters, AdamW moments, the other state kinds the checkpoint holds and the
    optimizer step into ``state`` (this rank's, any layout) from the checkpoint at ``path``;
    return the training step it holds. Verifies the checkpoint first (cached when
    :func:`resolve_resume` already did) and checks every tensor's shape against the model;
    raises CheckpointError naming the file (and dataset, or the tensor holding a NaN or an
    infinity) at fault. No collective."""
    path = resolve_path(path)
    index = require_sound(path)
    extra = sorted(set(index.tensors) - set(KINDS))
    for kind in (*KINDS, *extra):
        for name, shape in state.shapes.items():
            held = index.tensor(kind, name).shape
            if held != shape:
                raise CheckpointError(f"{index.file}: {kind}/{name} has shape {held}, the model "
                                      f"needs {shape}")
    with ShardFiles(path, index) as files:
        try:
            state.load(files.read, index.optimizer_step, set(extra))
        except NonFiniteError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None
    return index.step


def read_moe_bias(path: str | os.PathLike) -> dict[int, np.ndarray]:
    """The routing biases of auxiliary-loss-free balancing the checkpoint at ``path`` records,
    ``{sparse block: [E] float64}`` (empty when its run had none), verified first. Every layout
    loads them whole (:meth:`mpipar.model.moe.RoutingBias.load`). No collective."""
    return dict(require_sound(resolve_path(path)).moe_bias)


def read_dpo_reference(path: str | os.PathLike) -> np.ndarray | None:
    """The DPO reference log-probabilities ``[2 * pairs]`` the checkpoint at ``path`` records
    (None when its run had none, or saved before computing them), verified first. No
    collective."""
    return require_sound(resolve_path(path)).dpo_reference


def read_tensors(path: str | os.PathLike, kind: str = "param") -> dict[str, np.ndarray]:
    """Every global tensor of ``kind`` ("param", "exp_avg", "exp_avg_sq" or a residual kind the
    checkpoint holds), verified first."""
    path = resolve_path(path)
    index = require_sound(path)
    if kind not in index.tensors:
        raise ValueError(f"kind={kind!r}: must be one of {', '.join(index.tensors)}")
    with ShardFiles(path, index) as files:
        return {name: files.read(kind, name, tuple(slice(0, n) for n in tensor.shape))
                for name, tensor in index.tensors[kind].items()}
