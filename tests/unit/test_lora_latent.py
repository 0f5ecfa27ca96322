"""LoRA on latent attention's projections against PyTorch + PEFT in float64, on one process: a
tiny random DeepSeek-V3 (:mod:`tests.lora_latent_reference`) with a PEFT adapter of nonzero A
and B on ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj`` and ``o_proj``; the
losses, gradient norms and trained adapter over two AdamW steps; the adapter written back loads
in PEFT as the trained one; targets the model does not have are refused naming the target and
what the model has. Layouts: mpi/test_lora.py."""
from __future__ import annotations

import numpy as np
import pytest

from tests.lora_latent_reference import (FIELDS, LATENT_TARGETS, STEPS, adapter_tensors,
                                         latent_rank, make_dirs, peft, peft_training)
from tests.deepseek_reference import float64_deepseek, loaded
from tests.transformers_reference import OPT, TOL, rel

from mpipar.checkpoint import hf_deepseek
from mpipar.checkpoint.huggingface import load_hf
from mpipar.checkpoint.peft import save_adapter
from mpipar.config import Config, ConfigError, ModelConfig, TrainConfig
from mpipar.model.lora import Lora, is_adapter
from mpipar.rules import validate
from mpipar.training import step as trainer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_dirs(tmp_path_factory.mktemp("lora-latent"))


def test_latent_attention_adapters_train_like_peft(dirs, monkeypatch, tmp_path):
    float64_deepseek(monkeypatch)
    base, adapter, rows = dirs
    rank, params, adapters = latent_rank(base, adapter, rows)
    assert sorted(n.split(".")[-3] for n in adapters if n.startswith("layers.0.")) == \
        sorted(2 * LATENT_TARGETS)
    assert set(rank.weights.reducer.master_tensors()) == set(adapters)
    results = [trainer.train_step(rank, k) for k in range(STEPS)]
    trained = trainer.gather_params(rank)
    trainer.close(rank)
    losses, norms, want = peft_training(base, adapter, rows)
    cfg = load_hf(base)[0]
    ours = hf_deepseek.adapters_to_hub(cfg, {n: v for n, v in trained.items() if is_adapter(n)})

    assert norms[0] > OPT["clip_grad"]                        # clipping is exercised
    for r, loss, norm in zip(results, losses, norms):
        assert abs(r.loss - loss) <= TOL * loss, (r.loss, loss)
        assert abs(r.grad_norm - norm) <= TOL * norm, (r.grad_norm, norm)
    assert sorted(ours) == sorted(want)
    assert max(rel(ours[n], want[n]) for n in want) <= TOL
    assert max(rel(trained[n], adapters[n]) for n in adapters) > 1e-3     # the adapters moved
    for n, v in params.items():                                           # the base did not
        np.testing.assert_array_equal(trained[n], v)

    # --export-adapter: PEFT loads the trained adapter as PEFT trained it.
    save_adapter(tmp_path / "out", cfg, Lora.of(TrainConfig(**FIELDS)), trained)
    back = adapter_tensors(peft.PeftModel.from_pretrained(loaded(base), str(tmp_path / "out")))
    assert max(rel(back[n], want[n]) for n in want) <= TOL


LATENT = dict(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=4, ffn_hidden=32,
              head_dim=12, latent_kv_rank=12, rope_head_dim=4, v_head_dim=6)


@pytest.mark.parametrize("model, targets, match", [
    ({**LATENT, "latent_q_rank": 16}, "q_a_proj,k_proj",
     r"the model has no 'k_proj'; its targets are o_proj, gate_proj, up_proj, down_proj, "
     r"q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj"),
    ({**LATENT, "latent_q_rank": 16}, "q_proj", r"the model has no 'q_proj'"),
    (LATENT, "q_a_proj", r"the model has no 'q_a_proj'; its targets are q_proj, o_proj"),
    (dict(vocab_size=64, hidden=16, layers=2, heads=2, kv_heads=1, ffn_hidden=32), "kv_b_proj",
     r"the model has no 'kv_b_proj'; its targets are q_proj, k_proj, v_proj, o_proj, "
     r"gate_proj, up_proj, down_proj"),
])
def test_targets_the_model_does_not_have_are_refused(model, targets, match):
    train = TrainConfig(seq_len=8, global_batch_size=2,
                        **{**FIELDS, "lora_targets": targets})
    with pytest.raises(ConfigError, match=match):
        validate(Config(model=ModelConfig(**model), train=train), 1)
