"""Qwen2-MoE checkpoints: a random ``Qwen2MoeForCausalLM`` (q/k/v biases, block 0 dense by
``mlp_only_layers``, 4 experts top 2 renormalised or not by ``norm_topk_prob``, a gated shared
expert) written by
transformers' save_pretrained is read by mpipar (``--moe-shared-ffn-hidden`` with
``--moe-shared-gate``), trained two AdamW steps by both with the objective cross-entropy +
DeepSeek-V3's sequence-wise balance loss (computed on transformers' side from its router
logits), and the losses, balance losses, gradient norms and trained weights agree in float64
(<= 1e-10 relative); mpipar's export reads back the same and transformers loads it.

transformers' float32 casts are removed as in ``transformers_reference.py``, plus the router's
softmax (``dtype=torch.float``), redone in float64; experts run ``eager``."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.transformers_reference import (B, EPS, H, HEADS, KV, OPT, PATCHES, S, THETA, TOL, V,
                                          hf_loss, mpipar_engine, rel, rmsnorm_own_dtype,
                                          rotary_float64, router_float64, torch,
                                          transformers)
from transformers import AutoModelForCausalLM, Qwen2MoeConfig  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe  # noqa: E402

from mpipar.checkpoint.huggingface import load_hf, mpipar_name, read_model_config, save_hf, support
from mpipar.model.params import ROUTER, expert_names

E, TOPK, FFN, DENSE, SHARED, LAYERS, ALPHA, STEPS = 4, 2, 24, 40, 32, 3, 0.1, 2


@pytest.fixture
def qwen_float64(monkeypatch):
    for owner, attr, replacement in PATCHES + [
            (modeling_qwen2_moe.Qwen2MoeRMSNorm, "forward", rmsnorm_own_dtype),
            (modeling_qwen2_moe.Qwen2MoeRotaryEmbedding, "forward", rotary_float64),
            (modeling_qwen2_moe.Qwen2MoeTopKRouter, "forward", router_float64)]:
        monkeypatch.setattr(owner, attr, replacement)


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def qwen_dir(request, tmp_path_factory):
    cfg = Qwen2MoeConfig(vocab_size=V, hidden_size=H, num_attention_heads=HEADS,
                         num_key_value_heads=KV, num_hidden_layers=LAYERS,
                         intermediate_size=DENSE, moe_intermediate_size=FFN,
                         shared_expert_intermediate_size=SHARED, num_experts=E,
                         num_experts_per_tok=TOPK, norm_topk_prob=request.param,
                         mlp_only_layers=[0],
                         rope_theta=THETA, rms_norm_eps=EPS, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1 if name.endswith("norm.weight") else 0
            p.copy_(scale + (0.1 if p.ndim == 1 else 0.15) * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen2_moe") / "qwen2_moe"
    model.save_pretrained(path)
    return path


def balance_loss(router_logits, k: int) -> "torch.Tensor":
    """alpha x mean over rows of the sum over sparse layers of sum_e f_e P_e (DeepSeek-V3)."""
    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.to(torch.float64), dim=-1).reshape(B, S, E)
        with torch.no_grad():
            top = torch.topk(probs, k, dim=-1).indices
            counts = torch.nn.functional.one_hot(top, E).sum(dim=(1, 2)).to(probs.dtype)
        total = total + (E / (k * S) * counts * probs.mean(dim=1)).sum(dim=-1).mean()
    return ALPHA * total


def by_mpipar_name(model) -> dict[str, np.ndarray]:
    """The model's parameters under mpipar's names (the fused experts split into w1, w3, w2)."""
    out = {}
    for name, p in model.named_parameters():
        value = p.detach().numpy()
        i = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):
            for e in range(E):
                w1, w3, _ = expert_names(i, e)
                out[w1], out[w3] = value[e, :FFN].copy(), value[e, FFN:].copy()
        elif name.endswith("experts.down_proj"):
            for e in range(E):
                out[expert_names(i, e)[2]] = value[e].copy()
        elif name.endswith(".mlp.gate.weight"):
            out[f"layers.{i}." + ROUTER] = value.copy()
        else:
            out[mpipar_name(name)] = value.copy()
    return out


def torch_training(path, rows):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                 attn_implementation="sdpa")
    model.config._experts_implementation = "eager"
    model.train()
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for p in named.values() if p.ndim >= 2],
                              "weight_decay": OPT["weight_decay"]},
                             {"params": [p for p in named.values() if p.ndim < 2],
                              "weight_decay": 0.0}],
                            lr=OPT["lr"], betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"])
    ce, aux, norms = [], [], []
    for k in range(STEPS):
        ids = rows[k * B:(k + 1) * B]
        opt.zero_grad()
        out = model(input_ids=ids[:, :S], output_router_logits=True)
        assert len(out.router_logits) == LAYERS - 1         # block 0 is dense
        loss, balance = hf_loss(out.logits, ids), balance_loss(out.router_logits, TOPK)
        (loss + balance).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["clip_grad"]).item())
        opt.step()
        ce.append(loss.item())
        aux.append(balance.item())
    return ce, aux, norms, by_mpipar_name(model)


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
    cfg = read_model_config(qwen_dir)
    cfg.moe_aux_loss_coef = ALPHA
    _, params = load_hf(qwen_dir)
    rows = np.random.default_rng(5).integers(0, V, size=(STEPS * B, S + 1))
    np.save(tmp_path / "rows.npy", rows)
    engine = mpipar_engine(cfg, params, tmp_path / "rows.npy")
    results = [engine.train_step(k) for k in range(STEPS)]
    trained = engine.gather_params()
    engine.close()
    ce, aux, norms, want = torch_training(qwen_dir, torch.from_numpy(rows))
    assert sorted(trained) == sorted(want)
    assert "layers.1.mlp.shared_expert_gate.weight" in want
    for r, c, a, n in zip(results, ce, aux, norms):
        assert abs(r.loss - c) <= TOL * c, (r.loss, c)
        assert abs(r.moe["moe_aux_loss"] - a) <= TOL * a, (r.moe["moe_aux_loss"], a)
        assert abs(r.grad_norm - n) <= TOL * n, (r.grad_norm, n)
    assert max(rel(v, want[n]) for n, v in trained.items()) <= TOL


def test_qwen2_moe_export_round_trip(qwen_dir, tmp_path):
    cfg = read_model_config(qwen_dir)
    _, params = load_hf(qwen_dir)
    save_hf(tmp_path / "out", cfg, params, dtype="float64")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2MoeForCausalLM"] and raw["num_experts"] == E
    assert raw["mlp_only_layers"] == [0] and raw["norm_topk_prob"] is cfg.moe_norm_topk
    _, again = load_hf(tmp_path / "out")
    for n, v in params.items():
        np.testing.assert_array_equal(again[n], v)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    got = by_mpipar_name(model)
    assert sorted(got) == sorted(params)
    for n, v in params.items():
        np.testing.assert_array_equal(got[n], v)
    aspects = {s.aspect: s for s in support(raw)[0]}
    assert "Qwen2-MoE experts: 4" in aspects["experts"].reading and not aspects["experts"].problem
