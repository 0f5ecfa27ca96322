"""Documents of a raw-text corpus, read a bounded batch at a time.

The inputs of ``python -m mpipar.data prepare --tokenizer`` are files and directories; each file
is read by its suffix:

| suffix      | documents                                                                    |
|-------------|------------------------------------------------------------------------------|
| `.jsonl`    | one per non-blank line: the string field `text_field` of the JSON object     |
| `.parquet`  | one per row: the string column `text_field` (needs `pyarrow`: `mpipar[parquet]`) |
| anything else | the whole file, UTF-8 text, one document                                   |

A directory stands for its regular, non-hidden files, recursively, sorted by relative path.
A text file is read in blocks of about `block_bytes`, each cut after a single newline between two
characters that are not whitespace (or at the end of the file), so memory stays bounded by the
block size or the longest stretch without such a newline. The regular expressions of byte-level
BPE pre-tokenizers (GPT-2, Llama 3) never join two pieces across such a newline, so encoding the
blocks one by one gives the ids of the whole file; tokenizers that prefix the start of each text
with a space marker (SentencePiece style, Llama 2) see one at each block start. A file with CRLF
line ends has no such newline and is read whole: no cut there keeps the pieces of both
expressions (GPT-2's splits "\\r" from "\\n" before a word, Llama 3's keeps "\\r\\n" whole).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpipar.data.sources import DataError, directory_files

BATCH_DOCUMENTS = 1024
"""Documents of a `.jsonl` or `.parquet` file read (and encoded) together."""
BATCH_BYTES = 2**20
"""Text per batch: a `.jsonl` batch ends once it holds this much; a text file's block size; the
most text encoded at once (the tokenizer's encodings of 1 MiB of English text take about
170 MB, so each worker stays within a few hundred MB)."""


@dataclass(frozen=True)
class Batch:
    """Consecutive pieces of text of one file. `ends[i]` says whether `texts[i]` ends a document
    (a text file's blocks before the last do not); `nbytes` is the input consumed."""

    texts: list[str]
    ends: list[bool]
    nbytes: int


def file_kind(path: str | os.PathLike) -> str:
    """"jsonl", "parquet" or "text", by the file's suffix."""
    suffix = Path(path).suffix.lower()
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[str]:
    """The files behind `inputs`, in order: a file stands for itself, a directory for its regular
    non-hidden files (recursive, sorted by relative path). Raises DataError for a missing path,
    a path that is neither file nor directory, a directory with no file, or no input at all."""
    if not inputs:
        raise DataError("prepare needs at least one input file or directory")
    files: list[str] = []
    for given in map(os.fspath, inputs):
        p = Path(given)
        if p.is_file():
            files.append(given)
        elif p.is_dir():
            found = [os.path.join(given, rel) for rel in directory_files(p)]
            if not found:
                raise DataError(f"{given}: the directory holds no regular, non-hidden file")
            files.extend(found)
        elif not p.exists():
            raise DataError(f"{given} does not exist")
        else:
            raise DataError(f"{given} is neither a regular file nor a directory")
    return files


def check_readable(path: str, text_field: str) -> None:
    """Fail early (DataError) for an input this process cannot open, a Parquet input when
    `pyarrow` is absent, or one whose schema lacks the string column `text_field`."""
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None
    if file_kind(path) != "parquet":
        return
    pq = _pyarrow_parquet(path)
    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises several types for a file that is not Parquet
        raise DataError(f"cannot read {path} as Parquet: {err}") from err
    if text_field not in schema.names:
        raise DataError(f"{path}: no column {text_field!r} (--text-field); columns: "
                        f"{', '.join(schema.names)}")
    kind = str(schema.field(text_field).type)
    if kind not in ("string", "large_string", "string_view"):
        raise DataError(f"{path}: column {text_field!r} has type {kind}; --text-field must name "
                        f"a string column")


def read_batches(path: str, text_field: str, batch_bytes: int = BATCH_BYTES,
                 batch_documents: int = BATCH_DOCUMENTS) -> Iterator[Batch]:
    """The documents of `path` (see the module docstring), a bounded batch at a time; empty
    documents are dropped. Raises DataError naming the file and the place for text that is not
    UTF-8, a `.jsonl` line that is not a JSON object with a string `text_field`, or a null in a
    Parquet column."""
    kind = file_kind(path)
    if kind == "jsonl":
        return _jsonl_batches(path, text_field, batch_bytes, batch_documents)
    if kind == "parquet":
        return _parquet_batches(path, text_field, batch_documents)
    return _text_batches(path, batch_bytes)


def _decode(data: bytes, path: str, at: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text at byte {at + err.start} ({err.reason})") from None


def _text_batches(path: str, block: int) -> Iterator[Batch]:
    pending, at, started = bytearray(), 0, False
    for data in _read_blocks(path, block):
        scanned = max(0, len(pending) - 5)  # newlines before here were judged whole
        pending += data
        cut = _last_cut(pending, scanned)
        if cut:
            text = _decode(bytes(pending[:cut]), path, at)
            yield Batch([text], [False], cut)
            del pending[:cut]
            at, started = at + cut, True
    text = _decode(bytes(pending), path, at)
    if text or started:  # the end of the document, so a non-empty file ends with EOS
        yield Batch([text], [True], len(pending))


def _read_blocks(path: str, block: int) -> Iterator[bytes]:
    """The bytes of `path`, `block` at a time; a read error is a DataError naming the file."""
    try:
        with open(path, "rb") as fh:
            while data := fh.read(block):
                yield data
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None


def _last_cut(data: bytes | bytearray, start: int = 0) -> int:
    """The end of the last newline in `data[start:]` with a character that is not whitespace on
    either side (0: none). Scanning only what was appended since the last scan keeps a file
    without such a newline (CRLF line ends) linear in its size."""
    i = len(data) - 1
    while (i := data.rfind(b"\n", max(start, 0), i)) > 0:
        before = bytes(data[max(0, i - 4):i]).decode("utf-8", "ignore")[-1:]
        after = bytes(data[i + 1:i + 5]).decode("utf-8", "ignore")[:1]
        if before and after and not before.isspace() and not after.isspace():
            return i + 1
    return 0


def _jsonl_batches(path: str, field: str, batch_bytes: int, batch_documents: int
                   ) -> Iterator[Batch]:
    texts: list[str] = []
    size = nbytes = 0
    for number, line in enumerate(_read_lines(path), 1):
        nbytes += len(line)
        if not line.strip():
            continue
        text = _jsonl_text(line, field, path, number)
        if text:
            texts.append(text)
            size += len(text)
        if len(texts) >= batch_documents or size >= batch_bytes:
            yield Batch(texts, [True] * len(texts), nbytes)
            texts, size, nbytes = [], 0, 0
    if texts or nbytes:
        yield Batch(texts, [True] * len(texts), nbytes)


def _read_lines(path: str) -> Iterator[bytes]:
    """The lines of `path`; a read error is a DataError naming the file."""
    try:
        with open(path, "rb") as fh:
            yield from fh
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror or err})") from None


