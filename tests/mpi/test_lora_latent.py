"""LoRA on latent attention's projections (:mod:`tests.lora_latent_reference`) on a layout of 4
ranks with tp (the up-projections' B split by rows, the down-projections' both factors whole with
their gradients partial over tp, o_proj's A split by columns) and ep (the frozen experts sharded)
equals PyTorch + PEFT in float64: losses, gradient norms and the trained adapters over two AdamW
steps to 1e-10 relative, the frozen base unchanged."""
from __future__ import annotations

import pytest

from tests.lora_latent_reference import STEPS, latent_rank, make_dirs, peft_training
from tests.deepseek_reference import float64_deepseek
from tests.lora_reference import differences_from_peft

from conftest import check_in_groups
from layouts import layout_name, layout_size
from mpipar.checkpoint import hf_deepseek
from mpipar.checkpoint.huggingface import load_hf
from mpipar.model.lora import is_adapter
from mpipar.training import step as trainer

LATENT_LAYOUTS = [dict(dp=2, tp=2, ep=2),
                  dict(sp=2, dp=2, sp_split="zigzag")]   # the ring: kv_b_proj adapted, K and V pass expanded


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_dirs(tmp_path_factory.mktemp("lora-latent"))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", LATENT_LAYOUTS, ids=[layout_name(v) for v in LATENT_LAYOUTS])
def test_latent_attention_adapters_on_layouts_train_like_peft(world, dirs, layout, monkeypatch):
    float64_deepseek(monkeypatch)
    base, adapter, rows = dirs

    def check(comm) -> list[str]:
        rank, params, _ = latent_rank(base, adapter, rows, comm, **layout)
        results = [trainer.train_step(rank, k) for k in range(STEPS)]
        trained = trainer.gather_params(rank)
        trainer.close(rank)
        losses, norms, want = peft_training(base, adapter, rows)
        ours = hf_deepseek.adapters_to_hub(load_hf(base)[0],
                                           {n: v for n, v in trained.items() if is_adapter(n)})
        return differences_from_peft(results, losses, norms, ours, want, params, trained)

    check_in_groups(world, layout_size(layout), check)
