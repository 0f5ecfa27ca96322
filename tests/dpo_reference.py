"""The float64 reference of the DPO tests: preference pairs of token ids, a hand-written DPO loss
on transformers' float64 log-probabilities trained with ``torch.optim.AdamW``, and mpipar
engines on the same checkpoint and pairs. Shared by the one-process and multi-rank tests.

Importing this module skips the importing test module where torch or transformers is missing.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from transformers_reference import OPT, S, V, hf_model, rel, torch, torch_adamw
from mpipar.checkpoint.huggingface import load_hf, mpipar_name
from mpipar.checkpoint.peft import read_adapter
from mpipar.config import Config, ParallelConfig, TrainConfig
from mpipar.data.preference import prepare_preference
from mpipar.model.lora import Lora
from mpipar.rules import validate
from mpipar.training import step as trainer
from mpipar.training.rank import Rank, build_rank

PAIRS, BATCH, STEPS, BETA = 5, 2, 2, 0.7
"""Pairs in the file (the reference pass covers all, the last batch wrapping), pairs per step,
steps, DPO's beta (large enough that the sigmoid is far from 1/2 after a step)."""


LENGTHS = ((1, 6), (1, 9), (1, 9))
"""The ranges ([lo, hi)) of the prompts', chosen and rejected responses' tokens."""
SHORT = ((1, 3), (1, 4), (1, 4))
"""Short pairs: their two sequences fit one row of :data:`S` together (``--pack-pairs``)."""


def write_pairs(path: Path, lengths=LENGTHS) -> Path:
    """:data:`PAIRS` random pairs of ids (prompts, chosen and rejected responses of
    ``lengths`` tokens) prepared for ``--seq-len`` :data:`S`; the JSONL beside the .h5."""
    rng = np.random.default_rng(7)
    lines = []
    for _ in range(PAIRS):
        ids = [rng.integers(1, V, rng.integers(lo, hi)).tolist() for lo, hi in lengths]
        lines.append(json.dumps(dict(zip(("prompt_ids", "chosen_ids", "rejected_ids"), ids))))
    src = path.with_suffix(".jsonl")
    src.write_text("\n".join(lines) + "\n")
    prepare_preference(src, path, S)
    return path


def dpo_rank(checkpoint: Path, pairs: Path, comm=MPI.COMM_SELF, adapter: Path | None = None,
             pack_pairs: bool = False, batch: int = BATCH, micro: int | None = None,
             **parallel) -> Rank:
    """A Rank on ``comm`` with the checkpoint's weights, training the pairs in order with
    DPO (``batch`` pairs a step; ``micro`` a microbatch, by default one on a layout, the whole
    batch alone), packed with ``pack_pairs``; with ``adapter`` (a PEFT directory), LoRA of
    :data:`lora_reference.LORA_FIELDS` from it."""
    cfg, params = load_hf(checkpoint)
    lora = {}
    if adapter is not None:
        from lora_reference import LORA_FIELDS
        lora = LORA_FIELDS
        params = {**params, **read_adapter(adapter, cfg, Lora.of(TrainConfig(**lora)))}
    micro = micro or (1 if parallel else batch)
    train = TrainConfig(steps=STEPS, seq_len=S, global_batch_size=batch, micro_batch_size=micro,
                        lr_schedule="constant",
                        warmup_steps=0, min_lr=0.0, dtype="float64", backend="numpy",
                        shuffle=False, seed=0, data=str(pairs), objective="dpo", dpo_beta=BETA,
                        pack_pairs=pack_pairs, **OPT, **lora)
    layout = validate(Config(cfg, ParallelConfig(**parallel), train), comm.Get_size())
    rank = build_rank(layout, comm)
    trainer.load_params(rank, params)
    return rank


def _logps(model, rows, counted):
    """Each row's summed log-probability of its counted targets (float64)."""
    logits = model(input_ids=rows[:, :S]).logits
    logp = torch.log_softmax(logits, dim=-1).gather(-1, rows[:, 1:, None])[..., 0]
    return (logp * counted).sum(dim=1)


