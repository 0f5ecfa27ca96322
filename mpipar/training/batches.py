"""One global batch as a rank trains or evaluates on it, read once.

:func:`prepare` reads the rows of global batch ``k`` (a training step's, or a validation
batch's) once and derives from them everything a step needs: this rank's microbatches (its dp
rows, its sp positions, moved to the backend's array module), their packed documents and the
targets that count (:mod:`mpipar.data.packing`, the one home of packed documents), the loss
divisor (the targets of the whole global batch that carry loss: every rank has them, so the
count is layout-invariant and needs no message), and under ``--document-masking`` the global
batch's documents (the attention imbalance and the model FLOPs read them). The whole batch is
read where a rule needs it (documents, masked loss); otherwise only this rank's rows. Under
``--pack-pairs`` this rank's pairs are read as sequences and packed into rows
(:func:`mpipar.data.preference.pack_pairs`), each microbatch's pairs into its own rows, each
sequence a document of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mpipar.data.packing import (batch_documents, counted_targets, masks_loss,
                                 microbatch_positions, sample_indices)
from mpipar.data.preference import pack_pairs, sequence_lengths
from mpipar.data.sources import EvalSet, Sampler, inputs_targets
from mpipar.parallel.pipeline.executor import Microbatch
from mpipar.training.objective import PairLoss, Sequences
from mpipar.training.rank import Rank


@dataclass(frozen=True)
class StepBatch:
    """Global batch ``k`` as this rank sees it: its microbatches, the loss divisor, the
    whole batch's document ids ``[rows, S]`` (None without ``--document-masking``) and its
    counted targets (None when every target counts: no loss mask, or DPO's pairs). A batch
    whose every target is masked counts 0: its loss and gradient are 0 by definition, not a
    measurement, and the step says so (:mod:`mpipar.observe.metrics`)."""
    microbatches: tuple[Microbatch, ...]
    divisor: int
    documents: np.ndarray | None
    targets: int | None = None


def prepare(rank: Rank, batches: Sampler | EvalSet, k: int) -> StepBatch:
    """Global batch ``k`` of ``batches`` (the sampler's step ``k``, or validation batch ``k``)
    for ``rank`` (module docstring). Under ``--objective dpo`` the batch's samples are pairs,
    each two rows of the source (:class:`mpipar.training.objective.Preference`), and the
    divisor is the global batch's pairs."""
    tr, pref = rank.cfg.train, rank.data.preference
    d, n = rank.coord.dp, rank.data.rows_per_dp
    mine = slice(d * n, (d + 1) * n)
    whole = masks_loss(tr) or tr.document_masking
    indices = sample_indices(batches, k, slice(None) if whole else mine)
    if pref is not None:
        indices = pref.rows(indices)
    inputs, targets = inputs_targets(batches.source, indices)
    masks = None if rank.data.masks is None else rank.data.masks.sample(indices)
    counted = (counted_targets(inputs, tr, rank.data.eos, masks) if pref is None
               else (masks[:, 1:] != 0).astype(np.float64))
    docs = batch_documents(inputs, rank.data.eos) if tr.document_masking else None
    packed = None
    if pref is not None and tr.pack_pairs:
        inputs, targets, counted, packed = _packed(inputs, targets, counted, masks, tr)
    n_counted = None if pref is not None or counted is None else int(counted.sum())
    divisor = (tr.global_batch_size if pref is not None
               else tr.global_batch_size * tr.seq_len if n_counted is None
               else max(1, n_counted))
    at = mine if whole else slice(None)
    micro = _microbatches(rank, inputs[at], targets[at],
                          None if counted is None else counted[at],
                          None if docs is None else docs[at],
                          None if pref is None or pref.reference is None
                          else pref.reference[indices], packed)
    return StepBatch(microbatches=micro, divisor=divisor, documents=docs, targets=n_counted)


def _packed(inputs: np.ndarray, targets: np.ndarray, counted: np.ndarray, masks: np.ndarray,
            tr) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, counted targets, where) of pairs' sequences ``[2P, S]`` packed into
    ``P`` rows (:func:`mpipar.data.preference.pack_pairs`, ``where`` its answer); padding
    is token 0 and counts no target."""
    where = pack_pairs(sequence_lengths(masks[:, :-1]), tr.micro_batch_size, tr.seq_len)
    pad, at = where < 0, np.maximum(where, 0)
    return (np.where(pad, 0, inputs.reshape(-1)[at]), np.where(pad, 0, targets.reshape(-1)[at]),
            np.where(pad, 0.0, counted.reshape(-1)[at]), where)


def _microbatches(rank: Rank, inputs: np.ndarray, targets: np.ndarray,
                  counted: np.ndarray | None, docs: np.ndarray | None,
                  reference: np.ndarray | None, packed: np.ndarray | None
                  ) -> tuple[Microbatch, ...]:
    """This rank's microbatches of its rows ``[rows_per_dp, S]`` (twice that of pairs, or as
    many packed): each one's sp positions (its documents' under ``--document-masking`` or
    ``--pack-pairs``), its tokens, targets and counted targets at them, in the backend's array
    module, and its rows' indices in the global batch; under DPO each one's pair loss (with
    the sequences' ``reference`` log-probabilities, None in the pass computing them)."""
    xp, pref = rank.compute.xp, rank.data.preference
    sequence = rank.comms.groups["sp"] if rank.cfg.parallel.sp > 1 else None
    mbs = rank.cfg.train.micro_batch_size * (1 if pref is None else pref.objective.rows_per_pair)
    seqs = 2 * rank.cfg.train.micro_batch_size    # a DPO microbatch's sequences
    out = []
    for i in range(rank.data.microbatches):
        rows = slice(i * mbs, (i + 1) * mbs)
        positions: Any = None
        if docs is not None or packed is not None:
            positions = microbatch_positions(
                docs[rows] if packed is None else _pair_documents(packed[rows], inputs.shape[1]),
                rank.model.seq, rank.coord.sp, rank.model.positions)
        at = rank.model.positions if positions is None else np.asarray(positions)
        mask = None if counted is None else xp.asarray(counted[rows][:, at])
        loss = None
        if pref is not None:
            mine = slice(i * seqs, (i + 1) * seqs)
            owner = (None if packed is None else
                     xp.asarray(_owners(packed[rows][:, at], i * seqs, seqs, inputs.shape[1])))
            loss = PairLoss(pref.objective, Sequences(mask, owner),
                            None if reference is None else reference[mine], xp, sequence)
        out.append(Microbatch(xp.asarray(inputs[rows][:, at]), xp.asarray(targets[rows][:, at]),
                              positions, mask, loss,
                              rank.coord.dp * len(inputs) + xp.arange(rows.start, rows.stop),
                              _ahead(targets[rows], at, rank.cfg.model.mtp_depth, xp)))
    return tuple(out)


def _pair_documents(where: np.ndarray, seq_len: int) -> np.ndarray:
    """The document ids ``[R, S]`` of packed rows (``where`` of
    :func:`mpipar.data.preference.pack_pairs`): each sequence's index, -1 for the padding."""
    return np.where(where >= 0, where // seq_len, -1)


def _owners(where: np.ndarray, first: int, seqs: int, seq_len: int) -> np.ndarray:
    """``[seqs, R * S_loc]`` float64: 1 where a position of the packed rows ``where [R, S_loc]``
    holds a token of sequence ``first + k`` (row ``k``; :class:`~mpipar.training.objective.
    Sequences`)."""
    of = np.where(where >= 0, where // seq_len - first, -1).reshape(-1)
    return (of[None, :] == np.arange(seqs)[:, None]).astype(np.float64)


def _ahead(targets: np.ndarray, at: np.ndarray, depth: int, xp) -> Any:
    """Multi-token prediction's tokens of rows ``targets`` ``[B, S]`` (``t_{i+1}``) at this
    rank's positions ``at``: ``[depth, B, len(at)]``, ``t_{i+1+k}`` for k = 1..depth, -1 past
    the row's end (:mod:`mpipar.model.mtp`); None without it."""
    if not depth:
        return None
    S = targets.shape[1]
    out = np.full((depth,) + targets.shape[:1] + (len(at),), -1, dtype=targets.dtype)
    for k in range(1, depth + 1):
        inside = at + k < S
        out[k - 1][:, inside] = targets[:, at[inside] + k]
    return xp.asarray(out)
