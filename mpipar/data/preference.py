"""Preference data for direct preference optimization: pairs of a prompt's chosen and rejected
responses, with a loss mask over the responses.

``python -m mpipar.data prepare --preference PAIRS.jsonl --seq-len S --out OUT.h5`` reads JSONL
records, one pair a line, either as text (with ``--tokenizer``)::

    {"prompt": str, "chosen": str, "rejected": str}

where the prompt may also be a list of chat messages (``{"role", "content"}``), rendered with
the tokenizer's chat template as ``prepare --sft`` renders a conversation (the prompt with the
generation prompt; each response is what the conversation with it as the assistant's last
message adds), each response ending with EOS as an SFT completion does; or as token ids, taken
as they are::

    {"prompt_ids": [int], "chosen_ids": [int], "rejected_ids": [int]}

Pair ``i`` is written as two rows of ``S`` tokens of one token stream, so that the sampler's
sample ``j`` (tokens ``[j*S, j*S + S]``) is one sequence: row ``2i`` holds prompt + chosen,
row ``2i + 1`` prompt + rejected, each cut to its first ``S`` tokens and padded (EOS, or id 0
without a tokenizer); one pad token ends the stream. Beside it a ``loss_mask`` stream of the same
length is 1 on the response tokens and 0 on the prompt, the padding and the first token of every
row (which no target of its row predicts): a target carries loss iff the token it predicts has
mask 1, as for SFT. A response that the cut leaves without a token of mask 1 is refused. The file
records ``preference_pairs`` and ``seq_len`` (and the tokenizer, as ``prepare --tokenizer`` does),
the JSONL it was read from (``preference_source``) and each pair's line there
(``preference_lines``).

Packed pairs (``--pack-pairs``, :func:`pack_pairs`): the same file trains packed. A sequence is
its row's first ``length`` tokens, up to its last token of mask 1 (:func:`sequence_lengths`:
prompt + response as the row holds it, cut to ``S``); a microbatch of ``m`` pairs is ``m`` rows
of ``S`` tokens, its pairs laid in order, a pair's chosen then rejected sequence side by side in
one row, a pair going to the next row when it does not fit the rest of the current one; each
sequence is its own document, and what is left of a row is padding (a document of its own, no
target counted). A pair fits a row alone iff its two sequences take at most ``S`` tokens
together (:func:`check_packable`), and then its microbatch's pairs always fit their ``m`` rows.

Any bad record (a missing or mistyped field, text without ``--tokenizer``, a negative id, a
response cut to nothing) is a DataError naming FILE:LINE; nothing is written.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from pathlib import Path

import h5py
import numpy as np

from mpipar.data.prepare import hdf5_output, output_file
from mpipar.data.sft import MASK, chat_template, jsonl_records, render_chat
from mpipar.data.sources import H5_SUFFIXES, DataError
from mpipar.data.tokenizer import token_dtype

TEXT_FIELDS = ("prompt", "chosen", "rejected")
ID_FIELDS = ("prompt_ids", "chosen_ids", "rejected_ids")
MAX_ID = 1 << 32
LINES = "preference_lines"
"""The dataset of each pair's line in the JSONL file it was prepared from."""
"""Token ids of an ids record are below this (the widest token stream is uint32)."""


@dataclass(frozen=True)
class PreparedPairs:
    """What :func:`prepare_preference` wrote: ``pairs`` pairs of two ``seq_len``-token rows,
    ``response_tokens`` of them with mask 1."""

    pairs: int
    seq_len: int
    response_tokens: int