@functools.lru_cache(maxsize=None)
def torch_dpo(checkpoint: Path, pairs: Path, adapter: Path | None = None
              ) -> tuple[list[dict], dict[str, np.ndarray]]:
    """transformers + torch.optim.AdamW on DPO's loss written out here, pairs in order: per step
    (loss, rewards, accuracy, gradient norm) and the trained parameters by mpipar name. With
    ``adapter``, PEFT's model of it on the checkpoint, the adapters alone trained (the frozen
    base has no gradient, so AdamW and the clipping skip it) and returned; the reference is the
    base with the initial adapter. Call it with the float64 patches applied."""
    with h5py.File(pairs, "r") as f:
        tokens, mask = np.asarray(f["tokens"], np.int64), np.asarray(f["loss_mask"])
    idx = np.arange(2 * PAIRS)[:, None] * S + np.arange(S + 1)
    rows, counted = torch.from_numpy(tokens[idx]), torch.from_numpy(mask[idx][:, 1:] != 0)
    if adapter is None:
        model = hf_model(checkpoint)
    else:
        from lora_reference import peft_model
        model = peft_model(checkpoint, adapter)
    with torch.no_grad():
        reference = _logps(model, rows, counted.double())
    model.train()
    named = dict(model.named_parameters())
    opt = torch_adamw(model)
    steps = []
    for k in range(STEPS):
        at = slice(2 * k * BATCH, 2 * (k + 1) * BATCH)
        opt.zero_grad()
        rewards = BETA * (_logps(model, rows[at], counted[at].double()) - reference[at])
        chosen, rejected = rewards[0::2], rewards[1::2]
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["clip_grad"]).item()
        opt.step()
        steps.append({"loss": loss.item(), "grad_norm": norm,
                      "dpo_reward_chosen": chosen.mean().item(),
                      "dpo_reward_rejected": rejected.mean().item(),
                      "dpo_accuracy": (chosen > rejected).double().mean().item()})
    if adapter is not None:
        from lora_reference import adapter_tensors
        return steps, adapter_tensors(model)
    return steps, {mpipar_name(n): p.detach().numpy().copy() for n, p in named.items()}


def dpo_differences(results, trained: dict, want) -> dict[str, float]:
    """The largest relative difference of each step quantity and of the trained parameters of
    an mpipar run against :func:`torch_dpo`'s."""
    steps, params = want
    assert sorted(trained) == sorted(params)
    got = [{"loss": r.loss, "grad_norm": r.grad_norm, **r.preference} for r in results]
    out = {key: max(abs(g[key] - w[key]) / max(abs(w[key]), 1e-300) if w[key] else abs(g[key])
                    for g, w in zip(got, steps)) for key in steps[0]}
    out["params"] = max(rel(v, params[n]) for n, v in trained.items())
    return out


def packed_differences(packed: Rank, unpacked: Rank) -> dict[str, float]:
    """The largest relative difference of each step quantity, of the reference
    log-probabilities and of the trained parameters of a ``--pack-pairs`` run against the
    unpacked run of the same pairs (two steps each); the parameters gathered on every rank."""
    runs = []
    for rank in (packed, unpacked):
        results = [trainer.train_step(rank, k) for k in range(STEPS)]
        runs.append(([{"loss": r.loss, "grad_norm": r.grad_norm, **r.preference}
                      for r in results], trainer.gather_params(rank),
                     rank.data.preference.reference))
    (got, params, ref), (want, want_params, want_ref) = runs
    out = {key: max(abs(g[key] - w[key]) / max(abs(w[key]), 1e-300) if w[key] else abs(g[key])
                    for g, w in zip(got, want)) for key in want[0]}
    out["reference"] = rel(ref, want_ref)
    out["params"] = max(rel(v, want_params[n]) for n, v in params.items())
    return out
