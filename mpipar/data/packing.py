"""Packed documents (``--document-masking``, ``--eod-mask-loss``): what a batch of packed
samples says about its documents, and the rules of those flags.

A sample of ``seq_len + 1`` tokens cut from the concatenated corpus holds several documents,
each ended by the EOS token (``--eos-token-id``, or the EOS ``data prepare --tokenizer``
recorded). The EOS belongs to the document it ends; the token after it starts the next one; the
sample's first document may be the tail of one cut by packing and is a document like any other.
The model reads the documents through :class:`mpipar.model.attention.DocumentPositions` (the
engine builds one per microbatch); the loss through a 0/1 mask of counted targets.
"""
from __future__ import annotations

import numpy as np

from mpipar.config import TrainConfig, require
from mpipar.data.sources import DataError, recorded_tokenizer
from mpipar.layout import Layout
from mpipar.runtime.device import resolve_device


def eos_id(train: TrainConfig) -> int:
    """The end-of-text token id: ``--eos-token-id``, else the one recorded in ``--data``."""
    if train.eos_token_id >= 0:
        return train.eos_token_id
    tok = recorded_tokenizer(train.data) if train.data else None
    if tok is None:
        raise DataError(f"train.eos_token_id={train.eos_token_id}: the data "
                        f"({train.data or 'the built-in byte corpus'}) records no EOS token; "
                        f"give --eos-token-id")
    return int(tok["eos_id"])


def uses_eos(train: TrainConfig) -> bool:
    """Whether the run reads the EOS token (documents or the EOS loss mask)."""
    return train.document_masking or train.eod_mask_loss


def counted_targets(inputs: np.ndarray, train: TrainConfig, eos: int) -> np.ndarray | None:
    """1.0 where a target carries loss, 0.0 where not (``--eod-mask-loss``: the input is EOS),
    ``[B, S]`` float64; None when every target counts."""
    if not train.eod_mask_loss:
        return None
    return (np.asarray(inputs) != eos).astype(np.float64)


def check_config(layout: Layout) -> None:
    """An EOS id in the vocabulary (given, or recorded by the data) when documents or the EOS
    loss mask are asked for, and none otherwise; RoPE scaled by the sequence's length (dynamic)
    cannot restart per document; the GPU kernels are not verified with document masks."""
    t, m = layout.train, layout.model
    if not uses_eos(t):
        require(t.eos_token_id == -1,
                f"train.eos_token_id={t.eos_token_id}: needs --document-masking or "
                f"--eod-mask-loss")
        return
    require(t.eos_token_id >= -1, f"train.eos_token_id={t.eos_token_id}: must be >= 0 (or -1)")
    try:
        eos = eos_id(t)
    except DataError as exc:
        require(False, str(exc))
    require(eos < m.vocab_size,
            f"train.eos_token_id={eos}: must be < model.vocab_size={m.vocab_size}")
    if t.document_masking:
        require(m.rope_type != "dynamic",
                f"model.rope_type='dynamic' with --document-masking: dynamic NTK scales by the "
                f"whole sequence's length, which a document does not have; use default, linear "
                f"or llama3")
        require(t.backend != "cupy" and resolve_device(t.device) != "cuda",
                f"train.document_masking with train.device={t.device!r}, "
                f"train.backend={t.backend!r}: document masks are verified on the CPU kernels "
                f"only; use --device cpu")