class _Encoder:
    """Token ids of a record's prompt and responses: from its ids, or from its text with the
    tokenizer (loaded on first use) and, for a chat prompt, its chat template."""

    def __init__(self, tokenizer: str | os.PathLike | None, eos: str | None) -> None:
        self.path, self.eos, self._tok, self._chat = tokenizer, eos, None, None

    @property
    def spec(self):
        """The tokenizer's spec (None without ``--tokenizer``)."""
        return None if self._tok is None else self._tok[1]

    def ids(self, rec, where: str) -> tuple[list[int], list[int], list[int]]:
        """(prompt, chosen, rejected) ids of record ``rec`` at ``where``."""
        if not isinstance(rec, dict):
            raise DataError(f"{where}: a record is a JSON object with fields "
                            f"{', '.join(TEXT_FIELDS)} or {', '.join(ID_FIELDS)}")
        if any(k in rec for k in ID_FIELDS):
            return tuple(_id_list(rec, k, where) for k in ID_FIELDS)
        missing = [k for k in TEXT_FIELDS if k not in rec]
        if missing:
            raise DataError(f"{where}: the record has no field '{missing[0]}' (a pair needs "
                            f"{', '.join(TEXT_FIELDS)}, or {', '.join(ID_FIELDS)})")
        for k in TEXT_FIELDS[1:]:
            if not isinstance(rec[k], str):
                raise DataError(f"{where}: field '{k}' must be a string")
        if self.path is None:
            raise DataError(f"{where}: a text record needs --tokenizer (or give token ids "
                            f"as {', '.join(ID_FIELDS)})")
        return self._text(rec, where)

    def _text(self, rec: dict, where: str) -> tuple[list[int], list[int], list[int]]:
        if self._tok is None:
            from mpipar.data.tokenizer import load_tokenizer
            self._tok = load_tokenizer(self.path, self.eos)
        tok, spec = self._tok
        prompt = rec["prompt"]
        if isinstance(prompt, list):
            self._chat = self._chat or chat_template(self.path)
            rendered = [render_chat(*self._chat, [*prompt, {"role": "assistant", "content": r}],
                                    where) for r in (rec["chosen"], rec["rejected"])]
            prompt, responses = rendered[0][0], [c for _, c in rendered]
        elif isinstance(prompt, str):
            responses = [rec["chosen"], rec["rejected"]]
        else:
            raise DataError(f"{where}: field 'prompt' must be a string or a list of chat "
                            f"messages")
        p = tok.encode(prompt, add_special_tokens=False).ids
        out = []
        for r in responses:
            c = tok.encode(r, add_special_tokens=False).ids
            out.append(c if c and c[-1] == spec.eos_id else c + [spec.eos_id])
        return p, out[0], out[1]


def _id_list(rec: dict, key: str, where: str) -> list[int]:
    """Field ``key`` of ``rec``: a list of token ids (integers >= 0)."""
    if key not in rec:
        raise DataError(f"{where}: the record has no field '{key}' (a pair of ids needs "
                        f"{', '.join(ID_FIELDS)})")
    ids = rec[key]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            and 0 <= i < MAX_ID for i in ids):
        raise DataError(f"{where}: field '{key}' must be a list of token ids (integers in "
                        f"[0, {MAX_ID}))")
    return ids


