"""The float64 reference of LoRA on latent attention: the tiny random DeepSeek-V3 of
:mod:`tests.deepseek_reference` (a query latent, values narrower than queries, layer 0 dense, two
sparse layers), a PEFT adapter with nonzero A and B on its five attention projections
(``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``) as
``save_pretrained`` writes it, and its training with PyTorch + PEFT + ``torch.optim.AdamW`` over
the adapters alone (decay on the 2-D tensors, clipping by the norm of their gradients), the
balance loss off (``moe_aux_loss_coef`` 0 in mpipar). Shared by the one-process and the
multi-rank comparisons; call the trainings with :func:`tests.deepseek_reference.
float64_deepseek` applied.

Importing it skips the importing module where torch, transformers or peft is missing.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

peft = pytest.importorskip("peft", reason="peft is a test-only dependency of the LoRA tests")

from tests.deepseek_reference import B, S, V, loaded, random_model  # noqa: E402
from tests.lora_reference import nonzero_adapter  # noqa: E402
from tests.transformers_reference import adamw_on_rows, mpipar_rank  # noqa: E402

from mpipar.checkpoint.huggingface import load_hf, load_selection_biases  # noqa: E402
from mpipar.checkpoint.peft import PREFIX, read_adapter  # noqa: E402
from mpipar.config import TrainConfig  # noqa: E402
from mpipar.model.lora import Lora  # noqa: E402

RANK, ALPHA, STEPS = 4, 6.0, 2
LATENT_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
FIELDS = dict(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=",".join(LATENT_TARGETS))
"""The mpipar run's LoRA fields (TrainConfig)."""


def make_dirs(root: Path) -> tuple[Path, Path, Path]:
    """(base checkpoint, PEFT adapter, token rows ``[STEPS * B, S + 1]``) under ``root``."""
    base, adapter, rows = root / "deepseek", root / "adapter", root / "rows.npy"
    random_model().save_pretrained(base)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(LATENT_TARGETS),
                             lora_dropout=0.0, task_type="CAUSAL_LM")
    model = nonzero_adapter(loaded(base), config)
    model.save_pretrained(str(adapter))
    np.save(rows, np.random.default_rng(5).integers(0, V, size=(STEPS * B, S + 1)))
    return base, adapter, rows


def adapter_tensors(model) -> dict[str, np.ndarray]:
    """The adapter factors of a PEFT model by hub name without PEFT's prefix (rope rows
    interleaved, as PEFT holds them)."""
    return {n.removeprefix(PREFIX).replace(".default", ""): p.detach().numpy().copy()
            for n, p in model.named_parameters() if "lora_" in n}


@functools.lru_cache(maxsize=None)
def peft_training(base: Path, adapter: Path, rows: Path) -> tuple[list, list, dict]:
    """PyTorch + PEFT training of the adapter for :data:`STEPS` steps of B rows in order:
    (losses, gradient norms, trained adapters by hub name)."""
    model = peft.PeftModel.from_pretrained(loaded(base), str(adapter), is_trainable=True)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(LATENT_TARGETS) * model.config.num_hidden_layers
    losses, norms = adamw_on_rows(model, trainable, rows, STEPS, B, S, V)
    return losses, norms, adapter_tensors(model)


def latent_rank(base: Path, adapter: Path, rows: Path, comm=None, **parallel):
    """An mpipar Rank of the base with the PEFT adapter read, LoRA of :data:`FIELDS`, the
    balance loss off; (rank, base parameters, adapters in mpipar's layout)."""
    cfg, params = load_hf(base)
    cfg.moe_aux_loss_coef = 0.0
    adapters = read_adapter(adapter, cfg, Lora.of(TrainConfig(**FIELDS)))
    extra = {} if comm is None else {"comm": comm}
    rank = mpipar_rank(cfg, {**params, **adapters}, rows, train_fields=FIELDS, **extra,
                       **parallel)
    rank.model.routing.load(load_selection_biases(base))
    return rank, params, adapters
