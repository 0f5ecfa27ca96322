"""The float64 transformers reference of the DeepSeek-V3 tests: a tiny random
``DeepseekV3ForCausalLM`` (latent attention with a query latent, values narrower than queries,
layer 0 dense, 8 experts in 4 groups, top 3 in the best 2 groups, 2 shared experts, a routed
scale, non-zero selection biases), its float32 casts removed, its parameters under mpipar's
names, its training with AdamW and the grouped sigmoid router's balance loss (on scores
normalised over the experts, as mpipar defines it). Shared by the one-process and multi-rank
tests. transformers computes its RMSNorm, RoPE and router in float32 even for a float64 model,
and keeps the router's weight and bias in float32 when it loads a checkpoint: the patches here
redo them in float64 and :func:`hf_deepseek` casts the loaded router back from the file."""
from __future__ import annotations

import copy

import numpy as np

from tests.transformers_moe import by_mpipar_name as moe_by_mpipar_name, float64_moe
from tests.transformers_reference import OPT, torch, torch_adamw
from transformers import AutoModelForCausalLM, DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

from mpipar.checkpoint import hf_deepseek
from mpipar.checkpoint.huggingface import load_hf, mpipar_name
from mpipar.model.params import ROUTER, SHARED_DOWN, SHARED_GATE_UP

V, H, HEADS, LAYERS, S, B, STEPS, ALPHA = 64, 32, 4, 3, 12, 2, 2, 0.1
E, TOPK, FFN, GROUPS, TOPK_GROUPS, SCALE = 8, 3, 16, 4, 2, 2.5
SIZES = dict(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
             num_key_value_heads=HEADS, kv_lora_rank=12, qk_rope_head_dim=4,
             qk_nope_head_dim=8, v_head_dim=6, n_routed_experts=E, n_group=GROUPS,
             topk_group=TOPK_GROUPS, num_experts_per_tok=TOPK, first_k_dense_replace=1,
             moe_intermediate_size=FFN, intermediate_size=40, n_shared_experts=2,
             routed_scaling_factor=SCALE, rms_norm_eps=1e-6, tie_word_embeddings=False)


def router_float64(self, hidden_states):
    """``DeepseekV3TopkRouter.forward`` in the weight's dtype (not ``float32``)."""
    logits = torch.nn.functional.linear(hidden_states.view(-1, self.hidden_dim), self.weight)
    scores = logits.sigmoid()
    index = grouped_topk(scores + self.e_score_correction_bias, self)
    weights = scores.gather(1, index)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, index


def grouped_topk(choice, router):
    """transformers' choice of experts within the best groups (its code, any dtype)."""
    n, g = router.num_experts, router.num_group
    group_scores = choice.view(-1, g, n // g).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, g, n // g).reshape(-1, n)
    return torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), k=router.top_k,
                      dim=-1, sorted=False)[1]


def float64_deepseek(monkeypatch) -> None:
    """transformers' DeepSeek-V3 in float64 throughout (norms, RoPE, the grouped router)."""
    float64_moe(monkeypatch, hf_ds.DeepseekV3RMSNorm, hf_ds.DeepseekV3RotaryEmbedding,
                hf_ds.DeepseekV3TopkRouter, router_float64)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
        "original_max_position_embeddings": 4096}
"""DeepSeek-V3's yarn fields with a pretraining context of 4096: of the 2 frequencies of the rope
width 4 one is kept and one blended; mscale differs from mscale_all_dim, so the tables carry an
attention factor other than 1 and the softmax scale a factor (0.1 * 0.8 ln 4 + 1)^2."""


def random_model(q_lora_rank: int | None = 16, **fields):
    """The random float64 model (seed 0), router weights and selection biases included;
    ``fields``: more config fields."""
    torch.manual_seed(0)
    cfg = DeepseekV3Config(q_lora_rank=q_lora_rank, **SIZES, **fields)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(torch.float64)
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 if name.endswith("norm.weight") else 0)
                    + (0.1 if p.ndim == 1 else 0.15) * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


def loaded(path):
    """transformers' model read from ``path``, its float32-kept router weights and biases
    replaced by the file's float64 values (by mpipar's reading)."""
    from mpipar.checkpoint.huggingface import load_selection_biases
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                 attn_implementation="sdpa").to(torch.float64)
    model.config._experts_implementation = "eager"
    _, params = load_hf(path)
    with torch.no_grad():
        for i, bias in load_selection_biases(path).items():
            gate = model.model.layers[i].mlp.gate
            gate.weight.copy_(torch.from_numpy(params[f"layers.{i}." + ROUTER]))
            gate.e_score_correction_bias.copy_(torch.from_numpy(bias))
    return model


def by_mpipar_name(model) -> dict[str, np.ndarray]:
    """The model's parameters under mpipar's names and in its layout (fused experts split, the
    shared experts renamed, rope rows from interleaved pairs to halves)."""
    shared = dict(zip(("gate_proj", "up_proj", "down_proj"), SHARED_GATE_UP + SHARED_DOWN))

    def other(name: str, i: int | None) -> str:
        if ".shared_experts." in name:
            return f"layers.{i}." + shared[name.split(".")[-2]]
        return mpipar_name(name)

    out = moe_by_mpipar_name(model, E, FFN, other)
    from mpipar.checkpoint.huggingface import model_config_from_hf
    cfg = model_config_from_hf(model.config.to_dict())
    return hf_deepseek.from_hub(cfg, {"rope_interleave": True}, out)


def balance_loss(router_logits, routers) -> "torch.Tensor":
    """ALPHA x mean over rows of the sum over sparse layers of sum_e f_e P_e, P from the sigmoid
    scores normalised over the experts, f from the grouped choice (with the biases)."""
    total = 0.0
    for logits, router in zip(router_logits, routers):
        scores = logits.sigmoid()
        with torch.no_grad():
            index = grouped_topk(scores + router.e_score_correction_bias, router)
            counts = torch.nn.functional.one_hot(index, E).reshape(B, S * TOPK, E).sum(1).to(
                scores.dtype)
        p = (scores / scores.sum(dim=-1, keepdim=True)).reshape(B, S, E)
        total = total + (E / (TOPK * S) * counts * p.mean(dim=1)).sum(dim=-1).mean()
    return ALPHA * total


def torch_training(model, rows):
    """transformers + AdamW (clipping) on a copy of ``model`` for STEPS steps of B rows of
    ``rows`` ``[STEPS * B, S + 1]``: (cross-entropies, balance losses, gradient norms, trained
    parameters by mpipar name). Call it with :func:`float64_deepseek` applied."""
    model = copy.deepcopy(model)
    model.train()
    opt = torch_adamw(model)
    routers = [layer.mlp.gate for layer in model.model.layers[1:]]
    ce, aux, norms = [], [], []
    for k in range(STEPS):
        ids = torch.from_numpy(rows[k * B:(k + 1) * B])
        opt.zero_grad()
        out = model(input_ids=ids[:, :S], output_router_logits=True)
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V),
                                                 ids[:, 1:].reshape(-1))
        balance = balance_loss(out.router_logits, routers)
        (loss + balance).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["clip_grad"]).item())
        opt.step()
        ce.append(loss.item())
        aux.append(balance.item())
    return ce, aux, norms, by_mpipar_name(model)
