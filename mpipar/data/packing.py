"""Packed documents (``--document-masking``, ``--eod-mask-loss``): what a batch of packed
samples says about its documents, and the rules of those flags.

A sample of ``seq_len + 1`` tokens cut from the concatenated corpus holds several documents,
each ended by the EOS token (``--eos-token-id``, or the EOS ``data prepare --tokenizer``
recorded). The EOS belongs to the document it ends; the token after it starts the next one; the
sample's first document may be the tail of one cut by packing and is a document like any other.
The model reads the documents through :class:`mpipar.model.attention.DocumentPositions` (one
per microbatch, :func:`microbatch_positions`); the loss through a 0/1 mask of counted targets.
The batches of a step (:mod:`mpipar.training.batches`) ask this module for all of it: the
documents of a global batch, each microbatch's positions, the targets that count.
"""
from __future__ import annotations

import contextlib

import numpy as np

from mpipar.config import TrainConfig, require
from mpipar.data.sft import loss_mask_source
from mpipar.data.sources import (DataError, Sampler, TokenSource, load_tokens,
                                 recorded_tokenizer, training_batches)
from mpipar.layout import Layout
from mpipar.model.attention import DocumentPositions, document_ids
from mpipar.parallel.sequence_split import SeqLayout


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


SCAN_CHUNK = 1 << 22
"""Tokens read at a time when :func:`packed_data` looks for the EOS id and a counted target."""


def packed_data(train: TrainConfig, source: TokenSource, samples: int
                ) -> tuple[int | None, TokenSource | None]:
    """(the EOS id, or None when the run reads none; the ``--loss-mask`` stream, or None) of a
    run training on samples ``[0, samples)`` of ``source``. DataError naming the value and the
    rule when the EOS id never occurs in the data (documents would be the whole stream: plain
    causal attention, and ``--eod-mask-loss`` would mask nothing), or when no training target
    carries loss (the run would report loss 0 and learn nothing). Each scan stops at the first
    token that answers it."""
    eos = eos_id(train) if uses_eos(train) else None
    masks = loss_mask_source(train.data, train.seq_len) if train.loss_mask else None
    if eos is not None and not _holds(source, lambda x: x == eos):
        flags = " and ".join(f for f, on in (("--document-masking", train.document_masking),
                                              ("--eod-mask-loss", train.eod_mask_loss)) if on)
        raise DataError(f"train.eos_token_id={eos}: the id never occurs in the "
                        f"{source.num_tokens} tokens of the training data ({source.path}); "
                        f"{flags} needs the id that ends its documents (without one the run "
                        f"would be plain causal and mask nothing)")
    if masks_loss(train) and not _counts_a_target(source, masks, train, eos, samples):
        rule = " and ".join(r for r, on in (
            ("loss_mask is 0 at every target (--loss-mask)", train.loss_mask),
            (f"every input is the EOS id {eos} (--eod-mask-loss)", train.eod_mask_loss))
            if on)
        raise DataError(f"{source.path}: no target of its {samples} training samples carries "
                        f"loss ({rule}); the run would report loss 0 and learn nothing")
    return eos, masks


