"""Hugging Face tokenizers: a raw-text corpus to an HDF5 token stream the trainer reads.

`python -m mpipar.data prepare INPUT... --tokenizer HF_DIR_OR_tokenizer.json --out tokens.h5`
encodes the documents of the inputs (text files, directories, `.jsonl`, Parquet:
:mod:`mpipar.data.documents`) with the `tokenizers` library (`pip install 'mpipar[tokenizers]'`;
no PyTorch) and writes one 1-D dataset `tokens`:

- each document is the tokenizer's encoding without its special-token template (no BOS),
  followed by the tokenizer's end-of-document token (EOS), documents in input order;
- ids in the smallest unsigned dtype that holds the vocabulary (uint8, uint16 or uint32);
- streamed: batches of documents are encoded and appended to a resizable, chunked, fletcher32
  dataset, so memory stays bounded by a batch, whatever the corpus size;
- with `workers > 1`, files are encoded in parallel processes, each into a temporary part file,
  and appended in input order: the output is the same for every number of workers;
- the file's attributes record the tokenizer (the path given, its vocabulary size, the sha256 of
  its tokenizer.json, the EOS token and id; :data:`mpipar.data.sources.TOKENIZER_ATTRS`), the input files
  with the token offset of each (`files`, `offsets`), the document count and the text field.
  The trainer checks the vocabulary against the model's (:func:`mpipar.data.sources.load_tokens`).

The EOS token is `--eos` when given, else `eos_token` of the `tokenizer_config.json` or
`special_tokens_map.json` beside tokenizer.json, else the one special token among
:data:`KNOWN_EOS` the tokenizer has.

Text that spells a special token (`</s>`, `<|im_end|>`) is encoded as the text it is, never as
that token: a document (or an SFT record) cannot end itself, or mask its own loss, by writing an
EOS. `--parse-special-tokens` (``parse_special=True``) turns such text into the token, for data
that really carries control tokens.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpipar.data import documents
from mpipar.data.prepare import PREPARE_CHUNK_TOKENS, check_written, hdf5_output, output_file
from mpipar.data.sources import DataError

KNOWN_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>")
"""End-of-document tokens recognised when no tokenizer_config.json names one."""


@dataclass(frozen=True)
class TokenizerSpec:
    """What identifies a tokenizer in a prepared file."""

    name: str           # the path as given
    file: str           # its tokenizer.json
    vocab_size: int     # ids are in [0, vocab_size)
    sha256: str         # of tokenizer.json
    eos_token: str
    eos_id: int

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned dtype that holds every id."""
        return token_dtype(self.vocab_size)

    def attrs(self) -> dict[str, Any]:
        """The HDF5 attributes (names in :data:`mpipar.data.sources.TOKENIZER_ATTRS`)."""
        return {"tokenizer": self.name, "tokenizer_vocab_size": self.vocab_size,
                "tokenizer_sha256": self.sha256, "eos_token": self.eos_token,
                "eos_id": self.eos_id}


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_tokenized` wrote."""

    tokens: int
    documents: int
    files: list[str]
    tokenizer: TokenizerSpec


def token_dtype(vocab_size: int) -> np.dtype:
    """uint8, uint16 or uint32: the smallest unsigned dtype holding ids below `vocab_size`."""
    return next(np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64)
                if vocab_size - 1 <= np.iinfo(t).max)


# ---------------------------------------------------------------------------------------------
# the tokenizer


def tokenizer_file(path: str | os.PathLike) -> Path:
    """The tokenizer.json of `path` (a Hugging Face directory or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.is_file():
            raise DataError(f"--tokenizer {path}: the directory has no tokenizer.json (a fast "
                            f"tokenizer of the `tokenizers` library)")
    elif not p.is_file():
        raise DataError(f"--tokenizer {path} does not exist")
    return p


def load_tokenizer(path: str | os.PathLike, eos: str | None = None,
                   parse_special: bool = False):
    """(the `tokenizers.Tokenizer` of `path`, its :class:`TokenizerSpec`). Truncation and padding
    stored in the file are switched off: every document is encoded whole; text that spells a
    special token stays text unless ``parse_special`` (module docstring)."""
    file = tokenizer_file(path)
    tokenizer = _read_tokenizer(file)
    tokenizer.encode_special_tokens = not parse_special
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eos_token = eos or _configured_eos(file) or _known_eos(tokenizer, path)
    if eos_token not in vocab:
        raise DataError(f"--tokenizer {path}: the end-of-document token {eos_token!r} is not in "
                        f"its vocabulary" + ("" if eos else "; name one with --eos TOKEN"))
    spec = TokenizerSpec(os.fspath(path), os.fspath(file), max(vocab.values()) + 1,
                         hashlib.sha256(file.read_bytes()).hexdigest(), eos_token, vocab[eos_token])
    return tokenizer, spec


def _read_tokenizer(file: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("--tokenizer needs the tokenizers package: "
                        "pip install 'mpipar[tokenizers]'") from None
    try:
        tokenizer = Tokenizer.from_file(os.fspath(file))
    except Exception as err:  # tokenizers raises its own Exception for malformed JSON
        raise DataError(f"cannot read {file} as a tokenizers JSON file: {err}") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _configured_eos(file: Path) -> str | None:
    """`eos_token` from tokenizer_config.json or special_tokens_map.json beside `file`."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = file.with_name(name)
        if not config.is_file():
            continue
        try:
            value = json.loads(config.read_text()).get("eos_token")
        except (ValueError, AttributeError) as err:
            raise DataError(f"cannot read {config} as a JSON object: {err}") from None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


def _known_eos(tokenizer, path) -> str:
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    found = [t for t in KNOWN_EOS if t in special]
    if len(found) != 1:
        raise DataError(f"--tokenizer {path}: cannot tell its end-of-document token (no eos_token "
                        f"in a tokenizer_config.json beside it; special tokens among "
                        f"{', '.join(KNOWN_EOS)}: {', '.join(found) or 'none'}); "
                        f"name it with --eos TOKEN")
    return found[0]


# ---------------------------------------------------------------------------------------------
# encoding


def encode_file(tokenizer, spec: TokenizerSpec, path: str, text_field: str
                ) -> Iterator[tuple[np.ndarray, int, int]]:
    """(ids [n] in `spec.dtype`, documents ended, input bytes consumed) per batch of `path`.
    The texts of a batch are encoded a group of at most `documents.BATCH_BYTES` characters at a
    time: the tokenizer's encodings take about 300 bytes a token, the ids kept 1 to 4."""
    for batch in documents.read_batches(path, text_field):
        pieces = []
        for start, stop in _groups([len(t) for t in batch.texts], documents.BATCH_BYTES):
            texts = batch.texts[start:stop]
            try:
                encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
            except Exception as err:  # the tokenizers library raises its own exception types
                raise DataError(f"{path}: the tokenizer cannot encode it "
                                f"({type(err).__name__}: {err})") from None
            for encoding, end in zip(encodings, batch.ends[start:stop]):
                pieces.append(np.asarray(encoding.ids, dtype=spec.dtype))
                if end:
                    pieces.append(np.asarray([spec.eos_id], dtype=spec.dtype))
            del encodings
        ids = np.concatenate(pieces) if pieces else np.empty(0, spec.dtype)
        yield ids, sum(batch.ends), batch.nbytes


def _groups(lengths: list[int], limit: int) -> Iterator[tuple[int, int]]:
    """Consecutive ranges [start, stop) of `lengths` of at most `limit` in all (or one item)."""
    start, size = 0, 0
    for i, n in enumerate(lengths):
        if i > start and size + n > limit:
            yield start, i
            start, size = i, 0
        size += n
    if start < len(lengths):
        yield start, len(lengths)


_worker: dict[str, Any] = {}


def _init_worker(name: str, eos: str, parse_special: bool, threads: int) -> None:
    """A worker process: cap the tokenizer's thread pool, then load the tokenizer once."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    _worker["tokenizer"], _worker["spec"] = load_tokenizer(name, eos, parse_special)


def _encode_to_part(task: tuple[str, str, str]) -> tuple[int, int]:
    """Encode one file into a raw part file of ids; returns (tokens, documents). Errors are
    DataErrors, which the pool hands to the parent as they are."""
    path, text_field, part = task
    tokens = docs = 0
    try:
        with open(part, "wb") as fh:
            for ids, ended, _ in encode_file(_worker["tokenizer"], _worker["spec"], path,
                                             text_field):
                fh.write(ids.tobytes())
                tokens, docs = tokens + ids.size, docs + ended
    except OSError as err:
        raise DataError(f"the part file {part} beside --out cannot be written "
                        f"({err.strerror or err})") from None
    return tokens, docs


# ---------------------------------------------------------------------------------------------
# the output file


class _TokenStream:
    """A growing 1-D `tokens` dataset (resizable, chunked, fletcher32), written a chunk at a
    time: appended ids wait in memory until they fill a chunk, or :meth:`flush`."""

    def __init__(self, f: h5py.File, dtype: np.dtype, chunk_tokens: int,
                 check: Callable[[], None]):
        self.data = f.create_dataset("tokens", shape=(0,), maxshape=(None,), dtype=dtype,
                                     chunks=(chunk_tokens,), fletcher32=True)
        self.size = 0  # tokens appended, written or waiting
        self._waiting: list[np.ndarray] = []
        self._written = 0
        self._check = check  # raises once a write to the file has failed

    def append(self, ids: np.ndarray) -> None:
        self._waiting.append(ids)
        self.size += ids.size
        if self.size - self._written >= self.data.chunks[0]:
            self.flush()

    def flush(self) -> None:
        if self.size > self._written:
            self.data.resize((self.size,))
            self.data[self._written:] = np.concatenate(self._waiting)
            self._waiting, self._written = [], self.size
            self._check()


def _cpus() -> int:
    """CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers(num_files: int) -> int:
    """One process per CPU this process may use, at most one per file."""
    return max(1, min(num_files, _cpus()))


def prepare_tokenized(inputs: Sequence[str | os.PathLike], out: str | os.PathLike,
                      tokenizer: str | os.PathLike, eos: str | None = None,
                      text_field: str = "text", workers: int = 0,
                      chunk_tokens: int = PREPARE_CHUNK_TOKENS,
                      progress: bool | None = None, parse_special: bool = False) -> Prepared:
    """Encode the documents of `inputs` with `tokenizer` into the HDF5 file `out` (see the
    module docstring). `workers` 0 means :func:`default_workers`; `progress` None shows a bar
    on a terminal only. The output is written to a temporary file of a unique name and renamed
    (:func:`mpipar.data.prepare.hdf5_output`), so `out` is either complete or untouched. Every
    input is checked readable, and `out` writable, before anything is encoded. Raises DataError
    naming the input or `--out` and the rule broken."""
    for name, value, low in (("workers", workers, 0), ("chunk_tokens", chunk_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise DataError(f"{name} must be an integer >= {low}, got {value!r}")
    out = output_file(out)
    files = documents.expand_inputs(inputs)
    for path in files:
        documents.check_readable(path, text_field)
    tok, spec = load_tokenizer(tokenizer, eos, parse_special)
    workers = min(workers, len(files)) or default_workers(len(files))
    # HDF5 1.10 object headers hold attributes over 64 KiB (the names of many files)
    with hdf5_output(out, libver=("v110", "latest")) as (f, sink):
        stream = _TokenStream(f, spec.dtype, chunk_tokens, lambda: check_written(sink, out))
        offsets, docs = _write(stream, files, tok, spec, text_field, workers, out, progress,
                               parse_special)
        stream.flush()
        if stream.size == 0:
            raise DataError(f"the inputs {', '.join(map(os.fspath, inputs))} hold no text")
        f.attrs.update(spec.attrs())
        f.attrs.update({"files": files, "offsets": np.asarray(offsets, dtype=np.int64),
                        "documents": docs, "text_field": text_field})
    return Prepared(stream.size, docs, files, spec)


def _write(stream: _TokenStream, files: list[str], tok, spec: TokenizerSpec, text_field: str,
           workers: int, out: Path, progress: bool | None, parse_special: bool
           ) -> tuple[list[int], int]:
    """Append every file's ids to `stream` in input order; (token offsets [files + 1], docs)."""
    from tqdm import tqdm
    total = sum(os.path.getsize(p) for p in files)
    disable = None if progress is None else not progress
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=disable,
              file=sys.stderr) as bar:
        if workers == 1:
            offsets, docs = [0], 0
            for path in files:
                for ids, ended, nbytes in encode_file(tok, spec, path, text_field):
                    stream.append(ids)
                    docs += ended
                    bar.update(nbytes)
                offsets.append(stream.size)
            return offsets, docs
        return _write_parallel(stream, files, spec, text_field, workers, out, bar, parse_special)


def _write_parallel(stream: _TokenStream, files: list[str], spec: TokenizerSpec,
                    text_field: str, workers: int, out: Path, bar, parse_special: bool
                    ) -> tuple[list[int], int]:
    """Files encoded by `workers` processes into part files, appended here in input order."""
    parts = Path(tempfile.mkdtemp(prefix=out.name + ".parts.", dir=out.parent))
    threads = max(1, _cpus() // workers)
    tasks = [(path, text_field, os.fspath(parts / f"{i:08d}.ids")) for i, path in enumerate(files)]
    offsets, docs = [0], 0
    # concurrent.futures, not multiprocessing.Pool: after a worker's DataError, the Pool's exit
    # (terminate) could wait forever on its task-feeding thread; the executor's shutdown with
    # cancel_futures drops the files not started and waits only for those running.
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"),  # no fork of a
                               _init_worker,                                 # threaded one
                               (spec.name, spec.eos_token, parse_special, threads))
    try:
        futures = [pool.submit(_encode_to_part, task) for task in tasks]
        for (path, _, part), future in zip(tasks, futures):
            count, ended = future.result()
            _append_part(stream, part, spec.dtype, count)
            docs += ended
            offsets.append(stream.size)
            bar.update(os.path.getsize(path))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(parts, ignore_errors=True)
    return offsets, docs


def _append_part(stream: _TokenStream, part: str, dtype: np.dtype, count: int) -> None:
    """Copy a part file's `count` ids into `stream` a chunk at a time, then delete it."""
    step = stream.data.chunks[0]
    with open(part, "rb") as fh:
        for _ in range(0, count, step):
            stream.append(np.frombuffer(fh.read(step * dtype.itemsize), dtype=dtype))
    os.unlink(part)
