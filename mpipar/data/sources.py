"""Token sources and the deterministic sampler.

A token source is one path holding integer token ids, cut into training samples of
`seq_len + 1` tokens (inputs are the first `seq_len`, targets the last `seq_len`):

| path                         | format      | kind    | tokens                                        |
|------------------------------|-------------|---------|-----------------------------------------------|
| None or "stdlib"             | stdlib      | stream  | bytes of the Python standard library's `.py`  |
| a directory                  | directory   | stream  | bytes of every regular, non-hidden file        |
| `*.bin`                      | bin         | stream  | uint16 (nanoGPT convention), memory-mapped    |
| `*.npy`, 1-D / 2-D           | npy         | stream / samples | any integer dtype, memory-mapped     |
| `*.h5`, `*.hdf5`             | hdf5        | stream / samples | dataset `tokens` (1-D) or `samples` (2-D), read by slices |
| anything else                | text        | stream  | the file's bytes, memory-mapped               |

Byte-level sources (stdlib, directory, text) have vocabulary 256. Every source is checked
once when loaded (integer dtype, long enough, every id in `[0, vocab_size)`); large files are
checked in chunks so they never load whole. An HDF5 source is read once in full even when its
dtype cannot hold a bad id, so that a damaged chunk is named when the source is loaded.

The sampler maps an optimizer step to sample indices as a pure function of `(seed, step)`,
so resuming after `k` steps continues exactly where an uninterrupted run would be.

Validation (:class:`EvalSet`): `--eval-data PATH` is a separate source; `--eval-fraction F` holds
out the last `round(F * num_samples)` samples of the training source, which the sampler then
never draws (:func:`validation`). Either way `--eval-batches K` batches of the global batch size
are fixed once: `K * B` samples evenly spaced over the validation samples. The split is a pure
function of the source and F, so a resumed run (which must keep F) holds out the same samples.

An HDF5 file written by `prepare --tokenizer` records its tokenizer (`TOKENIZER_ATTRS`); loading
it checks that the model's vocabulary holds the tokenizer's.

`python -m mpipar.data info PATH` inspects a source and `python -m mpipar.data prepare` writes
one (:mod:`mpipar.data.cli`): the bytes of text files (:func:`mpipar.data.prepare.prepare_tokens`),
or the ids of a Hugging Face tokenizer (:mod:`mpipar.data.tokenizer`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ContextManager

import h5py
import numpy as np

from mpipar.config import TrainConfig, require
from mpipar.layout import Layout

STDLIB_CAP_BYTES = 16 * 2**20
"""The built-in corpus keeps the longest prefix of its sorted file list that fits in 16 MiB.
CPython 3.11's standard library (without tests, site-packages, idlelib, lib2to3, turtledemo)
is about 11 MB in 580 files and reads in about 0.1 s, so there the cap keeps every file."""

_STDLIB_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo"})
H5_SUFFIXES = (".h5", ".hdf5")
_CHECK_CHUNK = 1 << 22
"""Elements read at a time when checking token ids against the vocabulary."""

TOKENIZER_ATTRS = ("tokenizer", "tokenizer_vocab_size", "tokenizer_sha256", "eos_token", "eos_id",
                   "documents")
"""HDF5 file attributes of a tokenized stream (:mod:`mpipar.data.tokenizer` writes them)."""

Opener = Callable[[], ContextManager[Any]]
"""A callable returning a context manager that yields an array-like (numpy array, memmap or
h5py dataset) supporting basic slicing and increasing integer-array row selection."""


class DataError(ValueError):
    """A token source that cannot be used; the message names the path and the rule broken."""


# ---------------------------------------------------------------------------------------------
# byte corpora


def _stdlib_files(root: Path) -> list[str]:
    """Relative posix paths of the standard library's `.py` files, sorted, skipping
    `_STDLIB_SKIP_DIRS` at any depth."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            full = Path(dirpath, name)
            if name.endswith(".py") and full.is_file():
                found.append(full.relative_to(root).as_posix())
    return sorted(found)


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> np.ndarray:
    """The built-in corpus: the running Python's standard-library `.py` sources as bytes.

    Files come from `sysconfig.get_paths()["stdlib"]`, sorted by relative path, excluding
    site-packages, test/tests directories, idlelib, lib2to3 and turtledemo, concatenated up to
    `STDLIB_CAP_BYTES` (the longest prefix of the sorted list that fits). Deterministic for a
    given Python installation; cached per process.

    Returns a read-only uint8 array [num_bytes].
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for rel in _stdlib_files(root):
        try:
            data = (root / rel).read_bytes()
        except OSError as err:
            raise DataError(f"cannot read standard-library file {root / rel}: {err}") from err
        if total + len(data) > STDLIB_CAP_BYTES:
            break
        chunks.append(data)
        total += len(data)
    if total == 0:
        raise DataError(f"stdlib corpus: no .py source files found under {root}")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def directory_files(root: Path) -> list[str]:
    """Relative posix paths of every regular file under `root` (recursive, skipping names that
    start with '.'), sorted."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            full = Path(dirpath, name)
            if not name.startswith(".") and full.is_file():
                files.append(full.relative_to(root).as_posix())
    return sorted(files)