def _jsonl_text(line: bytes, field: str, path: str, number: int) -> str:
    try:
        record = json.loads(line)
    except ValueError as err:
        raise DataError(f"{path}: line {number} is not valid JSON ({err})") from None
    if not isinstance(record, dict) or field not in record:
        raise DataError(f"{path}: line {number} has no field {field!r} (--text-field)")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{path}: line {number}: field {field!r} must be a string, got "
                        f"{type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # JSON escapes such as "\\ud800" decode to lone surrogates
        raise DataError(f"{path}: line {number}: field {field!r} holds the lone surrogate "
                        f"U+{ord(text[err.start]):04X} at character {err.start}, which is not "
                        f"text (no UTF-8 encoding); repair or drop the line") from None
    return text


def _pyarrow_parquet(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'mpipar[parquet]'"
                        ) from None
    return pq


def _parquet_batches(path: str, field: str, batch_documents: int) -> Iterator[Batch]:
    check_readable(path, field)
    pq = _pyarrow_parquet(path)
    parquet = pq.ParquetFile(path)
    size, row = os.path.getsize(path), 0
    total_rows = max(1, parquet.metadata.num_rows)
    consumed = 0
    for record_batch in parquet.iter_batches(batch_size=batch_documents, columns=[field]):
        column = record_batch.column(0)
        if column.null_count:
            first = next(i for i, v in enumerate(column.is_null().to_pylist()) if v)
            raise DataError(f"{path}: row {row + first} of column {field!r} is null")
        texts = [t for t in column.to_pylist() if t]
        row += len(column)
        done = size * row // total_rows
        yield Batch(texts, [True] * len(texts), done - consumed)
        consumed = done
