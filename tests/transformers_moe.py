"""The float64 transformers reference of the MoE checkpoint tests (Mixtral, Qwen2-MoE): the
sizes the two share (:data:`E` experts, top :data:`TOPK`, expert FFN :data:`FFN`, balance
coefficient :data:`ALPHA`, :data:`STEPS` AdamW steps), transformers' training with the objective
cross-entropy + DeepSeek-V3's sequence-wise balance loss computed from its router logits (as
mpipar defines it), and the two comparisons each model's test makes: training against
transformers, and the export read back by mpipar and by transformers.

transformers' float32 casts are removed as in ``transformers_reference.py``, plus the router's
softmax, redone in float64 (:func:`float64_moe`); experts run ``eager``. Importing this module
skips the importing test module where torch or transformers is missing."""
from __future__ import annotations

import numpy as np

from tests.transformers_reference import (B, OPT, PATCHES, S, TOL, V, hf_loss, mpipar_rank, rel,
                                          rmsnorm_own_dtype, rotary_float64, router_float64,
                                          torch, torch_adamw)
from transformers import AutoModelForCausalLM  # noqa: E402

from mpipar.checkpoint.huggingface import load_hf, mpipar_name, read_model_config, save_hf
from mpipar.model.params import ROUTER, expert_names
from mpipar.training import step as trainer

E, TOPK, FFN, ALPHA, STEPS = 4, 2, 24, 0.1, 2


def float64_moe(monkeypatch, rmsnorm, rotary, router, router_forward=router_float64) -> None:
    """Apply :data:`PATCHES` and the model's own ``rmsnorm``, ``rotary`` and ``router`` classes'
    float64 forwards (transformers' ``<Model>RMSNorm``, ``<Model>RotaryEmbedding``,
    ``<Model>TopKRouter``; the router's ``router_forward``, a softmax top-K's by default) for
    the test."""
    for owner, attr, replacement in PATCHES + [(rmsnorm, "forward", rmsnorm_own_dtype),
                                               (rotary, "forward", rotary_float64),
                                               (router, "forward", router_forward)]:
        monkeypatch.setattr(owner, attr, replacement)


def balance_loss(router_logits) -> "torch.Tensor":
    """ALPHA x mean over rows of the sum over sparse layers of sum_e f_e P_e (DeepSeek-V3),
    from each sparse layer's router logits ``[B*S, E]``."""
    total = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.to(torch.float64), dim=-1).reshape(B, S, E)
        with torch.no_grad():
            top = torch.topk(probs, TOPK, dim=-1).indices
            counts = torch.nn.functional.one_hot(top, E).sum(dim=(1, 2)).to(probs.dtype)
        total = total + (E / (TOPK * S) * counts * probs.mean(dim=1)).sum(dim=-1).mean()
    return ALPHA * total


def by_mpipar_name(model, experts: int = E, ffn: int = FFN, other=None) -> dict[str, np.ndarray]:
    """The model's parameters under mpipar's names: the fused experts (``experts`` of width
    ``ffn``) split into w1, w3, w2, the router (``mlp.gate`` in memory in transformers 5; the
    hub's ``block_sparse_moe.gate`` for Mixtral) as :data:`ROUTER`; ``other(name, layer)``:
    the mpipar name of any other tensor (default :func:`mpipar_name`)."""
    out = {}
    for name, p in model.named_parameters():
        value = p.detach().numpy()
        i = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):
            for e in range(experts):
                w1, w3, _ = expert_names(i, e)
                out[w1], out[w3] = value[e, :ffn].copy(), value[e, ffn:].copy()
        elif name.endswith("experts.down_proj"):
            for e in range(experts):
                out[expert_names(i, e)[2]] = value[e].copy()
        elif name.endswith(".mlp.gate.weight"):
            out[f"layers.{i}." + ROUTER] = value.copy()
        else:
            out[other(name, i) if other else mpipar_name(name)] = value.copy()
    return out


def torch_training(path, rows, sparse_layers: int):
    """transformers + torch.optim.AdamW on the checkpoint at ``path`` for STEPS steps of B rows
    of ``rows`` ``[STEPS * B, S + 1]`` in order, the objective cross-entropy + balance loss:
    (cross-entropies, balance losses, gradient norms, trained parameters by mpipar name).
    Call it with :func:`float64_moe` applied."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                 attn_implementation="sdpa")
    model.config._experts_implementation = "eager"
    model.train()
    opt = torch_adamw(model)
    ce, aux, norms = [], [], []
    for k in range(STEPS):
        ids = rows[k * B:(k + 1) * B]
        opt.zero_grad()
        out = model(input_ids=ids[:, :S], output_router_logits=True)
        assert len(out.router_logits) == sparse_layers
        loss, balance = hf_loss(out.logits, ids), balance_loss(out.router_logits)
        (loss + balance).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["clip_grad"]).item())
        opt.step()
        ce.append(loss.item())
        aux.append(balance.item())
    return ce, aux, norms, by_mpipar_name(model)


def assert_trains_as_transformers(path, tmp_path, sparse_layers: int) -> dict[str, np.ndarray]:
    """mpipar (one process) and transformers train the checkpoint at ``path`` STEPS steps on
    the same rows: losses, balance losses, gradient norms and trained weights equal to TOL
    (relative); returns transformers' trained weights by mpipar name."""
    cfg = read_model_config(path)
    cfg.moe_aux_loss_coef = ALPHA
    _, params = load_hf(path)
    rows = np.random.default_rng(5).integers(0, V, size=(STEPS * B, S + 1))
    np.save(tmp_path / "rows.npy", rows)
    rank = mpipar_rank(cfg, params, tmp_path / "rows.npy")
    results = [trainer.train_step(rank, k) for k in range(STEPS)]
    trained = trainer.gather_params(rank)
    trainer.close(rank)
    ce, aux, norms, want = torch_training(path, torch.from_numpy(rows), sparse_layers)
    assert sorted(trained) == sorted(want)
    for r, c, a, n in zip(results, ce, aux, norms):
        assert abs(r.loss - c) <= TOL * c, (r.loss, c)
        assert abs(r.moe["moe_aux_loss"] - a) <= TOL * a, (r.moe["moe_aux_loss"], a)
        assert abs(r.grad_norm - n) <= TOL * n, (r.grad_norm, n)
    assert max(rel(v, want[n]) for n, v in trained.items()) <= TOL
    return want


def assert_export_round_trip(path, out) -> dict[str, np.ndarray]:
    """mpipar exports the checkpoint at ``path`` to ``out`` (float64); mpipar reads back the
    same parameters, and so does transformers (returned by mpipar name)."""
    cfg = read_model_config(path)
    _, params = load_hf(path)
    save_hf(out, cfg, params, dtype="float64")
    _, again = load_hf(out)
    for n, v in params.items():
        np.testing.assert_array_equal(again[n], v)
    got = by_mpipar_name(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64))
    assert sorted(got) == sorted(params)
    for n, v in params.items():
        np.testing.assert_array_equal(got[n], v)
    return got