def _directory_bytes(root: Path) -> np.ndarray:
    """Bytes of every file of `directory_files(root)`, concatenated: uint8 [num_bytes]."""
    parts = []
    for rel in directory_files(root):
        try:
            parts.append((root / rel).read_bytes())
        except OSError as err:
            raise DataError(f"cannot read {root / rel}: {err}") from err
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# sources


def _in_memory(array: np.ndarray) -> Opener:
    return lambda: contextlib.nullcontext(array)


def _h5_dataset(path: str, name: str) -> Opener:
    """Open the file per read, so no HDF5 handle outlives a call (safe across fork and MPI)."""

    @contextlib.contextmanager
    def open_dataset():
        with h5py.File(path, "r") as f:
            yield f[name]

    return open_dataset


class TokenSource:
    """Integer tokens behind one path, cut into samples of `seq_len + 1` tokens.

    kind "stream": a token stream [num_tokens]; sample i is the window
        `tokens[i*seq_len : i*seq_len + seq_len + 1]`, so consecutive windows share one token
        (the last target of one is the first input of the next) and
        `num_samples = (num_tokens - 1) // seq_len`.
    kind "samples": ready-made rows [num_samples, seq_len + 1]; sample i is row i.
    """

    def __init__(self, path: str, fmt: str, seq_len: int, shape: tuple[int, ...],
                 dtype: np.dtype, opener: Opener, tokenizer: dict[str, Any] | None = None,
                 origin: str | None = None):
        self.path = path
        self.tokenizer = tokenizer  # TOKENIZER_ATTRS of a tokenized HDF5 file, else None
        # what made the ids: "tokenizer SHA256", "bytes", or None (not recorded: .npy, .bin)
        self.origin = origin
        self.format = fmt
        self.seq_len = seq_len
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.kind = "stream" if len(self.shape) == 1 else "samples"
        self.num_tokens = int(np.prod(self.shape))
        if self.kind == "stream":
            self.num_samples = max(0, (self.shape[0] - 1) // seq_len)
        else:
            self.num_samples = self.shape[0]
        self._open = opener

    def __repr__(self) -> str:
        return (f"TokenSource(path={self.path!r}, format={self.format}, kind={self.kind}, "
                f"tokens={self.num_tokens}, samples={self.num_samples}, seq_len={self.seq_len})")

    def sample(self, idx: np.ndarray | Sequence[int]) -> np.ndarray:
        """Samples `idx` [n] (any order, repeats allowed) as int64 rows [n, seq_len + 1]."""
        idx = np.asarray(idx)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise ValueError(f"sample indices must be a 1-D integer array, got shape {idx.shape} "
                             f"dtype {idx.dtype}")
        idx = idx.astype(np.int64)
        bad = (idx < 0) | (idx >= self.num_samples)
        if bad.any():
            raise ValueError(f"sample index {int(idx[bad][0])} is outside [0, {self.num_samples}) "
                             f"for {self.path}")
        width = self.seq_len + 1
        out = np.empty((idx.size, width), dtype=np.int64)
        if idx.size == 0:
            return out
        with self._open() as arr:
            if self.kind == "stream":
                for row, i in enumerate(idx.tolist()):
                    start = i * self.seq_len
                    out[row] = arr[start:start + width]
            else:
                # h5py selects rows only by increasing, unique indices
                uniq, inverse = np.unique(idx, return_inverse=True)
                out[:] = np.asarray(arr[uniq])[inverse]
        return out


def _check_ids(src: TokenSource, vocab_size: int, read_all: bool = False) -> None:
    """Every token id in [0, vocab_size), read `_CHECK_CHUNK` elements at a time. Skipped when
    the dtype cannot hold a bad id, unless `read_all`: then every element is read once anyway,
    so that a damaged HDF5 chunk (its fletcher32 checksum or filter fails) is named now rather
    than met in the middle of training."""
    info = np.iinfo(src.dtype)
    if info.min >= 0 and info.max < vocab_size and not read_all:
        return
    row_len = src.shape[1] if src.kind == "samples" else 1
    step = max(1, _CHECK_CHUNK // row_len)
    what = "rows" if src.kind == "samples" else "tokens"
    with src._open() as arr:
        for start in range(0, src.shape[0], step):
            try:
                chunk = np.asarray(arr[start:start + step])
            except OSError as err:
                raise DataError(f"{src.path}: cannot read {what} [{start}, "
                                f"{min(start + step, src.shape[0])}): {err} (the file is "
                                f"damaged)") from None
            if chunk.min() >= 0 and chunk.max() < vocab_size:
                continue
            flat = chunk.reshape(-1)
            first = int(np.flatnonzero((flat < 0) | (flat >= vocab_size))[0])
            if src.kind == "stream":
                where = f"position {start + first}"
            else:
                row, col = divmod(first, row_len)
                where = f"row {start + row}, column {col}"
            raise DataError(f"{src.path}: token id {int(flat[first])} at {where} is outside the "
                            f"vocabulary [0, {vocab_size}) (--vocab-size {vocab_size})")


def _make_source(path: str, fmt: str, seq_len: int, vocab_size: int, shape: tuple[int, ...],
                 dtype: np.dtype, opener: Opener, tokenizer: dict[str, Any] | None = None,
                 read_all: bool = False, origin: str | None = None) -> TokenSource:
    """Check shape, dtype and ids (reading every element when `read_all`), then build the
    source."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        raise DataError(f"{path}: tokens must have an integer dtype, got {dtype}")
    if len(shape) not in (1, 2):
        raise DataError(f"{path}: tokens must be 1-D (a stream) or 2-D [num_samples, seq_len + 1], "
                        f"got shape {tuple(shape)}")
    if int(np.prod(shape)) == 0:
        raise DataError(f"{path}: the token source is empty (shape {tuple(shape)})")
    if len(shape) == 2 and shape[1] != seq_len + 1:
        raise DataError(f"{path}: rows hold {shape[1]} tokens, but --seq-len {seq_len} needs rows of "
                        f"seq_len + 1 = {seq_len + 1} tokens")
    if len(shape) == 1 and shape[0] < seq_len + 1:
        raise DataError(f"{path}: the stream has {shape[0]} tokens, fewer than the seq_len + 1 = "
                        f"{seq_len + 1} one sample needs (--seq-len {seq_len})")
    src = TokenSource(path, fmt, seq_len, shape, dtype, opener, tokenizer, origin)
    _check_ids(src, vocab_size, read_all)
    return src


def _byte_source(path: str, fmt: str, data: np.ndarray, seq_len: int, vocab_size: int) -> TokenSource:
    if vocab_size < 256:
        raise DataError(f"{path}: byte-level text has token ids 0..255, so it needs --vocab-size >= 256 "
                        f"(got {vocab_size})")
    return _make_source(path, fmt, seq_len, vocab_size, data.shape, data.dtype, _in_memory(data),
                        origin="bytes")


def _memmap(path: str, dtype: type) -> np.ndarray:
    try:
        return np.memmap(path, dtype=dtype, mode="r")
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read {path}: {err}") from err


def _load_npy(path: str, seq_len: int, vocab_size: int) -> TokenSource:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read {path} as a .npy array: {err}") from err
    return _make_source(path, "npy", seq_len, vocab_size, arr.shape, arr.dtype, _in_memory(arr))


def _load_h5(path: str, seq_len: int, vocab_size: int) -> TokenSource:
    try:
        with h5py.File(path, "r") as f:
            name = _token_dataset(f, path)
            shape, dtype = f[name].shape, f[name].dtype
            tokenizer = _tokenizer_attrs(f, path)
            prepared_bytes = tokenizer is None and {"files", "offsets"} <= set(f.attrs)
    except OSError as err:
        raise DataError(f"cannot read {path} as HDF5: {err}") from err
    want = 1 if name == "tokens" else 2
    if len(shape) != want:
        raise DataError(f"{path}: dataset '{name}' must be {want}-D, got shape {shape}")
    if tokenizer is not None:
        _check_tokenizer_vocab(path, tokenizer, vocab_size)
    origin = (f"tokenizer {tokenizer['tokenizer_sha256']}" if tokenizer is not None else
              "bytes" if prepared_bytes and np.dtype(dtype) == np.uint8 else None)
    return _make_source(path, "hdf5", seq_len, vocab_size, shape, dtype, _h5_dataset(path, name),
                        tokenizer, read_all=True, origin=origin)


def _token_dataset(f: h5py.File, path: str) -> str:
    """The name of the token dataset of `f`, 'tokens' or 'samples', stored in the file itself:
    a link to another file or path, external raw storage (the bytes of any file) or a virtual
    dataset (its sources' bytes, or fill values for a missing source) is refused, so a token
    file reads nothing but itself."""
    present = []
    for name in ("tokens", "samples"):
        link = f.get(name, getlink=True)
        if link is None:
            continue
        if not isinstance(link, h5py.HardLink):
            raise DataError(f"{path}: '{name}' is a link ({type(link).__name__}) to another "
                            f"file or path; a token dataset must be stored in the file itself")
        if isinstance(f[name], h5py.Dataset):
            present.append(name)
    if len(present) != 1:
        rule = ("has both datasets 'tokens' and 'samples'; keep one" if present else
                f"needs a dataset 'tokens' (1-D stream) or 'samples' (2-D [N, seq_len + 1]); "
                f"top-level names: {sorted(f.keys())}")
        raise DataError(f"{path}: {rule}")
    ds = f[present[0]]
    if ds.is_virtual:
        raise DataError(f"{path}: dataset '{present[0]}' is a virtual dataset (mapped from other "
                        f"files); a token dataset must be stored in the file itself")
    if ds.external:
        raise DataError(f"{path}: dataset '{present[0]}' keeps its bytes in external files "
                        f"({', '.join(str(e[0]) for e in ds.external[:3])}); a token dataset "
                        f"must be stored in the file itself")
    return present[0]


def _check_tokenizer_vocab(path: str, tokenizer: dict[str, Any], vocab_size: int) -> None:
    """The model's vocabulary must hold every id of the recorded tokenizer (a larger one is
    accepted: Hugging Face checkpoints often pad their embedding table)."""
    size = tokenizer["tokenizer_vocab_size"]
    if vocab_size < size:
        raise DataError(f"{path} was prepared with the tokenizer {tokenizer['tokenizer']} of "
                        f"{size} tokens (sha256 {tokenizer['tokenizer_sha256'][:16]}...), but the "
                        f"model's vocabulary has {vocab_size} (--vocab-size {vocab_size}): ids "
                        f"{vocab_size}..{size - 1} would have no embedding; use --vocab-size {size}")


_TOKENIZER_TYPES = {"tokenizer": str, "tokenizer_vocab_size": int, "tokenizer_sha256": str,
                    "eos_token": str, "eos_id": int, "documents": int}
"""The type of each of TOKENIZER_ATTRS; all but `documents` are required once one is there."""


def _tokenizer_attrs(f: h5py.File, path: str) -> dict[str, Any] | None:
    """The TOKENIZER_ATTRS of a file written by `prepare --tokenizer` (None for a file with none
    of them), each checked: strings, a vocabulary size >= 1, a sha256 of 64 hex digits, an EOS
    id inside the vocabulary, a document count >= 0. Raises DataError naming the attribute."""
    if not any(k in f.attrs for k in TOKENIZER_ATTRS[:-1]):
        return None
    out = {}
    for key in TOKENIZER_ATTRS:
        if key not in f.attrs:
            if key == "documents":
                continue
            raise DataError(f"{path}: the tokenizer record lacks the attribute {key!r} (a file "
                            f"written by prepare --tokenizer has {', '.join(TOKENIZER_ATTRS)})")
        out[key] = _attribute(f.attrs[key], _TOKENIZER_TYPES[key], key, path)
    size = out["tokenizer_vocab_size"]
    for key, ok, rule in (
            ("tokenizer_vocab_size", size >= 1, "must be >= 1"),
            ("tokenizer_sha256", len(out["tokenizer_sha256"]) == 64 and all(
                c in "0123456789abcdef" for c in out["tokenizer_sha256"]),
             "must be 64 hexadecimal digits"),
            ("eos_id", 0 <= out["eos_id"] < size, f"must be in [0, {size})"),
            ("documents", out.get("documents", 0) >= 0, "must be >= 0")):
        if not ok:
            raise DataError(f"{path}: attribute {key}={out[key]!r} {rule}")
    return out


def _attribute(value: Any, kind: type, key: str, path: str) -> Any:
    """An HDF5 attribute as the Python `kind` (str or int); DataError naming it otherwise."""
    if isinstance(value, np.generic) and not isinstance(value, np.bool_):
        value = value.item()
    if kind is str and isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, bool) or not isinstance(value, kind):
        what = "a string" if kind is str else "an integer"
        raise DataError(f"{path}: attribute {key}={value!r} must be {what}")
    return value


def recorded_tokenizer(path: str | os.PathLike) -> dict[str, Any] | None:
    """The tokenizer recorded in the HDF5 file `path` (None for any other source)."""
    if Path(path).suffix.lower() not in H5_SUFFIXES or not Path(path).is_file():
        return None
    try:
        with h5py.File(path, "r") as f:
            return _tokenizer_attrs(f, os.fspath(path))
    except OSError as err:
        raise DataError(f"cannot read {path} as HDF5: {err}") from err


def load_tokens(path: str | os.PathLike | None, vocab_size: int, seq_len: int) -> TokenSource:
    """Open the token source at `path` (see the module docstring for formats) and check it.

    Raises DataError naming the path and the rule for a missing, unreadable or empty source, a
    non-integer dtype, a stream shorter than `seq_len + 1`, 2-D rows not `seq_len + 1` long, or a
    token id outside `[0, vocab_size)`.
    """
    for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise DataError(f"{name} must be an integer >= 1, got {value!r}")
    if path is None or path == "stdlib":
        return _byte_source("stdlib", "stdlib", stdlib_corpus(), seq_len, vocab_size)
    path = os.fspath(path)
    p = Path(path)
    if not p.exists():
        raise DataError(f"data path {path} does not exist")
    if p.is_dir():
        return _byte_source(path, "directory", _directory_bytes(p), seq_len, vocab_size)
    if not p.is_file():
        raise DataError(f"data path {path} is neither a regular file nor a directory")
    suffix = p.suffix.lower()
    if suffix == ".npy":
        return _load_npy(path, seq_len, vocab_size)
    if suffix in H5_SUFFIXES:
        return _load_h5(path, seq_len, vocab_size)
    size = p.stat().st_size
    if size == 0:
        raise DataError(f"{path}: the token source is empty (0 bytes)")
    if suffix == ".bin":
        if size % 2:
            raise DataError(f"{path}: size {size} bytes is not a multiple of 2 "
                            f"(a .bin file holds uint16 tokens)")
        tokens = _memmap(path, np.uint16)
        return _make_source(path, "bin", seq_len, vocab_size, tokens.shape, tokens.dtype,
                            _in_memory(tokens))
    return _byte_source(path, "text", _memmap(path, np.uint8), seq_len, vocab_size)


# ---------------------------------------------------------------------------------------------
# sampler


class Sampler:
    """Which samples each optimizer step trains on, as a pure function of `(seed, step)`.

    Samples are visited in an endless sequence of epochs; epoch e is
    `np.random.default_rng([seed, e]).permutation(num_samples)` when shuffling, else
    `range(num_samples)`. Step k takes positions `k*B .. (k+1)*B - 1` of the concatenated
    epochs (B = global_batch), so an epoch boundary may fall inside a batch. A call costs
    O(B) plus one O(num_samples) permutation the first time an epoch is touched (the last two
    epochs' permutations are kept); no other state, so resuming at step k is exact.

    `samples` (default: all of the source) limits training to samples `[0, samples)`: the rest
    is held out for validation (:func:`validation`) and never drawn; `num_samples` above is then
    `samples`.
    """

    def __init__(self, source: TokenSource, global_batch: int, seed: int, shuffle: bool = True,
                 samples: int | None = None):
        if isinstance(global_batch, bool) or not isinstance(global_batch, (int, np.integer)) \
                or global_batch < 1:
            raise ValueError(f"global_batch must be an integer >= 1, got {global_batch!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        samples = source.num_samples if samples is None else samples
        if not 1 <= samples <= source.num_samples:
            raise ValueError(f"samples={samples!r}: must be in [1, {source.num_samples}] "
                             f"(the samples of {source.path})")
        self.source = source
        self.num_samples = int(samples)
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self.shuffle = shuffle
        self._orders: dict[int, np.ndarray] = {}

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Sample order of `epoch`: int64 [num_samples]."""
        order = self._orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            if len(self._orders) >= 2:
                del self._orders[next(iter(self._orders))]
            self._orders[epoch] = order
        return order

    def indices(self, step: int) -> np.ndarray:
        """Sample indices of optimizer step `step` (0-based): int64 [global_batch]."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        n, b = self.num_samples, self.global_batch
        first, stop = int(step) * b, (int(step) + 1) * b
        if not self.shuffle:
            return np.arange(first, stop, dtype=np.int64) % n
        out = np.empty(b, dtype=np.int64)
        for epoch in range(first // n, (stop - 1) // n + 1):
            lo, hi = max(first, epoch * n), min(stop, (epoch + 1) * n)
            out[lo - first:hi - first] = self._epoch_order(epoch)[lo - epoch * n:hi - epoch * n]
        return out

    def batch(self, step: int, rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """Rows `rows` of step `step`'s global batch (a DP rank passes its slice).

        Returns (inputs, targets), int64 [len(rows), seq_len] each; targets are inputs shifted
        left by one token.
        """
        return inputs_targets(self.source, self.indices(step)[rows])


def inputs_targets(source: TokenSource, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of samples `idx` [n]: int64 [n, seq_len] each, targets shifted left by
    one token."""
    data = source.sample(idx)
    return np.ascontiguousarray(data[:, :-1]), np.ascontiguousarray(data[:, 1:])


# ---------------------------------------------------------------------------------------------
# validation


class EvalSet:
    """The fixed validation batches: `batches` batches of `batch` samples, evenly spaced over
    samples `[start, stop)` of `source` (sample `start + (j * n) // (batches * batch)` is row
    `j % batch` of batch `j // batch`, `n = stop - start`), the same at every evaluation."""

    def __init__(self, source: TokenSource, start: int, stop: int, batches: int, batch: int):
        need, have = batches * batch, stop - start
        if have < need:
            raise DataError(f"{source.path}: the validation set holds {have} samples of "
                            f"seq_len + 1 = {source.seq_len + 1} tokens, fewer than --eval-batches "
                            f"{batches} x --global-batch-size {batch} = {need}; lower "
                            f"--eval-batches, or give more validation data")
        self.source, self.batches, self.batch_size = source, batches, batch
        self.indices = start + (np.arange(need, dtype=np.int64) * have) // need

    def batch(self, k: int, rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """Rows `rows` of validation batch `k` (0-based): (inputs, targets) as
        :meth:`Sampler.batch`."""
        if not 0 <= k < self.batches:
            raise ValueError(f"validation batch {k}: must be in [0, {self.batches})")
        return inputs_targets(self.source, self.indices[k * self.batch_size:
                                                        (k + 1) * self.batch_size][rows])


def held_out(num_samples: int, fraction: float) -> int:
    """Samples `--eval-fraction` holds out of `num_samples`: `round(fraction * num_samples)`, the
    last ones of the source."""
    return round(fraction * num_samples)


def validation(source: TokenSource, train: TrainConfig, vocab_size: int
               ) -> tuple[int, EvalSet | None]:
    """(samples of `source` training may draw, the validation set or None) of `train`'s
    `eval_data` / `eval_fraction` / `eval_batches` (module docstring). Raises DataError when
    the split leaves no training or too few validation samples, or `eval_data` is unusable."""
    batch, batches = train.global_batch_size, train.eval_batches
    if train.eval_data:
        evals = load_tokens(train.eval_data, vocab_size, train.seq_len)
        _require_same_origin(source, evals)
        return source.num_samples, EvalSet(evals, 0, evals.num_samples, batches, batch)
    if not train.eval_fraction:
        return source.num_samples, None
    n = source.num_samples
    keep = n - held_out(n, train.eval_fraction)
    if keep < 1:
        raise DataError(f"{source.path}: --eval-fraction {train.eval_fraction} of its {n} "
                        f"samples leaves none to train on")
    return keep, EvalSet(source, keep, n, batches, batch)


def training_batches(source: TokenSource, train: TrainConfig, vocab_size: int
                     ) -> tuple[Sampler, EvalSet | None]:
    """The run's sampler over the samples of ``source`` that :func:`validation` leaves to
    training, and its validation set (None without one): what the engine trains on, and the
    batches the planner reads for packed documents."""
    samples, evals = validation(source, train, vocab_size)
    return Sampler(source, train.global_batch_size, train.seed, train.shuffle, samples), evals


def _describe_origin(src: TokenSource) -> str:
    if src.tokenizer is not None:
        return (f"ids of the tokenizer {src.tokenizer['tokenizer']} (sha256 "
                f"{src.tokenizer['tokenizer_sha256'][:16]}...)")
    return "byte tokens (no tokenizer)"


def _require_same_origin(train: TokenSource, evals: TokenSource) -> None:
    """Training and validation ids must come from the same tokenizer (or both be bytes) when
    both sources say where their ids come from; a validation loss over other ids means
    nothing. Sources that do not record it (.npy, .bin, other HDF5 files) are not compared."""
    if train.origin is None or evals.origin is None or train.origin == evals.origin:
        return
    raise DataError(f"--eval-data {evals.path} holds {_describe_origin(evals)}, but --data "
                    f"{train.path} holds {_describe_origin(train)}: a validation loss over ids "
                    f"of another tokenizer means nothing; prepare both with the same tokenizer")


def check_config(layout: Layout) -> None:
    """One validation source at most (a separate file or a held-out fraction of the training
    data); a fraction in [0, 1); at least one validation batch; --eval-every needs a source."""
    t = layout.train
    require(0 <= t.eval_fraction < 1,
            f"train.eval_fraction={t.eval_fraction}: must be in [0, 1)")
    require(not (t.eval_data and t.eval_fraction),
            f"train.eval_fraction={t.eval_fraction}: give --eval-data or --eval-fraction, not "
            f"both (eval_data={t.eval_data!r})")
    require(t.eval_batches >= 1, f"train.eval_batches={t.eval_batches}: must be >= 1")
    require(t.eval_every >= 0, f"train.eval_every={t.eval_every}: must be >= 0")
    require(not t.eval_every or t.eval_data or t.eval_fraction,
            f"train.eval_every={t.eval_every}: needs a validation set (--eval-data or "
            f"--eval-fraction)")
