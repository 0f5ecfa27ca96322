"""LoRA on a mixture of experts' routed experts (:mod:`tests.lora_moe_reference`: PEFT's
``target_parameters`` on transformers' fused 3-D expert tensors) against PyTorch + PEFT in
float64 on one process: losses, gradient norms and the trained adapters over two AdamW steps;
the PEFT files in and out (the fused tensors' names and layout), the merged model against
``merge_and_unload()``; the rules."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.lora_moe_reference import (B, E, EXPERT_FFN, FIELDS, S, float64_qwen3_moe, loaded,
                                      lora, make_dirs, moe_rank, peft, peft_training)
from tests.lora_reference import differences_from_peft
from tests.transformers_moe import by_mpipar_name
from tests.transformers_reference import TOL, mpipar_logits, rel, torch

from mpipar.checkpoint.huggingface import load_hf, open_safetensors, write_safetensors
from mpipar.checkpoint.peft import AdapterError, merge, read_adapter, save_adapter
from mpipar.config import Config, ConfigError, ModelConfig, TrainConfig
from mpipar.rules import validate
from mpipar.training import step as trainer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_dirs(tmp_path_factory.mktemp("lora-moe"))


def test_expert_adapters_train_like_peft(dirs, monkeypatch):
    float64_qwen3_moe(monkeypatch)
    base, adapter, rows = dirs
    rank, params, adapters = moe_rank(base, adapter, rows)
    assert set(rank.weights.reducer.master_tensors()) == set(adapters)
    assert adapters["layers.1.block_sparse_moe.experts.3.gate_up_proj.lora_B.weight"].shape == \
        (2 * EXPERT_FFN, 4)
    results = [trainer.train_step(rank, k) for k in range(2)]
    trained = trainer.gather_params(rank)
    losses, norms, want = peft_training(base, adapter, rows)
    assert sorted(want) == sorted(adapters)
    assert not differences_from_peft(results, losses, norms, trained, want, params, trained)
    moved = [rel(trained[n], adapters[n]) for n in adapters if ".experts." in n]
    assert min(moved) > 1e-4                          # every expert's adapters trained


def test_export_is_peft_s_file_and_merge_equals_merge_and_unload(dirs, monkeypatch, tmp_path):
    """The adapter read and written back is PEFT's file, tensor for tensor (the fused experts'
    names and layout); PEFT loads it and gives mpipar's logits; mpipar's merge equals PEFT's
    ``merge_and_unload()``."""
    float64_qwen3_moe(monkeypatch)
    base, adapter, rows = dirs
    rank, params, adapters = moe_rank(base, adapter, rows)
    cfg = load_hf(base)[0]
    save_adapter(tmp_path / "out", cfg, lora(), adapters, base=str(base))
    with open_safetensors(adapter / "adapter_model.safetensors") as f, \
            open_safetensors(tmp_path / "out" / "adapter_model.safetensors") as g:
        assert sorted(f.keys()) == sorted(g.keys())
        assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight" in f.keys()
        for k in f.keys():
            np.testing.assert_array_equal(f.get_tensor(k), g.get_tensor(k))
    written = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert written["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model = peft.PeftModel.from_pretrained(loaded(base), str(tmp_path / "out"))
    tokens = np.load(rows)[:B, :S]
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
        merged = by_mpipar_name(model.merge_and_unload(), E, EXPERT_FFN)
    assert rel(mpipar_logits(rank, tokens), theirs) <= TOL
    ours = merge(cfg, lora(), {**params, **adapters})
    assert sorted(ours) == sorted(merged)
    assert max(rel(ours[n], merged[n]) for n in ours) <= TOL


def _copy(adapter, root, edit=None, tensors=None):
    bad = root / "bad"
    bad.mkdir(parents=True)
    raw = json.loads((adapter / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**raw, **(edit or {})}))
    source = tensors or adapter
    (bad / "adapter_model.safetensors").write_bytes(
        (source / "adapter_model.safetensors").read_bytes())
    return bad


@pytest.mark.parametrize("edit, match", [
    ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters"),
    ({"target_parameters": None}, "target_parameters"),
    ({"rank_pattern": {r".*\.gate_up_proj": 8}}, "rank_pattern"),
])
def test_adapter_config_refused(dirs, tmp_path, edit, match):
    base, adapter, _ = dirs
    with pytest.raises(AdapterError, match=match):
        read_adapter(_copy(adapter, tmp_path, edit), load_hf(base)[0], lora())


def test_adapter_of_other_experts_or_shapes_refused(dirs, tmp_path):
    """A PEFT adapter of the experts' down_proj alone (its factors under the outer wrapper's
    names) does not fit a run adapting gate_up_proj too, nor one whose fused factor has another
    shape: the tensors are named."""
    base, adapter, _ = dirs
    cfg = load_hf(base)[0]
    config = peft.LoraConfig(r=4, lora_alpha=6.0, target_modules=["q_proj", "k_proj", "v_proj",
                                                                  "o_proj"],
                             target_parameters=["mlp.experts.down_proj"])
    peft.get_peft_model(loaded(base), config).save_pretrained(str(tmp_path / "down"))
    both = {"target_parameters": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]}
    with pytest.raises(AdapterError, match=r"missing \['base_model.model.model.layers.1.mlp."
                                           r"experts.base_layer.lora_A.weight'"):
        read_adapter(_copy(tmp_path / "down", tmp_path / "a", both), cfg, lora())
    with open_safetensors(adapter / "adapter_model.safetensors") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    name = "base_model.model.model.layers.1.mlp.experts.lora_B.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)
    (tmp_path / "t").mkdir()
    write_safetensors(tensors, tmp_path / "t" / "adapter_model.safetensors", {"format": "pt"})
    with pytest.raises(AdapterError, match=rf"{name} has shape \[16, 32\], the model needs "
                                           rf"\[32, 16\]"):
        read_adapter(_copy(adapter, tmp_path / "b", tensors=tmp_path / "t"), cfg, lora())


MOE = dict(vocab_size=64, hidden=16, layers=2, heads=2, kv_heads=1, ffn_hidden=32,
           moe_experts=4, moe_top_k=2, moe_ffn_hidden=8)


@pytest.mark.parametrize("model, fields, match", [
    (MOE, {"lora_targets": "q_proj,gate_proj"}, r"gate_proj on a mixture-of-experts model.*"
                                                r"experts.gate_up_proj, experts.down_proj"),
    ({**MOE, "moe_experts": 0}, {}, r"the model has no 'experts.gate_up_proj'"),
    (MOE, {"lora_rank": 9, "lora_targets": "experts.gate_up_proj,experts.down_proj"},
     r"lora_rank=9: must be <= 8, the smaller side of "
                            r"block_sparse_moe.experts.0.w1.weight \[8, 16\]"),
    (MOE, {"lora_dropout": 0.1}, r"lora_dropout=0.1: the experts' adapters"),
])
def test_rules(model, fields, match):
    train = TrainConfig(seq_len=8, global_batch_size=2, **{**FIELDS, **fields})
    with pytest.raises(ConfigError, match=match):
        validate(Config(model=ModelConfig(**model), train=train), 1)


def test_expert_adapters_count_as_trained_parameters():
    from mpipar.plan.memory import trained_parameter_count
    train = TrainConfig(seq_len=8, global_batch_size=2, **FIELDS)
    cfg = validate(Config(model=ModelConfig(**MOE), train=train), 1)
    r, h, kv, f = 4, 16, 8, 8
    attention = 2 * r * (h + h) + 2 * r * (h + kv)         # q, o; k, v: A [r, in] + B [out, r]
    experts = 4 * (r * (h + 2 * f) + r * (f + h))          # 4 experts: gate_up, down
    assert trained_parameter_count(cfg.model, cfg.train) == 2 * (attention + experts)
