"""Direct preference optimization (``--objective dpo``): the loss of pairs of sequences, a
prompt's chosen and rejected responses (``data prepare --preference``).

A response's log-probability under the policy is the sum of ``log softmax`` of its tokens: minus
the sum of the model's per-token cross-entropy over the targets that carry loss (the response's
tokens, by the file's ``loss_mask``). With ``logπ`` the policy's and ``logπ_ref`` the reference's
(the policy as it was at step 0),

    reward(y)   = β (logπ(y) − logπ_ref(y))
    loss(pair)  = −log σ(reward(chosen) − reward(rejected))

and the step's loss is the mean over the pairs of the global batch (``--global-batch-size``
counts pairs: a microbatch of ``m`` pairs holds ``2m`` sequences, ``2i`` and ``2i + 1`` one pair,
so a pair never leaves its microbatch). Unpacked, each sequence is a row of its own (``2m``
rows); under ``--pack-pairs`` the ``m`` pairs are ``m`` rows, each pair's two sequences side by
side in one row as documents of their own (:func:`mpipar.data.preference.pack_pairs`), and a
sequence's log-probability is the sum over its own positions (:class:`Sequences`): the same
numbers, fewer rows. The model is differentiated by hand: its head takes the
gradient of the per-token cross-entropy (:meth:`mpipar.model.tensor_ops.TensorOps.
cross_entropy_backward`), and a pair's is

    ∂loss/∂ce(chosen token)   =  β σ(−margin) · counted
    ∂loss/∂ce(rejected token) = −β σ(−margin) · counted

with ``margin = reward(chosen) − reward(rejected)``, so the vocabulary-parallel cross-entropy
of the tensor-parallel head serves DPO unchanged.

The reference log-probabilities are computed once, by a forward pass over every pair of the
training data before step 0's update (:func:`reference_logps`), and stored: the same numbers a
frozen copy of the step-0 weights would give, at the cost of one forward per pair and no second
model. ``dpo_reward_chosen``, ``dpo_reward_rejected`` (the mean rewards over the pairs of the
global batch) and ``dpo_accuracy`` (the fraction of them whose chosen reward is above the
rejected one) go to metrics.jsonl. Checkpoints record the reference log-probabilities
(``dpo_reference`` of :mod:`mpipar.checkpoint.index`), so a resumed run goes on with the step-0
policy's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpipar.config import TrainConfig, require
from mpipar.data.preference import check_packable, preference_pairs
from mpipar.data.sources import DataError
from mpipar.layout import Layout
from mpipar.runtime.device import to_host

Array = Any

@dataclass(frozen=True)
class DPO:
    """The DPO loss of temperature ``beta`` (module docstring)."""

    beta: float
    rows_per_pair: int = 2     # rows of seq_len a pair takes: 2, or 1 packed (--pack-pairs)

    def rewards(self, logps: np.ndarray, reference: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """(chosen, rejected) rewards ``[pairs]`` of rows' log-probabilities and their
        reference's ``[2 * pairs]`` (chosen at even rows, rejected at odd)."""
        r = self.beta * (logps - reference)
        return r[0::2], r[1::2]

    def losses(self, logps: np.ndarray, reference: np.ndarray) -> np.ndarray:
        """``−log σ(margin)`` of each pair ``[pairs]``."""
        chosen, rejected = self.rewards(logps, reference)
        return np.logaddexp(0.0, -(chosen - rejected))

    def row_weights(self, logps: np.ndarray, reference: np.ndarray) -> np.ndarray:
        """``−∂(Σ pair losses)/∂logπ(row)`` ``[rows]``: a counted token's
        ``∂/∂(token_loss)`` (module docstring)."""
        chosen, rejected = self.rewards(logps, reference)
        pull = self.beta * 0.5 * (1.0 - np.tanh(0.5 * (chosen - rejected)))   # β σ(−margin)
        return np.stack([pull, -pull], axis=1).reshape(-1)


@dataclass(frozen=True)
class Sequences:
    """Where a microbatch's ``2m`` sequences lie in its rows: ``counted [R, S_loc]`` (1/0) its
    targets that carry loss, and ``owner`` ``[2m, R * S_loc]`` 1 at the positions of each
    sequence (the rows flattened), or None where row ``j`` is sequence ``j`` (unpacked)."""

    counted: Array
    owner: Array | None = None

    def logps(self, token_loss: Array) -> Array:
        """The log-probabilities ``[2m]`` of the sequences' counted targets, of the per-token
        cross-entropy ``token_loss [R, S_loc]``."""
        counted = token_loss * self.counted
        if self.owner is None:
            return -counted.sum(axis=1)
        return -(self.owner @ counted.reshape(-1))

    def spread(self, weights: Array) -> Array:
        """``[R, S_loc]``: each counted target's sequence's weight of ``weights [2m]``."""
        if self.owner is None:
            return self.counted * weights[:, None]
        return self.counted * (weights @ self.owner).reshape(self.counted.shape)


