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
records ``preference_pairs`` and ``seq_len`` (and the tokenizer, as ``prepare --tokenizer`` does).

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
    rows, masks = [], []
    for n, rec in jsonl_records(path, "--preference"):
        where = f"{path}:{n}"
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
        if enc.spec is not None:
            f.attrs.update(enc.spec.attrs())
        f.attrs.update({"preference_pairs": len(rows) // 2, "seq_len": seq_len})
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