def _row(prompt: list[int], response: list[int], seq_len: int, pad: int, where: str,
         name: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss mask) of one row: prompt + response cut to ``seq_len`` tokens and
    padded; the mask 1 on the response's tokens after the row's first."""
    ids = (prompt + response)[:seq_len]
    mask = np.zeros(seq_len, np.uint8)
    mask[len(prompt):len(ids)] = 1
    mask[0] = 0
    if not mask.any():
        raise DataError(f"{where}: the {name} response has no token left within --seq-len "
                        f"{seq_len} (prompt of {len(prompt)} tokens, response of "
                        f"{len(response)}); shorten the prompt or raise --seq-len")
    row = np.full(seq_len, pad, np.int64)
    row[:len(ids)] = ids
    return row, mask


def prepare_preference(path: str | os.PathLike, out: str | os.PathLike, seq_len: int,
                       tokenizer: str | os.PathLike | None = None,
                       eos: str | None = None) -> PreparedPairs:
    """Write the pairs of the JSONL file ``path`` to ``out`` (module docstring)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"--seq-len must be an integer >= 2, got {seq_len!r}")
    out = output_file(out)
    enc = _Encoder(tokenizer, eos)
    rows, masks, lines = [], [], []
    for n, rec in jsonl_records(path, "--preference"):
        where = f"{path}:{n}"
        lines.append(n)
        prompt, chosen, rejected = enc.ids(rec, where)
        pad = 0 if enc.spec is None else enc.spec.eos_id
        for name, response in (("chosen", chosen), ("rejected", rejected)):
            row, mask = _row(prompt, response, seq_len, pad, where, name)
            rows.append(row)
            masks.append(mask)
    if not rows:
        raise DataError(f"{path}: no preference pairs")
    pad = 0 if enc.spec is None else enc.spec.eos_id
    tokens = np.concatenate([*rows, [pad]])
    flags = np.concatenate([*masks, np.zeros(1, np.uint8)])
    dtype = enc.spec.dtype if enc.spec is not None else token_dtype(int(tokens.max()) + 1)
    with hdf5_output(out) as (f, _):
        f.create_dataset("tokens", data=tokens.astype(dtype))
        f.create_dataset(MASK, data=flags)
        f.create_dataset(LINES, data=np.asarray(lines, np.int64))
        if enc.spec is not None:
            f.attrs.update(enc.spec.attrs())
        f.attrs.update({"preference_pairs": len(rows) // 2, "seq_len": seq_len,
                        "preference_source": str(path)})
    return PreparedPairs(len(rows) // 2, seq_len, int(flags.sum()))


def preference_pairs(path: str | os.PathLike, seq_len: int) -> int:
    """The pairs of ``path``, a file of :func:`prepare_preference` written for ``seq_len``;
    DataError naming it and the rule otherwise."""
    if Path(path).suffix.lower() not in H5_SUFFIXES or not Path(path).is_file():
        raise DataError(f"--objective dpo: --data {path or 'the built-in corpus'} is not an HDF5 "
                        f"file written by data prepare --preference")
    with h5py.File(path, "r") as f:
        pairs, written = f.attrs.get("preference_pairs"), f.attrs.get("seq_len")
        if pairs is None or MASK not in f:
            raise DataError(f"--objective dpo: --data {path} holds no preference pairs (write "
                            f"it with data prepare --preference)")
    if int(written) != seq_len:
        raise DataError(f"--objective dpo: --data {path} holds pairs of {int(written)} tokens, "
                        f"not --seq-len {seq_len}: prepare it with --seq-len {seq_len}")
    return int(pairs)


def sequence_lengths(masks: np.ndarray) -> np.ndarray:
    """The lengths ``[n]`` of sequences whose rows' loss masks are ``masks [n, S]``: up to
    and with the last token of mask 1, the end of the response as the row holds it."""
    flipped = np.asarray(masks)[:, ::-1] != 0
    return flipped.shape[1] - np.argmax(flipped, axis=1)


def check_packable(path: str | os.PathLike, seq_len: int) -> None:
    """DataError naming the pair's line (``FILE:LINE``) and the rule when a pair of the file
    ``path`` (of :func:`prepare_preference`, rows of ``seq_len``) does not fit one packed row:
    its two sequences take more than ``seq_len`` tokens together (module docstring)."""
    chunk = max(1, (1 << 22) // (2 * seq_len))
    with h5py.File(path, "r") as f:
        pairs, mask = int(f.attrs["preference_pairs"]), f[MASK]
        for a in range(0, pairs, chunk):
            b = min(a + chunk, pairs)
            rows = np.asarray(mask[2 * a * seq_len:2 * b * seq_len]).reshape(-1, seq_len)
            need = sequence_lengths(rows).reshape(-1, 2).sum(axis=1)
            over = np.flatnonzero(need > seq_len)
            if over.size:
                i = a + int(over[0])
                where = (f"{f.attrs['preference_source']}:{int(f[LINES][i])}" if LINES in f
                         else f"{path}: pair {i}")
                raise DataError(f"{where}: its prompt + chosen and prompt + rejected take "
                                f"{int(need[over[0]])} tokens together, more than one packed "
                                f"row of --seq-len {seq_len} (--pack-pairs lays both sequences "
                                f"of a pair in one row); shorten the pair, raise --seq-len, or "
                                f"train without --pack-pairs")


def pack_pairs(lengths: np.ndarray, pairs: int, seq_len: int) -> np.ndarray:
    """Where the tokens of sequences of ``lengths [2P]`` (pair ``i``'s chosen at ``2i``, its
    rejected at ``2i + 1``) go when packed, each group of ``pairs`` pairs (a microbatch) into
    ``pairs`` rows of ``seq_len`` (module docstring): ``[P, seq_len]`` int64, the index of the
    token in the sequences' rows flattened (sequence ``j``'s token ``t`` at ``j * seq_len +
    t``), -1 where the row is padding. Every pair must fit a row (:func:`check_packable`)."""
    lengths = np.asarray(lengths, np.int64)
    P = len(lengths) // 2
    out = np.full((P, seq_len), -1, np.int64)
    for first in range(0, P, pairs):
        row, col = first, 0
        for i in range(first, min(first + pairs, P)):
            if col + lengths[2 * i] + lengths[2 * i + 1] > seq_len:
                row, col = row + 1, 0
            for j in (2 * i, 2 * i + 1):
                out[row, col:col + lengths[j]] = j * seq_len + np.arange(lengths[j])
                col += lengths[j]
    return out
