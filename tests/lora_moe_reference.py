"""The float64 reference of LoRA on a mixture of experts' routed experts: a tiny random
``Qwen3MoeForCausalLM`` (block 0 dense, block 1 sparse: 4 experts, top 2), a PEFT adapter with
nonzero A and B on the attention's four projections (``target_modules``) and the experts' fused
``gate_up_proj`` and ``down_proj`` (``target_parameters``) as ``save_pretrained`` writes it, and
its training with PyTorch + PEFT + ``torch.optim.AdamW`` over the adapters alone (decay on the
2-D tensors, clipping by the norm of their gradients), the balance loss off
(``moe_aux_loss_coef`` 0 in mpipar). Shared by the one-process and the multi-rank comparisons;
call the trainings with :func:`float64_qwen3_moe` applied.

Importing it skips the importing module where torch, transformers or peft is missing.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

peft = pytest.importorskip("peft", reason="peft is a test-only dependency of the LoRA tests")

from tests.transformers_moe import float64_moe  # noqa: E402
from tests.lora_reference import nonzero_adapter  # noqa: E402
from tests.transformers_reference import adamw_on_rows, mpipar_rank, save_random, torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

from mpipar.checkpoint.huggingface import load_hf  # noqa: E402
from mpipar.checkpoint.peft import PREFIX, from_peft, read_adapter  # noqa: E402
from mpipar.config import TrainConfig  # noqa: E402
from mpipar.model.lora import Lora  # noqa: E402

V, H, HEADS, KV, HEAD_DIM, DENSE, EXPERT_FFN, E, TOPK = 64, 32, 4, 2, 8, 48, 16, 4, 2
B, S, STEPS = 2, 12, 2
RANK, ALPHA = 4, 6.0
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
FIELDS = dict(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=",".join(MODULES + EXPERTS))
"""The mpipar run's LoRA fields (TrainConfig)."""


def float64_qwen3_moe(monkeypatch) -> None:
    """transformers' Qwen3-MoE in float64 throughout (norms, RoPE, router)."""
    float64_moe(monkeypatch, modeling_qwen3_moe.Qwen3MoeRMSNorm,
                modeling_qwen3_moe.Qwen3MoeRotaryEmbedding, modeling_qwen3_moe.Qwen3MoeTopKRouter)


def loaded(path: Path):
    """transformers' float64 model at ``path``, experts ``eager``."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                 attn_implementation="sdpa")
    model.config._experts_implementation = "eager"
    return model


def make_dirs(root: Path) -> tuple[Path, Path, Path]:
    """(base checkpoint, PEFT adapter, token rows ``[STEPS * B, S + 1]``) under ``root``."""
    base, adapter, rows = root / "qwen3_moe", root / "adapter", root / "rows.npy"
    save_random(Qwen3MoeConfig(vocab_size=V, hidden_size=H, num_attention_heads=HEADS,
                               num_key_value_heads=KV, head_dim=HEAD_DIM, num_hidden_layers=2,
                               intermediate_size=DENSE, moe_intermediate_size=EXPERT_FFN,
                               num_experts=E, num_experts_per_tok=TOPK, norm_topk_prob=True,
                               mlp_only_layers=[0], tie_word_embeddings=False), base)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(MODULES),
                             target_parameters=["mlp." + t for t in EXPERTS],
                             lora_dropout=0.0, task_type="CAUSAL_LM")
    model = nonzero_adapter(loaded(base), config)
    model.save_pretrained(str(adapter))
    np.save(rows, np.random.default_rng(5).integers(0, V, size=(STEPS * B, S + 1)))
    return base, adapter, rows


def lora() -> Lora:
    return Lora.of(TrainConfig(**FIELDS))


def adapter_tensors(model, cfg) -> dict[str, np.ndarray]:
    """The adapter factors of a PEFT model by mpipar name (the experts' split per expert)."""
    return from_peft(cfg, lora(), {n.removeprefix(PREFIX).replace(".default", ""):
                                   p.detach().numpy().copy()
                                   for n, p in model.named_parameters() if "lora_" in n})


@functools.lru_cache(maxsize=None)
def peft_training(base: Path, adapter: Path, rows: Path) -> tuple[list, list, dict]:
    """PyTorch + PEFT training of the adapter for :data:`STEPS` steps of B rows in order:
    (losses, gradient norms, trained adapters by mpipar name)."""
    model = peft.PeftModel.from_pretrained(loaded(base), str(adapter), is_trainable=True)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * (len(MODULES) * 2 + len(EXPERTS)), len(trainable)
    losses, norms = adamw_on_rows(model, trainable, rows, STEPS, B, S, V)
    return losses, norms, adapter_tensors(model, load_hf(base)[0])


def moe_rank(base: Path, adapter: Path, rows: Path, comm=None, **parallel):
    """An mpipar Rank of the base with the PEFT adapter read, LoRA of :data:`FIELDS`, the
    balance loss off; (rank, base parameters, adapters by mpipar name)."""
    cfg, params = load_hf(base)
    cfg.moe_aux_loss_coef = 0.0
    adapters = read_adapter(adapter, cfg, lora())
    extra = {} if comm is None else {"comm": comm}
    rank = mpipar_rank(cfg, {**params, **adapters}, rows, train_fields=FIELDS, **extra,
                       **parallel)
    return rank, params, adapters
