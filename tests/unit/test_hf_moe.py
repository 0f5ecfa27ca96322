"""Mixtral checkpoints: a random ``MixtralForCausalLM`` written by transformers' save_pretrained
is read by mpipar, trained two AdamW steps by both with the objective cross-entropy +
DeepSeek-V3's sequence-wise balance loss (computed on transformers' side from its router
logits, as mpipar defines it), and the losses, gradient norms and trained weights agree in
float64 (<= 1e-10 relative); mpipar's export reads back the same and transformers loads it.

transformers' float32 casts are removed as in ``transformers_reference.py``, plus Mixtral's
router softmax (``router_logits.float()``), redone in float64; experts run ``eager``
(``transformers_moe.py``)."""
from __future__ import annotations

import json

import pytest

from tests.transformers_moe import (E, FFN, TOPK, assert_export_round_trip,
                                    assert_trains_as_transformers, float64_moe)
from tests.transformers_reference import EPS, H, HEADS, KV, LAYERS, THETA, V, save_random
from transformers import MixtralConfig  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

from mpipar.checkpoint.huggingface import read_model_config, support
from mpipar.model.params import ROUTER


@pytest.fixture
def mixtral_float64(monkeypatch):
    float64_moe(monkeypatch, modeling_mixtral.MixtralRMSNorm,
                modeling_mixtral.MixtralRotaryEmbedding, modeling_mixtral.MixtralTopKRouter)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    cfg = MixtralConfig(vocab_size=V, hidden_size=H, num_attention_heads=HEADS,
                        num_key_value_heads=KV, num_hidden_layers=LAYERS, intermediate_size=FFN,
                        num_local_experts=E, num_experts_per_tok=TOPK, rope_theta=THETA,
                        rms_norm_eps=EPS, tie_word_embeddings=False, sliding_window=None)
    return save_random(cfg, tmp_path_factory.mktemp("mixtral") / "mixtral")


def test_mixtral_trains_as_transformers_float64(mixtral_dir, tmp_path, mixtral_float64):
    cfg = read_model_config(mixtral_dir)
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_ffn_hidden) == (E, TOPK, FFN)
    assert_trains_as_transformers(mixtral_dir, tmp_path, sparse_layers=LAYERS)


def test_mixtral_export_round_trip(mixtral_dir, tmp_path):
    got = assert_export_round_trip(mixtral_dir, tmp_path / "out")
    assert "layers.0." + ROUTER in got
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["architectures"] == ["MixtralForCausalLM"] and raw["num_local_experts"] == E
    aspects = {s.aspect: s for s in support(raw)[0]}
    assert "Mixtral experts: 4" in aspects["experts"].reading and not aspects["experts"].problem
