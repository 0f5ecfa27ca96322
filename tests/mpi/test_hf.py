"""Hugging Face checkpoints trained on layouts of 8 ranks (PP with the tie across stages, TP, SP,
ZeRO-1 and ZeRO-3; Qwen3's q/k norms summed over tp) equal transformers + ``torch.optim.AdamW`` in float64 (:mod:`transformers_reference`):
losses, gradient norms and exported parameters to 1e-10 relative."""
from __future__ import annotations

import pytest

# First: importing transformers_reference skips this module where torch or transformers is
# missing. float64_transformers, hf_dirs and samples are fixtures.
from transformers_reference import (STEPS, TOL, float64_transformers,  # noqa: F401
                                    hf_dirs, mpipar_rank, samples, torch_training,
                                    training_differences)

from conftest import check_in_groups
from layouts import layout_name, layout_size
from mpipar.checkpoint.huggingface import load_hf
from mpipar.training import step as trainer

HF_LAYOUTS = [("llama3-tied", dict(pp=2, tp=2, dp=2)),
              ("llama3-tied", dict(pp=2, sp=2, dp=2, zero=1, schedule="zb-h1")),
              ("llama3-tied", dict(pp=2, tp=2, sp=2, sp_split="zigzag", zero=1, bucket_mb=0.002)),
              ("llama3-tied", dict(sp=4, dp=2, zero=1)),
              ("qwen2", dict(pp=2, tp=2, dp=2)),
              ("qwen2", dict(tp=2, sp=2, dp=2, zero=1, tp_sequence_parallel=True)),
              ("qwen2", dict(pp=2, sp=2, sp_mode="ulysses", dp=2, schedule="gpipe")),
              ("mistral", dict(sp=4, dp=2, sp_mode="halo")),
              ("mistral", dict(pp=2, tp=2, sp=2, sp_split="zigzag")),
              ("qwen3", dict(pp=2, tp=2, dp=2)),
              ("qwen3", dict(tp=2, sp=2, dp=2, sp_split="zigzag", tp_sequence_parallel=True,
                             zero=3)),
              ("qwen3", dict(sp=2, dp=2, pp=2, sp_mode="ulysses", schedule="zb-h1"))]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("kind,layout", HF_LAYOUTS,
                         ids=[f"{k}-{layout_name(v)}" for k, v in HF_LAYOUTS])
def test_layouts_train_like_torch_adamw(world, hf_dirs, kind, layout, samples,
                                        float64_transformers):
    """Every rank builds the same checkpoint and its transformers reference (deterministic);
    the layout trains it and must equal transformers: losses, norms and exported parameters."""
    def check(comm) -> list[str]:
        cfg, params = load_hf(hf_dirs[kind])
        rank = mpipar_rank(cfg, params, samples, comm, **layout)
        results = [trainer.train_step(rank, k) for k in range(STEPS)]
        loss_diffs, param_diff = training_differences(results, trainer.gather_params(rank),
                                                      torch_training(hf_dirs[kind], samples))
        if world.rank == 0:
            print(f"\n{kind} {layout_name(layout)}: max param rel diff {param_diff:.2e}, loss "
                  f"diffs {[f'{d:.1e}' for d in loss_diffs]}")
        if not (max(loss_diffs) <= TOL and param_diff <= TOL):
            return [f"loss diffs {loss_diffs}, param diff {param_diff:.3g}"]
        return []

    check_in_groups(world, layout_size(layout), check)