@dataclass
class PairLoss:
    """One microbatch's DPO loss over its rows' per-token cross-entropy, for the pipeline
    executor (:attr:`mpipar.parallel.pipeline.executor.Microbatch.loss`): ``sequences`` where
    its ``2m`` sequences lie, ``reference`` ``[2m]`` their reference log-probabilities (None
    in the forward pass that computes them, :func:`mpipar.training.step.reference_logps`);
    ``sequence``: the sp group over which the rows' tokens are spread (their
    log-probabilities are summed over it), or None (whole rows)."""

    objective: DPO
    sequences: Sequences
    reference: np.ndarray | None
    xp: Any
    sequence: Any = None
    logps: np.ndarray | None = None
    stats: np.ndarray = field(default_factory=lambda: np.zeros(3))

    def forward(self, token_loss: Array) -> float:
        """The summed loss of the microbatch's pairs; keeps their log-probabilities and adds
        (reward chosen, reward rejected, chosen above rejected) summed over the pairs to
        :attr:`stats` (0 and nothing off the first rank of ``sequence``: its ranks' sums over
        dp x sp count each pair once)."""
        logps = self.sequences.logps(token_loss)
        if self.sequence is not None:
            logps = self.sequence.allreduce_(self.xp.ascontiguousarray(logps))
        self.logps = np.asarray(to_host(logps), np.float64)
        if self.sequence is not None and self.sequence.rank != 0:
            return 0.0          # the pairs are counted once over sp: on its first rank
        chosen, rejected = self.objective.rewards(self.logps, self.reference)
        self.stats += [float(chosen.sum()), float(rejected.sum()), float((chosen > rejected).sum())]
        return float(self.objective.losses(self.logps, self.reference).sum())

    def dout(self, weight: Array) -> Array:
        """The gradient of the per-token loss: ``weight`` (the step's ``1 / pairs``) times the
        pairs' :meth:`DPO.row_weights` at their sequences' counted targets."""
        rows = self.objective.row_weights(self.logps, self.reference)
        return weight * self.sequences.spread(self.xp.asarray(rows, dtype=weight.dtype))


@dataclass
class Preference:
    """A DPO run's data side on one rank: the objective, the pairs of the training data, and
    their rows' reference log-probabilities ``[2 * pairs]`` (None until
    :func:`reference_logps` has run)."""

    objective: DPO
    pairs: int
    reference: np.ndarray | None = None

    def load(self, reference: np.ndarray | None, step: int) -> None:
        """Take a checkpoint's ``reference`` (None: it has none) for a run resumed at ``step``;
        ValueError when it does not fit: none after step 0 (a checkpoint of another objective's
        run), or a count of rows other than this file's. At step 0 without one the reference is
        computed, as a new run's."""
        if reference is None:
            if step:
                raise ValueError(f"holds no DPO reference log-probabilities at step {step}: "
                                 f"not a DPO run's checkpoint")
            return
        if reference.shape != (2 * self.pairs,):
            raise ValueError(f"dpo_reference holds {reference.size} rows' log-probabilities; "
                             f"--data's {self.pairs} pairs have {2 * self.pairs}")
        self.reference = np.array(reference, np.float64)

    def rows(self, pairs: np.ndarray) -> np.ndarray:
        """The sample (row) indices of pair indices ``pairs``: ``2p, 2p + 1`` each."""
        return (2 * np.asarray(pairs, np.int64)[:, None] + np.arange(2)).reshape(-1)


def preference(train: TrainConfig) -> Preference | None:
    """The run's :class:`Preference` (None for the next-token objective); reads the pairs'
    count from ``train.data``."""
    if train.objective != "dpo":
        return None
    return Preference(DPO(train.dpo_beta, train.rows_per_sample),
                      preference_pairs(train.data, train.seq_len))


def check_config(layout: Layout) -> None:
    """``--dpo-beta`` > 0 and finite; ``--objective dpo`` trains on a preference file of
    ``--seq-len`` rows holding at least one global batch of pairs, and none of the next-token
    loss's masks, EOS-delimited documents or validation loss; ``--pack-pairs`` only with it,
    on pairs that each fit a row."""
    t, p = layout.train, layout.parallel
    require(math.isfinite(t.dpo_beta) and t.dpo_beta > 0,
            f"train.dpo_beta={t.dpo_beta}: must be a finite number > 0")
    require(not t.pack_pairs or t.objective == "dpo",
            f"train.pack_pairs=True: packs the preference pairs of --objective dpo, not "
            f"objective {t.objective!r} (its documents: --document-masking)")
    if t.objective != "dpo":
        return
    for name in ("loss_mask", "eod_mask_loss", "document_masking"):
        require(not getattr(t, name), f"train.{name}=True with --objective dpo: DPO counts the "
                                      f"response tokens of its pairs' loss_mask only")
    require(not t.eval_data and t.eval_fraction == 0 and t.eval_every == 0,
            "--objective dpo has no validation loss: drop --eval-data, --eval-fraction and "
            "--eval-every")
    try:
        pairs = preference_pairs(t.data, t.seq_len)
    except (DataError, OSError) as exc:
        require(False, str(exc))
    require(pairs >= t.global_batch_size,
            f"train.global_batch_size={t.global_batch_size}: more pairs than the "
            f"{pairs} of {t.data}")
    if t.pack_pairs:
        try:
            check_packable(t.data, t.seq_len)
        except DataError as exc:
            require(False, f"train.pack_pairs=True: {exc}")