def _holds(source: TokenSource, test, stop: int | None = None) -> bool:
    """Whether some token of ``source`` (of its first ``stop`` rows or tokens) passes ``test``
    (an array of tokens -> booleans)."""
    stop = source.shape[0] if stop is None else stop
    rows = max(1, SCAN_CHUNK // (source.shape[1] if source.kind == "samples" else 1))
    with source._open() as arr:
        return any(test(np.asarray(arr[a:min(a + rows, stop)])).any()
                   for a in range(0, stop, rows))


def _counts_a_target(source: TokenSource, masks: TokenSource | None, train: TrainConfig,
                     eos: int | None, samples: int) -> bool:
    """Whether some target of samples ``[0, samples)`` carries loss (:func:`counted_targets`):
    its input is not the EOS under ``--eod-mask-loss``, its mask is not 0 under ``--loss-mask``.
    A stream's targets are its tokens ``[1, samples * seq_len]``; a samples file's, the last
    ``seq_len`` of each row."""
    if source.kind == "samples":   # no loss mask there (loss_mask_source): only --eod-mask-loss
        return _holds(source, lambda rows: rows[:, :-1] != eos, samples)
    stop = samples * source.seq_len + 1
    opened = masks._open() if masks is not None else contextlib.nullcontext()
    with source._open() as tokens, opened as mask:
        for a in range(1, stop, SCAN_CHUNK):
            b = min(a + SCAN_CHUNK, stop)
            counted = np.ones(b - a, bool)
            if train.eod_mask_loss:
                counted &= np.asarray(tokens[a - 1:b - 1]) != eos
            if train.loss_mask:
                counted &= np.asarray(mask[a:b]) != 0
            if counted.any():
                return True
    return False


def masks_loss(train: TrainConfig) -> bool:
    """Whether some targets carry no loss (``--eod-mask-loss`` or ``--loss-mask``)."""
    return train.eod_mask_loss or train.loss_mask


def sample_indices(batcher, k: int, rows: slice) -> np.ndarray:
    """The sample indices behind ``batcher.batch(k, rows)`` (a Sampler's step or an EvalSet's
    batch): where the loss mask of those rows is read."""
    if isinstance(batcher, Sampler):
        return batcher.indices(k)[rows]
    return batcher.indices[k * batcher.batch_size:(k + 1) * batcher.batch_size][rows]


def uses_eos(train: TrainConfig) -> bool:
    """Whether the run reads the EOS token (documents or the EOS loss mask)."""
    return train.document_masking or train.eod_mask_loss


def counted_targets(inputs: np.ndarray, train: TrainConfig, eos: int | None,
                    mask: np.ndarray | None = None) -> np.ndarray | None:
    """1.0 where a target carries loss, 0.0 where not, ``[B, S]`` float64 (``--eod-mask-loss``:
    the input is EOS; ``--loss-mask``: ``mask [B, S + 1]`` of the samples is 0 at the target's
    token); None when every target counts."""
    if not masks_loss(train):
        return None
    out = np.ones(np.shape(inputs), np.float64)
    if train.eod_mask_loss:
        out *= np.asarray(inputs) != eos
    if train.loss_mask:
        out *= np.asarray(mask)[:, 1:] != 0
    return out


def batch_documents(inputs: np.ndarray, eos: int) -> np.ndarray:
    """The document ids ``[rows, S]`` of packed input rows ``inputs [rows, S]`` (an EOS belongs
    to the document it ends: :func:`mpipar.model.attention.document_ids`)."""
    return document_ids(inputs, eos)


def microbatch_positions(docs: np.ndarray, seq: SeqLayout, sp_rank: int,
                         positions: np.ndarray) -> DocumentPositions:
    """Sp rank ``sp_rank``'s positions of a microbatch whose rows hold documents ``docs
    [mbs, S]``, carrying them: ``positions`` (the rank's under ``seq``) when one split serves
    every microbatch, else those of this microbatch's split (``--sp-split balanced``:
    :meth:`~mpipar.parallel.sequence_split.SeqLayout.for_microbatch`)."""
    split = seq.for_microbatch(docs)
    if split is seq:
        return DocumentPositions.of(positions, docs, None)
    return DocumentPositions.of(split.positions(sp_rank), docs, split)


def step_documents(cfg, step: int = 0) -> np.ndarray:
    """The document ids ``[global batch, seq_len]`` of optimizer step ``step``'s global batch
    of ``cfg``'s data under ``--document-masking`` (what a training step reads: the same source,
    :func:`~mpipar.data.sources.training_batches` and EOS), for the planner's step time and traffic. Raises
    DataError for data the run could not read."""
    tr = cfg.train
    source = load_tokens(tr.data or None, cfg.model.vocab_size, tr.seq_len)
    sampler = training_batches(source, tr, cfg.model.vocab_size)[0]
    eos, _ = packed_data(tr, source, sampler.num_samples)   # the run's rules on its data
    return batch_documents(sampler.batch(step)[0], eos)


def check_config(layout: Layout) -> None:
    """An EOS id in the vocabulary (given, or recorded by the data) when documents or the EOS
    loss mask are asked for, and none otherwise; RoPE scaled by the sequence's length (dynamic)
    cannot restart per document."""
    t, m = layout.train, layout.model
    if t.loss_mask:
        try:
            loss_mask_source(t.data, t.seq_len)
        except (DataError, OSError) as exc:
            require(False, f"train.loss_mask=True: {exc}")
    if not uses_eos(t):
        require(t.eos_token_id == -1,
                f"train.eos_token_id={t.eos_token_id}: needs --document-masking or "
                f"--eod-mask-loss")
        return
    require(t.eos_token_id >= -1, f"train.eos_token_id={t.eos_token_id}: must be >= 0 (or -1)")
    try:
        eos = eos_id(t)
        recorded = recorded_tokenizer(t.data) if t.data and t.eos_token_id >= 0 else None
    except DataError as exc:
        require(False, str(exc))
    require(recorded is None or recorded["eos_id"] == eos,
            f"train.eos_token_id={eos}: the data ({t.data}) records eos_id="
            f"{(recorded or {}).get('eos_id')} ({(recorded or {}).get('eos_token')!r}) as the end "
            f"of its documents; another id would cut them where they do not end (drop "
            f"--eos-token-id to use the recorded one)")
    require(eos < m.vocab_size,
            f"train.eos_token_id={eos}: must be < model.vocab_size={m.vocab_size}")
    if t.document_masking:
        require(not m.rope.by_sequence_length,
                f"model.rope_type={m.rope_type!r} with --document-masking: dynamic NTK scales "
                f"by the whole sequence's length, which a document does not have; use default, "
                f"linear or llama3")
