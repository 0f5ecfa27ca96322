"""LoRA on layouts of 4 ranks (dp, tp with and without its sequence parallelism, pp with a
zero-bubble schedule, sp, ZeRO-1, -2 and -3) equals PyTorch + PEFT in float64
(:mod:`lora_reference`): losses, gradient norms and the trained adapters over two AdamW steps to
1e-10 relative, the frozen base unchanged (and under ZeRO-3 sharded, without gradients)."""
from __future__ import annotations

import pytest

# First: importing lora_reference skips this module where torch, transformers or peft is
# missing. float64_transformers, lora_dirs and samples are fixtures.
from transformers_reference import (TOL, float64_transformers, mpipar_rank, rel,  # noqa: F401
                                    samples)
from lora_reference import (LORA_FIELDS, LORA_STEPS, differences_from_peft,  # noqa: F401
                            lora_dirs, peft_training)

from conftest import check_in_groups
from layouts import layout_name, layout_size
from mpipar.checkpoint.huggingface import load_hf
from mpipar.checkpoint.peft import read_adapter
from mpipar.model.lora import Lora
from mpipar.config import TrainConfig
from mpipar.training import step as trainer

LORA_LAYOUTS = [dict(dp=2, tp=2),
                dict(tp=2, sp=2, tp_sequence_parallel=True, zero=1),
                dict(pp=2, tp=2, schedule="zb-h1"),
                dict(pp=2, sp=2, sp_split="zigzag"),
                dict(sp=2, dp=2, zero=1),
                dict(dp=2, tp=2, zero=3),
                dict(pp=2, dp=2, zero=2)]


DROPOUT_LAYOUTS = [dict(dp=2, tp=2, tp_sequence_parallel=True),
                   dict(pp=2, sp=2, sp_split="zigzag")]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", DROPOUT_LAYOUTS, ids=[layout_name(v) for v in DROPOUT_LAYOUTS])
def test_lora_dropout_layouts_drop_as_one_process(world, lora_dirs, layout, samples,
                                                  float64_transformers):
    """--lora-dropout: every layout drops the elements one process drops (the mask is keyed by
    each element's global place: rows over dp, positions over sp, a row-parallel linear's
    columns over tp), so it equals PyTorch + PEFT fed those masks."""
    base, adapter = lora_dirs
    fields = {**LORA_FIELDS, "lora_dropout": 0.3}

    def check(comm) -> list[str]:
        cfg, params = load_hf(base)
        adapters = read_adapter(adapter, cfg, Lora.of(TrainConfig(**LORA_FIELDS)))
        rank = mpipar_rank(cfg, {**params, **adapters}, samples, comm, train_fields=fields,
                           **layout)
        results = [trainer.train_step(rank, k) for k in range(LORA_STEPS)]
        trained = trainer.gather_params(rank)
        losses, norms, want = peft_training(base, adapter, samples, 0.3)
        problems = [f"step {k + 1}: loss {r.loss} vs {loss}, norm {r.grad_norm} vs {norm}"
                    for k, (r, loss, norm) in enumerate(zip(results, losses, norms))
                    if abs(r.loss - loss) > TOL * loss or abs(r.grad_norm - norm) > TOL * norm]
        diff = max(rel(trained[n], want[n]) for n in want)
        return problems + ([f"adapters differ by {diff:.3g}"] if diff > TOL else [])

    check_in_groups(world, layout_size(layout), check)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", LORA_LAYOUTS, ids=[layout_name(v) for v in LORA_LAYOUTS])
def test_lora_layouts_train_like_peft(world, lora_dirs, layout, samples, float64_transformers):
    base, adapter = lora_dirs

    def check(comm) -> list[str]:
        cfg, params = load_hf(base)
        adapters = read_adapter(adapter, cfg, Lora.of(TrainConfig(**LORA_FIELDS)))
        rank = mpipar_rank(cfg, {**params, **adapters}, samples, comm,
                               train_fields=LORA_FIELDS, **layout)
        results = [trainer.train_step(rank, k) for k in range(LORA_STEPS)]
        trained = trainer.gather_params(rank)
        losses, norms, want = peft_training(base, adapter, samples)
        problems = differences_from_peft(results, losses, norms, trained, want, params, trained)
        if layout.get("zero") == 3:     # the frozen base sharded over dp x sp, no gradients
            frozen = rank.weights.frozen
            owned = sum(u.owned.size for u in frozen.units.values())
            whole = sum(u.size for u in frozen.units.values())
            if owned * layout["dp"] != whole or any(u.owned_grad is not None
                                                    for u in frozen.units.values()):
                problems.append(f"frozen base: {owned} of {whole} elements held")
        return problems

    check_in_groups(world, layout_size(layout), check)
