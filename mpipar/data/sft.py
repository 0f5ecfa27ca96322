"""Supervised fine-tuning data: prompt/completion pairs with a loss mask (``--loss-mask``).

``python -m mpipar.data prepare --sft PAIRS.jsonl --tokenizer DIR --out OUT.h5`` reads JSONL
records ``{"prompt": str, "completion": str}`` and writes one token stream of examples, each
``prompt ids + completion ids + EOS`` (so ``--document-masking`` keeps examples apart), beside a
``loss_mask`` stream of the same length: 0 on the prompt's tokens, 1 on the completion's and on
its EOS. A target carries loss with ``--loss-mask`` iff the token it predicts has mask 1: the
model learns the completions (and to end them), never the prompts. The file records the
tokenizer as ``prepare --tokenizer`` does, and ``examples``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from mpipar.data.prepare import hdf5_output, output_file
from mpipar.data.sources import DataError, H5_SUFFIXES, TokenSource, _h5_dataset

MASK = "loss_mask"


def _records(path: str | os.PathLike):
    """(line number, prompt, completion) of every record of the JSONL file ``path``."""
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{n}: not JSON ({err.msg})") from None
            if not (isinstance(rec, dict) and isinstance(rec.get("prompt"), str)
                    and isinstance(rec.get("completion"), str)):
                raise DataError(f"{path}:{n}: a record needs string fields 'prompt' and "
                                f"'completion' (chat 'messages' are not supported yet)")
            yield n, rec["prompt"], rec["completion"]


def prepare_sft(path: str | os.PathLike, out: str | os.PathLike, tokenizer: str | os.PathLike,
                eos: str | None = None) -> tuple[int, int, int]:
    """Write the examples of ``path`` to ``out`` (module docstring) -> (tokens, examples,
    tokens with mask 1)."""
    from mpipar.data.tokenizer import load_tokenizer
    out = output_file(out)
    tok, spec = load_tokenizer(tokenizer, eos)
    ids, mask = [], []
    for _, prompt, completion in _records(path):
        p = tok.encode(prompt, add_special_tokens=False).ids
        c = tok.encode(completion, add_special_tokens=False).ids + [spec.eos_id]
        ids += [p, c]
        mask += [np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)]
    if not ids:
        raise DataError(f"{path}: no prompt/completion records")
    tokens, flags = np.concatenate(ids).astype(spec.dtype), np.concatenate(mask)
    with hdf5_output(out) as (f, _):
        f.create_dataset("tokens", data=tokens)
        f.create_dataset(MASK, data=flags)
        f.attrs.update(spec.attrs())
        f.attrs.update({"documents": len(ids) // 2, "examples": len(ids) // 2})
    return len(tokens), len(ids) // 2, int(flags.sum())


def loss_mask_source(path: str, seq_len: int) -> TokenSource:
    """The ``loss_mask`` stream of a prepared SFT file, cut into samples as its tokens are."""
    if Path(path).suffix.lower() not in H5_SUFFIXES or not Path(path).is_file():
        raise DataError(f"--loss-mask: {path or 'the built-in corpus'} is not an HDF5 file "
                        f"written by data prepare --sft")
    with h5py.File(path, "r") as f:
        if MASK not in f or f[MASK].shape != f["tokens"].shape:
            raise DataError(f"--loss-mask: {path} has no '{MASK}' stream beside its tokens "
                            f"(write it with data prepare --sft)")
        shape, dtype = f[MASK].shape, f[MASK].dtype
    return TokenSource(path, "hdf5", seq_len, shape, dtype, _h5_dataset(path, MASK))
