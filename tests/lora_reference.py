"""The float64 reference of the LoRA tests: a small random Llama (transformers), a PEFT LoRA
adapter with nonzero A and B on all seven targets, and its training with PyTorch + PEFT +
``torch.optim.AdamW`` over the adapters alone (decay on the 2-D tensors, clipping by the norm of
the adapters' gradients). Shared by the one-process and the multi-rank comparisons.

Importing it skips the importing module where torch, transformers or peft is missing.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from transformers_reference import B, OPT, S, hf_loss, hf_model, make_checkpoint, torch

peft = pytest.importorskip("peft", reason="peft is a test-only dependency of the LoRA tests")

from mpipar.checkpoint.peft import PREFIX  # noqa: E402
from mpipar.model.lora_dropout import keep_mask  # noqa: E402

RANK, ALPHA = 4, 6.0
SEED = 0
"""The mpipar runs' ``--seed`` (:func:`transformers_reference.mpipar_rank`): it keys the
dropout masks."""
LORA_STEPS = 2
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear of a Llama block: the adapter's targets."""
LORA_FIELDS = dict(lora_rank=RANK, lora_alpha=ALPHA, lora_targets=",".join(TARGETS))
"""The mpipar run's LoRA fields (TrainConfig)."""


def peft_model(base: Path, adapter: Path | None = None, rslora: bool = False):
    """PEFT's LoRA model on the float64 checkpoint ``base``: the adapter at ``adapter``, or a
    new one of :data:`RANK`, :data:`ALPHA` on every target with nonzero random A and B."""
    model = hf_model(base)
    if adapter is not None:
        return peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    return nonzero_adapter(model, peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0,
        use_rslora=rslora, task_type="CAUSAL_LM"))


def nonzero_adapter(model, config):
    """PEFT's LoRA model of ``config`` on ``model`` with A and B drawn from N(0, 0.2^2) (seeded):
    an adapter whose both factors act, unlike PEFT's zero B."""
    model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def make_adapter(base: Path, root: Path, rslora: bool = False) -> Path:
    """A PEFT adapter directory written by ``save_pretrained`` (float64 tensors)."""
    path = root / ("adapter-rslora" if rslora else "adapter")
    peft_model(base, rslora=rslora).save_pretrained(str(path))
    return path


def adapter_tensors(model) -> dict[str, np.ndarray]:
    """The adapter factors of a PEFT model by mpipar name."""
    return {n.removeprefix(PREFIX).replace(".default", ""): p.detach().numpy().copy()
            for n, p in model.named_parameters() if "lora_" in n}


class MaskedDropout(torch.nn.Module):
    """PEFT's ``lora_dropout`` of the targeted linear ``target`` of block ``layer``, its mask
    mpipar's (:func:`mpipar.model.lora_dropout.keep_mask`) of the step ``now[0]`` and the
    global batch's rows ``[0, B)``: the same mask the mpipar run draws, so the runs compare
    exactly."""

    def __init__(self, p: float, layer: int, target: str, now: list) -> None:
        super().__init__()
        self.p, self.layer, self.target, self.now = p, layer, target, now

    def forward(self, x):
        b, s, width = x.shape
        tokens = (np.arange(b)[:, None] * S + np.arange(s)[None, :]).reshape(-1)
        key = (SEED, self.now[0], self.layer, list(TARGETS).index(self.target))
        keep = keep_mask(np, self.p, key, tokens, range(width), width)
        factor = keep.astype(np.float64) * (1.0 / (1.0 - self.p))
        return x * torch.from_numpy(factor.reshape(x.shape))


def mask_dropout(model, p: float) -> list:
    """Give each of ``model``'s LoRA layers a :class:`MaskedDropout`; returns the step cell
    (``[step]``) they read."""
    now = [0]
    for name, module in model.named_modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            module.lora_dropout["default"] = MaskedDropout(p, layer, parts[-1], now)
    return now


@functools.lru_cache(maxsize=None)
def peft_training(base: Path, adapter: Path, samples: Path, dropout: float = 0.0
                  ) -> tuple[list, list, dict]:
    """PyTorch + PEFT training of the adapter for :data:`LORA_STEPS` steps on the samples' rows
    in order: (losses, gradient norms, trained adapters by mpipar name); ``dropout`` > 0: LoRA
    dropout with mpipar's masks (:class:`MaskedDropout`, seed :data:`SEED`). Call it with the
    float64 patches applied."""
    model = peft_model(base, adapter)
    now = mask_dropout(model, dropout) if dropout > 0 else [0]
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * model.config.num_hidden_layers
    opt = torch.optim.AdamW([{"params": [p for p in trainable if p.ndim >= 2],
                              "weight_decay": OPT["weight_decay"]}],
                            lr=OPT["lr"], betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"])
    rows = torch.from_numpy(np.load(samples))
    losses, norms = [], []
    for k in range(LORA_STEPS):
        now[0] = k
        ids = rows[k * B:(k + 1) * B]
        opt.zero_grad()
        loss = hf_loss(model(input_ids=ids[:, :S]).logits, ids)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(trainable, OPT["clip_grad"]).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, adapter_tensors(model)


def differences_from_peft(results, losses, norms, ours: dict, want: dict, base: dict,
                          trained: dict) -> list[str]:
    """What differs from PEFT's run beyond ``TOL``: each step's loss and gradient norm
    (``results`` against ``losses``, ``norms``), the trained adapters ``ours`` against ``want``;
    and any tensor of the frozen ``base`` that moved in ``trained``."""
    from transformers_reference import TOL, rel
    problems = [f"step {k + 1}: loss {r.loss} vs {loss}, norm {r.grad_norm} vs {norm}"
                for k, (r, loss, norm) in enumerate(zip(results, losses, norms))
                if abs(r.loss - loss) > TOL * loss or abs(r.grad_norm - norm) > TOL * norm]
    diff = max(rel(ours[n], want[n]) for n in want)
    if diff > TOL:
        problems.append(f"adapters differ by {diff:.3g}")
    return problems + [f"base {n} moved" for n, v in base.items()
                       if not np.array_equal(trained[n], v)]


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(base checkpoint, PEFT adapter) directories."""
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint("llama", root)
    return base, make_adapter(base, root)
