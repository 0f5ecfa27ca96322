"""Qwen2-MoE checkpoints: a random ``Qwen2MoeForCausalLM`` (q/k/v biases, block 0 dense by
``mlp_only_layers``, 4 experts top 2 renormalised or not by ``norm_topk_prob``, a gated shared
expert) written by
transformers' save_pretrained is read by mpipar (``--moe-shared-ffn-hidden`` with
``--moe-shared-gate``), trained two AdamW steps by both with the objective cross-entropy +
DeepSeek-V3's sequence-wise balance loss (computed on transformers' side from its router
logits), and the losses, balance losses, gradient norms and trained weights agree in float64
(<= 1e-10 relative); mpipar's export reads back the same and transformers loads it.

transformers' float32 casts are removed as in ``transformers_reference.py``, plus the router's
softmax (``dtype=torch.float``), redone in float64; experts run ``eager``
(``transformers_moe.py``)."""
from __future__ import annotations

import json

import pytest

from tests.transformers_moe import (E, FFN, TOPK, assert_export_round_trip,
                                    assert_trains_as_transformers, float64_moe)
from tests.transformers_reference import EPS, H, HEADS, KV, THETA, V, save_random
from transformers import Qwen2MoeConfig  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe  # noqa: E402

from mpipar.checkpoint.huggingface import read_model_config, support

DENSE, SHARED, LAYERS = 40, 32, 3


@pytest.fixture
def qwen_float64(monkeypatch):
    float64_moe(monkeypatch, modeling_qwen2_moe.Qwen2MoeRMSNorm,
                modeling_qwen2_moe.Qwen2MoeRotaryEmbedding, modeling_qwen2_moe.Qwen2MoeTopKRouter)


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def qwen_dir(request, tmp_path_factory):
    cfg = Qwen2MoeConfig(vocab_size=V, hidden_size=H, num_attention_heads=HEADS,
                         num_key_value_heads=KV, num_hidden_layers=LAYERS,
                         intermediate_size=DENSE, moe_intermediate_size=FFN,
                         shared_expert_intermediate_size=SHARED, num_experts=E,
                         num_experts_per_tok=TOPK, norm_topk_prob=request.param,
                         mlp_only_layers=[0],
                         rope_theta=THETA, rms_norm_eps=EPS, tie_word_embeddings=False)
    return save_random(cfg, tmp_path_factory.mktemp("qwen2_moe") / "qwen2_moe")


def test_qwen2_moe_config_reads_as_a_gated_shared_expert(qwen_dir):
    cfg = read_model_config(qwen_dir)
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_ffn_hidden, cfg.ffn_hidden) == \
        (E, TOPK, FFN, DENSE)
    assert (cfg.moe_shared_ffn_hidden, cfg.moe_shared_gate, cfg.attention_bias) == \
        (SHARED, True, True)
    assert [cfg.is_sparse(i) for i in range(LAYERS)] == [False, True, True]
    raw = json.loads((qwen_dir / "config.json").read_text())
    assert cfg.moe_norm_topk is raw["norm_topk_prob"]
    reading = {s.aspect: s for s in support(raw)[0]}["experts"].reading
    assert ("not renormalised" in reading) is not raw["norm_topk_prob"], reading
    absent = {k: v for k, v in raw.items() if k != "norm_topk_prob"}
    assert support(absent)[1]["moe_norm_topk"] is False          # transformers' default
    for change, field in ((dict(norm_topk_prob=1), "norm_topk_prob=1 must be true or false"),
                          (dict(mlp_only_layers=[0, 1, 2]), "no sparse layer")):
        aspects = {s.aspect: s for s in support({**raw, **change})[0]}
        assert field in aspects["experts"].problem


def test_qwen2_moe_trains_as_transformers_float64(qwen_dir, tmp_path, qwen_float64):
    want = assert_trains_as_transformers(qwen_dir, tmp_path, sparse_layers=LAYERS - 1)  # 0 dense
    assert "layers.1.mlp.shared_expert_gate.weight" in want


def test_qwen2_moe_export_round_trip(qwen_dir, tmp_path):
    assert_export_round_trip(qwen_dir, tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2MoeForCausalLM"] and raw["num_experts"] == E
    assert raw["mlp_only_layers"] == [0] and raw["norm_topk_prob"] is read_model_config(
        qwen_dir).moe_norm_topk
    aspects = {s.aspect: s for s in support(raw)[0]}
    assert "Qwen2-MoE experts: 4" in aspects["experts"].reading and not aspects["experts"].problem
